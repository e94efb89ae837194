//! Pool tests: limits, retry, trim, statistics, strategies and concurrency, on the sim and host backends.

use super::*;
use crate::testing::fault::FaultyBackend;
use crate::{BlockHandle, HostBackend, MemoryPool, SimBackend, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

fn sim_pool(mode: SegmentMode, limit: Option<Limit>) -> Pool<SimBackend> {
    // The sim's own 2 MiB pages: the page geometry these tests check is written for them.
    let config = PoolConfig { segment_mode: mode, limit, page_size: Some(SimBackend::PAGE), ..PoolConfig::default() };
    Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap()
}

#[test]
fn zero_and_overflowing_sizes_are_errors() {
    let pool = sim_pool(SegmentMode::Auto, None);
    assert!(matches!(pool.allocate(0, S0), Err(Error::ZeroSize { .. })));
    assert!(matches!(pool.allocate(u64::MAX, S0), Err(Error::SizeOverflow { .. })));
    let plain = sim_pool(SegmentMode::Plain, None);
    let err = plain.allocate(16 << 30, S0).unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }), "{err}");
    // Requests past any device on virtual reservations: refused whether or not a reservation exists yet, and
    // with withheld ranges between mapped blocks (where the request's end would overflow an address).
    let virt = sim_pool(SegmentMode::Virtual, None);
    let huge = [u64::MAX - 4096, 1 << 63, 1 << 40];
    for bytes in huge {
        let err = virt.allocate(bytes, S0).unwrap_err();
        assert!(matches!(err, Error::TooLarge { max, .. } if max == 8 << 30), "{bytes} bytes on a fresh pool: {err}");
    }
    let blocks: Vec<_> = (0..6).map(|_| virt.allocate(40 * MIB, S0).unwrap()).collect();
    for block in blocks.iter().step_by(2) {
        virt.free(block).unwrap();
    }
    virt.release_cached();
    for bytes in huge {
        let err = virt.allocate(bytes, S0).unwrap_err();
        assert!(matches!(err, Error::TooLarge { .. }), "{bytes} bytes between withheld ranges: {err}");
    }
    assert_eq!(virt.stats().allocated_bytes.current, 3 * 40 * MIB);
}

#[test]
fn small_requests_share_small_segments_and_are_cache_hits_after_warmup() {
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let pool = sim_pool(mode, None);
        let a = pool.allocate(4096, S0).unwrap();
        let b = pool.allocate(4096, S0).unwrap();
        let s = pool.stats();
        assert_eq!(s.reserved_bytes.current, 2 * MIB, "one 2 MiB small segment");
        assert_eq!((s.cache_misses, s.cache_hits), (1, 1));
        pool.free(&a).unwrap();
        pool.free(&b).unwrap();
        assert!(matches!(pool.free(&a), Err(Error::UnknownBlock(_))), "double free is an error");
        // Freed blocks wait in the quick cache until something drains it (a snapshot does).
        let _ = pool.snapshot();
        let s = pool.stats();
        assert_eq!(s.allocated_bytes.current, 0);
        assert_eq!(s.allocated_bytes.peak, 8192);
        assert_eq!(s.inactive_split_bytes.current, 0, "an empty segment is cached, not split");
    }
}

#[test]
fn limit_releases_cache_then_retries_then_reports_numbers() {
    // No segment slack: the limit alone is what releases the cached segment here.
    let config = PoolConfig {
        segment_mode: SegmentMode::Plain,
        limit: Some(Limit::Bytes(64 * MIB)),
        segment_slack: None,
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
    // Fill the cache with a 40 MiB segment, free it, then ask for 50 MiB: only fits after the cache is released.
    let a = pool.allocate(40 * MIB, S0).unwrap();
    pool.free(&a).unwrap();
    let b = pool.allocate(50 * MIB, S0).unwrap();
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.reserved_bytes.current, 50 * MIB);
    let err = pool.allocate(20 * MIB, S0).unwrap_err();
    match err {
        Error::OutOfMemory { requested, cached, limit, reserved, .. } => {
            assert_eq!(requested, 20 * MIB);
            assert_eq!(cached, 0);
            assert_eq!(reserved, 50 * MIB);
            assert_eq!(limit, Some(64 * MIB));
        }
        other => panic!("expected OutOfMemory, got {other}"),
    }
    assert_eq!(pool.stats().num_ooms, 1);
    pool.free(&b).unwrap();
}

#[test]
fn virtual_segments_unmap_free_holes_under_pressure() {
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        limit: Some(Limit::Bytes(100 * MIB)),
        mapped_slack: None,
        // Unmapping is what this checks; stitched blocks would serve the request from the holes as they are.
        stitch: false,
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
    let blocks: Vec<_> = (0..9).map(|_| pool.allocate(10 * MIB, S0).unwrap()).collect();
    // Free every other block: holes of 10 MiB between live blocks.
    for b in blocks.iter().step_by(2) {
        pool.free(b).unwrap();
    }
    // 40 MiB live; a 50 MiB request fits only if the holes' pages are unmapped.
    let big = pool.allocate(50 * MIB, S0).unwrap();
    let s = pool.stats();
    assert!(s.reserved_bytes.current <= 100 * MIB, "{s:?}");
    assert!(s.num_device_free > 0, "holes were unmapped: {s:?}");
    assert_eq!(s.num_alloc_retries, 0, "in place, before mapping: no failed attempt and retry: {s:?}");
    pool.free(&big).unwrap();
    for b in blocks.iter().skip(1).step_by(2) {
        pool.free(b).unwrap();
    }
    // The trim took only what the limit needed: 100 MiB stay mapped, and all of it goes back.
    assert_eq!(pool.stats().reserved_bytes.current, 100 * MIB);
    let report = pool.release_cached();
    assert_eq!(report.bytes_released, 100 * MIB, "every mapped page goes back, with the empty reservation");
    assert_eq!(pool.stats().reserved_bytes.current, 0);
    assert_eq!(pool.backend().physical_in_use(), 0);
}

#[test]
fn a_larger_page_size_maps_and_trims_whole_pages() {
    const PAGE: u64 = 8 * MIB;
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        page_size: Some(PAGE),
        mapped_slack: None,
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
    assert_eq!(pool.backend().virtual_memory().map(|vm| vm.page_size), Some(PAGE));
    let sizes = [3 * MIB, 21 * MIB, 9 * MIB + 4096, 40 * MIB];
    let blocks: Vec<_> = sizes.iter().map(|&s| pool.allocate(s, S0).unwrap()).collect();
    let physical = pool.backend().physical_in_use();
    let live: u64 = blocks.iter().map(|b| b.size()).sum();
    assert_eq!(physical % PAGE, 0, "{physical} bytes mapped");
    assert!(physical >= live && physical < live + sizes.len() as u64 * PAGE, "{physical} mapped for {live} live");
    assert_eq!(pool.stats().reserved_bytes.current, physical);
    for b in &blocks {
        pool.free(b).unwrap();
    }
    assert_eq!(pool.release_cached().bytes_released, physical);
    assert_eq!(pool.backend().physical_in_use(), 0);
}

#[test]
fn page_sizes_that_are_not_powers_of_two_or_below_the_device_page_are_refused() {
    let with_page =
        |page| PoolConfig { segment_mode: SegmentMode::Virtual, page_size: Some(page), ..Default::default() };
    let err = Pool::new(SimBackend::new("sim0", 8 << 30), with_page(3 * MIB)).err().expect("refused");
    assert!(matches!(&err, Error::InvalidConfig(m) if m.contains("power of two")), "{err}");
    let err = Pool::new(SimBackend::new("sim0", 8 << 30), with_page(MIB)).err().expect("refused");
    assert!(matches!(&err, Error::InvalidConfig(m) if m.contains("below")), "{err}");
    // Pools without virtual reservations have no pages: the setting does not apply to them.
    let config = PoolConfig { page_size: Some(8 * MIB), ..PoolConfig::default() };
    let pool = Pool::new(SimBackend::plain("plain", 8 << 30), config).unwrap();
    assert!(!pool.uses_virtual_memory());
    pool.free(&pool.allocate(5 * MIB, S0).unwrap()).unwrap();
}

#[test]
fn a_device_whose_pages_are_not_powers_of_two_gets_no_virtual_reservations() {
    // Page arithmetic on the remap path is masks and shifts; a device reporting 3 MiB pages must be refused.
    let odd = || checked(SimBackend::new("odd", 8 << 30)).reporting_page(3 * MIB);
    let virt = PoolConfig { segment_mode: SegmentMode::Virtual, ..Default::default() };
    let err = Pool::new(odd(), virt).err().expect("refused");
    assert!(matches!(&err, Error::InvalidConfig(m) if m.contains("power of two") && m.contains("odd")), "{err}");
    // Plain segments need no pages: the same device serves a plain pool.
    let plain = PoolConfig { segment_mode: SegmentMode::Plain, ..Default::default() };
    let pool = Pool::new(odd(), plain).unwrap();
    assert!(!pool.uses_virtual_memory());
    pool.free(&pool.allocate(5 * MIB, S0).unwrap()).unwrap();
}

#[test]
fn virtual_segments_prefer_mapped_holes_to_mapping_new_pages() {
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        mapped_slack: None,
        page_size: Some(SimBackend::PAGE),
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
    let [a, b, c, d] = [6 * MIB, 2 * MIB, 10 * MIB, 2 * MIB].map(|size| pool.allocate(size, S0).unwrap());
    // a's hole loses its pages; c's hole keeps them.
    pool.free(&a).unwrap();
    assert_eq!(pool.release_cached().bytes_released, 6 * MIB);
    pool.free(&c).unwrap();
    let maps = pool.stats().num_device_alloc;
    // a's unmapped hole is the best fit for 6 MiB; c's mapped one is taken instead, with no device call.
    let e = pool.allocate(6 * MIB, S0).unwrap();
    assert_eq!(e.offset, c.offset);
    assert_eq!(pool.stats().num_device_alloc, maps);
    for block in [b, d, e] {
        pool.free(&block).unwrap();
    }
}

#[test]
fn virtual_segments_place_blocks_on_the_mapped_part_of_a_hole() {
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        mapped_slack: None,
        page_size: Some(SimBackend::PAGE),
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
    let [a, b1, b2, c] = [4 * MIB, 4 * MIB, 6 * MIB, 2 * MIB].map(|size| pool.allocate(size, S0).unwrap());
    // A hole [4 MiB, 14 MiB) whose first 4 MiB lost their pages and whose last 6 MiB kept them.
    pool.free(&b1).unwrap();
    assert_eq!(pool.release_cached().bytes_released, 4 * MIB);
    pool.free(&b2).unwrap();
    let maps = pool.stats().num_device_alloc;
    // At the hole's start 6 MiB would need two new pages; on its mapped part it needs none.
    let e = pool.allocate(6 * MIB, S0).unwrap();
    assert_eq!(e.offset, b2.offset);
    assert_eq!(pool.stats().num_device_alloc, maps);
    // The unmapped front of the hole is still free, and usable.
    let f = pool.allocate(4 * MIB, S0).unwrap();
    assert_eq!(f.offset, b1.offset);
    for block in [a, c, e, f] {
        pool.free(&block).unwrap();
    }
    assert_eq!(pool.stats().allocated_bytes.current, 0);
}

/// A virtual pool on the page-checking device whose reservation starts with 6 MiB of unmapped space, then a mapped
/// hole of 10 MiB, then a live 2 MiB block (returned); nothing past it is mapped.
fn unmapped_space_then_a_mapped_hole() -> (Pool<FaultyBackend<SimBackend>>, BlockHandle) {
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        mapped_slack: None,
        page_size: Some(SimBackend::PAGE),
        ..PoolConfig::default()
    };
    let pool = Pool::new(checked(SimBackend::new("checked", 8 << 30)), config).unwrap();
    let [a, b, c] = [6 * MIB, 10 * MIB, 2 * MIB].map(|size| pool.allocate(size, S0).unwrap());
    pool.free(&a).unwrap();
    assert_eq!(pool.release_cached().bytes_released, 6 * MIB);
    pool.free(&b).unwrap();
    (pool, c)
}

#[test]
fn pages_are_unmapped_for_the_stream_whose_arena_holds_them() {
    // A backend waits only for the stream it is told before giving pages back (CUDA: cuStreamSynchronize, not
    // the whole context), so each unmap must name the stream the pages' blocks were freed on.
    let config =
        PoolConfig { segment_mode: SegmentMode::Virtual, page_size: Some(SimBackend::PAGE), ..Default::default() };
    let pool = Pool::new(checked(SimBackend::new("checked", 8 << 30)), config).unwrap();
    let other = StreamId(7);
    let blocks = [pool.allocate(8 * MIB, S0).unwrap(), pool.allocate(8 * MIB, other).unwrap()];
    for block in &blocks {
        pool.free(block).unwrap();
    }
    let released = pool.release_cached();
    assert_eq!(released.bytes_released, 16 * MIB, "{released:?}");
    // The ledger fails a reservation whose pages are unmapped for two streams.
    assert_eq!(pool.backend().handle().unmap_streams(), [S0, other], "one reservation per stream");
    assert_no_violations(&pool, "each reservation unmapped for its own stream");
}

/// Frees `blocks`, the pool's last live ones, releases the cache and checks that no page is left mapped.
fn free_and_release_everything(pool: &Pool<FaultyBackend<SimBackend>>, blocks: impl IntoIterator<Item = BlockHandle>) {
    for block in blocks {
        pool.free(&block).unwrap();
    }
    pool.release_cached();
    assert_eq!(pool.backend().handle().mapped_bytes(), 0, "pages left mapped");
    assert_no_violations(pool, "after releasing everything");
}

#[test]
fn a_request_that_ends_in_a_mapped_hole_maps_only_the_pages_before_it() {
    let (pool, c) = unmapped_space_then_a_mapped_hole();
    let (maps, reserved) = (pool.stats().num_device_alloc, pool.stats().reserved_bytes.current);
    assert_eq!(reserved, 12 * MIB);
    // 12 MiB fit no mapped hole. Ending in the hole, they need one page before it; starting at the reservation's
    // start they would need all three, and past c six.
    let d = pool.allocate(12 * MIB, S0).unwrap();
    assert_eq!(d.offset, 4 * MIB);
    let s = pool.stats();
    assert_eq!((s.num_device_alloc, s.reserved_bytes.current), (maps + 1, reserved + 2 * MIB), "{s:?}");
    let (segment, offset) = pool.segment_of(&d).unwrap();
    assert!(pool.backend().handle().is_mapped(&segment, offset, d.size));
    free_and_release_everything(&pool, [c, d]);
}

#[test]
fn a_request_ending_in_a_hole_that_would_pass_the_limit_is_undone_and_reported() {
    let (pool, c) = unmapped_space_then_a_mapped_hole();
    pool.set_limit(Some(Limit::Bytes(12 * MIB))).unwrap();
    // The page before the hole would pass the limit, and the hole itself is all there is to unmap: the restore is
    // undone, the cache released, and the retry (six new pages) fails too.
    assert!(matches!(pool.allocate(12 * MIB, S0), Err(Error::OutOfMemory { requested, .. }) if requested == 12 * MIB));
    let s = pool.stats();
    assert_eq!((s.num_ooms, s.reserved_bytes.current, s.allocated_bytes.current), (1, 2 * MIB, 2 * MIB), "{s:?}");
    assert_eq!(pool.backend().handle().mapped_bytes(), SimBackend::PAGE, "only c's page is mapped");
    // What was undone is whole again: the space before c serves up to the limit.
    let d = pool.allocate(10 * MIB, S0).unwrap();
    assert_eq!(d.offset, 0);
    free_and_release_everything(&pool, [c, d]);
}

#[test]
fn a_remap_at_the_limit_unmaps_only_what_the_limit_needs() {
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        mapped_slack: None,
        stitch: false,
        limit: Some(Limit::Bytes(64 * MIB)),
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
    // 48 MiB mapped under a 64 MiB limit; freeing two 16 MiB blocks leaves 32 MiB of mapped holes, apart.
    let [a, b, c] = [16 * MIB, 16 * MIB, 16 * MIB].map(|size| pool.allocate(size, S0).unwrap());
    pool.free(&a).unwrap();
    pool.free(&c).unwrap();
    assert_eq!(pool.stats().reserved_bytes.current, 48 * MIB);
    // 40 MiB fits no hole: the end of the reservation, past c's hole, needs 24 new MiB (c's pages are reused),
    // 8 over the limit. Only those 8 MiB of a's hole are unmapped, in place, with no failed attempt and retry.
    let d = pool.allocate(40 * MIB, S0).unwrap();
    assert_eq!(d.offset, c.offset);
    let s = pool.stats();
    assert_eq!(s.reserved_bytes.current, 64 * MIB, "the limit is used, not undercut: {s:?}");
    assert_eq!((s.num_alloc_retries, s.num_ooms), (0, 0), "{s:?}");
    // The 8 MiB of a's hole still mapped serve a request there with no device call.
    let maps = s.num_device_alloc;
    let e = pool.allocate(8 * MIB, S0).unwrap();
    assert_eq!(pool.stats().num_device_alloc, maps);
    for block in [b, d, e] {
        pool.free(&block).unwrap();
    }
}

#[test]
fn cleanup_releases_only_idle_segments() {
    let pool = sim_pool(SegmentMode::Plain, None);
    let a = pool.allocate(30 * MIB, S0).unwrap();
    pool.free(&a).unwrap();
    assert_eq!(pool.cleanup(2).segments_released, 0, "used this round");
    assert_eq!(pool.cleanup(2).segments_released, 1, "idle for two rounds");
    assert_eq!(pool.stats().reserved_bytes.current, 0);
}

#[test]
fn direct_strategy_gives_memory_back_on_free() {
    let config = PoolConfig { strategy: Strategy::Direct, ..PoolConfig::default() };
    let pool = Pool::new(SimBackend::new("sim", 1 << 30), config).unwrap();
    let a = pool.allocate(1000, S0).unwrap();
    assert_eq!(pool.stats().reserved_bytes.current, 2 * MIB);
    pool.free(&a).unwrap();
    let s = pool.stats();
    assert_eq!((s.reserved_bytes.current, s.num_device_alloc, s.num_device_free), (0, 1, 1));
}

#[test]
fn without_sharing_streams_do_not_share_free_blocks() {
    let config = PoolConfig { cross_stream: crate::CrossStream::Off, ..PoolConfig::default() };
    let pool =
        Pool::new(SimBackend::new("sim0", 8 << 30), PoolConfig { segment_mode: SegmentMode::Plain, ..config }).unwrap();
    let a = pool.allocate(4096, StreamId(1)).unwrap();
    pool.free(&a).unwrap();
    let b = pool.allocate(4096, StreamId(2)).unwrap();
    assert_eq!(pool.stats().segments.current, 2, "stream 2 does not take stream 1's freed block");
    let c = pool.allocate(4096, StreamId(1)).unwrap();
    assert_eq!((c.segment, c.offset, c.arena), (a.segment, a.offset, a.arena), "same stream reuses at once");
    pool.free(&b).unwrap();
    pool.free(&c).unwrap();
}

#[test]
fn copies_through_a_freed_or_stale_handle_are_refused() {
    let pool = Pool::new(HostBackend::new("host", 1 << 30), PoolConfig::default()).unwrap();
    let a = pool.allocate(4096, S0).unwrap();
    let stale = a.clone();
    pool.free(&a).unwrap();
    // The same memory goes to a new block; the old handle must reach neither it nor its segment.
    let b = pool.allocate(4096, S0).unwrap();
    assert_eq!((b.offset, b.segment_index()), (stale.offset, stale.segment_index()), "the block is reused");
    pool.write(&b, 0, &[7; 16]).unwrap();
    let unknown = |r: Result<()>| matches!(r, Err(Error::UnknownBlock(_)));
    assert!(unknown(pool.write(&stale, 0, &[1; 16])), "write through a stale handle");
    assert!(unknown(pool.fill(&stale, 0, 16, 1)), "fill through a stale handle");
    assert!(unknown(pool.read(&stale, 0, &mut [0; 16])), "read through a stale handle");
    let mut got = [0; 16];
    pool.read(&b, 0, &mut got).unwrap();
    assert_eq!(got, [7; 16], "the new block's bytes are untouched");
    pool.free(&b).unwrap();
}

/// A handle names its block inside one pool; another pool whose own block has the same ids must refuse it.
/// Otherwise freeing pool A's handle through pool B would free B's block under its owner, whose host slice
/// would then alias the next block B hands out.
#[test]
fn a_handle_of_another_pool_is_refused() {
    let a: Arc<dyn MemoryPool> = Arc::new(Pool::new(HostBackend::new("a", 1 << 30), PoolConfig::default()).unwrap());
    let b: Arc<dyn MemoryPool> = Arc::new(Pool::new(HostBackend::new("b", 1 << 30), PoolConfig::default()).unwrap());
    let foreign = a.allocate(4096, S0).unwrap();
    let mut owned = crate::OwnedBlock::allocate(Arc::clone(&b), 4096, S0, false).unwrap();
    owned.host_bytes_mut().unwrap().fill(7);
    let info = owned.info();
    assert_eq!((info.key, info.segment, info.offset), (foreign.key(), foreign.segment_index(), foreign.offset));
    let unknown = |r: Result<()>| matches!(r, Err(Error::UnknownBlock(_)));
    assert!(unknown(b.free(&foreign)), "free through another pool's handle");
    assert!(unknown(b.write(&foreign, 0, &[1; 16])), "write through another pool's handle");
    assert!(unknown(b.fill(&foreign, 0, 16, 1)), "fill through another pool's handle");
    assert!(unknown(b.read(&foreign, 0, &mut [0; 16])), "read through another pool's handle");
    assert!(b.host_ptr(&foreign).is_none());
    assert_eq!(b.stats().active_blocks.current, 1, "the owned block is still live");
    assert!(owned.host_bytes().unwrap().iter().all(|&x| x == 7), "and its bytes untouched");
    a.free(&foreign).unwrap();
}

#[test]
fn host_pool_moves_bytes_zeroes_and_poisons() {
    let config = PoolConfig { poison_on_free: true, ..PoolConfig::default() };
    let pool = Pool::new(HostBackend::new("host", 1 << 30), config).unwrap();
    let a = pool.allocate(1000, S0).unwrap();
    assert_eq!(a.offset % 64, 0);
    pool.write(&a, 10, &[1, 2, 3]).unwrap();
    let mut out = [0u8; 3];
    pool.read(&a, 10, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3]);
    assert!(matches!(pool.write(&a, a.size - 1, &[1, 2]), Err(Error::OutOfBounds(_))));
    pool.free(&a).unwrap();
    // The same block comes back (best fit, same stream): poisoned by the free, zeroed on request.
    let b = pool.allocate(1000, S0).unwrap();
    assert_eq!(b.offset, a.offset);
    let mut dirty = [0u8; 16];
    pool.read(&b, 0, &mut dirty).unwrap();
    assert_eq!(dirty, [POISON_BYTE; 16]);
    pool.free(&b).unwrap();
    let c = pool.allocate_zeroed(1000, S0).unwrap();
    let mut clean = vec![1u8; 1000];
    pool.read(&c, 0, &mut clean).unwrap();
    assert!(clean.iter().all(|&x| x == 0));
    pool.free(&c).unwrap();
}

#[test]
fn concurrent_allocate_and_free_keep_blocks_disjoint() {
    let pool = Arc::new(Pool::new(HostBackend::new("host", 4 << 30), PoolConfig::default()).unwrap());
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                let mut live = Vec::new();
                for i in 0..stress_cycles(4000) {
                    let size = 64 + (i * 7919 + u64::from(t) * 104729) % (3 * MIB);
                    let b = pool.allocate(size, S0).unwrap();
                    pool.fill(&b, 0, b.size, t + 1).unwrap();
                    live.push(b);
                    if i % 3 == 0 {
                        let b = live.swap_remove((i as usize * 31) % live.len());
                        // Our bytes are intact: nobody else was handed an overlapping block.
                        let mut bytes = vec![0; b.size as usize];
                        pool.read(&b, 0, &mut bytes).unwrap();
                        assert!(bytes.iter().all(|&x| x == t + 1));
                        pool.free(&b).unwrap();
                    }
                }
                for b in live {
                    pool.free(&b).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = pool.stats();
    let ops = 4 * stress_cycles(4000);
    assert_eq!((s.allocated_bytes.current, s.num_allocs, s.num_frees), (0, ops, ops));
    pool.release_cached();
    assert_eq!(pool.stats().reserved_bytes.current, 0);
}

#[test]
fn invalid_configs_are_refused() {
    let bad = PoolConfig { small_segment_size: 1024, ..PoolConfig::default() };
    assert!(matches!(Pool::new(SimBackend::new("s", 1 << 30), bad), Err(Error::InvalidConfig(_))));
    let virt = PoolConfig { segment_mode: SegmentMode::Virtual, ..PoolConfig::default() };
    let err = Pool::new(HostBackend::new("h", 1 << 30), virt).err().expect("host has no virtual memory");
    assert!(matches!(&err, Error::InvalidConfig(m) if m.contains("no virtual memory")), "{err}");
    let frac = PoolConfig { limit: Some(Limit::Fraction(1.5)), ..PoolConfig::default() };
    let err = Pool::new(SimBackend::new("s", 1 << 30), frac).err().expect("a limit of 150% is refused");
    assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
}

#[test]
fn snapshot_lists_each_segments_blocks_in_address_order() {
    let pool = sim_pool(SegmentMode::Virtual, None);
    let a = pool.allocate(1000, S0).unwrap();
    let b = pool.allocate(30 * MIB, S0).unwrap();
    let snap = pool.snapshot();
    assert_eq!(snap.segments.len(), 2);
    let small = snap.segments.iter().find(|s| s.class == "small").unwrap();
    assert_eq!(small.blocks[0], BlockSnapshot { offset: 0, size: 1024, free: false, key: Some(a.key()) });
    assert!(small.blocks[1].free);
    let large = snap.segments.iter().find(|s| s.class == "large").unwrap();
    assert!(large.virtual_reservation);
    assert_eq!(large.physical_bytes, 30 * MIB);
    assert_eq!(large.blocks[0].key, Some(b.key()));
    // Each segment's blocks come in address order and tile it: every block starts where the one before ends.
    for segment in &snap.segments {
        let mut end = 0;
        for block in &segment.blocks {
            assert_eq!(block.offset, end, "segment {} out of address order: {:?}", segment.index, segment.blocks);
            end += block.size;
        }
        assert_eq!(end, segment.size);
    }
    pool.free(&a).unwrap();
    pool.free(&b).unwrap();
}

#[test]
fn mapped_slack_keeps_reserved_near_the_live_set() {
    let slack = 0.03;
    let config = PoolConfig {
        segment_mode: SegmentMode::Virtual,
        mapped_slack: Some(slack),
        stitch: false,
        page_size: Some(SimBackend::PAGE),
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
    // Shapes that never repeat: without trimming, free mapped holes would pile up.
    let mut live = Vec::new();
    for i in 0..400u64 {
        let size = (3 + (i * 7919) % 61) * MIB + (i % 7) * 4096;
        live.push(pool.allocate(size, S0).unwrap());
        if live.len() > 6 {
            let b = live.remove((i as usize * 13) % live.len());
            pool.free(&b).unwrap();
        }
    }
    // The peak of reserved memory follows the peak of live memory (plus the pages blocks share at their ends).
    let s = pool.stats();
    let bound = (s.allocated_bytes.peak as f64 * (1.0 + slack)) as u64 + 2 * SimBackend::PAGE * 7;
    assert!(s.reserved_bytes.peak <= bound, "{s:?}");
    let unbounded = {
        let config = PoolConfig {
            segment_mode: SegmentMode::Virtual,
            mapped_slack: None,
            stitch: false,
            page_size: Some(SimBackend::PAGE),
            ..PoolConfig::default()
        };
        let pool = Pool::new(SimBackend::new("sim1", 8 << 30), config).unwrap();
        let mut live = Vec::new();
        for i in 0..400u64 {
            live.push(pool.allocate((3 + (i * 7919) % 61) * MIB + (i % 7) * 4096, S0).unwrap());
            if live.len() > 6 {
                let b = live.remove((i as usize * 13) % live.len());
                pool.free(&b).unwrap();
            }
        }
        pool.stats().reserved_bytes.peak
    };
    assert!(unbounded > s.reserved_bytes.peak, "slack trimming lowers the peak ({unbounded} vs {s:?})");
    for b in live {
        pool.free(&b).unwrap();
    }
}

#[test]
fn batch_allocation_is_all_or_nothing() {
    let pool = sim_pool(SegmentMode::Plain, Some(Limit::Bytes(64 * MIB)));
    let blocks = pool.allocate_batch(&[1000, 4 * MIB, 30 * MIB], S0).unwrap();
    assert_eq!(blocks.len(), 3);
    assert!(blocks[2].size() >= 30 * MIB);
    for b in &blocks {
        pool.free(b).unwrap();
    }
    let before = pool.stats().num_allocs;
    let err = pool.allocate_batch(&[1000, 40 * MIB, 40 * MIB], S0).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    let s = pool.stats();
    assert_eq!((s.allocated_bytes.current, s.num_allocs - s.num_frees), (0, 0), "nothing stays allocated");
    assert_eq!(s.num_allocs, before + 2);
}

/// A sim device behind the fault wrapper, whose ledger checks every mapping (no range mapped twice or unmapped
/// while not mapped, whole pages only, one stream for each reservation's unmaps); reservations of at most 256 MiB,
/// so that a test also sees a pool with several of them.
fn checked(inner: SimBackend) -> FaultyBackend<SimBackend> {
    FaultyBackend::new(inner).0.with_max_reservation(256 * MIB)
}

/// Fails the test with whatever misuse the ledger of `pool`'s backend has seen.
fn assert_no_violations(pool: &Pool<FaultyBackend<SimBackend>>, context: &str) {
    assert_eq!(pool.backend().handle().violations(), Vec::<String>::new(), "{context}");
}

/// Random allocations and frees on virtual reservations under a limit, with trims and cleanups in between:
/// every live block lies on mapped pages, no page is mapped or unmapped twice, reserved memory equals the mapped
/// pages and stays under the limit, and everything is unmapped at the end; with the device's pages and with larger
/// ones (mapped and unmapped whole).
#[test]
fn virtual_reservations_keep_live_blocks_mapped_under_random_pressure() {
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    let ops = prop::collection::vec((0u8..10, 1u64..(48 * MIB), any::<usize>()), 6000);
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let rounds =
        [(Some(0.03), None), (None, None), (Some(0.0), None), (Some(0.03), Some(8 * MIB)), (None, Some(8 * MIB))];
    for (round, (slack, page_size)) in rounds.into_iter().enumerate() {
        let limit = 400 * MIB;
        let backend = checked(SimBackend::new("checked", 8 << 30));
        let faults = backend.handle();
        let config = PoolConfig {
            segment_mode: SegmentMode::Virtual,
            limit: Some(Limit::Bytes(limit)),
            mapped_slack: slack,
            page_size,
            ..PoolConfig::default()
        };
        let pool = Pool::new(backend, config).unwrap();
        let mut live: Vec<BlockHandle> = Vec::new();
        for (kind, size, pick) in ops.new_tree(&mut runner).unwrap().current() {
            let stream = StreamId(u64::from(kind % 2));
            match kind {
                0..=4 => match pool.allocate(size, stream) {
                    Ok(block) => live.push(block),
                    Err(Error::OutOfMemory { .. }) => {}
                    Err(e) => panic!("round {round}: {e}"),
                },
                5..=8 if !live.is_empty() => pool.free(&live.swap_remove(pick % live.len())).unwrap(),
                9 if pick % 8 == 0 => drop(pool.release_cached()),
                _ => drop(pool.cleanup(1)),
            }
            let s = pool.stats();
            let plain: u64 = pool.snapshot().segments.iter().filter(|g| !g.virtual_reservation).map(|g| g.size).sum();
            assert_eq!(s.reserved_bytes.current, faults.mapped_bytes() + plain, "round {round}");
            assert!(s.reserved_bytes.current <= limit, "round {round}: over the limit");
            for block in &live {
                let (segment, offset) = pool.segment_of(block).unwrap();
                assert!(!segment.inner().reservation || faults.is_mapped(&segment, offset, block.size));
            }
            assert_no_violations(&pool, &format!("round {round}"));
        }
        for block in live.drain(..) {
            pool.free(&block).unwrap();
        }
        pool.release_cached();
        assert_eq!(faults.mapped_bytes(), 0, "round {round}: pages left mapped");
        assert_eq!(pool.stats().reserved_bytes.current, 0);
    }
}

#[test]
fn a_miss_reuses_a_larger_quick_block_before_growing() {
    let pool = sim_pool(SegmentMode::Plain, None);
    // Fill one 2 MiB small segment exactly: 512 KiB + 1 MiB + 512 KiB.
    let blocks: Vec<_> = [512 * 1024, MIB, 512 * 1024].iter().map(|&s| pool.allocate(s, S0).unwrap()).collect();
    assert_eq!(pool.stats().reserved_bytes.current, 2 * MIB);
    // The 1 MiB block waits in the quick cache; a 300 KiB request has no class of its own there and the engine
    // has nothing free, so it is served from the larger quick block instead of a new segment.
    pool.free(&blocks[1]).unwrap();
    let small = pool.allocate(300 * 1024, S0).unwrap();
    assert_eq!(small.offset, blocks[1].offset);
    let s = pool.stats();
    assert_eq!((s.reserved_bytes.current, s.num_device_alloc), (2 * MIB, 1));
    // The rest of that block went back to the engine: a 600 KiB request fits after it, still without growing.
    let rest = pool.allocate(600 * 1024, S0).unwrap();
    assert_eq!(rest.offset, small.offset + small.size);
    assert_eq!(pool.stats().reserved_bytes.current, 2 * MIB);
    for block in [&blocks[0], &blocks[2], &small, &rest] {
        pool.free(block).unwrap();
    }
}

#[test]
fn derived_statistics_follow_every_operation() {
    let pool = sim_pool(SegmentMode::Plain, None);
    let a = pool.allocate(4096, S0).unwrap();
    let b = pool.allocate(4096, S0).unwrap();
    let s = pool.stats();
    assert_eq!(s.inactive_split_bytes.current, 2 * MIB - 8192, "free bytes beside live blocks");
    // Two live blocks of 4 KiB: both figures counted on their own, not one read off the other.
    assert_eq!((s.num_allocs, s.allocated_bytes.current, s.active_bytes.current), (2, 8192, 8192));
    pool.free(&a).unwrap();
    let s = pool.stats();
    assert_eq!(s.inactive_split_bytes.current, 2 * MIB - 4096);
    assert_eq!(s.inactive_split_bytes.peak, 2 * MIB - 4096, "the peak follows frees");
    assert_eq!((s.allocated_bytes.current, s.active_bytes.current), (4096, 4096));
    let c = pool.allocate(4096, S0).unwrap();
    assert_eq!(pool.stats().inactive_split_bytes.current, 2 * MIB - 8192);
    pool.reset_peaks();
    let s = pool.stats();
    assert_eq!(s.inactive_split_bytes.peak, s.inactive_split_bytes.current, "reset to the current value");
    // Three allocations, one of which had to make the segment.
    assert_eq!((s.num_allocs, s.cache_misses, s.num_device_alloc), (3, 1, 1));
    for block in [b, c] {
        pool.free(&block).unwrap();
    }
}

/// A pool serves 32,768 streams (two arenas each, numbered in 16 bits); the next stream gets an error naming the
/// limit, and the streams it already serves go on working. A stream costs about 30 KiB of indexes, so this
/// test holds about 1 GB.
#[test]
fn a_pool_refuses_streams_past_the_most_it_can_number() {
    // Streams keep their own memory here: sharing would scan every other stream's arena on each of the 32,768
    // first allocations, a cost of this test's extreme and beside its point.
    let config = PoolConfig {
        segment_mode: SegmentMode::Plain,
        cross_stream: CrossStream::Off,
        page_size: Some(SimBackend::PAGE),
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::new("sim0", 128 << 30), config).unwrap();
    let most = 1u64 << (ARENA_BITS - 1);
    for s in 0..most {
        let b = pool.allocate(4096, StreamId(s)).unwrap();
        pool.free(&b).unwrap();
    }
    let refused = pool.allocate(4096, StreamId(most)).unwrap_err();
    assert!(matches!(refused, Error::InvalidConfig(ref m) if m.contains("32768 streams already")), "{refused}");
    assert_eq!(pool.stats().num_allocs, most, "the refused request changed nothing");
    for s in [0, most - 1] {
        let b = pool.allocate(1 << 30, StreamId(s)).unwrap();
        pool.free(&b).unwrap();
    }
}

/// Cycles per thread of a stress test: `default`, or `UMM_STRESS_CYCLES` (fewer under valgrind, more for a soak).
fn stress_cycles(default: u64) -> u64 {
    std::env::var("UMM_STRESS_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Bytes of free blocks in every thread cache slot of `pool`.
fn thread_cached_bytes<B: Backend>(pool: &Pool<B>) -> u64 {
    pool.shared.slots.iter().map(|slot| slot.lock().bytes()).sum()
}

#[test]
fn thread_caches_refuse_double_frees_and_stale_handles() {
    let pool = Pool::new(HostBackend::new("host", 1 << 30), PoolConfig::default()).unwrap();
    let a = pool.allocate(4096, S0).unwrap();
    assert!(a.lent.is_some(), "small blocks are lent from the thread's cache");
    let stale = a.clone();
    pool.free(&a).unwrap();
    assert!(matches!(pool.free(&stale), Err(Error::UnknownBlock(_))), "double free");
    // The same memory lent again from the cache: the old handle stays refused, the new one works.
    let b = pool.allocate(4096, S0).unwrap();
    assert_eq!((b.offset, b.segment), (a.offset, a.segment), "served from the thread's cache");
    assert_ne!(b, stale);
    assert!(matches!(pool.write(&stale, 0, &[1]), Err(Error::UnknownBlock(_))));
    assert!(matches!(pool.free(&stale), Err(Error::UnknownBlock(_))));
    assert!(pool.host_ptr(&stale).is_none());
    pool.write(&b, 0, &[7; 16]).unwrap();
    let mut back = [0; 16];
    pool.read(&b, 0, &mut back).unwrap();
    assert_eq!(back, [7; 16]);
    pool.free(&b).unwrap();
    let s = pool.stats();
    assert_eq!((s.allocated_bytes.current, s.active_blocks.current, s.num_allocs, s.num_frees), (0, 0, 2, 2));
    assert_eq!((s.allocated_bytes.peak, s.cache_hits, s.cache_misses), (4096, 1, 1));
}

#[test]
fn a_block_freed_on_another_thread_goes_back_to_the_cache_that_lent_it() {
    let pool = Arc::new(Pool::new(HostBackend::new("host", 1 << 30), PoolConfig::default()).unwrap());
    let blocks: Vec<_> = (0..8).map(|_| pool.allocate(64 << 10, S0).unwrap()).collect();
    let lender = blocks[0].lent.expect("lent").slot();
    {
        let pool = Arc::clone(&pool);
        let blocks = blocks.clone();
        std::thread::spawn(move || {
            for b in &blocks {
                pool.write(b, 0, &[3; 64]).unwrap();
                pool.free(b).unwrap();
            }
        })
        .join()
        .unwrap();
    }
    assert_eq!(pool.shared.slots[lender as usize].lock().bytes(), 8 * (64 << 10), "back in the lender's slot");
    for b in &blocks {
        assert!(matches!(pool.free(b), Err(Error::UnknownBlock(_))), "freed once already");
    }
    let s = pool.stats();
    assert_eq!((s.allocated_bytes.current, s.active_blocks.current, s.num_frees), (0, 0, 8));
    assert_eq!(s.allocated_bytes.peak, 8 * (64 << 10));
}

#[test]
fn cleanup_and_thread_exit_drain_thread_caches() {
    let pool = Arc::new(sim_pool(SegmentMode::Auto, None));
    // A thread that exits leaves nothing in its slot.
    {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            let blocks: Vec<_> = (0..16).map(|i| pool.allocate(256 << (i % 4), S0).unwrap()).collect();
            for b in &blocks {
                pool.free(b).unwrap();
            }
            assert!(thread_cached_bytes(&pool) > 0, "the frees stay in the thread's cache");
        })
        .join()
        .unwrap();
    }
    assert_eq!(thread_cached_bytes(&pool), 0, "drained when its thread exited");
    // A live thread's cache is drained by cleanup, and the memory goes back to the device.
    let (cached_tx, cached_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let worker = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            let blocks: Vec<_> = (0..16).map(|_| pool.allocate(100 << 10, S0).unwrap()).collect();
            for b in &blocks {
                pool.free(b).unwrap();
            }
            cached_tx.send(()).unwrap();
            done_rx.recv().unwrap();
        })
    };
    cached_rx.recv().unwrap();
    assert!(thread_cached_bytes(&pool) > 0);
    let s = pool.stats();
    assert_eq!(s.allocated_bytes.current, 0, "cached blocks are not allocated");
    assert!(s.inactive_split_bytes.current > 0, "cached blocks keep their segments split");
    let report = pool.cleanup(0);
    assert_eq!(thread_cached_bytes(&pool), 0);
    assert!(report.bytes_released > 0);
    assert_eq!(pool.stats().reserved_bytes.current, 0, "every segment went back");
    done_tx.send(()).unwrap();
    worker.join().unwrap();
}

#[test]
fn an_out_of_memory_retry_drains_other_threads_caches() {
    // Room for one small segment and nothing else: a large request fits only once another thread's cached
    // small blocks go back and their segment is released.
    let pool = Arc::new(sim_pool(SegmentMode::Plain, Some(Limit::Bytes(2 * MIB))));
    let (cached_tx, cached_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let worker = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            let blocks: Vec<_> = (0..4).map(|_| pool.allocate(256 << 10, S0).unwrap()).collect();
            for b in &blocks {
                pool.free(b).unwrap();
            }
            cached_tx.send(()).unwrap();
            done_rx.recv().unwrap();
        })
    };
    cached_rx.recv().unwrap();
    assert_eq!(thread_cached_bytes(&pool), MIB);
    let big = pool.allocate(2 * MIB, S0).expect("the retry drains the other thread's cache");
    let s = pool.stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms, s.reserved_bytes.current), (1, 0, 2 * MIB));
    assert_eq!(thread_cached_bytes(&pool), 0);
    pool.free(&big).unwrap();
    done_tx.send(()).unwrap();
    worker.join().unwrap();
}

#[test]
fn eight_threads_keep_data_and_statistics_exact() {
    for thread_cache_bytes in [0, 64 << 10, 8 << 20] {
        let config = PoolConfig { thread_cache_bytes, ..PoolConfig::default() };
        let pool = Arc::new(Pool::new(HostBackend::new("host", 4 << 30), config).unwrap());
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let pool = Arc::clone(&pool);
                std::thread::spawn(move || {
                    let mut rng = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    let mut next = move || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let mut live: Vec<(BlockHandle, u8)> = Vec::new();
                    let (mut allocs, mut bytes_live) = (0u64, 0u64);
                    for cycle in 0..stress_cycles(3000) {
                        let size = [256, 4096, 64 << 10, 1 << 20, 3 << 20][(next() % 5) as usize] - next() % 200;
                        let b = pool.allocate(size, S0).unwrap();
                        // The address handed out with the block is the one the pool looks up under its locks.
                        assert_eq!(b.host, pool.host_ptr(&b).map_or(0, |p| p.as_ptr() as usize));
                        assert_ne!(b.host, 0, "host memory is host-addressable");
                        let tag = (t * 31 + cycle) as u8;
                        pool.fill(&b, 0, size, tag).unwrap();
                        bytes_live += b.size;
                        allocs += 1;
                        live.push((b, tag));
                        if live.len() > 16 || next() % 3 == 0 {
                            // Free one of them, sometimes on the thread of another's block: swap with a neighbour.
                            let (b, tag) = live.swap_remove((next() % live.len() as u64) as usize);
                            let mut back = vec![0; b.requested as usize];
                            pool.read(&b, 0, &mut back).unwrap();
                            assert!(back.iter().all(|&x| x == tag), "thread {t} cycle {cycle}: block overwritten");
                            bytes_live -= b.size;
                            pool.free(&b).unwrap();
                        }
                    }
                    (live, allocs, bytes_live)
                })
            })
            .collect();
        let mut leftovers = Vec::new();
        let (mut allocs, mut bytes_live) = (0, 0);
        for t in threads {
            let (live, a, b) = t.join().unwrap();
            leftovers.extend(live);
            allocs += a;
            bytes_live += b;
        }
        // Exact with blocks still live, then with none.
        let s = pool.stats();
        assert_eq!(s.allocated_bytes.current, bytes_live, "thread_cache_bytes {thread_cache_bytes}");
        assert_eq!(s.active_blocks.current, leftovers.len() as u64);
        assert_eq!(s.num_allocs, allocs);
        assert_eq!(s.num_frees, allocs - leftovers.len() as u64);
        assert!(s.allocated_bytes.peak >= bytes_live && s.allocated_bytes.peak <= s.reserved_bytes.peak);
        for (b, _) in &leftovers {
            pool.free(b).unwrap();
        }
        let s = pool.stats();
        assert_eq!((s.allocated_bytes.current, s.requested_bytes.current, s.active_blocks.current), (0, 0, 0));
        pool.release_cached();
        assert_eq!(pool.stats().reserved_bytes.current, 0, "everything went back");
    }
}

/// Returns once some thread has found the pool's lock taken (it marks its slot to cache large blocks just before
/// it waits), so that a test holding the lock knows the other thread is waiting for it, without sleeping.
fn wait_until_a_thread_contends<B: Backend>(pool: &Pool<B>) {
    while !pool.shared.slots.iter().any(|slot| slot.large.load(Ordering::Relaxed)) {
        std::thread::yield_now();
    }
}

#[test]
fn large_blocks_are_cached_only_by_threads_that_met_contention() {
    let pool = Arc::new(sim_pool(SegmentMode::Auto, None));
    let alone = pool.allocate(8 * MIB, S0).unwrap();
    assert!(alone.lent.is_none(), "a thread that never waited for the pool keeps no large blocks");
    pool.free(&alone).unwrap();
    // Hold the pool's lock while another thread allocates: it waits, and from then on caches large blocks.
    let held = pool.state().lock();
    let (cached_tx, cached_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let worker = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            let waited = pool.allocate(8 * MIB, S0).unwrap();
            pool.free(&waited).unwrap();
            let first = pool.allocate(8 * MIB, S0).unwrap();
            pool.free(&first).unwrap();
            let again = pool.allocate(8 * MIB, S0).unwrap();
            let cached = first.lent.is_some() && again.lent.is_some();
            let same = (again.offset, again.segment) == (first.offset, first.segment);
            pool.free(&again).unwrap();
            cached_tx.send((cached, same)).unwrap();
            go_rx.recv().unwrap();
            // After a cleanup the thread keeps none until it meets contention again.
            let after = pool.allocate(8 * MIB, S0).unwrap();
            pool.free(&after).unwrap();
            after.lent.is_none()
        })
    };
    wait_until_a_thread_contends(&pool);
    drop(held);
    let (cached, same) = cached_rx.recv().expect("the worker runs");
    assert!(cached, "lent from the thread's cache once the thread met contention");
    assert!(same, "the second block came from the thread's cache");
    assert_eq!(thread_cached_bytes(&pool), 8 * MIB);
    pool.cleanup(0);
    assert_eq!(thread_cached_bytes(&pool), 0);
    go_tx.send(()).unwrap();
    assert!(worker.join().unwrap(), "no large caching after a cleanup");
    let s = pool.stats();
    assert_eq!((s.allocated_bytes.current, s.num_allocs, s.num_frees), (0, 5, 5));
}

#[test]
fn a_contending_thread_keeps_large_blocks_through_misses_and_gives_them_back_when_memory_runs_out() {
    let pool = Arc::new(sim_pool(SegmentMode::Plain, Some(Limit::Bytes(64 * MIB))));
    let held = pool.state().lock();
    let worker = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            // Waits for the lock: from now on this thread caches large blocks.
            let first = pool.allocate(8 * MIB, S0).unwrap();
            pool.free(&first).unwrap();
            let blocks: Vec<_> = (0..3).map(|_| pool.allocate(16 * MIB, S0).unwrap()).collect();
            for b in &blocks {
                pool.free(b).unwrap();
            }
            let cached = thread_cached_bytes(&pool);
            // A miss of another size does not empty the cache while memory lasts...
            let other = pool.allocate(4 * MIB, S0).unwrap();
            let kept = thread_cached_bytes(&pool);
            pool.free(&other).unwrap();
            // ...and when it runs out, the thread's own cached blocks go back and the request succeeds.
            let big = pool.allocate(40 * MIB, S0).expect("the thread's cached blocks make room");
            pool.free(&big).unwrap();
            (cached, kept)
        })
    };
    wait_until_a_thread_contends(&pool);
    drop(held);
    let (cached, kept) = worker.join().unwrap();
    assert_eq!(cached, 48 * MIB, "three 16 MiB blocks cached");
    assert!(kept >= 48 * MIB, "the miss kept them");
    let s = pool.stats();
    assert_eq!(s.num_ooms, 0, "the allocation succeeded in the end");
    assert!(s.reserved_bytes.peak <= 64 * MIB);
    assert_eq!(s.allocated_bytes.current, 0);
}

#[test]
fn limits_need_a_unit_or_a_percent_sign() {
    assert_eq!(Limit::parse("90%"), Ok(Limit::Fraction(0.9)));
    assert_eq!(Limit::parse(" 12.5 %"), Ok(Limit::Fraction(0.125)));
    assert_eq!(Limit::parse("100%"), Ok(Limit::Fraction(1.0)));
    assert_eq!(Limit::parse("2GiB"), Ok(Limit::Bytes(2 << 30)));
    assert_eq!(Limit::parse("1B"), Ok(Limit::Bytes(1)));
    assert_eq!("1048576B".parse::<Limit>(), Ok(Limit::Bytes(1 << 20)));
    for limit in [Limit::Bytes(12345), Limit::Fraction(0.9), Limit::Fraction(0.125)] {
        assert_eq!(Limit::parse(&limit.to_string()), Ok(limit), "{limit} reads back");
    }
    // A bare number is refused with both readings spelt out.
    let err = Limit::parse("1").unwrap_err();
    assert!(err.contains("1B") && err.contains("100%") && err.contains("no unit"), "{err}");
    let err = Limit::parse("1.0").unwrap_err();
    assert!(err.contains("100%") && err.contains("GiB"), "{err}");
    let err = Limit::parse("0.5").unwrap_err();
    assert!(err.contains("50%") && !err.contains("0.5B"), "{err}");
    let err = Limit::parse("1048576").unwrap_err();
    assert!(err.contains("1048576B") && err.contains('%'), "{err}");
    // Zero has no reading to suggest: neither zero bytes nor a share of nothing is a limit.
    for zero in ["0", "00", "0.0"] {
        let err = Limit::parse(zero).unwrap_err();
        assert!(err.contains("no unit") && !err.contains("write "), "{zero}: {err}");
    }
    for bad in ["0%", "150%", "-5%", "x%", "%", "", "0B", "0GiB", "lots", "-3GiB", "2XB"] {
        let err = Limit::parse(bad).unwrap_err();
        assert!(err.contains("GiB") && err.contains('%'), "{bad:?}: names both forms: {err}");
    }
}

#[test]
fn a_configuration_without_optional_fields_takes_their_defaults() {
    let defaults = PoolConfig::default();
    let mut json = serde_json::to_value(&defaults).unwrap();
    let fields = json.as_object_mut().unwrap();
    fields.remove("stitch");
    fields.remove("plan_steps");
    fields.remove("thread_cache_bytes");
    let read: PoolConfig = serde_json::from_value(json).unwrap();
    assert_eq!((read.stitch, read.plan_steps), (defaults.stitch, defaults.plan_steps));
    assert_eq!(read.thread_cache_bytes, defaults.thread_cache_bytes);
    // Off where the default is on: the field is read, not assumed.
    let off = PoolConfig { stitch: false, plan_steps: false, ..PoolConfig::default() };
    let read: PoolConfig = serde_json::from_value(serde_json::to_value(&off).unwrap()).unwrap();
    assert_eq!((read.stitch, read.plan_steps), (false, false));
}

#[test]
fn error_predicates_name_the_kind_of_failure() {
    let pool = sim_pool(SegmentMode::Plain, Some(Limit::Bytes(4 * MIB)));
    let oom = pool.allocate(8 * MIB, S0).unwrap_err();
    assert!(oom.is_out_of_memory() && !oom.is_too_large() && !oom.is_unknown_block(), "{oom}");
    let too_large = sim_pool(SegmentMode::Plain, None).allocate(16 << 30, S0).unwrap_err();
    assert!(too_large.is_too_large() && !too_large.is_out_of_memory(), "{too_large}");
    assert!(pool.allocate(0, S0).unwrap_err().is_invalid_size());
    let block = pool.allocate(MIB, S0).unwrap();
    pool.free(&block).unwrap();
    let twice = pool.free(&block).unwrap_err();
    assert!(twice.is_unknown_block() && !twice.is_invalid_config(), "{twice}");
    let bad = PoolConfig { large_segment_size: MIB, ..PoolConfig::default() };
    let err = Pool::new(SimBackend::new("s", 1 << 30), bad).err().expect("a large segment below 2 MiB is refused");
    assert!(err.is_invalid_config() && err.to_string().contains("large_segment_size"), "{err}");
}

/// One pass of a workload whose shapes vary within the pass (as batches of varying sequence length do) but repeat
/// from pass to pass; every block is freed at the end of the pass.
fn varying_pass<B: Backend>(pool: &Pool<B>) {
    let mut live = Vec::new();
    for i in 0..300u64 {
        let size = (3 + (i * 7919) % 61) * MIB + (i % 7) * 4096;
        live.push(pool.allocate(size, S0).unwrap());
        if live.len() > 6 {
            let b = live.remove((i as usize * 13) % live.len());
            pool.free(&b).unwrap();
        }
    }
    for b in live {
        pool.free(&b).unwrap();
    }
}

#[test]
fn a_repeating_workload_makes_no_device_call_after_its_first_pass() {
    // `passes` warm the pool up before the four counted.
    let calls_in_later_passes = |mapped_slack: Option<f64>, stitch: bool, page_size: Option<u64>, passes: usize| {
        let config =
            PoolConfig { segment_mode: SegmentMode::Virtual, mapped_slack, stitch, page_size, ..PoolConfig::default() };
        let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
        // The first pass maps as it goes; the second finds all of that mapped and free at once, so its best fits
        // land elsewhere and may map a little more. From then on the layout repeats.
        for _ in 0..passes {
            varying_pass(&pool);
        }
        let warm = pool.stats();
        assert!(warm.num_device_calls > 0, "the first passes map pages");
        for _ in 0..4 {
            varying_pass(&pool);
        }
        let later = pool.stats();
        assert_eq!(later.allocated_bytes.current, 0);
        if later.num_device_calls == warm.num_device_calls {
            assert_eq!(later.reserved_bytes.peak, warm.reserved_bytes.peak, "the peak of the first passes holds");
        }
        later.num_device_calls - warm.num_device_calls
    };
    let slack = PoolConfig::default().mapped_slack;
    assert_eq!(calls_in_later_passes(slack, false, None, 2), 0);
    assert_eq!(calls_in_later_passes(slack, true, Some(32 * MIB), 2), 0);
    // With the default 8 MiB pages this workload's 300 distinct requests of 3-64 MiB make stitched ranges over
    // four passes (169, 82, 88 and 48 device calls), until the kept ranges serve all of them.
    assert!(calls_in_later_passes(slack, true, None, 2) > 0);
    assert_eq!(calls_in_later_passes(slack, true, None, 4), 0);
    // The opt-in trimming moves pages in every pass of this workload: what the default spares it.
    assert!(calls_in_later_passes(Some(0.0), false, None, 2) > 0);
}

#[test]
fn resetting_peaks_does_not_change_what_the_pool_trims() {
    let calls = |reset: bool| {
        let config =
            PoolConfig { segment_mode: SegmentMode::Virtual, mapped_slack: Some(0.03), ..PoolConfig::default() };
        let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
        for _ in 0..3 {
            varying_pass(&pool);
            if reset {
                pool.reset_peaks();
            }
        }
        pool.stats().num_device_calls
    };
    assert_eq!(calls(true), calls(false));
}

#[test]
fn device_calls_count_every_call_into_the_backend() {
    let pool = sim_pool(SegmentMode::Virtual, None);
    let big = pool.allocate(40 * MIB, S0).unwrap(); // reserve + map
    let small = pool.allocate(4096, S0).unwrap(); // a small segment
    let s = pool.stats();
    assert_eq!(s.num_device_calls, 3, "{s:?}");
    pool.free(&big).unwrap();
    pool.free(&small).unwrap();
    let report = pool.release_cached();
    assert_eq!(report.segments_released, 2, "{report:?}");
    // The empty reservation: one unmap of its mapped range, then its release; the small segment's release.
    assert_eq!(pool.stats().num_device_calls, 3 + 3);
}

#[test]
fn pages_are_coarse_without_a_limit_and_the_devices_own_under_one() {
    let reserved_for_3_mib = |limit: Option<Limit>, page_size: Option<u64>| {
        let config = PoolConfig { segment_mode: SegmentMode::Virtual, limit, page_size, ..PoolConfig::default() };
        let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
        let b = pool.allocate(3 * MIB, S0).unwrap();
        let reserved = pool.stats().reserved_bytes.current;
        pool.free(&b).unwrap();
        reserved
    };
    assert_eq!(reserved_for_3_mib(None, None), crate::DEFAULT_PAGE_UNLIMITED);
    assert_eq!(reserved_for_3_mib(Some(Limit::Bytes(1 << 30)), None), 2 * SimBackend::PAGE);
    assert_eq!(reserved_for_3_mib(None, Some(4 * MIB)), 4 * MIB);
    assert_eq!(reserved_for_3_mib(Some(Limit::Bytes(1 << 30)), Some(16 * MIB)), 16 * MIB);
}

#[test]
fn segment_slack_replaces_empty_segments_and_settles() {
    let run = |segment_slack: Option<f64>| {
        let config = PoolConfig { segment_mode: SegmentMode::Plain, segment_slack, ..PoolConfig::default() };
        let pool = Pool::new(SimBackend::plain("plain0", 8 << 30), config).unwrap();
        let mut calls = Vec::new();
        for _ in 0..8 {
            let before = pool.stats().num_device_calls;
            varying_pass(&pool);
            calls.push(pool.stats().num_device_calls - before);
        }
        let s = pool.stats();
        assert_eq!(s.allocated_bytes.current, 0);
        (s.reserved_bytes.peak as f64 / s.allocated_bytes.peak as f64, calls)
    };
    let (kept, kept_calls) = run(None);
    let (replaced, replaced_calls) = run(PoolConfig::default().segment_slack);
    assert!(replaced < kept, "reserved over live: {replaced} with the slack, {kept} without");
    assert!(kept_calls[1..].iter().all(|&c| c == 0), "{kept_calls:?}");
    // Replacing segments settles: the last passes create and destroy nothing.
    assert!(replaced_calls[4..].iter().all(|&c| c == 0), "{replaced_calls:?}");
}

#[test]
fn a_device_whose_largest_segment_is_not_a_multiple_of_the_granularity_gets_whole_segments() {
    // 4,842 bytes: not a multiple of the 512-byte alignment. Found by fuzzing `umm replay --capacity 4842`.
    for mode in [SegmentMode::Plain, SegmentMode::Auto] {
        let pool = Pool::new(SimBackend::new("tiny", 4842), PoolConfig { segment_mode: mode, ..PoolConfig::default() })
            .unwrap();
        let block = pool.allocate(512, S0).unwrap();
        let s = pool.stats();
        assert_eq!(s.reserved_bytes.current % pool.backend().alignment(), 0, "{mode:?}: {s:?}");
        assert!(s.reserved_bytes.current <= 4842, "{mode:?}: {s:?}");
        let err = pool.allocate(1 << 20, S0).unwrap_err();
        assert!(err.is_out_of_memory() || matches!(err, Error::TooLarge { .. }), "{mode:?}: {err}");
        pool.free(&block).unwrap();
        assert_eq!(pool.stats().allocated_bytes.current, 0);
        pool.release_cached();
        assert_eq!(pool.stats().reserved_bytes.current, 0);
    }
}

#[test]
fn blocks_carry_their_host_address_through_every_cache_and_thread() {
    // Blocks freed on other threads go back to the slots that lent them and come out again from there, from the
    // pool's quick cache, from segments and from large arenas: each handle's address must be the one the pool
    // looks up, and a device backend's blocks carry none.
    let config =
        PoolConfig { thread_cache_bytes: 1 << 20, thread_cache_large_bytes: 16 << 20, ..PoolConfig::default() };
    let pool = Arc::new(Pool::new(HostBackend::new("host", 4 << 30), config).unwrap());
    let sizes = [64, 256, 4096, 60 << 10, 1 << 20, 3 << 20];
    let mut handed: Vec<BlockHandle> = Vec::new();
    for round in 0..200u64 {
        let pool2 = Arc::clone(&pool);
        let made: Vec<BlockHandle> = std::thread::spawn(move || {
            (0..8).map(|i| pool2.allocate(sizes[((round + i) % 6) as usize], S0).unwrap()).collect()
        })
        .join()
        .unwrap();
        for b in made.iter().chain(&handed) {
            assert_eq!(b.host, pool.host_ptr(b).map_or(0, |p| p.as_ptr() as usize), "round {round}");
            assert_ne!(b.host, 0);
        }
        // Free the older half here (the lending thread is gone or another), keep the rest.
        for b in handed.drain(..) {
            pool.free(&b).unwrap();
        }
        handed = made;
        if round % 50 == 49 {
            pool.cleanup(0);
        }
    }
    for b in &handed {
        pool.free(b).unwrap();
    }
    let sim = sim_pool(SegmentMode::Auto, None);
    let b = sim.allocate(4096, S0).unwrap();
    assert_eq!((b.host, sim.host_ptr(&b)), (0, None));
    sim.free(&b).unwrap();
}

/// A pool over a backend whose every block is a segment: blocks are never split, a freed segment serves requests
/// up to 1/4 smaller, and the slack budget releases the one tightest empty segment that covers the excess rather
/// than the least recently used ones.
#[test]
fn a_segment_per_block_pool_never_splits_and_releases_the_tightest_covering_segment() {
    let config = PoolConfig {
        segment_slack: Some(0.0),
        thread_cache_bytes: 0,
        thread_cache_large_bytes: 0,
        ..PoolConfig::default()
    };
    let pool = Pool::new(SimBackend::segment_per_block("sim-wgpu", 8 << 30), config).unwrap();
    assert!(pool.backend().segment_per_block());
    let virtual_config = PoolConfig { segment_mode: SegmentMode::Virtual, ..PoolConfig::default() };
    let err = Pool::new(SimBackend::segment_per_block("sim-wgpu", 8 << 30), virtual_config).err().unwrap();
    assert!(err.to_string().contains("a segment of its own"), "{err}");

    // Two small blocks get a segment each, of their own sizes (8-byte granularity), not a shared 2 MiB one.
    let (a, b) = (pool.allocate(1000, S0).unwrap(), pool.allocate(24, S0).unwrap());
    assert_ne!(a.segment_index(), b.segment_index());
    assert_eq!((a.offset(), a.size(), b.offset(), b.size()), (0, 1000, 0, 24));
    assert_eq!(pool.stats().reserved_bytes.current, 1024);
    pool.free(&a).unwrap();
    let c = pool.allocate(900, S0).unwrap();
    assert_eq!((c.segment_index(), c.size()), (a.segment_index(), 1000), "1,000 is within 1/4 above 900");
    pool.free(&c).unwrap();
    let d = pool.allocate(792, S0).unwrap();
    assert_eq!(d.size(), 792, "1,000 is more than 1/4 above 792: a segment of its own size");
    for block in [&b, &d] {
        pool.free(block).unwrap();
    }
    pool.release_cached();

    // Large blocks, freed: 4, 4, 8, 20 and 64 MiB, the larger ones used last.
    let blocks: Vec<_> = [4, 4, 8, 20, 64].iter().map(|&m| pool.allocate(m * MIB, S0).unwrap()).collect();
    for block in &blocks {
        pool.free(block).unwrap();
    }
    let before = pool.stats();
    assert_eq!(before.reserved_bytes.current, 100 * MIB);
    // 15 MiB (the 20 MiB segment is more than 1/4 above it) would pass the high-water mark of 100 MiB by 15 MiB:
    // the 20 MiB segment alone covers that. The least recently used would have been the three small ones, the
    // largest the 64 MiB one.
    let e = pool.allocate(15 * MIB, S0).unwrap();
    let after = pool.stats();
    assert_eq!(after.num_device_free - before.num_device_free, 1, "{after:?}");
    assert_eq!(after.reserved_bytes.current, 95 * MIB);
    for (size, still) in [(4, true), (8, true), (64, true), (20, false)] {
        let hits = pool.stats().cache_hits;
        let reused = pool.allocate(size * MIB, S0).unwrap();
        assert_eq!(pool.stats().cache_hits > hits, still, "{size} MiB cached: {still}");
        pool.free(&reused).unwrap();
    }
    pool.free(&e).unwrap();
    assert_eq!(pool.stats().inactive_split_bytes.current, 0, "nothing is ever split");
}

/// Where streams share memory, free blocks parked in other threads' caches for other streams go back to the
/// pool before it takes new memory: a thread's cached large blocks of its stream serve another thread's request
/// on another stream instead of new pages or segments. Blocks of the requesting stream stay in their caches.
#[test]
fn another_threads_cached_blocks_serve_a_miss_before_new_memory() {
    let (s1, s2) = (StreamId(1), StreamId(2));
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let pool = Arc::new(sim_pool(mode, None));
        // Stream 2 known to the pool, so that it shares across streams.
        let first = pool.allocate(4096, s2).unwrap();
        pool.free(&first).unwrap();
        for slot in pool.shared.slots.iter() {
            slot.large.store(true, Ordering::Relaxed); // as after contention: large blocks are cached
        }
        let (parked_tx, parked_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let worker = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                let blocks: Vec<_> = (0..4).map(|_| pool.allocate(8 * MIB, s1).unwrap()).collect();
                let lent = blocks.iter().all(|b| b.lent.is_some());
                for b in &blocks {
                    pool.free(b).unwrap();
                }
                parked_tx.send(lent).unwrap();
                // Alive until the main thread is done: a thread's exit drains its slot.
                done_rx.recv().unwrap();
            })
        };
        assert!(parked_rx.recv().unwrap(), "{mode:?}: lent from the worker's cache");
        let parked = thread_cached_bytes(&pool);
        assert!(parked >= 32 * MIB, "{mode:?}: parked in the worker's slot");
        let reserved = pool.stats().reserved_bytes.current;
        let block = pool.allocate(16 * MIB, s2).unwrap();
        assert_eq!(pool.stats().reserved_bytes.current, reserved, "{mode:?}: the worker's blocks served it");
        assert_eq!(thread_cached_bytes(&pool), parked - 32 * MIB, "{mode:?}: taken back from the worker's slot");
        pool.free(&block).unwrap();
        done_tx.send(()).unwrap();
        worker.join().unwrap();
    }
}

#[test]
fn reserved_and_unused_bytes_follow_the_books_without_the_thread_caches() {
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let pool = sim_pool(mode, None);
        assert_eq!((pool.reserved_bytes(), pool.unused_bytes()), (0, 0), "{mode}");
        // Large blocks bypass the thread caches: the books see them at once.
        let a = pool.allocate(40 * MIB, S0).unwrap();
        let b = pool.allocate(24 * MIB, S0).unwrap();
        let s = pool.stats();
        assert_eq!(pool.reserved_bytes(), s.reserved_bytes.current, "{mode}: the lock-free figure is the books'");
        assert_eq!(pool.unused_bytes(), s.reserved_bytes.current - s.allocated_bytes.current, "{mode}");
        pool.free(&a).unwrap();
        assert_eq!(pool.unused_bytes(), pool.reserved_bytes() - 24 * MIB, "{mode}: a freed block is unused memory");
        pool.free(&b).unwrap();
        assert_eq!(pool.unused_bytes(), pool.reserved_bytes(), "{mode}");
        pool.release_cached();
        assert_eq!((pool.reserved_bytes(), pool.unused_bytes()), (0, 0), "{mode}: all given back");
    }
}

/// `alignment` places every block, small (through the thread caches) and large, in plain segments and in
/// virtual reservations, at a multiple of it and rounds its size to it; values that are not powers of two, are
/// above the most allowed or above the device's segment granularity are refused by name.
#[test]
fn blocks_start_at_multiples_of_the_configured_alignment() {
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let config = PoolConfig { segment_mode: mode, alignment: Some(512), ..Default::default() };
        let pool = Pool::new(SimBackend::new("sim0", 8 << 30), config).unwrap();
        assert_eq!(MemoryPool::alignment(&pool), 512);
        let sizes = [1, 255, 257, 513, 4000, 70_000, 3 * MIB + 1, 25 * MIB + 3];
        let blocks: Vec<_> = sizes.iter().cycle().take(40).map(|&s| pool.allocate(s, S0).unwrap()).collect();
        for (b, &asked) in blocks.iter().zip(sizes.iter().cycle()) {
            assert_eq!(b.offset() % 512, 0, "{mode:?}: {b:?}");
            assert_eq!(b.size(), asked.next_multiple_of(512), "{mode:?}: {b:?}");
        }
        // Blocks freed and taken again (the thread cache's path) keep the alignment.
        for b in &blocks[..20] {
            pool.free(b).unwrap();
        }
        for &s in &sizes {
            let b = pool.allocate(s, S0).unwrap();
            assert_eq!((b.offset() % 512, b.size() % 512), (0, 0), "{mode:?}: {b:?}");
        }
    }
    let default = Pool::new(SimBackend::new("sim0", 8 << 30), PoolConfig::default()).unwrap();
    assert_eq!(MemoryPool::alignment(&default), SimBackend::new("x", 1 << 30).alignment());
    for bad in [384, 128 << 10] {
        let config = PoolConfig { alignment: Some(bad), ..Default::default() };
        let err = Pool::new(SimBackend::new("sim0", 8 << 30), config).err().expect("refused");
        assert!(matches!(&err, Error::InvalidConfig(m) if m.contains("alignment")), "{bad}: {err}");
    }
}
