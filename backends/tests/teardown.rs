//! Dropping a pool while it still holds live blocks and mapped pages: every physical page goes back to the
//! device and no segment is destroyed while pages are still mapped in it. The simulated device runs under
//! [`FaultyBackend`], whose ledger of segments and mapped ranges says exactly that
//! ([`FaultHandle::check_released`], [`FaultHandle::violations`]); no fault is injected.
//!
//! Covered, in plain and virtual segment modes: live blocks of every size class on several streams, blocks
//! lent by and cached in the thread caches of threads that are still alive when the pool drops (and exit
//! afterwards, draining their caches into a pool that is gone), and pages unmapped by a trim before the drop.
//! A block with a pending `record_stream` exists on CUDA pools only: `backends/tests/cuda.rs`
//! (`dropping_a_pool_with_a_pending_free_waits_for_its_stream`).

use std::sync::{Arc, Barrier};
use umm_backends::testing::fault::{FaultHandle, FaultyBackend};
use umm_backends::{BlockHandle, Pool, PoolConfig, SegmentMode, SimBackend, StreamId};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

type SimPool = Pool<FaultyBackend<SimBackend>>;

/// A pool over the simulated device in `mode`, with its ledger. Virtual mode maps 2 MiB pages (rather than the
/// larger pages an unlimited pool picks), so that a trim has pages to unmap between live blocks.
fn pool(mode: SegmentMode) -> (Arc<SimPool>, FaultHandle) {
    let sim = match mode {
        SegmentMode::Plain => SimBackend::plain("sim-plain", 64 * GIB),
        _ => SimBackend::new("sim-virtual", 64 * GIB),
    };
    let (backend, faults) = FaultyBackend::new(sim);
    let page_size = (mode == SegmentMode::Virtual).then_some(SimBackend::PAGE);
    let config = PoolConfig { segment_mode: mode, page_size, ..PoolConfig::default() };
    let pool = Pool::new(backend, config).unwrap();
    assert_eq!(pool.uses_virtual_memory(), mode == SegmentMode::Virtual);
    (Arc::new(pool), faults)
}

/// Sizes from every class: small (thread-cached and quick-cached), medium, and large (virtual reservations in
/// virtual mode).
const SIZES: [u64; 6] = [512, 4 * KIB + 3, 100 * KIB, 900 * KIB, 3 * MIB + 5, 40 * MIB];

/// Allocates every size on streams 0..4, frees every other block (so the arenas hold free and live blocks side
/// by side), and returns the live ones.
fn live_blocks_on_several_streams(pool: &SimPool) -> Vec<BlockHandle> {
    let mut live = Vec::new();
    for stream in 0..4 {
        for (i, &size) in SIZES.iter().cycle().take(SIZES.len() * 3).enumerate() {
            let block = pool.allocate(size, StreamId(stream)).unwrap();
            if i % 2 == 0 {
                live.push(block);
            } else {
                pool.free(&block).unwrap();
            }
        }
    }
    live
}

/// The ledger and the pool agree on the physical memory held, and pages are mapped (in virtual mode).
fn check_ledger_matches_pool(pool: &SimPool, faults: &FaultHandle, what: &str) {
    let reserved = pool.stats().reserved_bytes.current;
    assert_eq!(faults.resident_bytes(), reserved, "{what}: physical bytes held, ledger against pool");
    assert_eq!(faults.violations(), Vec::<String>::new(), "{what}: misuse before the drop");
    if pool.uses_virtual_memory() {
        assert!(faults.mapped_bytes() > 0, "{what}: the test means to drop a pool with pages mapped");
    }
}

/// Drops the last handle on `pool` and checks that everything went back, in the right order.
fn drop_and_check_released(pool: Arc<SimPool>, faults: &FaultHandle, what: &str) {
    let pool = Arc::into_inner(pool).expect("the test holds the last handle on the pool");
    assert!(pool.stats().active_blocks.current > 0, "{what}: the pool is dropped with live blocks");
    drop(pool);
    if let Err(problems) = faults.check_released() {
        panic!("{what}: after the pool dropped: {problems}");
    }
    assert_eq!(faults.resident_bytes(), 0, "{what}: physical bytes still held after the drop");
    assert_eq!(faults.segments_created(), faults.segments_destroyed(), "{what}");
}

#[test]
fn dropping_a_pool_with_live_blocks_on_several_streams_releases_every_page_and_segment() {
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let what = format!("{mode:?}");
        let (pool, faults) = pool(mode);
        let live = live_blocks_on_several_streams(&pool);
        assert!(live.len() > 30);
        check_ledger_matches_pool(&pool, &faults, &what);
        drop_and_check_released(pool, &faults, &what);
        // The handles outlive the pool: plain data, nothing to free.
        drop(live);
    }
}

#[test]
fn dropping_a_pool_after_a_trim_releases_the_pages_still_mapped() {
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let what = format!("{mode:?} after a trim");
        let (pool, faults) = pool(mode);
        let mut live = live_blocks_on_several_streams(&pool);
        let unmaps = faults.unmap_calls();
        let trimmed = pool.release_cached();
        assert!(trimmed.bytes_released > 0, "{what}: the trim released something: {trimmed:?}");
        if mode == SegmentMode::Virtual {
            assert!(faults.unmap_calls() > unmaps, "{what}: the trim unmapped free pages between live blocks");
        }
        check_ledger_matches_pool(&pool, &faults, &what);
        // New blocks after the trim map pages again, some into the holes the trim left.
        for stream in 0..2 {
            for &size in &SIZES {
                live.push(pool.allocate(size, StreamId(stream)).unwrap());
            }
        }
        check_ledger_matches_pool(&pool, &faults, &what);
        drop_and_check_released(pool, &faults, &what);
    }
}

#[test]
fn dropping_a_pool_while_other_threads_hold_lent_and_cached_blocks_releases_everything() {
    const THREADS: usize = 4;
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let what = format!("{mode:?} with thread caches");
        let (pool, faults) = pool(mode);
        let main_live = live_blocks_on_several_streams(&pool);
        // Blocks the main thread allocated; the workers free half of them (into the main thread's slot).
        let for_workers: Vec<Vec<BlockHandle>> =
            (0..THREADS).map(|_| (0..8).map(|_| pool.allocate(4 * KIB, StreamId(0)).unwrap()).collect()).collect();
        let allocated = Arc::new(Barrier::new(THREADS + 1));
        let pool_dropped = Arc::new(Barrier::new(THREADS + 1));
        let workers: Vec<_> = for_workers
            .into_iter()
            .enumerate()
            .map(|(t, from_main)| {
                let pool = Arc::clone(&pool);
                let (allocated, pool_dropped) = (Arc::clone(&allocated), Arc::clone(&pool_dropped));
                std::thread::spawn(move || {
                    let stream = StreamId(t as u64 % 2);
                    // Small blocks come from this thread's cache; half go back into it.
                    let mut mine: Vec<BlockHandle> =
                        (0..64).map(|i| pool.allocate(256 + 64 * (i % 8), stream).unwrap()).collect();
                    for block in mine.drain(..32) {
                        pool.free(&block).unwrap();
                    }
                    for block in &from_main[..4] {
                        pool.free(block).unwrap();
                    }
                    // A medium and a large block live past the drop too.
                    mine.push(pool.allocate(600 * KIB, stream).unwrap());
                    mine.push(pool.allocate(9 * MIB, stream).unwrap());
                    drop(pool);
                    allocated.wait();
                    // The thread is alive, its cache full, while the main thread drops the pool; it exits after.
                    pool_dropped.wait();
                    (mine, from_main)
                })
            })
            .collect();
        allocated.wait();
        check_ledger_matches_pool(&pool, &faults, &what);
        drop_and_check_released(pool, &faults, &what);
        pool_dropped.wait();
        for worker in workers {
            let (mine, from_main) = worker.join().expect("a worker thread exits cleanly after the pool is gone");
            assert_eq!((mine.len(), from_main.len()), (34, 8));
        }
        // The workers' exits drained nothing into a dropped pool and touched no segment.
        if let Err(problems) = faults.check_released() {
            panic!("{what}: after the threads exited: {problems}");
        }
        drop(main_live);
    }
}
