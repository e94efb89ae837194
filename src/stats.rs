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
    /// The most the manager's pools reserved at one moment, all devices together, since the manager began or
    /// [`crate::UniversalMemoryManager::reset_peak_stats`]: the true peak of the sum, where `total`'s peak adds the
    /// pools' own peaks. Buffers adopted from outside (`mm.adopt`) are not counted: umm reserved nothing for them.
    pub peak_reserved_at_once: u64,
}

impl GlobalMemoryStats {
    /// A table for people, like `torch.cuda.memory_summary()`: one row per pool, then each device's and the
    /// whole total, with allocated and reserved memory (current and peak), live blocks, segments, allocations,
    /// cache hits, out-of-memory errors and the bytes of planned steps. A total's peak is the sum of its pools'
    /// peaks, which may have come at different moments: the table says so, since it is an upper bound of the
    /// true peak, not the peak; the line after it gives the true peak of reserved memory
    /// ([`GlobalMemoryStats::peak_reserved_at_once`]).
    pub fn summary(&self) -> String {
        use std::fmt::Write;
        let human = umm_placement::units::human_bytes;
        let header = [
            "device / pool",
            "allocated",
            "peak",
            "reserved",
            "peak",
            "blocks",
            "segments",
            "allocs",
            "hit rate",
            "ooms",
            "planned",
        ];
        let row = |name: String, s: &PoolStats| -> [String; 11] {
            [
                name,
                human(s.allocated_bytes.current),
                human(s.allocated_bytes.peak),
                human(s.reserved_bytes.current),
                human(s.reserved_bytes.peak),
                s.active_blocks.current.to_string(),
                s.segments.current.to_string(),
                s.num_allocs.to_string(),
                format!("{:.1}%", 100.0 * s.hit_rate()),
                s.num_ooms.to_string(),
                human(s.planned_bytes),
            ]
        };
        let mut rows = Vec::new();
        for device in &self.devices {
            for pool in &device.pools {
                rows.push(row(format!("[{}] {} {} {}", device.index, device.name, pool.api, pool.kind), &pool.stats));
            }
            if device.pools.len() > 1 {
                rows.push(row(format!("[{}] {} (sum)*", device.index, device.name), &device.total));
            }
        }
        rows.push(row("total (sum)*".to_string(), &self.total));
        let mut widths = header.map(str::len);
        for r in &rows {
            for (w, cell) in widths.iter_mut().zip(r) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, cells: &[&str]| {
            let mut text = String::new();
            for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
                if i == 0 {
                    let _ = write!(text, "{cell:<w$}");
                } else {
                    let _ = write!(text, "  {cell:>w$}");
                }
            }
            let _ = writeln!(out, "{}", text.trim_end());
        };
        line(&mut out, &header);
        for r in &rows {
            line(&mut out, &r.each_ref().map(String::as_str));
        }
        let _ = writeln!(
            out,
            "* peaks of a sum add the pools' own peaks, which may have come at different moments: an upper bound"
        );
        let _ = writeln!(out, "peak reserved by all pools at one moment: {}", human(self.peak_reserved_at_once));
        if self.total.asleep_bytes > 0 {
            let _ = writeln!(
                out,
                "asleep (tags put to sleep, not in reserved): {}, of which {} offloaded to host memory",
                human(self.total.asleep_bytes),
                human(self.total.offloaded_bytes)
            );
        }
        out
    }
}
