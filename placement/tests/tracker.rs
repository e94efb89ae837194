//! The usage tracker: aggregation, recommendations, decay, and Auto following the evidence.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use umm_placement::{
    AccessPattern, Decider, Placement, PoolKind, Recommendations, Request, SizeClass, Subject, Thresholds,
    TrackerConfig, UsageTracker,
};

fn medium(tracker: &UsageTracker, host_reads: usize, device_uses: usize) {
    let id = tracker.register(MIB, Placement::Auto, AccessPattern::ReadWrite, PoolKind::DeviceLocal);
    tracker.record_host_write(&id, MIB);
    for _ in 0..device_uses {
        tracker.record_device_use(&id);
    }
    for _ in 0..host_reads {
        tracker.record_host_read(&id, MIB);
    }
    tracker.retire(id);
}

#[test]
fn fresh_tracker_recommends_table_defaults() {
    let recs = UsageTracker::default().recommendations();
    assert_eq!(recs.items.len(), 5);
    for r in &recs.items {
        assert_eq!(r.placement, r.subject.table_default());
        assert!(!r.from_evidence);
        assert!(r.reason.contains("no evidence yet; table default"), "{}", r.reason);
    }
}

#[test]
fn medium_buffers_flip_to_pinned_after_many_host_reads_and_auto_follows() {
    let tracker = UsageTracker::default();
    let decider = Decider::default();
    let req = Request::new(MIB).access(AccessPattern::ReadWrite);

    // Phase 1: buffers live on the device; the host writes each once.
    for _ in 0..16 {
        medium(&tracker, 0, 10);
    }
    let recs = tracker.recommendations();
    let rec = recs.get(Subject::MediumBuffers).unwrap();
    assert_eq!((rec.placement, rec.from_evidence), (Placement::DeviceLocal, true), "{}", rec.reason);
    assert!(rec.reason.contains("agrees with the table default"), "{}", rec.reason);
    let d = decider.decide(&req, &machine(), Some(&recs)).unwrap();
    assert_eq!(d.pool, PoolKind::DeviceLocal);

    // Phase 2: the results are read back to the host every step.
    for _ in 0..64 {
        medium(&tracker, 40, 10);
    }
    let recs = tracker.recommendations();
    let rec = recs.get(Subject::MediumBuffers).unwrap();
    assert_eq!((rec.placement, rec.from_evidence), (Placement::HostPinned, true), "{}", rec.reason);
    assert!(rec.reason.contains("medium (64 KiB < size <= 16 MiB) buffers: the host made"), "{}", rec.reason);
    let e = &rec.evidence;
    assert_eq!((e.buffers, e.live_buffers, e.retired), (80, 0, 80));
    assert_eq!((e.host_reads, e.host_writes, e.device_uses), (64 * 40, 80, 800));
    assert_eq!(e.host_read_bytes, 64 * 40 * MIB);
    assert_eq!((e.auto_buffers, e.in_pool.device_local), (80, 80));
    assert!(e.host_access_share > 0.5 && e.mean_lifetime_ms.is_some());

    let d = decider.decide(&req, &machine(), Some(&recs)).unwrap();
    assert_eq!((d.device, d.pool), (1, PoolKind::HostPinned), "{}", d.reason());
    assert!(d.reason().contains("but usage evidence says host_pinned: medium"), "{}", d.reason());
    // Other subjects and explicit placements are untouched by it.
    let d = decider.decide(&Request::new(64 * MIB), &machine(), Some(&recs)).unwrap();
    assert_eq!(d.pool, PoolKind::DeviceLocal);
    let d = decider.decide(&req.placement(Placement::DeviceLocal), &machine(), Some(&recs)).unwrap();
    assert_eq!(d.pool, PoolKind::DeviceLocal);
    // Buffers declared read-only have their own subject.
    let d = decider.decide(&Request::new(MIB).access(AccessPattern::ReadOnly), &machine(), Some(&recs)).unwrap();
    assert_eq!(d.pool, PoolKind::ReadOnly);
}

#[test]
fn small_buffers_the_host_never_touches_move_to_the_device() {
    let tracker = UsageTracker::default();
    for _ in 0..10 {
        let id = tracker.register(KIB, Placement::Auto, AccessPattern::Unknown, PoolKind::HostPinned);
        for _ in 0..20 {
            tracker.record_device_use(&id);
        }
        tracker.retire(id);
    }
    let recs = tracker.recommendations();
    assert_eq!(recs.get(Subject::SmallBuffers).unwrap().placement, Placement::DeviceLocal);
    let d = Decider::default().decide(&Request::new(KIB), &machine(), Some(&recs)).unwrap();
    assert_eq!(d.pool, PoolKind::DeviceLocal, "{}", d.reason());
}

#[test]
fn too_little_evidence_keeps_the_table() {
    let tracker = UsageTracker::default();
    for _ in 0..3 {
        medium(&tracker, 100, 0);
    }
    let recs = tracker.recommendations();
    let rec = recs.get(Subject::MediumBuffers).unwrap();
    assert_eq!((rec.placement, rec.from_evidence), (Placement::DeviceLocal, false));
    assert!(rec.reason.contains("too little evidence yet (3 buffers, 8 needed"), "{}", rec.reason);
}

#[test]
fn live_buffers_count_as_evidence_and_survive_decay() {
    let tracker = UsageTracker::default();
    let ids: Vec<_> = (0..8)
        .map(|_| tracker.register(MIB, Placement::Auto, AccessPattern::HostFrequent, PoolKind::HostPinned))
        .collect();
    tracker.decay(0.0).unwrap();
    let e = tracker.evidence(SizeClass::Medium, AccessPattern::HostFrequent);
    assert_eq!((e.buffers, e.live_buffers, e.host_reads), (0, 8, 0));
    for id in &ids {
        tracker.record_device_use(id);
    }
    let rec = tracker.recommendations().get(Subject::FrequentlyAccessedData).unwrap().clone();
    assert_eq!((rec.placement, rec.from_evidence), (Placement::DeviceLocal, true), "{}", rec.reason);
    for id in ids {
        tracker.retire(id);
    }
    assert_eq!(tracker.evidence(SizeClass::Medium, AccessPattern::HostFrequent).live_buffers, 0);
}

#[test]
fn decay_on_demand_scales_everything() {
    let tracker = UsageTracker::default();
    for _ in 0..16 {
        medium(&tracker, 4, 4);
    }
    let before = tracker.evidence(SizeClass::Medium, AccessPattern::ReadWrite);
    tracker.decay(0.5).unwrap();
    let after = tracker.evidence(SizeClass::Medium, AccessPattern::ReadWrite);
    assert_eq!((before.buffers, after.buffers), (16, 8));
    assert_eq!((before.host_reads, after.host_reads), (64, 32));
    assert_eq!((before.bytes, after.bytes), (16 * MIB, 8 * MIB));
    assert_eq!(before.host_access_share, after.host_access_share);
    assert_eq!(before.mean_lifetime_ms, after.mean_lifetime_ms);
    tracker.decay(0.0).unwrap();
    let recs = tracker.recommendations();
    assert!(recs.get(Subject::MediumBuffers).unwrap().reason.contains("no evidence yet"));
    assert!(matches!(
        tracker.decay(-1.0),
        Err(umm_placement::Error::InvalidConfig { field: "decay factor", ref value, .. }) if value == "-1"
    ));
}

#[test]
fn caps_halve_old_evidence_so_new_behaviour_wins() {
    let capped =
        UsageTracker::with_config(TrackerConfig { buffer_cap: 32, access_cap: 256, ..TrackerConfig::default() })
            .unwrap();
    let uncapped = UsageTracker::default();
    for tracker in [&capped, &uncapped] {
        // Old behaviour: device only (one host write per buffer). Then: read back 16 times per buffer.
        for _ in 0..32 {
            medium(tracker, 0, 8);
        }
        for _ in 0..12 {
            medium(tracker, 16, 8);
        }
    }
    let e = capped.evidence(SizeClass::Medium, AccessPattern::ReadWrite);
    assert!(e.buffers <= 32 && e.host_reads + e.host_writes + e.device_uses <= 256, "{e:?}");
    let rec = |t: &UsageTracker| t.recommendations().get(Subject::MediumBuffers).unwrap().placement;
    assert_eq!(rec(&capped), Placement::HostPinned);
    // Without the caps the old evidence still outweighs the new.
    assert_eq!(rec(&uncapped), Placement::DeviceLocal);
}

#[test]
fn sampled_registration_times_one_buffer_in_eight_and_counts_them_all() {
    let tracker = UsageTracker::default();
    // A fresh thread, so that its sample count starts at zero.
    let tracker = std::thread::scope(|s| {
        s.spawn(|| {
            let ids: Vec<_> = (0..2 * umm_placement::LIFETIME_SAMPLE)
                .map(|_| tracker.register_sampled(100, Placement::Auto, AccessPattern::Random, PoolKind::HostPinned))
                .collect();
            let timed = ids.iter().filter(|id| id.registered_at().is_some()).count();
            assert_eq!(timed, 2, "the first of each run of LIFETIME_SAMPLE is timed");
            for id in ids {
                // Untimed buffers have no registration time: their retirement carries no lifetime.
                let at = id.registered_at().map_or_else(Instant::now, |born| born + Duration::from_millis(20));
                tracker.retire_at(id, at);
            }
        });
        &tracker
    });
    let e = tracker.evidence(SizeClass::Small, AccessPattern::Random);
    assert_eq!(e.retired, 2 * u64::from(umm_placement::LIFETIME_SAMPLE));
    // The mean is over the timed buffers only: untimed ones do not pull it towards zero.
    assert_eq!(e.mean_lifetime_ms, Some(20.0), "{e:?}");
}

#[test]
fn lifetimes_are_measured() {
    let tracker = UsageTracker::default();
    let id = tracker.register(100, Placement::HostPinned, AccessPattern::Random, PoolKind::HostPinned);
    assert_eq!(id.size_class(), SizeClass::Small);
    let born = id.registered_at().expect("register times every buffer");
    let second = tracker.register(100, Placement::HostPinned, AccessPattern::Random, PoolKind::HostPinned);
    tracker.retire_at(id, born + Duration::from_millis(20));
    // A retirement dated before the registration is a lifetime of zero, not a negative one.
    tracker.retire_at(second, born.checked_sub(Duration::from_millis(5)).unwrap_or(born));
    let e = tracker.evidence(SizeClass::Small, AccessPattern::Random);
    assert_eq!(e.mean_lifetime_ms, Some(10.0), "the mean of 20 ms and 0 ms: {e:?}");
    assert_eq!((e.auto_buffers, e.in_pool.host_pinned), (0, 2));
}

#[test]
fn retiring_now_measures_the_time_since_registration() {
    let tracker = UsageTracker::default();
    let before = Instant::now();
    let id = tracker.register(100, Placement::HostPinned, AccessPattern::Random, PoolKind::HostPinned);
    tracker.retire(id);
    let bound = before.elapsed().as_secs_f64() * 1e3;
    let e = tracker.evidence(SizeClass::Small, AccessPattern::Random);
    let mean = e.mean_lifetime_ms.expect("a timed buffer");
    assert!((0.0..=bound).contains(&mean), "{mean} ms, at most the {bound} ms the test saw go by");
}

#[test]
fn tracker_thresholds_classify_buffers() {
    let tracker = UsageTracker::new(Thresholds::new(100, 1000).unwrap()).unwrap();
    let id = tracker.register(500, Placement::Auto, AccessPattern::Unknown, PoolKind::DeviceLocal);
    assert_eq!(id.size_class(), SizeClass::Medium);
    tracker.retire(id);
    let recs = tracker.recommendations();
    assert_eq!(recs.thresholds, Thresholds::new(100, 1000).unwrap());
    assert!(recs.get(Subject::MediumBuffers).unwrap().reason.contains("100 B < size <= 1000 B"));
}

#[test]
fn concurrent_recording_loses_nothing() {
    let tracker = Arc::new(UsageTracker::default());
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let tracker = Arc::clone(&tracker);
            std::thread::spawn(move || {
                for _ in 0..100 {
                    medium(&tracker, 3, 2);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let e = tracker.evidence(SizeClass::Medium, AccessPattern::ReadWrite);
    assert_eq!((e.buffers, e.host_reads, e.host_writes, e.device_uses), (800, 2400, 800, 1600));
}

#[test]
fn recommendations_serialize_and_never_say_auto() {
    let tracker = UsageTracker::default();
    for _ in 0..10 {
        medium(&tracker, 50, 1);
    }
    let recs = tracker.recommendations();
    let json = serde_json::to_value(&recs).unwrap();
    assert_eq!(json["items"][1]["subject"], "medium_buffers");
    assert_eq!(json["items"][1]["placement"], "host_pinned");
    assert_eq!(json["items"][0]["evidence"]["mean_lifetime_ms"], serde_json::Value::Null);
    let back: Recommendations = serde_json::from_value(json).unwrap();
    assert_eq!(back, recs);
    assert!(recs.items.iter().all(|r| r.placement != Placement::Auto));
    assert_eq!(recs.to_string().lines().count(), 5);
}
