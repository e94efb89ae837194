//! The outcome of a decision: [`Decision`], the facts its reason is made of, and their rendering in words.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use super::Request;
#[cfg(doc)]
use super::Spread;
use crate::device::{Api, DeviceKind, DeviceView};
use crate::placement::{Placement, PoolKind, SizeClass, Thresholds};
use crate::units;

/// Where a request goes, and why.
///
/// Plain data: the choice (device, pool, size class) and the facts that led to it as codes and numbers, with the
/// devices as the decider saw them (shared, not copied). The reason is a sentence rendered only when asked for
/// ([`Decision::reason`], `Display`), so deciding formats nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The chosen device's [`DeviceView::index`].
    pub device: usize,
    /// The kind of pool on that device (one it offers).
    pub pool: PoolKind,
    /// The request's size class.
    pub size_class: SizeClass,
    pub(super) why: Why,
}

/// What a reason is rendered from.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Why {
    /// Decided by the table.
    Table {
        request: Request,
        thresholds: Thresholds,
        pressure_threshold: f64,
        /// The devices the decision was made on; [`Step`]s name them by position in this slice.
        devices: Arc<[DeviceView]>,
        steps: Vec<Step>,
    },
    /// Memory made elsewhere and adopted: it stays where it was made.
    Adopted { api: Api, owned: bool },
}

/// One fact of a decision, in the order the table met it. Devices are positions in [`Why::Table`]'s slice.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Step {
    /// No accelerator at all: host memory.
    HostOnly { kind: PoolKind, host: usize },
    /// Accelerators exist, but only software or CPU ones, which are chosen only when a selector names them.
    SoftwareShunned { kind: PoolKind, host: usize },
    /// An explicit placement without a selector, on the caller's current device.
    Current(usize),
    /// Auto's table row.
    TableRule(&'static str),
    /// Usage evidence overrode the table.
    Evidence { placement: Placement, reason: String },
    /// The placement was explicit.
    Explicit,
    /// The selector matched no accelerator.
    NoAcceleratorSelected,
    /// A device that cannot hold the request in one allocation.
    TooBig(usize),
    /// No selected accelerator offers this pool.
    NoOffer(PoolKind),
    /// Auto passed over a device under pressure.
    UnderPressure(usize),
    /// Every candidate is under pressure.
    AllUnderPressure,
    /// Auto's choice under [`Spread::Balance`]: the most memory free to the caller among `among` candidates.
    MostFree { device: usize, kind: PoolKind, among: usize },
    /// Auto's choice under [`Spread::CurrentFirst`]: the current device, not under pressure.
    CurrentFirst { device: usize, kind: PoolKind },
    /// The chosen device shares memory with the host and offers a pinned pool.
    SharedPinned(usize),
    /// The chosen device shares memory with the host but offers no pinned pool.
    SharedNoPinned(usize),
    /// An explicit placement honoured on a device under pressure.
    HonouredUnderPressure(usize),
    /// An explicit placement's device.
    Chose(usize),
    /// The chain found nothing on accelerators.
    FallsBackToHost,
    /// A selector named accelerators none of which offers pinned memory: Auto stays on the one with the most free
    /// memory, in device-local (or, for data declared read-only, read-only) memory.
    StaysOnSelected { device: usize, kind: PoolKind },
    /// Pinned memory through an accelerator.
    PinnedThrough(usize),
    /// Pinned memory on the host device.
    PinnedHost(usize),
    /// Pageable host memory.
    Pageable(usize),
}

impl Decision {
    /// The decision for memory adopted from `api` (made elsewhere, [`Decision::reason`] says so): it stays on
    /// `device`'s `pool`; `owned` says whether the adopter releases it.
    pub fn adopted(device: usize, pool: PoolKind, size_class: SizeClass, api: Api, owned: bool) -> Self {
        Decision { device, pool, size_class, why: Why::Adopted { api, owned } }
    }

    /// A sentence naming the size class, the thresholds and the deciding facts, rendered now from the figures
    /// the decision was made on.
    pub fn reason(&self) -> String {
        match &self.why {
            Why::Adopted { api, owned } => {
                let ownership = if *owned { "owned" } else { "borrowed" };
                format!("Adopted {api} memory ({ownership}): it stays where it was made.")
            }
            Why::Table { request, thresholds, pressure_threshold, devices, steps } => {
                let r = Render { request, devices, pressure_threshold: *pressure_threshold };
                let mut s = format!(
                    "{} buffer of {} ({}), access {}",
                    self.size_class,
                    units::bytes(request.bytes),
                    thresholds.describe(),
                    request.access
                );
                for step in steps {
                    s.push_str("; ");
                    s.push_str(&r.clause(step));
                }
                if let Some(first) = s.get(..1) {
                    let upper = first.to_ascii_uppercase();
                    s.replace_range(..1, &upper);
                }
                s.push('.');
                s
            }
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {} {}: {}", self.device, self.pool, self.reason())
    }
}

impl Serialize for Decision {
    /// `{"device", "pool", "size_class", "reason"}`, the reason rendered.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("Decision", 4)?;
        s.serialize_field("device", &self.device)?;
        s.serialize_field("pool", &self.pool)?;
        s.serialize_field("size_class", &self.size_class)?;
        s.serialize_field("reason", &self.reason())?;
        s.end()
    }
}

/// Renders [`Step`]s into clauses.
struct Render<'a> {
    request: &'a Request,
    devices: &'a [DeviceView],
    pressure_threshold: f64,
}

impl Render<'_> {
    fn label(&self, at: usize) -> String {
        self.devices[at].label()
    }

    fn clause(&self, step: &Step) -> String {
        let req = self.request;
        match step {
            Step::SoftwareShunned { kind, host } => format!(
                "host memory: software or CPU devices ({}) are host memory behind a slower API and serve only \
                 requests that select them (by index or API), so it goes to {} on {}",
                self.devices
                    .iter()
                    .filter(|d| d.kind == DeviceKind::Cpu)
                    .map(DeviceView::label)
                    .collect::<Vec<_>>()
                    .join(", "),
                kind.describe(),
                self.label(*host)
            ),
            Step::HostOnly { kind, host } => format!(
                "host memory only: no accelerator discovered, so it goes to {} on {}",
                kind.describe(),
                self.label(*host)
            ),
            Step::TableRule(rule) => format!("placement auto: the table says {rule}"),
            Step::Evidence { placement, reason } => format!("but usage evidence says {placement}: {reason}"),
            Step::Explicit => format!("{} was asked for explicitly", req.placement),
            Step::NoAcceleratorSelected => format!("{} selects no accelerator", req.selector.describe()),
            Step::TooBig(at) => format!(
                "skipped {}: the request is above its largest single allocation ({})",
                self.label(*at),
                units::bytes(self.devices[*at].max_allocation)
            ),
            Step::NoOffer(kind) => format!("no selected accelerator offers {}", kind.describe()),
            Step::UnderPressure(at) => format!("skipped {}: {}", self.label(*at), self.pressure_fact(*at)),
            Step::AllUnderPressure => {
                "every candidate device is under pressure, so it falls back to pinned host memory".to_owned()
            }
            Step::MostFree { device, kind, among: 1 } => format!(
                "chose {} for {}, the only candidate: {}",
                self.label(*device),
                kind.describe(),
                self.devices[*device].describe_memory()
            ),
            Step::MostFree { device, kind, among } => format!(
                "chose {} for {}, the most memory free to umm among {among} candidates (spread balance): {}",
                self.label(*device),
                kind.describe(),
                self.devices[*device].describe_memory()
            ),
            Step::CurrentFirst { device, kind } => format!(
                "chose {} for {}: the current device, filled first (spread current_first): {}",
                self.label(*device),
                kind.describe(),
                self.devices[*device].describe_memory()
            ),
            Step::SharedPinned(at) => format!(
                "{} shares memory with the host, so Auto prefers pinned host memory, which it reads in place \
                 (whether the host may also address the buffer as a slice depends on its API)",
                self.label(*at)
            ),
            Step::SharedNoPinned(at) => format!(
                "{} shares memory with the host but offers no pinned pool, so its device-local memory (host memory \
                 anyway) is used",
                self.label(*at)
            ),
            Step::HonouredUnderPressure(at) => {
                format!("{} is honoured on {} although {}", req.placement, self.label(*at), self.pressure_fact(*at))
            }
            Step::Chose(at) => format!("chose {}: {}", self.label(*at), self.devices[*at].describe_memory()),
            Step::Current(at) => format!(
                "{} is the current device (set it with set_current_device, or select another): {}",
                self.label(*at),
                self.devices[*at].describe_memory()
            ),
            Step::FallsBackToHost => "it falls back to host memory".to_owned(),
            Step::StaysOnSelected { device, kind } => format!(
                "{} selects {}, which offers no pinned memory, so it stays there in {}",
                req.selector.describe(),
                self.label(*device),
                kind.describe()
            ),
            Step::PinnedThrough(at) => {
                let zero_copy = if self.devices[*at].shares_memory_with_host {
                    ", which it reads in place since it shares memory with the host"
                } else {
                    ""
                };
                format!("pinned host memory through {}{zero_copy}", self.label(*at))
            }
            Step::PinnedHost(at) => format!("pinned host memory on {}", self.label(*at)),
            Step::Pageable(at) => format!("no pinned pool is offered, so pageable host memory on {}", self.label(*at)),
        }
    }

    /// Why the device at `at` is under pressure, in words.
    fn pressure_fact(&self, at: usize) -> String {
        let device = &self.devices[at];
        if device.used_fraction() > self.pressure_threshold {
            format!(
                "{} used is above the {} pressure threshold",
                units::percent(device.used_fraction()),
                units::percent(self.pressure_threshold)
            )
        } else {
            format!(
                "only {} free, less than the {} asked",
                units::bytes(device.available_bytes()),
                units::bytes(self.request.bytes)
            )
        }
    }
}
