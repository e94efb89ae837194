//! The pool settings a workload runs under, drawn with it: every cross-stream policy and segment mode, thread
//! caches, stitching, plans, a limit workloads meet, a tagged pool (every block in reservations, so it can sleep).

use super::oracle::Reach;
use super::workload::{run, Door, Op};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use umm_backends::{CrossStream, Limit, PoolConfig, SegmentMode};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[derive(Debug, Clone)]
pub struct Setup {
    pub cross: CrossStream,
    pub mode: SegmentMode,
    /// Thread caches of small and large blocks on.
    pub caches: bool,
    pub stitch: bool,
    pub plans: bool,
    /// A limit low enough that workloads meet it (out of memory then waits for pending frees).
    pub limit: bool,
    /// A tagged pool: every block in reservations, so the pool can sleep.
    pub tagged: bool,
}

pub fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![Just(CrossStream::Off), Just(CrossStream::Completed), Just(CrossStream::Wait)],
        prop_oneof![Just(SegmentMode::Plain), Just(SegmentMode::Virtual), Just(SegmentMode::Auto)],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::bool::weighted(0.25),
        proptest::bool::weighted(0.2),
    )
        .prop_map(|(cross, mode, caches, stitch, plans, limit, tagged)| Setup {
            cross,
            mode,
            caches,
            stitch,
            plans,
            limit,
            tagged,
        })
}

impl Setup {
    /// The pool configuration: 2 MiB pages, segment slack 0.1, the setup's switches, a 160 MiB limit where drawn.
    pub fn config(&self) -> PoolConfig {
        let config = PoolConfig {
            cross_stream: self.cross,
            segment_mode: self.mode,
            segment_slack: Some(0.1),
            page_size: Some(2 * MIB),
            thread_cache_bytes: if self.caches { 32 * MIB } else { 0 },
            thread_cache_large_bytes: if self.caches { GIB } else { 0 },
            stitch: self.stitch,
            plan_steps: self.plans,
            limit: self.limit.then_some(Limit::Bytes(160 * MIB)),
            ..PoolConfig::default()
        };
        if self.tagged {
            config.tagged("kv")
        } else {
            config
        }
    }
}

/// The reach of `runs` workloads drawn from `strategy` by a deterministic runner, each run through a fresh
/// door made for its settings: what a suite prints and holds to minimums, so that a generator that stopped
/// reaching what it is for fails rather than passing vacuously.
pub fn reach_of<D: Door>(
    runs: u64,
    strategy: impl Strategy<Value = (Setup, Vec<Op>)>,
    door: impl Fn(&Setup) -> D,
) -> Reach {
    let mut runner = TestRunner::deterministic();
    let mut reach = Reach::default();
    for _ in 0..runs {
        let (setup, ops) = strategy.new_tree(&mut runner).expect("a workload").current();
        let one = run(door(&setup), &ops).unwrap_or_else(|e| panic!("{setup:?}: {e}"));
        reach.add(&one);
    }
    reach
}
