//! Migration through the public API: round trips between every pool present on this machine (host memory, and
//! each device's DeviceLocal, HostPinned and ReadOnly pools: PoCL and lavapipe where installed, CUDA where
//! present), odd lengths, empty buffers, read-only targets and unknown devices.

use umm::backends::{skip_or_fail, Api};
use umm::{
    AccessPattern, AllocOptions, DeviceSelector, Error, MigrateTo, MigrationPath, Placement, PoolKind, UniversalBuffer,
    UniversalMemoryManager,
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
