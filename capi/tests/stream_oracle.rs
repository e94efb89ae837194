//! Stream-ordered reuse through the C ABI over simulated devices, checked against the model of streams the
//! backends' suites use (`backends/tests/stream_model`): random workloads of `umm_alloc`, `umm_record_stream`,
//! frees on other streams, captures (`umm_capture_begin`/`end` with `umm_sim_capture`) and graphs captured into
//! private pools (`umm_pool_retain`, `umm_alloc_to_pool`, replayed until `umm_pool_release`), steps and
//! `umm_empty_cache`, sleeps and wakes of a tag's pool (`umm_set_tag`, `umm_sleep`, `umm_wake`), while the
//! device's streams are held back and let run item by item (`umm_sim_stream`).
//! After every operation no live block may share a byte with a block whose last owner's work may still run.
//! Each setting of cross-stream sharing, stitching, thread caches and segment mode runs in a process of its own
//! (the library reads its settings once).

#[path = "../../backends/tests/stream_model/mod.rs"]
mod stream_model;

mod common;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use std::ffi::{c_int, c_void};
use std::ops::Range;
use std::process::Command;
use stream_model::oracle::{Reach, Stream, Streams};
use stream_model::workload::{op, physical_bytes, run, Counters, Device, Door, Op};
use umm_capi::*;

use common::{last_error, stats, stream};

const DEVICE: c_int = 0;
/// The variable that tells a child process which settings it runs under.
const CHILD: &str = "UMM_ORACLE_TEST_SETTINGS";

/// The streams of simulated device [`DEVICE`], through `umm_sim_stream`.
struct CDevice;

fn sim(on: Stream, op: SimStreamOp, arg: u64) -> u64 {
    // SAFETY: a simulated device queues no work: any stream value is fine.
    let answer = unsafe { umm_sim_stream(DEVICE, stream(on as usize), op as c_int, arg) };
    assert!(answer >= 0, "{}", last_error());
    answer as u64
}

impl Streams for CDevice {
    fn completed(&self, on: Stream) -> u64 {
        sim(on, SimStreamOp::Completed, 0)
    }
    fn ordered_after(&self, on: Stream, other: Stream) -> u64 {
        sim(on, SimStreamOp::OrderedAfter, other)
    }
    fn bytes(&self, address: u64, len: u64) -> Vec<Range<u64>> {
        physical_bytes(|a| Some(sim(0, SimStreamOp::Byte, a)), address, len)
    }
}

impl Device for CDevice {
    fn launch(&self, on: Stream) -> u64 {
        sim(on, SimStreamOp::Launch, 0)
    }
    fn hold(&self, on: Stream) {
        sim(on, SimStreamOp::Hold, 0);
    }
    fn run(&self, on: Stream, item: u64) {
        sim(on, SimStreamOp::Run, item);
    }
    fn finish(&self, on: Stream) {
        sim(on, SimStreamOp::Finish, 0);
    }
    fn capture(&self, on: Stream, capturing: bool) {
        // SAFETY: as in `sim`.
        let done = unsafe { umm_sim_capture(DEVICE, stream(on as usize), c_int::from(capturing)) };
        assert_eq!(done, 0, "{}", last_error());
    }
    fn capture_violations(&self) -> u64 {
        stats(DEVICE)["capture_violations"].as_u64().expect("a simulated device counts capture violations")
    }
}

/// The C ABI: blocks are addresses, frees name their stream.
struct CDoor {
    device: CDevice,
    /// The device's counters when the door was made (they count over the process).
    start: Counters,
    /// Every thread allocates under tag [`TAG`] (`umm_set_tag`), so that the door can sleep and wake.
    tagged: bool,
}

/// The child setting (an environment variable of the test's own) under which allocations carry a tag.
const TAGGED: &str = "ORACLE_TAGGED";
const TAG: &std::ffi::CStr = c"kv";

thread_local! {
    /// Whether this thread's tag is set.
    static TAG_SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// An address handed out, as the tests' threads pass it around.
#[derive(Clone, Copy)]
struct Ptr(usize);

impl Ptr {
    fn of(p: *mut c_void) -> Option<Self> {
        (!p.is_null()).then_some(Ptr(p as usize))
    }
    fn get(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

fn pool_id(number: u64) -> PoolId {
    PoolId { first: 61, second: number }
}

impl Door for CDoor {
    type Handle = Ptr;
    type Device = CDevice;
    fn device(&self) -> &CDevice {
        &self.device
    }
    fn allocate(&self, bytes: u64, on: u64) -> Option<(Ptr, u64, u64)> {
        if self.tagged && !TAG_SET.get() {
            // SAFETY: `TAG` is a NUL-terminated string.
            assert_eq!(unsafe { umm_set_tag(TAG.as_ptr()) }, 0, "{}", last_error());
            TAG_SET.set(true);
        }
        // SAFETY: as in `sim`.
        let p = Ptr::of(unsafe { umm_alloc(bytes as isize, DEVICE, stream(on as usize)) })?;
        Some((p, p.0 as u64, bytes))
    }
    fn record(&self, block: &Ptr, on: u64) -> bool {
        // SAFETY: as in `sim`.
        assert_eq!(unsafe { umm_record_stream(block.get(), stream(on as usize)) }, 0, "{}", last_error());
        true
    }
    fn free(&self, block: &Ptr, on: u64) {
        // SAFETY: as in `sim`.
        unsafe { umm_free(block.get(), 0, DEVICE, stream(on as usize)) };
    }
    fn frees_on_streams(&self) -> bool {
        true
    }
    fn begin_capture(&self) {
        assert_eq!(umm_capture_begin(DEVICE), 0, "{}", last_error());
    }
    fn end_capture(&self) {
        assert_eq!(umm_capture_end(DEVICE), 0, "{}", last_error());
    }
    fn begin_graph(&self) -> Option<u64> {
        // Graphs made so far in the process: a private pool number no earlier graph used.
        static GRAPHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let number = GRAPHS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(umm_pool_retain(DEVICE, pool_id(number)), 1, "{}", last_error());
        self.begin_capture();
        Some(number)
    }
    fn allocate_in_graph(&self, pool: u64, bytes: u64, on: u64) -> Option<(Ptr, u64, u64)> {
        // SAFETY: as in `sim`.
        let p = Ptr::of(unsafe { umm_alloc_to_pool(bytes as isize, DEVICE, stream(on as usize), pool_id(pool)) })?;
        Some((p, p.0 as u64, bytes))
    }
    fn end_graph(&self) {
        self.end_capture();
    }
    fn release_graph(&self, pool: u64) {
        assert_eq!(umm_pool_release(DEVICE, pool_id(pool)), 0, "{}", last_error());
    }
    fn mark_step(&self) {
        assert_eq!(umm_mark_step(DEVICE), 0, "{}", last_error());
    }
    fn tidy(&self, _: u8) {
        assert!(umm_empty_cache(DEVICE) >= 0, "{}", last_error());
    }
    fn sleep_and_wake(&self) -> bool {
        if !self.tagged {
            return false;
        }
        // Refused while nothing was allocated under the tag yet, or while a capture is underway.
        // SAFETY: `TAG` is a NUL-terminated string; NULL offloads nothing.
        let slept = unsafe { umm_sleep(std::ptr::null(), TAG.as_ptr()) };
        if slept.is_null() {
            return false;
        }
        // SAFETY: a string from `umm_sleep`, freed once.
        unsafe { umm_string_free(slept) };
        // SAFETY: as above.
        let woke = unsafe { umm_wake(TAG.as_ptr()) };
        assert!(!woke.is_null(), "{}", last_error());
        // SAFETY: a string from `umm_wake`, freed once.
        unsafe { umm_string_free(woke) };
        true
    }
    fn counters(&self) -> Counters {
        let now = counters();
        Counters {
            moves: now.moves - self.start.moves,
            planned_allocs: now.planned_allocs - self.start.planned_allocs,
            stitched_allocs: now.stitched_allocs - self.start.stitched_allocs,
            retries: now.retries - self.start.retries,
        }
    }
}

/// What the device's pools counted so far.
fn counters() -> Counters {
    let stats = stats(DEVICE);
    let count = |key: &str| stats[key].as_u64().unwrap_or(0);
    Counters {
        moves: count("num_segments_shared") + count("num_pages_shared") + count("num_blocks_shared"),
        planned_allocs: count("num_planned_allocs"),
        stitched_allocs: count("num_stitched_allocs"),
        retries: count("num_alloc_retries") + count("num_ooms"),
    }
}

fn door() -> CDoor {
    CDoor { device: CDevice, start: counters(), tagged: std::env::var_os(TAGGED).is_some() }
}

fn workload() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 20..90)
}

/// Workloads per setting: a quarter of `UMM_ORACLE_CASES` (256 by default).
fn cases() -> u32 {
    let cases: u32 = std::env::var("UMM_ORACLE_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256);
    (cases / 4).max(1)
}

/// The settings each child process runs under.
const SETTINGS: &[&[(&str, &str)]] = &[
    &[("UMM_CROSS_STREAM", "completed")],
    &[("UMM_CROSS_STREAM", "wait"), ("UMM_STITCH", "off")],
    &[("UMM_CROSS_STREAM", "off"), ("UMM_THREAD_CACHE", "0"), ("UMM_THREAD_CACHE_LARGE", "0")],
    &[("UMM_CROSS_STREAM", "completed"), ("UMM_SEGMENT_MODE", "plain")],
    &[("UMM_CROSS_STREAM", "wait"), ("UMM_SEGMENT_MODE", "plain"), ("UMM_THREAD_CACHE", "0")],
    // Every allocation under a tag, whose pool sleeps (discarding) and wakes among the other operations.
    &[("UMM_CROSS_STREAM", "completed"), (TAGGED, "1")],
];

#[test]
fn the_c_abi_never_hands_out_bytes_whose_work_may_still_run() {
    if std::env::var_os(CHILD).is_some() {
        return; // a child runs only `oracle_child`
    }
    let exe = std::env::current_exe().expect("the test binary");
    for settings in SETTINGS {
        let mut child = Command::new(&exe);
        child.args(["--exact", "oracle_child", "--ignored", "--nocapture", "--test-threads=1"]);
        child.env(CHILD, format!("{settings:?}"));
        for (name, value) in *settings {
            child.env(name, value);
        }
        let out = child.output().expect("the test binary runs");
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "under {settings:?}:\n{text}");
        let reach = text.lines().find_map(|l| l.split_once("reach ").map(|(_, r)| r)).unwrap_or("no reach printed");
        eprintln!("{settings:?}: {reach}");
    }
}

#[test]
#[ignore = "run by the_c_abi_never_hands_out_bytes_whose_work_may_still_run in a process of its own"]
fn oracle_child() {
    assert!(std::env::var_os(CHILD).is_some(), "run by the_c_abi_never_hands_out_bytes_whose_work_may_still_run");
    let _g = common::simulated();
    let mut runner = TestRunner::new(proptest::test_runner::Config {
        cases: cases(),
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    });
    let reach = std::cell::RefCell::new(Reach::default());
    let result = runner.run(&workload(), |ops| {
        let one = run(door(), &ops).map_err(TestCaseError::fail)?;
        reach.borrow_mut().add(&one);
        Ok(())
    });
    println!("reach {:?}", reach.borrow());
    if let Err(e) = result {
        panic!("{e}");
    }
    if std::env::var_os(TAGGED).is_some() {
        assert!(reach.borrow().sleeps > 0, "the tagged workloads slept: {:?}", reach.borrow());
    }
    assert_eq!(stats(DEVICE)["live_pointers"], 0);
}

/// The generator's reach through the C ABI under the default settings, held to minimums: frees on other streams,
/// graphs and their replays, multi-stream records.
#[test]
fn the_c_abi_workloads_reach_what_they_are_for() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let _g = common::simulated();
    let mut runner = TestRunner::deterministic();
    let mut reach = Reach::default();
    let runs = 8;
    for _ in 0..runs {
        let ops = workload().new_tree(&mut runner).expect("a workload").current();
        let one = run(door(), &ops).unwrap_or_else(|e| panic!("{e}"));
        reach.add(&one);
    }
    eprintln!("reach of {runs} workloads through the C ABI: {reach:?}");
    assert!(reach.frees_on_other_streams >= runs, "{reach:?}");
    assert!(reach.cross_stream_reuses >= runs, "{reach:?}");
    assert!(reach.captures >= runs / 2, "{reach:?}");
    assert!(reach.multi_stream_frees >= runs / 2, "{reach:?}");
}
