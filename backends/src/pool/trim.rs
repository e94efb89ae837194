//! Giving memory back: cleanup rounds and `release_cached` destroy empty plain segments and unmap free pages of
//! virtual reservations; the allocation path gives back only what the limit or a slack budget demands.

use super::state::{Arena, ArenaClass, State};
use super::Pool;
use crate::backend::PoolAccess;
use crate::engine::SegmentId;
use crate::Backend;
use serde::Serialize;
use std::time::{Duration, Instant};

/// What a release of cached memory gave back to the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TrimReport {
    /// Bytes of physical memory given back.
    pub bytes_released: u64,
    /// Plain segments destroyed (and empty virtual reservations released).
    pub segments_released: u64,
    /// Pages unmapped inside virtual reservations.
    pub pages_unmapped: u64,
    /// Time the release took.
    #[serde(with = "duration_us")]
    pub elapsed: Duration,
}

mod duration_us {
    pub fn serialize<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros() as u64)
    }
}

impl<B: Backend> Pool<B> {
    /// Gives every cached byte back to the device: destroys empty plain segments and unmaps the free pages of
    /// virtual reservations. O(segments + free blocks in virtual reservations).
    pub fn release_cached(&self) -> TrimReport {
        self.drain_thread_caches(true);
        let mut state = self.state().lock();
        let report = self.release_cached_locked(&mut state, 0, u64::MAX);
        Self::release_host_store(&mut state);
        // The user asked for everything back: what the workload held before no longer says what it needs.
        state.reserved_high_water = state.reserved();
        state.stitch_evictions = 0;
        report
    }

    /// A periodic cleanup round: releases cached memory that has not been used for at least `idle_rounds`
    /// rounds (0 releases everything cached, like [`Pool::release_cached`]). O(segments + free blocks in
    /// virtual reservations).
    pub fn cleanup(&self, idle_rounds: u64) -> TrimReport {
        self.drain_thread_caches(true);
        let mut state = self.state().lock();
        state.cleanup_round += 1;
        self.release_cached_locked(&mut state, idle_rounds, u64::MAX)
    }

    /// Releases cached memory idle for `idle_rounds` rounds until `want` bytes are released (`u64::MAX`: all):
    /// empty plain segments first, then free pages of virtual reservations, smallest free blocks first (the large
    /// ones are what later requests fit in).
    pub(super) fn release_cached_locked(
        &self,
        state: &mut State<B::Segment>,
        idle_rounds: u64,
        want: u64,
    ) -> TrimReport {
        // A sleeping pool's pages are unmapped already and its books must stay as they were for the wake; during a
        // capture, unmapping or destroying memory waits for streams, which the capture refuses.
        if state.sleep.is_some() || self.capture_underway() {
            return TrimReport::default();
        }
        let start = Instant::now();
        let mut report = TrimReport::default();
        let round = state.cleanup_round;
        // Blocks lent across streams and freed go home first, waiting for their streams: released memory must be
        // free memory.
        self.return_loans(state, true, true);
        // Thread caches first; a slot whose lock is taken (its thread waits for this one, say) keeps its blocks:
        // waiting for it here, under the pool's lock, would break the lock order.
        for slot in self.shared.slots.iter() {
            if let Some(mut cache) = slot.cache.try_lock() {
                slot.empty_into(&mut cache, state);
            }
        }
        for arena in 0..state.arenas.len() {
            state.drain_quick(arena);
        }
        for arena in 0..state.arenas.len() {
            // Stitched ranges hold no memory of their own: they go with the pages they map.
            if state.arenas[arena].class == ArenaClass::Stitched {
                continue;
            }
            let idle: Vec<SegmentId> = state.arenas[arena]
                .engine()
                .empty_segments()
                .filter(|&id| {
                    let entry = state.arenas[arena].entry(id).expect("segment exists");
                    round.saturating_sub(entry.last_used_round) >= idle_rounds
                })
                .collect();
            for id in idle {
                if report.bytes_released >= want {
                    break;
                }
                report.bytes_released += self.destroy_segment(state, arena, id);
                report.segments_released += 1;
            }
        }
        for arena in 0..state.arenas.len() {
            if state.arenas[arena].virtual_segments && report.bytes_released < want {
                let (pages, bytes) =
                    self.unmap_free_pages(state, arena, round, idle_rounds, want - report.bytes_released, true);
                report.pages_unmapped += pages;
                report.bytes_released += bytes;
            }
        }
        state.update_reserved();
        self.backend.release_spare_pages();
        report.elapsed = start.elapsed();
        report
    }

    /// Destroys empty plain segments until `want` bytes are released (or none is left) to make room for a new
    /// segment under the slack budget: least recently used first, or where every block is a segment
    /// ([`Backend::segment_per_block`]) as few as can be. There the one tightest empty segment that covers `want`
    /// goes, found in the engines' free indexes in O(1), else the largest ones. Destroying the least recently used
    /// instead, often several small segments of sizes the workload comes back to, made every later pass of a
    /// repeating trace create and destroy them again (`umm replay --backend sim-wgpu`, gpt2_train: 278 device calls
    /// per 1,000 ops in a warm pass, at the same reserved memory). O(segments log segments) but for the covering
    /// segment, on a miss that creates a segment, which costs a device call.
    pub(super) fn release_empty_segments(&self, state: &mut State<B::Segment>, want: u64) {
        if self.whole_blocks {
            let plain = state.arenas.iter().enumerate().filter(|(_, arena)| !arena.virtual_segments);
            let covering = plain
                .filter_map(|(a, arena)| arena.engine().empty_segment_covering(want).map(|(id, size)| (size, a, id)))
                .min_by_key(|&(size, _, _)| size);
            if let Some((_, arena, id)) = covering {
                self.destroy_segment(state, arena, id);
                return;
            }
        }
        let mut empty: Vec<(u64, usize, SegmentId)> = Vec::new();
        // A planned step's segment goes only when asked (cleanup, a release, a shortfall), not to make room.
        let plain = |arena: &&Arena<B::Segment>| {
            !arena.virtual_segments && !matches!(arena.class, ArenaClass::Planned | ArenaClass::Stitched)
        };
        for (a, arena) in state.arenas.iter().enumerate().filter(|(_, arena)| plain(arena)) {
            for id in arena.engine().empty_segments() {
                let order = match self.whole_blocks {
                    true => u64::MAX - arena.engine().segment_size(id).expect("segment exists"),
                    false => arena.entry(id).expect("segment exists").last_used_alloc,
                };
                empty.push((order, a, id));
            }
        }
        empty.sort_unstable_by_key(|&(order, _, _)| order);
        let mut released = 0;
        for (_, arena, id) in empty {
            if released >= want {
                break;
            }
            released += self.destroy_segment(state, arena, id);
        }
    }

    /// Destroys an empty segment; returns the physical bytes it held.
    pub(super) fn destroy_segment(&self, state: &mut State<B::Segment>, arena: usize, id: SegmentId) -> u64 {
        if state.arenas[arena].virtual_segments {
            // Stitched ranges kept over its pages go first (see `stitch`).
            self.drop_kept_stitches(state, arena);
        }
        let entry = state.arenas[arena].segments[id.0 as usize].take().expect("segment exists");
        let (unmapped, calls) =
            Self::unmap_all(&self.backend, state.arenas[arena].engine(), state.arenas[arena].stream, id, &entry);
        state.stats.num_device_calls += calls + 1;
        let size = state.remove_segment(arena, id);
        let released = if entry.mapped.is_some() {
            state.mapped_bytes -= unmapped;
            unmapped
        } else {
            size
        };
        self.backend.destroy_segment(entry.handle, PoolAccess::new());
        self.backend.release_spare_pages();
        state.stats.num_device_free += 1;
        state.stats.segments.sub(1);
        state.update_reserved();
        released
    }

    /// The reserved bytes above which the allocation path gives cached memory back before taking more from the
    /// device ([`Pool::map_withheld`] unmaps free pages with `mapped_slack`, [`Pool::grow`] destroys empty
    /// segments with `segment_slack`), for an allocation of `size` bytes being added: the larger of
    /// `(1 + slack) × allocated` and the pool's own high water mark of reserved memory (below it, a steady
    /// workload reuses memory it held before, and trimming there would only churn); without a slack, no budget.
    #[inline(always)]
    pub(super) fn trim_budget(state: &State<B::Segment>, slack: Option<f64>, size: u64) -> u64 {
        let Some(slack) = slack else { return u64::MAX };
        let allocated_after = state.stats.allocated_bytes.current + size;
        ((allocated_after as f64 * (1.0 + slack)) as u64).max(state.reserved_high_water)
    }
}
