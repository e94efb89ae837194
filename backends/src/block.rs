//! Blocks as callers see them: a plain [`BlockHandle`], the object-safe [`MemoryPool`] that every `Pool<B>` is,
//! and [`OwnedBlock`], which frees its block when dropped.

use crate::engine::{BlockId, SegmentId};
use crate::{Api, Backend, DevicePath, Limit, Pool, PoolStats, Result, StreamId, TrimReport};
use std::any::Any;
use std::sync::Arc;

/// A live block of a pool: where it is and how large. Plain data; freeing is explicit ([`MemoryPool::free`]) or
/// done by [`OwnedBlock`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHandle {
    /// The block's arena, numbered uniquely in the process: the pool's number in the high bits, the arena's
    /// index in the pool in the low [`crate::pool::ARENA_BITS`]. Another pool, whose own block may have the
    /// same ids, finds the number outside its range and refuses the handle.
    pub(crate) arena: u64,
    pub(crate) segment: SegmentId,
    pub(crate) block: BlockId,
    pub(crate) offset: u64,
    pub(crate) size: u64,
    pub(crate) requested: u64,
    /// The host address of the block's first byte where its memory is host-addressable, 0 otherwise: what the
    /// backend's [`Backend::host_ptr`] vouched for when the pool handed the block out, under its lock. It travels
    /// with the block's segment and offset through the thread caches, so that [`OwnedBlock`] gets it with the
    /// allocation instead of a second trip through the pool's locks. Only [`OwnedBlock`] uses it, for a block it
    /// was just handed; the pool and its caches only carry it.
    pub(crate) host: usize,
    /// Set for a block lent from a thread cache: the slot that lent it checks this ticket (the engine holds the
    /// block parked). See [`crate::pool`]'s thread caches.
    pub(crate) lent: Option<crate::pool::Lent>,
}

impl BlockHandle {
    /// Offset of the block inside its segment (a multiple of the backend's alignment).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size of the block in bytes (the request rounded up to the alignment).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes the caller asked for.
    pub fn requested(&self) -> u64 {
        self.requested
    }

    /// A number unique among the pool's live blocks (reused after free), for side tables and snapshots.
    pub fn key(&self) -> u64 {
        (self.arena_index() << 32) | u64::from(self.block.index())
    }

    /// Segment index inside its arena (for snapshots).
    pub fn segment_index(&self) -> u32 {
        self.segment.0
    }

    /// The arena's index inside its pool.
    pub(crate) fn arena_index(&self) -> u64 {
        self.arena & ((1 << crate::pool::ARENA_BITS) - 1)
    }

    /// The same facts as plain numbers.
    pub fn info(&self) -> BlockInfo {
        BlockInfo {
            key: self.key(),
            segment: self.segment.0,
            offset: self.offset,
            size: self.size,
            requested: self.requested,
        }
    }
}

/// Where a block lies in its pool, as plain numbers, for side tables, profiles and tests. Unlike a
/// [`BlockHandle`] it grants nothing: no pool call takes one. It is all that [`OwnedBlock`] shows of its block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct BlockInfo {
    /// See [`BlockHandle::key`].
    pub key: u64,
    /// See [`BlockHandle::segment_index`].
    pub segment: u32,
    /// See [`BlockHandle::offset`].
    pub offset: u64,
    /// See [`BlockHandle::size`].
    pub size: u64,
    /// See [`BlockHandle::requested`].
    pub requested: u64,
}

pub(crate) mod sealed {
    /// Only this crate's pools are [`super::MemoryPool`]s: [`super::OwnedBlock`] trusts what a pool says about
    /// its blocks (which memory is host-addressable, that blocks do not overlap) when it lends host slices.
    pub trait Sealed {}
}

/// What every pool offers, whatever its backend: the facade holds pools as `Arc<dyn MemoryPool>`. Sealed: it is
/// implemented by [`Pool`] (over any [`Backend`]) and by the CUDA stream-aware pool, nothing else (a new kind of
/// memory is a new [`Backend`]).
pub trait MemoryPool: sealed::Sealed + Send + Sync + 'static {
    /// Pool name (device and placement).
    fn name(&self) -> &str;
    /// Kind of memory.
    fn api(&self) -> Api;
    /// Block alignment in bytes.
    fn alignment(&self) -> u64;
    /// Device capacity in bytes.
    fn capacity(&self) -> u64;
    /// Device free memory in bytes, as the device reports it.
    fn free_bytes(&self) -> u64;
    /// See [`Pool::allocate`].
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle>;
    /// See [`Pool::allocate_zeroed`].
    fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle>;
    /// Allocates a block holding a copy of `data`: the only way to fill a block of a read-only pool, whose
    /// writes are refused afterwards. The default allocates and writes.
    fn allocate_filled(&self, data: &[u8], stream: StreamId) -> Result<BlockHandle> {
        let block = self.allocate(data.len() as u64, stream)?;
        if let Err(e) = self.write(&block, 0, data) {
            let _ = self.free(&block);
            return Err(e);
        }
        Ok(block)
    }
    /// See [`Pool::free`].
    fn free(&self, block: &BlockHandle) -> Result<()>;
    /// See [`Pool::write`].
    fn write(&self, block: &BlockHandle, offset: u64, src: &[u8]) -> Result<()>;
    /// See [`Pool::read`].
    fn read(&self, block: &BlockHandle, offset: u64, dst: &mut [u8]) -> Result<()>;
    /// See [`Pool::fill`].
    fn fill(&self, block: &BlockHandle, offset: u64, len: u64, value: u8) -> Result<()>;
    /// See [`Pool::host_ptr`].
    fn host_ptr(&self, block: &BlockHandle) -> Option<std::ptr::NonNull<u8>>;
    /// See [`Pool::device_address`].
    fn device_address(&self, block: &BlockHandle) -> Option<u64>;
    /// Waits for the device work queued on the pool's memory (see [`Backend::settle`]).
    fn settle(&self) -> Result<()>;
    /// See [`Pool::stats`].
    fn stats(&self) -> PoolStats;
    /// See [`Pool::reserved_bytes`]: without the pool's lock.
    fn reserved_bytes(&self) -> u64;
    /// See [`Pool::unused_bytes`]: under the pool's lock alone.
    fn unused_bytes(&self) -> u64;
    /// See [`Pool::snapshot`].
    fn snapshot(&self) -> crate::pool::PoolSnapshot;
    /// See [`Pool::reset_peaks`].
    fn reset_peaks(&self);
    /// See [`Pool::mark_step`].
    fn mark_step(&self) -> crate::pool::StepReport;
    /// See [`Pool::release_cached`].
    fn release_cached(&self) -> TrimReport;
    /// See [`Pool::cleanup`].
    fn cleanup(&self, idle_rounds: u64) -> TrimReport;
    /// See [`Pool::set_limit`].
    fn set_limit(&self, limit: Option<Limit>) -> Result<()>;
    /// See [`Pool::sleep`].
    fn sleep(&self, action: crate::pool::SleepAction) -> Result<crate::pool::SleepReport>;
    /// See [`Pool::wake`].
    fn wake(&self) -> Result<crate::pool::WakeReport>;
    /// See [`Pool::sleeping`].
    fn sleeping(&self) -> Option<crate::pool::SleepAction>;
    /// Copies the first `len` bytes of `src_block` (of `src`) into `block` on the device(s), where `src` is a
    /// pool of the same kind and the backends join them ([`Backend::copy_on_device`]); `Ok(None)` otherwise.
    /// For [`OwnedBlock::copy_on_device_from`], whose borrows keep both blocks live and free of host slices.
    fn copy_on_device_from(
        &self,
        block: &BlockHandle,
        src: &dyn MemoryPool,
        src_block: &BlockHandle,
        len: u64,
    ) -> Result<Option<DevicePath>>;
    /// The concrete pool, for backend-specific interop (`downcast_ref::<Pool<CudaBackend>>()`).
    fn as_any(&self) -> &dyn Any;
    /// What names the pool: its address, the same through every [`PoolLease`] of it.
    fn identity(&self) -> usize {
        self.as_any() as *const dyn Any as *const () as usize
    }
}

/// A handle on a shared pool that forwards every call to it, for one thread to hold many of: each block
/// allocated through the lease holds the lease's reference count, which only its thread writes, instead of the
/// pool's, which every thread would write on every allocation and free (a cache line passed between cores at
/// each). [`MemoryPool::identity`] and [`MemoryPool::as_any`] are the pool's.
pub struct PoolLease(Arc<dyn MemoryPool>);

impl PoolLease {
    /// A lease on `pool`.
    pub fn new(pool: Arc<dyn MemoryPool>) -> Self {
        Self(pool)
    }

    /// The pool leased.
    pub fn pool(&self) -> &Arc<dyn MemoryPool> {
        &self.0
    }
}

impl sealed::Sealed for PoolLease {}

impl MemoryPool for PoolLease {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn api(&self) -> Api {
        self.0.api()
    }
    fn alignment(&self) -> u64 {
        self.0.alignment()
    }
    fn capacity(&self) -> u64 {
        self.0.capacity()
    }
    fn free_bytes(&self) -> u64 {
        self.0.free_bytes()
    }
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.0.allocate(bytes, stream)
    }
    fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.0.allocate_zeroed(bytes, stream)
    }
    fn allocate_filled(&self, data: &[u8], stream: StreamId) -> Result<BlockHandle> {
        self.0.allocate_filled(data, stream)
    }
    fn free(&self, block: &BlockHandle) -> Result<()> {
        self.0.free(block)
    }
    fn write(&self, block: &BlockHandle, offset: u64, src: &[u8]) -> Result<()> {
        self.0.write(block, offset, src)
    }
    fn read(&self, block: &BlockHandle, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.0.read(block, offset, dst)
    }
    fn fill(&self, block: &BlockHandle, offset: u64, len: u64, value: u8) -> Result<()> {
        self.0.fill(block, offset, len, value)
    }
    fn host_ptr(&self, block: &BlockHandle) -> Option<std::ptr::NonNull<u8>> {
        self.0.host_ptr(block)
    }
    fn device_address(&self, block: &BlockHandle) -> Option<u64> {
        self.0.device_address(block)
    }
    fn settle(&self) -> Result<()> {
        self.0.settle()
    }
    fn stats(&self) -> PoolStats {
        self.0.stats()
    }
    fn reserved_bytes(&self) -> u64 {
        self.0.reserved_bytes()
    }
    fn unused_bytes(&self) -> u64 {
        self.0.unused_bytes()
    }
    fn snapshot(&self) -> crate::pool::PoolSnapshot {
        self.0.snapshot()
    }
    fn reset_peaks(&self) {
        self.0.reset_peaks()
    }
    fn mark_step(&self) -> crate::pool::StepReport {
        self.0.mark_step()
    }
    fn release_cached(&self) -> TrimReport {
        self.0.release_cached()
    }
    fn cleanup(&self, idle_rounds: u64) -> TrimReport {
        self.0.cleanup(idle_rounds)
    }
    fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        self.0.set_limit(limit)
    }
    fn sleep(&self, action: crate::pool::SleepAction) -> Result<crate::pool::SleepReport> {
        self.0.sleep(action)
    }
    fn wake(&self) -> Result<crate::pool::WakeReport> {
        self.0.wake()
    }
    fn sleeping(&self) -> Option<crate::pool::SleepAction> {
        self.0.sleeping()
    }
    fn copy_on_device_from(
        &self,
        block: &BlockHandle,
        src: &dyn MemoryPool,
        src_block: &BlockHandle,
        len: u64,
    ) -> Result<Option<DevicePath>> {
        self.0.copy_on_device_from(block, src, src_block, len)
    }
    fn as_any(&self) -> &dyn Any {
        self.0.as_any()
    }
    fn identity(&self) -> usize {
        self.0.identity()
    }
}

impl<B: Backend> sealed::Sealed for Pool<B> {}

impl<B: Backend> MemoryPool for Pool<B> {
    fn name(&self) -> &str {
        self.backend().name()
    }
    fn api(&self) -> Api {
        self.backend().api()
    }
    fn alignment(&self) -> u64 {
        self.block_alignment()
    }
    fn capacity(&self) -> u64 {
        self.backend().capacity()
    }
    fn free_bytes(&self) -> u64 {
        self.backend().free_bytes()
    }
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        Pool::allocate(self, bytes, stream)
    }
    fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        Pool::allocate_zeroed(self, bytes, stream)
    }
    fn free(&self, block: &BlockHandle) -> Result<()> {
        Pool::free(self, block)
    }
    fn write(&self, block: &BlockHandle, offset: u64, src: &[u8]) -> Result<()> {
        Pool::write(self, block, offset, src)
    }
    fn read(&self, block: &BlockHandle, offset: u64, dst: &mut [u8]) -> Result<()> {
        Pool::read(self, block, offset, dst)
    }
    fn fill(&self, block: &BlockHandle, offset: u64, len: u64, value: u8) -> Result<()> {
        Pool::fill(self, block, offset, len, value)
    }
    fn host_ptr(&self, block: &BlockHandle) -> Option<std::ptr::NonNull<u8>> {
        Pool::host_ptr(self, block)
    }
    fn device_address(&self, block: &BlockHandle) -> Option<u64> {
        Pool::device_address(self, block)
    }
    fn settle(&self) -> Result<()> {
        self.backend().settle()
    }
    fn stats(&self) -> PoolStats {
        Pool::stats(self)
    }
    fn reserved_bytes(&self) -> u64 {
        Pool::reserved_bytes(self)
    }
    fn unused_bytes(&self) -> u64 {
        Pool::unused_bytes(self)
    }
    fn reset_peaks(&self) {
        Pool::reset_peaks(self)
    }
    fn mark_step(&self) -> crate::pool::StepReport {
        Pool::mark_step(self)
    }
    fn snapshot(&self) -> crate::pool::PoolSnapshot {
        Pool::snapshot(self)
    }
    fn release_cached(&self) -> TrimReport {
        Pool::release_cached(self)
    }
    fn cleanup(&self, idle_rounds: u64) -> TrimReport {
        Pool::cleanup(self, idle_rounds)
    }
    fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        Pool::set_limit(self, limit)
    }
    fn sleep(&self, action: crate::pool::SleepAction) -> Result<crate::pool::SleepReport> {
        Pool::sleep(self, action)
    }
    fn wake(&self) -> Result<crate::pool::WakeReport> {
        Pool::wake(self)
    }
    fn sleeping(&self) -> Option<crate::pool::SleepAction> {
        Pool::sleeping(self)
    }
    fn copy_on_device_from(
        &self,
        block: &BlockHandle,
        src: &dyn MemoryPool,
        src_block: &BlockHandle,
        len: u64,
    ) -> Result<Option<DevicePath>> {
        match src.as_any().downcast_ref::<Pool<B>>() {
            Some(src) => Pool::copy_on_device_from(self, block, src, src_block, len),
            None => Ok(None),
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A block that returns itself to its pool when dropped.
///
/// Its [`BlockHandle`] never leaves this crate: a handle is the capability to free, write, fill or read a block
/// through the pool, and an owned block lends `&[u8]`/`&mut [u8]` slices of host-addressable memory that Rust's
/// borrow rules protect only if every other access goes through the block itself. Handles cannot be forged
/// (their fields are private) nor reused once their block is freed (block ids carry a generation), so code
/// outside the crate reaches an owned block's bytes only through the methods below, which borrow it. Interop
/// that needs the handle inside the crate is offered per backend ([`OwnedBlock::copy_on_device_from`], OpenCL's
/// `block_sub_buffer`).
///
/// What code outside the crate sees of the block is its [`BlockInfo`]:
/// ```
/// # use std::sync::Arc;
/// # use umm_backends::{HostBackend, MemoryPool, OwnedBlock, Pool, PoolConfig, StreamId};
/// let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(HostBackend::new("host", 1 << 30), PoolConfig::default())?);
/// let block = OwnedBlock::allocate(Arc::clone(&pool), 64, StreamId(0), false)?;
/// assert_eq!(block.info().requested, 64);
/// # Ok::<(), umm_backends::Error>(())
/// ```
/// and never the handle, so the pool cannot be asked to free (or write) the block behind the owner's back:
/// ```compile_fail,E0624
/// # use std::sync::Arc;
/// # use umm_backends::{HostBackend, MemoryPool, OwnedBlock, Pool, PoolConfig, StreamId};
/// let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(HostBackend::new("host", 1 << 30), PoolConfig::default())?);
/// let block = OwnedBlock::allocate(Arc::clone(&pool), 64, StreamId(0), false)?;
/// let slice = block.host_bytes().unwrap();
/// pool.free(block.handle())?; // error[E0624]: method `handle` is private
/// # let _ = slice;
/// # Ok::<(), umm_backends::Error>(())
/// ```
pub struct OwnedBlock {
    pool: Arc<dyn MemoryPool>,
    /// Holds the host address of the first byte when the memory is host-addressable (as an integer, so that the
    /// type stays `Send + Sync`), set by the pool when it handed the block out.
    handle: BlockHandle,
}

impl OwnedBlock {
    /// Allocates `bytes` on `stream` from `pool` (zeroed if asked).
    pub fn allocate(pool: Arc<dyn MemoryPool>, bytes: u64, stream: StreamId, zeroed: bool) -> Result<Self> {
        let handle = if zeroed { pool.allocate_zeroed(bytes, stream)? } else { pool.allocate(bytes, stream)? };
        Ok(Self { pool, handle })
    }

    /// Allocates a block holding a copy of `data` on `stream` (see [`MemoryPool::allocate_filled`]).
    pub fn allocate_filled(pool: Arc<dyn MemoryPool>, data: &[u8], stream: StreamId) -> Result<Self> {
        let handle = pool.allocate_filled(data, stream)?;
        Ok(Self { pool, handle })
    }

    /// The block's handle, for this crate's interop only (see the type's documentation for why it stays here).
    pub(crate) fn handle(&self) -> &BlockHandle {
        &self.handle
    }

    /// Where the block lies in its pool (key, segment, offset, sizes).
    pub fn info(&self) -> BlockInfo {
        self.handle.info()
    }

    /// The pool it came from.
    pub fn pool(&self) -> &Arc<dyn MemoryPool> {
        &self.pool
    }

    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.handle.requested
    }

    /// Always false: pools refuse zero-byte blocks.
    pub fn is_empty(&self) -> bool {
        self.handle.requested == 0
    }

    /// Copies `src` into the block at `offset`. Takes `&mut self`: no slice from [`OwnedBlock::host_bytes`] may
    /// be alive while the bytes under it change (and `src` cannot be one of this block's own).
    pub fn write(&mut self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len() as u64)?;
        self.pool.write(&self.handle, offset, src)
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len() as u64)?;
        self.pool.read(&self.handle, offset, dst)
    }

    /// Sets `len` bytes at `offset` to `value`. Takes `&mut self`, as [`OwnedBlock::write`] does.
    pub fn fill(&mut self, offset: u64, len: u64, value: u8) -> Result<()> {
        self.check_range(offset, len)?;
        self.pool.fill(&self.handle, offset, len, value)
    }

    /// The device address of the block's first byte, where its memory has one (CUDA, the simulated device;
    /// `None` for host, OpenCL and wgpu memory). A number to identify the memory by: kernels reach it through the
    /// backends' views, which order their work on the block's stream.
    pub fn device_address(&self) -> Option<u64> {
        self.pool.device_address(&self.handle)
    }

    /// The requested bytes as a host slice, when the memory is host-addressable; `None` otherwise, and when the
    /// device work queued on the pool's memory cannot be waited for. Waits for that work first
    /// ([`MemoryPool::settle`]: CUDA pinned and OpenCL mapped memory), so that no asynchronous copy or kernel
    /// queued before, on this block or on one that held its memory earlier, is still writing the bytes.
    #[allow(unsafe_code)] // Discharges `host_ptr::bytes`'s contract.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let addr = self.host_addr()?;
        self.pool.settle().ok()?;
        // The block is live for as long as `self`, so the range stays valid for the borrow.
        // SAFETY: the handle's `host` is the address the backend vouched for (a `HostPtr`) at this block's
        // segment and offset when the pool handed the block out (the thread caches keep it with that segment and
        // offset, which the block still has); the length is the block's requested size; `settle` just waited for
        // queued device work.
        Some(unsafe { crate::host_ptr::bytes(self, addr, self.handle.requested as usize) })
    }

    /// The requested bytes as a mutable host slice, when the memory is host-addressable; waits for queued device
    /// work first, as [`OwnedBlock::host_bytes`] does.
    #[allow(unsafe_code)] // Discharges `host_ptr::bytes_mut`'s contract.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let addr = self.host_addr()?;
        self.pool.settle().ok()?;
        let len = self.handle.requested as usize;
        // SAFETY: as in `host_bytes`.
        Some(unsafe { crate::host_ptr::bytes_mut(self, addr, len) })
    }

    /// The host address of the first byte, when the memory is host-addressable.
    fn host_addr(&self) -> Option<usize> {
        (self.handle.host != 0).then_some(self.handle.host)
    }

    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.handle.requested => Ok(()),
            _ => Err(crate::Error::OutOfBounds(format!(
                "{len} bytes at offset {offset} run past the end of a block of {} bytes",
                self.handle.requested
            ))),
        }
    }
}

impl Drop for OwnedBlock {
    fn drop(&mut self) {
        if let Err(e) = self.pool.free(&self.handle) {
            log::error!("freeing a block of {} failed: {e}", self.pool.name());
        }
    }
}

impl std::fmt::Debug for OwnedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedBlock").field("pool", &self.pool.name()).field("handle", &self.handle).finish()
    }
}
