//! Stream captures (CUDA graphs) on the simulated device, whose streams model a capture as the driver does
//! (`SimBackend::begin_capture`): while a pool is told that a capture is underway (`begin_capture`), it makes no
//! call that the driver refuses during one (each would invalidate the capture), whatever the workload, the
//! cross-stream policy, stitching or the segment mode; and a pool that is not told is caught by the model.
//! Random workloads: allocations and frees on three streams, frees on other streams (record_stream), memory held
//! back on streams, limits that force the pool to its slow paths, and a capture now and then.

use proptest::prelude::*;
use umm_backends::pool::StreamPool;
use umm_backends::{BlockHandle, CrossStream, Limit, Pool, PoolConfig, SegmentMode, SimBackend, StreamId};

const MIB: u64 = 1 << 20;
const CAPTURE: StreamId = StreamId(1);
const STREAMS: [StreamId; 3] = [StreamId(1), StreamId(2), StreamId(3)];

fn pool(cross: CrossStream, stitch: bool, virtual_memory: bool) -> StreamPool<SimBackend> {
    let backend = if virtual_memory { SimBackend::new("sim", 4 << 30) } else { SimBackend::plain("sim", 4 << 30) };
    let config = PoolConfig {
        cross_stream: cross,
        stitch,
        segment_mode: if virtual_memory { SegmentMode::Virtual } else { SegmentMode::Plain },
        page_size: Some(2 * MIB),
        mapped_slack: Some(0.05),
        ..PoolConfig::default()
    };
    StreamPool::new(Pool::new(backend, config).expect("a valid pool"))
}

#[derive(Debug, Clone)]
enum Op {
    Allocate { stream: usize, mib: u64 },
    Free { index: usize, on: usize },
    Record { index: usize, stream: usize },
    Hold { stream: usize },
    Finish { stream: usize },
    Capture,
    EndCapture,
    Trim,
    Limit { mib: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, prop_oneof![1u64..4, 8u64..40, 60u64..200]).prop_map(|(stream, mib)| Op::Allocate { stream, mib }),
        5 => (any::<usize>(), 0..3usize).prop_map(|(index, on)| Op::Free { index, on }),
        2 => (any::<usize>(), 0..3usize).prop_map(|(index, stream)| Op::Record { index, stream }),
        1 => (0..3usize).prop_map(|stream| Op::Hold { stream }),
        1 => (0..3usize).prop_map(|stream| Op::Finish { stream }),
        1 => Just(Op::Capture),
        1 => Just(Op::EndCapture),
        1 => Just(Op::Trim),
        1 => (300u64..1200).prop_map(|mib| Op::Limit { mib }),
    ]
}

/// Runs `ops`; `told` says whether the pool is told of the captures the device models.
fn run(pool: &StreamPool<SimBackend>, ops: &[Op], told: bool) -> u64 {
    let sim = pool.backend();
    let mut live: Vec<(BlockHandle, StreamId)> = Vec::new();
    let mut capturing = false;
    for op in ops {
        match *op {
            Op::Allocate { stream, mib } => {
                if let Ok(block) = pool.allocate(mib * MIB, STREAMS[stream]) {
                    live.push((block, STREAMS[stream]));
                }
            }
            Op::Free { index, on } if !live.is_empty() => {
                let (block, stream) = live.swap_remove(index % live.len());
                if STREAMS[on] != stream {
                    pool.record_stream(&block, STREAMS[on]).expect("a live block");
                }
                pool.free(&block).expect("a live block");
            }
            Op::Record { index, stream } if !live.is_empty() => {
                let (block, _) = &live[index % live.len()];
                pool.record_stream(block, STREAMS[stream]).expect("a live block");
            }
            Op::Hold { stream } => sim.hold_stream(STREAMS[stream]),
            Op::Finish { stream } => sim.finish_stream(STREAMS[stream]),
            Op::Capture if !capturing => {
                capturing = true;
                sim.begin_capture(CAPTURE);
                if told {
                    pool.begin_capture();
                }
            }
            Op::EndCapture if capturing => {
                capturing = false;
                // As PyTorch does: the driver ends the capture, then the allocator is told.
                sim.end_capture(CAPTURE);
                if told {
                    pool.end_capture().expect("marks recorded");
                }
            }
            Op::Trim => {
                pool.release_cached();
            }
            Op::Limit { mib } => {
                let _ = pool.set_limit(Some(Limit::Bytes(mib * MIB)));
            }
            _ => {}
        }
    }
    if capturing {
        sim.end_capture(CAPTURE);
        if told {
            pool.end_capture().expect("marks recorded");
        }
    }
    STREAMS.iter().for_each(|&s| sim.finish_stream(s));
    for (block, _) in live {
        pool.free(&block).expect("a live block");
    }
    sim.stream_log().capture_violations
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn a_pool_told_of_captures_makes_no_call_a_capture_refuses(
        ops in prop::collection::vec(op(), 1..120),
        cross in prop_oneof![Just(CrossStream::Completed), Just(CrossStream::Wait), Just(CrossStream::Off)],
        stitch in any::<bool>(),
        virtual_memory in any::<bool>(),
    ) {
        let pool = pool(cross, stitch, virtual_memory);
        prop_assert_eq!(run(&pool, &ops, true), 0);
        prop_assert_eq!(pool.deferred_frees(), 0, "every free held back during a capture was marked after it");
    }
}

/// The oracle can fail: the same kind of workload with the pool not told of the capture makes refused calls
/// (memory of the capturing stream moved to another, cache released under it).
#[test]
fn a_pool_not_told_of_a_capture_is_caught() {
    let ops = vec![
        Op::Allocate { stream: 0, mib: 100 },
        Op::Allocate { stream: 0, mib: 100 },
        Op::Record { index: 0, stream: 1 },
        Op::Free { index: 0, on: 0 },
        Op::Free { index: 0, on: 0 },
        Op::Capture,
        Op::Allocate { stream: 1, mib: 150 },
        Op::Allocate { stream: 2, mib: 150 },
        Op::Trim,
        Op::EndCapture,
    ];
    let mut caught = 0;
    for cross in [CrossStream::Completed, CrossStream::Wait, CrossStream::Off] {
        for virtual_memory in [false, true] {
            let told = run(&pool(cross, false, virtual_memory), &ops, true);
            assert_eq!(told, 0, "{cross:?} virtual={virtual_memory}");
            caught += run(&pool(cross, false, virtual_memory), &ops, false);
        }
    }
    assert!(caught > 0, "no refused call without begin_capture: the model would not catch a slip");
}

/// A free during a capture of a block used on another stream is held back, counted by `deferred_frees`, until the
/// capture ends; a block used on its own stream only goes back at once.
#[test]
fn a_free_on_another_stream_during_a_capture_is_held_until_it_ends() {
    let pool = pool(CrossStream::Completed, false, false);
    let sim = pool.backend();
    let shared = pool.allocate(4 * MIB, STREAMS[0]).expect("memory");
    let own = pool.allocate(4 * MIB, STREAMS[0]).expect("memory");
    pool.record_stream(&shared, STREAMS[1]).expect("a live block");
    sim.begin_capture(CAPTURE);
    pool.begin_capture();
    pool.free(&own).expect("a live block");
    assert_eq!(pool.deferred_frees(), 0, "a block of one stream is not held back");
    pool.free(&shared).expect("a live block");
    assert_eq!(pool.deferred_frees(), 1, "the block used on another stream is held back");
    sim.end_capture(CAPTURE);
    pool.end_capture().expect("marks recorded");
    assert_eq!(pool.deferred_frees(), 0, "marked once the capture ended");
    assert_eq!(sim.stream_log().capture_violations, 0);
}
