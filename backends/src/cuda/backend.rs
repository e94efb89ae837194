//! `CudaBackend`: segments of device memory (cuMemAlloc, or address reservations mapped page by page with
//! cuMemCreate/cuMemMap), of pinned host memory (cuMemHostAlloc), or of read-only device memory.
//!
//! Synchronisation rules (why the calls below synchronize where they do):
//! - A segment is destroyed only after `cuCtxSynchronize`, and pages are unmapped only after their arena's
//!   stream has passed its work (`cuStreamSynchronize`; the context when the stream is no longer live): a block
//!   freed on a stream may still be used by work queued on it before the free. Unmapping does not wait for the
//!   other streams: a pool under a limit that moves pages does not stall work it has no part in.
//! - The blocking byte moves of [`Backend::write`], [`Backend::read`] and [`Backend::fill`] on device memory
//!   wait for all work queued in the context first and for their own copy afterwards, so they are ordered with
//!   every stream (the streams the pool hands out blocks on are usually non-blocking ones). Stream-ordered copies
//!   are in [`super::CudaPool`] and [`super::CudaBuffer`].
//! - Pinned memory is host memory: reads and writes are plain host copies and do not wait for the device.

use super::raw::{self, Failure};
use crate::adopt::{Adoption, Keeper, Ownership};
use crate::HostPtr;
use crate::{Api, Backend, DevicePath, Error, PoolKind, Result, StreamId, VirtualMemory};
use cudarc::driver::{CudaContext, CudaEvent};
use parking_lot::Mutex;
use std::sync::Arc;

/// One segment: a device range (plain or a virtual reservation) or a pinned host allocation.
#[derive(Debug, Clone)]
pub struct CudaSegment {
    /// Device address of the first byte (for pinned memory, the device-mapped address).
    pub(super) device_ptr: u64,
    /// Length in bytes.
    pub(super) size: u64,
    /// Host address of the first byte for pinned memory.
    pub(super) host_addr: Option<usize>,
    /// For a virtual reservation: the allocation handle mapped at each page (0 where none).
    pub(super) pages: Option<Arc<Mutex<Vec<u64>>>>,
}

impl CudaSegment {
    /// Device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    /// Length in bytes (for a reservation, its address span).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether this is a virtual reservation mapped page by page.
    pub fn is_virtual(&self) -> bool {
        self.pages.is_some()
    }
}

/// The backend of one pool of one CUDA device. Holds the device's shared context.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    pub(super) ordinal: i32,
    pub(super) name: String,
    placement: PoolKind,
    capacity: u64,
    /// Page size of virtual memory management, when the device supports it and the placement uses device memory.
    pub(super) vmm: Option<VirtualMemory>,
    /// What plain segments round to: the device's own page even when reservations map larger pages.
    granularity: u64,
    /// Physical pages unmapped during the current pool operation, kept for its next mapping: moving a page
    /// costs cuMemUnmap + cuMemMap, while freeing and creating one adds cuMemRelease + cuMemCreate.
    pub(super) spare_pages: Mutex<Vec<u64>>,
    /// Whether new pages are made shareable with other processes (POSIX file descriptors, see `ipc.rs`): until
    /// the driver first refuses it, as some containers do.
    pub(super) shareable_pages: std::sync::atomic::AtomicBool,
    /// Stream marks (events) the pool recorded to share free memory across streams.
    pub(super) marks: Mutex<Marks>,
    /// The devices granted access to mapped pages: this one, then every device that can reach its memory as a
    /// peer. A reservation's pages are reachable only from the devices `cuMemSetAccess` names, so without the
    /// peers a GPU→GPU copy from virtual segments would be staged by the driver (a tenth of NVLink's speed).
    pub(super) access: Vec<i32>,
    /// For the backend of an adopted allocation: that allocation (see [`crate::adopt`]).
    adoption: Option<Adoption<CudaSegment>>,
}

/// The backend's stream marks (see `marks.rs`): recorded events by id, and spare ones.
#[derive(Default)]
pub(super) struct Marks {
    pub(super) recorded: Vec<Option<CudaEvent>>,
    pub(super) free_ids: Vec<usize>,
    pub(super) spare: Vec<CudaEvent>,
}

impl std::fmt::Debug for Marks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let live = self.recorded.iter().flatten().count();
        f.debug_struct("Marks").field("live", &live).field("spare", &self.spare.len()).finish()
    }
}

impl CudaBackend {
    /// Block alignment: what cuMemAlloc guarantees at least (PyTorch's allocator rounds to 512; see
    /// `PoolConfig::alignment`).
    pub const ALIGNMENT: u64 = 256;
    /// Segment granularity of device memory when the driver does not report one (2 MiB, the GPU's large page).
    pub const DEVICE_GRANULARITY: u64 = 2 << 20;
    /// Segment granularity of pinned host memory (a host page).
    pub const HOST_GRANULARITY: u64 = 4096;

    pub(super) fn new(
        ctx: Arc<CudaContext>,
        device_name: &str,
        placement: PoolKind,
        device_memory: u64,
        vmm_page: Option<u64>,
        peers: &[i32],
    ) -> Self {
        let placement = placement.on_device();
        let ordinal = ctx.ordinal() as i32;
        let capacity = match placement {
            PoolKind::HostPinned => crate::host::host_memory().map_or(device_memory, |(total, _)| total),
            _ => device_memory,
        };
        let vmm = match (placement, vmm_page) {
            (PoolKind::HostPinned, _) | (_, None) => None,
            (_, Some(page)) => {
                Some(VirtualMemory { page_size: page, max_reservation: device_memory.div_ceil(page) * page })
            }
        };
        let granularity = match (placement, vmm) {
            (PoolKind::HostPinned, _) => Self::HOST_GRANULARITY,
            (_, Some(vm)) => vm.page_size,
            _ => Self::DEVICE_GRANULARITY,
        };
        Self {
            ctx,
            ordinal,
            name: format!("cuda:{ordinal} {placement} ({device_name})"),
            placement,
            capacity,
            vmm,
            granularity,
            spare_pages: Mutex::new(Vec::new()),
            shareable_pages: std::sync::atomic::AtomicBool::new(true),
            marks: Mutex::new(Marks::default()),
            access: std::iter::once(ordinal).chain(peers.iter().copied().filter(|&p| p != ordinal)).collect(),
            adoption: None,
        }
    }

    /// This device-memory backend turned into the backend of a pool holding one adopted allocation of `size`
    /// bytes at `device_ptr` (alignment 1: the block spans the allocation exactly; no virtual memory).
    pub(super) fn adopting(mut self, device_ptr: u64, size: u64, keeper: Option<Keeper>, ownership: Ownership) -> Self {
        let segment = CudaSegment { device_ptr, size, host_addr: None, pages: None };
        self.name = format!("cuda:{} adopted", self.ordinal);
        self.vmm = None;
        self.granularity = 1;
        self.adoption = Some(Adoption::new(segment, keeper, ownership));
        self
    }

    /// The device's context (shared by all pools of the device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `stream` as a live stream of this device's context, or an error saying why it is not one.
    pub(super) fn live_stream(&self, stream: crate::StreamId) -> Result<raw::stream_ids::LiveStream> {
        raw::stream_ids::live(stream, self.ctx.cu_ctx(), &self.name)
    }

    /// Which placement this backend's pool serves.
    pub fn placement(&self) -> PoolKind {
        self.placement
    }

    pub(super) fn error(&self, failure: Failure) -> Error {
        Error::Driver { backend: self.name.clone(), call: failure.call.into(), message: failure.message() }
    }

    /// Makes the context current on this thread.
    pub(super) fn bind(&self) -> Result<()> {
        super::scope::before_bind();
        self.ctx.bind_to_thread().map_err(|e| Error::Driver {
            backend: self.name.clone(),
            call: "cuCtxSetCurrent".into(),
            message: e.to_string(),
        })
    }

    /// Waits for the work queued on `stream`: that stream alone when it is live (cuMemUnmap itself does not wait
    /// for other streams, so their work runs on), else the whole context (a dropped stream may still have work
    /// in flight, which only the context's synchronisation waits for).
    pub(super) fn wait_for_stream(&self, stream: StreamId) -> Result<()> {
        match self.live_stream(stream) {
            Ok(live) => {
                self.bind()?;
                raw::stream_synchronize(&live).map_err(|f| self.error(f))
            }
            Err(_) => self.synchronize(),
        }
    }

    /// Binds the context and waits for all its work.
    pub(super) fn synchronize(&self) -> Result<()> {
        self.bind()?;
        raw::ctx_synchronize().map_err(|f| self.error(f))
    }

    pub(super) fn check(&self, segment: &CudaSegment, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= segment.size => Ok(()),
            _ => Err(Error::OutOfBounds(format!(
                "{len} bytes at offset {offset} in a segment of {} bytes of {}",
                segment.size, self.name
            ))),
        }
    }

    fn refuse_read_only(&self, what: &str) -> Result<()> {
        if self.placement == PoolKind::ReadOnly {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: format!("{what}: read-only memory is filled once, when it is allocated"),
            });
        }
        Ok(())
    }

    /// Blocking copy of `src` into a device segment, ignoring the read-only rule (used to fill read-only blocks
    /// at allocation). Ordered with every stream.
    #[allow(unsafe_code)] // Discharges `raw::host_copy_in`'s and `raw::copy_htod`'s contracts.
    pub(super) fn write_device(&self, segment: &CudaSegment, offset: u64, src: &[u8]) -> Result<()> {
        self.check(segment, offset, src.len() as u64)?;
        if src.is_empty() {
            return Ok(());
        }
        if let Some(host) = segment.host_addr {
            // SAFETY: `check` just put the range inside `segment`, a live pinned allocation (only its pool destroys
            // it, through a `PoolAccess`, after its last block); no slice of the bytes is in use (host slices
            // borrow their owned block, whose writes take `&mut`; see `crate::host_ptr::bytes`).
            unsafe { raw::host_copy_in(host + offset as usize, src) };
            return Ok(());
        }
        self.synchronize()?;
        // SAFETY: the range was checked against `segment`, live device memory of this context (bound by
        // `synchronize`); device memory is never lent as a host slice.
        unsafe { raw::copy_htod(segment.device_ptr + offset, src) }.map_err(|f| self.error(f))?;
        // A copy from pageable memory may return before its DMA lands; other streams must see the bytes.
        raw::ctx_synchronize().map_err(|f| self.error(f))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // A pool releases spare pages at the end of each operation; this only covers one that panicked midway.
        if !self.spare_pages.get_mut().is_empty() && self.bind().is_ok() {
            self.release_spare_pages();
        }
    }
}

impl crate::backend::sealed::Sealed for CudaBackend {}

impl Backend for CudaBackend {
    type Segment = CudaSegment;

    fn name(&self) -> &str {
        &self.name
    }

    fn api(&self) -> Api {
        Api::Cuda
    }

    fn alignment(&self) -> u64 {
        if self.adoption.is_some() {
            return 1;
        }
        Self::ALIGNMENT
    }

    fn segment_granularity(&self) -> u64 {
        self.granularity
    }

    fn max_segment_size(&self) -> u64 {
        self.capacity
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Free device memory (cuMemGetInfo), or available host memory for the pinned pool. 0 when it cannot be read.
    fn free_bytes(&self) -> u64 {
        if self.placement == PoolKind::HostPinned {
            return crate::host::host_memory().map_or(0, |(_, available)| available);
        }
        if self.bind().is_err() {
            return 0;
        }
        raw::mem_info().map_or(0, |(free, _)| free)
    }

    fn create_segment(&self, size: u64) -> Result<CudaSegment> {
        if let Some(adoption) = &self.adoption {
            return adoption.take(&self.name);
        }
        self.bind()?;
        if self.placement == PoolKind::HostPinned {
            let (host, device) = raw::host_alloc(size).map_err(|f| self.error(f))?;
            return Ok(CudaSegment { device_ptr: device, size, host_addr: Some(host), pages: None });
        }
        let ptr = raw::mem_alloc(size).map_err(|f| self.error(f))?;
        Ok(CudaSegment { device_ptr: ptr, size, host_addr: None, pages: None })
    }

    #[allow(unsafe_code)] // Discharges the contracts of `raw::host_free`, `raw::address_free` and `raw::mem_free`.
    fn destroy_segment(&self, segment: CudaSegment, _: crate::backend::PoolAccess) {
        // Work queued before the blocks of this segment were freed may still run: wait for it.
        if let Err(e) = self.synchronize() {
            log::error!("{}: synchronizing before freeing a segment failed: {e}", self.name);
        }
        if let Some(adoption) = &self.adoption {
            // Not this backend's allocation: an owned `CudaSlice` frees itself as it drops; borrowed memory stays.
            adoption.release();
            return;
        }
        // For the three frees below: `segment` came from this backend's `create_segment` or `reserve_virtual`
        // and is destroyed once (only a pool destroys segments, each once, through a `PoolAccess`, and never one
        // that holds a live block, so no slice of it is in use or used later). The context was synchronized above;
        // should that fail, the memory is freed anyway, as a failed synchronize leaves a context with a sticky
        // error, which runs no further work.
        let result = if let Some(host) = segment.host_addr {
            // SAFETY: as said above; pinned segments come from `raw::host_alloc`.
            unsafe { raw::host_free(host) }
        } else if let Some(vm) = self.vmm.filter(|_| segment.pages.is_some()) {
            // SAFETY: as said above: synchronized, and no live block lies in a segment being destroyed.
            unsafe { self.unmap_all(&segment, vm.page_size) };
            // SAFETY: as said above; a segment with a page table is one whole reservation from
            // `raw::address_reserve`, whose pages `unmap_all` just unmapped.
            unsafe { raw::address_free(segment.device_ptr, segment.size) }
        } else {
            // SAFETY: as said above; other segments come from `raw::mem_alloc`.
            unsafe { raw::mem_free(segment.device_ptr) }
        };
        if let Err(f) = result {
            log::error!("{}: {}", self.name, self.error(f));
        }
    }

    fn virtual_memory(&self) -> Option<VirtualMemory> {
        self.vmm
    }

    /// Each page becomes one cuMemCreate of `page` bytes (a multiple of the device's granularity, being a power
    /// of two at least as large).
    fn set_page_size(&mut self, page: u64) -> Result<()> {
        let Some(vm) = self.vmm else {
            return Err(Error::Unsupported { backend: self.name.clone(), what: "a page size of its own".into() });
        };
        self.vmm = Some(VirtualMemory { page_size: page, max_reservation: vm.max_reservation.div_ceil(page) * page });
        Ok(())
    }

    fn reserve_virtual(&self, size: u64) -> Result<CudaSegment> {
        let Some(vm) = self.vmm else {
            return Err(Error::Unsupported { backend: self.name.clone(), what: "virtual reservations".into() });
        };
        self.bind()?;
        let size = size.div_ceil(vm.page_size) * vm.page_size;
        let ptr = raw::address_reserve(size, vm.page_size).map_err(|f| self.error(f))?;
        let pages = vec![0u64; (size / vm.page_size) as usize];
        Ok(CudaSegment { device_ptr: ptr, size, host_addr: None, pages: Some(Arc::new(Mutex::new(pages))) })
    }

    /// Creates one physical allocation per page (so that any page can be unmapped on its own later), maps each,
    /// then grants read-write access to the whole range in one call, to this device and its peers. On failure
    /// nothing stays mapped.
    fn map_pages(&self, segment: &CudaSegment, offset: u64, len: u64) -> Result<()> {
        self.map_new_pages(segment, offset, len)
    }

    fn can_alias_pages(&self) -> bool {
        self.vmm.is_some() && self.adoption.is_none()
    }

    /// Maps each source page's physical allocation at the destination under a reference of its own
    /// (`cuMemRetainAllocationHandle`), so that the destination's table releases it like any page when the range
    /// is destroyed, and the memory lives until both mappings are gone. Then grants access to the range as
    /// [`Backend::map_pages`] does. On failure nothing of this call stays mapped.
    fn alias_pages(
        &self,
        dst: &CudaSegment,
        dst_offset: u64,
        src: &CudaSegment,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        self.map_pages_again(dst, dst_offset, src, src_offset, len)
    }

    #[allow(unsafe_code)] // Discharges `unmap_range`'s contract.
    fn unmap_pages(&self, segment: &CudaSegment, offset: u64, len: u64, stream: StreamId, wait: bool) {
        let (Some(vm), true) = (self.vmm, segment.is_virtual()) else { return };
        // Blocks over these pages were freed on `stream`; work queued there before may still use them, unless
        // the pool saw a mark recorded after their frees pass.
        if wait {
            if let Err(e) = self.wait_for_stream(stream) {
                log::error!("{}: waiting before unmapping pages failed: {e}", self.name);
            }
        }
        // SAFETY: `stream` was waited for just above, or the pool saw a mark recorded on it after the pages' last
        // free pass, and it is the only stream whose work may still use these pages (`Backend::unmap_pages`'
        // contract with the pool; a failure is logged: a context with a sticky error runs no further work); the
        // pool unmaps only pages under no live block.
        unsafe { self.unmap_range(segment, offset, len, vm.page_size, true) };
    }

    fn mark_stream(&self, stream: StreamId) -> Result<Option<crate::StreamMark>> {
        self.record_mark(stream).map(Some)
    }

    fn mark_passed(&self, mark: &crate::StreamMark) -> bool {
        self.query_mark(mark)
    }

    fn wait_for_mark(&self, stream: StreamId, mark: &crate::StreamMark) -> Result<()> {
        self.order_after(stream, mark)
    }

    fn release_mark(&self, mark: crate::StreamMark) {
        self.drop_mark(mark);
    }

    fn wait_mark(&self, mark: &crate::StreamMark) -> Result<()> {
        self.wait_for_mark_on_host(mark)
    }

    fn check_stream(&self, stream: StreamId) -> Result<()> {
        self.live_stream(stream).map(|_| ())
    }

    fn device_address(&self, segment: &CudaSegment) -> Option<u64> {
        Some(segment.device_ptr)
    }

    /// Any two CUDA pools of the process are joined: a copy within one context, a peer copy between two. A
    /// read-only target is filled once, at allocation, so no path writes it.
    #[allow(unsafe_code)] // Discharges `CudaBackend::copy_from`'s contract.
    fn copy_on_device(
        &self,
        segment: &CudaSegment,
        offset: u64,
        src: &Self,
        src_segment: &CudaSegment,
        src_offset: u64,
        len: u64,
    ) -> Result<Option<DevicePath>> {
        if self.placement() == PoolKind::ReadOnly {
            return Ok(None);
        }
        self.check(segment, offset, len)?;
        src.check(src_segment, src_offset, len)?;
        // SAFETY: both ranges were just checked against their segments, which hold them inside live blocks that
        // the caller keeps live and free of host slices for the call (the trait's contract).
        let path =
            unsafe { self.copy_from(src, src_segment.device_ptr + src_offset, segment.device_ptr + offset, len) }?;
        Ok(Some(path))
    }

    #[allow(unsafe_code)] // Discharges `raw::mem_release`'s contract.
    fn release_spare_pages(&self) {
        for handle in self.spare_pages.lock().drain(..) {
            // SAFETY: a spare page is an unmapped handle from `raw::mem_create`, drained from the list so it is
            // released once.
            if let Err(f) = unsafe { raw::mem_release(handle) } {
                log::error!("{}: {}", self.name, self.error(f));
            }
        }
    }

    fn write(&self, segment: &CudaSegment, offset: u64, src: &[u8]) -> Result<()> {
        self.refuse_read_only("write")?;
        self.write_device(segment, offset, src)
    }

    #[allow(unsafe_code)] // Discharges `raw::host_copy_out`'s and `raw::copy_dtoh`'s contracts.
    fn read(&self, segment: &CudaSegment, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(segment, offset, dst.len() as u64)?;
        if dst.is_empty() {
            return Ok(());
        }
        if let Some(host) = segment.host_addr {
            // SAFETY: as in `write_device`: the range was just checked against the live pinned `segment`, and
            // mutable slices of it borrow their owner mutably, so nothing on the host writes it meanwhile.
            unsafe { raw::host_copy_out(host + offset as usize, dst) };
            return Ok(());
        }
        self.synchronize()?;
        // SAFETY: the range was checked against `segment`, live device memory of the bound context.
        unsafe { raw::copy_dtoh(dst, segment.device_ptr + offset) }.map_err(|f| self.error(f))
    }

    #[allow(unsafe_code)] // Discharges `raw::host_fill`'s and `raw::memset`'s contracts.
    fn fill(&self, segment: &CudaSegment, offset: u64, len: u64, value: u8) -> Result<()> {
        self.refuse_read_only("fill")?;
        self.check(segment, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if let Some(host) = segment.host_addr {
            // SAFETY: as in `write_device`.
            unsafe { raw::host_fill(host + offset as usize, len as usize, value) };
            return Ok(());
        }
        self.synchronize()?;
        // SAFETY: the range was checked against `segment`, live device memory of the bound context, which stays
        // allocated until the fill is done (the context is synchronized right after).
        unsafe { raw::memset(segment.device_ptr + offset, value, len) }.map_err(|f| self.error(f))?;
        raw::ctx_synchronize().map_err(|f| self.error(f))
    }

    fn settle(&self) -> Result<()> {
        self.synchronize()
    }
    fn host_store(&self, len: u64) -> Result<crate::HostStore> {
        let len = usize::try_from(len).map_err(|_| Error::InvalidConfig(format!("{len} host bytes")))?;
        self.bind()?;
        let bytes = super::host_store::PinnedBytes::new(&self.ctx, len).map_err(|f| self.error(f))?;
        Ok(crate::HostStore::from_bytes(Box::new(bytes), true))
    }

    fn restore(&self, segment: &CudaSegment, offset: u64, src: &[u8]) -> Result<()> {
        self.write_device(segment, offset, src)
    }

    #[allow(unsafe_code)] // Discharges `raw::pinned_host_ptr`'s contract.
    fn host_ptr(&self, segment: &CudaSegment, offset: u64) -> Option<HostPtr> {
        let host = segment.host_addr?;
        // SAFETY: `host` is the host address of the live pinned `segment` (from `raw::host_alloc`; only its pool
        // destroys it) and `offset` is checked against its size here; this backend touches its bytes only in
        // `write_device`, `read` and `fill`, when the pool asks.
        (offset < segment.size).then(|| unsafe { raw::pinned_host_ptr(host, offset as usize) }).flatten()
    }
    fn may_be_host_addressable(&self) -> bool {
        self.placement == PoolKind::HostPinned
    }
}

impl CudaBackend {
    /// Copies `len` bytes from `src_ptr` (memory of `from`'s context) to `dst_ptr` (memory of this backend's) and waits:
    /// within one context a plain copy, between two a peer copy after enabling peer access once per pair. Waits for
    /// all work queued in the source context first, so the copy sees what kernels wrote. Returns the path taken.
    ///
    /// # Safety
    /// `[src_ptr, src_ptr + len)` lies in live memory of `from`'s context and `[dst_ptr, dst_ptr + len)` in live
    /// memory of this backend's, and no host slice of either range is in use for the call.
    #[allow(unsafe_code)] // Discharges `raw::copy`'s and `raw::copy_peer`'s contracts.
    pub(super) unsafe fn copy_from(
        &self,
        from: &CudaBackend,
        src_ptr: u64,
        dst_ptr: u64,
        len: u64,
    ) -> Result<DevicePath> {
        let (src_ctx, dst_ctx) = (from.context(), self.context());
        let same_context = src_ctx.cu_ctx() == dst_ctx.cu_ctx();
        let path = if same_context { DevicePath::CudaDevice } else { DevicePath::CudaPeer };
        if len == 0 {
            return Ok(path);
        }
        from.synchronize()?;
        if same_context {
            // SAFETY: the caller's contract; both ranges are of the context that `synchronize` bound.
            unsafe { raw::copy(dst_ptr, src_ptr, len) }.map_err(|f| self.error(f))?;
            raw::ctx_synchronize().map_err(|f| self.error(f))?;
            return Ok(path);
        }
        self.synchronize()?;
        super::peer::enable_peer_access_once((from.name(), src_ctx), (self.name(), dst_ctx));
        self.bind()?;
        // SAFETY: the caller's contract; the source range is of `src_ctx`, the destination's of `dst_ctx`.
        unsafe { raw::copy_peer(dst_ptr, dst_ctx, src_ptr, src_ctx, len) }.map_err(|f| self.error(f))?;
        raw::ctx_synchronize().map_err(|f| self.error(f))?;
        Ok(path)
    }
}
