//! The process-wide registry behind the C ABI: the devices (CUDA devices discovered on first use, or simulated
//! devices under `UMM_CAPI_SIM`), stream-aware caching pools of device memory per device, and the live pointers,
//! so that a free by address finds its block.
//!
//! Each device has a main pool: PyTorch's segment policy, with large blocks in one virtual reservation mapped
//! page by page where the device has virtual memory management. Optionally (`UMM_HUGE_MIN=bytes`, off by
//! default) requests of at least that size go to a second pool of plain segments next to a virtual main pool, so
//! a huge block gets a segment of its own that the next request of its size reuses whole; with two pools the
//! reported peaks are the pools' peaks added up (an upper bound), so it stays opt-in.
//!
//! Everything here is safe Rust over plain integers (addresses and stream handles as `u64`); [`crate::ffi`]
//! converts the C types.

use crate::device_pool::DevicePool;
use crate::history::{self, Action};
use crate::trace;
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use umm_backends::cuda::{self, ContextScope};
use umm_backends::pool::StreamPool;
use umm_backends::{
    BlockHandle, Error, Limit, Pool, PoolConfig, PoolKind, PoolStats, ReservedGroup, SegmentMode, SimBackend, Strategy,
    StreamId,
};
use umm_placement::units::human_bytes as human;

/// Default of `UMM_HUGE_MIN`: 0, no huge pool.
const DEFAULT_HUGE_MIN: u64 = 0;

/// A block handed out through the ABI.
struct Live {
    device: usize,
    /// The bytes asked for.
    requested: u64,
    /// The stream it was allocated on (its pool arena).
    stream: StreamId,
    /// Whether it came from the device's huge pool.
    huge: bool,
    /// The tagged pool it came from, if any ([`crate::tag`]).
    tagged: Option<SharedPool>,
    block: BlockHandle,
    /// Its ID in the `UMM_TRACE` recording (`None`: not recording).
    trace_id: Option<u64>,
}

/// One device's pools, or why it has none.
pub(crate) struct Slot {
    pub(crate) name: String,
    total_bytes: u64,
    pool: Result<Arc<dyn DevicePool>, String>,
    /// Plain segments for requests of at least `huge_min` bytes (only next to a virtual main pool).
    huge: Option<Arc<dyn DevicePool>>,
    /// Set while a limit is in force: every request then goes to the main pool, which holds the limit.
    limited: AtomicBool,
    /// The device's pools' reserved bytes together: the true peak where there are two.
    reserved: Arc<ReservedGroup>,
    /// Pools of tagged requests, one per tag, made on first use by `make_tagged` ([`crate::tag`]).
    pub(crate) tagged: RwLock<Vec<(Arc<str>, SharedPool)>>,
    pub(crate) make_tagged: Option<MakeTagged>,
}

/// Makes the pool of a tag on one device, given the tag and how many tagged pools the device has already.
pub(crate) type MakeTagged = Arc<dyn Fn(&str, usize) -> Result<SharedPool, String> + Send + Sync>;

impl Slot {
    /// A device's slot with its pools.
    fn new(
        name: String,
        total_bytes: u64,
        (pool, huge): (Result<SharedPool, String>, Option<SharedPool>),
        reserved: Arc<ReservedGroup>,
        make_tagged: Option<MakeTagged>,
    ) -> Self {
        let (limited, tagged) = (AtomicBool::new(false), RwLock::new(Vec::new()));
        Slot { name, total_bytes, pool, huge, limited, reserved, tagged, make_tagged }
    }

    /// The pool of `tag` on this device, made on first use. A sleeping tag refuses.
    pub(crate) fn tagged_pool(&self, tag: &Arc<str>) -> Result<SharedPool, String> {
        if let Some((_, pool)) = self.tagged.read().iter().find(|(t, _)| t == tag) {
            return Ok(Arc::clone(pool));
        }
        if let Some(action) = crate::tag::ASLEEP.lock().get(&**tag) {
            return Err(format!("tag {tag} is asleep ({action}): allocation refused until it wakes"));
        }
        let make = self.make_tagged.as_ref().ok_or_else(|| format!("device {} has no pools", self.name))?;
        let mut tagged = self.tagged.write();
        if let Some((_, pool)) = tagged.iter().find(|(t, _)| t == tag) {
            return Ok(Arc::clone(pool));
        }
        let pool = make(tag, tagged.len())?;
        tagged.push((Arc::clone(tag), Arc::clone(&pool)));
        Ok(pool)
    }

    fn missing(name: String, reason: String) -> Self {
        Slot {
            name,
            total_bytes: 0,
            pool: Err(reason),
            huge: None,
            limited: AtomicBool::new(false),
            reserved: ReservedGroup::new(),
            tagged: RwLock::new(Vec::new()),
            make_tagged: None,
        }
    }

    /// The pool for a request of `size` bytes and whether it is the huge one.
    fn pool_for<'a>(
        &'a self,
        main: &'a Arc<dyn DevicePool>,
        size: u64,
        huge_min: u64,
    ) -> (&'a Arc<dyn DevicePool>, bool) {
        match &self.huge {
            Some(h) if size >= huge_min && !self.limited.load(Ordering::Relaxed) => (h, true),
            _ => (main, false),
        }
    }

    /// Statistics of the main pool plus the huge and tagged pools. Peaks add, so the peaks are upper bounds of
    /// the true peaks of the sum, but for reserved bytes, whose true peak the device's group keeps.
    fn stats(&self, main: &dyn DevicePool) -> PoolStats {
        let mut stats = main.stats();
        let others: Vec<SharedPool> =
            self.huge.iter().cloned().chain(self.tagged.read().iter().map(|(_, p)| Arc::clone(p))).collect();
        if !others.is_empty() {
            let limit = stats.limit_bytes;
            others.iter().for_each(|p| stats.accumulate(&p.stats()));
            stats.limit_bytes = limit;
            stats.reserved_bytes.peak = self.reserved.peak();
        }
        stats
    }

    /// The main pool, the huge pool and the tagged pools.
    fn pools(&self) -> Vec<SharedPool> {
        let fixed = self.pool.as_ref().ok().into_iter().chain(self.huge.as_ref()).cloned();
        fixed.chain(self.tagged.read().iter().map(|(_, p)| Arc::clone(p))).collect()
    }
}

pub(crate) struct Registry {
    /// Indexed by CUDA ordinal (or simulated device number).
    pub(crate) devices: Vec<Slot>,
    /// Whether the devices are simulated (`UMM_CAPI_SIM`).
    simulated: bool,
    /// Requests of at least this many bytes go to a device's huge pool (`UMM_HUGE_MIN`; 0: no huge pools).
    huge_min: u64,
    /// Why discovery found nothing, or skipped devices (empty when all went well).
    skipped: Vec<String>,
    /// Device address → block. One lock: PyTorch calls from its main and autograd threads, few at once.
    live: Mutex<LiveMap>,
}

/// Live blocks by device address.
type LiveMap = umm_backends::KeyMap<Live>;

/// A device's pool, shared.
pub(crate) type SharedPool = Arc<dyn DevicePool>;

static REGISTRY: OnceLock<Registry> = OnceLock::new();

pub(crate) fn registry() -> &'static Registry {
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
        config.page_size = Some(match umm_placement::units::parse_size(&v) {
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

/// `UMM_CAPI_SIM` read through `var`: `None` (unset: CUDA devices), or the simulated devices' count and bytes
/// each, from `16GiB` (one device) or `2x16GiB`.
fn simulated_devices(var: impl Fn(&str) -> Option<String>) -> Option<Result<(usize, u64), String>> {
    let value = var("UMM_CAPI_SIM")?;
    let refuse =
        |why: String| format!("UMM_CAPI_SIM={value:?} is not a size (16GiB) or a count and a size (2x16GiB): {why}");
    let text = value.trim();
    let (count, size) = match text.split_once(['x', 'X']) {
        Some((count, size)) if !count.is_empty() && count.bytes().all(|b| b.is_ascii_digit()) => (count, size),
        _ => ("1", text),
    };
    let parsed = count
        .parse::<usize>()
        .map_err(|e| refuse(format!("count: {e}")))
        .and_then(|n| if (1..=64).contains(&n) { Ok(n) } else { Err(refuse(format!("{n} devices is not 1 to 64"))) })
        .and_then(|n| match umm_placement::units::parse_size(size) {
            Ok(bytes) if bytes >= SimBackend::PAGE => Ok((n, bytes)),
            Ok(bytes) => Err(refuse(format!("{bytes} bytes is below one 2 MiB page"))),
            Err(e) => Err(refuse(e)),
        });
    Some(parsed)
}

/// Where simulated device `index`'s addresses begin: 1 TiB apart, none at 0.
fn simulated_base(index: usize) -> u64 {
    (index as u64 + 1) << 40
}

/// Tagged pools a simulated device can have.
const SIMULATED_TAGS: usize = 256;

/// Where the addresses of simulated device `index`'s tagged pool `number` begin: 1 TiB apart, above every
/// device's main and huge pools (devices are at most 64).
fn simulated_tag_base(index: usize, number: usize) -> Result<u64, umm_backends::Error> {
    if number >= SIMULATED_TAGS {
        return Err(Error::InvalidConfig(format!("a simulated device has at most {SIMULATED_TAGS} tags")));
    }
    Ok((128 + (index * SIMULATED_TAGS + number) as u64) << 40)
}

impl Registry {
    fn discover() -> Self {
        let config = pool_config(env_var)
            .and_then(|c| Ok((c, huge_min(env_var)?)))
            .and_then(|c| trace::start(env_var).map(|()| c));
        match simulated_devices(env_var) {
            Some(Ok((count, bytes))) => Self::simulated(count, bytes, config),
            Some(Err(e)) => Self::without_devices(format!("umm: {e}")),
            None => Self::cuda(config),
        }
    }

    fn without_devices(reason: String) -> Self {
        Registry {
            devices: Vec::new(),
            simulated: false,
            huge_min: 0,
            skipped: vec![reason],
            live: Mutex::new(LiveMap::default()),
        }
    }

    /// Pools on every CUDA device.
    fn cuda(config: Result<(PoolConfig, u64), String>) -> Self {
        let found = cuda::discover();
        let huge_min = config.as_ref().map_or(0, |(_, h)| *h);
        let mut devices: Vec<Slot> = Vec::new();
        for device in &found.devices {
            let info = device.info();
            let fail = |e| format!("umm: cannot create a pool on CUDA device {}: {e}", info.ordinal);
            let reserved = ReservedGroup::new();
            let pool = |config: PoolConfig| {
                let config = PoolConfig { reserved_group: Some(Arc::clone(&reserved)), ..config };
                device.caching_pool(PoolKind::DeviceLocal, config).map(|p| p as Arc<dyn DevicePool>).map_err(fail)
            };
            let (pool, huge) = match &config {
                Ok((config, huge_min)) => Self::pools(*huge_min, config, pool),
                Err(e) => (Err(format!("umm: {e}")), None),
            };
            let make_tagged: Option<MakeTagged> = config.as_ref().ok().map(|(config, _)| {
                let (device, config, reserved) = (device.clone(), config.clone(), Arc::clone(&reserved));
                Arc::new(move |tag: &str, _: usize| {
                    let config = PoolConfig {
                        reserved_group: Some(Arc::clone(&reserved)),
                        segment_mode: SegmentMode::Virtual,
                        ..config.tagged(tag)
                    };
                    // Virtual reservations where the device has them; plain segments, which cannot sleep, else.
                    let pool = device.caching_pool(PoolKind::DeviceLocal, config.clone()).or_else(|_| {
                        device.caching_pool(
                            PoolKind::DeviceLocal,
                            PoolConfig { segment_mode: SegmentMode::Auto, ..config },
                        )
                    });
                    pool.map(|p| p as SharedPool).map_err(|e| format!("umm: cannot create the pool of tag {tag}: {e}"))
                }) as MakeTagged
            });
            while devices.len() < info.ordinal {
                let missing = devices.len();
                devices.push(Slot::missing(String::new(), format!("umm: CUDA device {missing} could not be opened")));
            }
            devices.push(Slot::new(info.name.clone(), info.total_bytes, (pool, huge), reserved, make_tagged));
        }
        Registry { devices, simulated: false, huge_min, skipped: found.skipped, live: Mutex::new(LiveMap::default()) }
    }

    /// `count` simulated devices of `bytes` each, with virtual memory as CUDA devices have it; the huge pool's
    /// plain segments come from a second simulated device of the same size at addresses of their own.
    fn simulated(count: usize, bytes: u64, config: Result<(PoolConfig, u64), String>) -> Self {
        let huge_min = config.as_ref().map_or(0, |(_, h)| *h);
        let devices = (0..count)
            .map(|index| {
                let name = format!("umm simulated device {index}");
                let reserved = ReservedGroup::new();
                let pool = |config: PoolConfig| {
                    let config = PoolConfig { reserved_group: Some(Arc::clone(&reserved)), ..config };
                    let plain = config.segment_mode == SegmentMode::Plain;
                    let backend = if plain {
                        SimBackend::plain(name.clone(), bytes)
                    } else {
                        SimBackend::new(name.clone(), bytes)
                    };
                    // A plain pool next to a virtual one (the huge pool) takes the upper half of the device's range.
                    let base = simulated_base(index) + if plain { 1 << 39 } else { 0 };
                    Pool::new(backend.at_address(base), config)
                        .map(|p| Arc::new(StreamPool::new(p)) as Arc<dyn DevicePool>)
                        .map_err(|e| format!("umm: cannot create a pool on simulated device {index}: {e}"))
                };
                let (pool, huge) = match &config {
                    Ok((config, huge_min)) => Self::pools(*huge_min, config, pool),
                    Err(e) => (Err(format!("umm: {e}")), None),
                };
                let make_tagged: Option<MakeTagged> = config.as_ref().ok().map(|(config, _)| {
                    let (name, config, reserved) = (name.clone(), config.clone(), Arc::clone(&reserved));
                    Arc::new(move |tag: &str, number: usize| {
                        let config = PoolConfig { reserved_group: Some(Arc::clone(&reserved)), ..config.tagged(tag) };
                        // Each tagged pool's addresses lie apart from the main and huge pools' and each other's;
                        // its pages keep their bytes, so that offloading them has something to copy.
                        let backend = SimBackend::new(name.clone(), bytes).holding_bytes();
                        simulated_tag_base(index, number)
                            .and_then(|base| Pool::new(backend.at_address(base), config))
                            .map(|p| Arc::new(StreamPool::new(p)) as SharedPool)
                            .map_err(|e| {
                                format!("umm: cannot create the pool of tag {tag} on simulated device {index}: {e}")
                            })
                    }) as MakeTagged
                });
                Slot::new(name, bytes, (pool, huge), reserved, make_tagged)
            })
            .collect();
        Registry { devices, simulated: true, huge_min, skipped: Vec::new(), live: Mutex::new(LiveMap::default()) }
    }

    /// A device's main pool and, with `huge_min` set and a virtual main pool, its huge pool of plain segments.
    fn pools(
        huge_min: u64,
        config: &PoolConfig,
        make: impl Fn(PoolConfig) -> Result<SharedPool, String>,
    ) -> (Result<SharedPool, String>, Option<SharedPool>) {
        match make(config.clone()) {
            Ok(pool) if huge_min > 0 && pool.uses_virtual_memory() => {
                match make(PoolConfig { segment_mode: SegmentMode::Plain, ..config.clone() }) {
                    Ok(huge) => (Ok(pool), Some(huge)),
                    Err(e) => (Err(e), None),
                }
            }
            other => (other, None),
        }
    }

    /// The device's slot and main pool.
    fn pool(&self, device: i64) -> Result<(&Slot, &SharedPool), String> {
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
    fn targets(&self, device: i64) -> Result<Vec<(&Slot, &SharedPool)>, String> {
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
/// address. O(1) from cache: the pool's allocation plus one map insert (and, while history is recorded, one ring
/// push).
pub(crate) fn alloc(size: i64, device: i64, stream: StreamId) -> Result<u64, String> {
    if size <= 0 {
        return Err(format!("umm_alloc: size {size} on device {device}: a size must be above zero"));
    }
    let reg = registry();
    let (slot, main) = reg.pool(device)?;
    let tagged = match crate::tag::current() {
        Some(tag) => Some(slot.tagged_pool(&tag).map_err(|e| format!("umm_alloc: {e}"))?),
        None => None,
    };
    let (pool, huge) = match &tagged {
        Some(pool) => (pool, false),
        None => slot.pool_for(main, size as u64, reg.huge_min),
    };
    let _scope = ContextScope::enter();
    let reserved_before = history::on().then(|| pool.reserved_bytes());
    let block = match pool.allocate(size as u64, stream) {
        Ok(block) => block,
        Err(e) => return Err(alloc_failure(slot, main, device as usize, size as u64, stream, e)),
    };
    let ptr = match pool.address(&block) {
        Ok(p) => p,
        Err(e) => {
            let _ = pool.free(&block);
            return Err(format!("umm_alloc: {e}"));
        }
    };
    if let Some(before) = reserved_before {
        let device = device as usize;
        history::push_reserved_change(device, pool.uses_virtual_memory(), ptr, stream.0, before, pool.reserved_bytes());
        history::push(device, Action::Alloc, ptr, block.size(), stream.0, None);
    }
    // Recorded before the pointer is published, so that no free of it is recorded first.
    let trace_id = trace::record_alloc(size as u64, stream.0);
    let live = Live { device: device as usize, requested: size as u64, stream, huge, tagged, block, trace_id };
    reg.live.lock().insert(ptr, live);
    Ok(ptr)
}

/// The message of a failed allocation. An out-of-memory names what a user needs to see where the memory is:
/// reserved, allocated, the largest free block, the limit and the device's free memory (PyTorch's OOM message
/// has the first two).
fn alloc_failure(
    slot: &Slot,
    main: &Arc<dyn DevicePool>,
    device: usize,
    size: u64,
    stream: StreamId,
    error: Error,
) -> String {
    if !error.is_out_of_memory() {
        return format!("umm_alloc: {error}");
    }
    let stats = slot.stats(main.as_ref());
    let largest_free = slot
        .pools()
        .iter()
        .flat_map(|p| p.snapshot().segments)
        .flat_map(|s| s.blocks)
        .filter(|b| b.free)
        .map(|b| b.size)
        .max()
        .unwrap_or(0);
    let device_free = main.device_free();
    history::push(device, Action::Oom, 0, size, stream.0, Some(device_free));
    let limit = match stats.limit_bytes {
        Some(limit) => format!("{} ({limit} bytes)", human(limit)),
        None => "none".to_string(),
    };
    format!(
        "umm_alloc: out of memory on device {device} ({}): tried to allocate {} ({size} bytes); umm has reserved {} \
         ({} bytes), allocated {} ({} bytes), largest free block {} ({largest_free} bytes), limit {limit}; the \
         device has {} ({device_free} bytes) free. Cause: {error}",
        slot.name,
        human(size),
        human(stats.reserved_bytes.current),
        stats.reserved_bytes.current,
        human(stats.allocated_bytes.current),
        stats.allocated_bytes.current,
        human(largest_free),
        human(device_free),
    )
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
    let reserved_before = history::on().then(|| pool.reserved_bytes());
    pool.free(&live.block).map_err(|e| format!("umm_free: {e}"))?;
    if let Some(before) = reserved_before {
        let size = live.block.size();
        history::push(live.device, Action::FreeRequested, ptr, size, live.stream.0, None);
        history::push(live.device, Action::FreeCompleted, ptr, size, live.stream.0, None);
        let after = pool.reserved_bytes();
        history::push_reserved_change(live.device, pool.uses_virtual_memory(), ptr, live.stream.0, before, after);
    }
    Ok(())
}

fn live_pool<'a>(reg: &'a Registry, live: &'a Live) -> Result<&'a SharedPool, String> {
    if let Some(pool) = &live.tagged {
        return Ok(pool);
    }
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
    let stats = slot.stats(pool.as_ref());
    let live_pointers = reg.live.lock().values().filter(|l| l.device == device as usize).count();
    let mut value = serde_json::to_value(&stats).map_err(|e| format!("umm_stats_json: {e}"))?;
    if let Some(map) = value.as_object_mut() {
        map.insert("device".into(), device.into());
        map.insert("device_name".into(), slot.name.clone().into());
        map.insert("device_total_bytes".into(), slot.total_bytes.into());
        map.insert("virtual_memory".into(), pool.uses_virtual_memory().into());
        map.insert("simulated".into(), reg.simulated.into());
        map.insert("live_pointers".into(), live_pointers.into());
        map.insert("pending_frees".into(), slot.pools().iter().map(|p| p.pending_frees()).sum::<usize>().into());
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

/// Starts recording the last `max_entries` allocation events of every device for [`snapshot_json`]'s
/// `device_traces` (dropping what was recorded before); 0 stops and keeps them.
pub(crate) fn record_history(max_entries: i64) -> Result<(), String> {
    let entries = u64::try_from(max_entries)
        .map_err(|_| format!("umm_record_history: {max_entries} entries: a count is 0 (stop) or above"))?;
    history::record(entries)
}

/// The memory of `device` (or every device for -1) in the shape of PyTorch's `torch.cuda.memory._snapshot()`:
/// `segments`, each with its `blocks`, and `device_traces` (one list per device, see [`record_history`]), so
/// that PyTorch's memory visualizer draws it. A virtual reservation shows as one expandable segment of its
/// mapped bytes: its live blocks, then its mapped free bytes as one inactive block, so that every segment's
/// size adds up to the reserved bytes of the statistics and its active blocks to the allocated bytes.
pub(crate) fn snapshot_json(device: i64) -> Result<String, String> {
    let reg = registry();
    let targets = reg.targets(device).map_err(|e| format!("umm_snapshot_json: {e}"))?;
    // Requested bytes of live blocks by (pool, block key).
    let requested: std::collections::HashMap<(usize, u64), u64> = reg
        .live
        .lock()
        .values()
        .filter_map(|l| Some(((pool_id(live_pool(reg, l).ok()?), l.block.key()), l.requested)))
        .collect();
    let mut segments = Vec::new();
    for (slot, _) in &targets {
        let index = reg.devices.iter().position(|s| std::ptr::eq(s, *slot)).expect("a slot of the registry");
        for pool in slot.pools() {
            for segment in pool.snapshot().segments {
                segments.push(segment_json(index, pool_id(&pool), &segment, &requested));
            }
        }
    }
    let devices = reg.devices.len();
    let value = serde_json::json!({
        "segments": segments,
        "device_traces": history::events(devices),
        "allocator_settings": {"allocator": "umm", "simulated": reg.simulated, "huge_pool_min_bytes": reg.huge_min},
    });
    Ok(value.to_string())
}

/// What names a pool in [`snapshot_json`]'s table of requested sizes: its address.
fn pool_id(pool: &SharedPool) -> usize {
    Arc::as_ptr(pool) as *const () as usize
}

/// One segment of [`snapshot_json`].
fn segment_json(
    device: usize,
    pool: usize,
    segment: &umm_backends::SegmentSnapshot,
    requested: &std::collections::HashMap<(usize, u64), u64>,
) -> serde_json::Value {
    let base = segment.address.unwrap_or(0);
    let mut blocks = Vec::new();
    let (mut allocated, mut requested_total, mut free_mapped, mut first_free) = (0, 0, 0, None);
    for block in &segment.blocks {
        let address = base + block.offset;
        if block.free {
            first_free.get_or_insert(address);
            free_mapped += block.size;
            if !segment.virtual_reservation {
                blocks.push(serde_json::json!({
                    "address": address, "size": block.size, "requested_size": 0, "state": "inactive", "frames": [],
                }));
            }
            continue;
        }
        // A block of the pool's own (a stitched range's piece, a plan) has no live pointer: its size stands.
        let asked = block.key.and_then(|k| requested.get(&(pool, k)).copied()).unwrap_or(block.size);
        allocated += block.size;
        requested_total += asked;
        blocks.push(serde_json::json!({
            "address": address, "size": block.size, "requested_size": asked, "state": "active_allocated",
            "frames": [],
        }));
    }
    let total = if segment.virtual_reservation { segment.physical_bytes } else { segment.size };
    if segment.virtual_reservation {
        // Mapped free bytes; the rest of a free run is unmapped address space, which holds no memory.
        let mapped_free = total.saturating_sub(allocated).min(free_mapped);
        if mapped_free > 0 {
            blocks.push(serde_json::json!({
                "address": first_free.unwrap_or(base), "size": mapped_free, "requested_size": 0,
                "state": "inactive", "frames": [],
            }));
        }
    }
    serde_json::json!({
        "device": device,
        "address": base,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": requested_total,
        "stream": segment.stream.0,
        "segment_type": if segment.class == "small" { "small" } else { "large" },
        "segment_pool_id": [0, 0],
        "is_expandable": segment.virtual_reservation,
        "frames": [],
        "blocks": blocks,
    })
}

/// Gives cached memory of `device` (or every device for -1) back to the driver. Returns the bytes released.
pub(crate) fn empty_cache(device: i64) -> Result<u64, String> {
    let reg = registry();
    let _ = trace::flush(); // a moment the program chose; a failed write was reported when it happened
    reg.targets(device)?; // an unknown device is an error, as for every call naming one
    let _scope = ContextScope::enter_saving();
    let mut released = 0;
    for (index, slot) in reg.devices.iter().enumerate() {
        if device != -1 && device != index as i64 {
            continue;
        }
        for pool in slot.pools() {
            let before = pool.reserved_bytes();
            released += pool.release_cached().bytes_released;
            history::push_reserved_change(index, pool.uses_virtual_memory(), 0, 0, before, pool.reserved_bytes());
        }
    }
    Ok(released)
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

/// Marks the end of a step on `device` (or every device for -1): steps that repeat are served from a plan (see
/// `umm_backends::Pool::mark_step`), and records the mark in the trace of `UMM_TRACE`.
pub(crate) fn mark_step(device: i64) -> Result<(), String> {
    let targets = registry().targets(device).map_err(|e| format!("umm_mark_step: {e}"))?;
    trace::record_step();
    let _scope = ContextScope::enter();
    for (slot, _) in targets {
        slot.pools().iter().for_each(|p| {
            p.mark_step();
        });
    }
    Ok(())
}

/// Resets the peaks of `device` (or every device for -1) to the current values.
pub(crate) fn reset_peaks(device: i64) -> Result<(), String> {
    for (slot, _) in registry().targets(device)? {
        slot.pools().iter().for_each(|p| p.reset_peaks());
        slot.reserved.reset_peak();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    /// Valid values set the field they name; a page size must be a power of two.
    #[test]
    fn each_variable_sets_its_field() {
        let config = pool_config(vars(&[
            ("UMM_SEGMENT_MODE", "plain"),
            ("UMM_PLAN_STEPS", "off"),
            ("UMM_STITCH", "no"),
            ("UMM_PAGE_SIZE", "8MiB"),
            ("UMM_STRATEGY", "direct"),
            ("UMM_CROSS_STREAM", "wait"),
            ("UMM_MAPPED_SLACK", "0.05"),
            ("UMM_SEGMENT_SLACK", "off"),
        ]))
        .unwrap();
        assert_eq!(config.segment_mode, SegmentMode::Plain);
        assert!(!config.plan_steps && !config.stitch);
        assert_eq!(config.page_size, Some(8 << 20));
        assert_eq!(config.strategy, Strategy::Direct);
        assert_eq!(config.cross_stream, umm_backends::CrossStream::Wait);
        assert_eq!((config.mapped_slack, config.segment_slack), (Some(0.05), None));
        for on in ["on", "1", "true", "yes"] {
            let lookup = move |name: &str| (name == "UMM_PLAN_STEPS" || name == "UMM_STITCH").then(|| on.to_string());
            let config = pool_config(lookup).unwrap();
            assert!(config.plan_steps && config.stitch, "{on}");
        }
        for off in ["off", "0", "false", "no"] {
            let lookup = move |name: &str| (name == "UMM_PLAN_STEPS" || name == "UMM_STITCH").then(|| off.to_string());
            let config = pool_config(lookup).unwrap();
            assert!(!config.plan_steps && !config.stitch, "{off}");
        }
        let err = pool_config(vars(&[("UMM_PAGE_SIZE", "3MiB")])).unwrap_err();
        assert!(err.contains("not a power of two") && err.contains("3145728 bytes"), "{err}");
        assert_eq!(pool_config(vars(&[])).unwrap(), PoolConfig::default());
        assert_eq!(huge_min(vars(&[("UMM_HUGE_MIN", "1073741824")])), Ok(1 << 30));
        assert_eq!(huge_min(vars(&[])), Ok(0));
    }

    /// `UMM_CAPI_SIM`: a size, or a count and a size; at least one page; 1 to 64 devices.
    #[test]
    fn simulated_devices_are_read_from_a_size_or_a_count_and_a_size() {
        let read = |v: &'static str| simulated_devices(move |name: &str| (name == "UMM_CAPI_SIM").then(|| v.into()));
        assert_eq!(read("16GiB"), Some(Ok((1, 16 << 30))));
        assert_eq!(read("2x16GiB"), Some(Ok((2, 16 << 30))));
        assert_eq!(read(" 3X2MiB "), Some(Ok((3, 2 << 20))), "one page is enough");
        for (bad, why) in [
            ("x16GiB", "UMM_CAPI_SIM=\"x16GiB\""),
            ("2x", "UMM_CAPI_SIM=\"2x\""),
            ("1x1MiB", "below one 2 MiB page"),
            ("65x1GiB", "65 devices"),
            ("0x1GiB", "0 devices"),
        ] {
            let err = read(bad).expect("set").unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
        assert_eq!(simulated_devices(|_: &str| None), None, "unset: CUDA's devices");
    }

    /// Simulated devices start 1 TiB apart, none at 0; a huge pool next to a virtual main pool takes the
    /// requests of at least its size until a limit is set, at addresses of its own.
    #[test]
    fn simulated_devices_route_huge_requests_to_their_own_pool() {
        assert_eq!((simulated_base(0), simulated_base(1)), (1 << 40, 2 << 40));
        let registry = Registry::simulated(2, 4 << 30, Ok((PoolConfig::default(), 64 << 20)));
        assert!(registry.simulated);
        let slot = &registry.devices[1];
        let main = slot.pool.as_ref().unwrap();
        let huge = slot.huge.as_ref().expect("a huge pool next to a virtual main pool");
        assert!(main.uses_virtual_memory() && !huge.uses_virtual_memory());
        let (pool, is_huge) = slot.pool_for(main, 64 << 20, registry.huge_min);
        assert!(is_huge && Arc::ptr_eq(pool, huge));
        let (pool, is_huge) = slot.pool_for(main, (64 << 20) - 1, registry.huge_min);
        assert!(!is_huge && Arc::ptr_eq(pool, main));
        let block = huge.allocate(64 << 20, StreamId(0)).unwrap();
        let address = huge.address(&block).unwrap();
        assert!(((2 << 40) + (1 << 39)..3 << 40).contains(&address), "{address:#x}");
        let small = main.allocate(1 << 20, StreamId(0)).unwrap();
        assert!((2 << 40..(2 << 40) + (1 << 39)).contains(&main.address(&small).unwrap()));
        // The device's true reserved peak counts both pools at once.
        assert_eq!(slot.reserved.current(), main.reserved_bytes() + huge.reserved_bytes());
        assert_eq!(slot.stats(main.as_ref()).reserved_bytes.peak, slot.reserved.peak());
        slot.limited.store(true, Ordering::Relaxed);
        assert!(!slot.pool_for(main, 1 << 30, registry.huge_min).1, "under a limit everything goes to the main pool");
        huge.free(&block).unwrap();
        main.free(&small).unwrap();
        let plain_only = Registry::simulated(1, 1 << 30, Ok((PoolConfig::default(), 0)));
        assert!(plain_only.devices[0].huge.is_none(), "no huge pool without UMM_HUGE_MIN");
    }

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
