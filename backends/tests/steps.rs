//! Repeating steps served from a plan ([`Pool::mark_step`]), through the public API, on the simulated device
//! (plain segments and virtual reservations) and on host memory (whose bytes are checked): a step that repeats
//! is planned after two runs and then served at its planned offsets with no device call; a step that deviates
//! never gets memory that overlaps a live block; a plan is kept through one odd step and dropped after two;
//! blocks that outlive their step come from the pool; the plan's segment counts in every statistic.

use proptest::prelude::*;
use std::collections::HashMap;
use umm_backends::{
    BlockHandle, HostBackend, MemoryPool, Pool, PoolConfig, SegmentMode, SimBackend, StepOutcome, StreamId,
    MAX_STEP_EVENTS, MISSES_TO_DROP, REPEATS_TO_PLAN,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S0: StreamId = StreamId(0);

#[derive(Debug, Clone, Copy)]
enum Memory {
    Plain,
    Virtual,
    Host,
}

const MEMORIES: [Memory; 3] = [Memory::Plain, Memory::Virtual, Memory::Host];

fn pool(memory: Memory) -> Box<dyn MemoryPool> {
    pool_with(memory, PoolConfig::default())
}

fn pool_with(memory: Memory, config: PoolConfig) -> Box<dyn MemoryPool> {
    let mode = |m| PoolConfig { segment_mode: m, ..config.clone() };
    match memory {
        Memory::Plain => Box::new(Pool::new(SimBackend::plain("sim", 64 * GIB), mode(SegmentMode::Plain)).unwrap()),
        Memory::Virtual => {
            let config = PoolConfig { page_size: Some(2 * MIB), ..mode(SegmentMode::Virtual) };
            Box::new(Pool::new(SimBackend::new("sim", 64 * GIB), config).unwrap())
        }
        Memory::Host => Box::new(Pool::new(HostBackend::new("host", 8 * GIB), config).unwrap()),
    }
}

/// One operation of a scripted step: allocate `bytes` into slot `n`, or free slot `n`.
#[derive(Debug, Clone, Copy)]
enum Op {
    Alloc(usize, u64),
    Free(usize),
}

/// A training step's shape: activations allocated on the way forward, freed on the way back, with gradient
/// buffers and temporaries of varied sizes; slot 0 (the loss) outlives the step.
fn training_step(scale: u64) -> Vec<Op> {
    let sizes = [3 * MIB, 512 * KIB, 12 * MIB, 40 * KIB, 6 * MIB, 2 * MIB + 512, 24 * MIB, 96 * KIB];
    let mut ops = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        ops.push(Op::Alloc(1 + i, size * scale));
        if i % 3 == 2 {
            ops.push(Op::Alloc(20 + i, 700 * KIB * scale));
            ops.push(Op::Free(20 + i));
        }
    }
    for i in (0..sizes.len()).rev() {
        ops.push(Op::Alloc(40 + i, sizes[i] * scale / 2 + 256));
        ops.push(Op::Free(1 + i));
        ops.push(Op::Free(40 + i));
    }
    ops.push(Op::Alloc(0, 4 * KIB));
    ops
}

/// Runs a step's ops; the block in slot 0 lives until the next step's end (the loss a loop keeps).
struct Runner {
    pool: Box<dyn MemoryPool>,
    slots: HashMap<usize, BlockHandle>,
    kept: Vec<BlockHandle>,
    /// A distinct byte per block written at allocation, checked at free (host memory only).
    stamps: HashMap<u64, u8>,
    next_stamp: u8,
}

impl Runner {
    fn new(pool: Box<dyn MemoryPool>) -> Self {
        Self { pool, slots: HashMap::new(), kept: Vec::new(), stamps: HashMap::new(), next_stamp: 1 }
    }

    fn host(&self) -> bool {
        self.pool.name() == "host"
    }

    fn run(&mut self, ops: &[Op]) {
        for &op in ops {
            match op {
                Op::Alloc(slot, bytes) => {
                    let block = self.pool.allocate(bytes, S0).expect("allocation");
                    self.check_disjoint(&block);
                    if self.host() {
                        self.next_stamp = self.next_stamp.wrapping_add(1).max(1);
                        self.pool.fill(&block, 0, block.size(), self.next_stamp).unwrap();
                        self.stamps.insert(block.key(), self.next_stamp);
                    }
                    if let Some(old) = self.slots.insert(slot, block) {
                        self.kept.push(old);
                    }
                }
                Op::Free(slot) => {
                    if let Some(block) = self.slots.remove(&slot) {
                        self.free(block);
                    }
                }
            }
        }
    }

    fn free(&mut self, block: BlockHandle) {
        if self.host() {
            let stamp = self.stamps.remove(&block.key()).expect("stamped");
            let mut bytes = vec![0u8; block.size() as usize];
            self.pool.read(&block, 0, &mut bytes).unwrap();
            assert!(bytes.iter().all(|&b| b == stamp), "a block's bytes were overwritten while it lived");
        }
        self.pool.free(&block).expect("free");
    }

    /// No live block shares a byte with `block` (same arena and segment, overlapping ranges).
    fn check_disjoint(&self, block: &BlockHandle) {
        let place = |b: &BlockHandle| (b.key() >> 32, b.segment_index());
        for other in self.slots.values().chain(&self.kept) {
            if place(other) == place(block) {
                let apart =
                    other.offset() + other.size() <= block.offset() || block.offset() + block.size() <= other.offset();
                assert!(apart, "{block:?} overlaps live {other:?}");
            }
        }
    }

    fn end_step(&mut self) -> StepOutcome {
        for block in std::mem::take(&mut self.kept) {
            self.free(block);
        }
        self.pool.mark_step().outcome
    }
}

#[test]
fn a_repeating_step_is_planned_after_two_runs_and_then_served_without_device_calls() {
    for memory in MEMORIES {
        let mut r = Runner::new(pool(memory));
        let step = training_step(1);
        assert_eq!(r.end_step(), StepOutcome::Recorded, "{memory:?}: the first mark starts recording");
        let mut outcomes = Vec::new();
        for _ in 0..6 {
            r.run(&step);
            outcomes.push(r.end_step());
        }
        // The first step differs from the next (no loss of a step before it to free), so the second and third
        // are the two that repeat.
        assert_eq!(REPEATS_TO_PLAN, 2);
        assert_eq!(outcomes[..3], [StepOutcome::Recorded, StepOutcome::Recorded, StepOutcome::PlanMade], "{memory:?}");
        assert!(outcomes[3..].iter().all(|&o| o == StepOutcome::Planned), "{memory:?}: {outcomes:?}");
        let before = r.pool.stats();
        r.run(&step);
        assert_eq!(r.end_step(), StepOutcome::Planned);
        let after = r.pool.stats();
        // Every block freed within the step is placed (the loss of slot 0 outlives it and is not).
        let planned = step.iter().filter(|op| matches!(op, Op::Alloc(slot, _) if *slot != 0)).count() as u64;
        assert_eq!(after.num_planned_allocs - before.num_planned_allocs, planned, "{memory:?}");
        assert_eq!(after.num_plan_fallbacks, 0, "{memory:?}");
        assert_eq!(after.num_device_calls, before.num_device_calls, "{memory:?}: a planned step calls no device");
        assert_eq!(after.num_step_plans, 1);
        assert_eq!(after.num_steps_planned, 4);
        assert_eq!(after.num_steps, 8);
        assert!(after.planned_bytes > 0 && after.planned_bytes <= after.reserved_bytes.current, "{after:?}");
        let snapshot = r.pool.snapshot();
        let planned_segments: Vec<_> = snapshot.segments.iter().filter(|s| s.class == "planned").collect();
        assert_eq!(planned_segments.len(), 1, "{memory:?}");
        assert_eq!(planned_segments[0].size, after.planned_bytes);
    }
}

#[test]
fn a_planned_step_reserves_no_more_than_its_peak_live_bytes_rounded_to_a_segment() {
    for memory in MEMORIES {
        let mut r = Runner::new(pool(memory));
        let step = training_step(3);
        r.end_step();
        for _ in 0..3 {
            r.run(&step);
            r.end_step();
        }
        r.pool.reset_peaks();
        r.run(&step);
        assert_eq!(r.end_step(), StepOutcome::Planned);
        let stats = r.pool.stats();
        // The step's peak of live (rounded) bytes, from the script.
        let (mut live, mut peak, mut sizes) = (0u64, 0u64, HashMap::new());
        for op in &step {
            match *op {
                Op::Alloc(slot, bytes) => {
                    let size = bytes.next_multiple_of(r.pool.alignment());
                    sizes.insert(slot, size);
                    live += size;
                    peak = peak.max(live);
                }
                Op::Free(slot) => live -= sizes.remove(&slot).unwrap(),
            }
        }
        assert!(
            stats.planned_bytes <= peak.next_multiple_of(2 * MIB),
            "{memory:?}: plan {} over peak live {peak}",
            stats.planned_bytes
        );
        assert!(stats.reserved_bytes.peak <= stats.planned_bytes + 4 * MIB, "{memory:?}: {stats:?}");
    }
}

#[test]
fn one_odd_step_keeps_the_plan_and_a_new_repeating_step_replaces_it() {
    for memory in MEMORIES {
        let mut r = Runner::new(pool(memory));
        let (step, other) = (training_step(1), training_step(2));
        r.end_step();
        for _ in 0..3 {
            r.run(&step);
            r.end_step();
        }
        r.run(&other);
        assert_eq!(r.end_step(), StepOutcome::Deviated, "{memory:?}");
        r.run(&step);
        assert_eq!(r.end_step(), StepOutcome::Planned, "{memory:?}: one odd step keeps the plan");
        let mut outcomes = Vec::new();
        for _ in 0..MISSES_TO_DROP + 2 {
            r.run(&other);
            outcomes.push(r.end_step());
        }
        assert_eq!(
            outcomes,
            [StepOutcome::Deviated, StepOutcome::Dropped, StepOutcome::PlanMade, StepOutcome::Planned],
            "{memory:?}"
        );
        let stats = r.pool.stats();
        assert_eq!(stats.num_step_plans, 2);
        let planned = r.pool.snapshot().segments.iter().filter(|s| s.class == "planned").count();
        assert_eq!(planned, 1, "{memory:?}: the dropped plan's segment is gone");
    }
}

#[test]
fn a_plan_that_would_raise_the_peak_is_never_tried() {
    // Plain 20 MiB segments, and a virtual reservation of 32 MiB pages (weights pinning part of a page, as a
    // training loop's do): the step's blocks fit around the kept block, where a plan's segment would come on top.
    let plain = Pool::new(
        SimBackend::plain("sim", 64 * GIB),
        PoolConfig { segment_mode: SegmentMode::Plain, ..PoolConfig::default() },
    );
    let paged = PoolConfig { segment_mode: SegmentMode::Virtual, page_size: Some(32 * MIB), ..PoolConfig::default() };
    let paged = Pool::new(SimBackend::new("sim", 64 * GIB), paged);
    for (pool, held) in
        [(Box::new(plain.unwrap()) as Box<dyn MemoryPool>, 20 * MIB), (Box::new(paged.unwrap()), 32 * MIB)]
    {
        let step = |persistent: bool| -> Option<BlockHandle> {
            // Four 4 MiB blocks fit beside the block of 1.5 MiB that the first step leaves for good.
            let (a, b) = (pool.allocate(4 * MIB, S0).unwrap(), pool.allocate(4 * MIB, S0).unwrap());
            let kept = persistent.then(|| pool.allocate(3 * MIB / 2, S0).unwrap());
            let (c, d) = (pool.allocate(4 * MIB, S0).unwrap(), pool.allocate(4 * MIB, S0).unwrap());
            for block in [a, b, c, d] {
                pool.free(&block).unwrap();
            }
            kept
        };
        pool.mark_step();
        let kept = step(true);
        let mut outcomes = vec![pool.mark_step().outcome];
        for _ in 0..4 {
            assert!(step(false).is_none());
            outcomes.push(pool.mark_step().outcome);
        }
        // The plan's 16 MiB segment would come on top of the memory the kept block pins: it is not made, so the
        // peak never passes what the unplanned steps hold.
        assert_eq!(outcomes, [StepOutcome::Recorded; 5], "{}", pool.name());
        let stats = pool.stats();
        assert_eq!((stats.num_step_plans, stats.planned_bytes), (0, 0), "{stats:?}");
        assert_eq!((stats.reserved_bytes.current, stats.reserved_bytes.peak), (held, held), "{stats:?}");
        pool.free(&kept.unwrap()).unwrap();
    }
}

/// Where nothing pins memory the step's blocks used, the plan is made: a block that outlives each step and the
/// step's older block freed after it (a training loop's loss or gradients) do not stop it.
#[test]
fn a_step_that_frees_an_older_block_for_its_own_is_still_planned() {
    let pool = pool(Memory::Plain);
    let mut loss = None;
    let mut step = || {
        let blocks: Vec<_> = (0..4).map(|_| pool.allocate(12 * MIB, S0).unwrap()).collect();
        for block in blocks {
            pool.free(&block).unwrap();
        }
        let new = pool.allocate(4 * KIB, S0).unwrap();
        if let Some(old) = loss.replace(new) {
            pool.free(&old).unwrap();
        }
    };
    pool.mark_step();
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        step();
        outcomes.push(pool.mark_step().outcome);
    }
    use StepOutcome::*;
    assert_eq!(outcomes, [Recorded, Recorded, PlanMade, Planned, Planned]);
    let stats = pool.stats();
    assert!(stats.reserved_bytes.peak <= 4 * 12 * MIB + 2 * MIB, "{stats:?}");
}

#[test]
fn release_cached_takes_the_plans_segment_and_planning_starts_over() {
    let mut r = Runner::new(pool(Memory::Plain));
    let step = training_step(1);
    r.end_step();
    for _ in 0..3 {
        r.run(&step);
        r.end_step();
    }
    assert!(r.pool.stats().planned_bytes > 0);
    r.pool.release_cached();
    assert_eq!(r.pool.stats().planned_bytes, 0);
    // The plan is gone with its segment; the step still repeats, so the next mark plans it again.
    r.run(&step);
    assert_eq!(r.end_step(), StepOutcome::PlanMade);
    r.run(&step);
    assert_eq!(r.end_step(), StepOutcome::Planned);
}

#[test]
fn a_step_too_long_to_record_is_not_planned_and_its_record_stops_growing() {
    let pool = pool(Memory::Plain);
    pool.mark_step();
    // Alike steps, each one operation past the record's bound.
    for _ in 0..3 {
        for _ in 0..MAX_STEP_EVENTS / 2 {
            let block = pool.allocate(4 * KIB, S0).unwrap();
            pool.free(&block).unwrap();
        }
        let block = pool.allocate(4 * KIB, S0).unwrap();
        pool.free(&block).unwrap();
        assert_eq!(pool.mark_step().outcome, StepOutcome::Recorded);
    }
    // A short step after them is recorded afresh, and planned once it repeats.
    let short = || {
        let block = pool.allocate(4 * KIB, S0).unwrap();
        pool.free(&block).unwrap();
        pool.mark_step().outcome
    };
    assert_eq!([short(), short(), short()], [StepOutcome::Recorded, StepOutcome::PlanMade, StepOutcome::Planned]);
}

#[test]
fn with_planning_off_steps_are_only_counted() {
    let mut r = Runner::new(pool_with(Memory::Plain, PoolConfig { plan_steps: false, ..PoolConfig::default() }));
    for _ in 0..4 {
        r.run(&training_step(1));
        assert_eq!(r.end_step(), StepOutcome::Off);
    }
    let stats = r.pool.stats();
    assert_eq!((stats.num_steps, stats.num_step_plans, stats.planned_bytes), (4, 0, 0));
}

#[test]
fn a_step_with_nothing_freed_within_it_is_not_planned() {
    let mut r = Runner::new(pool(Memory::Plain));
    let step = [Op::Alloc(0, MIB)];
    for _ in 0..5 {
        r.run(&step);
        assert_eq!(r.end_step(), StepOutcome::Recorded);
    }
    assert_eq!(r.pool.stats().num_step_plans, 0);
}

/// A step of random ops over a few slots: `Some(size)` allocates into a slot (a size of a small set, so that
/// steps repeat often), `None` frees it.
fn random_step() -> impl Strategy<Value = Vec<(usize, Option<u64>)>> {
    let size = prop::sample::select(vec![256, 4 * KIB, 300 * KIB, 2 * MIB, 5 * MIB + 256, 21 * MIB]);
    prop::collection::vec((0usize..6, prop::option::weighted(0.6, size)), 1..40)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Steps that repeat, deviate, and come back, in any mix: no block ever overlaps a live one (and on host
    /// memory no block's bytes change while it lives), whatever the plan foresaw.
    #[test]
    fn deviating_steps_never_get_overlapping_memory(
        steps in prop::collection::vec(random_step(), 1..4),
        order in prop::collection::vec(0usize..4, 4..14),
        memory in prop::sample::select(MEMORIES.to_vec()),
    ) {
        let mut r = Runner::new(pool(memory));
        r.end_step();
        for &k in &order {
            let step = &steps[k % steps.len()];
            let ops: Vec<Op> = step
                .iter()
                .map(|&(slot, size)| match size {
                    Some(bytes) => Op::Alloc(slot, bytes),
                    None => Op::Free(slot),
                })
                .collect();
            r.run(&ops);
            r.end_step();
        }
        for (_, block) in std::mem::take(&mut r.slots) {
            r.free(block);
        }
        let stats = r.pool.stats();
        prop_assert_eq!(stats.active_blocks.current, 0);
        prop_assert_eq!(stats.allocated_bytes.current, 0);
    }
}
