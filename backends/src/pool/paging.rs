//! Virtual reservations: mapping withheld pages on a miss, and unmapping free pages (which the engine then
//! withholds, so that a block from its free index is always backed).

use super::allocate::Shortfall;
use super::state::{SegmentEntry, State};
use super::Pool;
use crate::engine::{Allocation, Engine, Restore, SegmentId};
use crate::{Backend, StreamId};

impl<B: Backend> Pool<B> {
    /// Serves `size` bytes from withheld (unmapped) space of the arena's reservations: restores the range that
    /// needs the fewest new pages, takes the block, gives back free mapped pages elsewhere when the mapping would
    /// push reserved memory past its budget, then maps. `Ok(None)` when no reservation has room.
    pub(super) fn map_withheld(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> std::result::Result<Option<Allocation>, Shortfall> {
        let page = self.page_size.expect("virtual arenas exist only with virtual memory");
        let engine = state.virtual_engine(arena);
        let Some(restore) = engine.find_withheld(size, page) else { return Ok(None) };
        // The block is taken before its pages are mapped, so the trim below cannot give them back.
        let alloc = engine.restore_and_allocate(&restore, size).expect("found just now");
        let missing = restore.len;
        // Other streams' free pages first: their physical memory is mapped here instead of new memory.
        self.take_free_pages(state, arena, missing);
        // Give back free mapped pages elsewhere first when the mapping would pass the budget: the limit, and with
        // `mapped_slack` the live set's share. Trimming just the excess here, rather than failing and letting the
        // retry release cached memory the size of the whole request, keeps the other cached pages mapped.
        let limit = state.stats.limit_bytes;
        let budget = Self::trim_budget(state, self.config.mapped_slack, alloc.size).min(limit.unwrap_or(u64::MAX));
        let excess = (state.reserved() + missing).saturating_sub(budget).min(missing);
        // Unmapping waits for the pages' stream, which a capture refuses: the pool grows past its slack instead.
        if excess > 0 && !self.capture_underway() {
            let (round, mut trimmed) = (state.cleanup_round, 0);
            for a in 0..state.arenas.len() {
                if state.arenas[a].virtual_segments && trimmed < excess {
                    trimmed += self.unmap_free_pages(state, a, round, 0, excess - trimmed, true).1;
                }
            }
        }
        let result = if limit.is_some_and(|l| state.reserved() + missing > l) {
            Err(Shortfall::Limit)
        } else {
            state.stats.num_device_calls += 1;
            let entry = state.arenas[arena].segments[restore.segment.0 as usize].as_mut().expect("segment exists");
            self.backend.map_pages(&entry.handle, restore.offset, restore.len).map_err(Shortfall::Device).map(|()| {
                *entry.mapped.as_mut().expect("virtual segment") += restore.len;
                state.mapped_bytes += restore.len;
                state.stats.num_device_alloc += 1;
            })
        };
        state.update_reserved();
        // Pages the trim above unmapped and the mapping did not take back are freed now.
        self.backend.release_spare_pages();
        match result {
            Ok(()) => Ok(Some(alloc)),
            Err(shortfall) => {
                Self::undo_restore(state.virtual_engine(arena), &alloc, &restore, page);
                Err(shortfall)
            }
        }
    }

    /// Gives back a block taken on withheld pages that could not be mapped, and withholds the pages again.
    pub(super) fn undo_restore(engine: &mut Engine, alloc: &Allocation, restore: &Restore, page: u64) {
        engine.free(alloc.block).expect("the block was just taken");
        let withheld = engine.withhold_range(restore.segment, restore.offset, restore.len, page);
        debug_assert!(withheld, "the restored range is free again");
    }

    /// Unmaps pages lying wholly inside free blocks of the arena's reservations (those idle for `idle_rounds`
    /// cleanup rounds), smallest free blocks first, until `want` bytes are unmapped, and withholds them from the
    /// engine. `wait`: the backend waits for the arena's stream first; off only where a passed mark says its
    /// work on them has run. Returns (pages, bytes). O(free blocks of a page or more visited).
    pub(super) fn unmap_free_pages(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        round: u64,
        idle_rounds: u64,
        want: u64,
        wait: bool,
    ) -> (u64, u64) {
        let page = self.page_size.expect("virtual arenas exist only with virtual memory");
        let stats = state.arenas[arena].engine().stats();
        if stats.reserved_bytes - stats.withheld_bytes - stats.allocated_bytes < page {
            return (0, 0);
        }
        // Stitched ranges kept over free pages go before any page is unmapped (see `stitch`).
        self.drop_kept_stitches(state, arena);
        let idle: Vec<bool> = if idle_rounds == 0 {
            Vec::new()
        } else {
            let idle = |e: &SegmentEntry<_>| round.saturating_sub(e.last_used_round) >= idle_rounds;
            state.arenas[arena].segments.iter().map(|slot| slot.as_ref().is_some_and(idle)).collect()
        };
        let eligible = |id: SegmentId| idle_rounds == 0 || idle[id.0 as usize];
        let stream = state.arenas[arena].stream;
        let (engine, segments) = state.virtual_parts(arena);
        let mut calls = 0;
        let bytes = engine.withhold_free(page, want, eligible, |id, offset, len| {
            let entry = segments[id.0 as usize].as_mut().expect("segment exists");
            self.backend.unmap_pages(&entry.handle, offset, len, stream, wait);
            *entry.mapped.as_mut().expect("virtual segment") -= len;
            calls += 1;
        });
        state.mapped_bytes -= bytes;
        state.stats.num_device_free += calls;
        state.stats.num_device_calls += calls;
        // A shift, not a division (pages are powers of two, checked in `Pool::new`): this runs on every remap.
        (bytes >> page.trailing_zeros(), bytes)
    }

    /// Unmaps every mapped range of a reservation of the arena serving `stream` (before it is destroyed or
    /// dropped); returns the bytes and the calls made.
    pub(super) fn unmap_all(
        backend: &B,
        engine: &Engine,
        stream: StreamId,
        id: SegmentId,
        entry: &SegmentEntry<B::Segment>,
    ) -> (u64, u64) {
        if entry.mapped.is_none() {
            return (0, 0);
        }
        let (mut released, mut calls) = (0, 0);
        for (offset, len) in engine.backed_ranges(id) {
            backend.unmap_pages(&entry.handle, offset, len, stream, true);
            released += len;
            calls += 1;
        }
        debug_assert_eq!(Some(released), entry.mapped, "mapped bytes follow the engine's backed ranges");
        (released, calls)
    }
}
