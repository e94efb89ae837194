//! Cache control over any pool: warm-up and batch allocation. Generic (they use only `Pool`'s public API), so
//! they serve every backend; they live here until the pool grows its own.

use crate::{Backend, BlockHandle, Pool, Result, StreamId};

/// Allocates one block per size on `stream`. On failure frees the blocks it allocated and returns the error.
/// O(sizes) pool allocations (the pool's lock is taken once per block).
pub fn allocate_batch<B: Backend>(pool: &Pool<B>, sizes: &[u64], stream: StreamId) -> Result<Vec<BlockHandle>> {
    pool.allocate_batch(sizes, stream)
}

/// Pre-populates the cache of `stream`: allocates `count` blocks of each `(size, count)`, then frees them all,
/// so later requests of those sizes on `stream` are cache hits (the segments stay until released). Sizes are
/// allocated largest first, so small blocks do not split the segments large ones need.
pub fn warm_up<B: Backend>(pool: &Pool<B>, sizes: &[(u64, usize)], stream: StreamId) -> Result<()> {
    let mut order: Vec<(u64, usize)> = sizes.to_vec();
    order.sort_by_key(|&(size, _)| std::cmp::Reverse(size));
    let flat: Vec<u64> = order.iter().flat_map(|&(size, count)| std::iter::repeat_n(size, count)).collect();
    let blocks = allocate_batch(pool, &flat, stream)?;
    for block in &blocks {
        pool.free(block)?;
    }
    Ok(())
}
