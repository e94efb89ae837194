//! Stream-ordered reuse through the manager's front door (`allocate_universal_with` on a stream, buffers dropped
//! on their stream, `mark_step`, `cleanup`, `release_all_cached`) checked against the model of streams the
//! backends' suites use (`backends/tests/stream_model`): random workloads over several streams, some held back
//! and let run one item at a time, under every setting of cross-stream sharing, with thread caches on and off,
//! stitching, plans, limits and captures; after every operation no live buffer may share a byte with one whose
//! last owner's work may still run. Each buffer is used on the stream it was allocated on (the manager has no
//! `record_stream`). Cases: 64, or a quarter of `UMM_ORACLE_CASES`.

#[path = "../backends/tests/stream_model/mod.rs"]
mod stream_model;

use proptest::prelude::*;
use std::sync::{Arc, Mutex};
use stream_model::setup::{reach_of, setup, Setup};
use stream_model::workload::{op, run, Counters, Door, Op};
use umm::backends::{MemoryPool, Pool, SimBackend, StreamId};
use umm::{AllocOptions, DeviceSelector, Placement, UniversalBuffer, UniversalMemoryManager};

const GIB: u64 = 1 << 30;

/// The backends' drawn settings but a tag: the manager's pools take their tags from its own tag scopes.
fn untagged() -> impl Strategy<Value = Setup> {
    setup().prop_map(|s| Setup { tagged: false, ..s })
}

/// A manager over host memory and one simulated device whose device-local pool has the setup's settings; the
/// pool is kept to reach its device's streams.
struct ManagerDoor {
    mm: UniversalMemoryManager,
    pool: Arc<Pool<SimBackend>>,
    /// The simulated device's index among the manager's devices.
    device: usize,
}

/// A buffer the workload's threads pass around; the free drops it.
type Buffer = Arc<Mutex<Option<UniversalBuffer<u8>>>>;

fn manager(setup: &Setup) -> ManagerDoor {
    let config = setup.config();
    let made: Arc<Mutex<Option<Arc<Pool<SimBackend>>>>> = Arc::default();
    let keep = Arc::clone(&made);
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device_with_pools(8 * GIB, move |name, _, _| {
            let pool = Arc::new(Pool::new(SimBackend::new(name, 8 * GIB).at_address(1 << 32), config.clone())?);
            *keep.lock().unwrap() = Some(Arc::clone(&pool));
            Ok(pool as Arc<dyn MemoryPool>)
        })
        .build()
        .expect("a manager");
    let device = mm.devices().iter().position(|d| d.name().starts_with("sim")).expect("the simulated device");
    // The device-local pool is made on first use: one buffer makes it.
    drop(mm.allocate_universal_with::<u8>(1, options(device, 0)).expect("a first buffer"));
    let pool = made.lock().unwrap().clone().expect("the device-local pool");
    ManagerDoor { mm, pool, device }
}

fn options(device: usize, stream: u64) -> AllocOptions {
    AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(device)).stream(StreamId(stream))
}

impl Door for ManagerDoor {
    type Handle = Buffer;
    type Device = SimBackend;
    fn device(&self) -> &SimBackend {
        self.pool.backend()
    }
    fn allocate(&self, bytes: u64, stream: u64) -> Option<(Buffer, u64, u64)> {
        let buffer = self.mm.allocate_universal_with::<u8>(bytes as usize, options(self.device, stream)).ok()?;
        let address = buffer.device_address().expect("simulated memory has addresses");
        let size = buffer.block_info().expect("a non-empty buffer").size;
        Some((Arc::new(Mutex::new(Some(buffer))), address, size))
    }
    fn record(&self, _: &Buffer, _: u64) -> bool {
        false
    }
    fn free(&self, buffer: &Buffer, _: u64) {
        drop(buffer.lock().unwrap().take().expect("freed once"));
    }
    fn begin_capture(&self) {
        self.pool.begin_capture();
    }
    fn end_capture(&self) {
        self.pool.end_capture();
    }
    fn mark_step(&self) {
        self.mm.mark_step();
    }
    fn tidy(&self, how: u8) {
        match how {
            0 | 1 => drop(self.mm.cleanup()),
            _ => drop(self.mm.release_all_cached()),
        }
    }
    fn counters(&self) -> Counters {
        self.pool.stats().into()
    }
}

fn workload() -> impl Strategy<Value = (Setup, Vec<Op>)> {
    (untagged(), proptest::collection::vec(op(), 20..90))
}

/// A quarter of `UMM_ORACLE_CASES` (256 by default): each case builds a manager.
fn cases() -> u32 {
    let cases: u32 = std::env::var("UMM_ORACLE_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256);
    (cases / 4).max(1)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 1000, ..ProptestConfig::default() })]

    #[test]
    fn the_manager_never_hands_out_bytes_whose_work_may_still_run((setup, ops) in workload()) {
        if let Err(e) = run(manager(&setup), &ops) {
            return Err(TestCaseError::fail(format!("{setup:?}: {e}")));
        }
    }
}

/// The generator's reach through the manager, held to minimums: reuses across streams and over held work,
/// captures, moves between streams, planned allocations.
#[test]
fn the_manager_workloads_reach_what_they_are_for() {
    let runs = 16;
    let reach = reach_of(runs, workload(), manager);
    eprintln!("reach of {runs} workloads through the manager: {reach:?}");
    assert!(reach.cross_stream_reuses >= runs / 2, "{reach:?}");
    assert!(reach.reuses_after_held_work >= runs, "{reach:?}");
    assert!(reach.captures >= runs / 2, "{reach:?}");
    assert!(reach.moves_between_streams >= runs / 2, "{reach:?}");
    assert!(reach.planned_allocs >= 1, "{reach:?}");
}
