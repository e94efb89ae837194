//! What a backend says about a device it discovered, in one shape for every API, so the facade can list devices,
//! recognise one GPU seen through two APIs, and feed the placement decider.

use serde::Serialize;
use umm_placement::{Api, DeviceKind};

/// One device as one API sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceInfo {
    /// The API.
    pub api: Api,
    /// Index among this API's devices.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// Vendor name.
    pub vendor: String,
    /// What sort of device it is.
    pub kind: DeviceKind,
    /// Total memory in bytes.
    pub total_bytes: u64,
    /// Free memory in bytes when discovered (None when the API cannot tell).
    pub free_bytes: Option<u64>,
    /// Whether device memory is host memory (integrated GPUs, CPU devices).
    pub shares_memory_with_host: bool,
    /// Block alignment the pools use, in bytes.
    pub alignment: u64,
    /// Largest single allocation, in bytes.
    pub max_allocation: u64,
    /// PCI bus id in `domain:bus:device.function` form (lowercase hex), when the API reports it.
    pub pci_bus_id: Option<String>,
    /// Device UUID, when the API reports it.
    pub uuid: Option<String>,
    /// Other API-specific facts worth showing (compute capability, driver, limits).
    pub details: Vec<(String, String)>,
}

/// The result of one backend's discovery: devices found, and why anything was skipped (never a panic).
#[derive(Debug, Default)]
pub struct Discovery<D> {
    /// Usable devices.
    pub devices: Vec<D>,
    /// Human-readable reasons for devices, platforms or the whole API being skipped.
    pub skipped: Vec<String>,
}
