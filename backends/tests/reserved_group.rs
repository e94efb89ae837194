//! A group of pools keeps the true peak of their reserved bytes together (`PoolConfig::reserved_group`), where the
//! sum of the pools' own peaks only bounds it from above.

use umm_backends::{Pool, PoolConfig, ReservedGroup, SegmentMode, SimBackend, StreamId};

const MIB: u64 = 1 << 20;

fn pool(group: &std::sync::Arc<ReservedGroup>) -> Pool<SimBackend> {
    let config = PoolConfig {
        segment_mode: SegmentMode::Plain,
        reserved_group: Some(group.clone()),
        thread_cache_bytes: 0,
        thread_cache_large_bytes: 0,
        ..PoolConfig::default()
    };
    Pool::new(SimBackend::plain("sim", 1 << 30), config).unwrap()
}

#[test]
fn the_group_peak_is_the_peak_of_the_sum_not_the_sum_of_peaks() {
    let group = ReservedGroup::new();
    let (a, b) = (pool(&group), pool(&group));
    let x = a.allocate(100 * MIB, StreamId(0)).unwrap();
    let after_a = group.current();
    assert_eq!(after_a, a.reserved_bytes());
    a.free(&x).unwrap();
    a.release_cached();
    assert_eq!(group.current(), 0, "released memory leaves the group");
    let y = b.allocate(60 * MIB, StreamId(0)).unwrap();
    assert_eq!(group.current(), b.reserved_bytes());
    let sum_of_peaks = a.stats().reserved_bytes.peak + b.stats().reserved_bytes.peak;
    assert_eq!(group.peak(), after_a, "the larger of the two moments, not their sum");
    assert!(sum_of_peaks > group.peak(), "{sum_of_peaks} is the upper bound the pools' own peaks give");
    // Both at once: the peak is their sum at that moment.
    let z = a.allocate(30 * MIB, StreamId(0)).unwrap();
    assert_eq!(group.current(), a.reserved_bytes() + b.reserved_bytes());
    group.reset_peak();
    assert_eq!(group.peak(), group.current(), "a reset starts from what is reserved now");
    a.free(&z).unwrap();
    b.free(&y).unwrap();
    drop(b);
    assert_eq!(group.current(), a.reserved_bytes(), "a dropped pool's bytes leave the group");
    drop(a);
    assert_eq!(group.current(), 0);
}

#[test]
fn a_pool_outside_any_group_changes_no_group() {
    let group = ReservedGroup::new();
    let lone = Pool::new(SimBackend::plain("sim", 1 << 30), PoolConfig::default()).unwrap();
    let block = lone.allocate(10 * MIB, StreamId(0)).unwrap();
    assert!(lone.reserved_bytes() > 0);
    assert_eq!((group.current(), group.peak()), (0, 0));
    lone.free(&block).unwrap();
}
