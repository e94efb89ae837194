//! What a program calls between steps: cleanup rounds, released caches, marked steps, statistics, peaks and
//! limits, over every pool of every device.

use crate::cleanup::{CleanupGuard, CleanupReport, DeviceCleanup};
use crate::error::Result;
use crate::manager::{Inner, UniversalMemoryManager};
use crate::stats::{DeviceStats, GlobalMemoryStats, PoolStatsEntry};
use std::sync::Arc;
use std::time::{Duration, Instant};
use umm_backends::PoolStats;

impl UniversalMemoryManager {
    /// A cleanup round: releases cached segments that sat unused for `cleanup_idle_rounds` rounds, and lets old
    /// usage evidence decay. Reports bytes and segments released per device and the time taken. Each pool is
    /// locked only while its own segments are released.
    pub fn cleanup(&self) -> CleanupReport {
        self.inner.cleanup(self.inner.config.cleanup_idle_rounds)
    }

    /// Marks the end of a training or inference step, and the start of the next, in every pool. Call it at the
    /// same point of every step (after the optimizer's step, or after a request is answered). Once two steps in a
    /// row make the same allocations and frees, the buffers that live within a step are placed at planned offsets
    /// of one segment per pool, of the step's peak size, with no device call; a step that does something else is
    /// served as before, and a plan whose steps keep deviating is dropped (see `umm_backends::Pool::mark_step`).
    /// The plan's segment counts in every statistic. `UMM_PLAN_STEPS=off` ([`umm_backends::PoolConfig`]'s
    /// `plan_steps`) only counts steps. Recorded in the trace of [`Builder::record_trace`](crate::Builder::record_trace) as an `s` line.
    pub fn mark_step(&self) -> Vec<PoolStep> {
        self.inner.profiler.trace_step();
        let mut steps = Vec::new();
        for device in &self.inner.devices {
            for (api, kind, pool) in device.pools() {
                steps.push(PoolStep { device: device.index(), api, kind, report: pool.mark_step() });
            }
        }
        steps
    }

    /// Releases every cached byte in every pool now (PyTorch's `empty_cache`).
    pub fn release_all_cached(&self) -> CleanupReport {
        self.inner.cleanup(0)
    }

    /// Runs [`UniversalMemoryManager::cleanup`] every `interval` on a background thread until the returned guard
    /// is dropped. An interval below [`CleanupGuard::MIN_INTERVAL`] (1 ms; `Duration::ZERO` included) is raised
    /// to it, with a warning, since rounds back to back would spin a core and empty the caches as fast as they
    /// fill.
    pub fn start_periodic_cleanup(&self, interval: Duration) -> CleanupGuard {
        let manager = Arc::downgrade(&self.inner);
        // A round while the manager lives; `None` once it is gone, which ends the cleaner.
        let round = move || manager.upgrade().map(|inner| inner.cleanup(inner.config.cleanup_idle_rounds));
        CleanupGuard::start(round, interval)
    }

    /// [`GlobalMemoryStats::summary`] of [`UniversalMemoryManager::global_memory_stats`]: a table of every pool's
    /// memory, like `torch.cuda.memory_summary()`.
    pub fn memory_summary(&self) -> String {
        self.inner.memory_stats().summary()
    }

    /// Sets every pool's peaks to their current values (`torch.cuda.reset_peak_memory_stats()`), so that later
    /// peaks are those of the work that follows.
    pub fn reset_peak_stats(&self) {
        for device in &self.inner.devices {
            for (_, _, pool) in device.pools() {
                pool.reset_peaks();
            }
        }
        if let Some(group) = &self.inner.config.pool.reserved_group {
            group.reset_peak();
        }
    }

    /// Statistics of every pool, per device and in total (serde-serialisable).
    pub fn global_memory_stats(&self) -> GlobalMemoryStats {
        self.inner.memory_stats()
    }

    /// Sets (or clears) the cap on reserved bytes of every pool: those made so far and those made later (which
    /// otherwise take [`Builder::limit`](crate::Builder::limit), `UMM_LIMIT`; [`UniversalMemoryManager::config`]
    /// keeps what the manager was built with). A pool that reserves more than the new cap gives its cached memory
    /// back now, so that its reserved bytes fall to the cap where only cache lay above it; from then on an
    /// allocation that would need memory above the cap fails as out of memory.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) for a limit of zero bytes or a fraction outside
    /// (0, 1]; no pool changes then.
    pub fn set_limit(&self, limit: Option<umm_backends::Limit>) -> Result<()> {
        if let Some(limit) = limit {
            limit.resolve(u64::MAX)?;
        }
        // Held while the pools made so far take the limit: a pool made meanwhile waits, then is among them.
        let mut config = self.inner.pool_config.write();
        for device in &self.inner.devices {
            for (_, _, pool) in device.pools() {
                pool.set_limit(limit)?;
                // Cached bytes are reserved bytes: those above the new cap go back now.
                if pool.stats().limit_bytes.is_some_and(|cap| pool.reserved_bytes() > cap) {
                    pool.release_cached();
                }
            }
        }
        config.limit = limit;
        Ok(())
    }
}

impl Inner {
    /// Every pool's statistics, per device and in total (see [`UniversalMemoryManager::global_memory_stats`]).
    pub(crate) fn memory_stats(&self) -> GlobalMemoryStats {
        let mut total = PoolStats { name: "total".into(), limit_bytes: Some(0), ..PoolStats::default() };
        let mut devices = Vec::new();
        for device in &self.devices {
            let mut device_total =
                PoolStats { name: device.name().to_string(), limit_bytes: Some(0), ..PoolStats::default() };
            let mut pools = Vec::new();
            for (api, kind, pool) in device.pools() {
                let stats = pool.stats();
                device_total.accumulate(&stats);
                pools.push(PoolStatsEntry { api, kind, stats });
            }
            if pools.is_empty() {
                device_total.limit_bytes = None;
            }
            total.accumulate(&device_total);
            devices.push(DeviceStats {
                index: device.index(),
                name: device.name().to_string(),
                pools,
                total: device_total,
            });
        }
        if devices.iter().all(|d| d.pools.is_empty()) {
            total.limit_bytes = None;
        }
        let peak_reserved_at_once = self.config.pool.reserved_group.as_ref().map_or(0, |g| g.peak());
        GlobalMemoryStats { devices, total, peak_reserved_at_once }
    }

    pub(crate) fn cleanup(&self, idle_rounds: u64) -> CleanupReport {
        let start = Instant::now();
        let mut devices = Vec::new();
        for device in &self.devices {
            let mut entry =
                DeviceCleanup { index: device.index(), name: device.name().to_string(), ..Default::default() };
            for (_, _, pool) in device.pools() {
                let report = pool.cleanup(idle_rounds);
                entry.bytes_released += report.bytes_released;
                entry.segments_released += report.segments_released;
                entry.pages_unmapped += report.pages_unmapped;
            }
            devices.push(entry);
        }
        // Halve the weight of old evidence each round so recommendations follow the current workload.
        let _ = self.tracker.decay(0.5);
        self.refresh();
        CleanupReport {
            bytes_released: devices.iter().map(|d| d.bytes_released).sum(),
            segments_released: devices.iter().map(|d| d.segments_released).sum(),
            devices,
            elapsed: start.elapsed(),
        }
    }
}

/// One pool's end of a step ([`UniversalMemoryManager::mark_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PoolStep {
    /// The device's index.
    pub device: usize,
    /// The pool's API.
    pub api: umm_placement::Api,
    /// The kind of pool.
    pub kind: umm_placement::PoolKind,
    /// What the pool did.
    pub report: umm_backends::StepReport,
}
