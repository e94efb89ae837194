//! The quick cache: blocks freed recently, kept per size class without coalescing so that the next request of
//! the same size takes one back in O(1) with no split and no merge. Training and inference loops free and
//! reallocate the same sizes every step, so most of their operations end here.
//!
//! Quick blocks are still live to the engine; to the pool they are free. The pool drains the cache into the
//! engine (coalescing them) before it grows, trims or snapshots, so caching never makes the pool reserve more.
//!
//! Parked blocks are memory the engine cannot hand out. When requests of ever new sizes meet blocks freed at
//! sizes nobody asks for again (variable-length inputs), the engine runs dry and the pool drains the whole cache
//! on the slow path, over and over. So the largest size the cache keeps adapts: it halves at every drain forced
//! by a miss (down to 64 KiB, where blocks churn most) and doubles back after a run of hits. Loops that reuse
//! their sizes never drain and keep every size; on the `variable` trace the limit cuts instructions per
//! operation by 15%.

use crate::engine::bins::{bin_of, BIN_COUNT};
use crate::engine::{BlockId, SegmentId};

/// Most blocks one size class keeps; further frees of that class coalesce at once.
const PER_CLASS: usize = 64;
/// Most blocks the whole cache keeps.
const TOTAL: usize = 4096;
/// The largest block size the cache keeps never drops below this: small blocks are the ones that churn.
const MAX_BLOCK_FLOOR: u64 = 64 << 10;
/// Quick hits in a row (no drain forced by a miss in between) after which the largest kept size doubles again.
const HITS_TO_GROW: u32 = 1024;

/// A freed block waiting in the quick cache.
#[derive(Debug, Clone, Copy)]
pub(super) struct QuickBlock {
    pub(super) block: BlockId,
    pub(super) segment: SegmentId,
    pub(super) offset: u64,
    pub(super) size: u64,
    /// See [`crate::BlockHandle`]'s `host`: kept with a block parked in a thread cache, so that lending it
    /// needs no look-up of its segment. Blocks of the pool's own quick cache get theirs when taken, under the
    /// lock, and keep 0 here.
    pub(super) host: usize,
}

#[derive(Debug)]
pub(super) struct QuickCache {
    classes: Vec<Vec<QuickBlock>>,
    occupied: [u64; BIN_COUNT.div_ceil(64)],
    len: usize,
    /// Blocks above this size are not kept: it halves whenever parked blocks starve the engine (a drain forced
    /// by a miss) and doubles back, up to `ceiling`, after a run of hits.
    max_block: u64,
    ceiling: u64,
    hits: u32,
}

impl QuickCache {
    /// An empty cache for blocks of up to `ceiling` bytes. It holds a list for each class up to the ceiling's and
    /// no more (a pool makes one per stream: with every class, 46 KiB of empty lists each).
    pub(super) fn new(ceiling: u64) -> Self {
        Self {
            classes: vec![Vec::new(); bin_of(ceiling) + 1],
            occupied: [0; BIN_COUNT.div_ceil(64)],
            len: 0,
            max_block: ceiling,
            ceiling,
            hits: 0,
        }
    }

    /// A cache that keeps nothing (for arenas of large blocks, which coalesce every free): it holds no lists.
    pub(super) fn disabled() -> Self {
        Self { classes: Vec::new(), occupied: [0; BIN_COUNT.div_ceil(64)], len: 0, max_block: 0, ceiling: 0, hits: 0 }
    }

    /// The class a freed block of `size` bytes would be kept in, or `None` when that class or the cache is
    /// full. O(1).
    #[inline(always)]
    pub(super) fn room_for(&self, size: u64) -> Option<usize> {
        let class = bin_of(size);
        let room = |list: &Vec<QuickBlock>| list.len() < PER_CLASS;
        (size <= self.max_block && self.len < TOTAL && self.classes.get(class).is_some_and(room)).then_some(class)
    }

    /// Keeps `block` in `class`, which [`QuickCache::room_for`] returned for its size. O(1).
    #[inline(always)]
    pub(super) fn push(&mut self, class: usize, block: QuickBlock) {
        debug_assert_eq!(Some(class), self.room_for(block.size));
        self.classes[class].push(block);
        self.occupied[class / 64] |= 1 << (class % 64);
        self.len += 1;
    }

    /// The most recently freed block of `size`'s class if it is at least `size` bytes (sizes in one class
    /// differ by under 1/32). O(1).
    #[inline(always)]
    pub(super) fn pop(&mut self, size: u64) -> Option<QuickBlock> {
        let class = bin_of(size);
        // No list past the ceiling's class: nothing that large is kept.
        let list = self.classes.get_mut(class)?;
        if list.last()?.size < size {
            return None;
        }
        let block = list.pop()?;
        if list.is_empty() {
            self.occupied[class / 64] &= !(1 << (class % 64));
        }
        self.len -= 1;
        self.hits += 1;
        if self.hits == HITS_TO_GROW {
            self.hits = 0;
            self.max_block = self.max_block.saturating_mul(2).min(self.ceiling);
        }
        Some(block)
    }

    /// Halves the largest size kept (not below a floor): the caller just had to drain the cache because its
    /// parked blocks left the engine nothing that fits, the sign of sizes that are freed but not asked for again.
    pub(super) fn shrink(&mut self) {
        self.max_block = (self.max_block / 2).max(MAX_BLOCK_FLOOR.min(self.ceiling));
        self.hits = 0;
    }

    /// The most recently freed block of the smallest class above `size`'s, if any: every block there is larger
    /// than `size`. O(1) when the cache is empty (always, in arenas of large blocks), else O(classes / 64).
    pub(super) fn pop_larger(&mut self, size: u64) -> Option<QuickBlock> {
        if self.len == 0 {
            return None;
        }
        let from = bin_of(size) + 1;
        let mut word = from / 64;
        let mut bits = self.occupied.get(word)? & (u64::MAX << (from % 64));
        while bits == 0 {
            word += 1;
            bits = *self.occupied.get(word)?;
        }
        Some(self.pop_class(word * 64 + bits.trailing_zeros() as usize))
    }

    /// The most recently freed block of the largest class held, if any. O(classes / 64).
    pub(super) fn pop_largest(&mut self) -> Option<QuickBlock> {
        if self.len == 0 {
            return None;
        }
        let word = self.occupied.iter().rposition(|&bits| bits != 0)?;
        Some(self.pop_class(word * 64 + 63 - self.occupied[word].leading_zeros() as usize))
    }

    /// The most recently freed block of `class`, which holds blocks.
    fn pop_class(&mut self, class: usize) -> QuickBlock {
        let list = &mut self.classes[class];
        let block = list.pop().expect("occupied classes hold blocks");
        if list.is_empty() {
            self.occupied[class / 64] &= !(1 << (class % 64));
        }
        self.len -= 1;
        block
    }

    /// Takes every block out, handing each to `take`. O(blocks + classes / 64), without allocating.
    pub(super) fn drain(&mut self, mut take: impl FnMut(QuickBlock)) {
        for word in 0..self.occupied.len() {
            let mut bits = self.occupied[word];
            while bits != 0 {
                let class = word * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                self.classes[class].drain(..).for_each(&mut take);
            }
            self.occupied[word] = 0;
        }
        self.len = 0;
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Engine;

    fn block(engine: &mut Engine, size: u64) -> QuickBlock {
        let alloc = engine.allocate(size).expect("the segment has room");
        QuickBlock { block: alloc.block, segment: alloc.segment, offset: alloc.offset, size: alloc.size, host: 0 }
    }

    #[test]
    fn the_largest_kept_size_halves_on_starvation_and_grows_back_after_hits() {
        let mut engine = Engine::new(256).expect("power of two");
        engine.add_segment(1 << 30).expect("valid size");
        let mut cache = QuickCache::new(1 << 20);
        assert!(cache.room_for(1 << 20).is_some(), "starts at the ceiling");
        cache.shrink();
        assert!(cache.room_for(1 << 20).is_none());
        assert!(cache.room_for(512 << 10).is_some());
        for _ in 0..10 {
            cache.shrink();
        }
        assert!(cache.room_for(MAX_BLOCK_FLOOR + 256).is_none(), "stops at the floor");
        assert!(cache.room_for(MAX_BLOCK_FLOOR).is_some());

        // A run of hits doubles it again, one step per run, never past the ceiling.
        let size = 4096;
        let class = cache.room_for(size).expect("room");
        for run in 0..10 {
            for _ in 0..HITS_TO_GROW {
                cache.push(class, block(&mut engine, size));
                assert!(cache.pop(size).is_some());
            }
            assert_eq!(cache.max_block, (MAX_BLOCK_FLOOR << (run + 1)).min(1 << 20));
        }
        assert!(cache.room_for(1 << 20).is_some());
        assert!(cache.is_empty());
    }

    #[test]
    fn a_ceiling_below_the_floor_is_kept() {
        let mut cache = QuickCache::new(16 << 10);
        cache.shrink();
        assert!(cache.room_for(16 << 10).is_some(), "the floor never exceeds the ceiling");
        assert!(cache.room_for((16 << 10) + 256).is_none());
    }
}
