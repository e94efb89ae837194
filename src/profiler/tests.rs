use super::recording::unique_trace_path;
use super::*;

#[test]
fn second_trace_of_a_process_gets_a_number() {
    let a = unique_trace_path(Path::new("/tmp/umm-unit-{pid}.trace.gz"));
    let b = unique_trace_path(Path::new("/tmp/umm-unit-{pid}.trace.gz"));
    assert!(!a.to_string_lossy().contains("{pid}"));
    assert!(b.to_string_lossy().ends_with(".2.trace.gz"), "{}", b.display());
}

#[test]
fn ring_drops_the_oldest_and_counts() {
    let p = Profiler::with_capacity(true, 2);
    let loc = Location::caller();
    let mut handles = Vec::new();
    for bytes in 1..=3 {
        let event = AllocEvent {
            device: 0,
            pool: PoolKind::Host,
            api: None,
            bytes,
            stream: StreamId(0),
            label: None,
            location: loc,
            block_key: None,
            pool_handle: None,
        };
        handles.push(p.on_alloc(&event));
    }
    let events = p.events();
    assert_eq!(events.iter().map(|e| e.bytes).collect::<Vec<_>>(), [2, 3]);
    assert_eq!(p.dropped_events(), 1);
    assert_eq!(p.leak_report().total_bytes, 6);
    p.on_free(handles[0]);
    assert_eq!(p.leak_report().total_bytes, 5);
    // The first allocation of this thread's shard.
    let first_id = LIVE_SHARDS + live_shard();
    assert_eq!(p.events().last().map(|e| (e.kind, e.id)), Some((EventKind::Free, first_id)));
}
