//! What the pool's lock guards: [`State`], its arenas (one free index per stream and size class) and the books
//! kept on them.
//!
//! The engines are private to this module: every change to a free index goes through a `State` method here,
//! and each of those passes the engine's report of a plain segment turning empty ([`Freed::segment_now_empty`])
//! or ceasing to be ([`Allocation::segment_was_empty`]), or of one being added or removed, to
//! [`State::note_emptiness`], the only code that moves `empty_plain_bytes`. The bytes it counts are the
//! engine's own segment sizes, so the figure cannot drift from what the engine holds; a segment the engine
//! would size differently from what the backend created is refused by a debug assertion where it is added.
//! Everything here is O(1) per call except the drains, which are O(blocks drained).

use super::quick::{QuickBlock, QuickCache};
use super::streams::StreamArenas;
use super::thread_cache::{Returned, ThreadCache};
use super::Slot;
use crate::engine::{Allocation, Engine, Freed, Restore, SegmentId};
use crate::{BlockHandle, PoolStats, StreamId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ArenaClass {
    Small,
    Large,
}

pub(super) struct SegmentEntry<S> {
    pub(super) handle: S,
    /// `Some` for a virtual reservation: its mapped bytes (everything its engine segment does not withhold).
    pub(super) mapped: Option<u64>,
    /// Cleanup round in which a block was last taken from this segment.
    pub(super) last_used_round: u64,
    /// The pool's allocation count (hits and misses) when a block was last taken from this segment.
    pub(super) last_used_alloc: u64,
}

/// One free index: the blocks of one stream and one size class. A virtual arena (`virtual_segments`) holds
/// reservations only, a plain one plain segments only.
pub(super) struct Arena<S> {
    /// The stream it serves.
    pub(super) stream: StreamId,
    /// Private: changed only through [`State`]'s methods, which keep the books.
    engine: Engine,
    pub(super) class: ArenaClass,
    pub(super) virtual_segments: bool,
    pub(super) segments: Vec<Option<SegmentEntry<S>>>,
    pub(super) quick: QuickCache,
}

impl<S> Arena<S> {
    /// An empty arena. O(1).
    pub(super) fn new(
        stream: StreamId,
        alignment: u64,
        class: ArenaClass,
        virtual_segments: bool,
        quick: QuickCache,
    ) -> Self {
        let engine = Engine::new(alignment).expect("alignment checked in Pool::new");
        Self { stream, engine, class, virtual_segments, segments: Vec::new(), quick }
    }

    pub(super) fn entry(&self, id: SegmentId) -> Option<&SegmentEntry<S>> {
        self.segments.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// The engine, to read.
    pub(super) fn engine(&self) -> &Engine {
        &self.engine
    }
}

pub(super) struct State<S> {
    /// See [`super::Pool`]'s `arena_base`.
    pub(super) arena_base: u64,
    pub(super) arenas: Vec<Arena<S>>,
    /// Stream → arena indices `[small, large]`.
    pub(super) streams: StreamArenas,
    pub(super) stats: PoolStats,
    /// Bytes of plain segments, and of mapped pages of reservations.
    plain_bytes: u64,
    pub(super) mapped_bytes: u64,
    /// Bytes of entirely free plain segments (cached, not split). Moved by [`State::note_emptiness`] alone.
    empty_plain_bytes: u64,
    pub(super) cleanup_round: u64,
    /// The highest reserved figure since the last full release: up to it the allocation path takes memory
    /// without trimming for `mapped_slack` or `segment_slack` (see [`super::Pool`]'s `trim_budget`).
    pub(super) reserved_high_water: u64,
}

/// What happened to a segment, as far as `empty_plain_bytes` cares.
#[derive(Clone, Copy)]
enum Emptiness {
    /// Added (empty) or emptied by a free.
    Became,
    /// A block was taken from it while it was empty, or it was removed.
    Ceased,
}

impl<S> State<S> {
    /// No arenas, no memory. O(1).
    pub(super) fn new(arena_base: u64, stats: PoolStats) -> Self {
        Self {
            arena_base,
            arenas: Vec::new(),
            streams: StreamArenas::default(),
            stats,
            plain_bytes: 0,
            mapped_bytes: 0,
            empty_plain_bytes: 0,
            cleanup_round: 0,
            reserved_high_water: 0,
        }
    }

    /// The one place `empty_plain_bytes` changes: `segment` of `arena` just became empty or ceased to be, by the
    /// engine's report. Reservations do not count (their free pages are counted as mapped, or not at all).
    #[inline(always)]
    fn note_emptiness(&mut self, arena: usize, segment: SegmentId, change: Emptiness) {
        let a = &self.arenas[arena];
        if a.virtual_segments {
            return;
        }
        let size = a.engine.segment_size(segment).expect("segment exists");
        match change {
            Emptiness::Became => self.empty_plain_bytes += size,
            Emptiness::Ceased => {
                debug_assert!(self.empty_plain_bytes >= size, "only segments counted empty cease to be");
                self.empty_plain_bytes -= size;
            }
        }
    }

    #[inline(always)]
    fn note_allocation(&mut self, arena: usize, alloc: Option<Allocation>) -> Option<Allocation> {
        if let Some(alloc) = alloc {
            if alloc.segment_was_empty {
                self.note_emptiness(arena, alloc.segment, Emptiness::Ceased);
            }
        }
        alloc
    }

    #[inline(always)]
    fn note_free(&mut self, arena: usize, freed: Option<Freed>) -> Option<Freed> {
        if let Some(freed) = freed {
            if freed.segment_now_empty {
                self.note_emptiness(arena, freed.segment, Emptiness::Became);
            }
        }
        freed
    }

    /// Bytes of entirely free plain segments.
    pub(super) fn empty_plain_bytes(&self) -> u64 {
        self.empty_plain_bytes
    }

    /// A block of `size` bytes from the arena's free index. O(1) (see [`Engine::allocate`]).
    #[inline(always)]
    pub(super) fn allocate_free(&mut self, arena: usize, size: u64) -> Option<Allocation> {
        let alloc = self.arenas[arena].engine.allocate(size);
        self.note_allocation(arena, alloc)
    }

    /// A block of `size` bytes in `segment`, fresh. O(1).
    pub(super) fn allocate_in(&mut self, arena: usize, segment: SegmentId, size: u64) -> Option<Allocation> {
        let alloc = self.arenas[arena].engine.allocate_in(segment, size);
        self.note_allocation(arena, alloc)
    }

    /// Frees a live or parked block into the arena's engine, coalescing it. O(1).
    #[inline(always)]
    pub(super) fn free_block(&mut self, arena: usize, block: crate::engine::BlockId) -> Option<Freed> {
        let freed = self.arenas[arena].engine.free(block);
        self.note_free(arena, freed)
    }

    /// Parks a live block (it stays taken in the engine; a cache holds it). O(1).
    #[inline(always)]
    pub(super) fn park(&mut self, arena: usize, block: crate::engine::BlockId) -> Option<crate::engine::BlockId> {
        self.arenas[arena].engine.park(block)
    }

    /// A block of `size` bytes from what the arena holds, without new memory: a quick block of the size's class,
    /// else the engine's free index. O(1). The only place a quick block is taken back whole.
    #[inline(always)]
    pub(super) fn take_cached(&mut self, arena: usize, size: u64) -> Option<Allocation> {
        let a = &mut self.arenas[arena];
        match a.quick.pop(size) {
            // Its pages stayed mapped: the cache is drained before any trim.
            Some(q) => Some(Allocation {
                block: a.engine.unpark(q.block).expect("quick blocks are parked"),
                segment: q.segment,
                offset: q.offset,
                size: q.size,
                segment_was_empty: false,
            }),
            None => self.allocate_free(arena, size),
        }
    }

    /// After a miss of the quick block's class and the free index: a larger quick block put back in the engine
    /// serves `size`; failing that, every quick block is (the cache keeping smaller ones from now on). O(1), or
    /// O(quick blocks) when drained.
    pub(super) fn take_after_quick_miss(&mut self, arena: usize, size: u64) -> Option<Allocation> {
        if let Some(q) = self.arenas[arena].quick.pop_larger(size) {
            self.free_block(arena, q.block).expect("quick blocks are parked");
            if let Some(alloc) = self.allocate_free(arena, size) {
                return Some(alloc);
            }
        }
        if self.arenas[arena].quick.is_empty() {
            return None;
        }
        self.arenas[arena].quick.shrink();
        self.drain_quick(arena);
        self.allocate_free(arena, size)
    }

    /// Frees the arena's quick blocks into its engine, coalescing them. O(quick blocks).
    pub(super) fn drain_quick(&mut self, arena: usize) {
        if self.arenas[arena].quick.is_empty() {
            return;
        }
        let mut blocks = std::mem::replace(&mut self.arenas[arena].quick, QuickCache::disabled());
        blocks.drain(|q| {
            self.free_block(arena, q.block).expect("quick blocks are parked");
        });
        self.arenas[arena].quick = blocks;
        self.update_split();
    }

    /// Keeps a freed block of `arena` as a quick block in `class` (see [`QuickCache::room_for`]). O(1).
    #[inline(always)]
    pub(super) fn keep_quick(&mut self, arena: usize, class: usize, block: &BlockHandle) -> Option<()> {
        let a = &mut self.arenas[arena];
        let parked = a.engine.park(block.block)?;
        a.quick
            .push(class, QuickBlock { block: parked, segment: block.segment, offset: block.offset, size: block.size });
        Some(())
    }

    /// Takes everything `slot`'s cache holds: its statistics, folded, and its free blocks.
    pub(super) fn absorb(&mut self, slot: &Slot, cache: &mut ThreadCache) {
        slot.fold(cache, &mut self.stats);
        cache.drain(|r| self.take_back(r, false));
        self.update_split();
    }

    /// Takes a free block back from a thread cache: into the arena's quick cache if it has room and
    /// `coalesce` is off, else into the engine.
    pub(super) fn take_back(&mut self, returned: Returned, coalesce: bool) {
        let arena = returned.arena as usize;
        let a = &mut self.arenas[arena];
        if !coalesce {
            if let Some(class) = a.quick.room_for(returned.block.size) {
                a.quick.push(class, returned.block);
                return;
            }
        }
        self.free_block(arena, returned.block.block).expect("cached blocks are parked");
    }

    /// Registers a new segment of `size` bytes (a multiple of the alignment, as the engine keeps it); a virtual
    /// reservation (`withheld`) starts with nothing mapped, a plain segment adds to the reserved bytes.
    pub(super) fn add_segment(&mut self, arena: usize, size: u64, entry: SegmentEntry<S>, withheld: bool) -> SegmentId {
        debug_assert_eq!(withheld, self.arenas[arena].virtual_segments, "an arena holds one kind of segment");
        let a = &mut self.arenas[arena];
        let id = if withheld { a.engine.add_withheld_segment(size) } else { a.engine.add_segment(size) }
            .expect("segment size is non-zero and rounded");
        debug_assert_eq!(a.engine.segment_size(id), Some(size), "the engine keeps the segment's size as it is");
        let slot = id.0 as usize;
        if a.segments.len() <= slot {
            a.segments.resize_with(slot + 1, || None);
        }
        a.segments[slot] = Some(entry);
        if !withheld {
            self.plain_bytes += size;
            self.note_emptiness(arena, id, Emptiness::Became);
        }
        id
    }

    /// Removes an empty segment from the books and returns its entry and size. O(1) for a plain segment.
    pub(super) fn remove_segment(&mut self, arena: usize, id: SegmentId) -> (SegmentEntry<S>, u64) {
        self.note_emptiness(arena, id, Emptiness::Ceased);
        let a = &mut self.arenas[arena];
        let entry = a.segments[id.0 as usize].take().expect("segment exists");
        let size = a.engine.remove_segment(id).expect("segment is empty");
        if entry.mapped.is_none() {
            self.plain_bytes -= size;
        }
        (entry, size)
    }

    /// Restores the withheld range `restore` of a virtual arena and takes a block of `size` from it.
    pub(super) fn restore_and_allocate(&mut self, arena: usize, restore: &Restore, size: u64) -> Option<Allocation> {
        debug_assert!(self.arenas[arena].virtual_segments);
        self.arenas[arena].engine.restore_and_allocate(restore, size)
    }

    /// Gives back a block taken on withheld pages that could not be mapped, and withholds the pages again.
    pub(super) fn undo_restore(&mut self, arena: usize, alloc: &Allocation, restore: &Restore, page: u64) {
        debug_assert!(self.arenas[arena].virtual_segments);
        let engine = &mut self.arenas[arena].engine;
        engine.free(alloc.block).expect("the block was just taken");
        let withheld = engine.withhold_range(restore.segment, restore.offset, restore.len, page);
        debug_assert!(withheld, "the restored range is free again");
    }

    /// Withholds free pages of a virtual arena (see [`Engine::withhold_free`]), calling `release` with each
    /// range's segment entry first. Returns the bytes withheld.
    pub(super) fn withhold_free(
        &mut self,
        arena: usize,
        page: u64,
        want: u64,
        eligible: impl Fn(SegmentId) -> bool,
        mut release: impl FnMut(&mut SegmentEntry<S>, u64, u64),
    ) -> u64 {
        let a = &mut self.arenas[arena];
        debug_assert!(a.virtual_segments);
        let segments = &mut a.segments;
        a.engine.withhold_free(page, want, eligible, |id, offset, len| {
            release(segments[id.0 as usize].as_mut().expect("segment exists"), offset, len)
        })
    }

    /// The entry of the segment holding `block`, if the block is live (for a block lent from a thread cache,
    /// which is parked in the engine, the caller has checked with the slot that it is lent).
    pub(super) fn live_entry(&self, block: &BlockHandle) -> Option<&SegmentEntry<S>> {
        let arena = self.arenas.get(block.arena.wrapping_sub(self.arena_base) as usize)?;
        if block.lent.is_none() {
            arena.engine.block(block.block)?;
        }
        arena.entry(block.segment)
    }

    /// The arena of `stream` for `class`, if the stream has been used. O(1).
    #[inline(always)]
    pub(super) fn arena_of(&self, stream: StreamId, class: ArenaClass) -> Option<usize> {
        let slot = usize::from(class == ArenaClass::Large);
        self.streams.get(stream).map(|arenas| arenas[slot] as usize)
    }

    pub(super) fn reserved(&self) -> u64 {
        self.plain_bytes + self.mapped_bytes
    }

    /// Free bytes in segments that also hold live blocks (plus free mapped pages of reservations).
    pub(super) fn split_bytes(&self) -> u64 {
        self.reserved() - self.stats.allocated_bytes.current - self.empty_plain_bytes
    }

    pub(super) fn update_reserved(&mut self) {
        let reserved = self.reserved();
        self.stats.reserved_bytes.set(reserved);
        self.reserved_high_water = self.reserved_high_water.max(reserved);
        self.update_split();
    }

    pub(super) fn update_split(&mut self) {
        let split = self.split_bytes();
        self.stats.inactive_split_bytes.set(split);
    }

    /// Counts a block taken from the arena and returns its handle. The segment's emptiness was noted when the
    /// engine handed the block out.
    #[inline(always)]
    pub(super) fn record_alloc(&mut self, arena: usize, alloc: &Allocation, requested: u64, hit: bool) -> BlockHandle {
        let round = self.cleanup_round;
        let a = &mut self.arenas[arena];
        let entry = a.segments[alloc.segment.0 as usize].as_mut().expect("segment exists");
        entry.last_used_round = round;
        entry.last_used_alloc = self.stats.cache_hits + self.stats.cache_misses;
        let s = &mut self.stats;
        if hit {
            s.cache_hits += 1;
        } else {
            s.cache_misses += 1;
        }
        s.allocated_bytes.add(alloc.size);
        s.requested_bytes.add(requested);
        s.active_blocks.add(1);
        // Taking bytes lowers the split bytes (read off at stats time), unless the block came out of an empty
        // plain segment, which stops counting as cached: only then can their peak move.
        if alloc.segment_was_empty {
            self.update_split();
        }
        BlockHandle {
            arena: self.arena_base + arena as u64,
            segment: alloc.segment,
            block: alloc.block,
            offset: alloc.offset,
            size: alloc.size,
            requested,
            lent: None,
        }
    }

    #[inline(always)]
    pub(super) fn record_free(&mut self, block: &BlockHandle) {
        let s = &mut self.stats;
        s.num_frees += 1;
        s.allocated_bytes.sub(block.size);
        s.requested_bytes.sub(block.requested);
        s.active_blocks.sub(1);
        self.update_split();
    }
}
