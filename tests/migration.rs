//! Migration through the public API: round trips between every pool present on this machine (host memory, and
//! each device's DeviceLocal, HostPinned and ReadOnly pools: PoCL and lavapipe where installed, CUDA where
//! present), odd lengths, empty buffers, read-only targets and unknown devices; and migrations that fail: a copy
//! failing on chunk k (fault injection under a test device) and a target out of memory.

use std::sync::{Arc, Mutex};
use umm::backends::testing::fault::{is_injected, FaultHandle, FaultKind, FaultyBackend};
use umm::backends::testing::skip_or_fail;
use umm::backends::{Api, HostBackend, MemoryPool, Pool};
use umm::{
    AccessPattern, AllocOptions, DeviceSelector, Error, Limit, MigrateTo, MigrationPath, Placement, PoolKind,
    UniversalBuffer, UniversalMemoryManager,
};

fn manager() -> UniversalMemoryManager {
    UniversalMemoryManager::builder().build().unwrap()
}

/// One target: a name for messages, where to migrate, and where the buffer must land.
#[derive(Debug, Clone)]
struct Target {
    name: String,
    to: MigrateTo,
    device: usize,
    kind: PoolKind,
}

/// For each accelerator API that no device of `mm` offers, prints that `test` does not cover it, or fails when
/// `UMM_REQUIRE_BACKENDS` names it: the per-device loops would otherwise pass silently over no devices.
fn report_missing_apis(mm: &UniversalMemoryManager, test: &str) {
    for api in [Api::Cuda, Api::OpenCl, Api::Wgpu] {
        let present = mm.devices().iter().any(|d| d.api_infos().iter().any(|i| i.api == api));
        if !present {
            let discovery = if mm.skipped().is_empty() { "nothing skipped".into() } else { mm.skipped().join("; ") };
            skip_or_fail(&api.to_string(), &format!("{test}: no {api} device ({discovery})"));
        }
    }
}

/// Host memory, then every (device, pool kind) that the machine's accelerators offer.
fn targets(mm: &UniversalMemoryManager) -> Vec<Target> {
    report_missing_apis(mm, "migration round trips");
    let mut out = vec![Target {
        name: "host".into(),
        to: MigrateTo::new(Placement::Auto).device(DeviceSelector::Host),
        device: 0,
        kind: PoolKind::Host,
    }];
    for device in mm.devices().iter().skip(1) {
        for kind in device.pool_kinds() {
            let placement = match kind {
                PoolKind::DeviceLocal => Placement::DeviceLocal,
                PoolKind::HostPinned => Placement::HostPinned,
                PoolKind::ReadOnly => Placement::ReadOnly,
                PoolKind::Host => continue,
            };
            out.push(Target {
                name: format!("{} {kind}", device.name()),
                to: MigrateTo::new(placement).device(DeviceSelector::Index(device.index())),
                device: device.index(),
                kind,
            });
        }
    }
    out
}

fn pattern<T: bytemuck::Pod>(n: usize, f: impl Fn(usize) -> T) -> Vec<T> {
    (0..n).map(f).collect()
}

/// Checks that `b` landed at `t`, holds `data`, and is sealed exactly when `t` is read-only.
fn check_at<T: bytemuck::Pod + PartialEq + std::fmt::Debug>(b: &mut UniversalBuffer<T>, t: &Target, data: &[T]) {
    // The host device has one pool: Host and HostPinned name the same memory there.
    let kind = if t.device == 0 && b.placement() == PoolKind::HostPinned { PoolKind::Host } else { b.placement() };
    assert_eq!((b.device().index(), kind), (t.device, t.kind), "{}: {}", t.name, b.decision().reason());
    assert_eq!(b.len(), data.len(), "{}", t.name);
    assert!(b.to_vec().unwrap() == data, "{}: contents differ after {:?}", t.name, b.migrated_via());
    if t.kind == PoolKind::ReadOnly {
        assert!(b.is_read_only(), "{}", t.name);
        let err = b.write(data).unwrap_err();
        assert!(matches!(err, Error::ReadOnly { .. }), "{}: {err}", t.name);
    }
}

/// For every ordered pair (A, B): host → A → B → A, checking contents, placement and sealing at every step.
fn round_trips<T: bytemuck::Pod + PartialEq + std::fmt::Debug>(data: &[T]) {
    let mm = manager();
    let all = targets(&mm);
    eprintln!("{} targets: {:?}", all.len(), all.iter().map(|t| &t.name).collect::<Vec<_>>());
    for a in &all {
        let mut host = mm.allocate_universal::<T>(data.len(), Placement::Auto).unwrap();
        host.write(data).unwrap();
        let mut at_a = host.migrate(&mm, a.to).unwrap();
        check_at(&mut at_a, a, data);
        for b in &all {
            let mut at_b = at_a.copy_to(&mm, b.to).unwrap();
            check_at(&mut at_b, b, data);
            let via_b = at_b.migrated_via();
            let mut back = at_b.migrate(&mm, a.to).unwrap();
            check_at(&mut back, a, data);
            if data.len() > 1 {
                eprintln!("  {} -> {}: {:?}, back: {:?}", a.name, b.name, via_b, back.migrated_via());
            }
        }
    }
    let stats = mm.global_memory_stats();
    assert_eq!(stats.total.active_blocks.current, 0, "every migrated block went back to its pool");
}

#[test]
fn round_trips_of_odd_byte_lengths_between_every_pair_of_pools() {
    round_trips(&pattern(1_000_003, |i| (i * 7 + i / 251) as u8));
    round_trips(&[0xa5u8]);
}

#[test]
fn round_trips_of_f32_between_every_pair_of_pools() {
    round_trips(&pattern(250_001, |i| i as f32 * 0.5 - 3.0));
    round_trips(&[f32::MIN_POSITIVE]);
}

#[test]
fn large_migrations_arrive_whole_across_chunk_boundaries_and_name_their_path() {
    // 20 MiB + 3 bytes: three 8 MiB chunks where the bytes go through the host, and a pattern that depends on
    // the position, so a chunk written at the wrong offset or cut short shows.
    let mm = manager();
    let data = pattern(20 * (1 << 20) + 3, |i| (i % 253) as u8);
    for t in targets(&mm) {
        let src = mm.allocate_universal_from(&data, Placement::Auto).unwrap();
        let mut moved = src.migrate(&mm, t.to).unwrap();
        let via = moved.migrated_via().expect("a migrated buffer says how it moved");
        assert_ne!(via, MigrationPath::Empty, "{}", t.name);
        eprintln!("{}: via {via}", t.name);
        check_at(&mut moved, &t, &data);
        let back = moved.migrate(&mm, DeviceSelector::Host).unwrap();
        assert!(back.to_vec().unwrap() == data, "{}", t.name);
    }
}

#[test]
fn migration_keeps_label_access_pattern_and_follows_the_decider() {
    let mm = manager();
    let options = AllocOptions::new().access(AccessPattern::HostFrequent).label("staging");
    let mut x = mm.allocate_universal_with::<u32>(4096, options).unwrap();
    x.write(&pattern(4096, |i| i as u32)).unwrap();
    let expected = mm.decide(x.size_bytes(), &AllocOptions::new().access(AccessPattern::HostFrequent)).unwrap();
    let y = x.migrate(&mm, Placement::Auto).unwrap();
    assert_eq!((y.label(), y.access_pattern(), y.len()), (Some("staging"), AccessPattern::HostFrequent, 4096));
    assert_eq!((y.device().index(), y.placement()), (expected.device, expected.pool));
    assert_eq!(y.requested_placement(), Placement::Auto);
    assert_eq!(y.to_vec().unwrap(), pattern(4096, |i| i as u32));
}

#[test]
fn empty_buffers_migrate_everywhere() {
    let mm = manager();
    for t in targets(&mm) {
        let empty = mm.allocate_universal::<f64>(0, Placement::Auto).unwrap();
        let mut moved = empty.migrate(&mm, t.to).unwrap();
        assert!(moved.is_empty() && moved.block_info().is_none(), "{}", t.name);
        let via = moved.migrated_via().unwrap();
        assert!(matches!(via, MigrationPath::Empty | MigrationPath::FilledAtAllocation), "{}: {via}", t.name);
        assert_eq!(moved.to_vec().unwrap(), Vec::<f64>::new());
        assert_eq!(moved.is_read_only(), t.kind == PoolKind::ReadOnly, "{}", t.name);
        check_at(&mut moved, &t, &[]);
    }
}

#[test]
fn a_missing_device_is_an_error_that_returns_the_buffer() {
    let mm = manager();
    let data = pattern(1000, |i| i as u16);
    let x = mm.allocate_universal_from(&data, Placement::Auto).unwrap();
    let missing = mm.devices().len() + 5;
    let err =
        x.migrate(&mm, MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Index(missing))).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err.error(), Error::Placement(_)), "{text}");
    assert!(text.contains(&missing.to_string()), "the message names the device asked for: {text}");
    eprintln!("{text}");
    let x = err.into_buffer();
    assert_eq!(x.to_vec().unwrap(), data, "the source survives a failed migration");
    // `?` into umm::Error works too (and drops the buffer).
    let as_error: Error = x.migrate(&mm, DeviceSelector::Index(missing)).unwrap_err().into();
    assert!(matches!(as_error, Error::Placement(_)));
}

#[test]
fn copy_to_keeps_the_source_and_copies_within_a_device_use_a_device_path_or_one_memcpy() {
    let mm = manager();
    let data = pattern(3 << 20, |i| (i % 249) as u8);
    report_missing_apis(&mm, "device-to-device copies");
    for device in mm.devices().iter().skip(1) {
        let on = |p: Placement| MigrateTo::new(p).device(DeviceSelector::Index(device.index()));
        let a = mm.allocate_universal_from(&data, Placement::Auto).unwrap().migrate(&mm, on(Placement::DeviceLocal));
        let a = a.unwrap();
        let b = a.copy_to(&mm, on(Placement::DeviceLocal)).unwrap();
        assert_eq!(a.to_vec().unwrap(), data, "the source is kept");
        assert_eq!(b.to_vec().unwrap(), data);
        let via = b.migrated_via().unwrap();
        eprintln!("{device}: DeviceLocal -> DeviceLocal via {via}");
        let device_paths = [
            MigrationPath::CudaDevice,
            MigrationPath::OpenClDevice,
            MigrationPath::WgpuDevice,
            MigrationPath::HostMemcpy,
        ];
        assert!(device_paths.contains(&via), "{device}: {via}");
    }
}

// ----- migrations that fail -----

const MIB: usize = 1 << 20;

/// A manager with the host (device 0) and one test device (device 1) whose pools hold their bytes in host
/// memory that is not host-addressable, so that a migration to or from it copies through the host in 8 MiB
/// chunks of `write` or `read`, under a [`FaultyBackend`]; with the fault handles of the pools it makes (the
/// test device's pools are made on first use). No accelerator API is probed: the devices are exactly these two.
fn manager_with_a_faulty_device() -> (UniversalMemoryManager, Arc<Mutex<Vec<FaultHandle>>>) {
    let handles = Arc::new(Mutex::new(Vec::new()));
    let made = Arc::clone(&handles);
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device_with_pools(1 << 30, move |name, _placement, config| {
            let (backend, faults) = FaultyBackend::new(HostBackend::new(name, 1 << 30));
            made.lock().unwrap().push(faults);
            Ok(Arc::new(Pool::new(backend.without_host_access(), config.clone())?) as Arc<dyn MemoryPool>)
        })
        .build()
        .unwrap();
    assert_eq!(mm.devices().len(), 2, "{:?}", mm.devices());
    (mm, handles)
}

const FAULTY: usize = 1;

fn to_faulty() -> MigrateTo {
    MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Index(FAULTY))
}

fn on_host() -> AllocOptions {
    AllocOptions::new().device(DeviceSelector::Host)
}

/// Bytes allocated and blocks live on each device (from the manager's statistics).
fn allocated(mm: &UniversalMemoryManager) -> Vec<(u64, u64)> {
    mm.global_memory_stats()
        .devices
        .iter()
        .map(|d| (d.total.allocated_bytes.current, d.total.active_blocks.current))
        .collect()
}

/// The one pool the test device has made so far (its DeviceLocal pool), and its fault handle.
fn faulty_pool(mm: &UniversalMemoryManager, handles: &Mutex<Vec<FaultHandle>>) -> (Arc<dyn MemoryPool>, FaultHandle) {
    let pools = mm.devices()[FAULTY].pools();
    assert_eq!(pools.len(), 1, "the test device made one pool");
    let handles = handles.lock().unwrap();
    assert_eq!(handles.len(), 1);
    (Arc::clone(&pools[0].2), handles[0].clone())
}

/// The injected copy fault that `error` reports, with the backend call it names.
fn injected_copy_call(error: &Error) -> String {
    match error {
        Error::Backend(e @ umm::backends::Error::Driver { call, .. }) if is_injected(e) => call.clone(),
        other => panic!("expected the injected copy fault, got {other:?}: {other}"),
    }
}

#[test]
fn a_migration_whose_write_of_chunk_k_fails_keeps_the_source_frees_the_target_and_names_the_write() {
    let (mm, handles) = manager_with_a_faulty_device();
    // Three chunks: 8 MiB, 8 MiB and 4 MiB + 3 bytes, with a pattern that shows a shifted or torn chunk.
    let data = pattern(20 * MIB + 3, |i| (i % 251) as u8);
    // A first migration makes the test device's pool and shows the path: chunked writes.
    let warm = mm.allocate_universal_from_with(&data, on_host()).unwrap().migrate(&mm, to_faulty()).unwrap();
    assert_eq!(warm.migrated_via(), Some(MigrationPath::HostDirect));
    assert!(warm.to_vec().unwrap() == data, "the warm-up migration arrived whole");
    drop(warm);
    let (pool, faults) = faulty_pool(&mm, &handles);
    for k in 1..=3 {
        let src = mm.allocate_universal_from_with(&data, on_host()).unwrap();
        let before = allocated(&mm);
        let copies = faults.calls(FaultKind::Copy);
        faults.fail_nth(FaultKind::Copy, copies + k);
        let err = src.migrate(&mm, to_faulty()).expect_err("the k-th write fails");
        assert_eq!(injected_copy_call(err.error()), "write", "chunk {k}: {err}");
        assert!(err.to_string().contains("injected fault") && err.to_string().contains("write"), "{err}");
        assert_eq!(faults.injected(FaultKind::Copy), k, "chunk {k}: exactly one fault per attempt fired");
        assert_eq!(faults.calls(FaultKind::Copy), copies + k, "chunk {k}: no write after the failed one");
        // Target freed, statistics back where they were.
        assert_eq!(allocated(&mm), before, "chunk {k}: allocations on each device, before and after");
        assert_eq!(pool.stats().active_blocks.current, 0, "chunk {k}: the target block went back");
        // Source intact: on the host, its bytes unchanged, and it still migrates.
        let src = err.into_buffer();
        assert_eq!(src.device().index(), 0);
        assert!(src.to_vec().unwrap() == data, "chunk {k}: the source's bytes changed");
        let moved = src.migrate(&mm, to_faulty()).unwrap();
        assert!(moved.to_vec().unwrap() == data, "chunk {k}: a later migration arrives whole");
    }
    mm.release_all_cached();
    assert_eq!(faults.resident_bytes(), 0, "the test device holds nothing once its cache is released");
    assert_eq!(faults.violations(), Vec::<String>::new());
}

#[test]
fn a_migration_whose_read_of_chunk_k_fails_keeps_the_source_readable_and_frees_the_target() {
    let (mm, handles) = manager_with_a_faulty_device();
    let data = pattern(20 * MIB + 3, |i| (i % 247) as u8);
    for k in 1..=3 {
        let src = mm.allocate_universal_from_with(&data, on_host()).unwrap().migrate(&mm, to_faulty()).unwrap();
        let (_, faults) = faulty_pool(&mm, &handles);
        let before = allocated(&mm);
        let copies = faults.calls(FaultKind::Copy);
        faults.fail_nth(FaultKind::Copy, copies + k);
        let err = src.migrate(&mm, DeviceSelector::Host).expect_err("the k-th read fails");
        assert_eq!(injected_copy_call(err.error()), "read", "chunk {k}: {err}");
        assert_eq!(faults.calls(FaultKind::Copy), copies + k, "chunk {k}: no read after the failed one");
        assert_eq!(allocated(&mm), before, "chunk {k}: the host target went back, the source stayed");
        let src = err.into_buffer();
        assert_eq!(src.device().index(), FAULTY);
        assert!(src.to_vec().unwrap() == data, "chunk {k}: the source still reads back whole");
    }
}

#[test]
fn a_migration_to_a_pool_at_its_limit_keeps_the_source_and_reports_out_of_memory() {
    let (mm, handles) = manager_with_a_faulty_device();
    let data = pattern(20 * MIB + 3, |i| (i % 241) as u8);
    // 12 MiB on the test device, then a limit of 16 MiB on its pool: the 20 MiB target cannot fit.
    let resident = mm.allocate_universal_from_with(&[7u8; 12 * MIB], on_host()).unwrap().migrate(&mm, to_faulty());
    let resident = resident.unwrap();
    let (pool, faults) = faulty_pool(&mm, &handles);
    pool.set_limit(Some(Limit::Bytes(16 << 20))).unwrap();
    let src = mm.allocate_universal_from_with(&data, on_host()).unwrap();
    let before = allocated(&mm);
    let copies = faults.calls(FaultKind::Copy);
    let err = src.migrate(&mm, to_faulty()).expect_err("the target does not fit under the limit");
    match err.error() {
        Error::Backend(e @ umm::backends::Error::OutOfMemory { limit, requested, .. }) => {
            assert_eq!(*limit, Some(16 << 20), "{e}");
            assert!(*requested >= data.len() as u64, "{e}");
            assert!(e.to_string().contains("out of memory"), "the message names the cause: {e}");
        }
        other => panic!("expected out of memory, got {other:?}: {other}"),
    }
    assert_eq!(faults.calls(FaultKind::Copy), copies, "nothing was copied");
    assert_eq!(allocated(&mm), before, "no target block is left allocated");
    assert_eq!(pool.stats().reserved_bytes.current, faults.resident_bytes());
    assert!(pool.stats().reserved_bytes.current <= 16 << 20, "the pool stayed under its limit");
    let src = err.into_buffer();
    assert!(src.to_vec().unwrap() == data, "the source's bytes are unchanged");
    assert_eq!(resident.to_vec().unwrap(), vec![7u8; 12 * MIB], "the device's other buffer is untouched");
    // The limit lifted, the same migration goes through.
    drop(resident);
    pool.set_limit(None).unwrap();
    let moved = src.migrate(&mm, to_faulty()).unwrap();
    assert!(moved.to_vec().unwrap() == data);
}

#[test]
fn a_migration_to_a_full_simulated_device_keeps_the_source_and_names_the_shortage() {
    // The public simulated device, 64 MiB, with 48 MiB taken: 20 MiB more do not fit.
    let mm =
        UniversalMemoryManager::builder().backends(false, false, false).simulated_device(64 << 20).build().unwrap();
    let sim = MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Index(1));
    let taken: Vec<UniversalBuffer<u8>> = (0..3)
        .map(|_| {
            mm.allocate_universal_with::<u8>(
                16 * MIB,
                AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1)),
            )
            .unwrap()
        })
        .collect();
    let data = pattern(20 * MIB + 3, |i| (i % 239) as u8);
    let src = mm.allocate_universal_from_with(&data, on_host()).unwrap();
    let before = allocated(&mm);
    let err = src.migrate(&mm, sim).expect_err("the device is full");
    let text = err.to_string();
    match err.error() {
        Error::Backend(e) => assert!(e.is_out_of_memory(), "{e:?}"),
        other => panic!("expected out of memory, got {other:?}: {other}"),
    }
    assert!(
        text.contains("out of memory on sim0") && text.contains("map_pages"),
        "names the device and the call: {text}"
    );
    assert_eq!(allocated(&mm), before, "no target block is left allocated");
    let src = err.into_buffer();
    assert!(src.to_vec().unwrap() == data, "the source's bytes are unchanged");
    drop(taken);
}

#[test]
fn a_selector_alone_keeps_the_placement_asked_for_and_read_only_stays_read_only() {
    let mm = UniversalMemoryManager::new().unwrap();
    let weights: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5).collect();
    let on_host = AllocOptions::new().placement(Placement::ReadOnly).device(DeviceSelector::Host);
    let src = mm.allocate_universal_from_with(&weights, on_host).unwrap();
    assert!(src.is_read_only());
    // Every device present, by index: the copy is asked for as ReadOnly there, filled once and sealed.
    for device in mm.devices() {
        let moved = src.copy_to(&mm, DeviceSelector::Index(device.index())).unwrap();
        assert_eq!(moved.requested_placement(), Placement::ReadOnly, "{}", device.name());
        assert_eq!(moved.device().index(), device.index(), "{}: {}", device.name(), moved.decision().reason());
        assert!(moved.is_read_only(), "{}: {}", device.name(), moved.decision().reason());
        assert_eq!(moved.to_vec().unwrap(), weights, "{}", device.name());
        let mut moved = moved;
        assert!(moved.write(&weights).unwrap_err().is_read_only(), "{}", device.name());
    }
    // A placement named with the selector is what is asked for: a writable copy.
    let writable = src.copy_to(&mm, MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Host)).unwrap();
    assert!(!writable.is_read_only());
    assert_eq!(writable.requested_placement(), Placement::DeviceLocal);
    // And the source moves whole, read-only still.
    let moved = src.migrate(&mm, DeviceSelector::Host).unwrap();
    assert!(moved.is_read_only() && moved.to_vec().unwrap() == weights);
}

#[test]
fn copy_from_fills_an_existing_buffer_on_every_device_from_every_other() {
    let mm = UniversalMemoryManager::new().unwrap();
    let data: Vec<u32> = (0..(3 << 18) + 5).map(|i| i ^ 0x5a5a).collect();
    let places: Vec<AllocOptions> = mm
        .devices()
        .iter()
        .filter(|d| d.kind() != umm::DeviceKind::Simulated)
        .map(|d| AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(d.index())))
        .collect();
    for from in &places {
        let src = mm.allocate_universal_from_with(&data, from.clone()).unwrap();
        for to in &places {
            let mut dst = mm.allocate_universal_with::<u32>(data.len(), to.clone()).unwrap();
            let (a, b) = (src.device().index(), dst.device().index());
            let path = dst.copy_from(&mm, &src).unwrap();
            assert_eq!(dst.to_vec().unwrap(), data, "{a} -> {b} via {path}");
            assert_eq!(dst.device().index(), b, "the target keeps its place");
        }
    }
    // Lengths must match; a read-only target takes its data at allocation only.
    let src = mm.allocate_universal_from(&data, Placement::Auto).unwrap();
    let mut short = mm.allocate_universal::<u32>(data.len() - 1, Placement::Auto).unwrap();
    let err = short.copy_from(&mm, &src).unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { op: "copy_from", .. }), "{err}");
    let mut sealed = mm.allocate_universal_from(&data, Placement::ReadOnly).unwrap();
    assert!(sealed.copy_from(&mm, &src).unwrap_err().is_read_only());
}
