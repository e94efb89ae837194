//! The manager's true peak of reserved memory across its pools (`GlobalMemoryStats::peak_reserved_at_once`) beside
//! the totals' sums of pool peaks, and its reset.

use umm::{AllocOptions, DeviceSelector, Placement, UniversalMemoryManager};

const MIB: usize = 1 << 20;

#[test]
fn the_true_peak_is_below_the_sum_of_pool_peaks_when_pools_peak_apart() {
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(4 << 30)
        .simulated_device(4 << 30)
        .build()
        .unwrap();
    let on =
        |device: usize| AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(device));
    let sims: Vec<usize> = mm.devices().iter().filter(|d| d.name().contains("sim")).map(|d| d.index()).collect();
    assert_eq!(sims.len(), 2, "{:?}", mm.devices().iter().map(|d| d.name().to_string()).collect::<Vec<_>>());
    let first = mm.allocate_universal_with::<u8>(256 * MIB, on(sims[0])).unwrap();
    drop(first);
    mm.release_all_cached();
    let second = mm.allocate_universal_with::<u8>(128 * MIB, on(sims[1])).unwrap();
    let stats = mm.global_memory_stats();
    let at_once = stats.peak_reserved_at_once;
    assert!(at_once >= 256 * MIB as u64, "{at_once}");
    assert!(
        stats.total.reserved_bytes.peak >= at_once + 128 * MIB as u64,
        "the sum of peaks adds both devices' peaks: {} against {at_once}",
        stats.total.reserved_bytes.peak
    );
    assert!(mm.memory_summary().contains("peak reserved by all pools at one moment"));
    mm.reset_peak_stats();
    let reset = mm.global_memory_stats().peak_reserved_at_once;
    assert_eq!(reset, mm.global_memory_stats().total.reserved_bytes.current, "a reset starts from now");
    drop(second);
}
