//! The one small trait every device backend implements: create and destroy segments, say how blocks must be
//! aligned, report capacity, and move bytes. Everything else (caching, splitting, limits, statistics) lives in
//! [`crate::Pool`], shared by every backend.

pub use crate::host_ptr::HostPtr;
use crate::{DevicePath, Result, StreamId};
use umm_placement::Api;

/// A backend that can reserve address space and map physical pages into it on demand (CUDA's
/// cuMemAddressReserve + cuMemCreate/cuMemMap, or the simulated device). A pool over such a backend places large
/// blocks in one growing virtual segment and unmaps the pages of free blocks under pressure, which removes
/// fragmentation between segments (PyTorch calls this "expandable segments").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtualMemory {
    /// Mapping granularity in bytes (a power of two; 2 MiB on CUDA).
    pub page_size: u64,
    /// How many bytes of address space one reservation may span.
    pub max_reservation: u64,
}

/// A point in one stream's queue recorded by [`Backend::mark_stream`]: an index into the backend's own table of
/// marks (events). Not `Clone`: the pool that got it gives it back once with [`Backend::release_mark`].
#[derive(Debug, PartialEq, Eq)]
pub struct StreamMark {
    /// The stream it was recorded on.
    pub stream: StreamId,
    /// The backend's number for it.
    pub(crate) id: u64,
}

/// Proof that a [`crate::Pool`] is the caller: what [`Backend::destroy_segment`] asks for. Only this crate makes
/// one, and [`Backend`] is sealed, so none reaches code outside it.
#[derive(Debug, Clone, Copy)]
pub struct PoolAccess(());

impl PoolAccess {
    pub(crate) const fn new() -> Self {
        Self(())
    }
}

pub(crate) mod sealed {
    /// Only this crate's backends are [`super::Backend`]s: pools trust what a backend says about its memory
    /// (addresses, bounds) when owned blocks lend host slices of it, and a backend receives [`super::PoolAccess`].
    pub trait Sealed {}
}

/// A device backend. Implementations live in one folder each (`host/`, `sim/`, `cuda/`, ...); their raw layers
/// hold any `unsafe`. All methods are called with the pool's lock held unless noted, so they must not call back
/// into the pool. Sealed: a new kind of memory is a new backend in this crate.
pub trait Backend: sealed::Sealed + Send + Sync + 'static {
    /// The backend's handle for one segment: a device pointer, a `cl_mem`, a `wgpu::Buffer`, a host allocation.
    /// Cloning must be cheap (a copy, or a reference count).
    type Segment: Clone + Send + Sync + 'static;

    /// Human-readable device name, used in errors and statistics.
    fn name(&self) -> &str;

    /// What kind of memory this is.
    fn api(&self) -> Api;

    /// Alignment (bytes, a power of two) every block start must honour: CUDA 256, OpenCL the device's base address
    /// alignment, wgpu the storage-buffer offset alignment, host 64 or more.
    fn alignment(&self) -> u64;

    /// Granularity (bytes, a power of two, a multiple of [`Backend::alignment`]) that segment sizes are rounded
    /// up to.
    fn segment_granularity(&self) -> u64 {
        self.alignment()
    }

    /// The largest segment this backend can create (max allocation size).
    fn max_segment_size(&self) -> u64;

    /// Total memory of the device in bytes.
    fn capacity(&self) -> u64;

    /// Free memory the device reports now, in bytes.
    fn free_bytes(&self) -> u64;

    /// Creates a segment of exactly `size` bytes (already rounded to the granularity).
    fn create_segment(&self, size: u64) -> Result<Self::Segment>;

    /// Destroys a segment created by [`Backend::create_segment`] or [`Backend::reserve_virtual`].
    /// Never panics; a failure is logged. Only a pool can call it (it alone makes a [`PoolAccess`]): segment
    /// handles are cheap clones, so a caller holding one could otherwise destroy memory twice, or under blocks
    /// whose owners lend it as host slices.
    fn destroy_segment(&self, segment: Self::Segment, access: PoolAccess);

    /// Whether (and how) this backend supports virtual reservations with on-demand page mapping.
    fn virtual_memory(&self) -> Option<VirtualMemory> {
        None
    }

    /// Maps virtual reservations `page` bytes at a time from now on (one physical allocation per page), for a
    /// pool configured with [`PoolConfig::page_size`](crate::PoolConfig::page_size). `page` is a power of two
    /// above the page [`Backend::virtual_memory`] reports; [`Pool::new`](crate::Pool::new) checks that and calls
    /// this before anything is reserved. Backends without virtual memory refuse.
    fn set_page_size(&mut self, page: u64) -> Result<()> {
        let _ = page;
        Err(crate::Error::Unsupported { backend: self.name().to_string(), what: "a page size of its own".into() })
    }

    /// Reserves `size` bytes of address space without physical memory behind it.
    fn reserve_virtual(&self, size: u64) -> Result<Self::Segment> {
        let _ = size;
        Err(crate::Error::Unsupported { backend: self.name().to_string(), what: "virtual reservations".into() })
    }

    /// Backs `[offset, offset + len)` of a virtual segment with physical memory (page-aligned range).
    fn map_pages(&self, segment: &Self::Segment, offset: u64, len: u64) -> Result<()> {
        let _ = (segment, offset, len);
        Err(crate::Error::Unsupported { backend: self.name().to_string(), what: "page mapping".into() })
    }

    /// Releases the physical memory behind `[offset, offset + len)` of a virtual segment (page-aligned range).
    /// A backend may keep the released pages' physical memory for the next [`Backend::map_pages`] until
    /// [`Backend::release_spare_pages`]: a pool that unmaps pages to map as many elsewhere then pays for moving
    /// pages, not for freeing and creating them.
    ///
    /// `stream` is the stream of the arena the pages lie in: every block over them was freed on it, and a block
    /// used on other streams came back to the arena only once their work had passed (see `CudaPool`). So
    /// waiting for `stream` alone makes the pages safe to give back; with `wait`, a backend with queued work
    /// waits for that stream, not for the whole device. Without it, the pool knows the work has passed (a
    /// [`StreamMark`] recorded after the pages' last free has passed), and nothing is waited for.
    fn unmap_pages(&self, segment: &Self::Segment, offset: u64, len: u64, stream: StreamId, wait: bool) {
        let _ = (segment, offset, len, stream, wait);
    }

    /// Whether [`Backend::alias_pages`] works: a pool then serves a request that no mapped free range holds
    /// from free pages scattered over its reservations, mapped side by side a second time.
    fn can_alias_pages(&self) -> bool {
        false
    }

    /// Maps the physical pages behind `[src_offset, src_offset + len)` of reservation `src` a second time, at
    /// `[dst_offset, dst_offset + len)` of reservation `dst` (a reservation of its own from
    /// [`Backend::reserve_virtual`], which never gets pages of its own through [`Backend::map_pages`]). Ranges are
    /// whole pages; every source page is mapped, no destination page is. The second mapping takes no physical
    /// memory and keeps the pages alive on its own: they go back to the device once both mappings are gone
    /// (`dst`'s with [`Backend::destroy_segment`]). The caller keeps the source range out of every other use while
    /// the destination is used, and does not unmap the source while the second mapping exists. On failure
    /// nothing of the destination stays mapped.
    fn alias_pages(
        &self,
        dst: &Self::Segment,
        dst_offset: u64,
        src: &Self::Segment,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        let _ = (dst, dst_offset, src, src_offset, len);
        Err(crate::Error::Unsupported { backend: self.name().to_string(), what: "mapping pages twice".into() })
    }

    /// Frees the physical memory of pages unmapped but kept for reuse. A pool calls it at the end of every
    /// operation that unmapped pages, so that kept pages never outlive the operation.
    fn release_spare_pages(&self) {}

    /// Waits for the device work queued on the backend's memory (a CUDA context's streams, an OpenCL queue), so
    /// that the host may read or lend host-addressable bytes that an asynchronous copy or kernel was writing.
    /// Nothing by default: backends whose accesses are complete when they return. Called without the pool's lock.
    fn settle(&self) -> Result<()> {
        Ok(())
    }

    /// Copies `src` into the segment at `offset`. Called with the pool's lock held when the segment is
    /// host-addressable ([`Backend::host_ptr`]), so that the block cannot be freed during the copy; without it
    /// otherwise.
    fn write(&self, segment: &Self::Segment, offset: u64, src: &[u8]) -> Result<()>;

    /// Copies bytes at `offset` of the segment into `dst`. Called with the pool's lock held when the segment is
    /// host-addressable ([`Backend::host_ptr`]), so that the block cannot be freed during the copy; without it
    /// otherwise.
    fn read(&self, segment: &Self::Segment, offset: u64, dst: &mut [u8]) -> Result<()>;

    /// Sets `len` bytes at `offset` to `value`, in chunks by default. Called with the pool's lock held when the
    /// segment is host-addressable ([`Backend::host_ptr`]), so that the block cannot be freed during the copy;
    /// without it otherwise.
    fn fill(&self, segment: &Self::Segment, offset: u64, len: u64, value: u8) -> Result<()> {
        const CHUNK: u64 = 1 << 20;
        let chunk = vec![value; CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = CHUNK.min(len - done);
            self.write(segment, offset + done, &chunk[..n as usize])?;
            done += n;
        }
        Ok(())
    }

    /// Host memory for `len` bytes of a sleeping pool's pages ([`crate::Pool::sleep`]): page-locked where the
    /// backend can make it, so that offloading and restoring copy at the link's full speed; plain heap memory by
    /// default.
    fn host_store(&self, len: u64) -> Result<crate::HostStore> {
        crate::HostStore::plain(len)
    }

    /// Copies `src` back into pages that slept ([`crate::Pool::wake`]), even in a pool whose blocks refuse
    /// writes (a read-only pool's blocks were filled before they slept). [`Backend::write`] by default.
    fn restore(&self, segment: &Self::Segment, offset: u64, src: &[u8]) -> Result<()> {
        self.write(segment, offset, src)
    }

    /// The host address of `offset` in the segment when its memory is directly addressable from the host
    /// (host memory, pinned or mapped memory); `None` otherwise, and for an offset outside the segment. Making a
    /// [`HostPtr`] takes an `unsafe` promise (valid until the segment is destroyed, touched only when the pool
    /// asks), because owned blocks lend host slices of the memory behind it. Called with or without the pool's
    /// lock (an owned block asks once, at allocation), so it must only compute the address.
    fn host_ptr(&self, segment: &Self::Segment, offset: u64) -> Option<HostPtr> {
        let _ = (segment, offset);
        None
    }

    /// Whether [`Backend::host_ptr`] can return an address for any segment of this backend. `false` lets a pool
    /// answer that a block has no host address without looking the block up under its locks (every buffer asks
    /// once, at allocation). A backend that overrides `host_ptr` overrides this too.
    fn may_be_host_addressable(&self) -> bool {
        false
    }

    /// Records a mark at the current end of `stream`'s queue: it passes once the work queued there so far has
    /// run. A pool marks a stream before handing memory freed on it to another stream (see
    /// [`CrossStream`](crate::CrossStream)). `Ok(None)`: the backend queues no work behind the host's back on
    /// that stream (its operations are complete when they return, or every stream's work runs in one in-order
    /// queue that the pool's own calls go through), so everything freed on it may be reused anywhere at once.
    fn mark_stream(&self, stream: StreamId) -> Result<Option<StreamMark>> {
        let _ = stream;
        Ok(None)
    }

    /// Whether the work before `mark` has run (a query; never waits).
    fn mark_passed(&self, mark: &StreamMark) -> bool {
        let _ = mark;
        true
    }

    /// Makes work queued on `stream` from now on wait for `mark` on the device, without blocking the host
    /// (CUDA: `cuStreamWaitEvent`).
    fn wait_for_mark(&self, stream: StreamId, mark: &StreamMark) -> Result<()> {
        let _ = (stream, mark);
        Ok(())
    }

    /// Gives a mark back (its event is kept for the next one). Never fails.
    fn release_mark(&self, mark: StreamMark) {
        let _ = mark;
    }

    /// Blocks the host until the work before `mark` has run (CUDA: `cuEventSynchronize`).
    fn wait_mark(&self, mark: &StreamMark) -> Result<()> {
        let _ = mark;
        Ok(())
    }

    /// Refuses a stream that this backend cannot queue work or record marks on (CUDA: a stream that is not a
    /// live stream of the device's context), so that a caller learns it when it names the stream rather than
    /// when a mark is first recorded on it. Every stream is fine by default.
    fn check_stream(&self, stream: StreamId) -> Result<()> {
        let _ = stream;
        Ok(())
    }

    /// The device address of `segment`'s first byte, for backends whose memory has one that a program passes
    /// around as an integer (CUDA device pointers; the simulated device's addresses). `None` by default: an
    /// OpenCL `cl_mem` or a `wgpu::Buffer` is a handle, not an address.
    fn device_address(&self, segment: &Self::Segment) -> Option<u64> {
        let _ = segment;
        None
    }

    /// Copies `len` bytes on the device(s) from `src_segment` of `src` at `src_offset` into `segment` at `offset`,
    /// and waits for the copy, where the two backends' memory is joined by a device path (one CUDA process, one
    /// OpenCL context, one wgpu device whose buffers have the copy usages): `Ok(Some(path))` with the path taken,
    /// `Ok(None)` where none joins them (another device or context, a target the path cannot write), and the
    /// caller moves the bytes through the host. Ranges outside their segments are [`crate::Error::OutOfBounds`].
    ///
    /// Called by [`crate::OwnedBlock::copy_on_device_from`] through the pools, without their locks (a device copy
    /// waits for queued work): both ranges lie inside live blocks that the caller's borrows keep live and free of
    /// host slices for the call. None by default.
    fn copy_on_device(
        &self,
        segment: &Self::Segment,
        offset: u64,
        src: &Self,
        src_segment: &Self::Segment,
        src_offset: u64,
        len: u64,
    ) -> Result<Option<DevicePath>> {
        let _ = (segment, offset, src, src_segment, src_offset, len);
        Ok(None)
    }

    /// Whether every block needs a segment of its own. wgpu tracks usage per buffer: within one dispatch a buffer
    /// is bound either read-only or read-write, and a buffer cannot be copied into itself, so two blocks of one
    /// shared buffer could not be bound as an input and an output of one kernel. A pool over such a backend never
    /// splits a segment (see [`crate::engine::Engine::whole_blocks`]): each block missing from its caches gets a
    /// segment of its size, and a free segment serves later requests it exceeds by at most
    /// [`crate::engine::WHOLE_FIT_SLACK`]. Virtual reservations are refused for such a backend.
    fn segment_per_block(&self) -> bool {
        false
    }
}
