//! Repeating steps served from a plan.
//!
//! A training or inference loop makes the same allocations and frees in the same order at every step. Once the
//! caller marks where steps end ([`Pool::mark_step`]), the pool records each step's allocations (rounded size
//! and stream) and frees (which of the step's allocations, or one made before it). When [`REPEATS_TO_PLAN`]
//! steps in a row were the same, it plans the step: the allocations freed within the step, on the stream that
//! makes most of them, get offsets in one segment from the offline planner ([`crate::plan::solve`]), which
//! packs them by their lifetimes (1.000 of the step's peak live bytes on the shared training traces, where
//! best fit online leaves 1.02-1.07). The memory the pool held for those steps is released first, and one
//! segment of the plan's size is made in an arena of its own.
//!
//! The next steps' allocations are then placed at their planned offsets. Each placement is checked by the engine
//! ([`crate::engine::Engine::allocate_at`]): the range must be free, so a step that does something else (another
//! size, order or lifetime) never gets memory that overlaps a live block; what cannot be placed goes to the pool
//! like any allocation (a fallback). A placement is O(1): the plan knows, for each allocation, which planned
//! block lies just below it at that moment, and the engine checks the free block that follows it.
//!
//! A plan never adds memory. It is made only where its first step would not reserve more than the step before it
//! did at its peak: what stays reserved once the cache is released, plus the plan's segment, plus what the
//! step's unplanned allocations may take at once beyond the older blocks it frees, must not pass that peak
//! (otherwise the trial itself would set the peak). And it stays only where its first step did not, in fact,
//! reserve more. Blocks that outlive their step (weights, optimizer state) are allocated in the first
//! steps among the step's own blocks, and the free ranges they leave in their segments are used by unplanned
//! steps but not by planned ones, whose blocks go to the plan's segment; where those ranges outweigh what the
//! plan saves, no plan is made, or the one made goes (ResNet-50 training through PyTorch on an H100: 1.035 of
//! peak allocated with the plan, 1.020 without).
//!
//! A plan whose step deviates [`MISSES_TO_DROP`] times in a row is dropped (its segment goes once empty) and
//! recording starts again, so a workload that changes its step gets a new plan two steps later, while a single
//! odd step (an evaluation, a checkpoint) keeps the plan. Blocks that outlive their step (weights, optimizer
//! state, outputs kept) are never planned: they come from the pool, as before.
//!
//! While steps are marked, allocations and frees take the pool's lock (the step's order is recorded there) and
//! skip the thread caches: a step planned for one stream's order is what a training loop is, and PyTorch's own
//! allocator takes one lock per operation too. Pools whose steps are never marked pay one load per operation.

use super::books::steps::{make_plan, Made, Plan, Route, StepEnd, StepOutcome, StepReport};
use super::state::{Arena, ArenaClass, SegmentEntry, State};
use super::Pool;
use crate::{Backend, BlockHandle, Result, Strategy, StreamId};
use std::sync::atomic::Ordering;

impl<B: Backend> Pool<B> {
    /// Marks the end of a step (and the start of the next): the first call starts recording, and steps that
    /// repeat are served from a plan (see [`crate::pool`]'s steps). Planning runs here, off the allocation path,
    /// with the pool's lock let go while the planner works. O(1) but at the end of a step that gets a plan
    /// (O(step's operations × log)) or drops one.
    pub fn mark_step(&self) -> StepReport {
        let mut state = self.state().lock();
        state.stats.num_steps += 1;
        let step = state.stats.num_steps;
        if !self.plans_steps() {
            return StepReport { step, outcome: StepOutcome::Off, planned_bytes: 0 };
        }
        self.detour.fetch_or(super::STEPPING, Ordering::Relaxed);
        self.retire_planned(&mut state);
        // A plan whose segment was released (cleanup, a shortfall) is gone.
        if let Some((arena, segment)) = state.steps.plan_segment() {
            if state.arenas[arena].engine().segment_size(segment).is_none() {
                state.steps.drop_plan(false);
            }
        }
        let reserved = state.reserved();
        let peak = std::mem::replace(&mut state.steps.step_peak, reserved);
        let outcome = match state.steps.end_step(peak) {
            StepEnd::Nothing(outcome) => outcome,
            StepEnd::Plan(events) => {
                drop(state);
                let made = make_plan(events.clone());
                state = self.state().lock();
                if made.is_some_and(|made| self.install_plan(&mut state, made, peak)) {
                    StepOutcome::PlanMade
                } else {
                    // Not tried again for this step, unless steps ran meanwhile and changed it.
                    state.steps.refused = state.steps.previous.as_ref() == Some(&events);
                    StepOutcome::Recorded
                }
            }
        };
        if matches!(outcome, StepOutcome::Planned) {
            state.stats.num_steps_planned += 1;
        }
        self.retire_planned(&mut state);
        // The next step's peak starts from what is reserved once the plan is in (or gone).
        state.steps.step_peak = state.reserved();
        let planned_bytes = state.planned_bytes();
        StepReport { step, outcome, planned_bytes }
    }

    /// Whether this pool plans steps: asked to, and able to place blocks inside a segment.
    fn plans_steps(&self) -> bool {
        self.config.plan_steps && self.config.strategy == Strategy::Pooled && !self.whole_blocks
    }

    /// Installs a plan made from the latest steps: the memory the pool caches goes back first (the plan replaces
    /// what those steps took), then one segment of the plan's size is made. False when it cannot be (the limit,
    /// the device) or could raise the step's peak (`peak_before`), which leaves the pool as it was apart from the
    /// release.
    fn install_plan(&self, state: &mut State<B::Segment>, made: Made, peak_before: u64) -> bool {
        // Installing releases cached memory first, which a capture refuses (see `capture`).
        if self.capture_underway() {
            return false;
        }
        // Steps may have run while the lock was let go: the plan is of the latest two only if none deviated.
        if state.steps.plan_segment().is_some() || state.steps.previous.as_ref() != Some(&made.events) {
            return false;
        }
        let granularity = self.backend.segment_granularity();
        let Some(size) = made.bytes.checked_next_multiple_of(granularity) else { return false };
        if size > self.backend.max_segment_size() {
            return false;
        }
        self.release_cached_locked(state, 0, u64::MAX);
        if state.stats.limit_bytes.is_some_and(|limit| state.reserved() + size > limit) {
            return false;
        }
        // A plan never adds memory: its first step holds what stays reserved now, the plan's segment, and what
        // the step's other allocations may take from the device (their most bytes at once beyond those of older
        // blocks the step has freed, less what the memory still held has free). Where that could pass the step's
        // peak without the plan, the trial itself would set the higher peak that out-of-memory errors are made
        // of, whether the plan stayed or not: it is not tried.
        let held_free = state.reserved().saturating_sub(state.stats.allocated_bytes.current);
        let others = made.unplanned_bytes.saturating_sub(held_free);
        if state.reserved().saturating_add(size).saturating_add(others) > peak_before {
            return false;
        }
        let Ok(arena) = self.planned_arena(state, made.stream) else { return false };
        state.stats.num_device_calls += 1;
        let Ok(handle) = self.backend.create_segment(size) else { return false };
        state.stats.num_device_alloc += 1;
        let entry = SegmentEntry { handle, mapped: None, last_used_round: state.cleanup_round, last_used_alloc: 0 };
        let segment = state.add_segment(arena, size, entry);
        state.stats.segments.add(1);
        state.update_reserved();
        state.stats.num_step_plans += 1;
        let live = vec![None; made.places.len()];
        state.steps.plan = Some(Plan {
            arena,
            segment,
            stream: made.stream,
            events: made.events,
            places: made.places,
            live,
            misses: 0,
            on_trial: Some(peak_before),
        });
        true
    }

    /// The planned arena of `stream`, made on first use.
    fn planned_arena(&self, state: &mut State<B::Segment>, stream: StreamId) -> Result<usize> {
        if let Some(&(_, arena)) = state.steps.arenas.iter().find(|(s, _)| *s == stream) {
            return Ok(arena);
        }
        if state.arenas.len() + 1 > 1 << super::ARENA_BITS {
            return Err(crate::Error::InvalidConfig("no arena numbers are left for a planned step".into()));
        }
        let (alignment, small_max) = (self.alignment, self.config.small_request_max);
        state.arenas.push(Arena::new(stream, ArenaClass::Planned, false, alignment, small_max, false));
        let arena = state.arenas.len() - 1;
        state.steps.arenas.push((stream, arena));
        Ok(arena)
    }

    /// Destroys the segments of dropped plans that are empty now.
    fn retire_planned(&self, state: &mut State<B::Segment>) {
        let mut retiring = std::mem::take(&mut state.steps.retiring);
        retiring.retain(|&(arena, segment)| {
            let engine = state.arenas[arena].engine();
            if engine.segment_size(segment).is_none() {
                return false;
            }
            if !engine.is_segment_empty(segment) {
                return true;
            }
            self.destroy_segment(state, arena, segment);
            false
        });
        state.update_reserved();
        state.steps.retiring = retiring;
    }

    /// An allocation while steps are marked: recorded, and placed where the plan says when it can be.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_stepped(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let mut state = self.state().lock();
        let (ordinal, route) = state.steps.note_alloc(self.rounded(bytes), stream);
        let mut placed = None;
        let handle = match route {
            Route::Planned { arena, segment, after, offset } if bytes > 0 => {
                match state.allocate_planned(arena, segment, after, offset, bytes) {
                    Some(alloc) => {
                        state.stats.num_planned_allocs += 1;
                        placed = Some(alloc.block);
                        self.hand_out(&mut state, arena, &alloc, bytes, true)
                    }
                    None => {
                        state.stats.num_plan_fallbacks += 1;
                        self.allocate_locked(&mut state, bytes, stream)?
                    }
                }
            }
            Route::Fallback => {
                state.stats.num_plan_fallbacks += 1;
                self.allocate_locked(&mut state, bytes, stream)?
            }
            _ => self.allocate_locked(&mut state, bytes, stream)?,
        };
        state.steps.opened(handle.key(), ordinal, placed);
        Ok(handle)
    }

    /// Records a free while steps are marked (before the block goes back).
    #[cold]
    #[inline(never)]
    pub(super) fn note_stepped_free(&self, block: &BlockHandle) {
        self.state().lock().steps.note_free(block.key(), block.size());
    }
}
