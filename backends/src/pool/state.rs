//! The pool's books behind its lock: arenas (one free index per stream and size class), their segments, and
//! the byte counts the statistics are read from.

use super::quick::QuickCache;
use super::slots::Slot;
use super::streams::StreamArenas;
use super::thread_cache::{Returned, ThreadCache};
use crate::engine::{Allocation, Engine, SegmentId};
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

/// One free index: the blocks of one stream and one size class.
pub(super) struct Arena<S> {
    /// The stream it serves.
    pub(super) stream: StreamId,
    pub(super) engine: Engine,
    pub(super) class: ArenaClass,
    pub(super) virtual_segments: bool,
    pub(super) segments: Vec<Option<SegmentEntry<S>>>,
    pub(super) quick: QuickCache,
}

impl<S> Arena<S> {
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
    pub(super) plain_bytes: u64,
    pub(super) mapped_bytes: u64,
    /// Bytes of entirely free plain segments (cached, not split).
    pub(super) empty_plain_bytes: u64,
    pub(super) cleanup_round: u64,
    /// The highest reserved figure since the last full release: up to it the allocation path takes memory
    /// without trimming for `mapped_slack` or `segment_slack` (see [`Pool::trim_budget`]).
    pub(super) reserved_high_water: u64,
}

impl<S> State<S> {
    /// The entry of the segment holding `block`, if the block is live (for a block lent from a thread cache,
    /// which is parked in the engine, the caller has checked with the slot that it is lent).
    pub(super) fn live_entry(&self, block: &BlockHandle) -> Option<&SegmentEntry<S>> {
        let arena = self.arenas.get(block.arena.wrapping_sub(self.arena_base) as usize)?;
        if block.lent.is_none() {
            arena.engine.block(block.block)?;
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
            None => a.engine.allocate(size),
        }
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
        let freed = a.engine.free(returned.block.block).expect("cached blocks are parked");
        self.note_engine_free(arena, freed.segment, freed.segment_now_empty);
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
        stats
    }

    /// Free bytes in segments that also hold live blocks (plus free mapped pages of reservations).
    pub(super) fn split_bytes(&self) -> u64 {
        self.reserved() - self.stats.allocated_bytes.current - self.empty_plain_bytes
    }

    pub(super) fn reserved(&self) -> u64 {
        self.plain_bytes + self.mapped_bytes
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

    /// Registers a new segment; a virtual reservation (`withheld`) starts with nothing mapped.
    pub(super) fn add_segment(&mut self, arena: usize, size: u64, entry: SegmentEntry<S>, withheld: bool) -> SegmentId {
        let arena = &mut self.arenas[arena];
        let id = if withheld { arena.engine.add_withheld_segment(size) } else { arena.engine.add_segment(size) }
            .expect("segment size is non-zero and rounded");
        let slot = id.0 as usize;
        if arena.segments.len() <= slot {
            arena.segments.resize_with(slot + 1, || None);
        }
        arena.segments[slot] = Some(entry);
        id
    }

    #[inline(always)]
    pub(super) fn record_alloc(&mut self, arena: usize, alloc: &Allocation, requested: u64, hit: bool) -> BlockHandle {
        let round = self.cleanup_round;
        let a = &mut self.arenas[arena];
        let entry = a.segments[alloc.segment.0 as usize].as_mut().expect("segment exists");
        entry.last_used_round = round;
        entry.last_used_alloc = self.stats.cache_hits + self.stats.cache_misses;
        if alloc.segment_was_empty && entry.mapped.is_none() {
            self.empty_plain_bytes -= a.engine.segment_size(alloc.segment).expect("segment exists");
        }
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

    /// Accounts for a block the engine has just freed: an emptied plain segment becomes cached, not split.
    pub(super) fn note_engine_free(&mut self, arena: usize, segment: SegmentId, segment_now_empty: bool) {
        let a = &self.arenas[arena];
        if segment_now_empty && a.entry(segment).is_some_and(|e| e.mapped.is_none()) {
            self.empty_plain_bytes += a.engine.segment_size(segment).expect("segment exists");
        }
    }

    /// Frees the arena's quick blocks into its engine, coalescing them. O(quick blocks).
    pub(super) fn drain_quick(&mut self, arena: usize) {
        if self.arenas[arena].quick.is_empty() {
            return;
        }
        let a = &mut self.arenas[arena];
        let mut emptied = 0;
        a.quick.drain(|q| {
            let freed = a.engine.free(q.block).expect("quick blocks are parked");
            // Quick blocks live in plain segments (small arenas only); an emptied one becomes cached.
            if freed.segment_now_empty
                && a.segments[freed.segment.0 as usize].as_ref().is_some_and(|e| e.mapped.is_none())
            {
                emptied += a.engine.segment_size(freed.segment).expect("segment exists");
            }
        });
        self.empty_plain_bytes += emptied;
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
