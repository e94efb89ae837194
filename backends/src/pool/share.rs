//! Free memory shared across streams ([`CrossStream`]): before a stream's miss takes new memory from the
//! device, memory that other streams hold free serves it: an empty plain segment moves to the taking stream's
//! arena as it is, free pages of another stream's reservation are unmapped there and mapped (the backend keeps
//! their physical memory for the next map) in the taker's.
//!
//! Why it is safe: work queued on the giving stream before a block's free may still touch the block, so its
//! memory moves only after a mark ([`StreamMark`], a CUDA event) recorded on that stream after the free has
//! passed ([`CrossStream::Completed`]), or with the taking stream made to wait for that mark on the device
//! ([`CrossStream::Wait`]). Each arena remembers the mark epoch of its latest free (`freed_epoch`, one store
//! per free into its engine); a mark covers everything the arena holds free when it was recorded after that.
//!
//! Why on a miss only: a stream that reuses its own free memory makes no device call, and stays that way; the
//! marks and moves cost driver calls, which a miss that would otherwise create a segment or map pages pays
//! anyway.

use super::state::{ArenaClass, ArenaMark, State};
use super::Pool;
use crate::engine::{Allocation, SegmentId, WHOLE_FIT_SLACK_SHIFT};
use crate::{Backend, CrossStream};

/// Whether a giving arena's free memory may move to another stream now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Donor {
    /// The work queued before its frees has run (or the backend queues none): move it, unmap without waiting.
    Passed,
    /// The taking stream now waits for it on the device ([`CrossStream::Wait`]): plain segments move at once;
    /// pages are unmapped after the host waits for the giving stream.
    Ordered,
    /// Not yet: a mark is on its way.
    NotYet,
}

impl<B: Backend> Pool<B> {
    /// Whether any other stream's memory may serve a miss: sharing is on and the pool serves several streams.
    #[inline(always)]
    pub(super) fn shares_across_streams(&self, state: &State<B::Segment>) -> bool {
        self.config.cross_stream != CrossStream::Off && state.streams.len() > 1 && !self.capture_underway()
    }

    /// Whether a miss that would add `adding` bytes of new memory should take other streams' instead: sharing is
    /// on, and the new memory would lift reserved memory above the highest live figure so far. Below it the
    /// memory is needed anyway (the workload has had that much live), and streams keep their own free memory.
    /// A budget of some slack above the live peak was measured too: on a synthetic four-stream serving trace
    /// (`umm replay --backend sim`), slack up to 0.15 changed neither the page moves of warm passes (740 calls
    /// in three passes of 29,520 ops) nor memory (1.186 × live), and 0.25 cost memory (1.229) for 2% fewer
    /// calls: a stream's misses are its own peaks, which only other streams' free memory serves.
    pub(super) fn should_share(&self, state: &State<B::Segment>, adding: u64) -> bool {
        if !self.shares_across_streams(state) {
            return false;
        }
        let live_peak = state.live_high_water.max(state.stats.allocated_bytes.peak);
        state.reserved().saturating_add(adding) > live_peak
    }

    /// Whether `donor`'s free memory may serve the stream of arena `taker` now, marking the donor's stream when
    /// no mark covers its latest free (one event record; a mark still pending is waited out first rather than
    /// piling up events). Under [`CrossStream::Wait`] the taker's stream is made to wait for the mark.
    pub(super) fn donor(&self, state: &mut State<B::Segment>, donor: usize, taker: usize) -> Donor {
        self.donor_marking(state, donor, taker, true)
    }

    /// [`Pool::donor`] with `record` off: the mark there is decides, and none is recorded (no device call but
    /// an event query).
    pub(super) fn donor_marking(
        &self,
        state: &mut State<B::Segment>,
        donor: usize,
        taker: usize,
        record: bool,
    ) -> Donor {
        let policy = self.config.cross_stream;
        let taker_stream = state.arenas[taker].stream;
        let arena = &mut state.arenas[donor];
        if let Some(mark) = &mut arena.mark {
            let covers = mark.epoch > arena.freed_epoch;
            if !mark.passed && self.backend.mark_passed(&mark.mark) {
                mark.passed = true;
            }
            match (covers, mark.passed, policy) {
                (true, true, _) => return Donor::Passed,
                (true, false, CrossStream::Wait) => return self.order(taker_stream, &mark.mark),
                (_, false, _) => return Donor::NotYet,
                (false, true, _) => {}
            }
        }
        if !record {
            return Donor::NotYet;
        }
        if let Some(old) = arena.mark.take() {
            self.backend.release_mark(old.mark);
        }
        state.mark_epoch += 1;
        let epoch = state.mark_epoch;
        let arena = &mut state.arenas[donor];
        match self.backend.mark_stream(arena.stream) {
            Ok(None) => Donor::Passed,
            Ok(Some(mark)) => {
                state.stats.num_stream_marks += 1;
                let passed = self.backend.mark_passed(&mark);
                let donor = match (passed, policy) {
                    (true, _) => Donor::Passed,
                    (false, CrossStream::Wait) => self.order(taker_stream, &mark),
                    (false, _) => Donor::NotYet,
                };
                arena.mark = Some(ArenaMark { mark, epoch, passed });
                donor
            }
            Err(e) => {
                log::debug!("{}: marking a stream before sharing its free memory failed: {e}", self.backend.name());
                Donor::NotYet
            }
        }
    }

    /// Makes `taker` wait on the device for `mark`.
    fn order(&self, taker: crate::StreamId, mark: &crate::StreamMark) -> Donor {
        match self.backend.wait_for_mark(taker, mark) {
            Ok(()) => Donor::Ordered,
            Err(e) => {
                log::warn!("{}: ordering one stream after another failed: {e}", self.backend.name());
                Donor::NotYet
            }
        }
    }

    /// For a miss of `size` bytes in plain `arena`, which would create a segment of `preferred` bytes: an empty
    /// segment of another stream's arena of the same class that fits and is at most a quarter larger than
    /// `preferred` (the tightest), moved to `arena` and allocated from. Larger ones stay: a stream that took a
    /// segment far larger than it asks for would leave the rest idle in its arena while the giver, needing its
    /// segment back, made a new one (`segment_slack` destroys those instead when memory is short). `None` when
    /// sharing is off or no giving stream is ready. O(arenas + their empty segments).
    pub(super) fn adopt_empty_segment(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
        preferred: u64,
    ) -> Option<Allocation> {
        if !self.should_share(state, preferred) {
            return None;
        }
        let class: ArenaClass = state.arenas[arena].class;
        // Other streams' quick blocks go back into their engines first: a segment holding only those is empty.
        for donor in 0..state.arenas.len() {
            if donor != arena && state.arenas[donor].class == class && !state.arenas[donor].quick.is_empty() {
                state.drain_quick(donor);
            }
        }
        let most = preferred.saturating_add(preferred >> WHOLE_FIT_SLACK_SHIFT);
        let mut fits: Vec<(u64, usize, SegmentId)> = Vec::new();
        for (a, donor) in state.arenas.iter().enumerate() {
            if a == arena || donor.class != class || donor.virtual_segments {
                continue;
            }
            for id in donor.engine().empty_segments() {
                let seg = donor.engine().segment_size(id).expect("segment exists");
                if (size..=most).contains(&seg) {
                    fits.push((seg, a, id));
                }
            }
        }
        fits.sort_unstable_by_key(|&(seg, a, _)| (seg, a));
        let mut refused = Vec::new();
        for (_, donor, id) in fits {
            if refused.contains(&donor) {
                continue;
            }
            if self.donor(state, donor, arena) == Donor::NotYet {
                refused.push(donor);
                continue;
            }
            let entry = state.arenas[donor].segments[id.0 as usize].take().expect("segment exists");
            let seg_size = state.remove_segment(donor, id);
            let moved = state.add_segment(arena, seg_size, entry);
            state.stats.num_segments_shared += 1;
            return state.allocate_in(arena, moved, size);
        }
        None
    }

    /// Before virtual `arena` maps `missing` bytes of new pages: unmaps up to that many bytes of free pages that
    /// other streams' reservations hold, from streams whose marks allow it, so that the mapping reuses their
    /// physical memory instead of taking more. O(arenas + free blocks visited).
    pub(super) fn take_free_pages(&self, state: &mut State<B::Segment>, arena: usize, missing: u64) {
        if missing == 0 || !self.should_share(state, missing) {
            return;
        }
        let page = self.page_size.expect("virtual arenas exist only with virtual memory");
        let (round, mut taken) = (state.cleanup_round, 0);
        for donor in 0..state.arenas.len() {
            if taken >= missing {
                break;
            }
            let a = &state.arenas[donor];
            if donor == arena || !a.virtual_segments {
                continue;
            }
            let stats = a.engine().stats();
            let free_mapped = stats.reserved_bytes - stats.withheld_bytes - stats.allocated_bytes;
            if free_mapped < page {
                continue;
            }
            let wait = match self.donor(state, donor, arena) {
                Donor::Passed => false,
                Donor::Ordered => true,
                Donor::NotYet => continue,
            };
            let (pages, bytes) = self.unmap_free_pages(state, donor, round, 0, missing - taken, wait);
            state.stats.num_pages_shared += pages;
            taken += bytes;
        }
    }
}
