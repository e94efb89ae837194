//! Stitched blocks ([`super::stitch`]) on the simulated device, under the fault ledger: the pages a stitched block
//! maps are pages freed in its stream's reservations (the device's page tables say so), no byte of physical
//! memory is ever under two live blocks, reserved memory is what the device holds, kept ranges serve again without
//! a device call, and no page is unmapped while mapped a second time.

use super::*;
use crate::testing::fault::{FaultHandle, FaultKind, FaultyBackend};
use crate::{BlockHandle, SimBackend, StreamId};
use std::collections::BTreeMap;

const MIB: u64 = 1 << 20;
const PAGE: u64 = SimBackend::PAGE;
const S0: StreamId = StreamId(0);

type SimPool = Pool<FaultyBackend<SimBackend>>;

fn pool(stitch: bool, limit: Option<u64>) -> (SimPool, FaultHandle) {
    let (backend, faults) = FaultyBackend::new(SimBackend::new("sim-stitch", 8 << 30));
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        page_size: Some(PAGE),
        limit: limit.map(Limit::Bytes),
        stitch,
        ..PoolConfig::default()
    };
    (Pool::new(backend, config).unwrap(), faults)
}

/// Where each byte of `block` lies in physical memory: `(physical page, first byte, end)` pieces for a block in
/// a reservation, its own address range (in a space of its own) for a block of a plain segment.
fn physical_pieces(pool: &SimPool, block: &BlockHandle) -> Vec<(u64, u64, u64)> {
    let (segment, offset) = pool.segment_of(block).expect("live");
    let sim = pool.backend().inner();
    let segment = segment.inner();
    let start = segment.base + offset;
    let end = start + block.size;
    if !segment.reservation {
        return vec![(u64::MAX, start, end)];
    }
    let mut pieces = Vec::new();
    let mut at = start;
    while at < end {
        let page_end = ((at / PAGE) + 1) * PAGE;
        let physical = sim.physical_page(at).expect("every byte of a live block is mapped");
        pieces.push((physical, at % PAGE, page_end.min(end) - (at / PAGE) * PAGE));
        at = page_end;
    }
    pieces
}

/// Panics if two live blocks share a byte of physical memory.
fn assert_disjoint(pool: &SimPool, live: &[BlockHandle], at: &str) {
    let mut by_page: BTreeMap<u64, Vec<(u64, u64, usize)>> = BTreeMap::new();
    for (i, block) in live.iter().enumerate() {
        for (page, lo, hi) in physical_pieces(pool, block) {
            by_page.entry(page).or_default().push((lo, hi, i));
        }
    }
    for (page, mut pieces) in by_page {
        pieces.sort_unstable();
        for pair in pieces.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "{at}: blocks {} and {} share page {page}: {pieces:?}",
                pair[0].2,
                pair[1].2
            );
        }
    }
}

/// Nine 10 MiB blocks with every other one freed: five holes of 10 MiB between live blocks. Returns the live
/// blocks.
fn five_holes(pool: &SimPool) -> Vec<BlockHandle> {
    let (live, freed) = holes(pool);
    for b in &freed {
        pool.free(b).unwrap();
    }
    live
}

/// Frees `blocks`, checks that the ledger saw no misuse, drops the pool and checks that it gave everything back.
fn finish(pool: SimPool, faults: FaultHandle, blocks: &[BlockHandle]) {
    for b in blocks {
        pool.free(b).unwrap();
    }
    assert_eq!(faults.violations(), Vec::<String>::new());
    drop(pool);
    faults.check_released().unwrap();
}

/// Nine 10 MiB blocks, every other one to be freed by the caller: (the rest, those).
fn holes(pool: &SimPool) -> (Vec<BlockHandle>, Vec<BlockHandle>) {
    let blocks: Vec<_> = (0..9).map(|_| pool.allocate(10 * MIB, S0).unwrap()).collect();
    let (mut live, mut freed) = (Vec::new(), Vec::new());
    for (i, b) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            freed.push(b);
        } else {
            live.push(b);
        }
    }
    (live, freed)
}

#[test]
fn a_request_no_free_range_holds_is_served_by_the_free_pages_mapped_again() {
    let (pool, faults) = pool(true, None);
    let (live, freed) = holes(&pool);
    let freed_pages: Vec<Vec<(u64, u64, u64)>> = freed.iter().map(|b| physical_pieces(&pool, b)).collect();
    for b in &freed {
        pool.free(b).unwrap();
    }
    let before = pool.stats();
    assert_eq!(before.reserved_bytes.current, 90 * MIB);
    let big = pool.allocate(40 * MIB, S0).unwrap();
    let s = pool.stats();
    assert_eq!(s.reserved_bytes.current, 90 * MIB, "no new memory: {s:?}");
    assert_eq!((s.num_stitches, s.num_stitched_allocs, s.stitched_ranges), (1, 1, 1), "{s:?}");
    assert_eq!(s.num_device_alloc, before.num_device_alloc, "no page mapped: {s:?}");
    // Every page of the stitched block is a page that a freed block had.
    let holes: Vec<u64> = freed_pages.iter().flatten().map(|p| p.0).collect();
    for (page, _, _) in physical_pieces(&pool, &big) {
        assert!(holes.contains(&page), "page {page} of the stitched block was not freed: holes {holes:?}");
    }
    let mut all = live.clone();
    all.push(big.clone());
    assert_disjoint(&pool, &all, "after stitching");
    assert_eq!(s.reserved_bytes.current, pool.backend().inner().physical_in_use());
    // A snapshot shows the stitched block as the memory it holds, under its key: allocated bytes add up.
    let snapshot = pool.snapshot();
    let blocks = || snapshot.segments.iter().flat_map(|g| &g.blocks).filter(|b| !b.free);
    assert_eq!(blocks().map(|b| b.size).sum::<u64>(), s.allocated_bytes.current);
    assert_eq!(blocks().filter(|b| b.key == Some(big.key())).map(|b| b.size).sum::<u64>(), 40 * MIB);
    // Freed and asked for again: the kept range serves, without a device call.
    pool.free(&big).unwrap();
    let calls = pool.stats().num_device_calls;
    let again = pool.allocate(40 * MIB, S0).unwrap();
    let s = pool.stats();
    assert_eq!(s.num_device_calls, calls, "a kept range is reused without a device call: {s:?}");
    assert_eq!((s.num_stitches, s.num_stitched_allocs), (1, 2), "{s:?}");
    // Its block is live to every lookup: a read reaches the device (which holds no bytes).
    assert!(matches!(pool.read(&again, 0, &mut [0u8; 1]), Err(Error::Unsupported { .. })));
    // While it lives, its pages are not free: a hole-sized request maps new memory rather than reuse them.
    let other = pool.allocate(10 * MIB, S0).unwrap();
    let mut all = live.clone();
    all.extend([again.clone(), other.clone()]);
    assert_disjoint(&pool, &all, "with the kept range in use");
    for b in all {
        pool.free(&b).unwrap();
    }
    assert_eq!(faults.violations(), Vec::<String>::new());
    drop(pool);
    faults.check_released().unwrap();
}

#[test]
fn without_stitching_the_request_maps_new_pages() {
    let (pool, faults) = pool(false, None);
    let live = five_holes(&pool);
    let big = pool.allocate(40 * MIB, S0).unwrap();
    let s = pool.stats();
    // The last hole borders the reservation's unmapped rest: 30 MiB are mapped past it.
    assert_eq!(s.reserved_bytes.current, 120 * MIB, "{s:?}");
    assert_eq!((s.num_stitches, s.num_stitched_allocs), (0, 0));
    finish(pool, faults, &[live, vec![big]].concat());
}

#[test]
fn free_pages_short_of_the_request_are_topped_up_with_fewer_new_pages_than_a_mapping_takes() {
    let (pool, faults) = pool(true, None);
    let live = five_holes(&pool);
    // 60 MiB: the holes hold 50. A mapping would take 50 new MiB past the last hole; stitching takes 10.
    let big = pool.allocate(60 * MIB, S0).unwrap();
    let s = pool.stats();
    assert_eq!(s.reserved_bytes.current, 100 * MIB, "{s:?}");
    assert_eq!(s.num_stitches, 1);
    let mut all = live.clone();
    all.push(big);
    assert_disjoint(&pool, &all, "topped up");
    finish(pool, faults, &all);
}

#[test]
fn a_range_the_device_refuses_to_map_falls_back_to_new_pages() {
    let (pool, faults) = pool(true, None);
    let live = five_holes(&pool);
    faults.fail_next(FaultKind::AliasPages);
    let big = pool.allocate(40 * MIB, S0).unwrap();
    let s = pool.stats();
    assert_eq!(faults.injected(FaultKind::AliasPages), 1);
    assert_eq!((s.num_stitches, s.stitched_ranges), (0, 0), "{s:?}");
    assert_eq!(s.reserved_bytes.current, 120 * MIB, "mapped instead: {s:?}");
    finish(pool, faults, &[live, vec![big]].concat());
}

#[test]
fn trims_drop_kept_ranges_before_unmapping_their_pages() {
    let (pool, faults) = pool(true, None);
    let live = five_holes(&pool);
    let big = pool.allocate(40 * MIB, S0).unwrap();
    pool.free(&big).unwrap();
    assert_eq!(pool.stats().stitched_ranges, 1);
    // The ledger flags any unmap of a page still mapped a second time.
    let report = pool.release_cached();
    assert!(report.pages_unmapped > 0, "{report:?}");
    let s = pool.stats();
    assert_eq!(s.stitched_ranges, 0, "{s:?}");
    assert_eq!(s.reserved_bytes.current, 40 * MIB);
    assert_eq!(s.reserved_bytes.current, pool.backend().inner().physical_in_use());
    finish(pool, faults, &live);
}

/// Random large and small requests and frees, with cleanups and a limit: after every operation no two live blocks
/// share physical memory, reserved memory is what the device holds, and the ledger saw no misuse.
#[test]
fn random_workloads_never_put_two_live_blocks_on_one_byte() {
    for (seed, limit) in [(1u64, None), (7, Some(160 * MIB)), (42, Some(96 * MIB)), (99, None)] {
        let (pool, faults) = pool(true, limit);
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            state >> 33
        };
        let mut live: Vec<BlockHandle> = Vec::new();
        for i in 0..1500 {
            let at = format!("seed {seed} op {i}");
            let roll = next() % 100;
            if roll < 55 || live.is_empty() {
                let bytes = match next() % 4 {
                    0 => (1 + next() % 512) * 1024,
                    _ => (1 + next() % 24) * MIB + (next() % 4) * 4096,
                };
                match pool.allocate(bytes, S0) {
                    Ok(b) => live.push(b),
                    Err(Error::OutOfMemory { .. }) => {}
                    Err(e) => panic!("{at}: {e}"),
                }
            } else if roll < 98 {
                let b = live.swap_remove((next() as usize) % live.len());
                pool.free(&b).unwrap();
            } else if roll == 98 {
                pool.cleanup(1);
            } else {
                pool.release_cached();
            }
            assert_disjoint(&pool, &live, &at);
            let s = pool.stats();
            assert_eq!(s.reserved_bytes.current, pool.backend().inner().physical_in_use(), "{at}");
            assert_eq!(s.reserved_bytes.current, faults.resident_bytes(), "{at}");
            assert_eq!(faults.violations(), Vec::<String>::new(), "{at}");
        }
        let s = pool.stats();
        assert!(s.num_stitched_allocs > 0, "seed {seed}: the workload stitched: {s:?}");
        for b in &live {
            pool.free(b).unwrap();
        }
        drop(pool);
        faults.check_released().unwrap();
    }
}

#[test]
fn a_pool_that_keeps_replacing_kept_ranges_stops_making_new_ones_until_a_full_release() {
    use super::books::stitch::{MAX_KEPT_STITCHES, MAX_STITCH_EVICTIONS};
    let (pool, faults) = pool(true, None);
    // 200 free pages, each between two live ones.
    let blocks: Vec<_> = (0..400).map(|_| pool.allocate(PAGE, S0).unwrap()).collect();
    for b in blocks.iter().step_by(2) {
        pool.free(b).unwrap();
    }
    // Requests of ever new page counts: each needs a range of its own, which is kept when freed.
    let made_at_most = MAX_KEPT_STITCHES as u64 + MAX_STITCH_EVICTIONS;
    for pages in 2..=(made_at_most + 20) {
        let b = pool.allocate(pages * PAGE, S0).unwrap();
        pool.free(&b).unwrap();
    }
    let s = pool.stats();
    assert_eq!(s.num_stitches, made_at_most, "{s:?}");
    assert_eq!(s.stitched_ranges, MAX_KEPT_STITCHES as u64, "{s:?}");
    // Past the bound the requests mapped new pages instead.
    assert!(s.reserved_bytes.peak > 400 * PAGE, "{s:?}");
    // Kept ranges still serve their own requests.
    let calls = s.num_device_calls;
    let again = pool.allocate(made_at_most * PAGE, S0).unwrap();
    assert_eq!(pool.stats().num_device_calls, calls, "the latest kept range serves without a device call");
    pool.free(&again).unwrap();
    for b in blocks.iter().skip(1).step_by(2) {
        pool.free(b).unwrap();
    }
    // A full release starts over: with new holes, a new range is made again.
    pool.release_cached();
    let live = five_holes(&pool);
    let made = pool.stats().num_stitches;
    let big = pool.allocate(40 * MIB, S0).unwrap();
    assert_eq!(pool.stats().num_stitches, made + 1);
    finish(pool, faults, &[live, vec![big]].concat());
}

/// Eight threads allocating and freeing large blocks of varying sizes at once, so that thread caches keep large
/// blocks (they do once a thread meets contention) while stitched blocks are made and reused: at the end no two
/// live blocks share physical memory, the ledger saw no misuse and everything goes back.
#[test]
fn threads_contending_for_a_pool_that_stitches_keep_blocks_apart() {
    let (pool, faults) = pool(true, None);
    let pool = &pool;
    let live: Vec<BlockHandle> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..8u64)
            .map(|t| {
                scope.spawn(move || {
                    let mut state = t * 7919 + 1;
                    let mut next = move |below: u64| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        (state >> 33) % below
                    };
                    let mut held: Vec<BlockHandle> = Vec::new();
                    for _ in 0..1500 {
                        if next(100) < 55 || held.is_empty() {
                            let bytes = (1 + next(20)) * MIB + next(4) * 4096;
                            held.push(pool.allocate(bytes, S0).unwrap());
                        } else {
                            let b = held.swap_remove(next(held.len() as u64) as usize);
                            pool.free(&b).unwrap();
                        }
                        if held.len() > 12 {
                            let b = held.swap_remove(0);
                            pool.free(&b).unwrap();
                        }
                    }
                    held
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    assert_disjoint(pool, &live, "after the threads");
    let s = pool.stats();
    assert!(s.num_stitched_allocs > 0, "{s:?}");
    assert_eq!(faults.violations(), Vec::<String>::new());
    for b in &live {
        pool.free(b).unwrap();
    }
    let s = pool.stats();
    assert_eq!((s.allocated_bytes.current, s.active_blocks.current), (0, 0), "{s:?}");
}
