//! What the decider knows of the devices in a machine: [`DeviceView`], [`DeviceKind`], [`Api`], and how a
//! request picks among them ([`DeviceSelector`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use strum::{Display, EnumIter, EnumString, IntoEnumIterator};

use crate::error::Error;
use crate::placement::PoolKind;
use crate::units;

/// The programming interface through which a device is reached.
///
/// Prints and parses like the enums in [`placement`](crate::Placement): snake_case, case-insensitive;
/// [`Api::OpenCl`] is `"opencl"` (also `"open_cl"`, `"open-cl"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Display, EnumString, EnumIter)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum Api {
    /// Host memory through the operating system.
    Host,
    /// NVIDIA CUDA.
    Cuda,
    /// OpenCL (including CPU implementations such as PoCL).
    #[serde(rename = "opencl")]
    #[strum(to_string = "opencl", serialize = "open_cl", serialize = "open-cl")]
    OpenCl,
    /// wgpu (Vulkan, Metal, DX12, GL).
    Wgpu,
    /// The simulated device used for replay and tests.
    Sim,
}

/// What sort of device a [`DeviceView`] describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Display, EnumString, EnumIter)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum DeviceKind {
    /// Host memory itself. Not an accelerator.
    Host,
    /// A software or CPU device (PoCL, lavapipe): an accelerator API over host memory.
    Cpu,
    /// A GPU with its own memory.
    #[strum(to_string = "discrete_gpu", serialize = "discrete-gpu", serialize = "discretegpu")]
    DiscreteGpu,
    /// A GPU that shares memory with the host.
    #[strum(to_string = "integrated_gpu", serialize = "integrated-gpu", serialize = "integratedgpu")]
    IntegratedGpu,
    /// The simulated device.
    Simulated,
    /// Anything else an API reports.
    Other,
}

/// What the decider knows of one device. The host is a view too (see [`DeviceView::host`]).
///
/// `total_bytes == 0` means the size is unknown (wgpu reports none): such a device is never considered under
/// pressure and ranks below devices with known free memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceView {
    /// The index the caller uses for this device; decisions return it.
    pub index: usize,
    /// A human name ("NVIDIA H100 80GB HBM3").
    pub name: String,
    /// What sort of device it is.
    pub kind: DeviceKind,
    /// The APIs through which it is reached (one physical device seen through two APIs is one view).
    pub apis: Vec<Api>,
    /// Whether device memory is host memory (integrated GPUs, PoCL, lavapipe): zero-copy is then free.
    pub shares_memory_with_host: bool,
    /// Total memory in bytes (0 if unknown).
    pub total_bytes: u64,
    /// Free memory in bytes, as the device counts it (what no program holds).
    pub free_bytes: u64,
    /// Bytes the caller's own pools hold on the device that no buffer uses: free to the caller's allocations,
    /// not to other programs. Auto ranks and judges pressure by [`DeviceView::available_bytes`], their sum.
    #[serde(default)]
    pub cached_bytes: u64,
    /// The pool kinds this device offers.
    pub pools: Vec<PoolKind>,
    /// The largest single allocation the device's API allows, in bytes (0 if unknown or unlimited): a request
    /// above it goes to the next candidate.
    #[serde(default)]
    pub max_allocation: u64,
}

impl DeviceView {
    /// The host as a device: kind [`DeviceKind::Host`], API [`Api::Host`], pools `[Host, HostPinned]`.
    pub fn host(index: usize, total_bytes: u64, free_bytes: u64) -> Self {
        DeviceView {
            index,
            name: "host".to_owned(),
            kind: DeviceKind::Host,
            apis: vec![Api::Host],
            shares_memory_with_host: true,
            total_bytes,
            free_bytes,
            cached_bytes: 0,
            pools: vec![PoolKind::Host, PoolKind::HostPinned],
            max_allocation: 0,
        }
    }

    /// Whether this is an accelerator (anything but [`DeviceKind::Host`]).
    pub fn is_accelerator(&self) -> bool {
        self.kind != DeviceKind::Host
    }

    /// Whether a single allocation of `bytes` fits under [`DeviceView::max_allocation`].
    pub fn fits(&self, bytes: u64) -> bool {
        self.max_allocation == 0 || bytes <= self.max_allocation
    }

    /// Whether the device offers a pool of `kind`. O(pools).
    pub fn offers(&self, kind: PoolKind) -> bool {
        self.pools.contains(&kind)
    }

    /// Whether the device is reached through `api`. O(apis).
    pub fn has_api(&self, api: Api) -> bool {
        self.apis.contains(&api)
    }

    /// What the caller's allocations can have: free memory plus what its pools hold unused
    /// ([`DeviceView::cached_bytes`]), at most the total where the total is known.
    pub fn available_bytes(&self) -> u64 {
        let sum = self.free_bytes.saturating_add(self.cached_bytes);
        if self.total_bytes == 0 {
            sum
        } else {
            sum.min(self.total_bytes)
        }
    }

    /// `(total - available) / total`, in [0, 1]: the share held by other programs and by live buffers; 0 when
    /// the total is unknown.
    pub fn used_fraction(&self) -> f64 {
        if self.total_bytes == 0 {
            return 0.0;
        }
        let used = self.total_bytes.saturating_sub(self.available_bytes());
        used as f64 / self.total_bytes as f64
    }

    /// A short label for reasons: "device 1 (NVIDIA H100)".
    pub fn label(&self) -> String {
        format!("device {} ({})", self.index, self.name)
    }

    /// Free memory in words: "70 GiB free of 80 GiB, 12.5% used"; with memory held unused by the caller's pools,
    /// "71 GiB free to umm of 80 GiB (70 GiB free on the device, 1 GiB unused in umm's pools), 11.2% used"; or
    /// "memory size unknown".
    pub fn describe_memory(&self) -> String {
        if self.total_bytes == 0 {
            return "memory size unknown".to_owned();
        }
        if self.cached_bytes == 0 {
            return format!(
                "{} free of {}, {} used",
                units::bytes(self.free_bytes),
                units::bytes(self.total_bytes),
                units::percent(self.used_fraction())
            );
        }
        format!(
            "{} free to umm of {} ({} free on the device, {} unused in umm's pools), {} used",
            units::bytes(self.available_bytes()),
            units::bytes(self.total_bytes),
            units::bytes(self.free_bytes),
            units::bytes(self.cached_bytes),
            units::percent(self.used_fraction())
        )
    }
}

impl fmt::Display for DeviceView {
    /// "1: NVIDIA H100 (discrete_gpu; cuda, opencl; pools device_local, host_pinned)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let apis: Vec<String> = self.apis.iter().map(Api::to_string).collect();
        let pools: Vec<String> = self.pools.iter().map(PoolKind::to_string).collect();
        write!(
            f,
            "{}: {} ({}; {}; pools {})",
            self.index,
            self.name,
            self.kind,
            if apis.is_empty() { "no api".to_owned() } else { apis.join(", ") },
            if pools.is_empty() { "none".to_owned() } else { pools.join(", ") }
        )
    }
}

/// Lists devices for error messages: "0: host (...), 1: ...", or "no devices".
pub(crate) fn describe_devices(devices: &[DeviceView]) -> String {
    if devices.is_empty() {
        return "no devices".to_owned();
    }
    let parts: Vec<String> = devices.iter().map(DeviceView::to_string).collect();
    parts.join("; ")
}

/// Which devices a request may be placed on.
///
/// Parses (case-insensitively) from `"any"`, `"host"`, a device index such as `"1"`, or an API name such as
/// `"cuda"`; prints the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceSelector {
    /// Any device; the decider chooses.
    #[default]
    Any,
    /// The device whose [`DeviceView::index`] is this.
    Index(usize),
    /// Any device reached through this API.
    Api(Api),
    /// The host.
    Host,
}

impl DeviceSelector {
    /// The selector in words, for reasons and errors: "device index 7", "a device with the cuda API".
    pub fn describe(&self) -> String {
        match self {
            DeviceSelector::Any => "any device".to_owned(),
            DeviceSelector::Index(i) => format!("device index {i}"),
            DeviceSelector::Api(api) => format!("a device with the {api} API"),
            DeviceSelector::Host => "the host".to_owned(),
        }
    }

    /// Whether `device` satisfies this selector. O(apis).
    pub fn matches(&self, device: &DeviceView) -> bool {
        match self {
            DeviceSelector::Any => true,
            DeviceSelector::Index(i) => device.index == *i,
            DeviceSelector::Api(api) => device.has_api(*api),
            DeviceSelector::Host => device.kind == DeviceKind::Host,
        }
    }
}

impl fmt::Display for DeviceSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSelector::Any => f.write_str("any"),
            DeviceSelector::Index(i) => write!(f, "{i}"),
            DeviceSelector::Api(api) => write!(f, "{api}"),
            DeviceSelector::Host => f.write_str("host"),
        }
    }
}

impl FromStr for DeviceSelector {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("any") {
            return Ok(DeviceSelector::Any);
        }
        if s.eq_ignore_ascii_case("host") {
            return Ok(DeviceSelector::Host);
        }
        if let Ok(i) = s.parse::<usize>() {
            return Ok(DeviceSelector::Index(i));
        }
        Api::from_str(s).map(DeviceSelector::Api).map_err(|_| Error::InvalidSelector {
            value: s.to_owned(),
            expected: Api::iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", "),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selector_parses_and_prints() {
        for (text, sel) in [
            ("any", DeviceSelector::Any),
            ("HOST", DeviceSelector::Host),
            ("3", DeviceSelector::Index(3)),
            ("Cuda", DeviceSelector::Api(Api::Cuda)),
            ("open-cl", DeviceSelector::Api(Api::OpenCl)),
        ] {
            assert_eq!(text.parse::<DeviceSelector>(), Ok(sel), "{text}");
            assert_eq!(sel.to_string().parse::<DeviceSelector>(), Ok(sel));
        }
        let err = "tpu".parse::<DeviceSelector>().unwrap_err().to_string();
        assert!(err.contains("\"tpu\"") && err.contains("cuda, opencl"), "{err}");
    }

    #[test]
    fn used_fraction_handles_unknown_and_inconsistent_sizes() {
        let mut d = DeviceView::host(0, 0, 0);
        assert_eq!(d.used_fraction(), 0.0);
        d.total_bytes = 100;
        d.free_bytes = 200;
        assert_eq!(d.used_fraction(), 0.0);
        d.free_bytes = 25;
        assert_eq!(d.used_fraction(), 0.75);
        assert_eq!(d.describe_memory(), "25 B free of 100 B, 75% used");
        d.cached_bytes = 25;
        assert_eq!((d.available_bytes(), d.used_fraction()), (50, 0.5), "memory held unused counts as available");
        assert_eq!(
            d.describe_memory(),
            "50 B free to umm of 100 B (25 B free on the device, 25 B unused in umm's pools), 50% used"
        );
        d.cached_bytes = 90;
        assert_eq!((d.available_bytes(), d.used_fraction()), (100, 0.0), "at most the total");
        d.total_bytes = 0;
        assert_eq!(d.available_bytes(), 115, "no total to cap at");
    }

    #[test]
    fn api_names() {
        assert_eq!(Api::OpenCl.to_string(), "opencl");
        assert_eq!(serde_json::to_string(&Api::OpenCl).unwrap(), "\"opencl\"");
        assert_eq!(DeviceKind::IntegratedGpu.to_string(), "integrated_gpu");
    }
}
