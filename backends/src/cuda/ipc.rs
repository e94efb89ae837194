//! Device memory shared with another process (CUDA IPC): [`CudaPool::export`] gives a block's [`IpcHandle`], a
//! few bytes to send by any means (a pipe, a socket, a file); the other process opens it with
//! [`ImportedMemory::open`] and reads and writes the same device memory.
//!
//! A handle names the driver allocation that holds the block (a plain segment, made with `cuMemAlloc`) and the
//! block's place in it; a receiver maps the whole segment once however many of its blocks arrive. Blocks in a
//! virtual reservation (`cuMemMap`) have no such handle and are refused: make the pool with
//! `SegmentMode::Plain` to share every block. The exporting process keeps the block live while the other uses
//! it: umm cannot see another process's uses.

#![allow(unsafe_code)] // Discharges the raw layer's copy and close contracts.

use super::{raw, CudaDevice, CudaPool};
use crate::{Backend, BlockHandle, Error, Result};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// What another process needs to open a block: the driver's handle of its segment, and where the block lies in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle {
    /// `cuIpcGetMemHandle` of the segment.
    pub handle: [u8; 64],
    /// The block's offset in the segment.
    pub offset: u64,
    /// The block's length in bytes.
    pub len: u64,
}

impl IpcHandle {
    /// Bytes of [`IpcHandle::to_bytes`].
    pub const BYTES: usize = 80;

    /// The handle as 80 bytes: the driver's handle, then offset and length little-endian.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0; Self::BYTES];
        out[..64].copy_from_slice(&self.handle);
        out[64..72].copy_from_slice(&self.offset.to_le_bytes());
        out[72..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// The handle from [`IpcHandle::to_bytes`]; an error for any other length.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != Self::BYTES {
            return Err(Error::InvalidConfig(format!("an IPC handle is {} bytes, not {}", Self::BYTES, bytes.len())));
        }
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let mut handle = [0; 64];
        handle.copy_from_slice(&bytes[..64]);
        Ok(IpcHandle { handle, offset: word(64), len: word(72) })
    }
}

impl CudaPool {
    /// The handle another process opens to reach `block` ([`ImportedMemory::open`]). Errors for a block that is
    /// not live in this pool, and [`Error::Unsupported`] for one in a virtual reservation or in pinned host memory.
    pub fn export(&self, block: &BlockHandle) -> Result<IpcHandle> {
        let backend = self.pool().backend();
        let (segment, offset) = self
            .pool()
            .segment_of(block)
            .ok_or_else(|| Error::UnknownBlock(format!("{block:?} in pool {}", backend.name())))?;
        if segment.pages.is_some() || segment.host_addr.is_some() {
            return Err(Error::Unsupported {
                backend: backend.name().to_string(),
                what: "sharing a block of a virtual reservation or of pinned host memory with another process (CUDA \
                       IPC handles reach cuMemAlloc allocations only; make the pool with SegmentMode::Plain)"
                    .into(),
            });
        }
        backend.bind()?;
        let handle = raw::ipc_get_mem_handle(segment.device_ptr).map_err(|f| backend.error(f))?;
        Ok(IpcHandle { handle, offset, len: block.size() })
    }
}

/// Another process's block mapped into this one ([`ImportedMemory::open`]); unmapped on drop.
pub struct ImportedMemory {
    context: Arc<CudaContext>,
    /// Where the other process's segment is mapped here.
    base: u64,
    handle: IpcHandle,
}

impl ImportedMemory {
    /// Maps the block of `handle` on `device` (the device the exporting process allocated it on).
    pub fn open(device: &CudaDevice, handle: &IpcHandle) -> Result<Self> {
        let context = Arc::clone(device.context());
        let driver_error = |f: raw::Failure| Error::Driver {
            backend: device.info().name.clone(),
            call: f.call.into(),
            message: f.message(),
        };
        context.bind_to_thread().map_err(|e| Error::Driver {
            backend: device.info().name.clone(),
            call: "cuCtxSetCurrent".into(),
            message: e.to_string(),
        })?;
        let base = raw::ipc_open_mem_handle(&handle.handle).map_err(driver_error)?;
        Ok(ImportedMemory { context, base, handle: *handle })
    }

    /// The block's device address in this process.
    pub fn device_ptr(&self) -> u64 {
        self.base + self.handle.offset
    }

    /// The block's length in bytes.
    pub fn len(&self) -> u64 {
        self.handle.len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.handle.len == 0
    }

    fn check(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.handle.len => Ok(()),
            _ => Err(Error::OutOfBounds(format!(
                "{len} bytes at offset {offset} of an imported block of {} bytes",
                self.handle.len
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

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: `base` came from `ipc_open_mem_handle` and is closed once, here; reads and writes through
            // `self` waited for their copies.
            if let Err(f) = unsafe { raw::ipc_close_mem_handle(self.base) } {
                log::warn!("closing imported CUDA memory failed: {}", f.message());
            }
        }
    }
}
