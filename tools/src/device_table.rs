//! `umm devices`: one table of every discovered device, whatever the APIs it is seen through (nvidia-smi and
//! clinfo in one), with the pools' current usage.

use serde::Serialize;
use std::fmt;
use umm::UniversalMemoryManager;
use umm_backends::DeviceInfo;
use umm_placement::units::human_bytes;
use umm_placement::{Api, DeviceKind, PoolKind};

/// One pool's usage in a [`DeviceRow`].
#[derive(Debug, Clone, Serialize)]
pub struct PoolUsage {
    /// The API the pool allocates through.
    pub api: Api,
    /// The kind of pool.
    pub kind: PoolKind,
    /// Bytes in live blocks.
    pub allocated_bytes: u64,
    /// Bytes held from the device.
    pub reserved_bytes: u64,
    /// Peak of reserved bytes.
    pub peak_reserved_bytes: u64,
}

/// One device of the table.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceRow {
    /// Index among the manager's devices.
    pub index: usize,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: DeviceKind,
    /// APIs it is seen through, preferred first.
    pub apis: Vec<Api>,
    /// Total memory in bytes.
    pub total_bytes: u64,
    /// Free memory in bytes now.
    pub free_bytes: u64,
    /// Whether device memory is host memory.
    pub shares_memory_with_host: bool,
    /// Block alignment per API, in the order of `apis`.
    pub alignment: Vec<u64>,
    /// Largest single allocation per API, in the order of `apis`.
    pub max_allocation: Vec<u64>,
    /// PCI bus id, when known.
    pub pci_bus_id: Option<String>,
    /// Pools created so far.
    pub pools: Vec<PoolUsage>,
    /// What each API reports (vendor, details such as compute capability or driver).
    pub per_api: Vec<DeviceInfo>,
    /// Indices of the devices that can read and write this one's memory directly (CUDA peers over NVLink or
    /// PCIe): a buffer migrates between them by peer copy, and kernels of one may use the other's buffers.
    pub peers: Vec<usize>,
}

/// Every device, and what discovery skipped (`umm devices --json` prints this).
#[derive(Debug, Clone, Serialize)]
pub struct DeviceTable {
    /// Devices, the host first.
    pub devices: Vec<DeviceRow>,
    /// Why devices, platforms or whole APIs were skipped.
    pub skipped: Vec<String>,
}

impl DeviceTable {
    /// Every device of `manager` with its APIs, memory, limits and pool usage now.
    pub fn of(manager: &UniversalMemoryManager) -> DeviceTable {
        let devices = manager
            .devices()
            .iter()
            .map(|d| {
                let infos = d.api_infos();
                DeviceRow {
                    index: d.index(),
                    name: d.name().to_string(),
                    kind: d.kind(),
                    apis: d.apis(),
                    total_bytes: d.total_bytes(),
                    free_bytes: d.free_bytes(),
                    shares_memory_with_host: d.shares_memory_with_host(),
                    alignment: infos.iter().map(|i| i.alignment).collect(),
                    max_allocation: infos.iter().map(|i| i.max_allocation).collect(),
                    pci_bus_id: d.pci_bus_id().map(str::to_string),
                    pools: d
                        .pools()
                        .into_iter()
                        .map(|(api, kind, pool)| {
                            let stats = pool.stats();
                            PoolUsage {
                                api,
                                kind,
                                allocated_bytes: stats.allocated_bytes.current,
                                reserved_bytes: stats.reserved_bytes.current,
                                peak_reserved_bytes: stats.reserved_bytes.peak,
                            }
                        })
                        .collect(),
                    per_api: infos.into_iter().cloned().collect(),
                    peers: manager.peers_of(d.index()),
                }
            })
            .collect();
        DeviceTable { devices, skipped: manager.skipped().to_vec() }
    }
}

/// `values` joined by `/`, or one value when all are equal.
fn per_api(values: &[u64], show: impl Fn(u64) -> String) -> String {
    match values {
        [] => "-".into(),
        [first, rest @ ..] if rest.iter().all(|v| v == first) => show(*first),
        _ => values.iter().map(|&v| show(v)).collect::<Vec<_>>().join("/"),
    }
}

impl fmt::Display for DeviceTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let header =
            ["#", "name", "kind", "apis", "total", "free", "shared", "align", "max alloc", "pools (used/reserved)"];
        let rows: Vec<[String; 10]> = self
            .devices
            .iter()
            .map(|d| {
                let pools = if d.pools.is_empty() {
                    "-".to_string()
                } else {
                    d.pools
                        .iter()
                        .map(|p| {
                            format!(
                                "{}/{}: {} / {}",
                                p.api,
                                p.kind,
                                human_bytes(p.allocated_bytes),
                                human_bytes(p.reserved_bytes)
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                [
                    d.index.to_string(),
                    d.name.clone(),
                    d.kind.to_string(),
                    d.apis.iter().map(Api::to_string).collect::<Vec<_>>().join("+"),
                    human_bytes(d.total_bytes),
                    human_bytes(d.free_bytes),
                    if d.shares_memory_with_host { "yes" } else { "no" }.into(),
                    per_api(&d.alignment, |v| v.to_string()),
                    per_api(&d.max_allocation, human_bytes),
                    pools,
                ]
            })
            .collect();
        let mut widths = header.map(str::len);
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, cells: &[&str]| -> fmt::Result {
            let mut text = String::new();
            for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
                let right = matches!(i, 0 | 4 | 5 | 7 | 8);
                let sep = if i == 0 { "" } else { "  " };
                if right {
                    text.push_str(&format!("{sep}{cell:>w$}"));
                } else {
                    text.push_str(&format!("{sep}{cell:<w$}"));
                }
            }
            writeln!(f, "{}", text.trim_end())
        };
        line(f, &header)?;
        for row in &rows {
            line(f, &row.each_ref().map(String::as_str))?;
        }
        for d in self.devices.iter().filter(|d| !d.peers.is_empty()) {
            let from: Vec<String> = d.peers.iter().map(|p| format!("[{p}]")).collect();
            writeln!(f, "peers: [{}] is reachable directly from {}", d.index, from.join(", "))?;
        }
        for reason in &self.skipped {
            writeln!(f, "skipped: {reason}")?;
        }
        Ok(())
    }
}
