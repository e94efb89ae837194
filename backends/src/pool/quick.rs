//! The quick cache: blocks freed recently, kept per size class without coalescing so that the next request of
//! the same size takes one back in O(1) with no split and no merge. Training and inference loops free and
//! reallocate the same sizes every step, so most of their operations end here.
//!
//! Quick blocks are still live to the engine; to the pool they are free. The pool drains the cache into the
//! engine (coalescing them) before it grows, trims or snapshots, so caching never makes the pool reserve more.

use crate::engine::bins::{bin_of, BIN_COUNT};
use crate::engine::{BlockId, SegmentId};

/// Most blocks one size class keeps; further frees of that class coalesce at once.
const PER_CLASS: usize = 64;
/// Most blocks the whole cache keeps.
const TOTAL: usize = 4096;

/// A freed block waiting in the quick cache.
#[derive(Debug, Clone, Copy)]
pub(super) struct QuickBlock {
    pub(super) block: BlockId,
    pub(super) segment: SegmentId,
    pub(super) offset: u64,
    pub(super) size: u64,
}

#[derive(Debug)]
pub(super) struct QuickCache {
    classes: Vec<Vec<QuickBlock>>,
    occupied: [u64; BIN_COUNT.div_ceil(64)],
    len: usize,
}

impl QuickCache {
    pub(super) fn new() -> Self {
        Self { classes: vec![Vec::new(); BIN_COUNT], occupied: [0; BIN_COUNT.div_ceil(64)], len: 0 }
    }

    /// The class a freed block of `size` bytes would be kept in, or `None` when that class or the cache is
    /// full. O(1).
    #[inline(always)]
    pub(super) fn room_for(&self, size: u64) -> Option<usize> {
        let class = bin_of(size);
        (self.len < TOTAL && self.classes[class].len() < PER_CLASS).then_some(class)
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
        let list = &mut self.classes[class];
        if list.last()?.size < size {
            return None;
        }
        let block = list.pop()?;
        if list.is_empty() {
            self.occupied[class / 64] &= !(1 << (class % 64));
        }
        self.len -= 1;
        Some(block)
    }

    /// The most recently freed block of the smallest class above `size`'s, if any: every block there is larger
    /// than `size`. O(classes / 64).
    pub(super) fn pop_larger(&mut self, size: u64) -> Option<QuickBlock> {
        let from = bin_of(size) + 1;
        let mut word = from / 64;
        let mut bits = self.occupied.get(word)? & (u64::MAX << (from % 64));
        while bits == 0 {
            word += 1;
            bits = *self.occupied.get(word)?;
        }
        let class = word * 64 + bits.trailing_zeros() as usize;
        let list = &mut self.classes[class];
        let block = list.pop().expect("occupied classes hold blocks");
        if list.is_empty() {
            self.occupied[class / 64] &= !(1 << (class % 64));
        }
        self.len -= 1;
        Some(block)
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
