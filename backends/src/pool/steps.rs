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
//! A plan stays only where it lowers memory: its first step must not reserve more at its peak than the step
//! before the plan did. Blocks that outlive their step (weights, optimizer state) are allocated in the first
//! steps among the step's own blocks, and the free ranges they leave in their segments are used by unplanned
//! steps but not by planned ones, whose blocks go to the plan's segment; where those ranges outweigh what the
//! plan saves, the plan goes (ResNet-50 training through PyTorch on an H100: 1.035 of peak allocated with the
//! plan, 1.020 without).
//!
//! A plan whose step deviates [`MISSES_TO_DROP`] times in a row is dropped (its segment goes once empty) and
//! recording starts again, so a workload that changes its step gets a new plan two steps later, while a single
//! odd step (an evaluation, a checkpoint) keeps the plan. Blocks that outlive their step (weights, optimizer
//! state, outputs kept) are never planned: they come from the pool, as before.
//!
//! While steps are marked, allocations and frees take the pool's lock (the step's order is recorded there) and
//! skip the thread caches: a step planned for one stream's order is what a training loop is, and PyTorch's own
//! allocator takes one lock per operation too. Pools whose steps are never marked pay one load per operation.

use super::state::{Arena, ArenaClass, SegmentEntry, State};
use super::Pool;
use crate::engine::{BlockId, SegmentId};
use crate::plan::{solve, PlanItem};
use crate::{Backend, BlockHandle, KeyMap, Result, Strategy, StreamId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;

/// Steps in a row that must make the same allocations and frees before they are planned: two, so that a first
/// step that differs (optimizer state created, buffers warmed up) is not planned, and a repeating step is
/// planned after its second run.
pub const REPEATS_TO_PLAN: u32 = 2;

/// Steps in a row that deviate from the plan before it is dropped: one odd step keeps it.
pub const MISSES_TO_DROP: u32 = 2;

/// The most operations of one step that are recorded (24 bytes each; a GPT-2 training step makes about 3,200): a
/// longer step (or a program that marked one step and never the next) is not planned, and its record stops growing
/// there.
pub const MAX_STEP_EVENTS: usize = 1 << 20;

/// What [`Pool::mark_step`] found at the end of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StepOutcome {
    /// Recorded; no plan yet.
    Recorded,
    /// Ran as the plan foresaw.
    Planned,
    /// Deviated from the plan, which is kept for now.
    Deviated,
    /// Deviated again: the plan was dropped, and recording starts over.
    Dropped,
    /// The plan's first step reserved more memory at its peak than the step before the plan: the blocks that
    /// outlive steps (weights, optimizer state) sit in segments whose free ranges the unplanned steps used, and the
    /// plan's segment came on top. The plan was dropped, and this step is not planned again.
    Unprofitable,
    /// A plan was made from this step and the ones before: the next steps are served from it.
    PlanMade,
    /// Planning is off ([`crate::PoolConfig::plan_steps`], or a pool that cannot place blocks: every block a
    /// segment of its own, or the `direct` strategy); the step was only counted.
    Off,
}

/// The end of one step, as [`Pool::mark_step`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StepReport {
    /// Steps marked so far, this one included.
    pub step: u64,
    /// What happened at this step's end.
    pub outcome: StepOutcome,
    /// Bytes of the plan's segment in use now (0 without a plan).
    pub planned_bytes: u64,
}

/// One operation of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Event {
    Alloc {
        size: u64,
        stream: StreamId,
    },
    /// A free of the step's allocation number `ordinal`, or of a block allocated before the step (`None`).
    Free {
        ordinal: Option<u32>,
    },
}

/// Where a plan puts one allocation: `after` is the planned allocation whose block ends closest below
/// `offset` while this one is allocated, if any.
#[derive(Debug, Clone, Copy)]
struct Place {
    offset: u64,
    size: u64,
    after: Option<u32>,
}

/// A plan made outside the pool's lock, to install.
pub(super) struct Made {
    stream: StreamId,
    events: Vec<Event>,
    places: Vec<Option<Place>>,
    bytes: u64,
}

/// A plan in use.
struct Plan {
    arena: usize,
    segment: SegmentId,
    stream: StreamId,
    events: Vec<Event>,
    /// By allocation number.
    places: Vec<Option<Place>>,
    /// By allocation number: the block placed for it in this step, while it lives.
    live: Vec<Option<BlockId>>,
    /// Steps in a row that deviated.
    misses: u32,
    /// The peak of reserved bytes in the step before the plan, until the plan's first step is compared with it.
    on_trial: Option<u64>,
}

/// Where [`Steps::note_alloc`] sends an allocation.
pub(super) enum Route {
    /// Not in the plan (or no plan): the pool serves it.
    Pool,
    /// At its planned place: `after` is the live block below it.
    Planned { arena: usize, segment: SegmentId, after: Option<BlockId>, offset: u64 },
    /// In the plan, but the step has deviated so that it cannot be placed: the pool serves it.
    Fallback,
}

/// What the end of a step asks of the pool.
pub(super) enum StepEnd {
    Nothing(StepOutcome),
    /// Plan this step (its events).
    Plan(Vec<Event>),
}

/// The steps' books, behind the pool's lock.
#[derive(Default)]
pub(super) struct Steps {
    log: Vec<Event>,
    /// Live blocks allocated in this step: key → allocation number.
    open: KeyMap<u32>,
    allocs: u32,
    previous: Option<Vec<Event>>,
    repeats: u32,
    plan: Option<Plan>,
    /// Planned arenas, by stream.
    pub(super) arenas: Vec<(StreamId, usize)>,
    /// Segments of dropped plans that still held live blocks: destroyed once empty.
    retiring: Vec<(usize, SegmentId)>,
    /// The repeating step could not be planned (nothing in it to plan, the limit, the device) or its plan did not
    /// pay: not tried again until the step changes.
    refused: bool,
    /// The most reserved bytes since the current step began (kept by [`State::update_reserved`]).
    pub(super) step_peak: u64,
    /// The step ran past [`MAX_STEP_EVENTS`]: its record was dropped.
    overflowed: bool,
}

impl Steps {
    /// Records an allocation of `size` (rounded) bytes on `stream` and says where it goes. Returns its number in
    /// the step too.
    pub(super) fn note_alloc(&mut self, size: u64, stream: StreamId) -> (u32, Route) {
        let ordinal = self.allocs;
        // Saturates in a step of 2^32 allocations, long past the record's bound: such a step is never planned.
        self.allocs = self.allocs.saturating_add(1);
        self.record(Event::Alloc { size, stream });
        let Some(plan) = &self.plan else { return (ordinal, Route::Pool) };
        let Some(&Some(place)) = plan.places.get(ordinal as usize) else { return (ordinal, Route::Pool) };
        if plan.stream != stream || place.size != size {
            return (ordinal, Route::Fallback);
        }
        let after = match place.after {
            None => None,
            Some(below) => match plan.live[below as usize] {
                Some(block) => Some(block),
                None => return (ordinal, Route::Fallback),
            },
        };
        (ordinal, Route::Planned { arena: plan.arena, segment: plan.segment, after, offset: place.offset })
    }

    /// The block just handed out for allocation `ordinal` (key `key`; `placed` when at its planned place).
    pub(super) fn opened(&mut self, key: u64, ordinal: u32, placed: Option<BlockId>) {
        self.open.insert(key, ordinal);
        if let (Some(block), Some(plan)) = (placed, self.plan.as_mut()) {
            plan.live[ordinal as usize] = Some(block);
        }
    }

    /// Records the free of the block with `key`.
    pub(super) fn note_free(&mut self, key: u64) {
        let ordinal = self.open.remove(&key);
        if let (Some(ordinal), Some(plan)) = (ordinal, self.plan.as_mut()) {
            if let Some(live) = plan.live.get_mut(ordinal as usize) {
                *live = None;
            }
        }
        self.record(Event::Free { ordinal });
    }

    /// Appends to the step's record, up to [`MAX_STEP_EVENTS`]; past it the record is dropped for good (until the
    /// step ends), so that it never matches and costs no more memory.
    fn record(&mut self, event: Event) {
        if self.overflowed {
            return;
        }
        if self.log.len() >= MAX_STEP_EVENTS {
            self.overflowed = true;
            self.log = Vec::new();
            return;
        }
        self.log.push(event);
    }

    /// Ends the step, whose reserved bytes peaked at `peak`: compares it with the plan or the step before.
    pub(super) fn end_step(&mut self, peak: u64) -> StepEnd {
        let log = std::mem::take(&mut self.log);
        self.open.clear();
        self.allocs = 0;
        if std::mem::take(&mut self.overflowed) {
            // Too long to plan: it matches no plan and no step.
            if let Some(plan) = self.plan.as_mut() {
                plan.live.fill(None);
                plan.on_trial = None;
                plan.misses += 1;
                if plan.misses >= MISSES_TO_DROP {
                    self.drop_plan(true);
                }
            }
            self.previous = None;
            self.repeats = 0;
            return StepEnd::Nothing(StepOutcome::Recorded);
        }
        if let Some(plan) = self.plan.as_mut() {
            plan.live.fill(None);
            if plan.events == log {
                plan.misses = 0;
                // The first planned step decides whether the plan stays: it must not raise the peak.
                if plan.on_trial.take().is_some_and(|before| peak > before) {
                    self.drop_plan(true);
                    self.remember(log);
                    self.refused = true;
                    return StepEnd::Nothing(StepOutcome::Unprofitable);
                }
                return StepEnd::Nothing(StepOutcome::Planned);
            }
            plan.misses += 1;
            // A deviating step grows the pool for its own blocks: the steps after it no longer compare with the
            // step before the plan, and the plan is kept without a trial.
            plan.on_trial = None;
            if plan.misses < MISSES_TO_DROP {
                self.remember(log);
                return StepEnd::Nothing(StepOutcome::Deviated);
            }
            self.drop_plan(true);
            self.remember(log);
            return StepEnd::Nothing(StepOutcome::Dropped);
        }
        self.remember(log);
        match (self.repeats >= REPEATS_TO_PLAN && !self.refused, &self.previous) {
            (true, Some(events)) => StepEnd::Plan(events.clone()),
            _ => StepEnd::Nothing(StepOutcome::Recorded),
        }
    }

    /// Keeps `log` as the latest step, counting repeats.
    fn remember(&mut self, log: Vec<Event>) {
        if self.previous.as_ref() == Some(&log) {
            self.repeats += 1;
        } else {
            self.previous = Some(log);
            self.repeats = 1;
            self.refused = false;
        }
    }

    /// Drops the plan; its segment retires (`retire`) or is already gone.
    fn drop_plan(&mut self, retire: bool) {
        if let Some(plan) = self.plan.take() {
            if retire {
                self.retiring.push((plan.arena, plan.segment));
            }
        }
    }

    /// The plan's arena and segment, if there is a plan.
    fn plan_segment(&self) -> Option<(usize, SegmentId)> {
        self.plan.as_ref().map(|p| (p.arena, p.segment))
    }
}

/// Plans the step of `events` (see the module's doc). `None` when nothing in it is planned.
pub(super) fn make_plan(events: Vec<Event>) -> Option<Made> {
    // Each allocation's event, size and stream, and its free's event.
    let mut allocs: Vec<(usize, u64, StreamId)> = Vec::new();
    let mut frees: Vec<Option<usize>> = Vec::new();
    for (at, event) in events.iter().enumerate() {
        match *event {
            Event::Alloc { size, stream } => {
                allocs.push((at, size, stream));
                frees.push(None);
            }
            Event::Free { ordinal: Some(o) } => frees[o as usize] = Some(at),
            Event::Free { ordinal: None } => {}
        }
    }
    // The stream that makes most of the step's allocations.
    let mut counts: HashMap<StreamId, usize> = HashMap::new();
    for &(_, _, stream) in &allocs {
        *counts.entry(stream).or_default() += 1;
    }
    let stream = counts.into_iter().max_by_key(|&(s, n)| (n, std::cmp::Reverse(s.0)))?.0;
    let planned: Vec<u32> =
        (0..allocs.len() as u32).filter(|&o| allocs[o as usize].2 == stream && frees[o as usize].is_some()).collect();
    if planned.is_empty() {
        return None;
    }
    let items: Vec<PlanItem> = planned
        .iter()
        .map(|&o| PlanItem {
            first: allocs[o as usize].0 as u64,
            last: frees[o as usize].expect("planned allocations are freed") as u64,
            size: allocs[o as usize].1,
        })
        .collect();
    let solution = solve(&items);
    let mut places: Vec<Option<Place>> = vec![None; allocs.len()];
    for (&o, &offset) in planned.iter().zip(&solution.offsets) {
        places[o as usize] = Some(Place { offset, size: allocs[o as usize].1, after: None });
    }
    // Replays the step to find each planned block's neighbour below, checking that no two planned blocks live
    // at once overlap (the engine would refuse such a placement anyway).
    let mut live: BTreeMap<u64, (u32, u64)> = BTreeMap::new();
    let mut ordinal = 0u32;
    for event in &events {
        match *event {
            Event::Alloc { .. } => {
                if let Some(place) = places[ordinal as usize].as_mut() {
                    let end = place.offset + place.size;
                    let below = live.range(..place.offset).next_back().map(|(_, &(o, e))| (o, e));
                    let above = live.range(place.offset..).next().map(|(&start, _)| start);
                    if below.is_some_and(|(_, e)| e > place.offset) || above.is_some_and(|start| start < end) {
                        return None;
                    }
                    place.after = below.map(|(o, _)| o);
                    live.insert(place.offset, (ordinal, end));
                }
                ordinal += 1;
            }
            Event::Free { ordinal: Some(o) } => {
                if let Some(place) = places[o as usize] {
                    live.remove(&place.offset);
                }
            }
            Event::Free { ordinal: None } => {}
        }
    }
    Some(Made { stream, events, places, bytes: solution.peak })
}

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
    /// the device), which leaves the pool as it was apart from the release.
    fn install_plan(&self, state: &mut State<B::Segment>, made: Made, peak_before: u64) -> bool {
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
        let (alignment, small_max) = (self.backend.alignment(), self.config.small_request_max);
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
        self.state().lock().steps.note_free(block.key());
    }
}
