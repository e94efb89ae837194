//! The allocation policy: a block from the calling thread's cache, else a cached block of the request's arena
//! under the pool's lock, else new memory (mapped pages or a new segment), with one release of cached memory
//! and a retry on a shortfall before out of memory.
//!
//! One way in: every single block ([`Pool::allocate`], [`Pool::allocate_zeroed`]) comes from
//! [`Pool::allocate_any`], and every block the pool hands out from its arenas, to a caller or to a thread
//! cache, comes from [`Pool::allocate_locked`] under the pool's lock ([`Pool::allocate_batch`] calls it once
//! per block under one lock acquisition):
//!
//! 1. a cached block of the request's arena: a quick block of its size class, else one from the engine's free
//!    index (inline, O(1): the common case);
//! 2. on a miss ([`Pool::allocate_slow`], [`Pool::remap`]), a larger quick block or all of them put back into the
//!    engine, then new memory: withheld pages of a virtual reservation mapped ([`super::paging`]), else a new
//!    segment or reservation ([`Pool::grow`]), within the limit and the slack budget ([`super::trim`]);
//! 3. on a shortfall that memory may cure (the limit, a device out of memory), cached memory released and one
//!    more attempt ([`Pool::retry_on_shortfall`]); then out of memory.

use super::quick::QuickBlock;
use super::slots::Slot;
use super::state::{Arena, ArenaClass, SegmentEntry, State};
use super::thread_cache::{ThreadCache, ThreadSlot};
use super::{Pool, ARENA_BITS};
use crate::engine::Allocation;
use crate::lock::LeanGuard;
use crate::{Backend, BlockHandle, Error, Result, Strategy, StreamId};
use std::sync::atomic::Ordering;

/// Why an attempt to allocate needs more memory than the pool may take.
pub(super) enum Shortfall {
    Limit,
    Device(Error),
}

impl Shortfall {
    /// Whether releasing cached memory may cure it: not a request too large for the device, a configuration the
    /// backend refuses, or a lost device, which are reported as they are.
    pub(super) fn memory_may_cure(&self) -> bool {
        !matches!(self, Shortfall::Device(Error::TooLarge { .. } | Error::InvalidConfig(_) | Error::DeviceLost { .. }))
    }
}

impl<B: Backend> Pool<B> {
    /// Allocates a block of at least `bytes` bytes on `stream`, reusing cached memory first. O(1) when served
    /// from cache; otherwise one backend call (plus a release of cached memory and a retry when the limit or the
    /// device is exhausted).
    #[inline(always)]
    pub fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        if self.config.zero_on_alloc {
            return self.allocate_zeroed(bytes, stream);
        }
        self.allocate_any(bytes, stream)
    }

    /// The allocation itself: a small block from the calling thread's cache when it holds one (no pool lock),
    /// else through the pool.
    #[inline(always)]
    pub(super) fn allocate_any(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        if self.detour.load(Ordering::Relaxed) != 0 {
            return self.allocate_detoured(bytes, stream);
        }
        let Some((index, thread)) = self.thread_slot() else {
            return self.allocate_uncached(bytes, stream);
        };
        let slot = &self.shared.slots[index as usize];
        let size = self.rounded(bytes);
        let Some(large) = self.cached_class(slot, bytes, size) else {
            return self.allocate_uncached_from(slot, bytes, stream);
        };
        let mut cache = slot.lock();
        if let Some((arena, block, lent)) = cache.take(stream, large, size, bytes, index) {
            slot.dirty.store(true, Ordering::Relaxed);
            return Ok(self.lent_handle(arena, block, bytes, lent));
        }
        self.allocate_through_pool(cache, index, thread, bytes, size, large, stream)
    }

    /// An allocation while steps are marked or the pool sleeps (see [`Pool::detour`]).
    #[cold]
    #[inline(never)]
    fn allocate_detoured(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        if self.detour.load(Ordering::Relaxed) & super::sleep::ASLEEP != 0 {
            return Err(self.asleep("allocate"));
        }
        self.allocate_stepped(bytes, stream)
    }

    /// An allocation the calling thread's cache (`slot`) does not serve: straight to the pool. Inlined, as
    /// [`Pool::free_through_pool`] is: one call fewer on every large allocate+free pair.
    #[inline(always)]
    pub(super) fn allocate_uncached_from(&self, slot: &Slot, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let mut state = self.lock_state_folding(slot);
        self.allocate_locked(&mut state, bytes, stream)
    }

    /// `bytes` rounded up to the backend's alignment (wrapping: an overflow is caught where it matters, as a size
    /// below the request).
    #[inline(always)]
    pub(super) fn rounded(&self, bytes: u64) -> u64 {
        let align = self.alignment;
        bytes.wrapping_add(align - 1) & !(align - 1)
    }

    /// For a request of `bytes` (`size` rounded) that `cache` serves, whether it is large; `None` for one it
    /// does not (too large to keep, a large one while the thread has not met contention, or invalid).
    #[inline(always)]
    pub(super) fn cached_class(&self, slot: &Slot, bytes: u64, size: u64) -> Option<bool> {
        if bytes == 0 || size < bytes || size > self.max_block {
            None
        } else if size <= self.config.small_request_max {
            (size <= self.cached_small_max).then_some(false)
        } else {
            (size <= self.cached_large_max && slot.large.load(Ordering::Relaxed)).then_some(true)
        }
    }

    /// An allocation without thread caches (off, or the thread is exiting): straight through the pool. Kept out
    /// of line so that the cached path stays small.
    #[inline(never)]
    pub(super) fn allocate_uncached(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let mut state = self.state().lock();
        self.allocate_locked(&mut state, bytes, stream)
    }

    /// A miss of the thread's cache for a block of its classes (`size` rounded, `large` or small), under the
    /// pool's lock: a block from the pool's cached blocks (for a small one, then from this slot's own,
    /// coalesced), else new memory, lent from the slot. Folds the slot's statistics first, so that a thread
    /// working alone keeps the pool's books exact at every pool operation.
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn allocate_through_pool(
        &self,
        mut cache: LeanGuard<'_, ThreadCache>,
        slot: u32,
        thread: ThreadSlot,
        bytes: u64,
        size: u64,
        large: bool,
        stream: StreamId,
    ) -> Result<BlockHandle> {
        cache.register(thread, || self.exit_hook());
        let lender = &self.shared.slots[slot as usize];
        let mut state = self.lock_state_from(lender);
        lender.fold(&mut cache, &mut state.stats);
        let class = if large { ArenaClass::Large } else { ArenaClass::Small };
        let arena = self.arena_for(&mut state, stream, class)?;
        let (ceiling, max_bytes) = if large {
            (self.cached_large_max, self.config.thread_cache_large_bytes)
        } else {
            (self.cached_small_max, self.config.thread_cache_bytes)
        };
        if !cache.add_arena(arena as u32, stream, large, ceiling, max_bytes) {
            drop(cache);
            return self.allocate_locked(&mut state, bytes, stream);
        }
        let handle = match state.take_cached(arena, size) {
            Some(alloc) => self.hand_out(&mut state, arena, &alloc, bytes, true),
            None if !large && !self.whole_blocks => {
                // The pool has nothing cached that fits: coalesce this slot's small blocks before the pool grows,
                // so that thread caches never make the pool reserve more; where streams share, the thread's
                // blocks of its other streams too, whose segments may then serve this one (see `share`).
                cache.drain_arena(arena as u32, |r| state.take_back(r, true));
                self.allocate_sharing_own_cache(&mut state, &mut cache, bytes, stream)?
            }
            // Large blocks are cached only by threads that contend, for whom a cache emptied at every miss would
            // be no cache: the pool grows instead, by at most the cache's bound, and gets the blocks back when it
            // runs out of memory. So are small ones where every block is a segment: they do not coalesce, so
            // draining the slot rarely makes a fit, and emptied at every miss the caches of 16 threads made the
            // pool create and destroy segments under its lock (threads example, small, 16 threads on an H100:
            // 1,073 segments made in 0.3 s and 60 M pairs/s, against 155-182 M with shared segments).
            None => match self.allocate_sharing_own_cache(&mut state, &mut cache, bytes, stream) {
                Err(Error::OutOfMemory { .. }) if cache.holds_any() => {
                    // This thread's own cached blocks were out of the pool's reach (its slot is held here): give
                    // them back and try once more. The failure just counted was not the last word.
                    state.stats.num_ooms -= 1;
                    cache.drain(|r| state.take_back(r, true));
                    self.allocate_locked(&mut state, bytes, stream)?
                }
                other => other?,
            },
        };
        // A stitched block (from another arena than the cache's) is not lent: it goes back through the pool.
        if handle.arena != state.arena_base + arena as u64 {
            return Ok(handle);
        }
        // Lent from the slot: parked in the engine, so that only the slot's ticket frees it.
        let parked = state.arenas[arena].park(handle.block).expect("allocated just now");
        let block = QuickBlock {
            block: parked,
            segment: handle.segment,
            offset: handle.offset,
            size: handle.size,
            host: handle.host,
        };
        let lent = cache.adopt(arena as u32, block, slot);
        Ok(BlockHandle { block: parked, lent: Some(lent), ..handle })
    }

    /// A miss past the calling thread's own cache (`cache`, whose lock it holds): the blocks this thread keeps for
    /// its other streams go back to the pool first when the pool shares memory across streams, since they may then
    /// serve this stream (see `share`); its blocks of this stream are the caller's to drain or keep.
    fn allocate_sharing_own_cache(
        &self,
        state: &mut State<B::Segment>,
        cache: &mut ThreadCache,
        bytes: u64,
        stream: StreamId,
    ) -> Result<BlockHandle> {
        if self.shares_across_streams(state) {
            cache.drain_other_streams(stream, |r| state.take_back(r, true));
        }
        self.allocate_locked(state, bytes, stream)
    }

    /// Like [`Pool::allocate`], with every byte of the block set to zero before it is returned.
    pub fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let handle = self.allocate_any(bytes, stream)?;
        if let Err(e) = self.fill(&handle, 0, handle.size, 0) {
            let _ = self.free(&handle);
            return Err(e);
        }
        Ok(handle)
    }

    /// The allocation itself, with the lock held: validate, pick the arena, take a cached block (inline: the
    /// common case), else go the slow way (new memory, retry, errors). O(1) on a hit.
    #[inline(always)]
    pub(super) fn allocate_locked(
        &self,
        state: &mut State<B::Segment>,
        bytes: u64,
        stream: StreamId,
    ) -> Result<BlockHandle> {
        let size = self.rounded(bytes);
        // Zero, overflow while rounding, sizes past the backend's maximum and a sleeping pool all land in the
        // slow path.
        if bytes == 0
            || size < bytes
            || size > self.max_block
            || self.config.strategy != Strategy::Pooled
            || state.sleep.is_some()
        {
            return self.allocate_slow(state, bytes, stream, false);
        }
        let Some(arena) = state.arena_of(stream, self.class_of(size)) else {
            return self.allocate_slow(state, bytes, stream, false);
        };
        let alloc = match state.take_cached(arena, size) {
            Some(alloc) => alloc,
            // A virtual arena of small blocks (a tagged pool's) may hold quick blocks: the slow path puts them
            // back before it maps anything.
            None if state.arenas[arena].virtual_segments && state.arenas[arena].quick.is_empty() => {
                return self.remap(state, arena, bytes, size)
            }
            None => return self.allocate_slow(state, bytes, stream, true),
        };
        Ok(self.hand_out(state, arena, &alloc, bytes, true))
    }

    /// Records `alloc` of `arena` as handed out (see [`State::record_alloc`]) and returns its handle, with the
    /// host address of its first byte where the backend says the memory is host-addressable (looked up here,
    /// under the lock, where the segment is at hand). Every block the pool hands out from its arenas passes here.
    #[inline(always)]
    pub(super) fn hand_out(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        alloc: &Allocation,
        bytes: u64,
        hit: bool,
    ) -> BlockHandle {
        let mut handle = state.record_alloc(arena, alloc, bytes, hit);
        if self.backend.may_be_host_addressable() {
            let segment = state.arenas[arena].entry(alloc.segment).map(|entry| &entry.handle);
            handle.host = segment
                .and_then(|segment| self.backend.host_ptr(segment, alloc.offset))
                .map_or(0, |ptr| ptr.as_non_null().as_ptr() as usize);
        }
        handle
    }

    /// A miss in a virtual arena, straight to mapping withheld pages: the common miss under memory pressure,
    /// spared the slow path's validation and cache checks (a large arena has no quick blocks). When no withheld
    /// range fits it grows, and on a shortfall (the limit, a device error) it releases cached memory and tries
    /// again, as the slow path does after the same steps.
    #[cold]
    #[inline(never)]
    pub(super) fn remap(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        bytes: u64,
        size: u64,
    ) -> Result<BlockHandle> {
        debug_assert!(state.arenas[arena].quick.is_empty(), "virtual arenas cache no quick blocks");
        if let Some(alloc) = self.reclaim_thread_caches(state, arena, size) {
            return Ok(self.hand_out(state, arena, &alloc, bytes, true));
        }
        // Blocks other streams borrowed and freed come home first (this arena's among them), then another
        // stream's free block serves where it lies before any page moves (see `borrow`).
        if let Some((giver, alloc)) = self.reuse_loan(state, arena, size) {
            return Ok(self.hand_out(state, giver, &alloc, bytes, true));
        }
        if self.return_loans(state, true, false) {
            if let Some(alloc) = state.take_cached(arena, size) {
                return Ok(self.hand_out(state, arena, &alloc, bytes, true));
            }
        }
        if let Some((giver, alloc)) = self.borrow_block(state, arena, size) {
            return Ok(self.hand_out(state, giver, &alloc, bytes, true));
        }
        if let Some((stitch_arena, alloc, made)) = self.stitched(state, arena, size) {
            return Ok(self.hand_out(state, stitch_arena, &alloc, bytes, !made));
        }
        let result = match self.map_withheld(state, arena, size) {
            Ok(Some(alloc)) => return Ok(self.hand_out(state, arena, &alloc, bytes, false)),
            Ok(None) => self.grow(state, arena, size).map(|alloc| (alloc, false)),
            Err(shortfall) => Err(shortfall),
        };
        self.retry_on_shortfall(state, arena, bytes, size, result)
    }

    /// The arena class of a request of `size` (rounded) bytes: small requests share small segments, except in the
    /// `direct` strategy, which caches nothing.
    #[inline(always)]
    pub(super) fn class_of(&self, size: u64) -> ArenaClass {
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
    pub(super) fn allocate_slow(
        &self,
        state: &mut State<B::Segment>,
        bytes: u64,
        stream: StreamId,
        cache_missed: bool,
    ) -> Result<BlockHandle> {
        if bytes == 0 {
            return Err(Error::ZeroSize { device: self.backend.name().to_string() });
        }
        if state.sleep.is_some() {
            return Err(self.asleep("allocate"));
        }
        let align = self.alignment;
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
    pub(super) fn retry_on_shortfall(
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
            Ok((alloc, hit)) => Ok(self.hand_out(state, arena, &alloc, bytes, hit)),
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
            // A tagged pool keeps small blocks in reservations too, so that all of it can sleep.
            let virtual_segments =
                (class == ArenaClass::Large || self.config.tag.is_some()) && self.page_size.is_some();
            let (alignment, small_max) = (self.alignment, self.config.small_request_max);
            state.arenas.push(Arena::new(stream, class, virtual_segments, alignment, small_max, self.whole_blocks));
        }
        state.streams.insert(stream, [first, first + 1]);
        Ok(first as usize + slot)
    }

    /// One attempt: a cached block, else new memory within the limit. Returns the block and whether it was a
    /// cache hit. `cache_missed`: the caller just found no quick block of the request's class and no free block
    /// in the engine (with the lock held since), so those two lookups are not repeated.
    pub(super) fn try_allocate(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
        cache_missed: bool,
    ) -> std::result::Result<(Allocation, bool), Shortfall> {
        if self.config.strategy == Strategy::Pooled {
            let mut found = if cache_missed { None } else { state.take_cached(arena, size) };
            if found.is_none() {
                // A larger quick block serves the request once it is back in the engine; failing that, coalesce
                // all of them before asking the device for more.
                if let Some(q) = state.arenas[arena].quick.pop_larger(size) {
                    state.free_block(arena, q.block).expect("quick blocks are parked");
                    found = state.allocate_from_engine(arena, size);
                }
                if found.is_none() && !state.arenas[arena].quick.is_empty() {
                    state.arenas[arena].quick.shrink();
                    state.drain_quick(arena);
                    found = state.allocate_from_engine(arena, size);
                }
            }
            if let Some(alloc) = found.or_else(|| self.reclaim_thread_caches(state, arena, size)) {
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

    /// Before the pool takes new memory for `size` bytes in `arena`, where streams share memory: the free blocks
    /// other threads' caches hold for other streams go back to their arenas, coalesced, where `share` can move
    /// them, and the arena is asked again. A thread cache keeps up to `thread_cache_large_bytes` (1 GiB) of large
    /// blocks per stream once its thread has met contention; an inference server of 4 threads, each on its own
    /// stream, reserved 4.4-4.9 × its peak of allocated memory through PyTorch with them (H100,
    /// `bench_serve.py`; PyTorch's allocator 3.5), 1.5 when other threads' caches were taken back at every such
    /// miss. A thread's blocks of its own miss's stream stay: taking back every cache at every miss that would
    /// grow the pool, the caches of 16 threads on one stream emptied each other about 5,000 times in 0.6 s and
    /// the threads example fell from 132-190 M pairs/s to 20-27 (large) and 113-184 to 14-17 (small); limited to
    /// once per eighth of growth, the server's memory went back to 4.2 ×. A slot whose lock is taken keeps its
    /// blocks (the lock order forbids waiting for it here). Not where every block is a segment: whole blocks do
    /// not coalesce (see [`Pool::allocate_through_pool`]). O(slots) on such a miss.
    pub(super) fn reclaim_thread_caches(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> Option<Allocation> {
        if self.whole_blocks || !self.shares_across_streams(state) {
            return None;
        }
        let stream = state.arenas[arena].stream;
        let mut reclaimed = false;
        for slot in self.shared.slots.iter() {
            let Some(mut cache) = slot.cache.try_lock() else { continue };
            if cache.holds_any() {
                slot.fold(&mut cache, &mut state.stats);
                cache.drain_other_streams(stream, |r| {
                    state.take_back(r, true);
                    reclaimed = true;
                });
            }
        }
        if !reclaimed {
            return None;
        }
        state.update_split();
        state.take_cached(arena, size)
    }

    /// Adds a segment (or a virtual reservation) that fits `size` and allocates from it.
    pub(super) fn grow(
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
            state.add_segment(arena, reservation, entry);
            state.stats.segments.add(1);
            let alloc = self.map_withheld(state, arena, size)?.expect("a fresh reservation holds the request");
            return Ok(alloc);
        }
        let preferred = match state.arenas[arena].class {
            _ if self.config.strategy == Strategy::Direct || self.whole_blocks => round(size),
            ArenaClass::Small => round(self.config.small_segment_size.max(size)),
            ArenaClass::Large if size < self.config.large_segment_size / 2 => round(self.config.large_segment_size),
            ArenaClass::Large | ArenaClass::Planned | ArenaClass::Stitched => round(size),
        }
        // The largest segment the backend makes, rounded down to the granularity: a segment size must be one
        // the engine keeps as it is, or the pool would count other bytes than the engine hands out.
        .min(self.backend.max_segment_size() / granularity * granularity)
        .max(size);
        // Another stream's empty segment of about the size this one would make, before a new one (see `share`).
        if let Some(alloc) = self.adopt_empty_segment(state, arena, size, preferred) {
            return Ok(alloc);
        }
        // Empty segments that would leave reserved memory above its `segment_slack` budget go first.
        let excess =
            (state.reserved() + preferred).saturating_sub(Self::trim_budget(state, self.config.segment_slack, size));
        if excess > 0 && state.has_empty_plain_segments() {
            self.release_empty_segments(state, excess);
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
        let seg = state.add_segment(arena, seg_size, entry);
        state.stats.segments.add(1);
        state.update_reserved();
        Ok(state.allocate_in(arena, seg, size).expect("fresh segment fits"))
    }

    pub(super) fn out_of_memory(&self, state: &mut State<B::Segment>, size: u64, shortfall: Shortfall) -> Error {
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
            free: self.backend.free_bytes(),
            cached: reserved - allocated,
            reserved,
            limit: state.stats.limit_bytes,
            cause,
        }
    }
}
