//! The process-wide registry behind the C ABI: the CUDA devices (discovered on first use), stream-aware caching
//! pools of device memory per device, and the live pointers, so that a free by address finds its block.
//!
//! Each device has a main pool: PyTorch's segment policy, with large blocks in one virtual reservation mapped
//! page by page where the device has virtual memory management. Optionally (`UMM_HUGE_MIN=bytes`, off by
//! default) requests of at least that size go to a second pool of plain segments next to a virtual main pool, so
//! a huge block gets a segment of its own that the next request of its size reuses whole. On the recorded GPT-2
//! trace (simulated device) that lowered peak reserved memory by 11%; on the GPU it did not show, and with two
//! pools the reported peaks are the pools' peaks added up (an upper bound), so it stays opt-in.
//!
//! Everything here is safe Rust over plain integers (addresses and stream handles as `u64`); [`crate::ffi`]
//! converts the C types.

use crate::trace;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use umm_backends::cuda::{self, ContextScope, CudaPool};
use umm_backends::{
    BlockHandle, Limit, MemoryPool, PoolConfig, PoolPlacement, PoolStats, SegmentMode, Strategy, StreamId,
};

/// Default of `UMM_HUGE_MIN`: 0, no huge pool.
const DEFAULT_HUGE_MIN: u64 = 0;

/// A block handed out through the ABI.
struct Live {
    device: usize,
    /// The stream it was allocated on (its pool arena).
    stream: StreamId,
    /// Whether it came from the device's huge pool.
    huge: bool,
    block: BlockHandle,
    /// Its ID in the `UMM_TRACE` recording (`None`: not recording).
    trace_id: Option<u64>,
}

/// One device's pools, or why it has none.
struct Slot {
    name: String,
    total_memory: u64,
    pool: Result<Arc<CudaPool>, String>,
    /// Plain segments for requests of at least `huge_min` bytes (only next to a virtual main pool).
    huge: Option<Arc<CudaPool>>,
    /// Set while a limit is in force: every request then goes to the main pool, which holds the limit.
    limited: AtomicBool,
}

impl Slot {
    fn missing(name: String, reason: String) -> Self {
        Slot { name, total_memory: 0, pool: Err(reason), huge: None, limited: AtomicBool::new(false) }
    }

    /// The pool for a request of `size` bytes and whether it is the huge one.
    fn pool_for<'a>(&'a self, main: &'a Arc<CudaPool>, size: u64, huge_min: u64) -> (&'a Arc<CudaPool>, bool) {
        match &self.huge {
            Some(h) if size >= huge_min && !self.limited.load(Ordering::Relaxed) => (h, true),
            _ => (main, false),
        }
    }

    /// Statistics of the main pool plus the huge pool. Peaks add, so the peaks are upper bounds of the true
    /// peaks of the sum.
    fn stats(&self, main: &CudaPool) -> PoolStats {
        let mut stats = main.stats();
        if let Some(h) = &self.huge {
            stats.accumulate(&h.stats());
            stats.limit_bytes = main.stats().limit_bytes;
        }
        stats
    }

    fn pools(&self) -> impl Iterator<Item = &Arc<CudaPool>> {
        self.pool.as_ref().ok().into_iter().chain(self.huge.as_ref())
    }
}

struct Registry {
    /// Indexed by CUDA ordinal.
    devices: Vec<Slot>,
    /// Requests of at least this many bytes go to a device's huge pool (`UMM_HUGE_MIN`; 0: no huge pools).
    huge_min: u64,
    /// Why discovery found nothing, or skipped devices (empty when all went well).
    skipped: Vec<String>,
    /// Device address → block. One lock: PyTorch calls from its main and autograd threads, few at once.
    live: Mutex<LiveMap>,
}

/// Live blocks by device address.
type LiveMap = umm_backends::KeyMap<Live>;

static REGISTRY: OnceLock<Registry> = OnceLock::new();

fn registry() -> &'static Registry {
    REGISTRY.get_or_init(|| {
        // Discovery binds each device's context to this thread; put the caller's back afterwards.
        let _scope = ContextScope::enter_saving();
        Registry::discover()
    })
}

/// The pool configuration: PyTorch's segment policy (the default), with `UMM_SEGMENT_MODE` (auto, plain,
/// virtual), `UMM_MAPPED_SLACK` and `UMM_SEGMENT_SLACK` (a fraction or off), `UMM_CROSS_STREAM` (off, completed,
/// wait), `UMM_PLAN_STEPS` (on, off), `UMM_PAGE_SIZE` (a power of two of
/// bytes: the page size of virtual reservations) and `UMM_STRATEGY` (pooled, direct) read through `var` (the
/// environment). An error names the variable and its value.
fn pool_config(var: impl Fn(&str) -> Option<String>) -> Result<PoolConfig, String> {
    let mut config = PoolConfig::default();
    if let Some(v) = var("UMM_SEGMENT_MODE") {
        config.segment_mode = v
            .parse::<SegmentMode>()
            .map_err(|_| format!("UMM_SEGMENT_MODE={v:?} is not one of auto, plain, virtual"))?;
    }
    if let Some(v) = var("UMM_MAPPED_SLACK") {
        config.mapped_slack = PoolConfig::parse_slack(&v)
            .ok_or_else(|| format!("UMM_MAPPED_SLACK={v:?} is not a fraction >= 0 (0.03) or off"))?;
    }
    if let Some(v) = var("UMM_SEGMENT_SLACK") {
        config.segment_slack = PoolConfig::parse_slack(&v)
            .ok_or_else(|| format!("UMM_SEGMENT_SLACK={v:?} is not a fraction >= 0 (0.1) or off"))?;
    }
    if let Some(v) = var("UMM_CROSS_STREAM") {
        config.cross_stream =
            v.trim().parse().map_err(|_| format!("UMM_CROSS_STREAM={v:?} is not one of off, completed, wait"))?;
    }
    if let Some(v) = var("UMM_PAGE_SIZE") {
        config.page_size = Some(match umm_backends::parse_size(&v) {
            Ok(page) if page.is_power_of_two() => page,
            Ok(page) => return Err(format!("UMM_PAGE_SIZE={v:?} is not a power of two of bytes (8MiB): {page} bytes")),
            Err(e) => return Err(format!("UMM_PAGE_SIZE={v:?} is not a power of two of bytes (8MiB): {e}")),
        });
    }
    if let Some(v) = var("UMM_PLAN_STEPS") {
        config.plan_steps = match v.trim().to_ascii_lowercase().as_str() {
            "on" | "1" | "true" | "yes" => true,
            "off" | "0" | "false" | "no" => false,
            _ => return Err(format!("UMM_PLAN_STEPS={v:?} is not one of on, off (1/0, true/false, yes/no)")),
        };
    }
    if let Some(v) = var("UMM_STITCH") {
        config.stitch = match v.trim().to_ascii_lowercase().as_str() {
            "on" | "1" | "true" | "yes" => true,
            "off" | "0" | "false" | "no" => false,
            _ => return Err(format!("UMM_STITCH={v:?} is not one of on, off (1/0, true/false, yes/no)")),
        };
    }
    if let Some(v) = var("UMM_STRATEGY") {
        config.strategy =
            v.parse::<Strategy>().map_err(|_| format!("UMM_STRATEGY={v:?} is not one of pooled, direct"))?;
    }
    Ok(config)
}

/// `UMM_HUGE_MIN` read through `var`: a byte count, 0 (the default) for no huge pool.
fn huge_min(var: impl Fn(&str) -> Option<String>) -> Result<u64, String> {
    match var("UMM_HUGE_MIN") {
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("UMM_HUGE_MIN={v:?} is not a byte count (an integer such as 1073741824; 0 disables)")),
        None => Ok(DEFAULT_HUGE_MIN),
    }
}

/// The environment variable `name`; a value that is not Unicode comes back lossily converted, so that it is
/// reported as invalid rather than ignored.
fn env_var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

impl Registry {
    fn discover() -> Self {
        let found = cuda::discover();
        let config = pool_config(env_var)
            .and_then(|c| Ok((c, huge_min(env_var)?)))
            .and_then(|c| trace::start(env_var).map(|()| c));
        let huge_min = config.as_ref().map_or(0, |(_, h)| *h);
        let mut devices: Vec<Slot> = Vec::new();
        for device in &found.devices {
            let info = device.info();
            let fail = |e| format!("umm: cannot create a pool on CUDA device {}: {e}", info.ordinal);
            let (pool, huge) = match &config {
                Ok((config, huge_min)) => match device.caching_pool(PoolPlacement::DeviceLocal, config.clone()) {
                    Ok(pool) if *huge_min > 0 && pool.pool().uses_virtual_memory() => {
                        let plain = PoolConfig { segment_mode: SegmentMode::Plain, ..config.clone() };
                        let huge = device.caching_pool(PoolPlacement::DeviceLocal, plain).map_err(fail);
                        match huge {
                            Ok(huge) => (Ok(pool), Some(huge)),
                            Err(e) => (Err(e), None),
                        }
                    }
                    Ok(pool) => (Ok(pool), None),
                    Err(e) => (Err(fail(e)), None),
                },
                Err(e) => (Err(format!("umm: {e}")), None),
            };
            while devices.len() < info.ordinal {
                let missing = devices.len();
                devices.push(Slot::missing(String::new(), format!("umm: CUDA device {missing} could not be opened")));
            }
            devices.push(Slot {
                name: info.name.clone(),
                total_memory: info.total_memory,
                pool,
                huge,
                limited: AtomicBool::new(false),
            });
        }
        Registry { devices, huge_min, skipped: found.skipped, live: Mutex::new(LiveMap::default()) }
    }

    /// The device's slot and main pool.
    fn pool(&self, device: i64) -> Result<(&Slot, &Arc<CudaPool>), String> {
        let slot = usize::try_from(device).ok().and_then(|d| self.devices.get(d));
        match slot {
            Some(slot @ Slot { pool: Ok(pool), .. }) => Ok((slot, pool)),
            Some(Slot { pool: Err(e), .. }) => Err(e.clone()),
            None if self.devices.is_empty() => Err(format!(
                "umm: no CUDA pool for device {device}: no CUDA device was found ({})",
                if self.skipped.is_empty() { "no reason given".to_string() } else { self.skipped.join("; ") }
            )),
            None => Err(format!(
                "umm: no CUDA pool for device {device}: devices are 0..{} ({})",
                self.devices.len(),
                self.devices.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
            )),
        }
    }

    /// The devices to act on, with their main pools: one (`device >= 0`) or all (`device == -1`).
    fn targets(&self, device: i64) -> Result<Vec<(&Slot, &Arc<CudaPool>)>, String> {
        if device == -1 {
            return Ok(self.devices.iter().filter_map(|s| s.pool.as_ref().ok().map(|p| (s, p))).collect());
        }
        Ok(vec![self.pool(device)?])
    }
}

/// Number of CUDA devices seen (including any whose pool could not be made). Discovers on first use.
pub(crate) fn device_count() -> usize {
    registry().devices.len()
}

/// Allocates `size` bytes on `device` for use on `stream` (0: the legacy default stream). Returns the device
/// address. O(1) from cache: [`CudaPool::allocate`] plus one map insert.
pub(crate) fn alloc(size: i64, device: i64, stream: StreamId) -> Result<u64, String> {
    if size <= 0 {
        return Err(format!("umm_alloc: size {size} on device {device}: a size must be above zero"));
    }
    let reg = registry();
    let (slot, main) = reg.pool(device)?;
    let (pool, huge) = slot.pool_for(main, size as u64, reg.huge_min);
    let _scope = ContextScope::enter();
    let block = pool.allocate(size as u64, stream).map_err(|e| format!("umm_alloc: {e}"))?;
    let ptr = match pool.device_ptr(&block) {
        Ok(p) => p,
        Err(e) => {
            let _ = pool.free(&block);
            return Err(format!("umm_alloc: {e}"));
        }
    };
    // Recorded before the pointer is published, so that no free of it is recorded first.
    let trace_id = trace::record_alloc(size as u64, stream.0);
    reg.live.lock().insert(ptr, Live { device: device as usize, stream, huge, block, trace_id });
    Ok(ptr)
}

/// Frees the block at `ptr`. `stream` is the stream of the free: when it is not the stream the block was
/// allocated on, the block is marked as used on it (`record_stream`), so it is reused only once the work queued
/// there has passed. Freeing 0 does nothing. An address umm did not hand out is an error and changes nothing.
/// `device` is checked only in the message: the address says which pool owns the block.
pub(crate) fn free(ptr: u64, device: i64, stream: StreamId) -> Result<(), String> {
    if ptr == 0 {
        return Ok(());
    }
    let Some(reg) = REGISTRY.get() else {
        return Err(format!(
            "umm_free: {ptr:#x} (device {device}) was not allocated by umm: nothing was allocated yet"
        ));
    };
    let live = reg.live.lock().remove(&ptr).ok_or_else(|| {
        format!("umm_free: {ptr:#x} (device {device}) was not allocated by umm or was already freed; nothing done")
    })?;
    trace::record_free(live.trace_id);
    let pool = live_pool(reg, &live)?;
    let _scope = ContextScope::enter();
    if stream != live.stream {
        pool.record_stream(&live.block, stream).map_err(|e| format!("umm_free: {e}"))?;
    }
    pool.free(&live.block).map_err(|e| format!("umm_free: {e}"))
}

fn live_pool<'a>(reg: &'a Registry, live: &Live) -> Result<&'a Arc<CudaPool>, String> {
    let (slot, main) = reg.pool(live.device as i64)?;
    Ok(if live.huge { slot.huge.as_ref().unwrap_or(main) } else { main })
}

/// Marks the live block at `ptr` as used on `stream` as well: its free then waits for the work queued there.
pub(crate) fn record_stream(ptr: u64, stream: StreamId) -> Result<(), String> {
    let reg = REGISTRY.get().ok_or_else(|| format!("umm_record_stream: {ptr:#x} was not allocated by umm"))?;
    let live = reg.live.lock();
    let entry = live.get(&ptr).ok_or_else(|| format!("umm_record_stream: {ptr:#x} was not allocated by umm"))?;
    let pool = live_pool(reg, entry)?;
    if stream == entry.stream {
        return Ok(());
    }
    let _scope = ContextScope::enter();
    pool.record_stream(&entry.block, stream).map_err(|e| format!("umm_record_stream: {e}"))
}

/// The device's pool statistics as one JSON object (names as in `torch.cuda.memory_stats()`).
pub(crate) fn stats_json(device: i64) -> Result<String, String> {
    let reg = registry();
    let (slot, pool) = reg.pool(device)?;
    let stats = slot.stats(pool);
    let live_pointers = reg.live.lock().values().filter(|l| l.device == device as usize).count();
    let mut value = serde_json::to_value(&stats).map_err(|e| format!("umm_stats_json: {e}"))?;
    if let Some(map) = value.as_object_mut() {
        map.insert("device".into(), device.into());
        map.insert("device_name".into(), slot.name.clone().into());
        map.insert("device_total_bytes".into(), slot.total_memory.into());
        map.insert("virtual_memory".into(), pool.pool().uses_virtual_memory().into());
        map.insert("live_pointers".into(), live_pointers.into());
        map.insert("pending_frees".into(), slot.pools().map(|p| p.pending_frees()).sum::<usize>().into());
        map.insert("huge_pool_min_bytes".into(), slot.huge.as_ref().map(|_| reg.huge_min).into());
        if let Some(huge) = &slot.huge {
            let main_stats = serde_json::to_value(pool.stats()).map_err(|e| format!("umm_stats_json: {e}"))?;
            let huge_stats = serde_json::to_value(huge.stats()).map_err(|e| format!("umm_stats_json: {e}"))?;
            map.insert("pools".into(), serde_json::json!({"main": main_stats, "huge": huge_stats}));
        }
        map.insert("hit_rate".into(), stats.hit_rate().into());
        map.insert("fragmentation_ratio".into(), stats.fragmentation_ratio().into());
    }
    Ok(value.to_string())
}

/// Gives cached memory of `device` (or every device for -1) back to the driver. Returns the bytes released.
pub(crate) fn empty_cache(device: i64) -> Result<u64, String> {
    let reg = registry();
    let _ = trace::flush(); // a moment the program chose; a failed write was reported when it happened
    let _scope = ContextScope::enter_saving();
    Ok(reg
        .targets(device)?
        .into_iter()
        .flat_map(|(slot, _)| slot.pools())
        .map(|p| p.release_cached().bytes_released)
        .sum())
}

/// Caps the bytes `device` (or every device for -1) reserves; 0 removes the cap. Cached memory above the new
/// cap is released at once. While a cap is set every request goes to the main pool, whose limit is the cap less
/// what the huge pool still holds.
pub(crate) fn set_limit(device: i64, bytes: u64) -> Result<(), String> {
    let reg = registry();
    let _scope = ContextScope::enter_saving();
    for (slot, main) in reg.targets(device)? {
        if bytes == 0 {
            main.set_limit(None).map_err(|e| format!("umm_set_limit: {e}"))?;
            slot.limited.store(false, Ordering::Relaxed);
            continue;
        }
        slot.limited.store(true, Ordering::Relaxed);
        let held = slot.huge.as_ref().map_or(0, |h| {
            h.release_cached();
            h.stats().reserved_bytes.current
        });
        let main_cap = bytes.checked_sub(held).filter(|&b| b > 0).ok_or_else(|| {
            format!("umm_set_limit: {bytes} bytes is not above the {held} bytes live in huge blocks on device {device}")
        })?;
        main.set_limit(Some(Limit::Bytes(main_cap))).map_err(|e| format!("umm_set_limit: {e}"))?;
        if main.stats().reserved_bytes.current > main_cap {
            main.release_cached();
        }
    }
    Ok(())
}

/// Resets the peaks of `device` (or every device for -1) to the current values.
/// Marks the end of a step on `device` (or every device for -1): steps that repeat are served from a plan (see
/// `umm_backends::Pool::mark_step`), and records the mark in the trace of `UMM_TRACE`.
pub(crate) fn mark_step(device: i64) -> Result<(), String> {
    let targets = registry().targets(device).map_err(|e| format!("umm_mark_step: {e}"))?;
    trace::record_step();
    let _scope = ContextScope::enter();
    for (slot, _) in targets {
        slot.pools().for_each(|p| {
            p.mark_step();
        });
    }
    Ok(())
}

pub(crate) fn reset_peaks(device: i64) -> Result<(), String> {
    for (slot, _) in registry().targets(device)? {
        slot.pools().for_each(|p| p.reset_peaks());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random values for every variable the C ABI reads: `Ok`, or an error that names the variable and quotes
    /// its value; never a panic. 10,000 cases (`UMM_FUZZ_CASES` overrides).
    #[test]
    fn fuzzed_variables_are_read_or_refused_by_name() {
        let cases: u64 = std::env::var("UMM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
        const VARS: [&str; 8] = [
            "UMM_CROSS_STREAM",
            "UMM_PLAN_STEPS",
            "UMM_SEGMENT_MODE",
            "UMM_MAPPED_SLACK",
            "UMM_SEGMENT_SLACK",
            "UMM_PAGE_SIZE",
            "UMM_STRATEGY",
            "UMM_HUGE_MIN",
        ];
        const VALUES: [&str; 28] = [
            "wait",
            "on",
            "True",
            "Completed",
            "",
            " ",
            "0",
            "1",
            "-1",
            "0.1",
            "NaN",
            "inf",
            "off",
            "none",
            "auto",
            "plain",
            "virtual",
            "VIRTUAL",
            "pooled",
            "direct",
            "8MiB",
            "3MiB",
            "1e30B",
            "99999999999999999999",
            "18446744073709551615",
            "2 MiB",
            "µ",
            "\u{0}",
        ];
        let mut state = 0x1234_5678_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..cases {
            let name = VARS[(next() % 6) as usize];
            let value = if next() % 4 == 0 {
                (0..next() % 8).map(|_| char::from_u32((next() % 0x3000) as u32).unwrap_or('?')).collect()
            } else {
                format!("{}{}", VALUES[(next() % 24) as usize], ["", "MiB", " ", "%"][(next() % 4) as usize])
            };
            let lookup = |k: &str| (k == name).then(|| value.clone());
            for result in [pool_config(lookup).map(|_| ()), huge_min(lookup).map(|_| ())] {
                if let Err(e) = result {
                    assert!(e.contains(&format!("{name}={value:?}")), "{name}={value:?}: {e}");
                }
            }
        }
    }
}
