//! The decision table, row by row, and its fallbacks and errors.

mod common;

use common::*;
use strum::IntoEnumIterator;
use umm_placement::{
    AccessPattern, Api, Decider, DecisionConfig, DeviceSelector, DeviceView, Error, Placement, PoolKind, Request,
    SizeClass, Spread, Thresholds,
};

const SMALL: u64 = 4 * KIB;
const MEDIUM: u64 = MIB;
const LARGE: u64 = 64 * MIB;

fn decide(req: Request, devices: &[DeviceView]) -> umm_placement::Decision {
    Decider::default().decide(&req, devices, None).expect("decision")
}

fn auto(bytes: u64, access: AccessPattern) -> Request {
    Request::new(bytes).access(access)
}

#[test]
fn auto_table_rows_on_a_discrete_gpu() {
    use AccessPattern as A;
    use PoolKind::{DeviceLocal as DL, HostPinned as HP, ReadOnly as RO};
    let rows = [
        (A::ReadOnly, [RO, RO, RO]),
        (A::HostFrequent, [HP, HP, HP]),
        (A::Sequential, [HP, DL, DL]),
        (A::WriteOnly, [HP, DL, DL]),
        (A::Unknown, [HP, DL, DL]),
        (A::ReadWrite, [HP, DL, DL]),
        (A::Random, [HP, DL, DL]),
    ];
    assert_eq!(rows.len(), AccessPattern::iter().count());
    for (access, pools) in rows {
        for (bytes, pool) in [SMALL, MEDIUM, LARGE].into_iter().zip(pools) {
            let d = decide(auto(bytes, access), &machine());
            assert_eq!((d.device, d.pool), (1, pool), "{access} {bytes}: {}", d.reason());
        }
    }
}

#[test]
fn auto_table_switches() {
    let streams = Decider::new(DecisionConfig { large_streams_to_pinned: true, ..DecisionConfig::default() }).unwrap();
    for access in [AccessPattern::Sequential, AccessPattern::WriteOnly] {
        let d = streams.decide(&auto(LARGE, access), &machine(), None).unwrap();
        assert_eq!(d.pool, PoolKind::HostPinned);
        assert!(d.reason().contains("large_streams_to_pinned is on"), "{}", d.reason());
        // Medium streams are unaffected.
        let d = streams.decide(&auto(MEDIUM, access), &machine(), None).unwrap();
        assert_eq!(d.pool, PoolKind::DeviceLocal);
    }
    let d = streams.decide(&auto(LARGE, AccessPattern::Random), &machine(), None).unwrap();
    assert_eq!(d.pool, PoolKind::DeviceLocal);

    let no_big_pins =
        Decider::new(DecisionConfig { large_host_frequent_to_pinned: false, ..DecisionConfig::default() }).unwrap();
    let d = no_big_pins.decide(&auto(LARGE, AccessPattern::HostFrequent), &machine(), None).unwrap();
    assert_eq!(d.pool, PoolKind::DeviceLocal);
    assert!(d.reason().contains("large_host_frequent_to_pinned is off"), "{}", d.reason());
    let d = no_big_pins.decide(&auto(MEDIUM, AccessPattern::HostFrequent), &machine(), None).unwrap();
    assert_eq!(d.pool, PoolKind::HostPinned);
}

#[test]
fn reasons_name_size_class_thresholds_and_fact() {
    let d = decide(auto(MEDIUM, AccessPattern::ReadWrite), &machine());
    assert_eq!(d.size_class, SizeClass::Medium);
    for needle in [
        "Medium buffer of 1 MiB",
        "small <= 64 KiB < medium <= 16 MiB",
        "placement auto: the table says medium buffers go to device-local memory",
        "device 1 (gpu1)",
        "70 GiB free of 80 GiB",
    ] {
        assert!(d.reason().contains(needle), "missing {needle:?} in {}", d.reason());
    }
    assert!(d.reason().ends_with('.'));
    let custom =
        Decider::new(DecisionConfig { thresholds: Thresholds::new(512, 4096).unwrap(), ..DecisionConfig::default() })
            .unwrap();
    let d = custom.decide(&Request::new(8192), &machine(), None).unwrap();
    assert_eq!(d.size_class, SizeClass::Large);
    assert!(d.reason().contains("small <= 512 B < medium <= 4 KiB < large"), "{}", d.reason());
}

#[test]
fn explicit_placements_are_honoured() {
    for (placement, pool) in [
        (Placement::HostPinned, PoolKind::HostPinned),
        (Placement::DeviceLocal, PoolKind::DeviceLocal),
        (Placement::ReadOnly, PoolKind::ReadOnly),
    ] {
        // Small and large alike: the table does not override an explicit choice.
        for bytes in [SMALL, LARGE] {
            let d = decide(Request::new(bytes).placement(placement).access(AccessPattern::HostFrequent), &machine());
            assert_eq!((d.device, d.pool), (1, pool), "{placement}: {}", d.reason());
            assert!(d.reason().contains("was asked for explicitly"), "{}", d.reason());
        }
    }
}

#[test]
fn explicit_placements_fall_back_along_the_chain() {
    let mut plain = gpu(1, 80 * GIB, 70 * GIB);
    plain.pools = vec![PoolKind::DeviceLocal];
    let devices = [host(0), plain.clone()];
    let d = decide(Request::new(MEDIUM).placement(Placement::ReadOnly), &devices);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal));
    assert!(d.reason().contains("no selected accelerator offers read-only device memory"), "{}", d.reason());

    // A GPU without a pinned pool: pinned memory comes from the host.
    let d = decide(Request::new(MEDIUM).placement(Placement::HostPinned), &devices);
    assert_eq!((d.device, d.pool), (0, PoolKind::HostPinned));
    assert!(d.reason().contains("pinned host memory on device 0 (host)"), "{}", d.reason());

    // A GPU with no device pools at all: everything falls back to host memory.
    plain.pools = vec![];
    let devices = [host(0), plain];
    for placement in [Placement::ReadOnly, Placement::DeviceLocal, Placement::Auto] {
        let d = decide(Request::new(MEDIUM).placement(placement), &devices);
        assert_eq!((d.device, d.pool), (0, PoolKind::HostPinned), "{placement}");
        assert!(d.reason().contains("falls back to host memory"), "{}", d.reason());
    }

    // A host that offers only pageable memory.
    let mut pageable = host(0);
    pageable.pools = vec![PoolKind::Host];
    let mut bare = gpu(1, 80 * GIB, 70 * GIB);
    bare.pools = vec![PoolKind::DeviceLocal];
    let d = decide(Request::new(MEDIUM).placement(Placement::HostPinned), &[pageable, bare]);
    assert_eq!((d.device, d.pool), (0, PoolKind::Host));
    assert!(d.reason().contains("no pinned pool is offered"), "{}", d.reason());
}

#[test]
fn host_only_machine_resolves_everything_to_the_host() {
    let devices = [host(0)];
    for placement in Placement::iter() {
        for access in AccessPattern::iter() {
            for bytes in [1, SMALL, MEDIUM, LARGE, u64::MAX] {
                let d = decide(Request::new(bytes).placement(placement).access(access), &devices);
                assert_eq!(d.device, 0);
                let pool = if placement == Placement::HostPinned { PoolKind::HostPinned } else { PoolKind::Host };
                assert_eq!(d.pool, pool, "{placement} {access}");
                assert!(d.reason().contains("host memory only: no accelerator discovered"), "{}", d.reason());
            }
        }
    }
    let err = Decider::default()
        .decide(&Request::new(MEDIUM).device(DeviceSelector::Api(Api::Cuda)), &devices, None)
        .unwrap_err();
    assert!(matches!(err, Error::NoDevice { .. }), "{err}");
}

#[test]
fn devices_sharing_memory_prefer_pinned_memory_they_read_in_place() {
    let devices = [host(0), igpu(1)];
    for bytes in [MEDIUM, LARGE] {
        let d = decide(auto(bytes, AccessPattern::ReadWrite), &devices);
        assert_eq!((d.device, d.pool), (1, PoolKind::HostPinned));
        assert!(
            d.reason()
                .contains("shares memory with the host, so Auto prefers pinned host memory, which it reads in place")
                && !d.reason().contains("zero-copy"),
            "{}",
            d.reason()
        );
    }
    let d = decide(auto(SMALL, AccessPattern::ReadWrite), &devices);
    assert_eq!((d.device, d.pool), (1, PoolKind::HostPinned));
    assert!(d.reason().contains("reads in place since it shares memory with the host"), "{}", d.reason());

    // Explicit device-local memory is still honoured.
    let d = decide(Request::new(MEDIUM).placement(Placement::DeviceLocal), &devices);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal));

    // A shared-memory device without a pinned pool keeps its device-local pool (host memory anyway); a CPU
    // device serves Auto only when a selector names it.
    let mut cpu = igpu(1);
    cpu.kind = umm_placement::DeviceKind::Cpu;
    cpu.pools = vec![PoolKind::DeviceLocal];
    let d = decide(auto(MEDIUM, AccessPattern::Unknown).device(DeviceSelector::Index(1)), &[host(0), cpu]);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal));
    assert!(d.reason().contains("offers no pinned pool"), "{}", d.reason());
}

#[test]
fn auto_picks_the_device_with_most_free_memory() {
    let devices = [host(0), gpu(1, 24 * GIB, 20 * GIB), gpu(2, 80 * GIB, 60 * GIB), gpu(3, 80 * GIB, 60 * GIB)];
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &devices);
    assert_eq!(d.device, 2, "ties go to the lower index: {}", d.reason());
    assert!(d.reason().contains("the most memory free to umm among 3 candidates (spread balance)"), "{}", d.reason());
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &[host(0), gpu(1, 24 * GIB, 20 * GIB)]);
    assert!(d.reason().contains("the only candidate"), "{}", d.reason());
}

#[test]
fn memory_the_pools_hold_unused_counts_as_available() {
    // gpu1 has less free on the device but more free to umm once what its pools hold unused is counted.
    let mut held = gpu(1, 80 * GIB, 50 * GIB);
    held.cached_bytes = 20 * GIB;
    let devices = [host(0), held.clone(), gpu(2, 80 * GIB, 60 * GIB)];
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &devices);
    assert_eq!(d.device, 1, "{}", d.reason());
    assert!(
        d.reason().contains("70 GiB free to umm of 80 GiB (50 GiB free on the device, 20 GiB unused in umm's pools)"),
        "{}",
        d.reason()
    );
    // Nor is a device under pressure when its pools hold what the device lacks.
    let mut full = gpu(1, 80 * GIB, GIB);
    full.cached_bytes = 40 * GIB;
    let d = decide(auto(4 * GIB, AccessPattern::Unknown), &[host(0), full, gpu(2, 80 * GIB, 30 * GIB)]);
    assert_eq!(d.device, 1, "41 GiB available: {}", d.reason());
}

#[test]
fn current_first_fills_the_current_device_until_it_is_under_pressure() {
    let decider = Decider::new(DecisionConfig { spread: Spread::CurrentFirst, ..DecisionConfig::default() }).unwrap();
    let devices = [host(0), gpu(1, 80 * GIB, 10 * GIB), gpu(2, 80 * GIB, 70 * GIB)];
    let d = decider.decide(&Request::new(LARGE).current(Some(1)), &devices, None).unwrap();
    assert_eq!(d.device, 1, "{}", d.reason());
    assert!(d.reason().contains("the current device, filled first (spread current_first)"), "{}", d.reason());
    // Without a current device, or with it under pressure, the most available memory wins.
    let d = decider.decide(&Request::new(LARGE), &devices, None).unwrap();
    assert_eq!(d.device, 2, "{}", d.reason());
    let busy = [host(0), gpu(1, 80 * GIB, 4 * GIB), gpu(2, 80 * GIB, 70 * GIB)];
    let d = decider.decide(&Request::new(LARGE).current(Some(1)), &busy, None).unwrap();
    assert_eq!(d.device, 2, "{}", d.reason());
    assert!(d.reason().contains("skipped device 1"), "{}", d.reason());
    // Balance, the default, ignores the current device for Auto.
    let d = decide(Request::new(LARGE).current(Some(1)), &devices);
    assert_eq!(d.device, 2, "{}", d.reason());
}

#[test]
fn spread_parses_and_prints() {
    for (text, spread) in
        [("balance", Spread::Balance), ("Current_First", Spread::CurrentFirst), ("current-first", Spread::CurrentFirst)]
    {
        assert_eq!(text.parse::<Spread>(), Ok(spread), "{text}");
        assert_eq!(spread.to_string().parse::<Spread>(), Ok(spread));
    }
    assert!("fill".parse::<Spread>().is_err());
    assert_eq!(Spread::default(), Spread::Balance);
}

#[test]
fn pressure_skips_busy_devices_then_falls_back_to_pinned_host_memory() {
    // gpu1 has the most free memory but is 92.5% used; gpu2 is half used.
    let busy = gpu(1, 200 * GIB, 15 * GIB);
    let calm = gpu(2, 16 * GIB, 8 * GIB);
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &[host(0), busy.clone(), calm]);
    assert_eq!((d.device, d.pool), (2, PoolKind::DeviceLocal));
    assert!(
        d.reason().contains("skipped device 1 (gpu1): 92.5% used is above the 90% pressure threshold"),
        "{}",
        d.reason()
    );

    // Everything busy: pinned host memory.
    let busy2 = gpu(2, 16 * GIB, GIB);
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &[host(0), busy.clone(), busy2.clone()]);
    assert_eq!(d.pool, PoolKind::HostPinned);
    assert!(
        d.reason().contains("every candidate device is under pressure, so it falls back to pinned host memory"),
        "{}",
        d.reason()
    );
    // With no pinned pool on the GPUs, the host's pinned pool.
    let (mut b1, mut b2) = (busy.clone(), busy2);
    b1.pools = vec![PoolKind::DeviceLocal];
    b2.pools = vec![PoolKind::DeviceLocal];
    let d = decide(auto(LARGE, AccessPattern::Unknown), &[host(0), b1, b2]);
    assert_eq!((d.device, d.pool), (0, PoolKind::HostPinned));

    // Explicit placements are honoured under pressure, and the reason says so.
    let d = decide(Request::new(MEDIUM).placement(Placement::DeviceLocal), &[host(0), busy.clone()]);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal));
    assert!(d.reason().contains("is honoured on device 1 (gpu1) although 92.5% used"), "{}", d.reason());

    // A lower threshold counts more devices as busy.
    let strict = Decider::new(DecisionConfig { pressure_threshold: 0.25, ..DecisionConfig::default() }).unwrap();
    let d = strict.decide(&auto(MEDIUM, AccessPattern::Unknown), &[host(0), gpu(1, 16 * GIB, 8 * GIB)], None).unwrap();
    assert_eq!(d.pool, PoolKind::HostPinned);
}

/// The threshold itself is not pressure: a device exactly 90% used is chosen, one a byte fuller is skipped.
#[test]
fn a_device_exactly_at_the_pressure_threshold_is_not_under_pressure() {
    let at = gpu(1, 10 * GIB, GIB);
    assert_eq!(at.used_fraction(), DecisionConfig::default().pressure_threshold, "exactly at the threshold");
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &[host(0), at]);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal), "{}", d.reason());
    let past = gpu(1, 10 * GIB, GIB - 1);
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &[host(0), past]);
    assert_eq!(d.pool, PoolKind::HostPinned, "{}", d.reason());
    assert!(d.reason().contains("above the 90% pressure threshold"), "{}", d.reason());
}

#[test]
fn a_request_that_does_not_fit_skips_the_device() {
    let small = gpu(1, 8 * GIB, 4 * GIB);
    let big = gpu(2, 80 * GIB, 3 * GIB); // 96% used: busy too
    let d = decide(auto(6 * GIB, AccessPattern::Unknown), &[host(0), small, big]);
    assert_eq!(d.pool, PoolKind::HostPinned);
    assert!(d.reason().contains("only 4 GiB free, less than the 6 GiB asked"), "{}", d.reason());
}

#[test]
fn devices_of_unknown_size_are_never_under_pressure() {
    let mut wgpu = gpu(1, 0, 0);
    wgpu.apis = vec![Api::Wgpu];
    let d = decide(auto(LARGE, AccessPattern::Unknown), &[host(0), wgpu]);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal));
    assert!(d.reason().contains("memory size unknown"), "{}", d.reason());
}

#[test]
fn selectors_choose_and_explain() {
    let mut cl = gpu(2, 16 * GIB, 8 * GIB);
    cl.apis = vec![Api::OpenCl];
    let mut cuda = gpu(1, 80 * GIB, 70 * GIB);
    cuda.apis = vec![Api::Cuda];
    let devices = [host(0), cuda, cl];
    let d = decide(Request::new(MEDIUM).device(DeviceSelector::Api(Api::OpenCl)), &devices);
    assert_eq!(d.device, 2);
    let d = decide(Request::new(MEDIUM).device(DeviceSelector::Index(2)), &devices);
    assert_eq!(d.device, 2);
    for selector in [DeviceSelector::Host, DeviceSelector::Index(0), DeviceSelector::Api(Api::Host)] {
        let d = decide(Request::new(MEDIUM).device(selector), &devices);
        assert_eq!((d.device, d.pool), (0, PoolKind::HostPinned), "{selector}");
        assert!(d.reason().contains("selects no accelerator"), "{}", d.reason());
    }
}

#[test]
fn selector_errors_name_what_was_asked_and_what_exists() {
    let decider = Decider::default();
    let err = decider.decide(&Request::new(MEDIUM).device(DeviceSelector::Index(7)), &machine(), None).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::NoDevice { .. }));
    for needle in [
        "device index 7",
        "0: host (host; host; pools host, host_pinned)",
        "1: gpu1 (discrete_gpu; cuda, opencl; pools device_local, read_only, host_pinned)",
    ] {
        assert!(msg.contains(needle), "missing {needle:?} in {msg}");
    }
    let mut cl_only = machine();
    cl_only[1].apis = vec![Api::OpenCl];
    let msg = decider
        .decide(&Request::new(MEDIUM).device(DeviceSelector::Api(Api::Cuda)), &cl_only, None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no device matches a device with the cuda API") && msg.contains("opencl"), "{msg}");
    let msg = decider.decide(&Request::new(MEDIUM), &[], None).unwrap_err().to_string();
    assert!(msg.contains("available: no devices"), "{msg}");
    let msg = decider
        .decide(&Request::new(MEDIUM).device(DeviceSelector::Host), &[gpu(0, GIB, GIB)], None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no device matches the host"), "{msg}");
}

#[test]
fn impossible_placements_and_zero_sizes_are_errors() {
    let mut odd = gpu(0, 80 * GIB, 70 * GIB);
    odd.pools = vec![PoolKind::ReadOnly];
    let err =
        Decider::default().decide(&Request::new(MEDIUM).placement(Placement::HostPinned), &[odd], None).unwrap_err();
    assert!(matches!(err, Error::ImpossiblePlacement { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("host_pinned placement of 1 MiB (access unknown) on any device")
            && msg.contains("pools read_only"),
        "{msg}"
    );
    let err = Decider::default().decide(&Request::new(0), &machine(), None).unwrap_err();
    assert_eq!(err, Error::ZeroSize);
}

#[test]
fn invalid_configs_are_rejected() {
    let err = Decider::new(DecisionConfig {
        thresholds: Thresholds { small_max: 16 * MIB, medium_max: 64 * KIB },
        ..DecisionConfig::default()
    })
    .unwrap_err();
    assert!(matches!(err, Error::InvalidThresholds { .. }), "{err}");
    for p in [-0.1, 1.5, f64::NAN] {
        let err = Decider::new(DecisionConfig { pressure_threshold: p, ..DecisionConfig::default() }).unwrap_err();
        assert!(err.to_string().contains("pressure_threshold"), "{err}");
    }
}

#[test]
fn decisions_serialize() {
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &machine());
    let json = serde_json::to_value(&d).unwrap();
    assert_eq!(json["pool"], "device_local");
    assert_eq!(json["size_class"], "medium");
    assert!(d.to_string().starts_with("device 1 device_local: Medium buffer"));
}

/// A software Vulkan adapter (lavapipe): a CPU device over host memory.
fn software(index: usize) -> DeviceView {
    DeviceView {
        index,
        name: "llvmpipe".into(),
        kind: umm_placement::DeviceKind::Cpu,
        apis: vec![Api::Wgpu],
        shares_memory_with_host: true,
        total_bytes: 16 * GIB,
        free_bytes: 16 * GIB,
        cached_bytes: 0,
        pools: vec![PoolKind::DeviceLocal, PoolKind::HostPinned, PoolKind::ReadOnly],
        max_allocation: 0,
    }
}

#[test]
fn no_placement_without_a_selector_picks_a_software_device_while_host_memory_exists() {
    let devices = [host(0), software(1)];
    for placement in Placement::iter() {
        for access in AccessPattern::iter() {
            for bytes in [SMALL, MEDIUM, LARGE] {
                let d = decide(Request::new(bytes).placement(placement).access(access), &devices);
                assert_eq!(d.device, 0, "{placement} {access} {bytes}: {}", d.reason());
                assert!(matches!(d.pool, PoolKind::Host | PoolKind::HostPinned), "{}", d.reason());
                assert!(d.reason().contains("software or CPU devices (device 1 (llvmpipe))"), "{}", d.reason());
                assert!(d.reason().contains("serve only requests that select them"), "{}", d.reason());
            }
        }
    }
    // Explicit pinned memory stays pinned; Auto's small buffers too.
    let d = decide(Request::new(MEDIUM).placement(Placement::HostPinned), &devices);
    assert_eq!((d.device, d.pool), (0, PoolKind::HostPinned), "{}", d.reason());
    // Named by a selector, it serves.
    let d = decide(auto(MEDIUM, AccessPattern::Unknown).device(DeviceSelector::Index(1)), &devices);
    assert_eq!(d.device, 1, "{}", d.reason());
    let d = decide(auto(MEDIUM, AccessPattern::Unknown).device(DeviceSelector::Api(Api::Wgpu)), &devices);
    assert_eq!(d.device, 1, "{}", d.reason());
    let d = decide(Request::new(MEDIUM).placement(Placement::DeviceLocal).device(DeviceSelector::Index(1)), &devices);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal), "{}", d.reason());
    // A software device made current serves explicit placements: the caller named it (`set_current_device`).
    for placement in [Placement::DeviceLocal, Placement::ReadOnly, Placement::HostPinned] {
        let d = decide(Request::new(MEDIUM).placement(placement).current(Some(1)), &devices);
        assert_eq!(d.device, 1, "{placement}: a software current device serves: {}", d.reason());
        assert!(d.reason().contains("is the current device"), "{}", d.reason());
    }
    // Auto is not bound to the current device: still host memory.
    let d = decide(auto(MEDIUM, AccessPattern::Unknown).current(Some(1)), &devices);
    assert_eq!(d.device, 0, "{}", d.reason());
    // Beside a real GPU, Auto still goes to the GPU.
    let d = decide(auto(MEDIUM, AccessPattern::Unknown), &[host(0), software(1), gpu(2, 80 * GIB, 80 * GIB)]);
    assert_eq!(d.device, 2, "{}", d.reason());
}

#[test]
fn a_request_above_a_devices_largest_allocation_goes_to_the_next_candidate() {
    let mut small_limit = gpu(1, 80 * GIB, 80 * GIB);
    small_limit.max_allocation = 2 * GIB;
    let roomy = gpu(2, 24 * GIB, 20 * GIB);
    // Auto: the device with the most free memory cannot hold it in one allocation; the next one serves.
    let d = decide(auto(4 * GIB, AccessPattern::Unknown), &[host(0), small_limit.clone(), roomy]);
    assert_eq!((d.device, d.pool), (2, PoolKind::DeviceLocal), "{}", d.reason());
    assert!(d.reason().contains("above its largest single allocation (2 GiB)"), "{}", d.reason());
    // Below the limit it is the first choice again.
    let d = decide(auto(GIB, AccessPattern::Unknown), &[host(0), small_limit.clone(), gpu(2, 24 * GIB, 20 * GIB)]);
    assert_eq!(d.device, 1, "{}", d.reason());
    // Explicit device-local memory with no device that fits falls back along the chain to pinned host memory.
    let d = decide(Request::new(4 * GIB).placement(Placement::DeviceLocal), &[host(0), small_limit]);
    assert_eq!(d.pool, PoolKind::HostPinned, "{}", d.reason());
    assert!(d.reason().contains("above its largest single allocation"), "{}", d.reason());
}

#[test]
fn a_decision_shares_the_devices_it_was_made_on_and_renders_its_reason_when_asked() {
    let devices: std::sync::Arc<[DeviceView]> = vec![host(0), gpu(1, 80 * GIB, 70 * GIB)].into();
    let d = Decider::default().decide_shared(&Request::new(MEDIUM), &devices, None).unwrap();
    // One reference count, not a copy of the views.
    assert_eq!(std::sync::Arc::strong_count(&devices), 2);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal));
    let copied = Decider::default().decide(&Request::new(MEDIUM), &devices, None).unwrap();
    assert_eq!(d.reason(), copied.reason());
    assert!(d.reason().contains("chose device 1 (gpu1) for device-local memory"), "{}", d.reason());
    // The figures are those the decision was made on, whatever the devices show later.
    assert!(d.reason().contains("70 GiB free of 80 GiB"), "{}", d.reason());
    drop(devices);
    assert!(d.reason().contains("70 GiB free of 80 GiB"), "{}", d.reason());
    assert_eq!(d.to_string(), format!("device 1 device_local: {}", d.reason()));
}

#[test]
fn a_decision_serialises_with_its_reason() {
    let d = decide(Request::new(MEDIUM), &[host(0), gpu(1, 80 * GIB, 70 * GIB)]);
    let json = serde_json::to_value(&d).unwrap();
    assert_eq!(json["device"], 1);
    assert_eq!(json["pool"], "device_local");
    assert_eq!(json["size_class"], "medium");
    assert_eq!(json["reason"], d.reason());
}

#[test]
fn explicit_placements_without_a_selector_go_to_the_current_device() {
    // Two GPUs; the second has more free memory, which is where the decider would otherwise put them.
    let devices = [host(0), gpu(1, 80 * GIB, 10 * GIB), gpu(2, 80 * GIB, 70 * GIB)];
    for (placement, pool) in [
        (Placement::DeviceLocal, PoolKind::DeviceLocal),
        (Placement::ReadOnly, PoolKind::ReadOnly),
        (Placement::HostPinned, PoolKind::HostPinned),
    ] {
        let d = decide(Request::new(MEDIUM).placement(placement).current(Some(1)), &devices);
        assert_eq!((d.device, d.pool), (1, pool), "{placement}: {}", d.reason());
        assert!(d.reason().contains("is the current device"), "{}", d.reason());
        let d = decide(Request::new(MEDIUM).placement(placement), &devices);
        assert_ne!(d.device, 1, "{placement} without a current device: the most free memory wins: {}", d.reason());
    }
    // Under pressure the current device is honoured, as explicit placements are.
    let full = [host(0), gpu(1, 80 * GIB, 2 * GIB), gpu(2, 80 * GIB, 70 * GIB)];
    let d = decide(Request::new(MEDIUM).placement(Placement::DeviceLocal).current(Some(1)), &full);
    assert_eq!(d.device, 1, "{}", d.reason());
    // Auto is not bound to it; a selector overrides it; a current device that does not exist changes nothing.
    let d = decide(Request::new(MEDIUM).current(Some(1)), &devices);
    assert_eq!(d.device, 2, "{}", d.reason());
    let d = decide(
        Request::new(MEDIUM).placement(Placement::DeviceLocal).current(Some(1)).device(DeviceSelector::Index(2)),
        &devices,
    );
    assert_eq!(d.device, 2, "{}", d.reason());
    let d = decide(Request::new(MEDIUM).placement(Placement::DeviceLocal).current(Some(9)), &devices);
    assert_eq!(d.device, 2, "{}", d.reason());
    // A current device without read-only memory serves ReadOnly from device-local memory; one that cannot hold the
    // request in one allocation is passed over.
    let mut plain = gpu(1, 80 * GIB, 10 * GIB);
    plain.pools.retain(|&k| k != PoolKind::ReadOnly);
    let d = decide(Request::new(MEDIUM).placement(Placement::ReadOnly).current(Some(1)), &[host(0), plain.clone()]);
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal), "{}", d.reason());
    plain.max_allocation = MEDIUM / 2;
    let d = decide(
        Request::new(MEDIUM).placement(Placement::DeviceLocal).current(Some(1)),
        &[host(0), plain, gpu(2, 80 * GIB, 70 * GIB)],
    );
    assert_eq!(d.device, 2, "{}", d.reason());
}

#[test]
fn a_selector_naming_a_device_keeps_the_request_there() {
    let mut no_pinned = gpu(1, 80 * GIB, 70 * GIB);
    no_pinned.pools.retain(|&k| k != PoolKind::HostPinned);
    let devices = [host(0), no_pinned, gpu(2, 80 * GIB, 70 * GIB)];
    // Auto's small buffers go to pinned memory by the table: through the named device where it offers it, and
    // in its device-local memory where it does not, never to the host the selector did not name.
    let small = |selector| decide(auto(SMALL, AccessPattern::Unknown).device(selector), &devices);
    let d = small(DeviceSelector::Index(2));
    assert_eq!((d.device, d.pool), (2, PoolKind::HostPinned), "{}", d.reason());
    let d = small(DeviceSelector::Index(1));
    assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal), "{}", d.reason());
    assert!(d.reason().contains("offers no pinned memory, so it stays there"), "{}", d.reason());
    // With any device, or the host named, the host serves as before.
    let d = small(DeviceSelector::Any);
    assert_eq!(d.pool, PoolKind::HostPinned, "{}", d.reason());
    let d = small(DeviceSelector::Host);
    assert_eq!((d.device, d.pool), (0, PoolKind::HostPinned), "{}", d.reason());
    // Pinned memory asked for explicitly on a device without it is impossible, not moved to the host.
    let err = Decider::default()
        .decide(&Request::new(SMALL).placement(Placement::HostPinned).device(DeviceSelector::Index(1)), &devices, None)
        .unwrap_err();
    assert!(matches!(err, umm_placement::Error::ImpossiblePlacement { .. }), "{err}");
    assert!(err.to_string().contains("device index 1"), "{err}");
}

/// Table defaults for every subject, with `subject` set to `placement`, backed by evidence or not.
fn evidence_for(
    subject: umm_placement::Subject,
    placement: Placement,
    from_evidence: bool,
) -> umm_placement::Recommendations {
    let mut recs = umm_placement::Recommendations::table_defaults(Thresholds::default());
    let item = recs.items.iter_mut().find(|r| r.subject == subject).expect("every subject has an item");
    item.placement = placement;
    item.from_evidence = from_evidence;
    recs
}

#[test]
fn only_evidence_that_contradicts_both_the_table_and_its_default_moves_auto() {
    use umm_placement::Subject;
    let d = Decider::default();
    let medium = auto(MEDIUM, AccessPattern::Sequential);
    // A recommendation not backed by evidence is the table's default in disguise: it never decides.
    let unbacked = evidence_for(Subject::MediumBuffers, Placement::HostPinned, false);
    let got = d.decide(&medium, &machine(), Some(&unbacked)).unwrap();
    assert_eq!(got.pool, PoolKind::DeviceLocal, "{}", got.reason());
    assert!(!got.reason().contains("usage evidence says"), "{}", got.reason());
    // Backed by evidence and against the table: it decides.
    let backed = evidence_for(Subject::MediumBuffers, Placement::HostPinned, true);
    let got = d.decide(&medium, &machine(), Some(&backed)).unwrap();
    assert_eq!(got.pool, PoolKind::HostPinned, "{}", got.reason());
    assert!(got.reason().contains("usage evidence says host_pinned"), "{}", got.reason());
    // Evidence that agrees with the subject's default does not undo a configured table rule: large streams to
    // pinned memory stay pinned when the evidence merely says what large buffers do by default.
    let streams = Decider::new(DecisionConfig { large_streams_to_pinned: true, ..DecisionConfig::default() }).unwrap();
    let agrees = evidence_for(Subject::LargeBuffers, Placement::DeviceLocal, true);
    let got = streams.decide(&auto(LARGE, AccessPattern::Sequential), &machine(), Some(&agrees)).unwrap();
    assert_eq!(got.pool, PoolKind::HostPinned, "{}", got.reason());
    assert!(!got.reason().contains("usage evidence says"), "{}", got.reason());
}

/// A GPU that offers nothing but read-only memory, most of it in use.
fn read_only_gpu(index: usize, free: u64) -> DeviceView {
    let mut g = gpu(index, 80 * GIB, free);
    g.pools = vec![PoolKind::ReadOnly];
    g
}

#[test]
fn read_only_data_falls_back_to_read_only_memory_on_the_selected_device() {
    use umm_placement::Subject;
    let selected = DeviceSelector::Index(1);
    let d = Decider::default();
    // Under pressure everywhere: the fallback keeps read-only data on the named device's read-only pool.
    let devices = [host(0), read_only_gpu(1, GIB)];
    let got = d.decide(&auto(MEDIUM, AccessPattern::ReadOnly).device(selected), &devices, None).unwrap();
    assert_eq!((got.device, got.pool), (1, PoolKind::ReadOnly), "{}", got.reason());
    // Evidence sends read-only data to pinned memory, which the named device does not offer: the fallback
    // still finds its read-only pool, for data declared read-only.
    let pinned = evidence_for(Subject::ReadOnlyData, Placement::HostPinned, true);
    let devices = [host(0), read_only_gpu(1, 70 * GIB)];
    let req = auto(MEDIUM, AccessPattern::ReadOnly).device(selected);
    let got = d.decide(&req, &devices, Some(&pinned)).unwrap();
    assert_eq!((got.device, got.pool), (1, PoolKind::ReadOnly), "{}", got.reason());
    // Data not declared read-only never lands in read-only memory: with nothing else there, no placement.
    let err = d.decide(&auto(MEDIUM, AccessPattern::Random).device(selected), &devices, None).unwrap_err();
    assert!(matches!(err, Error::ImpossiblePlacement { .. }), "{err}");
}

#[test]
fn a_device_too_small_for_one_allocation_is_named_and_not_called_one_that_offers_nothing() {
    let mut small = gpu(1, 80 * GIB, 70 * GIB);
    small.max_allocation = MIB;
    let got = decide(Request::new(LARGE).placement(Placement::DeviceLocal), &[host(0), small]);
    assert_eq!((got.device, got.pool), (1, PoolKind::HostPinned), "pinned through the GPU: {}", got.reason());
    assert!(got.reason().contains("skipped device 1 (gpu1): the request is above its largest"), "{}", got.reason());
    assert!(!got.reason().contains("no selected accelerator offers"), "{}", got.reason());
}

#[test]
fn a_machine_whose_only_device_is_a_cpu_runtime_uses_it_without_a_selector() {
    // No host view (a program that built its device list by hand): nothing to prefer over the CPU device.
    let got = decide(Request::new(MEDIUM).placement(Placement::DeviceLocal), &[software(0)]);
    assert_eq!((got.device, got.pool), (0, PoolKind::DeviceLocal), "{}", got.reason());
}
