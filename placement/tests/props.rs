//! Properties: `decide` never panics, and whatever it returns exists.

use proptest::prelude::*;
use strum::IntoEnumIterator;
use umm_placement::{
    AccessPattern, Api, Decider, DecisionConfig, DeviceKind, DeviceSelector, DeviceView, Placement, PoolKind,
    Recommendations, Request, SizeClass, Spread, Thresholds, TrackerConfig, UsageTracker,
};

fn pick<T: Copy + std::fmt::Debug + 'static>(all: Vec<T>) -> impl Strategy<Value = T> {
    prop::sample::select(all)
}

fn subset<T: Copy + std::fmt::Debug + 'static>(all: Vec<T>) -> impl Strategy<Value = Vec<T>> {
    let n = all.len();
    prop::sample::subsequence(all, 0..=n)
}

fn bytes() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 1u64..=1 << 40, any::<u64>(), Just(u64::MAX)]
}

fn device() -> impl Strategy<Value = DeviceView> {
    let accel = (
        pick(DeviceKind::iter().collect()),
        subset(Api::iter().collect()),
        any::<bool>(),
        bytes(),
        bytes(),
        bytes(),
        subset(PoolKind::iter().collect()),
    )
        .prop_map(|(kind, apis, shares, total, free, cached, pools)| DeviceView {
            index: 0,
            name: format!("{kind}"),
            kind,
            apis,
            shares_memory_with_host: shares,
            total_bytes: total,
            free_bytes: free,
            cached_bytes: cached,
            pools,
            max_allocation: 0,
        });
    prop_oneof![1 => (bytes(), bytes()).prop_map(|(t, f)| DeviceView::host(0, t, f)), 3 => accel]
}

/// Up to 5 devices with unique, shuffled indices in 0..8.
fn devices() -> impl Strategy<Value = Vec<DeviceView>> {
    (prop::collection::vec(device(), 0..=5), Just((0..8usize).collect::<Vec<_>>()).prop_shuffle()).prop_map(
        |(mut devices, indices)| {
            for (d, i) in devices.iter_mut().zip(indices) {
                d.index = i;
            }
            devices
        },
    )
}

fn request() -> impl Strategy<Value = Request> {
    let selector = prop_oneof![
        Just(DeviceSelector::Any),
        Just(DeviceSelector::Host),
        (0..9usize).prop_map(DeviceSelector::Index),
        pick(Api::iter().collect()).prop_map(DeviceSelector::Api),
    ];
    let current = prop::option::of(0..9usize);
    (bytes(), pick(Placement::iter().collect()), pick(AccessPattern::iter().collect()), selector, current).prop_map(
        |(bytes, placement, access, selector, current)| Request { bytes, placement, access, selector, current },
    )
}

/// Evidence from a tracker fed a random workload.
fn evidence() -> impl Strategy<Value = Option<Recommendations>> {
    let op = (bytes(), pick(AccessPattern::iter().collect()), 0..50usize, 0..50usize);
    prop::option::of(prop::collection::vec(op, 0..40).prop_map(|ops| {
        let tracker =
            UsageTracker::with_config(TrackerConfig { buffer_cap: 16, access_cap: 64, ..TrackerConfig::default() })
                .unwrap();
        for (bytes, access, reads, uses) in ops {
            let id = tracker.register(bytes, Placement::Auto, access, PoolKind::DeviceLocal);
            for _ in 0..reads {
                tracker.record_host_read(&id, bytes);
            }
            for _ in 0..uses {
                tracker.record_device_use(&id);
            }
            tracker.retire(id);
        }
        tracker.recommendations()
    }))
}

fn decider() -> impl Strategy<Value = Decider> {
    (0u64..1 << 30, 1u64..1 << 32, 0.0..=1.0f64, any::<bool>(), any::<bool>(), any::<bool>()).prop_filter_map(
        "ordered thresholds",
        |(small, medium, pressure, big_pins, streams, current_first)| {
            Decider::new(DecisionConfig {
                thresholds: Thresholds::new(small, medium).ok()?,
                pressure_threshold: pressure,
                large_host_frequent_to_pinned: big_pins,
                large_streams_to_pinned: streams,
                spread: if current_first { Spread::CurrentFirst } else { Spread::Balance },
            })
            .ok()
        },
    )
}

/// The size class as documented, computed without [`SizeClass::of`]: the number of maxima (`small_max`,
/// `medium_max`, both inclusive) the size is above picks small, medium or large.
fn documented_class(bytes: u64, thresholds: &Thresholds) -> SizeClass {
    let above = [thresholds.small_max, thresholds.medium_max].iter().filter(|&&max| bytes > max).count();
    [SizeClass::Small, SizeClass::Medium, SizeClass::Large][above]
}

/// A size at or within two bytes of one of the decider's maxima.
fn near_a_threshold(thresholds: &Thresholds, medium: bool, offset: i64) -> u64 {
    let max = if medium { thresholds.medium_max } else { thresholds.small_max };
    max.saturating_add_signed(offset).max(1)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Requests at and around either maximum get the documented class, and Auto on a GPU of unknown size gives
    /// them the table's pool for that class (pinned host memory for small, device-local memory otherwise).
    #[test]
    fn sizes_at_the_thresholds_get_the_documented_class(
        decider in decider(), medium in any::<bool>(), offset in -2i64..=2,
    ) {
        let thresholds = decider.config().thresholds;
        let bytes = near_a_threshold(&thresholds, medium, offset);
        let gpu = DeviceView {
            index: 1,
            name: "gpu".into(),
            kind: DeviceKind::DiscreteGpu,
            apis: vec![Api::Cuda],
            shares_memory_with_host: false,
            total_bytes: 0,
            free_bytes: 0,
            cached_bytes: 0,
            pools: vec![PoolKind::DeviceLocal, PoolKind::HostPinned],
            max_allocation: 0,
        };
        let d = decider.decide(&Request::new(bytes), &[DeviceView::host(0, 1 << 40, 1 << 39), gpu], None).unwrap();
        let class = documented_class(bytes, &thresholds);
        prop_assert_eq!(d.size_class, class, "{} B with {:?}", bytes, thresholds);
        let pool = if class == SizeClass::Small { PoolKind::HostPinned } else { PoolKind::DeviceLocal };
        prop_assert_eq!((d.device, d.pool), (1, pool), "{}", d.reason());
    }

    #[test]
    fn decide_returns_an_existing_device_and_an_offered_pool(
        decider in decider(), req in request(), devices in devices(), evidence in evidence(),
    ) {
        let result = decider.decide(&req, &devices, evidence.as_ref());
        let selectable = devices.iter().any(|d| req.selector.matches(d));
        let hosts = || devices.iter().filter(|d| d.kind == DeviceKind::Host);
        let full_host = |d: &DeviceView| d.offers(PoolKind::Host) && d.offers(PoolKind::HostPinned);
        let has_host = hosts().next().is_some() && hosts().all(full_host);
        match result {
            Ok(d) => {
                let device = devices.iter().find(|v| v.index == d.device);
                prop_assert!(device.is_some(), "device {} does not exist", d.device);
                prop_assert!(device.unwrap().offers(d.pool), "device {} lacks {}", d.device, d.pool);
                prop_assert_eq!(d.size_class, documented_class(req.bytes, &decider.config().thresholds));
                prop_assert!(d.reason().ends_with('.') && d.reason().len() > 40, "{}", d.reason());
                prop_assert!(selectable && req.bytes > 0);
                // A selector that names devices keeps the request on them.
                if req.selector != DeviceSelector::Any {
                    prop_assert!(req.selector.matches(device.unwrap()), "{} left the selection: {}", d.device, d.reason());
                }
            }
            Err(e) => {
                prop_assert!(!e.to_string().is_empty());
                // With hosts that offer both host pools, a non-empty request and a selector that matches
                // the host or any device, a decision always exists. A selector that names accelerators alone
                // fails only where none of them offers a pool the request can use.
                let host_selected = req.selector == DeviceSelector::Any
                    || devices.iter().any(|d| d.kind == DeviceKind::Host && req.selector.matches(d));
                if host_selected {
                    prop_assert!(req.bytes == 0 || !selectable || !has_host, "{}", e);
                } else if req.bytes > 0 && selectable {
                    let usable: &[PoolKind] = match req.placement {
                        // Auto takes read-only memory only for data declared read-only.
                        Placement::Auto if req.access == AccessPattern::ReadOnly => {
                            &[PoolKind::DeviceLocal, PoolKind::HostPinned, PoolKind::ReadOnly]
                        }
                        Placement::Auto => &[PoolKind::DeviceLocal, PoolKind::HostPinned],
                        Placement::ReadOnly => &[PoolKind::ReadOnly, PoolKind::DeviceLocal, PoolKind::HostPinned],
                        Placement::DeviceLocal => &[PoolKind::DeviceLocal, PoolKind::HostPinned],
                        Placement::HostPinned => &[PoolKind::HostPinned],
                    };
                    let servable = devices
                        .iter()
                        .filter(|d| req.selector.matches(d) && d.kind != DeviceKind::Host)
                        .any(|d| usable.iter().any(|&k| d.offers(k)));
                    prop_assert!(!servable, "a selected device could serve it: {}", e);
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Register(u64, AccessPattern, PoolKind),
    Read(usize, u64),
    Write(usize, u64),
    Use(usize),
    Retire(usize),
    Decay(f64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (bytes(), pick(AccessPattern::iter().collect()), pick(PoolKind::iter().collect()))
            .prop_map(|(b, a, p)| Op::Register(b, a, p)),
        (any::<usize>(), bytes()).prop_map(|(i, b)| Op::Read(i, b)),
        (any::<usize>(), bytes()).prop_map(|(i, b)| Op::Write(i, b)),
        any::<usize>().prop_map(Op::Use),
        any::<usize>().prop_map(Op::Retire),
        (-0.5..1.5f64).prop_map(Op::Decay),
    ]
}

proptest! {
    #[test]
    fn tracker_survives_any_workload(ops in prop::collection::vec(op(), 0..300), cap in 1u64..64) {
        let tracker = UsageTracker::with_config(TrackerConfig { buffer_cap: cap, access_cap: cap, ..TrackerConfig::default() }).unwrap();
        let mut live = Vec::new();
        for op in ops {
            match op {
                Op::Register(b, a, p) => live.push(tracker.register(b, Placement::Auto, a, p)),
                Op::Read(i, b) if !live.is_empty() => tracker.record_host_read(&live[i % live.len()], b),
                Op::Write(i, b) if !live.is_empty() => tracker.record_host_write(&live[i % live.len()], b),
                Op::Use(i) if !live.is_empty() => tracker.record_device_use(&live[i % live.len()]),
                Op::Retire(i) if !live.is_empty() => {
                    let n = live.len();
                    tracker.retire(live.swap_remove(i % n));
                }
                Op::Decay(f) => prop_assert_eq!(tracker.decay(f).is_ok(), (0.0..=1.0).contains(&f)),
                _ => {}
            }
        }
        let recs = tracker.recommendations();
        prop_assert_eq!(recs.items.len(), 5);
        let live_total: u64 = recs.items.iter().map(|r| r.evidence.live_buffers).sum();
        prop_assert_eq!(live_total, live.len() as u64);
        for r in &recs.items {
            prop_assert!(r.placement != Placement::Auto);
            prop_assert!((0.0..=1.0).contains(&r.evidence.host_access_share));
            prop_assert!(r.evidence.buffers <= cap.max(live.len() as u64) + 5 * cap, "{:?}", r.evidence);
        }
        prop_assert!(serde_json::to_string(&recs).is_ok());
    }
}
