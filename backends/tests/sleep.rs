//! Sleep and wake (`Pool::sleep`, `Pool::wake`) on a simulated device that keeps its bytes: the physical memory
//! goes back to the device, every block keeps its address, offloaded bytes come back, discarded ones do not, a
//! sleeping pool refuses allocations and accesses, and a wake the device cannot serve changes nothing.

use umm_backends::testing::fault::{FaultHandle, FaultKind, FaultyBackend};
use umm_backends::{BlockHandle, Error, MemoryPool, Pool, PoolConfig, SegmentMode, SimBackend, SleepAction, StreamId};

mod cycles;

use cycles::pattern;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn device(capacity: u64) -> SimBackend {
    SimBackend::new("sim", capacity).holding_bytes().at_address(1 << 40)
}

fn tagged(capacity: u64) -> Pool<SimBackend> {
    Pool::new(device(capacity), PoolConfig { page_size: Some(2 * MIB), ..PoolConfig::default() }.tagged("weights"))
        .unwrap()
}

fn contents(pool: &Pool<SimBackend>, block: &BlockHandle) -> Vec<u8> {
    let mut bytes = vec![0; block.requested() as usize];
    pool.read(block, 0, &mut bytes).unwrap();
    bytes
}

/// Each segment's index and address, with its blocks' (offset, size).
type Layout = Vec<(u32, Option<u64>, Vec<(u64, u64)>)>;

fn addresses(pool: &Pool<SimBackend>) -> Layout {
    let snapshot = pool.snapshot();
    let blocks = |s: &umm_backends::SegmentSnapshot| s.blocks.iter().map(|b| (b.offset, b.size)).collect();
    snapshot.segments.iter().map(|s| (s.index, s.address, blocks(s))).collect()
}

/// Small and large blocks on two streams, each filled with its own pattern.
fn filled(pool: &Pool<SimBackend>) -> Vec<(BlockHandle, Vec<u8>)> {
    let sizes = [300, 4 * KIB, 700 * KIB, 3 * MIB + 5, 9 * MIB, 100];
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let block = pool.allocate(size, StreamId(i as u64 % 2)).unwrap();
            let bytes = pattern(i as u64 + 1, size as usize);
            pool.write(&block, 0, &bytes).unwrap();
            (block, bytes)
        })
        .collect()
}

#[test]
fn offloaded_blocks_come_back_at_the_same_addresses_with_their_bytes() {
    let pool = tagged(1 << 30);
    let blocks = filled(&pool);
    // A freed block leaves free pages behind, which sleep gives back too.
    let spare = pool.allocate(6 * MIB, StreamId(0)).unwrap();
    pool.free(&spare).unwrap();
    let before = addresses(&pool);
    let live = pool.stats().allocated_bytes.current;
    assert!(pool.backend().physical_in_use() > 0);

    let report = pool.sleep(SleepAction::Offload).unwrap();
    assert_eq!(pool.backend().physical_in_use(), 0, "every page went back to the device");
    assert_eq!(report.bytes_offloaded, report.bytes_released);
    assert!(report.bytes_released >= live, "{report:?} holds the {live} live bytes");
    assert_eq!(report.blocks, blocks.len() as u64);
    assert!(!report.pinned, "the simulated device makes plain host stores");
    let stats = pool.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.asleep_bytes, stats.offloaded_bytes),
        (0, report.bytes_released, report.bytes_released)
    );
    assert_eq!(stats.host_store_bytes, report.bytes_offloaded);
    assert_eq!(stats.allocated_bytes.current, live, "the blocks are still live");
    assert_eq!(pool.sleeping(), Some(SleepAction::Offload));

    let report = pool.wake().unwrap();
    assert_eq!(pool.sleeping(), None);
    assert_eq!(report.bytes_restored, report.bytes_mapped);
    assert_eq!(addresses(&pool), before, "every block at its old address");
    for (block, bytes) in &blocks {
        assert_eq!(&contents(&pool, block), bytes, "block of {} bytes", block.requested());
    }
    let stats = pool.stats();
    assert_eq!(stats.asleep_bytes, 0);
    assert_eq!(stats.reserved_bytes.current, pool.backend().physical_in_use());
    // The pool serves again, and the host store waits for the next sleep until the cache is released.
    let more = pool.allocate(5 * MIB, StreamId(1)).unwrap();
    assert!(stats.host_store_bytes > 0);
    pool.release_cached();
    assert_eq!(pool.stats().host_store_bytes, 0);
    pool.free(&more).unwrap();
    for (block, _) in &blocks {
        pool.free(block).unwrap();
    }
}

#[test]
fn discarded_blocks_come_back_with_fresh_pages_not_their_old_bytes() {
    let pool = tagged(1 << 30);
    let blocks = filled(&pool);
    let report = pool.sleep(SleepAction::Discard).unwrap();
    assert_eq!((report.bytes_offloaded, pool.stats().host_store_bytes), (0, 0));
    assert_eq!(pool.backend().physical_in_use(), 0);
    let report = pool.wake().unwrap();
    assert_eq!(report.bytes_restored, 0);
    for (block, _) in &blocks {
        let bytes = contents(&pool, block);
        assert!(bytes.iter().all(|&b| b == SimBackend::FRESH_BYTE), "block of {} bytes", block.requested());
        pool.free(block).unwrap();
    }
}

#[test]
fn a_sleeping_pool_refuses_allocations_and_accesses_and_takes_frees() {
    let pool = tagged(1 << 30);
    let blocks = filled(&pool);
    pool.sleep(SleepAction::Offload).unwrap();
    let refused = |e: Error, what: &str| {
        assert!(e.is_asleep(), "{what}: {e}");
        let message = e.to_string();
        assert!(message.contains("tag weights") && message.contains("asleep"), "{message}");
    };
    // Through the thread caches' sizes, large sizes and a batch.
    for size in [256, 64 * KIB, 8 * MIB] {
        refused(pool.allocate(size, StreamId(0)).unwrap_err(), "allocate");
    }
    refused(pool.allocate_batch(&[512, 512], StreamId(1)).unwrap_err(), "batch");
    let (block, _) = &blocks[3];
    refused(pool.write(block, 0, &[1, 2, 3]).unwrap_err(), "write");
    refused(pool.read(block, 0, &mut [0; 3]).unwrap_err(), "read");
    refused(pool.fill(block, 0, 3, 9).unwrap_err(), "fill");
    refused(pool.sleep(SleepAction::Discard).unwrap_err(), "a second sleep");
    // Cleanup finds nothing to give back and changes nothing.
    assert_eq!(pool.release_cached().bytes_released, 0);
    assert_eq!(pool.cleanup(0).bytes_released, 0);
    // Frees are bookkeeping: the freed block's memory serves again after the wake.
    let live_before = pool.stats().active_blocks.current;
    pool.free(block).unwrap();
    assert_eq!(pool.stats().active_blocks.current, live_before - 1);
    assert!(pool.free(block).unwrap_err().is_unknown_block(), "a double free is still caught");
    pool.wake().unwrap();
    for (i, (block, bytes)) in blocks.iter().enumerate().filter(|(i, _)| *i != 3) {
        assert_eq!(&contents(&pool, block), bytes, "block {i}");
    }
    let again = pool.allocate(3 * MIB, StreamId(0)).unwrap();
    pool.write(&again, 0, &pattern(99, 3 * MIB as usize)).unwrap();
    assert_eq!(contents(&pool, &again), pattern(99, 3 * MIB as usize));
    assert_eq!(pool.wake().unwrap().bytes_mapped, 0, "waking an awake pool does nothing");
}

#[test]
fn a_wake_the_limit_forbids_changes_nothing_and_a_later_one_restores_everything() {
    let pool = tagged(1 << 30);
    let blocks = filled(&pool);
    let report = pool.sleep(SleepAction::Offload).unwrap();
    pool.set_limit(Some(umm_backends::Limit::Bytes(report.bytes_released - 2 * MIB))).unwrap();
    let e = pool.wake().unwrap_err();
    assert!(e.to_string().contains("limit"), "{e}");
    assert_eq!(pool.sleeping(), Some(SleepAction::Offload), "still asleep");
    assert_eq!(pool.backend().physical_in_use(), 0);
    pool.set_limit(None).unwrap();
    pool.wake().unwrap();
    for (block, bytes) in &blocks {
        assert_eq!(&contents(&pool, block), bytes);
    }
}

/// The limit is held against what the pool holds awake, its sleeping bytes counted once: a pool that slept at
/// its limit wakes (found by the stream oracle, whose pools sleep under limits: wake counted them twice).
#[test]
fn a_pool_that_slept_at_its_limit_wakes() {
    let pool = tagged(1 << 30);
    let blocks = filled(&pool);
    let report = pool.sleep(SleepAction::Offload).unwrap();
    pool.set_limit(Some(umm_backends::Limit::Bytes(report.bytes_released))).unwrap();
    pool.wake().unwrap();
    assert_eq!(pool.stats().reserved_bytes.current, report.bytes_released);
    for (block, bytes) in &blocks {
        assert_eq!(&contents(&pool, block), bytes);
    }
}

/// A tagged pool keeps small blocks in reservations, and its quick cache keeps small blocks freed there: a
/// miss of another size puts them back before mapping more (found by the stream oracle: the miss went straight
/// to mapping, past quick blocks that a debug build asserts a virtual arena never holds).
#[test]
fn a_tagged_pools_quick_blocks_are_put_back_before_a_miss_maps_pages() {
    let config = PoolConfig { page_size: Some(2 * MIB), thread_cache_bytes: 0, ..PoolConfig::default() };
    let pool = Pool::new(device(1 << 30), config.tagged("kv")).unwrap();
    let first = pool.allocate(512, StreamId(1)).unwrap();
    pool.free(&first).unwrap();
    let mut kept = vec![pool.allocate(700 * KIB, StreamId(1)).unwrap()];
    // Fill the first page and go on: the misses past it find the quick block of the first free.
    for _ in 0..3 {
        kept.push(pool.allocate(700 * KIB, StreamId(1)).unwrap());
    }
    for _ in 0..4 {
        kept.push(pool.allocate(512, StreamId(1)).unwrap());
    }
    let live: u64 = kept.iter().map(|b| b.size()).sum();
    assert!(pool.stats().reserved_bytes.current <= live.next_multiple_of(2 * MIB) + 2 * MIB, "{:?}", pool.stats());
}

#[test]
fn a_wake_the_device_cannot_serve_unmaps_what_it_mapped_and_stays_asleep() {
    let pool = Pool::new(
        SimBackend::new("small", 40 * MIB).holding_bytes(),
        PoolConfig { page_size: Some(2 * MIB), ..PoolConfig::default() }.tagged("kv"),
    )
    .unwrap();
    // Two streams, two reservations: the wake maps two ranges, and the second one fails.
    for i in 0..4u64 {
        let block = pool.allocate(4 * MIB, StreamId(i % 2)).unwrap();
        pool.write(&block, 0, &pattern(i, 4 * MIB as usize)).unwrap();
    }
    pool.sleep(SleepAction::Offload).unwrap();
    // Someone else takes the device's memory meanwhile: 12 MiB are left, the wake needs 16.
    let other = umm_backends::Backend::create_segment(pool.backend(), 28 * MIB).unwrap();
    assert_eq!(other.size, 28 * MIB);
    let e = pool.wake().unwrap_err();
    assert!(e.is_driver_error() && e.to_string().contains("out of device memory"), "{e}");
    assert_eq!(pool.backend().physical_in_use(), 28 * MIB, "the range the wake mapped was unmapped again");
    assert_eq!(pool.sleeping(), Some(SleepAction::Offload), "still asleep, its bytes kept");
    assert_eq!(pool.stats().offloaded_bytes, 16 * MIB);
}

#[test]
fn pools_whose_blocks_lie_in_plain_segments_say_why_they_cannot_sleep() {
    let plain = Pool::new(SimBackend::plain("opencl-like", 1 << 30).holding_bytes(), PoolConfig::default().tagged("w"))
        .unwrap();
    let block = plain.allocate(4 * MIB, StreamId(0)).unwrap();
    let e = plain.sleep(SleepAction::Offload).unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    assert!(e.to_string().contains("plain segments") && e.to_string().contains("virtual"), "{e}");
    plain.write(&block, 0, &[1]).unwrap();
    assert_eq!(plain.sleeping(), None, "a refused sleep leaves the pool awake");
    // Without live blocks it can: its cached segments go back, and it refuses allocations until it wakes.
    plain.free(&block).unwrap();
    let report = plain.sleep(SleepAction::Offload).unwrap();
    assert_eq!((report.bytes_released, report.bytes_offloaded), (0, 0));
    assert!(report.cached_released > 0 && plain.backend().physical_in_use() == 0, "{report:?}");
    assert!(plain.allocate(MIB, StreamId(0)).unwrap_err().is_asleep());
    plain.wake().unwrap();
    plain.allocate(MIB, StreamId(0)).unwrap();
    // An untagged pool keeps small blocks in plain segments: with one live, it cannot sleep either.
    let untagged = Pool::new(device(1 << 30), PoolConfig::default()).unwrap();
    let small = untagged.allocate(4 * KIB, StreamId(0)).unwrap();
    let e = untagged.sleep(SleepAction::Discard).unwrap_err();
    assert!(e.to_string().contains("plain segments"), "{e}");
    untagged.allocate(4 * KIB, StreamId(0)).unwrap();
    untagged.free(&small).unwrap();
    // Without small blocks it can.
    let large = Pool::new(device(1 << 30), PoolConfig::default()).unwrap();
    let big = large.allocate(40 * MIB, StreamId(0)).unwrap();
    large.sleep(SleepAction::Discard).unwrap();
    large.wake().unwrap();
    large.free(&big).unwrap();
}

#[test]
fn a_pool_that_segment_mode_plain_made_cannot_sleep() {
    let config = PoolConfig { segment_mode: SegmentMode::Plain, ..PoolConfig::default() }.tagged("w");
    let pool = Pool::new(device(1 << 30), config).unwrap();
    pool.allocate(MIB, StreamId(0)).unwrap();
    assert!(pool.sleep(SleepAction::Offload).unwrap_err().is_unsupported());
}

#[test]
fn sleep_and_wake_through_the_object_safe_pool() {
    let pool: std::sync::Arc<dyn MemoryPool> = std::sync::Arc::new(tagged(1 << 30));
    let block = pool.allocate(5 * MIB, StreamId(0)).unwrap();
    pool.write(&block, 0, &pattern(5, 5 * MIB as usize)).unwrap();
    let lease = umm_backends::PoolLease::new(pool.clone());
    lease.sleep(SleepAction::Offload).unwrap();
    assert_eq!(pool.sleeping(), Some(SleepAction::Offload));
    assert!(lease.read(&block, 0, &mut [0; 4]).unwrap_err().is_asleep());
    lease.wake().unwrap();
    let mut bytes = vec![0; 5 * MIB as usize];
    pool.read(&block, 0, &mut bytes).unwrap();
    assert_eq!(bytes, pattern(5, 5 * MIB as usize));
    pool.free(&block).unwrap();
}

/// Threads allocate, write, check and free while another puts the pool to sleep and wakes it: every operation
/// either works or is refused as asleep, no block's bytes are ever lost across a cycle, and the books end exact.
#[test]
fn threads_work_through_sleep_and_wake_cycles_without_losing_a_byte() {
    let pool = tagged(1 << 30);
    cycles::work_through_cycles(&pool, 4, 2, [512, 24 * KIB, 2 * MIB + 100], 40);
    let stats = pool.stats();
    assert_eq!((stats.active_blocks.current, stats.allocated_bytes.current), (0, 0));
    pool.release_cached();
    assert_eq!(pool.backend().physical_in_use(), 0);
    assert_eq!(pool.stats().reserved_bytes.current, 0);
}

/// A wake maps and copies back in pieces of 64 MiB: a block across several pieces comes back whole.
#[test]
fn a_block_longer_than_a_wake_piece_comes_back_whole() {
    let pool = tagged(1 << 30);
    let len = 150 * MIB + 3;
    let block = pool.allocate(len, StreamId(0)).unwrap();
    let bytes = pattern(77, len as usize);
    pool.write(&block, 0, &bytes).unwrap();
    let report = pool.sleep(SleepAction::Offload).unwrap();
    assert!(report.bytes_offloaded > 128 * MIB);
    let report = pool.wake().unwrap();
    assert_eq!(report.bytes_restored, report.bytes_mapped);
    assert!(contents(&pool, &block) == bytes, "a block of three pieces came back changed");
    pool.free(&block).unwrap();
}

/// A tagged pool over a simulated device that keeps its bytes, under a fault injector, with blocks on two streams
/// (two reservations, so a sleep copies and unmaps at least two pieces), each filled.
/// A pool under a fault injector, its handle, and its blocks with their bytes.
type Faulty = (Pool<FaultyBackend<SimBackend>>, FaultHandle, Vec<(BlockHandle, Vec<u8>)>);

fn faulty() -> Faulty {
    let (backend, faults) = FaultyBackend::new(device(1 << 30));
    let config = PoolConfig { page_size: Some(2 * MIB), ..PoolConfig::default() }.tagged("weights");
    let pool = Pool::new(backend, config).unwrap();
    let blocks = (0..4u64)
        .map(|i| {
            let block = pool.allocate(6 * MIB + i, StreamId(i % 2)).unwrap();
            let bytes = pattern(i + 40, block.requested() as usize);
            pool.write(&block, 0, &bytes).unwrap();
            (block, bytes)
        })
        .collect();
    (pool, faults, blocks)
}

fn contents_of<B: umm_backends::Backend>(pool: &Pool<B>, block: &BlockHandle) -> Vec<u8> {
    let mut bytes = vec![0; block.requested() as usize];
    pool.read(block, 0, &mut bytes).unwrap();
    bytes
}

#[test]
fn a_copy_that_fails_during_a_sleep_leaves_the_pool_awake_with_its_bytes() {
    let (pool, faults, blocks) = faulty();
    let reserved = pool.reserved_bytes();
    // The second piece's copy fails, after the first piece was copied and (on the other thread) unmapped.
    faults.fail_nth(FaultKind::Copy, faults.calls(FaultKind::Copy) + 2);
    let e = pool.sleep(SleepAction::Offload).unwrap_err();
    assert!(umm_backends::testing::fault::is_injected(&e), "{e}");
    assert_eq!(pool.sleeping(), None, "awake again");
    assert_eq!(pool.reserved_bytes(), reserved);
    for (block, bytes) in &blocks {
        assert!(contents_of(&pool, block) == *bytes, "the unmapped piece came back with its bytes");
    }
    assert!(pool.allocate(MIB, StreamId(0)).is_ok(), "and it allocates");
    assert!(faults.violations().is_empty(), "{:?}", faults.violations());
    // The next sleep works.
    pool.sleep(SleepAction::Offload).unwrap();
    pool.wake().unwrap();
    for (block, bytes) in &blocks {
        assert!(contents_of(&pool, block) == *bytes);
    }
}

#[test]
fn a_sleep_that_cannot_undo_itself_stays_asleep_over_what_it_unmapped() {
    let (pool, faults, blocks) = faulty();
    faults.fail_nth(FaultKind::Copy, faults.calls(FaultKind::Copy) + 2);
    // Mapping the first piece back fails too.
    faults.fail_nth(FaultKind::MapPages, faults.calls(FaultKind::MapPages) + 1);
    let e = pool.sleep(SleepAction::Offload).unwrap_err();
    assert!(e.to_string().contains("stays asleep over them"), "{e}");
    assert_eq!(pool.sleeping(), Some(SleepAction::Offload));
    assert!(pool.allocate(MIB, StreamId(0)).unwrap_err().is_asleep());
    let asleep = pool.stats().asleep_bytes;
    assert!(asleep > 0 && asleep < 24 * MIB + 8 * MIB, "only the unmapped piece sleeps: {asleep}");
    pool.wake().unwrap();
    for (block, bytes) in &blocks {
        assert!(contents_of(&pool, block) == *bytes, "every block whole after the wake");
    }
    assert!(faults.violations().is_empty(), "{:?}", faults.violations());
}

/// A reservation made after a segment starts at a multiple of its page, as CUDA's do, and the simulated device
/// finds every page of a block there (an unaligned base once hid the first page of such a block).
#[test]
fn a_reservation_after_a_segment_is_page_aligned_and_keeps_its_bytes() {
    let pool = Pool::new(device(1 << 30), PoolConfig::default()).unwrap();
    let small = pool.allocate(4 * KIB, StreamId(0)).unwrap();
    let large = pool.allocate(1_200_000, StreamId(0)).unwrap();
    let bytes = pattern(3, 1_200_000);
    pool.write(&large, 0, &bytes).unwrap();
    assert!(contents(&pool, &large) == bytes);
    let reservation = pool.snapshot().segments.into_iter().find(|s| s.virtual_reservation).unwrap();
    let page = umm_backends::DEFAULT_PAGE_UNLIMITED;
    assert_eq!(reservation.address.unwrap() % page, 0, "{reservation:?}");
    pool.free(&small).unwrap();
    pool.free(&large).unwrap();
}

/// A pool dropped while it sleeps gives everything back: the device's pages (none are mapped), its reservations
/// and its host store.
#[test]
fn a_pool_dropped_asleep_gives_everything_back() {
    let (backend, faults) = FaultyBackend::new(device(1 << 30));
    let pool =
        Pool::new(backend, PoolConfig { page_size: Some(2 * MIB), ..PoolConfig::default() }.tagged("w")).unwrap();
    for i in 0..3u64 {
        let block = pool.allocate(5 * MIB, StreamId(i)).unwrap();
        pool.write(&block, 0, &pattern(i, 5 * MIB as usize)).unwrap();
    }
    pool.sleep(SleepAction::Offload).unwrap();
    assert_eq!(pool.backend().inner().physical_in_use(), 0);
    drop(pool);
    assert_eq!(faults.live_segments(), 0, "every reservation went back");
    assert!(faults.check_released().is_ok(), "{:?}", faults.check_released());
    assert!(faults.violations().is_empty(), "{:?}", faults.violations());
}

/// A pool asleep over part of its pages (a sleep that could not undo itself) and dropped so: the pages still
/// mapped are unmapped, those asleep are not unmapped twice.
#[test]
fn a_pool_dropped_half_asleep_unmaps_only_what_is_mapped() {
    let (pool, faults, _blocks) = faulty();
    faults.fail_nth(FaultKind::Copy, faults.calls(FaultKind::Copy) + 2);
    faults.fail_nth(FaultKind::MapPages, faults.calls(FaultKind::MapPages) + 1);
    assert!(pool.sleep(SleepAction::Offload).is_err());
    assert!(pool.backend().inner().physical_in_use() > 0, "part of the pool is still mapped");
    drop(pool);
    assert!(faults.check_released().is_ok(), "{:?}", faults.check_released());
    assert!(faults.violations().is_empty(), "{:?}", faults.violations());
}

#[test]
fn tags_of_up_to_the_longest_length_are_accepted() {
    let longest = "t".repeat(umm_backends::pool::MAX_TAG_LEN);
    umm_backends::pool::check_tag(&longest).expect("a tag of the longest length");
    umm_backends::pool::check_tag("w").expect("a tag of one byte");
    for bad in [String::new(), format!("{longest}t"), "a,b".into(), "a\nb".into()] {
        let err = umm_backends::pool::check_tag(&bad).unwrap_err();
        assert!(err.to_string().contains("a tag has 1 to 128 bytes"), "{bad:?}: {err}");
    }
}
