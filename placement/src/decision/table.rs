//! The decision table itself: [`Decider`], which applies it, with the helpers that choose a device and a pool.

use std::sync::Arc;

use super::outcome::{Step, Why};
use super::{Decision, DecisionConfig, Request, Spread};
use crate::device::{describe_devices, DeviceKind, DeviceSelector, DeviceView};
use crate::error::{Error, Result};
use crate::placement::{AccessPattern, Placement, PoolKind, SizeClass};
use crate::recommend::Recommendations;

/// Applies the decision table. Cheap to clone; holds only its settings.
///
/// # The table
/// Explicit placements are honoured on the chosen device; where no selected device offers the pool the chain
/// falls back `ReadOnly → DeviceLocal → pinned host memory → pageable host memory`, and the reason says so.
///
/// [`Placement::Auto`] first picks a placement:
///
/// | access \ size               | small        | medium      | large                                   |
/// |-----------------------------|--------------|-------------|-----------------------------------------|
/// | `ReadOnly`                  | ReadOnly     | ReadOnly    | ReadOnly                                |
/// | `HostFrequent`              | HostPinned   | HostPinned  | HostPinned (DeviceLocal if `large_host_frequent_to_pinned` is off) |
/// | `Sequential`, `WriteOnly`   | HostPinned   | DeviceLocal | DeviceLocal (HostPinned if `large_streams_to_pinned` is on) |
/// | anything else               | HostPinned   | DeviceLocal | DeviceLocal                             |
///
/// then lets usage evidence override it: when the [`Recommendation`](crate::Recommendation) for the buffer's
/// [`Subject`](crate::Subject) is backed by evidence and differs from the subject's table default, Auto follows
/// it. Then it picks a device:
/// - **Host memory only** (no accelerator among the views): everything goes to the host, pageable unless pinned
///   was asked for explicitly.
/// - **Pressure**: among the selected accelerators offering the pool, those whose used fraction
///   `(total - available) / total` is above `pressure_threshold`, or whose available memory is less than the
///   request, are skipped ([`DeviceView::available_bytes`]: free memory plus what the caller's pools hold
///   unused). If all are skipped, Auto falls back to pinned host memory. Explicit placements are honoured even
///   under pressure.
/// - **Spread** ([`DecisionConfig::spread`]): of the rest, [`Spread::Balance`] takes the one with the most
///   available memory (ties: the lower index), so consecutive large buffers spread over the devices as their
///   figures move; [`Spread::CurrentFirst`] takes the current device ([`Request::current`]) while it is among
///   them, and the most available otherwise. An explicit placement without a current device goes to the device
///   with the most available memory.
/// - **Largest allocation**: when the decider chooses the device (selector `Any`), a device whose
///   [`DeviceView::max_allocation`] is below the request is passed over, with the reason; with none left the
///   chain goes on (for `DeviceLocal`, to pinned host memory).
/// - **Software devices**: with selector `Any` no placement goes to a [`DeviceKind::Cpu`] device (llvmpipe,
///   lavapipe, PoCL) while host memory is among the views: it is host memory behind a slower API. The exception
///   is the current device ([`Request::current`]): an explicit placement goes to a software device made current.
/// - **Current device**: an explicit placement with selector `Any` goes to [`Request::current`] when that device
///   offers its pool (for `ReadOnly`, read-only memory, else device-local) and can hold the request in one
///   allocation; otherwise the rules below choose.
/// - **Shared memory**: if the chosen device shares memory with the host and offers a pinned pool, Auto turns
///   `DeviceLocal` into `HostPinned` (zero-copy). `ReadOnly` stays.
/// - **Pinned memory** goes through the selected accelerator with the most free memory that offers a pinned pool
///   (so the device can DMA from it), else the host's pinned pool, else pageable host memory. Device memory
///   pressure does not matter for pinned memory.
#[derive(Debug, Clone, Default)]
pub struct Decider {
    config: DecisionConfig,
}

/// The position (in `devices`) of the device with the most memory free to the caller (ties: the lower index).
fn most_free(devices: &[DeviceView], positions: impl IntoIterator<Item = usize>) -> Option<usize> {
    positions.into_iter().max_by(|&a, &b| {
        let (a, b) = (&devices[a], &devices[b]);
        a.available_bytes().cmp(&b.available_bytes()).then(b.index.cmp(&a.index))
    })
}

impl Decider {
    /// A decider with these settings.
    ///
    /// # Errors
    /// As [`DecisionConfig::validate`].
    pub fn new(config: DecisionConfig) -> Result<Self> {
        config.validate()?;
        Ok(Decider { config })
    }

    /// The decider's settings.
    pub fn config(&self) -> &DecisionConfig {
        &self.config
    }

    /// Decides where `req` goes among `devices` (whose indices should be unique), following `evidence` for Auto
    /// where it contradicts the table. O(devices × (apis + pools)). Copies `devices` into the decision (for its
    /// reason); [`Decider::decide_shared`] shares them instead.
    ///
    /// # Errors
    /// [`Error::ZeroSize`] for a zero-byte request; [`Error::NoDevice`] when the selector matches no device;
    /// [`Error::ImpossiblePlacement`] when neither the selected devices nor the host offer any usable pool.
    pub fn decide(
        &self,
        req: &Request,
        devices: &[DeviceView],
        evidence: Option<&Recommendations>,
    ) -> Result<Decision> {
        self.decide_shared(req, &Arc::from(devices), evidence)
    }

    /// As [`Decider::decide`], on devices the decision shares (one reference count, no copy): what a caller
    /// deciding often on the same figures uses. Formats nothing unless it fails.
    ///
    /// # Errors
    /// As [`Decider::decide`].
    pub fn decide_shared(
        &self,
        req: &Request,
        devices: &Arc<[DeviceView]>,
        evidence: Option<&Recommendations>,
    ) -> Result<Decision> {
        if req.bytes == 0 {
            return Err(Error::ZeroSize);
        }
        let all: &[DeviceView] = devices;
        let size_class = SizeClass::of(req.bytes, &self.config.thresholds);
        // Without a selector no placement goes to a software or CPU runtime (llvmpipe, lavapipe, PoCL) while host
        // memory is there: it is host memory behind a slower API. Such a device serves when a selector names it.
        // A software device the caller made current (`set_current_device`) was chosen as much as by a selector:
        // its explicit placements go there.
        let host_exists = all.iter().any(|d| d.kind == DeviceKind::Host);
        let shun_software = req.selector == DeviceSelector::Any && host_exists;
        let chosen = req.current.filter(|_| req.placement != Placement::Auto && req.selector == DeviceSelector::Any);
        let usable = |d: &DeviceView| !(shun_software && d.kind == DeviceKind::Cpu) || chosen == Some(d.index);
        let candidates: Vec<usize> =
            (0..all.len()).filter(|&i| req.selector.matches(&all[i]) && usable(&all[i])).collect();
        if candidates.is_empty() {
            return Err(Error::NoDevice { asked: req.selector.describe(), available: describe_devices(all) });
        }
        // A selector that names accelerators keeps the request on them: host memory is a fallback only for a
        // request on any device, or one whose selector matches the host.
        let hosts: Vec<usize> = (0..all.len())
            .filter(|&i| all[i].kind == DeviceKind::Host)
            .filter(|&i| req.selector == DeviceSelector::Any || candidates.contains(&i))
            .collect();
        let mut steps = Vec::with_capacity(4);
        let impossible = || Error::ImpossiblePlacement { asked: req.describe(), available: describe_devices(all) };
        let decision = |at: usize, pool: PoolKind, steps: Vec<Step>| Decision {
            device: all[at].index,
            pool,
            size_class,
            why: Why::Table {
                request: *req,
                thresholds: self.config.thresholds,
                pressure_threshold: self.config.pressure_threshold,
                devices: Arc::clone(devices),
                steps,
            },
        };

        if !all.iter().filter(|d| usable(d)).any(DeviceView::is_accelerator) {
            let order = if req.placement == Placement::HostPinned {
                [PoolKind::HostPinned, PoolKind::Host]
            } else {
                [PoolKind::Host, PoolKind::HostPinned]
            };
            for kind in order {
                if let Some(&host) = candidates.iter().find(|&&i| all[i].offers(kind)) {
                    steps.push(if all.iter().any(DeviceView::is_accelerator) {
                        Step::SoftwareShunned { kind, host }
                    } else {
                        Step::HostOnly { kind, host }
                    });
                    return Ok(decision(host, kind, steps));
                }
            }
            return Err(impossible());
        }

        let auto = req.placement == Placement::Auto;
        let want = if auto {
            self.auto_placement(req, size_class, evidence, &mut steps)
        } else {
            steps.push(Step::Explicit);
            req.placement
        };
        let accels: Vec<usize> = candidates.iter().copied().filter(|&i| all[i].is_accelerator()).collect();
        if accels.is_empty() {
            steps.push(Step::NoAcceleratorSelected);
        }

        // An explicit placement without a selector goes to the current device where it offers the pool (the first
        // of the chain it offers), as a cudarc or PyTorch user expects, so that consecutive buffers share a device
        // and an API; it is honoured there under pressure, as explicit placements are.
        let current = req.current.filter(|_| !auto && req.selector == DeviceSelector::Any);
        if let Some(at) = current.and_then(|index| accels.iter().copied().find(|&i| all[i].index == index)) {
            let offered = match want {
                Placement::ReadOnly => {
                    [PoolKind::ReadOnly, PoolKind::DeviceLocal].into_iter().find(|&k| all[at].offers(k))
                }
                Placement::DeviceLocal => Some(PoolKind::DeviceLocal).filter(|&k| all[at].offers(k)),
                Placement::HostPinned => Some(PoolKind::HostPinned).filter(|&k| all[at].offers(k)),
                Placement::Auto => None,
            };
            if let Some(kind) = offered.filter(|_| all[at].fits(req.bytes)) {
                steps.push(Step::Current(at));
                return Ok(decision(at, kind, steps));
            }
        }
        let chain: &[PoolKind] = match want {
            Placement::ReadOnly => &[PoolKind::ReadOnly, PoolKind::DeviceLocal],
            Placement::DeviceLocal => &[PoolKind::DeviceLocal],
            Placement::HostPinned | Placement::Auto => &[],
        };
        for &kind in chain {
            // A device that cannot hold the request in one allocation is passed over when the decider chooses the
            // device; a selector that names devices gets what it named (and the allocation's own error).
            let choosing = req.selector == DeviceSelector::Any;
            let (offering, too_big): (Vec<usize>, Vec<usize>) = accels
                .iter()
                .copied()
                .filter(|&i| all[i].offers(kind))
                .partition(|&i| !choosing || all[i].fits(req.bytes));
            steps.extend(too_big.iter().map(|&i| Step::TooBig(i)));
            if offering.is_empty() {
                if !accels.is_empty() && too_big.is_empty() {
                    steps.push(Step::NoOffer(kind));
                }
                continue;
            }
            let (cool, hot): (Vec<usize>, Vec<usize>) =
                offering.iter().partition(|&&i| !self.under_pressure(&all[i], req.bytes));
            if auto {
                steps.extend(hot.iter().map(|&i| Step::UnderPressure(i)));
                let current_first = (self.config.spread == Spread::CurrentFirst)
                    .then_some(req.current)
                    .flatten()
                    .and_then(|index| cool.iter().copied().find(|&i| all[i].index == index));
                let Some(device) = current_first.or_else(|| most_free(all, cool.iter().copied())) else {
                    steps.push(Step::AllUnderPressure);
                    return self
                        .fallback(all, &accels, &hosts, auto, req.access == AccessPattern::ReadOnly, &mut steps)
                        .map(|(d, p)| decision(d, p, steps))
                        .ok_or_else(impossible);
                };
                steps.push(if current_first.is_some() {
                    Step::CurrentFirst { device, kind }
                } else {
                    Step::MostFree { device, kind, among: cool.len() }
                });
                if all[device].shares_memory_with_host && kind == PoolKind::DeviceLocal {
                    if all[device].offers(PoolKind::HostPinned) {
                        steps.push(Step::SharedPinned(device));
                        return Ok(decision(device, PoolKind::HostPinned, steps));
                    }
                    steps.push(Step::SharedNoPinned(device));
                }
                return Ok(decision(device, kind, steps));
            }
            let device = most_free(all, cool.iter().copied())
                .or_else(|| most_free(all, hot.iter().copied()))
                .unwrap_or(offering[0]);
            steps.push(if self.under_pressure(&all[device], req.bytes) {
                Step::HonouredUnderPressure(device)
            } else {
                Step::Chose(device)
            });
            return Ok(decision(device, kind, steps));
        }
        if !chain.is_empty() {
            steps.push(Step::FallsBackToHost);
        }
        self.fallback(all, &accels, &hosts, auto, req.access == AccessPattern::ReadOnly, &mut steps)
            .map(|(d, p)| decision(d, p, steps))
            .ok_or_else(impossible)
    }

    /// Where a request goes when its chain found nothing on the selected accelerators: pinned memory
    /// ([`Decider::pinned`]), on the host only where the selector allows it (`hosts`: every host for a request
    /// on any device, else the hosts the selector matches). A selector that names accelerators keeps the request
    /// on them: Auto falls back to device-local memory there; an explicit placement they cannot serve is
    /// impossible.
    fn fallback(
        &self,
        all: &[DeviceView],
        accels: &[usize],
        hosts: &[usize],
        auto: bool,
        read_only_data: bool,
        steps: &mut Vec<Step>,
    ) -> Option<(usize, PoolKind)> {
        if let Some(found) = self.pinned(all, accels, hosts, steps) {
            return Some(found);
        }
        if !auto {
            return None;
        }
        // Read-only memory only for data declared read-only.
        let kinds: &[PoolKind] =
            if read_only_data { &[PoolKind::DeviceLocal, PoolKind::ReadOnly] } else { &[PoolKind::DeviceLocal] };
        kinds.iter().find_map(|&kind| {
            let device = most_free(all, accels.iter().copied().filter(|&i| all[i].offers(kind)))?;
            steps.push(Step::StaysOnSelected { device, kind });
            Some((device, kind))
        })
    }

    /// The table's placement for Auto, overridden by evidence where it contradicts the table.
    fn auto_placement(
        &self,
        req: &Request,
        size_class: SizeClass,
        evidence: Option<&Recommendations>,
        steps: &mut Vec<Step>,
    ) -> Placement {
        use AccessPattern as A;
        use Placement as P;
        use SizeClass as S;
        let cfg = &self.config;
        let (table, rule) = match (req.access, size_class) {
            (A::ReadOnly, _) => (P::ReadOnly, "read-only data goes to read-only device memory"),
            (A::HostFrequent, S::Large) if !cfg.large_host_frequent_to_pinned => (
                P::DeviceLocal,
                "large host-frequent buffers stay in device memory (large_host_frequent_to_pinned is off)",
            ),
            (A::HostFrequent, _) => (P::HostPinned, "data the host touches often goes to pinned host memory"),
            (_, S::Small) => (P::HostPinned, "small buffers go to pinned host memory"),
            (_, S::Medium) => (P::DeviceLocal, "medium buffers go to device-local memory"),
            (A::Sequential | A::WriteOnly, S::Large) if cfg.large_streams_to_pinned => (
                P::HostPinned,
                "large sequential or write-only streams go to pinned host memory (large_streams_to_pinned is on)",
            ),
            (_, S::Large) => (P::DeviceLocal, "large buffers go to device-local memory"),
        };
        steps.push(Step::TableRule(rule));
        let rec = evidence.and_then(|e| e.for_buffer(size_class, req.access));
        if let Some(rec) = rec {
            let decisive = rec.from_evidence
                && rec.placement != Placement::Auto
                && rec.placement != rec.subject.table_default()
                && rec.placement != table;
            if decisive {
                steps.push(Step::Evidence { placement: rec.placement, reason: rec.reason.clone() });
                return rec.placement;
            }
        }
        table
    }

    /// Pinned host memory: through the selected accelerator with the most free memory that offers it, else the
    /// pinned pool of one of `hosts`, else pageable memory there. Returns the device's position and the pool.
    fn pinned(
        &self,
        all: &[DeviceView],
        accels: &[usize],
        hosts: &[usize],
        steps: &mut Vec<Step>,
    ) -> Option<(usize, PoolKind)> {
        if let Some(device) = most_free(all, accels.iter().copied().filter(|&i| all[i].offers(PoolKind::HostPinned))) {
            steps.push(Step::PinnedThrough(device));
            return Some((device, PoolKind::HostPinned));
        }
        if let Some(&host) = hosts.iter().find(|&&i| all[i].offers(PoolKind::HostPinned)) {
            steps.push(Step::PinnedHost(host));
            return Some((host, PoolKind::HostPinned));
        }
        let &host = hosts.iter().find(|&&i| all[i].offers(PoolKind::Host))?;
        steps.push(Step::Pageable(host));
        Some((host, PoolKind::Host))
    }

    /// Whether Auto avoids `device` for a request of `bytes`: used fraction above the threshold, or too little
    /// free memory. Devices of unknown size are never under pressure.
    fn under_pressure(&self, device: &DeviceView, bytes: u64) -> bool {
        device.total_bytes > 0
            && (device.used_fraction() > self.config.pressure_threshold || device.available_bytes() < bytes)
    }
}
