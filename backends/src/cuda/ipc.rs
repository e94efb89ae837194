//! Device memory shared with another process: [`CudaPool::export`] gives a block's [`IpcHandle`], whose bytes
//! ([`IpcHandle::to_bytes`]) are sent by any means (a pipe, a socket, a file); the other process opens them with
//! [`ImportedMemory::open`] and reads and writes the same device memory.
//!
//! Two kinds of handle, after the two kinds of segment:
//! - A block of a plain segment (`cuMemAlloc`): the driver's IPC handle of the segment (`cuIpcGetMemHandle`)
//!   and the block's place in it. The receiver maps the whole segment.
//! - A block of a virtual reservation: the physical pages under it, each exported as a POSIX file descriptor
//!   (`cuMemExportToShareableHandle`). The receiver copies the descriptors out of the exporting process
//!   (`pidfd_getfd`, Linux 5.6; allowed where it may trace that process: the same user, and under Yama's
//!   `ptrace_scope` 1 an ancestor), imports them and maps the pages side by side, once, in an address range of
//!   its own. This is what PyTorch's expandable segments do. The descriptors stay open while the
//!   [`IpcHandle`] lives: keep it until the other process has opened it.
//!
//! The exporting process keeps the block live while the other uses it: umm cannot see another process's uses.

#![allow(unsafe_code)] // Discharges the raw layer's copy, map and release contracts.

use super::{raw, CudaDevice, CudaPool};
use crate::{Backend, BlockHandle, Error, Result};
use cudarc::driver::CudaContext;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

/// What another process needs to open a block ([`CudaPool::export`]).
#[derive(Debug)]
pub struct IpcHandle {
    /// The block's offset in what the handle maps (its segment, or its first page).
    offset: u64,
    /// The block's length in bytes.
    len: u64,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// `cuIpcGetMemHandle` of a plain segment.
    Segment([u8; 64]),
    /// The pages under a block of a virtual reservation, exported as descriptors of process `pid`.
    Pages { pid: u32, page: u64, fds: Vec<OwnedFd> },
}

/// First byte of a handle's bytes: a plain segment's (as PyTorch's handles mark a `cudaMalloc` allocation).
const SEGMENT: u8 = b'c';
/// First byte of a handle's bytes: pages of a virtual reservation (PyTorch's mark of an expandable segment).
const PAGES: u8 = b'e';
/// The most pages one handle names: 2^20 pages of at least 2 MiB is 2 PiB, past any device.
const MAX_PAGES: u64 = 1 << 20;

impl IpcHandle {
    /// The block's offset in what the handle maps: its segment, or its first page.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The block's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the block is empty (never: blocks have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// For a handle of pages: the page size and the descriptors of the pages, in address order (open while the
    /// handle lives).
    pub fn pages(&self) -> Option<(u64, &[OwnedFd])> {
        match &self.kind {
            Kind::Pages { page, fds, .. } => Some((*page, fds)),
            Kind::Segment(_) => None,
        }
    }

    /// Whether the handle names pages of a virtual reservation (descriptors the receiver copies out of this
    /// process), rather than a plain segment.
    pub fn is_pages(&self) -> bool {
        matches!(self.kind, Kind::Pages { .. })
    }

    /// The bytes to send: `c`, the segment's 64-byte handle, offset and length; or `e`, the process id, page
    /// size, page count, offset, length and one descriptor number per page. Integers little-endian.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match &self.kind {
            Kind::Segment(handle) => {
                out.push(SEGMENT);
                out.extend_from_slice(handle);
            }
            Kind::Pages { pid, page, fds } => {
                out.push(PAGES);
                out.extend_from_slice(&pid.to_le_bytes());
                out.extend_from_slice(&page.to_le_bytes());
                out.extend_from_slice(&(fds.len() as u64).to_le_bytes());
            }
        }
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        if let Kind::Pages { fds, .. } = &self.kind {
            for fd in fds {
                out.extend_from_slice(&fd.as_raw_fd().to_le_bytes());
            }
        }
        out
    }
}

/// A handle's bytes read back ([`Received::parse`]): what [`ImportedMemory::open`] maps.
#[derive(Debug, PartialEq, Eq)]
enum Received {
    Segment { handle: [u8; 64], offset: u64, len: u64 },
    Pages { pid: u32, page: u64, fds: Vec<i32>, offset: u64, len: u64 },
}

impl Received {
    /// Reads [`IpcHandle::to_bytes`]'s bytes; an error names what is wrong with any other bytes.
    fn parse(bytes: &[u8]) -> Result<Self> {
        let bad = |why: String| Error::InvalidConfig(format!("not an IPC handle of umm: {why}"));
        let mut at = 1;
        let mut take = |n: usize| -> Result<&[u8]> {
            let piece = bytes.get(at..at + n).ok_or_else(|| bad(format!("{} bytes end early", bytes.len())))?;
            at += n;
            Ok(piece)
        };
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let parsed = match bytes.first() {
            Some(&SEGMENT) => {
                let handle: [u8; 64] = take(64)?.try_into().expect("64 bytes");
                let (offset, len) = (word(take(8)?), word(take(8)?));
                Received::Segment { handle, offset, len }
            }
            Some(&PAGES) => {
                let pid = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
                let (page, count) = (word(take(8)?), word(take(8)?));
                let (offset, len) = (word(take(8)?), word(take(8)?));
                if !page.is_power_of_two() || count == 0 || count > MAX_PAGES {
                    return Err(bad(format!("{count} pages of {page} bytes")));
                }
                if offset.checked_add(len).is_none_or(|end| end > count * page) || offset >= page {
                    return Err(bad(format!("{len} bytes at {offset} of {count} pages of {page} bytes")));
                }
                let fds = (0..count)
                    .map(|_| take(4).map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes"))))
                    .collect::<Result<Vec<_>>>()?;
                Received::Pages { pid, page, fds, offset, len }
            }
            Some(other) => return Err(bad(format!("its first byte is {other:#04x}, not 'c' or 'e'"))),
            None => return Err(bad("it is empty".into())),
        };
        if at != bytes.len() {
            return Err(bad(format!("{} bytes where {at} were expected", bytes.len())));
        }
        Ok(parsed)
    }
}

impl CudaPool {
    /// The handle another process opens to reach `block` ([`ImportedMemory::open`]). Errors for a block that is
    /// not live in this pool, and [`Error::Unsupported`] for one in pinned host memory or on pages the driver
    /// would not make shareable here (then a pool with `SegmentMode::Plain` shares its blocks).
    pub fn export(&self, block: &BlockHandle) -> Result<IpcHandle> {
        let backend = self.pool().backend();
        let (segment, offset) = self
            .pool()
            .segment_of(block)
            .ok_or_else(|| Error::UnknownBlock(format!("{block:?} in pool {}", backend.name())))?;
        let unsupported = |what: String| Error::Unsupported { backend: backend.name().to_string(), what };
        if segment.host_addr.is_some() {
            return Err(unsupported("sharing a block of pinned host memory with another process".into()));
        }
        backend.bind()?;
        let len = block.size();
        let (Some(pages), Some(vm)) = (&segment.pages, backend.vmm) else {
            let handle = raw::ipc_get_mem_handle(segment.device_ptr).map_err(|f| backend.error(f))?;
            return Ok(IpcHandle { offset, len, kind: Kind::Segment(handle) });
        };
        let page = vm.page_size;
        let (first, end) = (offset / page, (offset + len).div_ceil(page));
        let table = pages.lock();
        let mut fds = Vec::with_capacity((end - first) as usize);
        for i in first..end {
            let handle = table[i as usize];
            if handle == 0 {
                return Err(Error::InvalidConfig(format!(
                    "page {i} under a live block of {} is unmapped",
                    backend.name()
                )));
            }
            fds.push(raw::export_posix_fd(handle).map_err(|f| match f.refuses_sharing() {
                true => unsupported(format!(
                    "sharing a block of a virtual reservation: the driver refused to export its pages ({}); \
                     pages are made shareable where the driver allows it, else make the pool with \
                     SegmentMode::Plain",
                    f.message()
                )),
                false => backend.error(f),
            })?);
        }
        let kind = Kind::Pages { pid: std::process::id(), page, fds };
        Ok(IpcHandle { offset: offset - first * page, len, kind })
    }

    /// Maps a block another process exported ([`IpcHandle::to_bytes`]'s bytes) on this pool's device, as
    /// [`ImportedMemory::open`] does.
    pub fn import(&self, bytes: &[u8]) -> Result<ImportedMemory> {
        let backend = self.pool().backend();
        ImportedMemory::open_in(backend.context(), backend.ordinal, backend.name(), bytes)
    }
}

/// Another process's block mapped into this one ([`ImportedMemory::open`]); unmapped on drop.
pub struct ImportedMemory {
    context: Arc<CudaContext>,
    /// Where what the handle names (the segment, or the first page) is mapped here.
    base: u64,
    offset: u64,
    len: u64,
    /// For pages: the reservation's length and page, and the imported allocations mapped in it.
    pages: Option<(u64, u64, Vec<u64>)>,
}

impl ImportedMemory {
    /// Maps the block whose handle's bytes ([`IpcHandle::to_bytes`]) are `bytes` on `device` (the device the
    /// exporting process allocated it on). Bytes of no handle are refused before any driver call.
    pub fn open(device: &CudaDevice, bytes: &[u8]) -> Result<Self> {
        Self::open_in(device.context(), device.info().ordinal as i32, &device.info().name, bytes)
    }

    fn open_in(context: &Arc<CudaContext>, ordinal: i32, name: &str, bytes: &[u8]) -> Result<Self> {
        let received = Received::parse(bytes)?;
        let context = Arc::clone(context);
        let driver_error =
            |f: raw::Failure| Error::Driver { backend: name.to_string(), call: f.call.into(), message: f.message() };
        context.bind_to_thread().map_err(|e| Error::Driver {
            backend: name.to_string(),
            call: "cuCtxSetCurrent".into(),
            message: e.to_string(),
        })?;
        match received {
            Received::Segment { handle, offset, len } => {
                let base = raw::ipc_open_mem_handle(&handle).map_err(driver_error)?;
                Ok(ImportedMemory { context, base, offset, len, pages: None })
            }
            Received::Pages { pid, page, fds, offset, len } => {
                let os_error = |call: &str, e: std::io::Error| Error::Driver {
                    backend: name.to_string(),
                    call: call.into(),
                    message: format!("{e} (copying the page descriptors of process {pid}, which exported them)"),
                };
                let pidfd = raw::pidfd_open(pid).map_err(|e| os_error("pidfd_open", e))?;
                let mut handles = Vec::with_capacity(fds.len());
                let imported = fds.iter().try_for_each(|&fd| {
                    let local = raw::pidfd_getfd(pidfd.as_fd(), fd).map_err(|e| os_error("pidfd_getfd", e))?;
                    handles.push(raw::import_posix_fd(local.as_fd()).map_err(driver_error)?);
                    Ok(())
                });
                let mapped = imported.and_then(|()| map_side_by_side(&handles, page, ordinal).map_err(driver_error));
                match mapped {
                    Ok(base) => {
                        let pages = Some((page * handles.len() as u64, page, handles));
                        Ok(ImportedMemory { context, base, offset, len, pages })
                    }
                    Err(e) => {
                        for h in handles {
                            // SAFETY: each handle holds the one reference its import made, unmapped (the mapping
                            // undid itself on failure), released once here.
                            let _ = unsafe { raw::mem_release(h) };
                        }
                        Err(e)
                    }
                }
            }
        }
    }

    /// The block's device address in this process.
    pub fn device_ptr(&self) -> u64 {
        self.base + self.offset
    }

    /// The block's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds(format!(
                "{len} bytes at offset {offset} of an imported block of {} bytes",
                self.len
            ))),
        }
    }

    fn bind(&self) -> Result<()> {
        self.context.bind_to_thread().map_err(|e| Error::Driver {
            backend: "imported CUDA memory".into(),
            call: "cuCtxSetCurrent".into(),
            message: e.to_string(),
        })
    }

    /// Copies `dst.len()` bytes at `offset` of the block into `dst` (waits for the copy).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        self.bind()?;
        // SAFETY: the range was checked against the block, which stays mapped while `self` lives.
        unsafe { raw::copy_dtoh(dst, self.device_ptr() + offset) }.map_err(|f| self.error(f))
    }

    /// Copies `src` to `offset` of the block (waits for the copy).
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.bind()?;
        // SAFETY: as in `read`.
        unsafe { raw::copy_htod(self.device_ptr() + offset, src) }.map_err(|f| self.error(f))
    }

    fn error(&self, f: raw::Failure) -> Error {
        Error::Driver { backend: "imported CUDA memory".into(), call: f.call.into(), message: f.message() }
    }
}

/// Reserves an address range for `handles` (imported allocations of `page` bytes each), maps them side by side
/// and grants `ordinal` access; returns the range's start. On failure nothing stays mapped or reserved.
fn map_side_by_side(handles: &[u64], page: u64, ordinal: i32) -> raw::Raw<u64> {
    let span = page * handles.len() as u64;
    let base = raw::address_reserve(span, page)?;
    let mut mapped = 0;
    let mut result = Ok(());
    for (i, &h) in handles.iter().enumerate() {
        // SAFETY: the page at `base + i * page` lies inside the reservation just made and is not mapped yet; `h`
        // is a live imported allocation, not released. A size that is not the allocation's is refused by the
        // driver.
        result = unsafe { raw::mem_map(base + i as u64 * page, page, h) };
        if result.is_err() {
            break;
        }
        mapped += 1;
    }
    let result = result.and_then(|()| raw::set_access(base, span, &[ordinal]));
    if result.is_err() {
        for i in 0..mapped {
            // SAFETY: page `i` was mapped just above and nothing used it.
            let _ = unsafe { raw::mem_unmap(base + i * page, page) };
        }
        // SAFETY: the reservation was made above and nothing is mapped in it any more.
        let _ = unsafe { raw::address_free(base, span) };
    }
    result.map(|()| base)
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // Kernels a caller launched on the memory (the C ABI hands out its address) finish before it goes.
        if let Err(f) = raw::ctx_synchronize() {
            log::warn!("closing imported CUDA memory: synchronizing first failed: {}", f.message());
        }
        let result = match self.pages.take() {
            // SAFETY: `base` came from `ipc_open_mem_handle` and is closed once, here, after the context's work
            // (synchronized above).
            None => unsafe { raw::ipc_close_mem_handle(self.base) },
            Some((span, page, handles)) => {
                let mut result = Ok(());
                for (i, h) in handles.into_iter().enumerate() {
                    let at = self.base + i as u64 * page;
                    // SAFETY: page `i` was mapped by `map_side_by_side` and is unmapped once, here, after the
                    // context's work (synchronized above). Its handle holds the reference the import made,
                    // released once after the unmap.
                    result = result.and(unsafe { raw::mem_unmap(at, page) }).and(unsafe { raw::mem_release(h) });
                }
                // SAFETY: the reservation from `map_side_by_side`, with every page unmapped above, freed once.
                result.and(unsafe { raw::address_free(self.base, span) })
            }
        };
        if let Err(f) = result {
            log::warn!("closing imported CUDA memory failed: {}", f.message());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages_handle(fds: usize) -> IpcHandle {
        let fds = (0..fds).map(|_| std::fs::File::open("/dev/null").unwrap().into()).collect();
        IpcHandle { offset: 4096, len: (3 << 20) - 4096, kind: Kind::Pages { pid: 42, page: 2 << 20, fds } }
    }

    /// Both kinds read back as written; bytes of no handle are refused with what is wrong, before any driver call.
    #[test]
    fn handles_read_back_and_bad_bytes_are_refused() {
        let segment = IpcHandle { offset: 512, len: 1024, kind: Kind::Segment([7; 64]) };
        assert_eq!(segment.to_bytes().len(), 81);
        assert_eq!(
            Received::parse(&segment.to_bytes()).unwrap(),
            Received::Segment { handle: [7; 64], offset: 512, len: 1024 }
        );
        let pages = pages_handle(2);
        let bytes = pages.to_bytes();
        match Received::parse(&bytes).unwrap() {
            Received::Pages { pid, page, fds, offset, len } => {
                assert_eq!((pid, page, offset, len), (42, 2 << 20, 4096, (3 << 20) - 4096));
                assert_eq!(fds.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        let refused = |bytes: &[u8], why: &str| {
            let err = Received::parse(bytes).unwrap_err().to_string();
            assert!(err.contains("not an IPC handle") && err.contains(why), "{why}: {err}");
        };
        refused(&[], "empty");
        refused(&[b'x'; 81], "first byte");
        refused(&bytes[..bytes.len() - 1], "end early");
        refused(&[bytes.clone(), vec![0]].concat(), "were expected");
        let mut odd_page = bytes.clone();
        odd_page[5..13].copy_from_slice(&(3u64 << 20).to_le_bytes());
        refused(&odd_page, "pages of");
        let mut past_end = bytes.clone();
        past_end[29..37].copy_from_slice(&(8u64 << 20).to_le_bytes());
        refused(&past_end, "bytes at");
    }
}
