//! The pool's books behind its lock: arenas (one free index per stream and size class), their segments, and
//! the byte counts the statistics are read from.
//!
//! The engines are private to this module: every change to a plain arena's free index goes through a `State`
//! method here (`take_cached`, `allocate_from_engine`, `allocate_in`, `free_block`, `drain_quick`,
//! `add_segment`, `remove_segment`), and each passes the engine's report of a segment turning empty
//! ([`Freed::segment_now_empty`]) or ceasing to be ([`Allocation::segment_was_empty`]), or of one added or
//! removed, to [`State::note_emptiness`],
//! the only code that moves `empty_plain_bytes`. The bytes it counts are the engine's own segment sizes, so the
//! figure cannot drift from what the engines hold. Virtual arenas, whose free pages are counted as mapped
//! bytes, are changed through [`State::virtual_engine`] and never count as empty.

use super::books::steps::Steps;
use super::books::stitch::Stitcher;
use super::quick::QuickCache;
use super::streams::StreamArenas;
use super::thread_cache::Returned;
use crate::engine::{Allocation, BlockId, Engine, Freed, SegmentId};
use crate::{BlockHandle, PoolStats, StreamId, StreamMark};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ArenaClass {
    Small,
    Large,
    /// The segment of a planned step ([`super::steps`]): blocks are placed at planned offsets only.
    Planned,
    /// Stitched blocks of one virtual arena ([`super::stitch`]): each segment is an address range of its own in
    /// which pages of that arena's reservations are mapped a second time; it holds no memory of its own.
    Stitched,
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

/// A mark recorded on an arena's stream before its free memory went to another stream (see [`super::share`]).
pub(super) struct ArenaMark {
    pub(super) mark: StreamMark,
    /// [`State::mark_epoch`] when it was recorded: it covers the frees of epochs below.
    pub(super) epoch: u64,
    /// Seen to have passed (a passed mark stays passed).
    pub(super) passed: bool,
}

/// One free index: the blocks of one stream and one size class.
pub(super) struct Arena<S> {
    /// The stream it serves.
    pub(super) stream: StreamId,
    /// Read through [`Arena::engine`]; changed only by `State`'s methods (see the module's doc).
    engine: Engine,
    pub(super) class: ArenaClass,
    pub(super) virtual_segments: bool,
    pub(super) segments: Vec<Option<SegmentEntry<S>>>,
    pub(super) quick: QuickCache,
    /// [`State::mark_epoch`] at the latest free into the engine: a mark of a later epoch covers every free block.
    pub(super) freed_epoch: u64,
    /// The latest mark on this arena's stream, for sharing its free memory.
    pub(super) mark: Option<ArenaMark>,
}

impl<S> Arena<S> {
    /// An arena of `class` for `stream`, with no segments. Small arenas keep quick blocks up to
    /// `small_request_max`; large ones none. `whole_blocks`: every block is a whole segment
    /// ([`Engine::whole_blocks`]).
    pub(super) fn new(
        stream: StreamId,
        class: ArenaClass,
        virtual_segments: bool,
        alignment: u64,
        small_request_max: u64,
        whole_blocks: bool,
    ) -> Self {
        let engine = if whole_blocks { Engine::whole_blocks(alignment) } else { Engine::new(alignment) };
        Self {
            stream,
            engine: engine.expect("alignment checked in Pool::new"),
            class,
            virtual_segments,
            segments: Vec::new(),
            quick: match class {
                ArenaClass::Small => QuickCache::new(small_request_max),
                ArenaClass::Large | ArenaClass::Planned | ArenaClass::Stitched => QuickCache::disabled(),
            },
            freed_epoch: 0,
            mark: None,
        }
    }

    /// Parks a live block (see [`Engine::park`]): it stays allocated in the engine while a cache holds it, so a
    /// segment's emptiness does not change. `None` if it is not live.
    #[inline(always)]
    pub(super) fn park(&mut self, block: BlockId) -> Option<BlockId> {
        self.engine.park(block)
    }

    /// The free index, to read.
    #[inline(always)]
    pub(super) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(super) fn entry(&self, id: SegmentId) -> Option<&SegmentEntry<S>> {
        self.segments.get(id.0 as usize).and_then(Option::as_ref)
    }
}

pub(super) struct State<S> {
    /// See [`Pool::arena_base`].
    pub(super) arena_base: u64,
    pub(super) arenas: Vec<Arena<S>>,
    /// Stream → arena indices `[small, large]`.
    pub(super) streams: StreamArenas,
    pub(super) stats: PoolStats,
    /// Bytes of plain segments: moved by [`State::add_segment`] and [`State::remove_segment`] alone.
    plain_bytes: u64,
    pub(super) mapped_bytes: u64,
    /// Bytes of entirely free plain segments (cached, not split): moved by [`State::note_emptiness`] alone.
    empty_plain_bytes: u64,
    pub(super) cleanup_round: u64,
    /// The highest reserved figure since the last full release: up to it the allocation path takes memory
    /// without trimming for `mapped_slack` or `segment_slack` (see [`Pool::trim_budget`]).
    pub(super) reserved_high_water: u64,
    /// Marks recorded so far on any arena's stream: the epoch an arena's frees and marks are dated with.
    pub(super) mark_epoch: u64,
    /// The highest live figure before the latest [`crate::Pool::reset_peaks`] (the statistics' peak holds the
    /// rest): what sharing across streams budgets reserved memory against.
    pub(super) live_high_water: u64,
    /// Marked steps and their plan ([`super::steps`]).
    pub(super) steps: Steps,
    /// `reserved()` as of the last [`State::update_reserved`], readable without the lock
    /// ([`crate::Pool::reserved_bytes`]).
    pub(super) reserved_gauge: Arc<AtomicU64>,
    /// The group this pool's reserved bytes count in, if any (`PoolConfig::reserved_group`).
    pub(super) reserved_group: Option<Arc<crate::ReservedGroup>>,
    /// The stitched blocks of each virtual arena that has some ([`super::stitch`]).
    pub(super) stitchers: Vec<Stitcher>,
    /// Kept stitched ranges forgotten to make room for new ones since the last full release (see
    /// [`super::books::stitch::MAX_STITCH_EVICTIONS`]).
    pub(super) stitch_evictions: u64,
    /// While the pool sleeps: what it unmapped and where the bytes went ([`super::sleep`]).
    pub(super) sleep: Option<super::books::sleep::Sleeping>,
    /// Host memory that held offloaded bytes, kept for the next sleep ([`crate::Pool::wake`]).
    pub(super) host_store: Option<crate::HostStore>,
    /// Free blocks one stream's arena lent to another stream ([`super::borrow`]).
    pub(super) loans: super::borrow::Loans,
}

/// What happened to a plain segment, as far as `empty_plain_bytes` cares.
#[derive(Clone, Copy)]
enum Emptiness {
    /// Added (empty), or emptied by a free.
    Became,
    /// A block was taken from it while it was empty, or it was removed.
    Ceased,
}

impl<S> State<S> {
    /// No arenas, no memory.
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
            mark_epoch: 0,
            live_high_water: 0,
            steps: Steps::default(),
            reserved_gauge: Arc::default(),
            reserved_group: None,
            stitchers: Vec::new(),
            stitch_evictions: 0,
            sleep: None,
            host_store: None,
            loans: super::borrow::Loans::default(),
        }
    }

    /// The one place `empty_plain_bytes` changes: `segment` of `arena` just became empty or ceased to be, by the
    /// engine's report. Reservations do not count.
    #[inline(always)]
    fn note_emptiness(&mut self, arena: usize, segment: SegmentId, change: Emptiness) {
        let a = &self.arenas[arena];
        if a.virtual_segments || a.class == ArenaClass::Stitched {
            return;
        }
        let size = a.engine.segment_size(segment).expect("segment exists");
        match change {
            Emptiness::Became => self.empty_plain_bytes += size,
            Emptiness::Ceased => {
                debug_assert!(self.empty_plain_bytes >= size, "only a segment counted empty ceases to be");
                self.empty_plain_bytes -= size;
            }
        }
    }

    /// Whether some plain segment is entirely free.
    pub(super) fn has_empty_plain_segments(&self) -> bool {
        self.empty_plain_bytes > 0
    }

    /// The free index of a virtual arena, to change: its segments never count as empty plain memory.
    pub(super) fn virtual_engine(&mut self, arena: usize) -> &mut Engine {
        self.virtual_parts(arena).0
    }

    /// The free index and the segments of a virtual arena, to change together.
    pub(super) fn virtual_parts(&mut self, arena: usize) -> (&mut Engine, &mut Vec<Option<SegmentEntry<S>>>) {
        let a = &mut self.arenas[arena];
        debug_assert!(a.virtual_segments, "only virtual arenas are changed outside State's methods");
        (&mut a.engine, &mut a.segments)
    }

    /// Frees `block` into the arena's engine, coalescing it, and counts a plain segment it empties. `None` for a
    /// block the engine does not hold live or parked.
    #[inline(always)]
    pub(super) fn free_block(&mut self, arena: usize, block: BlockId) -> Option<Freed> {
        let a = &mut self.arenas[arena];
        let freed = a.engine.free(block)?;
        a.freed_epoch = self.mark_epoch;
        if freed.segment_now_empty {
            self.note_emptiness(arena, freed.segment, Emptiness::Became);
        }
        Some(freed)
    }

    /// A block of `size` bytes from the arena's engine alone (quick blocks aside), its segment no longer
    /// counted empty.
    pub(super) fn allocate_from_engine(&mut self, arena: usize, size: u64) -> Option<Allocation> {
        let alloc = self.arenas[arena].engine.allocate(size);
        self.counted(arena, alloc)
    }

    /// Exactly `[offset, offset + size)` of `segment` in a planned arena, where `after` is the live block below
    /// (see [`Engine::allocate_at`]); `None` when that range is not free.
    pub(super) fn allocate_planned(
        &mut self,
        arena: usize,
        segment: SegmentId,
        after: Option<BlockId>,
        offset: u64,
        size: u64,
    ) -> Option<Allocation> {
        let alloc = self.arenas[arena].engine.allocate_at(segment, after, offset, size);
        self.counted(arena, alloc)
    }

    /// Bytes of the planned arenas' segments.
    pub(super) fn planned_bytes(&self) -> u64 {
        self.steps.arenas.iter().map(|&(_, arena)| self.arenas[arena].engine.stats().reserved_bytes).sum()
    }

    /// A block of `size` bytes carved from `segment` (one just added), its segment no longer counted empty.
    pub(super) fn allocate_in(&mut self, arena: usize, segment: SegmentId, size: u64) -> Option<Allocation> {
        let alloc = self.arenas[arena].engine.allocate_in(segment, size);
        self.counted(arena, alloc)
    }

    /// Passes the engine's report on an allocation just taken (its segment was empty) to the books.
    #[inline(always)]
    fn counted(&mut self, arena: usize, alloc: Option<Allocation>) -> Option<Allocation> {
        if let Some(taken) = &alloc {
            if taken.segment_was_empty {
                self.note_emptiness(arena, taken.segment, Emptiness::Ceased);
            }
        }
        alloc
    }

    /// The entry of the segment holding `block`, if the block is live (for a block lent from a thread cache,
    /// which is parked in the engine, the caller has checked with the slot that it is lent).
    pub(super) fn live_entry(&self, block: &BlockHandle) -> Option<&SegmentEntry<S>> {
        let index = block.arena.wrapping_sub(self.arena_base) as usize;
        let arena = self.arenas.get(index)?;
        if block.lent.is_none() {
            arena.engine.block(block.block)?;
        }
        // A block lent to another stream and freed there is held live in its engine until it goes home.
        if !self.loans.blocks.is_empty() && self.loans.blocks.get(&(index, block.block)).is_some_and(|l| l.returning) {
            return None;
        }
        arena.entry(block.segment)
    }

    /// A block of `size` bytes from what the arena holds, without new memory: a quick block of the size's class,
    /// else the engine's free index. O(1).
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
            None => {
                let alloc = a.engine.allocate(size);
                self.counted(arena, alloc)
            }
        }
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

    /// The arena of `stream` for `class`, if the stream has been used. O(1).
    #[inline(always)]
    pub(super) fn arena_of(&self, stream: StreamId, class: ArenaClass) -> Option<usize> {
        let slot = usize::from(class == ArenaClass::Large);
        self.streams.get(stream).map(|arenas| arenas[slot] as usize)
    }

    /// The statistics, with the ones derived from others filled in rather than counted on every operation:
    /// `active_bytes` is `allocated_bytes` in a pool (a freed block is reusable at once on its stream),
    /// `num_allocs` is hits plus misses, and the current split bytes follow from reserved, allocated and cached.
    pub(super) fn stats_now(&self) -> PoolStats {
        let mut stats = self.stats.clone();
        stats.active_bytes = stats.allocated_bytes;
        stats.num_allocs = stats.cache_hits + stats.cache_misses;
        stats.inactive_split_bytes.current = self.split_bytes();
        stats.planned_bytes = self.planned_bytes();
        if let Some(sleep) = &self.sleep {
            stats.asleep_bytes = sleep.bytes;
            stats.offloaded_bytes = sleep.offloaded_bytes();
        }
        stats.host_store_bytes = self.host_store_bytes();
        stats
    }

    /// Free bytes in segments that also hold live blocks (plus free mapped pages of reservations).
    pub(super) fn split_bytes(&self) -> u64 {
        // Saturating: a sleeping pool's live blocks hold no device memory.
        self.reserved().saturating_sub(self.stats.allocated_bytes.current + self.empty_plain_bytes)
    }

    /// Device bytes held: plain segments and mapped pages, less the pages a sleeping pool unmapped (which the
    /// engine's books keep as mapped, so that waking maps exactly them again).
    pub(super) fn reserved(&self) -> u64 {
        self.plain_bytes + self.mapped_bytes - self.sleep.as_ref().map_or(0, |s| s.bytes)
    }

    pub(super) fn update_reserved(&mut self) {
        let reserved = self.reserved();
        self.stats.reserved_bytes.set(reserved);
        let before = self.reserved_gauge.swap(reserved, Ordering::Relaxed);
        if let Some(group) = &self.reserved_group {
            group.change(before, reserved);
        }
        self.reserved_high_water = self.reserved_high_water.max(reserved);
        self.steps.step_peak = self.steps.step_peak.max(reserved);
        self.update_split();
    }

    pub(super) fn update_split(&mut self) {
        let split = self.split_bytes();
        self.stats.inactive_split_bytes.set(split);
    }

    /// Registers a new segment of `size` bytes: a virtual reservation (in a virtual arena) starts with nothing
    /// mapped; a plain segment counts as reserved and, until a block is taken from it, empty.
    pub(super) fn add_segment(&mut self, arena: usize, size: u64, entry: SegmentEntry<S>) -> SegmentId {
        let a = &mut self.arenas[arena];
        let withheld = a.virtual_segments;
        let id = if withheld { a.engine.add_withheld_segment(size) } else { a.engine.add_segment(size) }
            .expect("segment size is non-zero and rounded");
        debug_assert_eq!(a.engine.segment_size(id), Some(size), "the engine keeps the size the backend made");
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

    /// Removes an empty segment from the engine (its entry already taken) and returns its size; a plain one no
    /// longer counts as reserved or empty.
    pub(super) fn remove_segment(&mut self, arena: usize, id: SegmentId) -> u64 {
        if !self.arenas[arena].virtual_segments {
            self.note_emptiness(arena, id, Emptiness::Ceased);
        }
        let size = self.arenas[arena].engine.remove_segment(id).expect("segment is empty");
        if !self.arenas[arena].virtual_segments {
            self.plain_bytes -= size;
        }
        size
    }

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
            host: 0,
            lent: None,
        }
    }

    /// Registers an address range for stitched blocks in stitch arena `arena`: it holds no memory of its own, so
    /// it counts neither as reserved nor as empty.
    pub(super) fn add_stitch_segment(&mut self, arena: usize, size: u64, entry: SegmentEntry<S>) -> SegmentId {
        let a = &mut self.arenas[arena];
        debug_assert_eq!(a.class, ArenaClass::Stitched);
        let id = a.engine.add_segment(size).expect("a stitched range is whole pages");
        let slot = id.0 as usize;
        if a.segments.len() <= slot {
            a.segments.resize_with(slot + 1, || None);
        }
        a.segments[slot] = Some(entry);
        id
    }

    /// Removes an address range for stitched blocks with no live block, and returns its entry.
    pub(super) fn remove_stitch_segment(&mut self, arena: usize, id: SegmentId) -> SegmentEntry<S> {
        let a = &mut self.arenas[arena];
        debug_assert_eq!(a.class, ArenaClass::Stitched);
        a.engine.remove_segment(id).expect("a stitched range is removed when no block is live in it");
        a.segments[id.0 as usize].take().expect("segment exists")
    }

    /// Frees the arena's quick blocks into its engine, coalescing them. O(quick blocks).
    pub(super) fn drain_quick(&mut self, arena: usize) {
        if self.arenas[arena].quick.is_empty() {
            return;
        }
        // The quick cache is taken out while it drains, so that each block goes back through `free_block`.
        let mut quick = std::mem::replace(&mut self.arenas[arena].quick, QuickCache::disabled());
        quick.drain(|q| {
            self.free_block(arena, q.block).expect("quick blocks are parked");
        });
        self.arenas[arena].quick = quick;
        self.update_split();
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
