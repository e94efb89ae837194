//! Every boundary of the decision table, through the public API: a case exactly at it, one just below and one
//! just above, each asserting the side the documentation gives it. The size classes include both maxima
//! (`bytes <= small_max` is small, `bytes <= medium_max` medium); a device is under pressure when its used
//! fraction is strictly above `pressure_threshold` or its available memory strictly below the request; a
//! request fits a device's largest allocation when it is not above it; ties of available memory go to the
//! lower index; `pressure_threshold` may be 0 or 1 and `small_max` must be strictly below `medium_max`.

mod common;

use common::*;
use umm_placement::{
    AccessPattern, Decider, DecisionConfig, DeviceView, Error, Placement, PoolKind, Request, SizeClass, Spread,
    Thresholds,
};

/// A large request (64 MiB): device-local memory for Auto.
const LARGE_REQ: u64 = 64 * MIB;

/// A decider with `config`, which must be valid.
fn decider(config: DecisionConfig) -> Decider {
    Decider::new(config).expect("a valid config")
}

/// The decision for `req` on `devices`, which must exist.
fn decide(decider: &Decider, req: Request, devices: &[DeviceView]) -> umm_placement::Decision {
    decider.decide(&req, devices, None).unwrap_or_else(|e| panic!("{}: {e}", req.describe()))
}

/// Thresholds to walk: the defaults, small custom ones, the smallest pair and a pair near the top of `u64`.
fn thresholds() -> [Thresholds; 4] {
    [
        Thresholds::default(),
        Thresholds::new(1000, 5000).unwrap(),
        Thresholds::new(1, 2).unwrap(),
        Thresholds::new(u64::MAX - 2, u64::MAX - 1).unwrap(),
    ]
}

/// A GPU of unknown size (never under pressure, never too small), so that only the size class decides.
fn roomy_gpu(index: usize) -> DeviceView {
    gpu(index, 0, 0)
}

/// `small_max` is the largest small size: at it and below it a request is small (pinned host memory for Auto),
/// one byte above it medium (device-local memory).
#[test]
fn small_max_is_small_and_one_byte_more_is_medium() {
    for t in thresholds() {
        let d = decider(DecisionConfig { thresholds: t, ..DecisionConfig::default() });
        let devices = [host(0), roomy_gpu(1)];
        let s = t.small_max;
        let cases =
            [(s.checked_sub(1), SizeClass::Small), (Some(s), SizeClass::Small), (Some(s + 1), SizeClass::Medium)];
        for (bytes, class) in cases {
            let Some(bytes) = bytes.filter(|&b| b > 0) else { continue };
            let decision = decide(&d, Request::new(bytes), &devices);
            assert_eq!(decision.size_class, class, "{bytes} B with {t:?}: {}", decision.reason());
            let (pool, rule) = match class {
                SizeClass::Small => (PoolKind::HostPinned, "small buffers go to pinned host memory"),
                _ => (PoolKind::DeviceLocal, "medium buffers go to device-local memory"),
            };
            assert_eq!((decision.device, decision.pool), (1, pool), "{bytes} B with {t:?}: {}", decision.reason());
            assert!(decision.reason().contains(rule), "{bytes} B with {t:?}: {}", decision.reason());
        }
    }
}

/// `medium_max` is the largest medium size: at it and below it a request is medium, one byte above it large.
/// The two switches that treat large buffers apart show the side in the pool too.
#[test]
fn medium_max_is_medium_and_one_byte_more_is_large() {
    for t in thresholds() {
        let m = t.medium_max;
        let streams = decider(DecisionConfig { thresholds: t, large_streams_to_pinned: true, ..Default::default() });
        let no_big_pins =
            decider(DecisionConfig { thresholds: t, large_host_frequent_to_pinned: false, ..Default::default() });
        let devices = [host(0), roomy_gpu(1)];
        for (bytes, class) in [(m - 1, SizeClass::Medium), (m, SizeClass::Medium), (m + 1, SizeClass::Large)] {
            if bytes <= t.small_max {
                continue;
            }
            let large = class == SizeClass::Large;
            let d = decide(&streams, Request::new(bytes).access(AccessPattern::Sequential), &devices);
            assert_eq!(d.size_class, class, "{bytes} B with {t:?}: {}", d.reason());
            let pool = if large { PoolKind::HostPinned } else { PoolKind::DeviceLocal };
            assert_eq!(d.pool, pool, "sequential {bytes} B with {t:?}: {}", d.reason());
            assert_eq!(d.reason().contains("large_streams_to_pinned is on"), large, "{}", d.reason());

            let d = decide(&no_big_pins, Request::new(bytes).access(AccessPattern::HostFrequent), &devices);
            assert_eq!(d.size_class, class, "{bytes} B with {t:?}: {}", d.reason());
            let pool = if large { PoolKind::DeviceLocal } else { PoolKind::HostPinned };
            assert_eq!(d.pool, pool, "host-frequent {bytes} B with {t:?}: {}", d.reason());
            assert_eq!(d.reason().contains("large_host_frequent_to_pinned is off"), large, "{}", d.reason());
        }
    }
}

/// The size class in the reason states the inclusive bounds it was decided by.
#[test]
fn the_reason_names_the_class_on_each_side_of_both_maxima() {
    let t = Thresholds::default();
    let d = decider(DecisionConfig::default());
    for (bytes, says) in [
        (t.small_max, "Small buffer of 64 KiB (small <= 64 KiB < medium <= 16 MiB < large)"),
        (t.small_max + 1, "Medium buffer of 64.0 KiB"),
        (t.medium_max, "Medium buffer of 16 MiB"),
        (t.medium_max + 1, "Large buffer of 16.0 MiB"),
    ] {
        let reason = decide(&d, Request::new(bytes), &machine()).reason();
        assert!(reason.starts_with(says), "{bytes}: {reason}");
    }
}

/// One byte is the smallest request; zero is an error.
#[test]
fn one_byte_is_a_request_and_zero_is_not() {
    let d = decider(DecisionConfig::default());
    assert_eq!(decide(&d, Request::new(1), &machine()).size_class, SizeClass::Small);
    assert_eq!(d.decide(&Request::new(0), &machine(), None).unwrap_err(), Error::ZeroSize);
}

/// A GPU of `total` bytes with `used` of them in use (`free = total - used`).
fn used_gpu(index: usize, total: u64, used: u64) -> DeviceView {
    gpu(index, total, total - used)
}

/// Where Auto puts a medium request on the host and `gpu`: device-local memory on the GPU when it is not under
/// pressure, pinned host memory through it when it is. Returns whether it was skipped, checking the reason.
fn skipped(decider: &Decider, bytes: u64, gpu: DeviceView) -> bool {
    let d = decide(decider, Request::new(bytes), &[host(0), gpu]);
    let skipped = d.reason().contains("skipped device 1");
    let pool = if skipped { PoolKind::HostPinned } else { PoolKind::DeviceLocal };
    assert_eq!((d.device, d.pool), (1, pool), "{}", d.reason());
    assert_eq!(d.reason().contains("every candidate device is under pressure"), skipped, "{}", d.reason());
    skipped
}

/// A device used exactly at the threshold is not under pressure; a byte more and it is, with the reason naming
/// both percentages; a byte less and it is not. For every threshold whose fraction of the device is exact.
#[test]
fn a_device_used_exactly_at_the_pressure_threshold_is_chosen_and_a_byte_more_is_skipped() {
    const TOTAL: u64 = 1 << 40;
    for (threshold, percent) in [(0.25, "25%"), (0.5, "50%"), (0.75, "75%"), (0.875, "87.5%"), (0.9375, "93.8%")] {
        let d = decider(DecisionConfig { pressure_threshold: threshold, ..DecisionConfig::default() });
        let at = (TOTAL as f64 * threshold) as u64;
        assert_eq!(used_gpu(1, TOTAL, at).used_fraction(), threshold, "exactly at {threshold}");
        assert!(!skipped(&d, MIB, used_gpu(1, TOTAL, at - 1)), "{threshold}: a byte below");
        assert!(!skipped(&d, MIB, used_gpu(1, TOTAL, at)), "{threshold}: at");
        assert!(skipped(&d, MIB, used_gpu(1, TOTAL, at + 1)), "{threshold}: a byte above");
        let reason = decide(&d, Request::new(MIB), &[host(0), used_gpu(1, TOTAL, at + 1)]).reason();
        assert!(reason.contains(&format!("is above the {percent} pressure threshold")), "{reason}");
    }
    // The default, 90%: 9 GiB used of 10 GiB is exactly 0.9 in floating point.
    let d = decider(DecisionConfig::default());
    assert_eq!(DecisionConfig::default().pressure_threshold, 0.9);
    assert_eq!(used_gpu(1, 10 * GIB, 9 * GIB).used_fraction(), 0.9);
    assert!(!skipped(&d, MIB, used_gpu(1, 10 * GIB, 9 * GIB - 1)));
    assert!(!skipped(&d, MIB, used_gpu(1, 10 * GIB, 9 * GIB)));
    assert!(skipped(&d, MIB, used_gpu(1, 10 * GIB, 9 * GIB + 1)));
}

/// At a threshold of 0 an idle device is not under pressure and one byte used is; at 1 a device with one byte
/// free serves a one-byte request, and a full one is skipped for its free memory, not its used fraction.
#[test]
fn thresholds_of_zero_and_one_are_inclusive_too() {
    let zero = decider(DecisionConfig { pressure_threshold: 0.0, ..DecisionConfig::default() });
    assert!(!skipped(&zero, MIB, used_gpu(1, 80 * GIB, 0)));
    assert!(skipped(&zero, MIB, used_gpu(1, 80 * GIB, 1)));

    let one = decider(DecisionConfig { pressure_threshold: 1.0, ..DecisionConfig::default() });
    let nearly_full = used_gpu(1, 80 * GIB, 80 * GIB - 1);
    let d = decide(&one, Request::new(1).access(AccessPattern::ReadOnly), &[host(0), nearly_full.clone()]);
    assert_eq!((d.device, d.pool), (1, PoolKind::ReadOnly), "{}", d.reason());
    let d = decide(
        &decider(DecisionConfig::default()),
        Request::new(1).access(AccessPattern::ReadOnly),
        &[host(0), nearly_full],
    );
    assert!(d.reason().contains("above the 90% pressure threshold"), "{}", d.reason());
    let full = used_gpu(1, 80 * GIB, 80 * GIB);
    let d = decide(&one, Request::new(1).access(AccessPattern::ReadOnly), &[host(0), full]);
    assert_eq!(d.pool, PoolKind::HostPinned, "{}", d.reason());
    assert!(d.reason().contains("only 0 B free, less than the 1 B asked"), "{}", d.reason());
    assert!(!d.reason().contains("pressure threshold"), "{}", d.reason());
}

/// Memory the caller's pools hold unused counts as available at the threshold, and the available memory is
/// capped at the total: free plus cached exactly at the threshold is chosen, a byte less is skipped.
#[test]
fn cached_memory_counts_toward_the_pressure_threshold_to_the_byte() {
    let d = decider(DecisionConfig::default());
    let with_cached = |free: u64, cached: u64| DeviceView { cached_bytes: cached, ..gpu(1, 10 * GIB, free) };
    assert!(!skipped(&d, MIB, with_cached(GIB / 2, GIB / 2)), "1 GiB of 10 available: exactly 90% used");
    assert!(skipped(&d, MIB, with_cached(GIB / 2, GIB / 2 - 1)), "a byte less");
    assert!(!skipped(&d, MIB, with_cached(10 * GIB, u64::MAX)), "capped at the total, not wrapped");
    // Capped at the total when ranking too: 10 GiB available at most, against 40 GiB.
    let devices = [host(0), with_cached(10 * GIB, 100 * GIB), gpu(2, 80 * GIB, 40 * GIB)];
    assert_eq!(decide(&d, Request::new(LARGE_REQ), &devices).device, 2);
    let devices = [host(0), with_cached(10 * GIB, 100 * GIB), gpu(2, 10 * GIB, 10 * GIB)];
    assert_eq!(decide(&d, Request::new(LARGE_REQ), &devices).device, 1, "a tie at the total: the lower index");
}

/// A request of exactly the available memory fits; a byte more and the device is skipped for lack of memory
/// (the reason says so, not the threshold), on a device far from the threshold.
#[test]
fn a_request_of_exactly_the_available_memory_fits_and_a_byte_more_does_not() {
    let d = decider(DecisionConfig::default());
    let device = || gpu(1, 80 * GIB, 70 * GIB);
    assert!(!skipped(&d, 70 * GIB - 1, device()));
    assert!(!skipped(&d, 70 * GIB, device()));
    assert!(skipped(&d, 70 * GIB + 1, device()));
    let reason = decide(&d, Request::new(70 * GIB + 1), &[host(0), device()]).reason();
    assert!(reason.contains("only 70 GiB free, less than the 70.0 GiB asked"), "{reason}");
    // Cached memory counts to the byte as well.
    let cached = DeviceView { cached_bytes: 10 * GIB, ..device() };
    assert!(!skipped(&d, 80 * GIB, cached.clone()));
    assert!(skipped(&d, 80 * GIB + 1, cached));
}

/// An explicit placement is honoured under pressure: at the threshold the reason says it was chosen, a byte
/// past it says it was honoured although the device is above the threshold.
#[test]
fn explicit_placements_are_honoured_under_pressure_only_past_the_threshold() {
    let d = decider(DecisionConfig::default());
    for (used, honoured) in [(9 * GIB - 1, false), (9 * GIB, false), (9 * GIB + 1, true)] {
        let req = Request::new(MIB).placement(Placement::DeviceLocal);
        let decision = decide(&d, req, &[host(0), used_gpu(1, 10 * GIB, used)]);
        assert_eq!((decision.device, decision.pool), (1, PoolKind::DeviceLocal), "{}", decision.reason());
        let reason = decision.reason();
        assert_eq!(reason.contains("is honoured on device 1 (gpu1) although"), honoured, "{used}: {reason}");
        assert_eq!(reason.contains("; chose device 1 (gpu1)"), !honoured, "{used}: {reason}");
    }
}

/// Spread current_first keeps the current device exactly at the threshold and leaves it a byte past.
#[test]
fn current_first_keeps_the_current_device_at_the_threshold_and_leaves_it_past() {
    let d = decider(DecisionConfig { spread: Spread::CurrentFirst, ..DecisionConfig::default() });
    for (used, stays) in [(9 * GIB - 1, true), (9 * GIB, true), (9 * GIB + 1, false)] {
        let devices = [host(0), used_gpu(1, 10 * GIB, used), gpu(2, 80 * GIB, 70 * GIB)];
        let decision = decide(&d, Request::new(LARGE_REQ).current(Some(1)), &devices);
        assert_eq!(decision.device, if stays { 1 } else { 2 }, "{used}: {}", decision.reason());
    }
}

/// A request of exactly a device's largest allocation fits it; a byte more is passed over, for Auto and for an
/// explicit placement on the current device.
#[test]
fn a_request_of_exactly_the_largest_allocation_fits_and_a_byte_more_does_not() {
    let d = decider(DecisionConfig::default());
    let limited = |index| DeviceView { max_allocation: 2 * GIB, ..gpu(index, 80 * GIB, 80 * GIB) };
    for (bytes, fits) in [(2 * GIB - 1, true), (2 * GIB, true), (2 * GIB + 1, false)] {
        let decision = decide(&d, Request::new(bytes), &[host(0), limited(1), gpu(2, 24 * GIB, 20 * GIB)]);
        assert_eq!(decision.device, if fits { 1 } else { 2 }, "{bytes}: {}", decision.reason());
        assert_eq!(decision.reason().contains("above its largest single allocation (2 GiB)"), !fits);

        let req = Request::new(bytes).placement(Placement::DeviceLocal).current(Some(1));
        let decision = decide(&d, req, &[host(0), limited(1), gpu(2, 24 * GIB, 20 * GIB)]);
        assert_eq!(decision.device, if fits { 1 } else { 2 }, "{bytes}: {}", decision.reason());
        assert_eq!(decision.reason().contains("is the current device"), fits, "{}", decision.reason());
    }
}

/// Equal available memory goes to the lower index (whatever the order of the views); a byte more goes to the
/// device that has it.
#[test]
fn ties_of_available_memory_go_to_the_lower_index_and_a_byte_breaks_them() {
    let d = decider(DecisionConfig::default());
    for (extra, winner) in [(0, 1), (1, 2)] {
        for reversed in [false, true] {
            let mut devices = vec![host(0), gpu(1, 80 * GIB, 40 * GIB), gpu(2, 80 * GIB, 40 * GIB + extra)];
            if reversed {
                devices.reverse();
            }
            let decision = decide(&d, Request::new(LARGE_REQ), &devices);
            assert_eq!(decision.device, winner, "extra {extra}, reversed {reversed}: {}", decision.reason());
            // Cached memory breaks ties alike.
            let mut cached = vec![host(0), gpu(1, 80 * GIB, 40 * GIB), gpu(2, 80 * GIB, 40 * GIB)];
            cached[2].cached_bytes = extra;
            if reversed {
                cached.reverse();
            }
            assert_eq!(decide(&d, Request::new(LARGE_REQ), &cached).device, winner, "cached {extra}");
        }
    }
}

/// The pressure threshold may be anything in [0, 1], both ends included; the nearest values outside are refused.
#[test]
fn the_pressure_threshold_takes_zero_and_one_and_nothing_outside() {
    let with = |pressure_threshold| Decider::new(DecisionConfig { pressure_threshold, ..DecisionConfig::default() });
    for inside in [0.0, -0.0, f64::MIN_POSITIVE, 0.5, 1.0 - f64::EPSILON / 2.0, 1.0] {
        assert!(with(inside).is_ok(), "{inside}");
    }
    let above_one = f64::from_bits(1.0f64.to_bits() + 1);
    for outside in [-f64::MIN_POSITIVE, -5e-324, above_one, f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
        let err = with(outside).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { field: "pressure_threshold", .. }), "{outside}: {err}");
    }
}

/// `small_max` must be strictly below `medium_max`: one below is valid, equal or above is refused, by
/// [`Thresholds::new`] and by a decider given hand-made thresholds.
#[test]
fn small_max_must_be_strictly_below_medium_max() {
    for (small, medium) in [(0, 1), (5, 6), (u64::MAX - 1, u64::MAX)] {
        assert!(Thresholds::new(small, medium).is_ok(), "{small} < {medium}");
    }
    for (small, medium) in [(5, 5), (6, 5), (0, 0), (u64::MAX, u64::MAX)] {
        assert_eq!(
            Thresholds::new(small, medium),
            Err(Error::InvalidThresholds { small_max: small, medium_max: medium })
        );
        let config =
            DecisionConfig { thresholds: Thresholds { small_max: small, medium_max: medium }, ..Default::default() };
        assert!(matches!(Decider::new(config), Err(Error::InvalidThresholds { .. })), "{small}, {medium}");
    }
}
