//! Statistics across every pool of every device.

use serde::Serialize;
use umm_backends::PoolStats;
use umm_placement::{Api, PoolKind};

/// One pool's statistics with where it is.
#[derive(Debug, Clone, Serialize)]
pub struct PoolStatsEntry {
    /// The API of the pool.
    pub api: Api,
    /// The kind of pool.
    pub kind: PoolKind,
    /// Its statistics.
    pub stats: PoolStats,
}

/// One device's pools and their sum.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceStats {
    /// Device index.
    pub index: usize,
    /// Device name.
    pub name: String,
    /// Its pools.
    pub pools: Vec<PoolStatsEntry>,
    /// The sum over its pools (peaks are sums of peaks: an upper bound).
    pub total: PoolStats,
}

/// Statistics of every pool, per device and in total.
#[derive(Debug, Clone, Serialize)]
pub struct GlobalMemoryStats {
    /// Per device.
    pub devices: Vec<DeviceStats>,
    /// Over all devices.
    pub total: PoolStats,
}
