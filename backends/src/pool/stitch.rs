//! Stitched blocks: a request of several pages that no free range of its stream's reservations holds, served
//! from free pages scattered over those reservations instead of new ones. The pages are mapped a second time,
//! side by side, in an address range of their own (GMLake, ASPLOS'24, calls this stitching), and each piece is
//! held in the reservation's engine (a *holder* block) while the stitched block lives, so nothing else is cut
//! from it. The stitched block lives in an arena of class [`ArenaClass::Stitched`], one per virtual arena, whose
//! segments are those address ranges.
//!
//! Why: a workload whose shapes vary leaves free memory in pieces between live blocks; a request larger than
//! every piece maps new pages though the pieces add up to more than it needs. Unmapping free pages there and
//! mapping them at the end ([`crate::PoolConfig::mapped_slack`]) keeps reserved memory near the live set, but
//! moves pages on the allocation path in every pass of a repeating workload. A stitched range moves nothing: it
//! is kept when its block is freed, its pages go back to the reservation's free index, and a later request it
//! holds is served from it without a device call as long as its pages are free again (in a repeating workload,
//! at the same point of each pass).
//!
//! Why it is safe: a page of a stitched range is never unmapped from its reservation while the range maps it:
//! a live stitched block holds its pages (they are not free, so no trim takes them), and the kept ranges of an
//! arena are destroyed before any of its pages is unmapped ([`Pool::drop_kept_stitches`], called by every path
//! that unmaps: trims, sharing with other streams, destroying a reservation). Where the backend keeps pages
//! alive by mapping (CUDA: the second mapping holds its own reference to each page), even a mistake there would
//! leak memory, not hand it out twice.

use super::books::stitch::{Run, Stitch, Stitcher, MAX_KEPT_STITCHES, MAX_STITCH_EVICTIONS};
use super::state::{Arena, ArenaClass, SegmentEntry, State};
use super::{Pool, ARENA_BITS};
use crate::backend::PoolAccess;
use crate::engine::{Allocation, BlockId, SegmentId};
use crate::{Backend, BlockHandle, Result};

impl<B: Backend> Pool<B> {
    /// On a miss in virtual `arena` for `size` bytes (rounded), before new pages are mapped: a kept stitched
    /// range that holds the request and whose pages are free, else a new range over free pages of the arena's
    /// reservations, topped up with new pages when they lack fewer than a mapping of the request would take.
    /// Returns the stitch arena, the block in it, and whether the range was made now (device calls) rather than
    /// reused. `None` when stitching is off, the request fits one page (a free page would have been a fitting
    /// free range), a mapping takes no more new memory, or the pool stopped making ranges
    /// ([`MAX_STITCH_EVICTIONS`]). O(kept ranges × their runs) to reuse; O(free blocks visited + withheld ranges)
    /// and one device call per run to make one.
    pub(super) fn stitched(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> Option<(usize, Allocation, bool)> {
        let page = self.page_size?;
        // A stitch may unmap kept ranges to make room, which a capture refuses (see `capture`).
        if !self.stitching || size <= page || self.capture_underway() {
            return None;
        }
        let capacity = size.div_ceil(page) * page;
        if let Some(found) = self.reuse_stitch(state, arena, size, capacity) {
            return Some((found.0, found.1, false));
        }
        if state.stitch_evictions >= MAX_STITCH_EVICTIONS {
            return None;
        }
        let engine = state.arenas[arena].engine();
        let missing = engine.find_withheld(size, page).map_or(capacity, |restore| restore.len);
        let mut runs = engine.free_granules(page, capacity);
        let mut found: u64 = runs.iter().map(|r| r.len).sum();
        // New pages for what the free ones lack, when that is fewer than a mapping of the request would take:
        // mapped as free memory of the reservations (so that they serve anything later), then found again.
        if capacity - found >= missing {
            return None;
        }
        if found < capacity {
            if !self.map_free_pages(state, arena, capacity - found) {
                return None;
            }
            runs = state.arenas[arena].engine().free_granules(page, capacity);
            found = runs.iter().map(|r| r.len).sum();
        }
        if found < capacity {
            return None;
        }
        let runs: Vec<Run> =
            runs.into_iter().map(|r| Run { segment: r.segment, offset: r.offset, len: r.len, hint: None }).collect();
        let stitched = self.make_stitch(state, arena, capacity, runs, size)?;
        Some((stitched.0, stitched.1, true))
    }

    /// Maps `len` bytes (whole pages) of withheld space of `arena`'s reservations as free memory, within the
    /// limit, reusing other streams' free pages first as a mapping for a request does. Whether it did.
    fn map_free_pages(&self, state: &mut State<B::Segment>, arena: usize, len: u64) -> bool {
        let page = self.page_size.expect("virtual arenas exist only with virtual memory");
        let Some((segment, offset)) = state.virtual_engine(arena).restore_free(len, page) else { return false };
        self.take_free_pages(state, arena, len);
        let within_limit = state.stats.limit_bytes.is_none_or(|l| state.reserved() + len <= l);
        let mapped = within_limit && {
            state.stats.num_device_calls += 1;
            let entry = state.arenas[arena].segments[segment.0 as usize].as_mut().expect("segment exists");
            match self.backend.map_pages(&entry.handle, offset, len) {
                Ok(()) => {
                    *entry.mapped.as_mut().expect("virtual segment") += len;
                    state.mapped_bytes += len;
                    state.stats.num_device_alloc += 1;
                    true
                }
                Err(e) => {
                    log::debug!("{}: mapping pages for a stitched block failed: {e}", self.backend.name());
                    false
                }
            }
        };
        if !mapped {
            let withheld = state.virtual_engine(arena).withhold_range(segment, offset, len, page);
            debug_assert!(withheld, "the restored range is free");
        }
        state.update_reserved();
        self.backend.release_spare_pages();
        mapped
    }

    /// A kept range of `arena`'s stitcher of `capacity` bytes (the pages `size` takes) whose pages are free now
    /// (the least recently used such), its pages held again. A larger range would leave whole pages it maps free
    /// in their reservation while its block lives, where a trim could unmap them. O(kept ranges × their runs).
    fn reuse_stitch(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
        capacity: u64,
    ) -> Option<(usize, Allocation)> {
        let k = state.stitchers.iter().position(|s| s.source == arena)?;
        let mut kept: Vec<(u64, usize)> = state.stitchers[k]
            .stitches
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().filter(|s| s.holders.is_empty() && s.capacity == capacity).map(|s| (s.last_used, i))
            })
            .collect();
        kept.sort_unstable();
        for (_, index) in kept {
            let mut runs = std::mem::take(&mut state.stitchers[k].stitches[index].as_mut().expect("listed").runs);
            let held = Self::hold(state, arena, &mut runs, size);
            let stitcher = &mut state.stitchers[k];
            stitcher.clock += 1;
            let clock = stitcher.clock;
            let stitch = stitcher.stitches[index].as_mut().expect("listed");
            stitch.runs = runs;
            if let Some(holders) = held {
                stitch.holders = holders;
                stitch.last_used = clock;
                let stitch_arena = stitcher.arena;
                let alloc =
                    state.allocate_in(stitch_arena, SegmentId(index as u32), size).expect("a kept range is free");
                state.stats.num_stitched_allocs += 1;
                return Some((stitch_arena, alloc));
            }
        }
        None
    }

    /// Holds the first `size` bytes of `runs` in `arena`'s engine: one holder block per run. `None` (nothing
    /// held) when some of it is not free.
    fn hold(state: &mut State<B::Segment>, arena: usize, runs: &mut [Run], size: u64) -> Option<Vec<BlockId>> {
        let mut left = size;
        let mut holders = Vec::with_capacity(runs.len());
        for run in runs.iter_mut() {
            if left == 0 {
                break;
            }
            let len = run.len.min(left);
            match state.virtual_engine(arena).allocate_range(run.segment, run.hint, run.offset, len) {
                Some(held) => {
                    run.hint = Some(held.block.index());
                    holders.push(held.block);
                    left -= len;
                }
                None => {
                    for holder in holders {
                        state.free_block(arena, holder).expect("held just now");
                    }
                    return None;
                }
            }
        }
        Some(holders)
    }

    /// Reserves `capacity` bytes of address space, maps `runs` there side by side, keeps the range in
    /// `arena`'s stitcher and takes a block of `size` bytes from it. `None` (nothing changed but the device
    /// calls counted) when the device refuses.
    fn make_stitch(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        capacity: u64,
        mut runs: Vec<Run>,
        size: u64,
    ) -> Option<(usize, Allocation)> {
        let k = self.stitcher_of(state, arena)?;
        state.stats.num_device_calls += 1;
        let handle = match self.backend.reserve_virtual(capacity) {
            Ok(handle) => handle,
            Err(e) => {
                log::debug!("{}: reserving a range for a stitched block failed: {e}", self.backend.name());
                return None;
            }
        };
        let mut at = 0;
        for run in &runs {
            let source = &state.arenas[arena].entry(run.segment).expect("a free page lies in a segment").handle;
            state.stats.num_device_calls += 1;
            if let Err(e) = self.backend.alias_pages(&handle, at, source, run.offset, run.len) {
                log::debug!("{}: mapping pages for a stitched block failed: {e}", self.backend.name());
                state.stats.num_device_calls += 1;
                self.backend.destroy_segment(handle, PoolAccess::new());
                return None;
            }
            at += run.len;
        }
        let holders = Self::hold(state, arena, &mut runs, size).expect("the pages were found free");
        let stitch_arena = state.stitchers[k].arena;
        let entry = SegmentEntry { handle, mapped: None, last_used_round: state.cleanup_round, last_used_alloc: 0 };
        let id = state.add_stitch_segment(stitch_arena, capacity, entry);
        let stitcher = &mut state.stitchers[k];
        stitcher.clock += 1;
        let slot = id.0 as usize;
        if stitcher.stitches.len() <= slot {
            stitcher.stitches.resize_with(slot + 1, || None);
        }
        stitcher.stitches[slot] = Some(Stitch { capacity, runs, holders, last_used: stitcher.clock });
        let alloc = state.allocate_in(stitch_arena, id, size).expect("a fresh range holds the request");
        state.stats.num_stitches += 1;
        state.stats.stitched_ranges += 1;
        state.stats.num_stitched_allocs += 1;
        self.forget_least_used(state, k);
        Some((stitch_arena, alloc))
    }

    /// The stitcher of virtual `arena`, made with its arena on first use. `None` when the pool has no arena
    /// number left.
    fn stitcher_of(&self, state: &mut State<B::Segment>, arena: usize) -> Option<usize> {
        if let Some(k) = state.stitchers.iter().position(|s| s.source == arena) {
            return Some(k);
        }
        if state.arenas.len() + 1 > 1 << ARENA_BITS {
            return None;
        }
        let stream = state.arenas[arena].stream;
        let (alignment, small_max) = (self.alignment, self.config.small_request_max);
        state.arenas.push(Arena::new(stream, ArenaClass::Stitched, false, alignment, small_max, false));
        let stitch_arena = state.arenas.len() - 1;
        state.stitchers.push(Stitcher { source: arena, arena: stitch_arena, stitches: Vec::new(), clock: 0 });
        Some(state.stitchers.len() - 1)
    }

    /// Destroys the least recently used kept ranges of stitcher `k` while it holds more than
    /// [`MAX_KEPT_STITCHES`] ranges.
    fn forget_least_used(&self, state: &mut State<B::Segment>, k: usize) {
        loop {
            let stitches = &state.stitchers[k].stitches;
            let count = stitches.iter().flatten().count();
            let oldest = stitches
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.as_ref().filter(|s| s.holders.is_empty()).map(|s| (s.last_used, i)))
                .min();
            match oldest {
                Some((_, index)) if count > MAX_KEPT_STITCHES => {
                    state.stitch_evictions += 1;
                    self.forget(state, k, index);
                }
                _ => return,
            }
        }
    }

    /// Destroys kept range `index` of stitcher `k`.
    fn forget(&self, state: &mut State<B::Segment>, k: usize, index: usize) {
        let stitch_arena = state.stitchers[k].arena;
        let stitch = state.stitchers[k].stitches[index].take().expect("kept");
        debug_assert!(stitch.holders.is_empty(), "only kept ranges are destroyed");
        let entry = state.remove_stitch_segment(stitch_arena, SegmentId(index as u32));
        state.stats.num_device_calls += 1;
        state.stats.stitched_ranges -= 1;
        self.backend.destroy_segment(entry.handle, PoolAccess::new());
    }

    /// Destroys every kept stitched range over virtual `arena`'s pages, before any of them is unmapped (see the
    /// module's doc). Live ones stay: their pages are held, so none of them is unmapped. O(ranges).
    pub(super) fn drop_kept_stitches(&self, state: &mut State<B::Segment>, arena: usize) {
        let Some(k) = state.stitchers.iter().position(|s| s.source == arena) else { return };
        for index in 0..state.stitchers[k].stitches.len() {
            if state.stitchers[k].stitches[index].as_ref().is_some_and(|s| s.holders.is_empty()) {
                self.forget(state, k, index);
            }
        }
    }

    /// Frees a stitched block (of stitch arena `arena`): its range is kept for later requests and its pages go
    /// back to the free index of the arena they lie in.
    pub(super) fn free_stitched(&self, state: &mut State<B::Segment>, arena: usize, block: &BlockHandle) -> Result<()> {
        let freed = state.free_block(arena, block.block).ok_or_else(|| self.unknown_block(block))?;
        state.record_free(block);
        let k = state.stitchers.iter().position(|s| s.arena == arena).expect("a stitch arena has a stitcher");
        let source = state.stitchers[k].source;
        let stitcher = &mut state.stitchers[k];
        stitcher.clock += 1;
        let clock = stitcher.clock;
        let stitch = stitcher.stitches[freed.segment.0 as usize].as_mut().expect("a live block's range is known");
        stitch.last_used = clock;
        for holder in std::mem::take(&mut stitch.holders) {
            state.free_block(source, holder).expect("holders live as long as their stitched block");
        }
        Ok(())
    }

    /// The holder blocks of live stitched blocks, each with the key of the stitched block it belongs to, for
    /// snapshots (which show a stitched block as the pieces of memory it holds).
    pub(super) fn stitch_holders(state: &State<B::Segment>) -> std::collections::HashMap<(usize, BlockId), u64> {
        let mut holders = std::collections::HashMap::new();
        for stitcher in &state.stitchers {
            let a = &state.arenas[stitcher.arena];
            for (index, stitch) in stitcher.stitches.iter().enumerate() {
                let Some(stitch) = stitch.as_ref().filter(|s| !s.holders.is_empty()) else { continue };
                let live = a.engine().blocks_in(SegmentId(index as u32)).find_map(|b| b.block.filter(|_| !b.free));
                let Some(live) = live else { continue };
                let key = ((stitcher.arena as u64) << 32) | u64::from(live.index());
                holders.extend(stitch.holders.iter().map(|&h| ((stitcher.source, h), key)));
            }
        }
        holders
    }
}
