//! Several blocks at once: a batch under one lock acquisition ([`Pool::allocate_batch`]), and a cache warmed with
//! one ([`Pool::warm_up`]).

use super::Pool;
use crate::{Backend, BlockHandle, Result, StreamId};

impl<B: Backend> Pool<B> {
    /// Allocates one block per entry of `sizes` on `stream` under a single lock: all of them, or none (on an
    /// error the blocks already taken go back). Zeroed when the pool zeroes every allocation. O(len) when served
    /// from cache.
    pub fn allocate_batch(&self, sizes: &[u64], stream: StreamId) -> Result<Vec<BlockHandle>> {
        let mut blocks = Vec::with_capacity(sizes.len());
        {
            let mut state = self.state().lock();
            for &bytes in sizes {
                match self.allocate_locked(&mut state, bytes, stream) {
                    Ok(block) => blocks.push(block),
                    Err(e) => {
                        drop(state);
                        self.free_all(&blocks);
                        return Err(e);
                    }
                }
            }
        }
        if self.config.zero_on_alloc {
            if let Err(e) = blocks.iter().try_for_each(|block| self.fill(block, 0, block.size, 0)) {
                self.free_all(&blocks);
                return Err(e);
            }
        }
        Ok(blocks)
    }

    /// Pre-populates the cache of `stream`: allocates `count` blocks of each `(size, count)`, then frees them all,
    /// so later requests of those sizes on `stream` are cache hits (the segments stay until released). Sizes are
    /// allocated largest first, so small blocks do not split the segments large ones need.
    pub fn warm_up(&self, sizes: &[(u64, usize)], stream: StreamId) -> Result<()> {
        let mut order: Vec<(u64, usize)> = sizes.to_vec();
        order.sort_by_key(|&(size, _)| std::cmp::Reverse(size));
        let flat: Vec<u64> = order.iter().flat_map(|&(size, count)| std::iter::repeat_n(size, count)).collect();
        let blocks = self.allocate_batch(&flat, stream)?;
        for block in &blocks {
            self.free(block)?;
        }
        Ok(())
    }

    /// Gives back every block of a batch that could not be completed.
    fn free_all(&self, blocks: &[BlockHandle]) {
        for block in blocks {
            let _ = self.free(block);
        }
    }
}
