//! Free blocks lent across streams where they lie (virtual reservations on the simulated device, whose streams a
//! test holds back): a stream's miss takes another stream's free block at its own address, with no page moved,
//! once a mark on the giving stream has passed; the block goes back to its arena only once a mark on the
//! borrowing stream, recorded after its free, has passed (or, under `wait`, with the giver made to wait for it).

use umm_backends::{BlockHandle, CrossStream, Pool, PoolConfig, SegmentMode, SimBackend, SimDeviceStreams, StreamId};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);
const BIG: u64 = 16 * MIB;

/// Virtual reservations of 2 MiB pages, sharing under `policy`, no thread caches or early trims (so that what
/// moves is sharing's doing).
fn pool(policy: CrossStream) -> Pool<SimBackend> {
    let config = PoolConfig {
        cross_stream: policy,
        segment_mode: SegmentMode::Virtual,
        segment_slack: None,
        mapped_slack: None,
        page_size: Some(2 * MIB),
        thread_cache_bytes: 0,
        thread_cache_large_bytes: 0,
        stitch: false,
        ..PoolConfig::default()
    };
    Pool::new(SimBackend::new("sim", 8 * GIB), config).expect("valid pool")
}

fn reserved(pool: &Pool<SimBackend>) -> u64 {
    pool.stats().reserved_bytes.current
}

fn address(pool: &Pool<SimBackend>, block: &BlockHandle) -> u64 {
    pool.device_address(block).expect("the simulated device has addresses")
}

/// Stream 1 leaves `BIG` free at the returned address; stream 2 has used its arena (a 2 MiB block, freed), so
/// that its next miss is one of an arena it has.
fn setup(pool: &Pool<SimBackend>) -> u64 {
    setup_with(pool, &[S2])
}

/// [`setup`] with each of `others` having used its arena, before stream 1's block is free.
fn setup_with(pool: &Pool<SimBackend>, others: &[StreamId]) -> u64 {
    let one = pool.allocate(BIG, S1).expect("allocates");
    let at = address(pool, &one);
    let small: Vec<_> = others.iter().map(|&s| pool.allocate(2 * MIB, s).expect("allocates")).collect();
    pool.free(&one).expect("frees");
    for block in &small {
        pool.free(block).expect("frees");
    }
    at
}

#[test]
fn a_miss_borrows_another_streams_free_block_where_it_lies() {
    let pool = pool(CrossStream::Completed);
    let at = setup(&pool);
    let (before, calls) = (reserved(&pool), pool.stats().num_device_calls);
    let block = pool.allocate(BIG, S2).expect("allocates");
    let stats = pool.stats();
    assert_eq!(address(&pool, &block), at, "stream 1's block, at its own address");
    assert_eq!((stats.num_blocks_shared, stats.num_pages_shared), (1, 0));
    assert_eq!(reserved(&pool), before, "no new memory");
    assert_eq!(stats.num_device_calls, calls, "no page unmapped or mapped");
    assert_eq!(stats.num_stream_marks, 1, "one mark on stream 1");
    // Freed by stream 2, whose work has run: stream 1's next miss gets it back, at its address.
    pool.free(&block).expect("frees");
    let back = pool.allocate(BIG, S1).expect("allocates");
    assert_eq!(address(&pool, &back), at);
    assert_eq!(reserved(&pool), before);
    assert_eq!(pool.stats().num_blocks_shared, 1, "its own block, not a loan");
    pool.free(&back).expect("frees");
}

#[test]
fn a_block_whose_givers_work_is_held_is_not_borrowed() {
    let pool = pool(CrossStream::Completed);
    pool.backend().hold_stream(S1);
    let at = setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_ne!(address(&pool, &block), at, "stream 1's kernels may still use its block");
    assert_eq!(pool.stats().num_blocks_shared, 0);
    pool.backend().finish_stream(S1);
    pool.free(&block).expect("frees");
}

#[test]
fn a_borrowed_block_goes_home_only_after_the_borrowers_work_has_run() {
    let pool = pool(CrossStream::Completed);
    let at = setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(address(&pool, &block), at);
    // Stream 2's kernels still use the block when it is freed.
    pool.backend().hold_stream(S2);
    pool.free(&block).expect("frees");
    assert_eq!(pool.device_address(&block), None, "a freed handle has no address");
    let early = pool.allocate(BIG, S1).expect("allocates");
    assert_ne!(address(&pool, &early), at, "stream 2's work may still run on the block");
    pool.free(&early).expect("frees");
    // Stream 2's work runs: stream 1 takes its block back (its other free block would serve as well: hold it).
    pool.backend().finish_stream(S2);
    let other = pool.allocate(BIG, S1).expect("allocates");
    let home = pool.allocate(BIG, S1).expect("allocates");
    assert!([address(&pool, &other), address(&pool, &home)].contains(&at), "the block went home");
    for block in [other, home] {
        pool.free(&block).expect("frees");
    }
}

#[test]
fn a_borrowed_block_freed_twice_is_refused() {
    let pool = pool(CrossStream::Completed);
    setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(pool.stats().num_blocks_shared, 1);
    pool.backend().hold_stream(S2);
    pool.free(&block).expect("frees");
    let second = pool.free(&block).expect_err("freed already");
    assert!(second.is_unknown_block(), "{second}");
    pool.backend().finish_stream(S2);
    // Returned once, whatever the second free said.
    pool.release_cached();
    assert_eq!(reserved(&pool), 0, "every page given back");
}

#[test]
fn releasing_cached_memory_waits_for_the_borrower_and_gives_the_block_back() {
    let pool = pool(CrossStream::Completed);
    setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    pool.backend().hold_stream(S2);
    pool.free(&block).expect("frees");
    let waits = pool.backend().stream_log().host_waits;
    pool.release_cached();
    assert!(pool.backend().stream_log().host_waits > waits, "the host waited for stream 2's mark");
    assert_eq!(reserved(&pool), 0, "the returned block's pages were released too");
    assert_eq!(pool.backend().stream_log().unsafe_unmaps, 0);
}

#[test]
fn under_wait_the_giver_waits_on_the_device_for_the_borrower() {
    let pool = pool(CrossStream::Wait);
    let at = setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(address(&pool, &block), at);
    pool.backend().hold_stream(S2);
    pool.free(&block).expect("frees");
    let waits = pool.backend().stream_log().waits.len();
    let back = pool.allocate(BIG, S1).expect("allocates");
    assert_eq!(address(&pool, &back), at, "stream 1 took its block back at once");
    let log = pool.backend().stream_log();
    assert_eq!(&log.waits[waits..], &[(S1, S2)], "stream 1 waits for stream 2 on the device");
    pool.backend().finish_stream(S2);
    pool.free(&back).expect("frees");
}

#[test]
fn without_sharing_nothing_is_borrowed() {
    let pool = pool(CrossStream::Off);
    let at = setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_ne!(address(&pool, &block), at);
    assert_eq!((pool.stats().num_blocks_shared, pool.stats().num_stream_marks), (0, 0));
    pool.free(&block).expect("frees");
}

#[test]
fn the_borrower_uses_its_freed_loan_again_without_a_mark() {
    let pool = pool(CrossStream::Completed);
    let at = setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    pool.backend().hold_stream(S2);
    pool.free(&block).expect("frees");
    let marks = pool.stats().num_stream_marks;
    // Stream 2's own later work is ordered after its earlier work on the block.
    let again = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(address(&pool, &again), at, "its loan again");
    assert_eq!(pool.stats().num_stream_marks, marks, "no mark on either stream");
    assert_eq!(pool.stats().num_blocks_shared, 1, "the same loan");
    pool.free(&again).expect("frees");
    pool.backend().finish_stream(S2);
}

#[test]
fn another_stream_never_takes_a_loan_freed_under_held_work() {
    const S3: StreamId = StreamId(3);
    let pool = pool(CrossStream::Completed);
    // Stream 3 has used its arena too, before stream 1's block is free.
    let at = setup_with(&pool, &[S2, S3]);
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!((address(&pool, &block), pool.stats().num_blocks_shared), (at, 1), "stream 1's block, lent");
    pool.backend().hold_stream(S2);
    pool.free(&block).expect("frees");
    let three = pool.allocate(BIG, S3).expect("allocates");
    assert_ne!(address(&pool, &three), at, "stream 2's work may still run on it");
    pool.free(&three).expect("frees");
    pool.backend().finish_stream(S2);
}

#[test]
fn dropping_the_pool_waits_for_the_borrower_of_a_returning_block() {
    // The device's streams outlive the pool: a second backend over them reads their log after the drop.
    let streams = SimDeviceStreams::default();
    let config = PoolConfig { stitch: false, ..pool(CrossStream::Completed).config().clone() };
    let pool = Pool::new(SimBackend::new("sim", 8 * GIB).with_streams(&streams), config).expect("valid pool");
    setup(&pool);
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(pool.stats().num_blocks_shared, 1);
    pool.backend().hold_stream(S2);
    pool.free(&block).expect("frees");
    drop(pool);
    let log = SimBackend::new("probe", GIB).with_streams(&streams).stream_log();
    // Unmapping stream 1's reservation waits for stream 1 only: the block went home first, after a mark on stream
    // 2 recorded after its free (the second mark; the first was stream 1's, for the loan) and waited for.
    assert_eq!(log.marks_recorded, 2, "{log:?}");
    assert!(log.host_waits > 0, "{log:?}");
    assert_eq!(log.unsafe_unmaps, 0, "{log:?}");
}
