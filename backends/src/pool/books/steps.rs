//! The books of repeating steps (`pool/steps.rs` serves allocations from them): what a step did, whether the
//! steps repeat, and the plan made from a step that does.

use crate::engine::{BlockId, SegmentId};
use crate::plan::{solve, PlanItem};
use crate::{KeyMap, StreamId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

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

/// What [`Pool::mark_step`](crate::Pool::mark_step) found at the end of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StepOutcome {
    /// Recorded; no plan yet (or none made: the step's plan could have raised its peak, see
    /// [`crate::pool`]'s steps).
    Recorded,
    /// Ran as the plan foresaw.
    Planned,
    /// Deviated from the plan, which is kept for now.
    Deviated,
    /// Deviated again: the plan was dropped, and recording starts over.
    Dropped,
    /// The plan's first step reserved more memory at its peak than the step before the plan, although the plan
    /// was expected not to (the step's unplanned allocations found no room in the memory held). The plan was
    /// dropped, and this step is not planned again.
    Unprofitable,
    /// A plan was made from this step and the ones before: the next steps are served from it.
    PlanMade,
    /// Planning is off ([`crate::PoolConfig::plan_steps`], or a pool that cannot place blocks: every block a
    /// segment of its own, or the `direct` strategy); the step was only counted.
    Off,
}

/// The end of one step, as [`Pool::mark_step`](crate::Pool::mark_step) reports it.
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(in crate::pool) enum Event {
    Alloc {
        size: u64,
        stream: StreamId,
    },
    /// A free of the step's allocation number `ordinal`, or of a block of `size` bytes allocated before the step
    /// (`None`; `size` is 0 for the step's own blocks, whose sizes their allocations give).
    Free {
        ordinal: Option<u32>,
        size: u64,
    },
}

/// Where a plan puts one allocation: `after` is the planned allocation whose block ends closest below
/// `offset` while this one is allocated, if any.
#[derive(Debug, Clone, Copy)]
pub(in crate::pool) struct Place {
    pub(in crate::pool) offset: u64,
    pub(in crate::pool) size: u64,
    pub(in crate::pool) after: Option<u32>,
}

/// A plan made outside the pool's lock, to install.
pub(in crate::pool) struct Made {
    pub(in crate::pool) stream: StreamId,
    pub(in crate::pool) events: Vec<Event>,
    pub(in crate::pool) places: Vec<Option<Place>>,
    pub(in crate::pool) bytes: u64,
    /// The most bytes the step's allocations that the plan leaves to the pool (other streams', blocks that
    /// outlive the step) hold at once beyond what the step has freed of blocks allocated before it: what they may
    /// take from the device once the plan has the step's own blocks.
    pub(in crate::pool) unplanned_bytes: u64,
}

/// A plan in use.
pub(in crate::pool) struct Plan {
    pub(in crate::pool) arena: usize,
    pub(in crate::pool) segment: SegmentId,
    pub(in crate::pool) stream: StreamId,
    pub(in crate::pool) events: Vec<Event>,
    /// By allocation number.
    pub(in crate::pool) places: Vec<Option<Place>>,
    /// By allocation number: the block placed for it in this step, while it lives.
    pub(in crate::pool) live: Vec<Option<BlockId>>,
    /// Steps in a row that deviated.
    pub(in crate::pool) misses: u32,
    /// The peak of reserved bytes in the step before the plan, until the plan's first step is compared with it.
    pub(in crate::pool) on_trial: Option<u64>,
}

/// Where [`Steps::note_alloc`] sends an allocation.
pub(in crate::pool) enum Route {
    /// Not in the plan (or no plan): the pool serves it.
    Pool,
    /// At its planned place: `after` is the live block below it.
    Planned { arena: usize, segment: SegmentId, after: Option<BlockId>, offset: u64 },
    /// In the plan, but the step has deviated so that it cannot be placed: the pool serves it.
    Fallback,
}

/// What the end of a step asks of the pool.
pub(in crate::pool) enum StepEnd {
    Nothing(StepOutcome),
    /// Plan this step (its events).
    Plan(Vec<Event>),
}

/// The steps' books, behind the pool's lock.
#[derive(Default)]
pub(in crate::pool) struct Steps {
    pub(in crate::pool) log: Vec<Event>,
    /// Live blocks allocated in this step: key → allocation number.
    pub(in crate::pool) open: KeyMap<u32>,
    pub(in crate::pool) allocs: u32,
    pub(in crate::pool) previous: Option<Vec<Event>>,
    pub(in crate::pool) repeats: u32,
    pub(in crate::pool) plan: Option<Plan>,
    /// Planned arenas, by stream.
    pub(in crate::pool) arenas: Vec<(StreamId, usize)>,
    /// Segments of dropped plans that still held live blocks: destroyed once empty.
    pub(in crate::pool) retiring: Vec<(usize, SegmentId)>,
    /// The repeating step could not be planned (nothing in it to plan, the limit, the device) or its plan did not
    /// pay: not tried again until the step changes.
    pub(in crate::pool) refused: bool,
    /// The most reserved bytes since the current step began (kept by [`State::update_reserved`]).
    pub(in crate::pool) step_peak: u64,
    /// The step ran past [`MAX_STEP_EVENTS`]: its record was dropped.
    pub(in crate::pool) overflowed: bool,
    /// Fingerprints of the steps whose plans did not pay ([`StepOutcome::Unprofitable`]): never planned again,
    /// whatever steps run between their repeats (a refusal alone lasts only until the step changes).
    pub(in crate::pool) unprofitable: Vec<u64>,
}

impl Steps {
    /// Records an allocation of `size` (rounded) bytes on `stream` and says where it goes. Returns its number in
    /// the step too.
    pub(in crate::pool) fn note_alloc(&mut self, size: u64, stream: StreamId) -> (u32, Route) {
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
    pub(in crate::pool) fn opened(&mut self, key: u64, ordinal: u32, placed: Option<BlockId>) {
        self.open.insert(key, ordinal);
        if let (Some(block), Some(plan)) = (placed, self.plan.as_mut()) {
            plan.live[ordinal as usize] = Some(block);
        }
    }

    /// Records the free of the block with `key`, of `size` bytes.
    pub(in crate::pool) fn note_free(&mut self, key: u64, size: u64) {
        let ordinal = self.open.remove(&key);
        if let (Some(ordinal), Some(plan)) = (ordinal, self.plan.as_mut()) {
            if let Some(live) = plan.live.get_mut(ordinal as usize) {
                *live = None;
            }
        }
        self.record(Event::Free { ordinal, size: if ordinal.is_none() { size } else { 0 } });
    }

    /// Appends to the step's record, up to [`MAX_STEP_EVENTS`]; past it the record is dropped for good (until the
    /// step ends), so that it never matches and costs no more memory.
    pub(in crate::pool) fn record(&mut self, event: Event) {
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
    pub(in crate::pool) fn end_step(&mut self, peak: u64) -> StepEnd {
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
                    self.unprofitable.push(fingerprint(&log));
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
            (true, Some(events)) if !self.unprofitable.contains(&fingerprint(events)) => StepEnd::Plan(events.clone()),
            _ => StepEnd::Nothing(StepOutcome::Recorded),
        }
    }

    /// Keeps `log` as the latest step, counting repeats.
    pub(in crate::pool) fn remember(&mut self, log: Vec<Event>) {
        if self.previous.as_ref() == Some(&log) {
            self.repeats += 1;
        } else {
            self.previous = Some(log);
            self.repeats = 1;
            self.refused = false;
        }
    }

    /// Drops the plan; its segment retires (`retire`) or is already gone.
    pub(in crate::pool) fn drop_plan(&mut self, retire: bool) {
        if let Some(plan) = self.plan.take() {
            if retire {
                self.retiring.push((plan.arena, plan.segment));
            }
        }
    }

    /// The plan's arena and segment, if there is a plan.
    pub(in crate::pool) fn plan_segment(&self) -> Option<(usize, SegmentId)> {
        self.plan.as_ref().map(|p| (p.arena, p.segment))
    }
}

/// A step's fingerprint: equal steps have equal ones (and different steps, but for a 64-bit hash collision).
fn fingerprint(events: &[Event]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    events.hash(&mut hasher);
    hasher.finish()
}

/// Plans the step of `events` (see the module's doc). `None` when nothing in it is planned.
pub(in crate::pool) fn make_plan(events: Vec<Event>) -> Option<Made> {
    // Each allocation's event, size and stream, and its free's event.
    let mut allocs: Vec<(usize, u64, StreamId)> = Vec::new();
    let mut frees: Vec<Option<usize>> = Vec::new();
    for (at, event) in events.iter().enumerate() {
        match *event {
            Event::Alloc { size, stream } => {
                allocs.push((at, size, stream));
                frees.push(None);
            }
            Event::Free { ordinal: Some(o), .. } => frees[o as usize] = Some(at),
            Event::Free { ordinal: None, .. } => {}
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
    let unplanned_bytes = unplanned_peak(&events, &places, &allocs);
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
            Event::Free { ordinal: Some(o), .. } => {
                if let Some(place) = places[o as usize] {
                    live.remove(&place.offset);
                }
            }
            Event::Free { ordinal: None, .. } => {}
        }
    }
    Some(Made { stream, events, places, bytes: solution.peak, unplanned_bytes })
}

/// [`Made::unplanned_bytes`]: walks the step, adding the allocations the plan does not place, taking away their
/// frees and those of blocks from before the step, and keeps the highest sum (0 at least).
fn unplanned_peak(events: &[Event], places: &[Option<Place>], allocs: &[(usize, u64, StreamId)]) -> u64 {
    let (mut held, mut peak, mut ordinal) = (0i128, 0i128, 0usize);
    for event in events {
        match *event {
            Event::Alloc { size, .. } => {
                if places[ordinal].is_none() {
                    held += i128::from(size);
                    peak = peak.max(held);
                }
                ordinal += 1;
            }
            Event::Free { ordinal: Some(o), .. } if places[o as usize].is_none() => {
                held -= i128::from(allocs[o as usize].1)
            }
            Event::Free { ordinal: Some(_), .. } => {}
            Event::Free { ordinal: None, size } => held -= i128::from(size),
        }
    }
    u64::try_from(peak).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S0: StreamId = StreamId(0);
    const S1: StreamId = StreamId(1);

    fn alloc(size: u64, stream: StreamId) -> Event {
        Event::Alloc { size, stream }
    }
    fn free(ordinal: u32) -> Event {
        Event::Free { ordinal: Some(ordinal), size: 0 }
    }
    fn free_older(size: u64) -> Event {
        Event::Free { ordinal: None, size }
    }

    #[test]
    fn unplanned_bytes_are_the_most_held_at_once_beyond_older_blocks_freed() {
        // Blocks 0 and 2 are planned (freed within the step, on S0); block 1 outlives the step; block 3 is on
        // another stream, freed within the step.
        let events = vec![alloc(8, S0), alloc(100, S0), free(0), alloc(8, S0), alloc(50, S1), free(3), free(2)];
        assert_eq!(make_plan(events).unwrap().unplanned_bytes, 150);
        // An older block freed before the new one is allocated makes room for it; freed after, it does not.
        let before = vec![alloc(8, S0), free_older(100), alloc(100, S0), free(0)];
        assert_eq!(make_plan(before).unwrap().unplanned_bytes, 0);
        let after = vec![alloc(8, S0), alloc(100, S0), free_older(100), free(0)];
        assert_eq!(make_plan(after).unwrap().unplanned_bytes, 100);
        // Frees of older blocks beyond what the step allocates count for nothing.
        let only_frees = vec![free_older(300), alloc(8, S0), free(0)];
        assert_eq!(make_plan(only_frees).unwrap().unplanned_bytes, 0);
    }

    #[test]
    fn a_plan_whose_first_step_raised_the_peak_is_dropped_and_never_made_again() {
        let step = vec![alloc(8, S0), free(0)];
        let made = make_plan(step.clone()).unwrap();
        let mut steps = Steps::default();
        let trial = |steps: &mut Steps, peak: u64| {
            steps.plan = Some(Plan {
                arena: 1,
                segment: SegmentId(0),
                stream: S0,
                events: made.events.clone(),
                places: made.places.clone(),
                live: vec![None; made.places.len()],
                misses: 0,
                on_trial: Some(100),
            });
            for &event in &step {
                steps.record(event);
            }
            steps.end_step(peak)
        };
        assert!(matches!(trial(&mut steps, 100), StepEnd::Nothing(StepOutcome::Planned)), "at the peak: kept");
        assert!(steps.plan.is_some() && steps.retiring.is_empty());
        assert!(matches!(trial(&mut steps, 101), StepEnd::Nothing(StepOutcome::Unprofitable)));
        assert!(steps.plan.is_none() && steps.retiring == [(1, SegmentId(0))], "its segment retires");
        // The same step again, twice: not planned.
        for _ in 0..2 {
            for &event in &step {
                steps.record(event);
            }
            assert!(matches!(steps.end_step(10), StepEnd::Nothing(StepOutcome::Recorded)));
        }
    }
}
