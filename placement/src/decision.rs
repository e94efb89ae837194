//! The decision table: [`Decider::decide`] turns a [`Request`] and the [`DeviceView`]s of a machine into a
//! [`Decision`] (device, pool kind, size class, and the reason in a sentence).

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::device::{describe_devices, Api, DeviceKind, DeviceSelector, DeviceView};
use crate::error::{Error, Result};
use crate::placement::{AccessPattern, Placement, PoolKind, SizeClass, Thresholds};
use crate::recommend::Recommendations;
use crate::units;

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
    /// The caller's current device (a [`DeviceView::index`]): where an explicit placement without a selector goes
    /// when that device offers its pool (see [`Decider`]). `None`: the decider chooses among all devices.
    #[serde(default)]
    pub current: Option<usize>,
}

impl Request {
    /// A request for `bytes` bytes: `Auto`, access `Unknown`, any device.
    pub fn new(bytes: u64) -> Self {
        Request {
            bytes,
            placement: Placement::Auto,
            access: AccessPattern::Unknown,
            selector: DeviceSelector::Any,
            current: None,
        }
    }

    /// Sets the current device: explicit placements without a selector go there.
    pub fn current(mut self, device: Option<usize>) -> Self {
        self.current = device;
        self
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
            units::bytes(self.bytes),
            self.access,
            self.selector.describe()
        )
    }
}

/// How Auto chooses among several accelerators that can all take a request.
///
/// Prints and parses in snake_case, case-insensitively (`"balance"`, `"current_first"`, also `"current-first"`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, strum::Display, strum::EnumString,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum Spread {
    /// The device with the most memory free to the caller ([`DeviceView::available_bytes`]) wins, so a burst of
    /// buffers spreads over the devices: what data-parallel workers in one process or a cache spread over GPUs
    /// want.
    #[default]
    Balance,
    /// The current device ([`Request::current`]) while it is not under pressure, then the rest by free memory:
    /// one device fills before the next is touched, as a PyTorch or cudarc user placing everything on "the"
    /// device expects.
    #[strum(to_string = "current_first", serialize = "current-first")]
    CurrentFirst,
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
    /// How Auto chooses among accelerators (default [`Spread::Balance`]).
    #[serde(default)]
    pub spread: Spread,
}

impl Default for DecisionConfig {
    fn default() -> Self {
        DecisionConfig {
            thresholds: Thresholds::default(),
            pressure_threshold: 0.90,
            large_host_frequent_to_pinned: true,
            large_streams_to_pinned: false,
            spread: Spread::Balance,
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
    why: Why,
}

/// What a reason is rendered from.
#[derive(Debug, Clone, PartialEq)]
enum Why {
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
enum Step {
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
///   lavapipe, PoCL) while host memory is among the views: it is host memory behind a slower API.
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
        let host_exists = all.iter().any(|d| d.kind == DeviceKind::Host);
        let shun_software = req.selector == DeviceSelector::Any && host_exists;
        let usable = |d: &DeviceView| !(shun_software && d.kind == DeviceKind::Cpu);
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
