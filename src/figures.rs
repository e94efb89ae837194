//! The device figures placement decisions are made on, and when they move.
//!
//! - **Measured** ([`measure`]): each device's free memory through its API (a driver call), and what umm's own
//!   pools hold there: reserved bytes, and of them the bytes no buffer uses, which are free to umm's next
//!   allocation though not to other programs ([`DeviceView::cached_bytes`]). Done by a refresh, every
//!   [`UmmConfig::device_refresh`](crate::UmmConfig) at most.
//! - **Estimated** ([`estimate`]): between two refreshes, without a driver call. A pool that took memory from the
//!   device since the refresh took it from the device's free memory, so free memory now is the refresh's figure
//!   less the pools' growth since; what the pools hold unused is read from their books. What other programs did
//!   since the refresh is not seen until the next one. Done when a pool of a device that Auto chooses among
//!   others grows, and before such a choice, so that a burst of buffers spreads as the figures move rather than
//!   piling onto the device that led at the last refresh.
//! - **What decisions depend on** ([`Signature`]): which devices are under pressure, their order by available
//!   memory and the evidence `Auto` follows. A change moves the placement epoch, so that every thread decides
//!   afresh.

use crate::device::Device;
use umm_placement::{DeviceKind, DeviceSelector, DeviceView, Placement, PoolKind, Recommendations, Subject};

/// A device's figures at the last refresh, that estimates start from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Baseline {
    /// Free memory as the device reported it.
    free: u64,
    /// What umm's pools held from the device at that moment.
    reserved: u64,
}

/// What umm's pools hold of a device's memory: reserved bytes, and of them the bytes no buffer uses
/// ([`umm_backends::Pool::unused_bytes`]). Pinned pools of an accelerator hold host memory and do not count. Takes
/// each pool's lock briefly, none of its thread caches'; no driver call.
fn holdings(device: &Device) -> (u64, u64) {
    let host = device.kind() == DeviceKind::Host;
    device
        .pools()
        .iter()
        .filter(|(_, kind, _)| host || *kind != PoolKind::HostPinned)
        .fold((0, 0), |(reserved, unused), (_, _, pool)| {
            (reserved + pool.reserved_bytes(), unused + pool.unused_bytes())
        })
}

/// Every device's view, asking each device for its free memory, with the baselines later estimates start from.
pub(crate) fn measure(devices: &[std::sync::Arc<Device>]) -> (Vec<DeviceView>, Vec<Baseline>) {
    devices
        .iter()
        .map(|device| {
            let mut view = device.view();
            let (reserved, unused) = holdings(device);
            view.cached_bytes = unused;
            let base = Baseline { free: view.free_bytes, reserved };
            (view, base)
        })
        .unzip()
}

/// The views as they stand now, estimated from `views` and their `baselines` and the pools' books, with no driver
/// call (see the module's documentation).
pub(crate) fn estimate(
    devices: &[std::sync::Arc<Device>],
    views: &[DeviceView],
    baselines: &[Baseline],
) -> Vec<DeviceView> {
    devices
        .iter()
        .zip(views)
        .zip(baselines)
        .map(|((device, view), base)| {
            let (reserved, unused) = holdings(device);
            let mut view = view.clone();
            let free = (base.free + base.reserved).saturating_sub(reserved);
            view.free_bytes = if view.total_bytes == 0 { free } else { free.min(view.total_bytes) };
            view.cached_bytes = unused;
            view
        })
        .collect()
}

/// How many bytes a thread may place with a remembered choice among several accelerators before it chooses
/// again: the chosen device's lead in available memory over the best other device that could have served, at
/// least 1/256 of the chosen device's memory (so that small buffers do not each decide), unbounded where no other
/// device could have served and for host memory. The budget is per thread: threads that place at once may
/// overshoot the lead, and a pool that grows under them moves the figures anyway.
pub(crate) fn spread_budget(views: &[DeviceView], chosen: usize, pool: PoolKind, selector: DeviceSelector) -> u64 {
    // Pinned and pageable memory are host memory: no device's figures move with them.
    if matches!(pool, PoolKind::HostPinned | PoolKind::Host) {
        return u64::MAX;
    }
    let Some(at) = views.iter().position(|v| v.index == chosen) else { return u64::MAX };
    let rivals = views
        .iter()
        .enumerate()
        .filter(|&(i, v)| i != at && v.is_accelerator() && v.offers(pool) && selector.matches(v))
        // Without a selector Auto shuns software devices (see the decider): they are no rivals.
        .filter(|(_, v)| v.kind != DeviceKind::Cpu || selector != DeviceSelector::Any)
        .map(|(_, v)| v.available_bytes());
    let Some(best_rival) = rivals.max() else { return u64::MAX };
    let lead = views[at].available_bytes().saturating_sub(best_rival);
    lead.max(views[at].total_bytes / 256)
}

/// What decisions depend on besides the request: which devices are under pressure, their order by available
/// memory, and what `Auto` follows of the evidence (each subject's recommended placement and whether evidence
/// backs it), not the evidence's running sums, which move with every buffer.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Signature {
    pressure: Vec<bool>,
    by_available: Vec<usize>,
    followed: Vec<(Subject, Placement, bool)>,
}

impl Signature {
    pub(crate) fn of(views: &[DeviceView], pressure_threshold: f64, evidence: Option<&Recommendations>) -> Self {
        let mut by_available: Vec<usize> = (0..views.len()).collect();
        by_available.sort_by(|&a, &b| views[b].available_bytes().cmp(&views[a].available_bytes()).then(a.cmp(&b)));
        let followed = evidence
            .map(|e| e.items.iter().map(|r| (r.subject, r.placement, r.from_evidence)).collect())
            .unwrap_or_default();
        Signature {
            pressure: views.iter().map(|v| v.used_fraction() > pressure_threshold).collect(),
            by_available,
            followed,
        }
    }

    /// This signature with `views`' pressure and order, keeping the evidence part.
    pub(crate) fn with_views(&self, views: &[DeviceView], pressure_threshold: f64) -> Self {
        let fresh = Signature::of(views, pressure_threshold, None);
        Signature { followed: self.followed.clone(), ..fresh }
    }
}

/// What the refreshing thread holds: the signature decisions were last made under and the baselines of the
/// last refresh.
#[derive(Debug, Default)]
pub(crate) struct RefreshState {
    pub(crate) signature: Signature,
    pub(crate) baselines: Vec<Baseline>,
}
