//! The decision table: [`Decider::decide`] turns a [`Request`] and the [`DeviceView`]s of a machine into a
//! [`Decision`] (device, pool kind, size class, and the reason in a sentence).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::device::{describe_devices, DeviceKind, DeviceSelector, DeviceView};
use crate::error::{Error, Result};
use crate::placement::{AccessPattern, Placement, PoolKind, SizeClass, Thresholds};
use crate::recommend::Recommendations;
use crate::text;

/// What a caller asks for. Build with [`Request::new`] and the chained setters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Request {
    /// Size in bytes (must be > 0).
    pub bytes: u64,
    /// Where the caller wants it.
    pub placement: Placement,
    /// How it will be used.
    pub access: AccessPattern,
    /// Which devices it may go to.
    pub selector: DeviceSelector,
}

impl Request {
    /// A request for `bytes` bytes: `Auto`, access `Unknown`, any device.
    pub fn new(bytes: u64) -> Self {
        Request { bytes, placement: Placement::Auto, access: AccessPattern::Unknown, selector: DeviceSelector::Any }
    }

    /// Sets the placement.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Sets the access pattern.
    pub fn access(mut self, access: AccessPattern) -> Self {
        self.access = access;
        self
    }

    /// Sets the device selector.
    pub fn selector(mut self, selector: DeviceSelector) -> Self {
        self.selector = selector;
        self
    }

    /// The request in words: "device_local placement of 1 MiB (access read_write) on any device".
    pub fn describe(&self) -> String {
        format!(
            "{} placement of {} (access {}) on {}",
            self.placement,
            text::bytes(self.bytes),
            self.access,
            self.selector.describe()
        )
    }
}

/// Settings of a [`Decider`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecisionConfig {
    /// Size-class boundaries.
    pub thresholds: Thresholds,
    /// Fraction of a device's memory in use above which Auto avoids it (default 0.90; in [0, 1]).
    pub pressure_threshold: f64,
    /// Whether large buffers declared [`AccessPattern::HostFrequent`] go to pinned host memory (default true;
    /// turn off to keep huge staging buffers from locking host memory).
    pub large_host_frequent_to_pinned: bool,
    /// Whether large [`AccessPattern::Sequential`] and [`AccessPattern::WriteOnly`] buffers (streams touched
    /// about once) go to pinned host memory, read over the bus instead of copied (default false).
    pub large_streams_to_pinned: bool,
}

impl Default for DecisionConfig {
    fn default() -> Self {
        DecisionConfig {
            thresholds: Thresholds::default(),
            pressure_threshold: 0.90,
            large_host_frequent_to_pinned: true,
            large_streams_to_pinned: false,
        }
    }
}

impl DecisionConfig {
    /// Checks the thresholds and that `pressure_threshold` is in [0, 1].
    ///
    /// # Errors
    /// [`Error::InvalidThresholds`] or [`Error::InvalidConfig`].
    pub fn validate(&self) -> Result<()> {
        self.thresholds.validate()?;
        if !(0.0..=1.0).contains(&self.pressure_threshold) {
            return Err(Error::InvalidConfig {
                field: "pressure_threshold",
                value: self.pressure_threshold.to_string(),
                expected: "a fraction in [0, 1]",
            });
        }
        Ok(())
    }
}

/// Where a request goes, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The chosen device's [`DeviceView::index`].
    pub device: usize,
    /// The kind of pool on that device (one it offers).
    pub pool: PoolKind,
    /// The request's size class.
    pub size_class: SizeClass,
    /// A sentence naming the size class, the thresholds and the deciding facts.
    pub reason: String,
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {} {}: {}", self.device, self.pool, self.reason)
    }
}

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
///   `(total - free) / total` is above `pressure_threshold`, or whose free memory is less than the request, are
///   skipped; the one with the most free memory wins (ties: the lower index). If all are skipped, Auto falls back
///   to pinned host memory. Explicit placements are honoured even under pressure.
/// - **Largest allocation**: when the decider chooses the device (selector `Any`), a device whose
///   [`DeviceView::max_allocation`] is below the request is passed over, with the reason; with none left the
///   chain goes on (for `DeviceLocal`, to pinned host memory).
/// - **Software devices**: `Auto` with selector `Any` never picks a [`DeviceKind::Cpu`] device (llvmpipe,
///   lavapipe, PoCL) while host memory is among the views: it is host memory behind a slower API.
/// - **Shared memory**: if the chosen device shares memory with the host and offers a pinned pool, Auto turns
///   `DeviceLocal` into `HostPinned` (zero-copy). `ReadOnly` stays.
/// - **Pinned memory** goes through the selected accelerator with the most free memory that offers a pinned pool
///   (so the device can DMA from it), else the host's pinned pool, else pageable host memory. Device memory
///   pressure does not matter for pinned memory.
#[derive(Debug, Clone, Default)]
pub struct Decider {
    config: DecisionConfig,
}

/// The clauses of a reason, joined into one sentence at the end.
struct Reason(Vec<String>);

impl Reason {
    fn push(&mut self, clause: impl Into<String>) {
        self.0.push(clause.into());
    }

    fn sentence(self) -> String {
        let mut s = self.0.join("; ");
        if let Some(first) = s.get(..1) {
            let upper = first.to_ascii_uppercase();
            s.replace_range(..1, &upper);
        }
        s.push('.');
        s
    }
}

/// The device with the most free memory (ties: the lower index).
fn most_free<'a>(devices: impl IntoIterator<Item = &'a DeviceView>) -> Option<&'a DeviceView> {
    devices.into_iter().max_by(|a, b| a.free_bytes.cmp(&b.free_bytes).then(b.index.cmp(&a.index)))
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
    /// where it contradicts the table. O(devices × (apis + pools)).
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
        if req.bytes == 0 {
            return Err(Error::ZeroSize);
        }
        let thresholds = &self.config.thresholds;
        let size_class = SizeClass::of(req.bytes, thresholds);
        // Auto on any device never picks a software or CPU runtime (llvmpipe, lavapipe, PoCL) while host memory
        // is there: it is host memory behind a slower API. Such a device serves when a selector names it.
        let host_exists = devices.iter().any(|d| d.kind == DeviceKind::Host);
        let shun_software = req.placement == Placement::Auto && req.selector == DeviceSelector::Any && host_exists;
        let usable = |d: &&DeviceView| !(shun_software && d.kind == DeviceKind::Cpu);
        let candidates: Vec<&DeviceView> = devices.iter().filter(|d| req.selector.matches(d)).filter(usable).collect();
        if candidates.is_empty() {
            return Err(Error::NoDevice { asked: req.selector.describe(), available: describe_devices(devices) });
        }
        let mut why = Reason(vec![format!(
            "{} buffer of {} ({}), access {}",
            size_class,
            text::bytes(req.bytes),
            thresholds.describe(),
            req.access
        )]);
        let impossible = || Error::ImpossiblePlacement { asked: req.describe(), available: describe_devices(devices) };
        let decision = |device: &DeviceView, pool: PoolKind, why: Reason| Decision {
            device: device.index,
            pool,
            size_class,
            reason: why.sentence(),
        };

        if !devices.iter().filter(usable).any(DeviceView::is_accelerator) {
            let order = if req.placement == Placement::HostPinned {
                [PoolKind::HostPinned, PoolKind::Host]
            } else {
                [PoolKind::Host, PoolKind::HostPinned]
            };
            for kind in order {
                if let Some(host) = candidates.iter().find(|d| d.offers(kind)) {
                    if devices.iter().any(DeviceView::is_accelerator) {
                        why.push(format!(
                            "host memory: Auto does not choose software or CPU devices ({}), which are host memory \
                             behind a slower API (select one by index or API to use it), so it goes to {} on {}",
                            devices
                                .iter()
                                .filter(|d| d.kind == DeviceKind::Cpu)
                                .map(DeviceView::label)
                                .collect::<Vec<_>>()
                                .join(", "),
                            kind.describe(),
                            host.label()
                        ));
                    } else {
                        why.push(format!(
                            "host memory only: no accelerator discovered, so it goes to {} on {}",
                            kind.describe(),
                            host.label()
                        ));
                    }
                    return Ok(decision(host, kind, why));
                }
            }
            return Err(impossible());
        }

        let auto = req.placement == Placement::Auto;
        let want = if auto {
            self.auto_placement(req, size_class, evidence, &mut why)
        } else {
            why.push(format!("{} was asked for explicitly", req.placement));
            req.placement
        };
        let accels: Vec<&DeviceView> = candidates.iter().copied().filter(|d| d.is_accelerator()).collect();
        if accels.is_empty() {
            why.push(format!("{} selects no accelerator", req.selector.describe()));
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
            let (offering, too_big): (Vec<&DeviceView>, Vec<&DeviceView>) =
                accels.iter().copied().filter(|d| d.offers(kind)).partition(|d| !choosing || d.fits(req.bytes));
            for d in &too_big {
                why.push(format!(
                    "skipped {}: the request is above its largest single allocation ({})",
                    d.label(),
                    text::bytes(d.max_allocation)
                ));
            }
            if offering.is_empty() {
                if !accels.is_empty() && too_big.is_empty() {
                    why.push(format!("no selected accelerator offers {}", kind.describe()));
                }
                continue;
            }
            let (cool, hot): (Vec<&DeviceView>, Vec<&DeviceView>) =
                offering.iter().partition(|d| !self.under_pressure(d, req.bytes));
            if auto {
                for d in &hot {
                    why.push(format!("skipped {}: {}", d.label(), self.pressure_fact(d, req.bytes)));
                }
                let Some(device) = most_free(cool.iter().copied()) else {
                    why.push("every candidate device is under pressure, so it falls back to pinned host memory");
                    return self
                        .pinned(&accels, devices, why)
                        .map(|(d, p, w)| decision(d, p, w))
                        .ok_or_else(impossible);
                };
                why.push(format!(
                    "chose {} for {}, the most free memory among candidates: {}",
                    device.label(),
                    kind.describe(),
                    device.describe_memory()
                ));
                if device.shares_memory_with_host && kind == PoolKind::DeviceLocal {
                    if device.offers(PoolKind::HostPinned) {
                        why.push(format!(
                            "{} shares memory with the host, so Auto prefers pinned host memory, which it reads in place (whether the \
                             host may also address the buffer as a slice depends on its API)",
                            device.label()
                        ));
                        return Ok(decision(device, PoolKind::HostPinned, why));
                    }
                    why.push(format!(
                        "{} shares memory with the host but offers no pinned pool, so its device-local memory (host memory anyway) is used",
                        device.label()
                    ));
                }
                return Ok(decision(device, kind, why));
            }
            let device =
                most_free(cool.iter().copied()).or_else(|| most_free(hot.iter().copied())).unwrap_or(offering[0]);
            if self.under_pressure(device, req.bytes) {
                why.push(format!(
                    "{} is honoured on {} although {}",
                    req.placement,
                    device.label(),
                    self.pressure_fact(device, req.bytes)
                ));
            } else {
                why.push(format!("chose {}: {}", device.label(), device.describe_memory()));
            }
            return Ok(decision(device, kind, why));
        }
        if !chain.is_empty() {
            why.push("it falls back to host memory");
        }
        self.pinned(&accels, devices, why).map(|(d, p, w)| decision(d, p, w)).ok_or_else(impossible)
    }

    /// The table's placement for Auto, overridden by evidence where it contradicts the table.
    fn auto_placement(
        &self,
        req: &Request,
        size_class: SizeClass,
        evidence: Option<&Recommendations>,
        why: &mut Reason,
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
        why.push(format!("placement auto: the table says {rule}"));
        let rec = evidence.and_then(|e| e.for_buffer(size_class, req.access));
        if let Some(rec) = rec {
            let decisive = rec.from_evidence
                && rec.placement != Placement::Auto
                && rec.placement != rec.subject.table_default()
                && rec.placement != table;
            if decisive {
                why.push(format!("but usage evidence says {}: {}", rec.placement, rec.reason));
                return rec.placement;
            }
        }
        table
    }

    /// Pinned host memory: through the selected accelerator with the most free memory that offers it, else the
    /// host's pinned pool, else pageable host memory.
    fn pinned<'a>(
        &self,
        accels: &[&'a DeviceView],
        devices: &'a [DeviceView],
        mut why: Reason,
    ) -> Option<(&'a DeviceView, PoolKind, Reason)> {
        if let Some(device) = most_free(accels.iter().copied().filter(|d| d.offers(PoolKind::HostPinned))) {
            let zero_copy = if device.shares_memory_with_host {
                ", which it reads in place since it shares memory with the host"
            } else {
                ""
            };
            why.push(format!("pinned host memory through {}{zero_copy}", device.label()));
            return Some((device, PoolKind::HostPinned, why));
        }
        let hosts = || devices.iter().filter(|d| d.kind == DeviceKind::Host);
        if let Some(host) = hosts().find(|d| d.offers(PoolKind::HostPinned)) {
            why.push(format!("pinned host memory on {}", host.label()));
            return Some((host, PoolKind::HostPinned, why));
        }
        let host = hosts().find(|d| d.offers(PoolKind::Host))?;
        why.push(format!("no pinned pool is offered, so pageable host memory on {}", host.label()));
        Some((host, PoolKind::Host, why))
    }

    /// Whether Auto avoids `device` for a request of `bytes`: used fraction above the threshold, or too little
    /// free memory. Devices of unknown size are never under pressure.
    fn under_pressure(&self, device: &DeviceView, bytes: u64) -> bool {
        device.total_bytes > 0 && (device.used_fraction() > self.config.pressure_threshold || device.free_bytes < bytes)
    }

    /// Why `device` is under pressure, in words.
    fn pressure_fact(&self, device: &DeviceView, bytes: u64) -> String {
        if device.used_fraction() > self.config.pressure_threshold {
            format!(
                "{} used is above the {} pressure threshold",
                text::percent(device.used_fraction()),
                text::percent(self.config.pressure_threshold)
            )
        } else {
            format!("only {} free, less than the {} asked", text::bytes(device.free_bytes), text::bytes(bytes))
        }
    }
}
