//! The allocation policy. Every public way to allocate goes through [`Pool::allocate_with`] (the calling
//! thread's cache, else the pool, then the block's contents), and every block the pool hands out from its own
//! arenas comes from [`Pool::allocate_locked`], under the pool's lock:
//!
//! 1. a cached block of the request's arena: a quick block of its size class, else one from the engine's free
//!    index (inline, O(1): the common case);
//! 2. on a miss, a larger quick block or all of them put back into the engine;
//! 3. then new memory: withheld pages of a virtual reservation mapped ([`super::paging`]), else a new segment
//!    or reservation (`grow`), within the limit and the slack budgets ([`super::trim`]);
//! 4. on a shortfall that memory may cure (the limit, a device out of memory), cached memory released and one
//!    more attempt; then out of memory.
//!
//! Segment sizes follow PyTorch (see the [module map](super)); a segment's size is a whole multiple of the
//! backend's granularity, the size the engine keeps, so the pool counts the bytes the engine holds.

use super::quick::QuickCache;
use super::state::{Arena, ArenaClass, SegmentEntry, State};
use super::{Pool, Slot, ARENA_BITS};
use crate::engine::Allocation;
use crate::{Backend, BlockHandle, Error, Result, Strategy, StreamId};

/// What a new block's bytes are set to before it is returned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Contents {
    /// Whatever the memory held.
    Any,
    /// Every byte zero.
    Zeroed,
}

/// Why an attempt to allocate needs more memory than the pool may take.
pub(super) enum Shortfall {
    Limit,
    Device(Error),
}

impl Shortfall {
    /// Whether releasing cached memory may cure it: not a request too large for the device, a configuration the
    /// backend refuses, or a lost device, which are reported as they are.
    fn memory_may_cure(&self) -> bool {
        !matches!(self, Shortfall::Device(Error::TooLarge { .. } | Error::InvalidConfig(_) | Error::DeviceLost { .. }))
    }
}

/// A hook [`Pool::allocate_locked`] calls once when the arena holds nothing cached that fits, before it takes
/// new memory: a thread cache's refill puts its own blocks back there, and the cached lookup runs once more.
/// `()` does nothing (and the lookup does not run again).
pub(super) trait OnMiss<S> {
    /// Returns whether it may have made a cached block available.
    fn on_miss(&mut self, state: &mut State<S>, arena: usize) -> bool;
}

impl<S> OnMiss<S> for () {
    #[inline(always)]
    fn on_miss(&mut self, _: &mut State<S>, _: usize) -> bool {
        false
    }
}

impl<S, F: FnMut(&mut State<S>, usize)> OnMiss<S> for F {
    #[inline(always)]
    fn on_miss(&mut self, state: &mut State<S>, arena: usize) -> bool {
        self(state, arena);
        true
    }
}

impl<B: Backend> Pool<B> {
    /// Allocates a block of at least `bytes` bytes on `stream`, reusing cached memory first. O(1) when served
    /// from cache; otherwise one backend call (plus a release of cached memory and a retry when the limit or the
    /// device is exhausted).
    #[inline(always)]
    pub fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let contents = if self.config.zero_on_alloc { Contents::Zeroed } else { Contents::Any };
        self.allocate_with(bytes, stream, contents)
    }

    /// Like [`Pool::allocate`], with every byte of the block set to zero before it is returned.
    pub fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.allocate_with(bytes, stream, Contents::Zeroed)
    }

    /// Allocates one block per entry of `sizes` on `stream` under a single lock: all of them, or none (on an
    /// error the blocks already taken go back). Zeroed when the pool zeroes every allocation. O(len) when served
    /// from cache.
    pub fn allocate_batch(&self, sizes: &[u64], stream: StreamId) -> Result<Vec<BlockHandle>> {
        let mut blocks = Vec::with_capacity(sizes.len());
        {
            let mut state = self.state().lock();
            for &bytes in sizes {
                match self.allocate_locked(&mut state, bytes, stream, ()) {
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
            for block in &blocks {
                if let Err(e) = self.fill(block, 0, block.size, 0) {
                    self.free_all(&blocks);
                    return Err(e);
                }
            }
        }
        Ok(blocks)
    }

    fn free_all(&self, blocks: &[BlockHandle]) {
        for block in blocks {
            let _ = self.free(block);
        }
    }

    /// Every public allocation: a block from [`Pool::take_block`], with its `contents` set (on a failure to set
    /// them the block goes back and the error is returned).
    #[inline(always)]
    fn allocate_with(&self, bytes: u64, stream: StreamId, contents: Contents) -> Result<BlockHandle> {
        let handle = self.take_block(bytes, stream)?;
        if contents == Contents::Zeroed {
            self.zero(&handle)?;
        }
        Ok(handle)
    }

    #[cold]
    #[inline(never)]
    fn zero(&self, handle: &BlockHandle) -> Result<()> {
        self.fill(handle, 0, handle.size, 0).inspect_err(|_| {
            let _ = self.free(handle);
        })
    }

    /// The block itself: a small block from the calling thread's cache when it holds one (no pool lock), else
    /// through the pool.
    #[inline(always)]
    fn take_block(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let Some((index, thread)) = self.thread_slot() else {
            return self.allocate_uncached(bytes, stream);
        };
        let slot = &self.shared.slots[index as usize];
        let size = self.rounded(bytes);
        let Some(large) = self.cached_class(slot, bytes, size) else {
            let mut state = self.lock_state_folding(slot);
            return self.allocate_locked(&mut state, bytes, stream, ());
        };
        let mut cache = slot.lock();
        if let Some((arena, block, lent)) = cache.take(stream, large, size, bytes, index) {
            slot.dirty.store(true, std::sync::atomic::Ordering::Relaxed);
            return Ok(self.lent_handle(arena, block, bytes, lent));
        }
        self.refill(cache, index, thread, bytes, large, stream)
    }

    /// An allocation without thread caches (off, or the thread is exiting): straight through the pool. Kept out
    /// of line so that the cached path stays small.
    #[inline(never)]
    fn allocate_uncached(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let mut state = self.state().lock();
        self.allocate_locked(&mut state, bytes, stream, ())
    }

    /// `bytes` rounded up to the backend's alignment (wrapping: an overflow is caught where it matters, as a size
    /// below the request).
    #[inline(always)]
    pub(super) fn rounded(&self, bytes: u64) -> u64 {
        let align = self.backend.alignment();
        bytes.wrapping_add(align - 1) & !(align - 1)
    }

    /// For a request of `bytes` (`size` rounded) that `cache` serves, whether it is large; `None` for one it
    /// does not (too large to keep, a large one while the thread has not met contention, or invalid).
    #[inline(always)]
    fn cached_class(&self, slot: &Slot, bytes: u64, size: u64) -> Option<bool> {
        if bytes == 0 || size < bytes || size > self.max_block {
            None
        } else if size <= self.config.small_request_max {
            (size <= self.cached_small_max).then_some(false)
        } else {
            (size <= self.cached_large_max && slot.large.load(std::sync::atomic::Ordering::Relaxed)).then_some(true)
        }
    }

    /// The one way into allocation, with the lock held: validate, pick the arena, take a cached block (inline:
    /// the common case), else go the slow way (`on_miss`, new memory, retry, errors). O(1) on a hit.
    #[inline(always)]
    pub(super) fn allocate_locked(
        &self,
        state: &mut State<B::Segment>,
        bytes: u64,
        stream: StreamId,
        mut on_miss: impl OnMiss<B::Segment>,
    ) -> Result<BlockHandle> {
        let size = self.rounded(bytes);
        // Zero, overflow while rounding, and sizes past the backend's maximum all land in the slow path.
        if bytes == 0 || size < bytes || size > self.max_block || self.config.strategy != Strategy::Pooled {
            return self.allocate_slow(state, bytes, stream, false);
        }
        let Some(arena) = state.arena_of(stream, self.class_of(size)) else {
            return self.allocate_slow(state, bytes, stream, false);
        };
        if let Some(alloc) = state.take_cached(arena, size) {
            return Ok(state.record_alloc(arena, &alloc, bytes, true));
        }
        self.allocate_missed(state, arena, bytes, stream, size, &mut on_miss)
    }

    /// A miss of [`Pool::allocate_locked`]'s cached lookup in `arena`: `on_miss`, and the cached lookup again
    /// when it did anything, else new memory.
    #[cold]
    #[inline(never)]
    fn allocate_missed(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        bytes: u64,
        stream: StreamId,
        size: u64,
        on_miss: &mut dyn OnMiss<B::Segment>,
    ) -> Result<BlockHandle> {
        if on_miss.on_miss(state, arena) {
            if let Some(alloc) = state.take_cached(arena, size) {
                return Ok(state.record_alloc(arena, &alloc, bytes, true));
            }
        }
        if state.arenas[arena].virtual_segments {
            return self.remap(state, arena, bytes, size);
        }
        self.allocate_slow(state, bytes, stream, true)
    }

    /// A miss in a virtual arena, straight to mapping withheld pages: the common miss under memory pressure,
    /// spared the slow path's validation and cache checks (a large arena has no quick blocks). When no withheld
    /// range fits it grows, and on a shortfall (the limit, a device error) it releases cached memory and tries
    /// again, as the slow path does after the same steps.
    fn remap(&self, state: &mut State<B::Segment>, arena: usize, bytes: u64, size: u64) -> Result<BlockHandle> {
        debug_assert!(state.arenas[arena].quick.is_empty(), "virtual arenas cache no quick blocks");
        let result = match self.map_withheld(state, arena, size) {
            Ok(Some(alloc)) => return Ok(state.record_alloc(arena, &alloc, bytes, false)),
            Ok(None) => self.grow(state, arena, size).map(|alloc| (alloc, false)),
            Err(shortfall) => Err(shortfall),
        };
        self.retry_on_shortfall(state, arena, bytes, size, result)
    }

    /// The arena class of a request of `size` (rounded) bytes: small requests share small segments, except in the
    /// `direct` strategy, which caches nothing.
    #[inline(always)]
    fn class_of(&self, size: u64) -> ArenaClass {
        if size <= self.config.small_request_max && self.config.strategy == Strategy::Pooled {
            ArenaClass::Small
        } else {
            ArenaClass::Large
        }
    }

    /// Everything [`Pool::allocate_locked`] does not do inline: validation errors, the first use of a stream,
    /// draining the quick cache, mapping or growing, releasing cached memory and retrying once on a shortfall.
    /// `cache_missed`: the inline path already looked for a quick block and a free block, and found none.
    #[cold]
    #[inline(never)]
    fn allocate_slow(
        &self,
        state: &mut State<B::Segment>,
        bytes: u64,
        stream: StreamId,
        cache_missed: bool,
    ) -> Result<BlockHandle> {
        if bytes == 0 {
            return Err(Error::ZeroSize { device: self.backend.name().to_string() });
        }
        let align = self.backend.alignment();
        let size = bytes
            .checked_add(align - 1)
            .map(|s| s & !(align - 1))
            .ok_or_else(|| Error::SizeOverflow { what: format!("{bytes} bytes rounded up to {align}") })?;
        let max = self.max_block;
        if size > max {
            return Err(Error::TooLarge { device: self.backend.name().to_string(), requested: size, max });
        }
        let arena = self.arena_for(state, stream, self.class_of(size))?;
        let result = self.try_allocate(state, arena, size, cache_missed);
        self.retry_on_shortfall(state, arena, bytes, size, result)
    }

    /// Records the outcome of a first attempt, or, on a shortfall, releases cached memory and tries once more
    /// (then reports out of memory).
    fn retry_on_shortfall(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        bytes: u64,
        size: u64,
        mut result: std::result::Result<(Allocation, bool), Shortfall>,
    ) -> Result<BlockHandle> {
        if matches!(&result, Err(shortfall) if shortfall.memory_may_cure()) {
            state.stats.num_alloc_retries += 1;
            self.release_cached_locked(state, 0, size);
            result = self.try_allocate(state, arena, size, false);
        }
        match result {
            Ok((alloc, hit)) => Ok(state.record_alloc(arena, &alloc, bytes, hit)),
            Err(shortfall) => Err(self.out_of_memory(state, size, shortfall)),
        }
    }

    /// The arena of `stream` for `class`, created on the stream's first use. O(1). Errors when
    /// the pool already serves 32,768 streams (see [`ARENA_BITS`]).
    pub(super) fn arena_for(
        &self,
        state: &mut State<B::Segment>,
        stream: StreamId,
        class: ArenaClass,
    ) -> Result<usize> {
        if let Some(arena) = state.arena_of(stream, class) {
            return Ok(arena);
        }
        if state.arenas.len() + 2 > 1 << ARENA_BITS {
            return Err(Error::InvalidConfig(format!(
                "pool {} serves {} streams already, the most one pool can",
                self.backend.name(),
                state.streams.len()
            )));
        }
        let slot = usize::from(class == ArenaClass::Large);
        let first = state.arenas.len() as u32;
        for class in [ArenaClass::Small, ArenaClass::Large] {
            let quick = match class {
                ArenaClass::Small => QuickCache::new(self.config.small_request_max),
                ArenaClass::Large => QuickCache::disabled(),
            };
            let virtual_segments = class == ArenaClass::Large && self.page_size.is_some();
            state.arenas.push(Arena::new(stream, self.backend.alignment(), class, virtual_segments, quick));
        }
        state.streams.insert(stream, [first, first + 1]);
        Ok(first as usize + slot)
    }

    /// One attempt: a cached block, else new memory within the limit. Returns the block and whether it was a
    /// cache hit. `cache_missed`: the caller just found no quick block of the request's class and no free block
    /// in the engine (with the lock held since), so those two lookups are not repeated.
    fn try_allocate(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
        cache_missed: bool,
    ) -> std::result::Result<(Allocation, bool), Shortfall> {
        if self.config.strategy == Strategy::Pooled {
            let found = if cache_missed { None } else { state.take_cached(arena, size) };
            if let Some(alloc) = found.or_else(|| state.take_after_quick_miss(arena, size)) {
                return Ok((alloc, true));
            }
            if state.arenas[arena].virtual_segments {
                if let Some(alloc) = self.map_withheld(state, arena, size)? {
                    return Ok((alloc, false));
                }
            }
        }
        let alloc = self.grow(state, arena, size)?;
        Ok((alloc, false))
    }

    /// Adds a segment (or a virtual reservation) that fits `size` and allocates from it.
    fn grow(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> std::result::Result<Allocation, Shortfall> {
        let granularity = self.backend.segment_granularity();
        let round = |s: u64| s.div_ceil(granularity) * granularity;
        if state.arenas[arena].virtual_segments {
            let page = self.page_size.unwrap_or(granularity);
            let reservation = self.max_reservation.max(size.div_ceil(page) * page);
            state.stats.num_device_calls += 1;
            let handle = self.backend.reserve_virtual(reservation).map_err(Shortfall::Device)?;
            let entry =
                SegmentEntry { handle, mapped: Some(0), last_used_round: state.cleanup_round, last_used_alloc: 0 };
            state.add_segment(arena, reservation, entry, true);
            state.stats.segments.add(1);
            let alloc = self.map_withheld(state, arena, size)?.expect("a fresh reservation holds the request");
            return Ok(alloc);
        }
        let preferred = match state.arenas[arena].class {
            _ if self.config.strategy == Strategy::Direct => round(size),
            ArenaClass::Small => round(self.config.small_segment_size.max(size)),
            ArenaClass::Large if size < self.config.large_segment_size / 2 => round(self.config.large_segment_size),
            ArenaClass::Large => round(size),
        }
        // The largest segment the backend makes, rounded down to the granularity: a segment size must be one
        // the engine keeps as it is, or the pool would count other bytes than the engine hands out.
        .min(self.backend.max_segment_size() / granularity * granularity)
        .max(size);
        // Empty segments that would leave reserved memory above its `segment_slack` budget go first.
        let excess =
            (state.reserved() + preferred).saturating_sub(Self::trim_budget(state, self.config.segment_slack, size));
        if excess > 0 && state.empty_plain_bytes() > 0 {
            self.release_least_recent_empty_segments(state, excess);
        }
        // Under a limit, fall back to a segment of just the request's size rather than fail.
        let limit = state.stats.limit_bytes;
        let fits = |s: u64| limit.is_none_or(|l| state.reserved() + s <= l);
        let seg_size = if fits(preferred) {
            preferred
        } else if fits(round(size)) {
            round(size)
        } else {
            return Err(Shortfall::Limit);
        };
        state.stats.num_device_calls += 1;
        let handle = self.backend.create_segment(seg_size).map_err(Shortfall::Device)?;
        state.stats.num_device_alloc += 1;
        let entry = SegmentEntry { handle, mapped: None, last_used_round: state.cleanup_round, last_used_alloc: 0 };
        let seg = state.add_segment(arena, seg_size, entry, false);
        state.stats.segments.add(1);
        state.update_reserved();
        Ok(state.allocate_in(arena, seg, size).expect("fresh segment fits"))
    }

    fn out_of_memory(&self, state: &mut State<B::Segment>, size: u64, shortfall: Shortfall) -> Error {
        state.stats.num_ooms += 1;
        if !shortfall.memory_may_cure() {
            let Shortfall::Device(e) = shortfall else { unreachable!("a limit is cured by memory") };
            return e;
        }
        let reserved = state.reserved();
        let allocated = state.stats.allocated_bytes.current;
        let cause = match shortfall {
            Shortfall::Device(e) => Some(e.to_string()),
            Shortfall::Limit => None,
        };
        Error::OutOfMemory {
            device: self.backend.name().to_string(),
            requested: size,
            free: self.backend.free_memory(),
            cached: reserved - allocated,
            reserved,
            limit: state.stats.limit_bytes,
            cause,
        }
    }
}
