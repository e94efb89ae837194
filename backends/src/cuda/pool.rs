//! `CudaPool`: the stream-safe pool ([`StreamPool`]) over a CUDA device, with PyTorch's `record_stream`
//! semantics (marks are CUDA events), plus the operations only CUDA memory has: device pointers, stream-ordered
//! writes and fills.

use super::backend::CudaBackend;
use super::raw;
use crate::pool::StreamPool;
#[cfg(doc)]
use crate::Pool;
use crate::{Api, Backend, BlockHandle, Error, Limit, MemoryPool, PoolStats, Result, StreamId, TrimReport};
use std::ptr::NonNull;

/// A stream-safe caching pool of one CUDA device and placement. `Send + Sync`; share it with `Arc`. See
/// [`StreamPool`] for the rules of blocks used on several streams.
pub type CudaPool = StreamPool<CudaBackend>;

impl StreamPool<CudaBackend> {
    /// Allocates one block per size in `sizes` on `stream` with one pass over the pending frees; on failure
    /// frees what it allocated and returns the error.
    pub fn allocate_batch(&self, sizes: &[u64], stream: StreamId) -> Result<Vec<BlockHandle>> {
        self.allocate_with(|p| p.allocate_batch(sizes, stream))
    }

    /// Pre-populates the cache: allocates `count` blocks of each `(size, count)` on `stream`, then frees them
    /// all, so that later requests of those sizes on that stream are cache hits.
    pub fn warm_up(&self, sizes: &[(u64, usize)], stream: StreamId) -> Result<()> {
        self.allocate_with(|p| p.warm_up(sizes, stream))
    }

    /// Device address of a live block's first byte (for pinned memory, its device-mapped address).
    pub fn device_ptr(&self, block: &BlockHandle) -> Result<u64> {
        super::CudaPoolExt::device_ptr(self.pool(), block)
    }

    /// Copies `src` into the block at `offset` with a copy queued on `stream`, then waits for that stream: the
    /// bytes are in place for every later use on `stream`. Refused for read-only blocks after creation.
    pub fn write_on_stream(&self, block: &BlockHandle, offset: u64, src: &[u8], stream: StreamId) -> Result<()> {
        self.refuse_read_only()?;
        super::interop::upload(self.pool(), block, offset, src, stream)
    }

    /// Sets `len` bytes at `offset` of the block to `value`, queued on `stream` (asynchronous). Pinned memory is
    /// filled at once, from the host, under the pool's lock ([`Pool::fill`]), so the fill cannot land after the
    /// block was freed and its memory lent to an owner as a host slice.
    #[allow(unsafe_code)] // Discharges `raw::memset_async`'s contract.
    pub fn fill_async(&self, block: &BlockHandle, offset: u64, len: u64, value: u8, stream: StreamId) -> Result<()> {
        self.refuse_read_only()?;
        let (ptr, host) = super::interop::range(self.pool(), block, offset, len)?;
        let backend = self.pool().backend();
        if host.is_some() {
            return self.pool().fill(block, offset, len, value);
        }
        let stream = backend.live_stream(stream)?;
        backend.bind()?;
        // SAFETY: `range` just checked the range against the block, found live in this pool; the block is device
        // memory (pinned went to the host path above), which is never lent as a host slice.
        unsafe { raw::memset_async(ptr, value, len, &stream) }.map_err(|f| backend.error(f))
    }

    fn refuse_read_only(&self) -> Result<()> {
        if self.pool().backend().placement() == crate::PoolKind::ReadOnly {
            return Err(Error::Unsupported {
                backend: self.pool().backend().name().to_string(),
                what: "write: read-only memory is filled once, when it is allocated".into(),
            });
        }
        Ok(())
    }
}

impl crate::block::sealed::Sealed for CudaPool {}

impl MemoryPool for CudaPool {
    fn name(&self) -> &str {
        self.pool().backend().name()
    }
    fn api(&self) -> Api {
        Api::Cuda
    }
    fn alignment(&self) -> u64 {
        MemoryPool::alignment(self.pool())
    }
    fn capacity(&self) -> u64 {
        MemoryPool::capacity(self.pool())
    }
    fn free_bytes(&self) -> u64 {
        MemoryPool::free_bytes(self.pool())
    }
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        StreamPool::allocate(self, bytes, stream)
    }
    fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        StreamPool::allocate_zeroed(self, bytes, stream)
    }
    fn allocate_filled(&self, data: &[u8], stream: StreamId) -> Result<BlockHandle> {
        // Through the stream-ordered upload, which read-only pools accept.
        self.allocate_with(|p| super::CudaPoolExt::upload_read_only(p, data, stream))
    }
    fn free(&self, block: &BlockHandle) -> Result<()> {
        StreamPool::free(self, block)
    }
    fn write(&self, block: &BlockHandle, offset: u64, src: &[u8]) -> Result<()> {
        self.pool().write(block, offset, src)
    }
    fn read(&self, block: &BlockHandle, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.pool().read(block, offset, dst)
    }
    fn fill(&self, block: &BlockHandle, offset: u64, len: u64, value: u8) -> Result<()> {
        self.pool().fill(block, offset, len, value)
    }
    fn host_ptr(&self, block: &BlockHandle) -> Option<NonNull<u8>> {
        self.pool().host_ptr(block)
    }
    fn device_address(&self, block: &BlockHandle) -> Option<u64> {
        self.pool().device_address(block)
    }
    fn settle(&self) -> Result<()> {
        self.pool().backend().settle()
    }
    fn stats(&self) -> PoolStats {
        self.pool().stats()
    }
    fn reserved_bytes(&self) -> u64 {
        self.pool().reserved_bytes()
    }
    fn unused_bytes(&self) -> u64 {
        self.pool().unused_bytes()
    }
    fn snapshot(&self) -> crate::pool::PoolSnapshot {
        self.pool().snapshot()
    }
    fn reset_peaks(&self) {
        self.pool().reset_peaks()
    }
    fn mark_step(&self) -> crate::pool::StepReport {
        self.pool().mark_step()
    }
    fn release_cached(&self) -> TrimReport {
        StreamPool::release_cached(self)
    }
    fn cleanup(&self, idle_rounds: u64) -> TrimReport {
        StreamPool::cleanup(self, idle_rounds)
    }
    fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        StreamPool::set_limit(self, limit)
    }
    fn sleep(&self, action: crate::pool::SleepAction) -> Result<crate::pool::SleepReport> {
        StreamPool::sleep(self, action)
    }
    fn wake(&self) -> Result<crate::pool::WakeReport> {
        self.pool().wake()
    }
    fn sleeping(&self) -> Option<crate::pool::SleepAction> {
        self.pool().sleeping()
    }
    fn copy_on_device_from(
        &self,
        block: &BlockHandle,
        src: &dyn MemoryPool,
        src_block: &BlockHandle,
        len: u64,
    ) -> Result<Option<crate::DevicePath>> {
        match src.as_any().downcast_ref::<CudaPool>() {
            Some(src) => self.pool().copy_on_device_from(block, src.pool(), src_block, len),
            None => Ok(None),
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
