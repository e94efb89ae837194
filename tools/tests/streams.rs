//! Replays of the committed serving trace: streams that share free memory hold one peak, not one per stream.

use umm::backends::{CrossStream, Pool, PoolConfig, SimBackend};
use umm::trace::Trace;
use umm_tools::replay::{replay, ReplayOptions};

/// The committed serving trace (BERT base inference, 4 threads each on its own CUDA stream, recorded through
/// PyTorch with `UMM_TRACE`) replayed on the simulated device: with streams sharing free memory (the default)
/// the pool reserves near the trace's live peak; with sharing off, each stream keeps its own peak.
#[test]
fn streams_sharing_free_memory_hold_one_peak_not_four() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/bert_serve_4streams.trace.gz");
    let trace = Trace::load(&path).unwrap();
    assert_eq!(trace.streams, 5, "the model's load on the default stream, then a stream per server thread");
    let ratio = |cross_stream| {
        let config = PoolConfig { cross_stream, ..PoolConfig::default() };
        let pool = Pool::new(SimBackend::new("sim", 80 << 30), config).unwrap();
        let report = replay(&trace, &pool, "sim", "sim", ReplayOptions::with_repeat(1)).unwrap();
        (report.reserved_over_live.unwrap(), pool.stats())
    };
    let (shared, stats) = ratio(CrossStream::Completed);
    let (apart, off_stats) = ratio(CrossStream::Off);
    assert!(shared < 1.3, "shared: reserved {shared:.3} x live");
    assert!(apart > 2.0, "apart: reserved {apart:.3} x live");
    assert!(stats.num_pages_shared + stats.num_segments_shared > 0, "{stats:?}");
    assert_eq!(off_stats.num_pages_shared + off_stats.num_segments_shared, 0, "{off_stats:?}");
}

/// The report counts moves between streams as the pool does, and the last warm pass's device calls apart from
/// all warm passes': with one warm pass they are the same, with three the last is its own share of them.
#[test]
fn replays_count_moves_between_streams_and_the_last_passes_device_calls() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/bert_serve_4streams.trace.gz");
    let trace = Trace::load(&path).unwrap();
    let run = |repeat| {
        let pool = Pool::new(SimBackend::new("sim", 80 << 30), PoolConfig::default()).unwrap();
        let report = replay(&trace, &pool, "sim", "sim", ReplayOptions::with_repeat(repeat)).unwrap();
        (report, pool.stats())
    };
    let (one, stats) = run(1);
    assert_eq!((one.pages_shared, one.segments_shared), (stats.num_pages_shared, stats.num_segments_shared));
    assert!(one.pages_shared + one.segments_shared > 0, "{one:?}");
    assert_eq!(one.warm_device_calls_last, one.warm_device_calls, "{one:?}");
    let (three, _) = run(3);
    let (all, last) = (three.warm_device_calls.unwrap(), three.warm_device_calls_last.unwrap());
    println!("warm device calls over three passes {all}, in the last {last}");
    assert!(last < all || all == 0, "the last pass is one of three: {three:?}");
}
