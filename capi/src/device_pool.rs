//! What the C ABI needs of one device's pool, over CUDA or over a simulated device: both are the backends'
//! stream-safe pool ([`StreamPool`]), so the rules for blocks used on several streams are the same code.
//!
//! The simulated devices (`UMM_CAPI_SIM`) let programs and tests that drive the C ABI, such as the Python
//! package's, run on a machine without a GPU: addresses are handed out and books kept exactly as on a GPU, but no
//! byte exists behind them.

use umm_backends::pool::StreamPool;
use umm_backends::{
    Backend, BlockHandle, Limit, PoolSnapshot, PoolStats, Result, SimBackend, SleepAction, SleepReport, StreamId,
    TrimReport, WakeReport,
};

/// One device's pool as the registry uses it.
pub(crate) trait DevicePool: Send + Sync {
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle>;
    fn free(&self, block: &BlockHandle) -> Result<()>;
    fn record_stream(&self, block: &BlockHandle, stream: StreamId) -> Result<()>;
    /// The block's device address (never 0 for a live block).
    fn address(&self, block: &BlockHandle) -> Result<u64>;
    fn stats(&self) -> PoolStats;
    /// Reserved bytes: one atomic load, no lock.
    fn reserved_bytes(&self) -> u64;
    fn snapshot(&self) -> PoolSnapshot;
    fn pending_frees(&self) -> usize;
    fn release_cached(&self) -> TrimReport;
    fn set_limit(&self, limit: Option<Limit>) -> Result<()>;
    fn reset_peaks(&self);
    fn mark_step(&self);
    fn uses_virtual_memory(&self) -> bool;
    /// Free memory the device reports.
    fn device_free(&self) -> u64;
    fn sleep(&self, action: SleepAction) -> Result<SleepReport>;
    fn wake(&self) -> Result<WakeReport>;
    fn sleeping(&self) -> Option<SleepAction>;
    /// A capture began on the device: capture-safe paths only until the matching end ([`StreamPool::begin_capture`]).
    fn begin_capture(&self);
    /// A capture ended; blocks it held back are marked now.
    fn end_capture(&self) -> Result<()>;
    /// Blocks allocated and not yet freed.
    fn live_blocks(&self) -> u64;
    /// The simulated device behind the pool, for tests that drive its streams (holds, captures) and read what they
    /// saw; `None` on a real device.
    fn simulated(&self) -> Option<&SimBackend>;
    /// The CUDA pool behind, for what only CUDA does (sharing blocks with other processes); `None` on a
    /// simulated device.
    fn cuda(&self) -> Option<&umm_backends::cuda::CudaPool>;
}

impl<B: Backend> DevicePool for StreamPool<B> {
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        StreamPool::allocate(self, bytes, stream)
    }
    fn free(&self, block: &BlockHandle) -> Result<()> {
        StreamPool::free(self, block)
    }
    fn record_stream(&self, block: &BlockHandle, stream: StreamId) -> Result<()> {
        StreamPool::record_stream(self, block, stream)
    }
    fn address(&self, block: &BlockHandle) -> Result<u64> {
        self.device_address(block)?.ok_or_else(|| umm_backends::Error::Unsupported {
            backend: self.backend().name().to_string(),
            what: "device addresses (this memory is reached through handles)".into(),
        })
    }
    fn stats(&self) -> PoolStats {
        StreamPool::stats(self)
    }
    fn reserved_bytes(&self) -> u64 {
        self.pool().reserved_bytes()
    }
    fn snapshot(&self) -> PoolSnapshot {
        self.pool().snapshot()
    }
    fn pending_frees(&self) -> usize {
        StreamPool::pending_frees(self)
    }
    fn release_cached(&self) -> TrimReport {
        StreamPool::release_cached(self)
    }
    fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        StreamPool::set_limit(self, limit)
    }
    fn reset_peaks(&self) {
        self.pool().reset_peaks()
    }
    fn mark_step(&self) {
        self.pool().mark_step();
    }
    fn uses_virtual_memory(&self) -> bool {
        self.pool().uses_virtual_memory()
    }
    fn device_free(&self) -> u64 {
        self.backend().free_bytes()
    }
    fn sleep(&self, action: SleepAction) -> Result<SleepReport> {
        StreamPool::sleep(self, action)
    }
    fn wake(&self) -> Result<WakeReport> {
        self.pool().wake()
    }
    fn sleeping(&self) -> Option<SleepAction> {
        self.pool().sleeping()
    }
    fn begin_capture(&self) {
        StreamPool::begin_capture(self)
    }
    fn end_capture(&self) -> Result<()> {
        StreamPool::end_capture(self)
    }
    fn live_blocks(&self) -> u64 {
        StreamPool::stats(self).active_blocks.current
    }
    fn simulated(&self) -> Option<&SimBackend> {
        (self.backend() as &dyn std::any::Any).downcast_ref::<SimBackend>()
    }
    fn cuda(&self) -> Option<&umm_backends::cuda::CudaPool> {
        (self as &dyn std::any::Any).downcast_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umm_backends::{Pool, PoolConfig};

    const MIB: u64 = 1 << 20;

    fn sim(virtual_memory: bool) -> StreamPool<SimBackend> {
        let backend = if virtual_memory { SimBackend::new("sim", 1 << 30) } else { SimBackend::plain("sim", 1 << 30) };
        StreamPool::new(Pool::new(backend.at_address(1 << 40), PoolConfig::default()).unwrap())
    }

    /// What the registry reads of a pool: its kind of segments, the device's free memory, peaks reset, steps
    /// counted, addresses where the backend gives them.
    #[test]
    fn the_registry_reads_what_the_pool_says() {
        for virtual_memory in [true, false] {
            let pool: &dyn DevicePool = &sim(virtual_memory);
            assert_eq!(pool.uses_virtual_memory(), virtual_memory);
            assert_eq!(pool.device_free(), 1 << 30);
            let block = pool.allocate(64 * MIB, StreamId(0)).unwrap();
            assert!(pool.address(&block).unwrap() >= 1 << 40);
            assert_eq!(pool.device_free(), (1 << 30) - pool.reserved_bytes());
            pool.free(&block).unwrap();
            assert_eq!(pool.stats().allocated_bytes.peak, 64 * MIB);
            pool.reset_peaks();
            assert_eq!(pool.stats().allocated_bytes.peak, 0, "a reset starts from what is allocated now");
            pool.mark_step();
            pool.mark_step();
            assert_eq!(pool.stats().num_steps, 2);
        }
    }
}
