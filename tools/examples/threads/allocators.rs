//! The allocators under test, behind one small trait so that every one runs the same thread loop: the bare
//! pools, the CUDA device pool and the whole manager.

use std::sync::Arc;
use umm::backends::{Backend, BlockHandle, Pool, StreamId};
use umm::{AllocOptions, Placement, UniversalBuffer, UniversalMemoryManager};

/// Every thread allocates and frees on the default stream: the threads contend for the same arenas, as threads
/// of a CPU program sharing one allocator do.
const STREAM: StreamId = StreamId(0);

/// One allocator shared by every thread of a run.
pub(crate) trait Allocator: Send + Sync + 'static {
    type Block: Send;
    /// Allocates `bytes`; the error as text, so that the thread can report it after the start barrier.
    fn allocate(&self, bytes: u64) -> Result<Self::Block, String>;
    /// Returns a block; panics if the allocator refuses it (it handed the block out, so that is a bug).
    fn free(&self, block: Self::Block);
    /// Bytes allocated now, from the allocator's statistics.
    fn allocated_bytes(&self) -> u64;
    /// Device allocations (segments created, pages mapped) so far: the timed run should make few.
    fn device_allocs(&self) -> u64;
    /// Allocations served so far per device, for an allocator that chooses the device itself; empty otherwise.
    fn allocations_by_device(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}

/// Checks that a pool's block holds the request (a pool rounds up, never down).
fn checked_block(result: umm::backends::Result<BlockHandle>, bytes: u64) -> Result<BlockHandle, String> {
    let block = result.map_err(|e| format!("allocating {bytes} bytes failed: {e}"))?;
    if block.size() < bytes {
        return Err(format!("asked for {bytes} bytes, got a block of {}", block.size()));
    }
    Ok(block)
}

impl<B: Backend> Allocator for Pool<B> {
    type Block = BlockHandle;
    fn allocate(&self, bytes: u64) -> Result<BlockHandle, String> {
        checked_block(Pool::allocate(self, bytes, STREAM), bytes)
    }
    fn free(&self, block: BlockHandle) {
        Pool::free(self, &block).unwrap_or_else(|e| panic!("freeing {block:?} failed: {e}"));
    }
    fn allocated_bytes(&self) -> u64 {
        self.stats().allocated_bytes.current
    }
    fn device_allocs(&self) -> u64 {
        self.stats().num_device_alloc
    }
}

#[cfg(feature = "cuda")]
impl Allocator for umm::backends::cuda::CudaPool {
    type Block = BlockHandle;
    fn allocate(&self, bytes: u64) -> Result<BlockHandle, String> {
        checked_block(umm::backends::cuda::CudaPool::allocate(self, bytes, STREAM), bytes)
    }
    fn free(&self, block: BlockHandle) {
        umm::backends::cuda::CudaPool::free(self, &block).unwrap_or_else(|e| panic!("freeing {block:?} failed: {e}"));
    }
    fn allocated_bytes(&self) -> u64 {
        self.pool().stats().allocated_bytes.current
    }
    fn device_allocs(&self) -> u64 {
        self.pool().stats().num_device_alloc
    }
}

/// The whole manager: placement decision, usage tracking and profiler hooks around the device's pool. With
/// options, `allocate_universal_with` those options; else `allocate_universal(n, Placement::DeviceLocal)`.
pub(crate) struct Universal(pub(crate) UniversalMemoryManager, pub(crate) Option<AllocOptions>);

impl Allocator for Universal {
    type Block = UniversalBuffer<u8>;
    fn allocate(&self, bytes: u64) -> Result<UniversalBuffer<u8>, String> {
        let n = bytes as usize;
        let buffer = match &self.1 {
            None => self.0.allocate_universal::<u8>(n, Placement::DeviceLocal),
            Some(options) => self.0.allocate_universal_with::<u8>(n, options.clone()),
        }
        .map_err(|e| format!("allocate_universal of {bytes} bytes failed: {e}"))?;
        if buffer.len() != n {
            return Err(format!("asked for {n} bytes, got a buffer of {}", buffer.len()));
        }
        Ok(buffer)
    }
    fn free(&self, block: UniversalBuffer<u8>) {
        // Dropping a buffer returns its block to its pool.
        drop(block);
    }
    fn allocated_bytes(&self) -> u64 {
        self.0.global_memory_stats().total.allocated_bytes.current
    }
    fn device_allocs(&self) -> u64 {
        self.0.global_memory_stats().total.num_device_alloc
    }
    fn allocations_by_device(&self) -> Vec<(String, u64)> {
        self.0.global_memory_stats().devices.into_iter().map(|d| (d.name, d.total.num_allocs)).collect()
    }
}

/// One allocator to measure: how to make a fresh one per configuration, and what it runs on.
pub(crate) struct Subject<A> {
    pub(crate) pool: &'static str,
    pub(crate) device: String,
    /// The memory that bounds how much the configuration may hold (`None`: no bound, the sim device).
    pub(crate) memory: Option<u64>,
    pub(crate) make: Box<dyn Fn() -> Arc<A>>,
    /// Run after each configuration (the shared manager gives its cached memory back here).
    pub(crate) reset: Box<dyn Fn(&A)>,
}
