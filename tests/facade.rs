//! The facade through its public API, on host memory and simulated devices (stand-ins for GPUs).

use std::sync::Arc;
use std::time::Duration;
use umm::{
    AccessPattern, AllocOptions, DeviceSelector, Error, Limit, Placement, PoolKind, Strategy, UniversalMemoryManager,
};

const MIB: u64 = 1 << 20;

fn host_only() -> UniversalMemoryManager {
    UniversalMemoryManager::builder().backends(false, false, false).build().unwrap()
}

#[test]
fn host_round_trip_and_host_slices() {
    let mm = host_only();
    assert_eq!(mm.devices().len(), 1);
    let mut x = mm.allocate_universal::<f32>(1000, Placement::Auto).unwrap();
    assert_eq!((x.len(), x.size_bytes(), x.placement()), (1000, 4000, PoolKind::Host));
    assert!(x.decision().reason().contains("no accelerator"), "{}", x.decision().reason());
    let data: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    x.write(&data).unwrap();
    assert_eq!(x.to_vec().unwrap(), data);
    assert_eq!(x.as_slice().unwrap()[999], 999.0);
    x.as_mut_slice().unwrap()[0] = -1.0;
    let mut one = [0.0f32; 2];
    x.read_at(0, &mut one).unwrap();
    assert_eq!(one, [-1.0, 1.0]);
    x.fill(2.5).unwrap();
    assert!(x.to_vec().unwrap().iter().all(|&v| v == 2.5));
}

#[test]
fn every_explicit_placement_resolves_to_host_memory_on_a_host_only_machine() {
    let mm = host_only();
    for placement in [Placement::Auto, Placement::HostPinned, Placement::DeviceLocal, Placement::ReadOnly] {
        let d = mm.decide(1 << 20, &AllocOptions::new().placement(placement)).unwrap();
        assert_eq!(d.device, 0, "{placement}: {}", d.reason());
        assert!(matches!(d.pool, PoolKind::Host | PoolKind::HostPinned), "{placement}: {}", d.reason());
        assert!(d.reason().contains("host"), "{}", d.reason());
    }
}

#[test]
fn empty_buffers_work_and_overflow_is_an_error() {
    let mm = host_only();
    let mut empty = mm.allocate_universal::<u64>(0, Placement::Auto).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.to_vec().unwrap(), Vec::<u64>::new());
    empty.write(&[]).unwrap();
    assert_eq!(empty.as_slice().unwrap().len(), 0);
    let err = mm.allocate_universal::<u64>(usize::MAX, Placement::Auto).unwrap_err();
    assert!(matches!(err, Error::SizeOverflow { elem_size: 8, .. }), "{err}");
    assert!(err.to_string().contains("u64"), "{err}");
}

#[test]
fn length_mismatches_are_errors() {
    let mm = host_only();
    let mut x = mm.allocate_universal::<u32>(10, Placement::Auto).unwrap();
    let err = x.write(&[1, 2, 3]).unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { op: "write", buffer_len: 10, given_len: 3 }), "{err}");
    assert!(err.to_string().contains("write_at"), "points to the partial form: {err}");
    let mut out = vec![0u32; 11];
    assert!(matches!(x.read(&mut out), Err(Error::LengthMismatch { op: "read", buffer_len: 10, given_len: 11 })));
    x.write_at(7, &[1, 2, 3]).unwrap();
}

#[test]
fn ranges_past_the_end_state_the_length_the_offset_and_the_count() {
    let mm = host_only();
    let mut x = mm.allocate_universal::<u8>(1000, Placement::Auto).unwrap();
    let err = x.write_at(1000, &[7]).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { op: "write_at", len: 1000, offset: 1000, count: 1 }), "{err}");
    let text = err.to_string();
    assert!(text.contains("1 element(s) at offset 1000") && text.contains("buffer of 1000 elements"), "{text}");
    assert!(!text.contains("holds 0"), "{text}");
    let err = x.write_at(998, &[1, 2, 3]).unwrap_err();
    assert!(err.to_string().contains("at most 2 fit from that offset"), "{err}");
    let mut out = [0u8; 4];
    let err = x.read_at(usize::MAX, &mut out).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { op: "read_at", len: 1000, offset: usize::MAX, count: 4 }), "{err}");
    assert!(err.to_string().contains("past the end"), "{err}");
    let err = x.write_at(1001, &[]).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { op: "write_at", offset: 1001, count: 0, .. }), "{err}");
    x.write_at(1000, &[]).unwrap();
    x.read_at(996, &mut out).unwrap();
}

#[test]
fn read_only_buffers_refuse_writes_after_their_fill() {
    let mm = host_only();
    let data = [1u16, 2, 3, 4];
    let mut w = mm.allocate_universal_from(&data, Placement::ReadOnly).unwrap();
    assert!(w.is_read_only());
    assert_eq!(w.to_vec().unwrap(), data);
    let err = w.write(&[9, 9, 9, 9]).unwrap_err();
    assert!(matches!(err, Error::ReadOnly { .. }), "{err}");
    assert!(matches!(w.fill(0), Err(Error::ReadOnly { .. })));
    assert!(w.as_mut_slice().is_none());
    assert_eq!(w.to_vec().unwrap(), data, "nothing changed");
}

#[test]
fn zeroed_allocation_reads_zero_after_dirty_reuse() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).build().unwrap();
    for round in 0..3 {
        let mut dirty = mm.allocate_universal::<u8>(4096, Placement::Auto).unwrap();
        dirty.fill(0xAB).unwrap();
        let dirty_at = block_identity(&dirty);
        drop(dirty);
        // Same size and placement, so the pool hands back the block just freed: the zeroing is what cleans it.
        let clean = mm.allocate_universal_with::<u8>(4096, AllocOptions::new().zeroed(true)).unwrap();
        assert_eq!(block_identity(&clean), dirty_at, "round {round}: the zeroed buffer got the dirty buffer's block");
        assert!(clean.to_vec().unwrap().iter().all(|&b| b == 0), "round {round}: a reused dirty block reads zero");
    }
}

/// Where a buffer's block lies in its pool (key, offset, segment): equal for two buffers means the later one
/// reuses the earlier one's memory.
fn block_identity<T: bytemuck::Pod>(buffer: &umm::UniversalBuffer<T>) -> (u64, u64, u32) {
    let block = buffer.block_info().expect("a non-empty buffer has a block");
    (block.key, block.offset, block.segment)
}

/// Pooled buffers, reused after being dirtied, compute exactly what fresh memory computes. The kernel accumulates
/// into its output (`c += a * b`), so a reused output block that was not really zeroed would change the result.
#[test]
fn pooled_and_direct_buffers_compute_bit_identical_results() {
    fn matmul_accumulate(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] += (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
            }
        }
    }
    let (m, k, n) = (37, 41, 29);
    let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 999.0 - 0.5).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i * 104729) % 1000) as f32 / 997.0 - 0.5).collect();
    let mut reference = vec![0.0; m * n];
    matmul_accumulate(&a, &b, &mut reference, m, k, n);
    let poison = f32::from_ne_bytes([umm::backends::pool::POISON_BYTE; 4]);
    for strategy in [Strategy::Pooled, Strategy::Direct] {
        let mm = UniversalMemoryManager::builder()
            .backends(false, false, false)
            .strategy(strategy)
            .poison_on_free(true)
            .build()
            .unwrap();
        for round in 0..5 {
            // Dirty the pool first so the next blocks are reused ones at shifted offsets.
            for s in 1..6 {
                let mut junk = mm.allocate_universal::<f32>(s * 97 + round, Placement::Auto).unwrap();
                junk.fill(f32::NAN).unwrap();
            }
            let _pad = mm.allocate_universal::<u8>(13 + round, Placement::Auto).unwrap();
            let ab = mm.allocate_universal_from(&a, Placement::Auto).unwrap();
            let bb = mm.allocate_universal_from(&b, Placement::Auto).unwrap();
            // A dirty block of exactly the output's size, freed (and poisoned) right before the output is taken.
            let mut dirty = mm.allocate_universal::<f32>(m * n, Placement::Auto).unwrap();
            dirty.fill(f32::NAN).unwrap();
            let dirty_at = block_identity(&dirty);
            drop(dirty);
            if strategy == Strategy::Pooled {
                // Control: without zeroing, the reused block still holds the poison that accumulation would add.
                let stale = mm.allocate_universal::<f32>(m * n, Placement::Auto).unwrap();
                assert_eq!(block_identity(&stale), dirty_at, "round {round}: the pool reuses the freed block");
                assert!(
                    stale.to_vec().unwrap().iter().all(|v| v.to_bits() == poison.to_bits()),
                    "round {round}: a reused block that is not zeroed holds the poison"
                );
            }
            let mut cb = mm.allocate_universal_with::<f32>(m * n, AllocOptions::new().zeroed(true)).unwrap();
            if strategy == Strategy::Pooled {
                assert_eq!(block_identity(&cb), dirty_at, "round {round}: the zeroed output reuses the dirty block");
            }
            matmul_accumulate(ab.as_slice().unwrap(), bb.as_slice().unwrap(), cb.as_mut_slice().unwrap(), m, k, n);
            let got = cb.to_vec().unwrap();
            assert!(got.iter().zip(&reference).all(|(x, y)| x.to_bits() == y.to_bits()), "{strategy} round {round}");
        }
    }
}

#[test]
fn a_limit_below_the_request_is_out_of_memory_with_numbers() {
    let mm =
        UniversalMemoryManager::builder().backends(false, false, false).limit(Limit::Bytes(8 * MIB)).build().unwrap();
    let err = mm.allocate_universal::<u8>(16 << 20, Placement::Auto).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("out of memory") && text.contains("16777216") && text.contains("8388608"), "{text}");
    assert!(mm.global_memory_stats().total.num_ooms == 1);
}

#[test]
fn error_predicates_classify_without_matching_nested_variants() {
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(1 << 30)
        .limit(Limit::Bytes(8 * MIB))
        .build()
        .unwrap();
    let oom = mm.allocate_universal::<u8>(16 << 20, Placement::Auto).unwrap_err();
    assert!(oom.is_out_of_memory() && !oom.is_too_large() && !oom.is_invalid_config(), "{oom}");
    assert!(oom.as_backend().is_some());
    let on_sim = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1));
    let too_large = mm.allocate_universal_with::<u8>(2 << 30, on_sim).unwrap_err();
    assert!(too_large.is_too_large() && !too_large.is_out_of_memory(), "{too_large}");

    let mut x = mm.allocate_universal::<u8>(10, Placement::Auto).unwrap();
    let range = x.write_at(10, &[1]).unwrap_err();
    let length = x.write(&[1]).unwrap_err();
    assert!(range.is_out_of_bounds() && length.is_out_of_bounds() && !range.is_out_of_memory(), "{range} {length}");
    let read_only = AllocOptions::new().placement(Placement::ReadOnly);
    let mut sealed = mm.allocate_universal_from_with(&[1u8], read_only.clone().device(DeviceSelector::Host)).unwrap();
    assert!(sealed.write(&[2]).unwrap_err().is_read_only());
    // The simulated device keeps its bytes: a read-only buffer filled there reads them back.
    let on_sim_read_only = read_only.device(DeviceSelector::Index(1));
    let filled = mm.allocate_universal_from_with(&[1u8], on_sim_read_only).unwrap();
    assert_eq!(filled.to_vec().unwrap(), [1]);

    let no_device = mm.allocate_universal_with::<u8>(10, AllocOptions::new().device(DeviceSelector::Index(9)));
    assert!(no_device.unwrap_err().is_no_device());

    let thresholds = UniversalMemoryManager::builder().backends(false, false, false).thresholds(1 << 20, 1 << 10);
    let err = thresholds.build().unwrap_err();
    assert!(err.is_invalid_config() && !err.is_out_of_memory(), "{err}");
    let err = UniversalMemoryManager::builder().simulated_device(0).build().unwrap_err();
    assert!(err.is_invalid_config(), "{err}");
    let mut config = umm::UmmConfig::default();
    let err = config.apply_vars(|k| (k == "UMM_STRATEGY").then(|| "hoard".to_string())).unwrap_err();
    assert!(err.is_invalid_config() && matches!(err, Error::InvalidEnv { .. }), "{err}");

    // A block freed twice, through a pool driven directly.
    let pool = umm::backends::Pool::new(umm::backends::HostBackend::new("host", 1 << 30), Default::default()).unwrap();
    let block = pool.allocate(4096, umm::StreamId(0)).unwrap();
    pool.free(&block).unwrap();
    let twice = Error::from(pool.free(&block).unwrap_err());
    assert!(twice.is_unknown_block() && !twice.is_out_of_memory(), "{twice}");
}

#[test]
fn a_simulated_device_of_zero_bytes_is_refused() {
    let err = UniversalMemoryManager::builder().backends(false, false, false).simulated_device(0).build().unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)) && err.to_string().contains("above zero"), "{err}");
}

fn with_sims(capacities: &[u64]) -> UniversalMemoryManager {
    let mut b = UniversalMemoryManager::builder().backends(false, false, false);
    for &c in capacities {
        b = b.simulated_device(c);
    }
    b.build().unwrap()
}

#[test]
fn auto_places_medium_buffers_on_an_accelerator_and_small_ones_pinned() {
    let mm = with_sims(&[8 << 30]);
    let medium = mm.allocate_universal::<u8>(4 << 20, Placement::Auto).unwrap();
    assert_eq!((medium.device().index(), medium.placement()), (1, PoolKind::DeviceLocal));
    let small = mm.decide(1024, &AllocOptions::new()).unwrap();
    assert_eq!(small.pool, PoolKind::HostPinned, "{}", small.reason());
    let ro = mm.decide(4 << 20, &AllocOptions::new().access(AccessPattern::ReadOnly)).unwrap();
    assert_eq!(ro.pool, PoolKind::ReadOnly);
}

#[test]
fn a_larger_page_size_maps_device_memory_in_whole_pages() {
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(8 << 30)
        .page_size(8 << 20)
        .build()
        .unwrap();
    let buffer =
        mm.allocate_universal_with::<u8>(20 << 20, AllocOptions::new().placement(Placement::DeviceLocal)).unwrap();
    assert_eq!(buffer.device().index(), 1);
    let reserved = mm.global_memory_stats().devices[1].total.reserved_bytes.current;
    assert!(reserved >= 20 << 20 && reserved.is_multiple_of(8 << 20), "{reserved} bytes reserved");

    let err = UniversalMemoryManager::builder().backends(false, false, false).page_size(3 << 20).build().unwrap_err();
    assert!(err.to_string().contains("page_size"), "{err}");
}

/// `segment_mode: virtual` (`UMM_SEGMENT_MODE=virtual`) means virtual reservations where the device has them:
/// host memory keeps plain segments and serves every placement, and a device with virtual memory reserves.
#[test]
fn virtual_segments_are_used_where_the_device_has_them_and_host_memory_still_serves() {
    let mut config = umm::UmmConfig::default();
    config.pool.segment_mode = umm::SegmentMode::Virtual;
    let mm = UniversalMemoryManager::builder()
        .config(config)
        .backends(false, false, false)
        .simulated_device(8 << 30)
        .build()
        .unwrap();
    for placement in [Placement::HostPinned, Placement::Auto] {
        let on_host = mm
            .allocate_universal_with::<u8>(
                4 << 20,
                AllocOptions::new().placement(placement).device(DeviceSelector::Host),
            )
            .unwrap_or_else(|e| panic!("{placement:?} on the host: {e}"));
        assert_eq!(on_host.device().index(), 0);
    }
    let device =
        mm.allocate_universal_with::<u8>(20 << 20, AllocOptions::new().placement(Placement::DeviceLocal)).unwrap();
    assert_eq!(device.device().index(), 1);
    let snapshot = mm.snapshot();
    let on_device = snapshot.pools.iter().filter(|p| p.device == 1);
    let reservation = on_device.flat_map(|p| &p.segments).any(|s| s.virtual_reservation);
    assert!(reservation, "the simulated device's large block lives in a reservation");
}

#[test]
fn auto_avoids_a_device_under_pressure() {
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(1 << 30)
        .simulated_device(1 << 30)
        .pressure_threshold(0.5)
        .build()
        .unwrap();
    // Fill device 1 past half its memory.
    let hog =
        mm.allocate_universal_with::<u8>(600 << 20, AllocOptions::new().device(DeviceSelector::Index(1))).unwrap();
    assert_eq!(hog.device().index(), 1);
    let next = mm.allocate_universal::<u8>(4 << 20, Placement::Auto).unwrap();
    assert_eq!(next.device().index(), 2, "{}", next.decision().reason());
    let _hog2 =
        mm.allocate_universal_with::<u8>(600 << 20, AllocOptions::new().device(DeviceSelector::Index(2))).unwrap();
    let last = mm.allocate_universal::<u8>(4 << 20, Placement::Auto).unwrap();
    assert_eq!(last.device().index(), 0, "every accelerator is under pressure: {}", last.decision().reason());
}

#[test]
fn selector_errors_name_what_exists() {
    let mm = with_sims(&[1 << 30]);
    let err = mm.allocate_universal_with::<u8>(100, AllocOptions::new().device(DeviceSelector::Index(7))).unwrap_err();
    let text = err.to_string();
    assert!(text.contains('7') && text.contains("sim0"), "{text}");
    let err = mm
        .allocate_universal_with::<u8>(100, AllocOptions::new().device(DeviceSelector::Api(umm::Api::Cuda)))
        .unwrap_err();
    assert!(err.to_string().contains("cuda"), "{err}");
}

#[test]
fn recommendations_follow_observed_use() {
    let mm = host_only();
    let before = mm.placement_recommendations();
    let medium = before.items.iter().find(|r| r.subject == umm::Subject::MediumBuffers).unwrap();
    assert_eq!(medium.placement, Placement::DeviceLocal);
    assert!(!medium.from_evidence);
    for _ in 0..32 {
        let mut x = mm.allocate_universal::<f32>(1 << 16, Placement::Auto).unwrap();
        x.fill(1.0).unwrap();
        for _ in 0..4 {
            let _ = x.to_vec().unwrap();
        }
    }
    let after = mm.placement_recommendations();
    let medium = after.items.iter().find(|r| r.subject == umm::Subject::MediumBuffers).unwrap();
    assert_eq!(medium.placement, Placement::HostPinned, "{}", medium.reason);
    assert!(medium.from_evidence && medium.evidence.host_reads >= 100, "{:?}", medium.evidence);
}

#[test]
fn periodic_cleanup_releases_idle_segments_while_threads_allocate() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    // Without the segment slack, which would let the workers' new segments replace the idle one: only the
    // cleaner may release it here.
    let mut config = umm::UmmConfig::default();
    config.pool.segment_slack = None;
    let mm = Arc::new(UniversalMemoryManager::builder().config(config).backends(false, false, false).build().unwrap());
    {
        // A large cached segment that nobody uses again.
        let _big = mm.allocate_universal::<u8>(64 << 20, Placement::Auto).unwrap();
    }
    let reserved_before = mm.global_memory_stats().total.reserved_bytes.current;
    assert!(reserved_before >= 64 << 20);
    let stop = Arc::new(AtomicBool::new(false));
    let buffers = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let (mm, stop, buffers) = (Arc::clone(&mm), Arc::clone(&stop), Arc::clone(&buffers));
            std::thread::spawn(move || {
                let mut i = 0usize;
                while !stop.load(Ordering::Acquire) {
                    let mut x = mm.allocate_universal::<u32>(1 + (i * 31 + t) % 5000, Placement::Auto).unwrap();
                    x.fill(i as u32).unwrap();
                    assert!(x.to_vec().unwrap().iter().all(|&v| v == i as u32));
                    buffers.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    // The workers are allocating before the cleaner starts, and keep on until it has released the segment.
    while buffers.load(Ordering::Relaxed) < 100 {
        std::thread::yield_now();
    }
    let guard = mm.start_periodic_cleanup(Duration::from_millis(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let released = loop {
        let reserved = mm.global_memory_stats().total.reserved_bytes.current;
        if reserved < 64 << 20 {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        std::thread::yield_now();
    };
    let during = buffers.load(Ordering::Relaxed);
    assert!(workers.iter().all(|w| !w.is_finished()), "both workers were still allocating");
    stop.store(true, Ordering::Release);
    for w in workers {
        w.join().unwrap();
    }
    let rounds = guard.stop();
    assert!(released, "the idle 64 MiB segment was released while {during} buffers were allocated");
    assert!(rounds >= 1, "the cleaner released it ({rounds} rounds)");
    assert_eq!(mm.global_memory_stats().total.allocated_bytes.current, 0);
}

#[test]
fn a_zero_cleanup_interval_is_raised_to_the_minimum_instead_of_spinning() {
    let mm = host_only();
    let start = std::time::Instant::now();
    let guard = mm.start_periodic_cleanup(Duration::ZERO);
    assert_eq!(guard.interval(), umm::CleanupGuard::MIN_INTERVAL);
    assert_eq!(umm::CleanupGuard::MIN_INTERVAL, Duration::from_millis(1), "the documented minimum");
    // Wait for 20 rounds by watching the count, not the clock.
    let deadline = start + Duration::from_secs(60);
    while guard.rounds() < 20 {
        assert!(std::time::Instant::now() < deadline, "{} rounds in 60 s", guard.rounds());
        std::thread::yield_now();
    }
    let rounds = guard.stop();
    let elapsed = start.elapsed();
    // Each round waits at least the minimum interval first: rounds back to back would have run thousands by now.
    assert!(rounds >= 20, "stop returns the rounds run, at least those seen: {rounds}");
    assert!(elapsed >= umm::CleanupGuard::MIN_INTERVAL * rounds as u32, "{rounds} rounds in {elapsed:?}");
    let guard = mm.start_periodic_cleanup(Duration::from_millis(7));
    assert_eq!(guard.interval(), Duration::from_millis(7), "longer intervals are kept");
}

#[test]
fn stats_serialise_and_cleanup_reports_per_device() {
    let mm = with_sims(&[1 << 30]);
    let a = mm.allocate_universal::<u8>(4 << 20, Placement::Auto).unwrap();
    let json = serde_json::to_value(mm.global_memory_stats()).unwrap();
    assert_eq!(json["devices"][1]["total"]["allocated_bytes"]["current"], 4 << 20);
    drop(a);
    let report = mm.release_all_cached();
    assert_eq!(report.devices.len(), 2);
    assert!(report.devices[1].bytes_released >= 4 << 20, "{report:?}");
    assert_eq!(mm.global_memory_stats().total.reserved_bytes.current, 0);
}

#[test]
fn the_manager_is_shared_across_threads() {
    let mm = Arc::new(host_only());
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let mm = Arc::clone(&mm);
            std::thread::spawn(move || {
                let mut bufs = Vec::new();
                for i in 0..500 {
                    let mut b = mm.allocate_universal::<u64>(17 + i % 300, Placement::Auto).unwrap();
                    b.fill((t * 1000 + i) as u64).unwrap();
                    bufs.push((b, (t * 1000 + i) as u64));
                }
                for (b, v) in bufs {
                    assert!(b.to_vec().unwrap().iter().all(|&x| x == v));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(mm.global_memory_stats().total.allocated_bytes.current, 0);
}

#[test]
fn explicit_placements_without_a_selector_land_on_the_current_device_or_host_memory() {
    // Whatever this machine has (CI: PoCL and lavapipe, software devices; a GPU machine: its GPU), every explicit
    // placement without a selector lands on the current device, or in host memory where there is none, and twice
    // in a row on the same device and pool.
    let mm = UniversalMemoryManager::new().unwrap();
    let current = mm.current_device();
    if let Some(index) = current {
        let device = mm.devices().iter().find(|d| d.index() == index).unwrap();
        assert!(!matches!(device.kind(), umm::DeviceKind::Cpu | umm::DeviceKind::Host), "{}", device.name());
    }
    for placement in [Placement::DeviceLocal, Placement::ReadOnly, Placement::HostPinned] {
        let first = mm.decide(32 * MIB, &AllocOptions::new().placement(placement)).unwrap();
        let second = mm.decide(MIB, &AllocOptions::new().placement(placement)).unwrap();
        assert_eq!((first.device, first.pool), (second.device, second.pool), "{placement}");
        // A current device without a host-addressable pinned pool (a GPU seen only through wgpu) leaves HostPinned
        // to host memory.
        let served_by_current = current.filter(|&index| {
            let kinds = mm.devices().iter().find(|d| d.index() == index).unwrap().pool_kinds();
            placement != Placement::HostPinned || kinds.contains(&PoolKind::HostPinned)
        });
        match served_by_current {
            Some(index) => {
                assert_eq!(first.device, index, "{placement}: {}", first.reason());
                assert!(first.reason().contains("is the current device"), "{}", first.reason());
            }
            None => {
                let host = mm.devices().iter().find(|d| d.kind() == umm::DeviceKind::Host).unwrap();
                assert_eq!(first.device, host.index(), "{placement}: {}", first.reason());
                assert!(matches!(first.pool, PoolKind::Host | PoolKind::HostPinned), "{}", first.reason());
            }
        }
    }
}

#[test]
fn host_pinned_memory_is_host_addressable_wherever_it_is_served() {
    // Every device this machine has (CI: PoCL and lavapipe), asked for pinned memory by index, by API and with no
    // selector: a buffer the host can read in place, or an error that says why, never memory only copies reach.
    let mm = UniversalMemoryManager::new().unwrap();
    let mut selectors = vec![DeviceSelector::Any];
    selectors.extend(mm.devices().iter().map(|d| DeviceSelector::Index(d.index())));
    selectors.extend([umm::Api::Cuda, umm::Api::OpenCl, umm::Api::Wgpu].map(DeviceSelector::Api));
    for selector in selectors {
        let options = AllocOptions::new().placement(Placement::HostPinned).device(selector);
        match mm.allocate_universal_with::<u32>(1 << 18, options) {
            Ok(mut buffer) => {
                let reason = buffer.decision().reason();
                let slice = buffer.host_slice_mut().unwrap_or_else(|e| panic!("{selector:?}: {e} ({reason})"));
                slice.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32);
                assert_eq!(buffer.to_vec().unwrap()[1 << 17], 1 << 17, "{selector:?}: written in place");
            }
            // No device there, none offering pinned memory, or (an API of a device whose pinned pool comes through
            // another API) none through the API named.
            Err(e) => assert!(
                e.is_no_device() || matches!(&e, Error::InvalidConfig(m) if m.contains("offers no host_pinned pool")),
                "{selector:?}: a refusal says why, not {e}"
            ),
        }
    }
    // A device seen only through wgpu offers no pinned pool: wgpu never lends the host an address.
    for device in mm.devices() {
        let apis: Vec<_> = device.api_infos().iter().map(|i| i.api).collect();
        if apis == [umm::Api::Wgpu] {
            assert!(!device.pool_kinds().contains(&PoolKind::HostPinned), "{}", device.name());
            let asked =
                AllocOptions::new().placement(Placement::HostPinned).device(DeviceSelector::Index(device.index()));
            let err = mm.allocate_universal_with::<u32>(1024, asked).unwrap_err();
            assert!(err.to_string().contains("host_pinned"), "{err}");
        }
    }
}

#[test]
fn the_current_device_is_the_largest_gpu_until_set_and_a_missing_one_is_refused() {
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(1 << 30)
        .simulated_device(2 << 30)
        .build()
        .unwrap();
    assert_eq!(mm.current_device(), Some(2), "the larger simulated device");
    let local = AllocOptions::new().placement(Placement::DeviceLocal);
    assert_eq!(mm.allocate_universal_with::<u8>(MIB as usize, local.clone()).unwrap().device().index(), 2);
    mm.set_current_device(Some(1)).unwrap();
    assert_eq!(mm.current_device(), Some(1));
    // The switch reaches placements threads remembered for the old device.
    assert_eq!(mm.allocate_universal_with::<u8>(MIB as usize, local.clone()).unwrap().device().index(), 1);
    let err = mm.set_current_device(Some(7)).unwrap_err();
    assert!(err.is_no_device() && err.to_string().contains("device index 7"), "{err}");
    assert_eq!(mm.current_device(), Some(1), "a refused index changes nothing");
    // None: the decider chooses (the most free memory), as before there was a current device.
    mm.set_current_device(None).unwrap();
    assert_eq!(mm.current_device(), None);
    let d = mm.decide(MIB, &local).unwrap();
    assert_eq!(d.device, 2, "{}", d.reason());
    assert!(!d.reason().contains("current device"), "{}", d.reason());
    // The host as the current device: explicit placements go to host memory.
    mm.set_current_device(Some(0)).unwrap();
    assert_eq!(mm.decide(MIB, &local).unwrap().device, 2, "the host offers no device-local pool: the decider chooses");
}

#[test]
fn a_memory_summary_lists_every_pool_and_peaks_reset_to_current() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).simulated_device(1 << 30).build().unwrap();
    let local = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1));
    let big = mm.allocate_universal_with::<u8>(24 * MIB as usize, local.clone()).unwrap();
    let host = mm.allocate_universal::<u8>(4096, Placement::Auto).unwrap();
    drop(big);
    let summary = mm.memory_summary();
    let lines: Vec<&str> = summary.lines().collect();
    assert!(lines[0].starts_with("device / pool") && lines[0].contains("reserved"), "{summary}");
    assert!(lines.iter().any(|l| l.contains("[1] sim") && l.contains("device_local")), "{summary}");
    assert!(lines.iter().any(|l| l.starts_with("[0] host")), "{summary}");
    let total = lines.iter().find(|l| l.starts_with("total (sum)*")).expect("a total row");
    assert!(total.contains("24.00 MiB"), "the peak of allocated memory: {summary}");
    assert!(summary.contains("an upper bound"), "{summary}");

    let before = mm.global_memory_stats().total;
    assert!(before.allocated_bytes.peak >= 24 * MIB);
    mm.reset_peak_stats();
    let after = mm.global_memory_stats().total;
    assert_eq!(after.allocated_bytes.peak, after.allocated_bytes.current, "{after:?}");
    assert!(after.allocated_bytes.peak < 24 * MIB, "{after:?}");
    assert_eq!(after.reserved_bytes.peak, after.reserved_bytes.current, "{after:?}");
    drop(host);
}

#[test]
fn out_of_memory_says_its_sizes_in_units_and_in_bytes() {
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(1 << 30)
        .limit(Limit::Bytes(8 * MIB))
        .build()
        .unwrap();
    let local = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1));
    let text = mm.allocate_universal_with::<u8>(16 * MIB as usize, local).unwrap_err().to_string();
    assert!(text.contains("asked for 16.00 MiB (16777216 bytes)"), "{text}");
    assert!(text.contains("limit 8.00 MiB (8388608 bytes)"), "{text}");
}

#[test]
fn host_slices_say_why_when_the_host_cannot_address_a_buffer() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).simulated_device(1 << 30).build().unwrap();
    let mut host = mm.allocate_universal_with::<u32>(64, AllocOptions::new().device(DeviceSelector::Host)).unwrap();
    host.host_slice_mut().unwrap()[3] = 7;
    assert_eq!(host.host_slice().unwrap()[3], 7);
    let on_sim = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1)).label("acts");
    let mut sim = mm.allocate_universal_with::<u32>(64, on_sim).unwrap();
    assert!(sim.as_slice().is_none());
    let err = sim.host_slice().unwrap_err();
    assert!(err.is_not_host_addressable(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("\"acts\"") && text.contains("device_local") && text.contains("only through copies"),
        "{text}"
    );
    assert!(text.contains("to_vec()"), "{text}");
    assert!(sim.host_slice_mut().unwrap_err().is_not_host_addressable());
    // A sealed read-only buffer: the refusal says read-only, wherever it lives.
    let mut sealed = mm
        .allocate_universal_from_with(
            &[1u32, 2],
            AllocOptions::new().placement(Placement::ReadOnly).device(DeviceSelector::Host),
        )
        .unwrap();
    assert_eq!(sealed.host_slice().unwrap(), &[1, 2]);
    assert!(sealed.host_slice_mut().unwrap_err().is_read_only());
}

#[test]
fn device_addresses_name_device_memory_and_only_it() {
    let mm = with_sims(&[1 << 30]);
    let on_device = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1));
    let a = mm.allocate_universal_with::<f32>(1 << 20, on_device.clone()).unwrap();
    let b = mm.allocate_universal_with::<f32>(1 << 20, on_device.clone()).unwrap();
    let (at_a, at_b) = (a.device_address().unwrap(), b.device_address().unwrap());
    assert!(at_a + a.size_bytes() <= at_b || at_b + b.size_bytes() <= at_a, "{at_a:#x} and {at_b:#x} overlap");
    // The block's address is its segment's plus its offset: a buffer made where one was freed gets its address.
    drop(a);
    let c = mm.allocate_universal_with::<f32>(1 << 20, on_device.clone()).unwrap();
    assert_eq!(c.device_address(), Some(at_a));
    let on_host = mm.allocate_universal_with::<f32>(16, AllocOptions::new().device(DeviceSelector::Host)).unwrap();
    assert_eq!(on_host.device_address(), None, "host memory has no device address");
    let empty = mm.allocate_universal_with::<f32>(0, on_device).unwrap();
    assert_eq!(empty.device_address(), None);
}
