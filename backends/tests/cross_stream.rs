//! Free memory shared across streams ([`CrossStream`]) on the simulated device, whose streams a test holds back
//! and lets finish: memory freed on a stream serves another stream's miss only once a mark recorded after the
//! free has passed (`completed`), or with the taker made to wait for it (`wait`); never while work that may use
//! it is held; and not at all when sharing is off. One suite over plain segments and virtual reservations.

use umm_backends::{BlockHandle, CrossStream, Pool, PoolConfig, SegmentMode, SimBackend, SimStreamLog, StreamId};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);
const S3: StreamId = StreamId(3);

/// A request that gets a segment of its own in a plain pool (above half the 20 MiB large segment) and spans
/// whole 2 MiB pages in a virtual one.
const BIG: u64 = 16 * MIB;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Memory {
    Plain,
    Virtual,
}

const MEMORIES: [Memory; 2] = [Memory::Plain, Memory::Virtual];

/// A pool on a simulated device with `policy`, no early trimming (so that what moves is sharing's doing), no
/// thread caches (a freed block goes straight back to its arena) and 2 MiB pages.
fn pool(memory: Memory, policy: CrossStream) -> Pool<SimBackend> {
    pool_with(memory, config(memory, policy))
}

fn pool_with(memory: Memory, config: PoolConfig) -> Pool<SimBackend> {
    let backend = match memory {
        Memory::Plain => SimBackend::plain("sim", 8 * GIB),
        Memory::Virtual => SimBackend::new("sim", 8 * GIB),
    };
    Pool::new(backend, config).expect("valid pool")
}

fn config(memory: Memory, policy: CrossStream) -> PoolConfig {
    PoolConfig {
        cross_stream: policy,
        segment_mode: if memory == Memory::Plain { SegmentMode::Plain } else { SegmentMode::Virtual },
        segment_slack: None,
        mapped_slack: None,
        page_size: Some(2 * MIB),
        thread_cache_bytes: 0,
        thread_cache_large_bytes: 0,
        ..PoolConfig::default()
    }
}

fn reserved(pool: &Pool<SimBackend>) -> u64 {
    pool.stats().reserved_bytes.current
}

fn shared(pool: &Pool<SimBackend>) -> u64 {
    let stats = pool.stats();
    stats.num_segments_shared + stats.num_pages_shared + stats.num_blocks_shared
}

fn log(pool: &Pool<SimBackend>) -> SimStreamLog {
    pool.backend().stream_log()
}

/// Allocates `BIG` on `stream` and frees it: the stream then holds that much free.
fn use_and_free(pool: &Pool<SimBackend>, stream: StreamId) {
    let block = pool.allocate(BIG, stream).expect("allocates");
    pool.free(&block).expect("frees");
}

#[test]
fn a_stream_miss_takes_what_another_stream_freed_once_its_work_passed() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Completed);
        use_and_free(&pool, S1);
        let before = reserved(&pool);
        let block = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), before, "{memory:?}: stream 2 reused stream 1's free memory");
        assert!(shared(&pool) > 0, "{memory:?}: the move is counted");
        let log = log(&pool);
        assert_eq!(log.marks_recorded, 1, "{memory:?}: one mark on the giving stream");
        assert!(log.waits.is_empty(), "{memory:?}: completed never makes a stream wait: {log:?}");
        // The mark has passed: pages are unmapped without waiting for the giving stream.
        assert_eq!((log.waited_unmaps, log.host_waits, log.unsafe_unmaps), (0, 0, 0), "{memory:?}: {log:?}");
        pool.free(&block).expect("frees");
    }
}

#[test]
fn without_sharing_each_stream_keeps_its_own_memory() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Off);
        use_and_free(&pool, S1);
        let before = reserved(&pool);
        let block = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), 2 * before, "{memory:?}: stream 2 took new memory");
        assert_eq!(shared(&pool), 0, "{memory:?}");
        assert_eq!(log(&pool).marks_recorded, 0, "{memory:?}: no marks when off");
        pool.free(&block).expect("frees");
    }
}

#[test]
fn memory_of_a_held_stream_waits_for_its_mark_under_completed() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Completed);
        pool.backend().hold_stream(S1);
        use_and_free(&pool, S1);
        let one = reserved(&pool);
        // Stream 1's kernels may still use what it freed: stream 2 takes new memory, and marks stream 1.
        let first = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), 2 * one, "{memory:?}: nothing moved from the held stream");
        let second = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), 3 * one, "{memory:?}: still nothing while its mark is pending");
        assert_eq!(log(&pool).marks_recorded, 1, "{memory:?}: a pending mark is not recorded again");
        assert_eq!(shared(&pool), 0, "{memory:?}");
        // Its work runs: the next miss takes stream 1's memory.
        pool.backend().finish_stream(S1);
        let third = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), 3 * one, "{memory:?}: stream 1's memory served the third block");
        assert!(shared(&pool) > 0, "{memory:?}");
        let log = log(&pool);
        assert_eq!((log.waits.len(), log.host_waits, log.unsafe_unmaps), (0, 0, 0), "{memory:?}: {log:?}");
        for block in [first, second, third] {
            pool.free(&block).expect("frees");
        }
    }
}

#[test]
fn a_free_after_a_streams_mark_needs_a_new_one() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Completed);
        use_and_free(&pool, S1);
        let taken = pool.allocate(BIG, S2).expect("allocates");
        // Stream 1 frees again, under held work: the passed mark predates this free, so it does not cover it.
        pool.backend().hold_stream(S1);
        use_and_free(&pool, S1);
        let before = reserved(&pool);
        let other = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), before + BIG, "{memory:?}: the newer free waits for a newer mark");
        assert_eq!(log(&pool).marks_recorded, 2, "{memory:?}");
        assert_eq!(log(&pool).unsafe_unmaps, 0, "{memory:?}");
        pool.free(&taken).expect("frees");
        pool.free(&other).expect("frees");
    }
}

#[test]
fn wait_takes_at_once_and_orders_the_taking_stream_after_the_giving_one() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Wait);
        pool.backend().hold_stream(S1);
        use_and_free(&pool, S1);
        let before = reserved(&pool);
        let block = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), before, "{memory:?}: taken at once");
        let log = log(&pool);
        assert_eq!(log.waits, vec![(S2, S1)], "{memory:?}: stream 2 waits for stream 1 on the device");
        assert_eq!(log.unsafe_unmaps, 0, "{memory:?}: {log:?}");
        // Pages are unmapped only after the host waited for the giving stream; segments move without it.
        let host_waits = if memory == Memory::Virtual { 1 } else { 0 };
        assert_eq!(log.host_waits, host_waits, "{memory:?}: {log:?}");
        pool.free(&block).expect("frees");
    }
}

#[test]
fn the_tightest_fitting_empty_segment_moves_between_streams() {
    let pool = pool(Memory::Plain, CrossStream::Completed);
    // Stream 1 frees a 64 MiB segment, stream 3 a 16 MiB one: a 16 MiB request takes the 16 MiB one.
    let wide = pool.allocate(64 * MIB, S1).expect("allocates");
    let narrow = pool.allocate(BIG, S3).expect("allocates");
    pool.free(&wide).expect("frees");
    pool.free(&narrow).expect("frees");
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(reserved(&pool), 80 * MIB, "no new segment");
    let snapshot = pool.snapshot();
    let of = |stream: StreamId| -> Vec<u64> {
        snapshot.segments.iter().filter(|s| s.stream == stream).map(|s| s.size).collect()
    };
    assert_eq!(of(S2), vec![BIG], "stream 2 got the 16 MiB segment");
    assert_eq!(of(S1), vec![64 * MIB], "stream 1 kept the 64 MiB one");
    assert!(of(S3).is_empty());
    pool.free(&block).expect("frees");
}

#[test]
fn small_blocks_share_another_streams_empty_small_segment() {
    let pool = pool(Memory::Virtual, CrossStream::Completed);
    let small = pool.allocate(4096, S1).expect("allocates");
    pool.free(&small).expect("frees");
    let before = reserved(&pool);
    let again = pool.allocate(4096, S2).expect("allocates");
    assert_eq!(reserved(&pool), before, "the 2 MiB small segment moved");
    assert_eq!(pool.stats().num_segments_shared, 1);
    pool.free(&again).expect("frees");
}

#[test]
fn a_busy_segment_or_another_class_never_moves_between_streams() {
    let pool = pool(Memory::Plain, CrossStream::Completed);
    // Stream 1's small segment holds a live block; its large segment is too small for the request.
    let live = pool.allocate(4096, S1).expect("allocates");
    let small_large = pool.allocate(2 * MIB, S1).expect("allocates");
    pool.free(&small_large).expect("frees");
    let before = reserved(&pool);
    let block = pool.allocate(4096, S2).expect("allocates");
    let big = pool.allocate(32 * MIB, S2).expect("allocates");
    assert_eq!(pool.stats().num_segments_shared, 0, "nothing fitting and empty to take");
    assert_eq!(reserved(&pool), before + 2 * MIB + 32 * MIB);
    for b in [live, block, big] {
        pool.free(&b).expect("frees");
    }
}

#[test]
fn stream_marks_are_given_back_when_the_pool_drops() {
    let pool = pool(Memory::Virtual, CrossStream::Completed);
    use_and_free(&pool, S1);
    use_and_free(&pool, S2);
    use_and_free(&pool, S3);
    let backend_log = log(&pool);
    assert!(backend_log.marks_live > 0, "marks were recorded: {backend_log:?}");
    let stats = pool.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    drop(pool);
}

/// Many streams, random sizes; every stream held from the start and let finish at random later (a stream held
/// since before its first free makes every unmap of its pages without a wait unsafe until it finishes, so the
/// model's check is exact): whatever the policy, no page is unmapped under held work without waiting,
/// `completed` never makes a stream wait, and while every stream is held `completed` moves nothing.
#[test]
fn random_streams_and_holds_never_share_unsafely() {
    for memory in MEMORIES {
        for policy in [CrossStream::Off, CrossStream::Completed, CrossStream::Wait] {
            let pool = pool(memory, policy);
            let mut rng = 0x2545_F491_4F6C_DD1Du64;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut live: Vec<(BlockHandle, StreamId)> = Vec::new();
            let mut held_all = true;
            for s in 1..=4 {
                pool.backend().hold_stream(StreamId(s));
            }
            for step in 0..3000 {
                let stream = StreamId(1 + next() % 4);
                match next() % 10 {
                    0 | 1 if step > 1500 => {
                        held_all = false;
                        pool.backend().finish_stream(stream);
                    }
                    2..=5 => {
                        let bytes = match next() % 3 {
                            0 => 1 + next() % (64 << 10),
                            1 => 1 + next() % (8 * MIB),
                            _ => 1 + next() % (48 * MIB),
                        };
                        let block = pool.allocate(bytes, stream).expect("allocates");
                        live.push((block, stream));
                    }
                    _ if !live.is_empty() => {
                        let (block, _) = live.swap_remove((next() % live.len() as u64) as usize);
                        pool.free(&block).expect("frees");
                    }
                    _ => {}
                }
                if held_all && policy == CrossStream::Completed {
                    assert_eq!(shared(&pool), 0, "{memory:?}: moved while every stream was held (step {step})");
                }
            }
            let log = log(&pool);
            assert_eq!(log.unsafe_unmaps, 0, "{memory:?} {policy:?}: {log:?}");
            match policy {
                CrossStream::Off => assert_eq!(log.marks_recorded, 0, "{memory:?}"),
                CrossStream::Completed => assert!(log.waits.is_empty(), "{memory:?}: {:?}", log.waits),
                CrossStream::Wait => assert!(
                    log.waits.iter().all(|(taker, giver)| taker != giver),
                    "{memory:?}: a stream waits for another"
                ),
            }
            assert!(policy == CrossStream::Off || shared(&pool) > 0, "{memory:?} {policy:?}: sharing happened");
            for (block, _) in live {
                pool.free(&block).expect("frees");
            }
        }
    }
}

#[test]
fn below_the_live_peak_each_stream_keeps_its_own_free_memory() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Completed);
        // A peak of 64 MiB live, given back: the workload has shown it needs that much.
        let peak: Vec<_> = (0..4).map(|_| pool.allocate(BIG, S1).expect("allocates")).collect();
        for block in &peak {
            pool.free(block).expect("frees");
        }
        pool.release_cached();
        assert_eq!(reserved(&pool), 0);
        use_and_free(&pool, S1);
        let block = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), 2 * BIG, "{memory:?}: new memory below the live peak, no move");
        assert_eq!(shared(&pool), 0, "{memory:?}");
        assert_eq!(log(&pool).marks_recorded, 0, "{memory:?}: no mark either");
        pool.free(&block).expect("frees");
    }
}

/// A segment far larger than the one the miss would make stays with its stream: taken, most of it would sit idle
/// in the taker's arena while its own stream, needing it back, made another.
#[test]
fn another_streams_empty_segment_much_larger_than_the_request_is_not_taken() {
    let pool = pool(Memory::Plain, CrossStream::Completed);
    let wide = pool.allocate(64 * MIB, S1).expect("allocates");
    pool.free(&wide).expect("frees");
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(reserved(&pool), 64 * MIB + BIG, "a segment of its own size");
    assert_eq!(shared(&pool), 0);
    pool.free(&block).expect("frees");
    // One at most a quarter larger than what the miss would make is taken.
    let pool = self::pool(Memory::Plain, CrossStream::Completed);
    let near = pool.allocate(BIG + BIG / 4, S1).expect("allocates");
    pool.free(&near).expect("frees");
    let block = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(reserved(&pool), BIG + BIG / 4, "taken");
    assert_eq!(shared(&pool), 1);
    pool.free(&block).expect("frees");
}

/// New memory that lifts reserved memory exactly to the live peak is still below the budget: each stream keeps its
/// own free memory, and nothing moves until reserved memory would pass the peak.
#[test]
fn at_the_live_peak_each_stream_keeps_its_own_free_memory() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Completed);
        // A peak of two blocks live, given back.
        let peak: Vec<_> = (0..2).map(|_| pool.allocate(BIG, S1).expect("allocates")).collect();
        for block in &peak {
            pool.free(block).expect("frees");
        }
        pool.release_cached();
        assert_eq!(reserved(&pool), 0);
        use_and_free(&pool, S1);
        // Stream 1's free block plus stream 2's new one make the peak exactly.
        let block = pool.allocate(BIG, S2).expect("allocates");
        assert_eq!(reserved(&pool), 2 * BIG, "{memory:?}: new memory up to the live peak, no move");
        assert_eq!(shared(&pool), 0, "{memory:?}");
        assert_eq!(log(&pool).marks_recorded, 0, "{memory:?}: no mark either");
        // One more block would pass the peak: stream 1's free memory serves it.
        let more = pool.allocate(BIG, S3).expect("allocates");
        assert_eq!(reserved(&pool), 2 * BIG, "{memory:?}: past the peak, stream 1's memory moved");
        assert!(shared(&pool) > 0, "{memory:?}");
        pool.free(&block).expect("frees");
        pool.free(&more).expect("frees");
    }
}

/// Small blocks another stream freed wait in its arena's quick cache, still allocated to its engine: they go back
/// into the engine before the search for empty segments, so a small segment emptied only by them moves.
#[test]
fn a_small_segment_another_stream_emptied_through_its_quick_blocks_moves() {
    for memory in MEMORIES {
        let pool = pool(memory, CrossStream::Completed);
        let blocks: Vec<_> = (0..4).map(|_| pool.allocate(4096, S1).expect("allocates")).collect();
        for block in &blocks {
            pool.free(block).expect("frees");
        }
        let before = reserved(&pool);
        assert_eq!(before, 2 * MIB, "{memory:?}: one small segment");
        let small = pool.allocate(4096, S2).expect("allocates");
        assert_eq!(pool.stats().num_segments_shared, 1, "{memory:?}: stream 1's small segment moved");
        assert_eq!(reserved(&pool), before, "{memory:?}: no new small segment");
        pool.free(&small).expect("frees");
    }
}

/// A miss takes free pages from several streams' reservations, each giving what is still missing and no more:
/// the first gives all its free pages, the second only the rest, and keeps its other free pages mapped.
#[test]
fn pages_from_several_streams_cover_a_miss_and_no_more() {
    let pool = pool(Memory::Virtual, CrossStream::Completed);
    // Both live at once: stream 2's miss finds no free page on stream 1.
    let one = pool.allocate(BIG / 2, S1).expect("allocates");
    let two = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(log(&pool).marks_recorded, 0, "no stream holds free pages to mark");
    pool.free(&one).expect("frees");
    pool.free(&two).expect("frees");
    assert_eq!(reserved(&pool), BIG + BIG / 2);
    // Stream 3 needs 16 MiB: 8 from stream 1 (all it has free), then 8 of stream 2's 16.
    let three = pool.allocate(BIG, S3).expect("allocates");
    let stats = pool.stats();
    assert_eq!(stats.num_pages_shared, BIG / (2 * MIB), "exactly the pages the miss needed");
    assert_eq!(reserved(&pool), BIG + BIG / 2, "stream 2 kept 8 MiB of free pages mapped");
    assert_eq!(log(&pool).marks_recorded, 2, "one mark on each giving stream");
    // Those 8 MiB serve stream 2 again without a new mapping.
    let calls = pool.stats().num_device_calls;
    let again = pool.allocate(BIG / 2, S2).expect("allocates");
    assert_eq!(pool.stats().num_device_calls, calls, "stream 2's kept pages served it");
    for block in [three, again] {
        pool.free(&block).expect("frees");
    }
}

/// A mark that passed after a stream's latest free covers everything that stream holds free: later moves from it
/// record no new mark (a mark is one device call: recording it is the only call a move of a plain segment makes).
#[test]
fn a_passed_mark_covers_every_later_move_from_its_stream() {
    let pool = pool(Memory::Plain, CrossStream::Completed);
    let peak: Vec<_> = (0..2).map(|_| pool.allocate(BIG, S1).expect("allocates")).collect();
    for block in &peak {
        pool.free(block).expect("frees");
    }
    let (calls, marks) = (pool.stats().num_device_calls, pool.stats().num_stream_marks);
    let two = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(pool.stats().num_segments_shared, 1);
    assert_eq!(log(&pool).marks_recorded, 1);
    assert_eq!(pool.stats().num_stream_marks, marks + 1, "the mark on stream 1");
    assert_eq!(pool.stats().num_device_calls, calls, "a mark is no call into the memory API");
    let three = pool.allocate(BIG, S3).expect("allocates");
    assert_eq!(pool.stats().num_segments_shared, 2, "stream 1's second segment moved too");
    assert_eq!(log(&pool).marks_recorded, 1, "under the same mark");
    assert_eq!(pool.stats().num_stream_marks, marks + 1, "no new mark");
    assert_eq!(pool.stats().num_device_calls, calls, "no call at all");
    assert_eq!(reserved(&pool), 2 * BIG);
    for block in [two, three] {
        pool.free(&block).expect("frees");
    }
}

/// An empty small segment of another stream does not serve a large request it would fit: only an arena of the
/// taker's class gives segments.
#[test]
fn another_streams_empty_segment_of_another_class_is_not_taken() {
    let pool = pool(Memory::Plain, CrossStream::Completed);
    let small = pool.allocate(4096, S1).expect("allocates");
    pool.free(&small).expect("frees");
    // A snapshot drains the quick caches: stream 1's small segment is empty in its engine.
    assert_eq!(pool.snapshot().segments.len(), 1);
    let large = pool.allocate(3 * MIB / 2, S2).expect("allocates");
    assert_eq!(pool.stats().num_segments_shared, 0, "a small segment never serves the large arena");
    assert_eq!(reserved(&pool), 2 * MIB + 20 * MIB, "a large segment of its own");
    pool.free(&large).expect("frees");
}

/// A reservation with exactly one free page gives it.
#[test]
fn a_single_free_page_of_another_stream_moves() {
    let pool = pool(Memory::Virtual, CrossStream::Completed);
    let one = pool.allocate(2 * MIB, S1).expect("allocates");
    pool.free(&one).expect("frees");
    let two = pool.allocate(2 * MIB, S2).expect("allocates");
    assert_eq!(pool.stats().num_pages_shared, 1);
    assert_eq!(reserved(&pool), 2 * MIB);
    pool.free(&two).expect("frees");
}

/// A pool that serves one stream shares nothing: no mark, no page moved, even where that stream's arenas of
/// both classes are reservations (a tagged pool's) and one of them holds free pages when the other misses.
#[test]
fn a_pool_of_one_stream_moves_nothing_between_its_arenas() {
    let pool = pool_with(Memory::Virtual, config(Memory::Virtual, CrossStream::Completed).tagged("one"));
    let small: Vec<_> = (0..8).map(|_| pool.allocate(256 << 10, S1).expect("allocates")).collect();
    for block in &small {
        pool.free(block).expect("frees");
    }
    // A snapshot drains the quick cache: the small arena's page is free in its engine.
    pool.snapshot();
    let big = pool.allocate(BIG, S1).expect("allocates");
    assert_eq!(shared(&pool), 0, "nothing moved");
    assert_eq!(log(&pool).marks_recorded, 0, "no mark");
    assert_eq!(reserved(&pool), 2 * MIB + BIG);
    pool.free(&big).expect("frees");
}

/// A miss drains the quick caches of its own class only: another stream's small blocks stay cached when a large
/// request misses, so the segment under them stays too (the slack trim, which gives back empty segments before
/// the pool grows, does not see it empty) and serves that stream's next small request without a device call.
#[test]
fn a_large_miss_leaves_other_streams_small_quick_blocks_cached() {
    let pool = pool_with(
        Memory::Plain,
        PoolConfig { segment_slack: Some(0.1), ..config(Memory::Plain, CrossStream::Completed) },
    );
    let small = pool.allocate(4096, S1).expect("allocates");
    pool.free(&small).expect("frees");
    let large = pool.allocate(BIG, S2).expect("allocates");
    assert_eq!(reserved(&pool), 2 * MIB + BIG, "stream 1's small segment stays");
    let calls = pool.stats().num_device_calls;
    let again = pool.allocate(4096, S1).expect("allocates");
    assert_eq!(pool.stats().num_device_calls, calls, "served by stream 1's cached block");
    for block in [large, again] {
        pool.free(&block).expect("frees");
    }
}
