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

use crate::config::{env_var, huge_min, pool_config, simulated_base, simulated_devices, simulated_tag_base};
use crate::device_pool::DevicePool;
use crate::graph_pool::{GraphPool, PoolId};
use crate::history::{self, Action};
use crate::trace;
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use umm_backends::cuda::{self, ContextScope};
use umm_backends::pool::StreamPool;
use umm_backends::{
    BlockHandle, CrossStream, Error, Limit, Pool, PoolConfig, PoolKind, PoolStats, ReservedGroup, SegmentMode,
    SimBackend, SimDeviceStreams, StreamId,
};
use umm_placement::units::human_bytes as human;

/// A block handed out through the ABI.
pub(crate) struct Live {
    pub(crate) device: usize,
    /// The bytes asked for.
    pub(crate) requested: u64,
    /// The stream it was allocated on (its pool arena).
    pub(crate) stream: StreamId,
    /// Whether it came from the device's huge pool.
    pub(crate) huge: bool,
    /// The tagged or private pool it came from, if any ([`crate::tag`], [`crate::graph_pool`]).
    pub(crate) tagged: Option<SharedPool>,
    /// Whether `tagged` is a private pool of graphs: freeing its last block may let the pool go. A flag, not the
    /// pool's name, so that a live entry stays as small as it was (the live map moves it on every allocation).
    pub(crate) graph: bool,
    pub(crate) block: BlockHandle,
    /// Its ID in the `UMM_TRACE` recording (`None`: not recording).
    pub(crate) trace_id: Option<u64>,
}

/// One device's pools, or why it has none.
pub(crate) struct Slot {
    pub(crate) name: String,
    pub(crate) total_bytes: u64,
    pub(crate) pool: Result<Arc<dyn DevicePool>, String>,
    /// Plain segments for requests of at least `huge_min` bytes (only next to a virtual main pool).
    pub(crate) huge: Option<Arc<dyn DevicePool>>,
    /// Set while a limit is in force: every request then goes to the main pool, which holds the limit.
    pub(crate) limited: AtomicBool,
    /// The device's pools' reserved bytes together: the true peak where there are two.
    pub(crate) reserved: Arc<ReservedGroup>,
    /// Pools of tagged requests, one per tag, made on first use by `make_pool` ([`crate::tag`]).
    pub(crate) tagged: RwLock<Vec<(Arc<str>, SharedPool)>>,
    pub(crate) make_pool: Option<MakePool>,
    /// Private pools of graph captures ([`crate::graph_pool`]).
    pub(crate) graphs: Mutex<Vec<GraphPool>>,
    /// Captures underway on the device.
    pub(crate) captures: AtomicU32,
    /// Held while a capture begins or ends and while a pool is made, so that every pool sees each capture once.
    pub(crate) capture_lock: Mutex<()>,
    /// Tagged and private pools made so far: each gets its own number (its addresses on a simulated device).
    made: AtomicUsize,
}

/// Makes a tagged or private pool on one device, given what it is for and its number on the device.
pub(crate) type MakePool = Arc<dyn Fn(Purpose<'_>, usize) -> Result<SharedPool, String> + Send + Sync>;

/// What a pool made after discovery is for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Purpose<'a> {
    /// The memory of a tag, which sleeps and wakes as a whole.
    Tag(&'a str),
    /// The private pool of graph captures ([`crate::graph_pool`]).
    Graph(PoolId),
}

/// Pages of private pools: a capture's memory is mapped once and kept while its graph lives, so small pages cost
/// no more device calls than the capture's first run makes, and keep a small graph's pool small.
const GRAPH_PAGE: u64 = 2 << 20;

impl Purpose<'_> {
    /// The configuration of the pool, from the device's.
    fn config(self, base: &PoolConfig) -> PoolConfig {
        match self {
            Purpose::Tag(tag) => base.tagged(tag),
            // A private pool serves captures only: no plans, no stitched ranges, no memory between its streams
            // (they capture together; their order is the graph's, not the pool's), and the device's segment policy.
            Purpose::Graph(_) => PoolConfig {
                stitch: false,
                plan_steps: false,
                cross_stream: CrossStream::Off,
                page_size: Some(GRAPH_PAGE),
                ..base.clone()
            },
        }
    }

    fn describe(self) -> String {
        match self {
            Purpose::Tag(tag) => format!("the pool of tag {tag}"),
            Purpose::Graph(id) => format!("private pool {id}"),
        }
    }
}

impl Slot {
    /// A device's slot with its pools.
    fn new(
        name: String,
        total_bytes: u64,
        (pool, huge): (Result<SharedPool, String>, Option<SharedPool>),
        reserved: Arc<ReservedGroup>,
        make_pool: Option<MakePool>,
    ) -> Self {
        Slot {
            name,
            total_bytes,
            pool,
            huge,
            limited: AtomicBool::new(false),
            reserved,
            tagged: RwLock::new(Vec::new()),
            make_pool,
            graphs: Mutex::new(Vec::new()),
            captures: AtomicU32::new(0),
            capture_lock: Mutex::new(()),
            made: AtomicUsize::new(0),
        }
    }

    /// The number of the next tagged or private pool made.
    pub(crate) fn next_pool_number(&self) -> usize {
        self.made.fetch_add(1, Ordering::Relaxed)
    }

    /// The pool of `tag` on this device, made on first use. A sleeping tag refuses.
    pub(crate) fn tagged_pool(&self, tag: &Arc<str>) -> Result<SharedPool, String> {
        if let Some((_, pool)) = self.tagged.read().iter().find(|(t, _)| t == tag) {
            return Ok(Arc::clone(pool));
        }
        if let Some(action) = crate::tag::ASLEEP.lock().get(&**tag) {
            return Err(format!("tag {tag} is asleep ({action}): allocation refused until it wakes"));
        }
        let make = self.make_pool.as_ref().ok_or_else(|| format!("device {} has no pools", self.name))?;
        // Made under the capture lock, so that a capture that begins meanwhile finds the pool in the list.
        let _capture = self.capture_lock.lock();
        let mut tagged = self.tagged.write();
        if let Some((_, pool)) = tagged.iter().find(|(t, _)| t == tag) {
            return Ok(Arc::clone(pool));
        }
        let pool = make(Purpose::Tag(tag), self.next_pool_number())?;
        for _ in 0..self.captures.load(Ordering::SeqCst) {
            pool.begin_capture();
        }
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
            make_pool: None,
            graphs: Mutex::new(Vec::new()),
            captures: AtomicU32::new(0),
            capture_lock: Mutex::new(()),
            made: AtomicUsize::new(0),
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
    pub(crate) fn stats(&self, main: &dyn DevicePool) -> PoolStats {
        let mut stats = main.stats();
        let others: Vec<SharedPool> = self
            .huge
            .iter()
            .cloned()
            .chain(self.tagged.read().iter().map(|(_, p)| Arc::clone(p)))
            .chain(self.graph_pools())
            .collect();
        if !others.is_empty() {
            let limit = stats.limit_bytes;
            others.iter().for_each(|p| stats.accumulate(&p.stats()));
            stats.limit_bytes = limit;
            stats.reserved_bytes.peak = self.reserved.peak();
        }
        stats
    }

    /// The main pool, the huge pool, the tagged pools and the private pools of graphs.
    pub(crate) fn pools(&self) -> Vec<SharedPool> {
        let fixed = self.pool.as_ref().ok().into_iter().chain(self.huge.as_ref()).cloned();
        fixed.chain(self.tagged.read().iter().map(|(_, p)| Arc::clone(p))).chain(self.graph_pools()).collect()
    }
}

pub(crate) struct Registry {
    /// Indexed by CUDA ordinal (or simulated device number).
    pub(crate) devices: Vec<Slot>,
    /// Whether the devices are simulated (`UMM_CAPI_SIM`).
    pub(crate) simulated: bool,
    /// Requests of at least this many bytes go to a device's huge pool (`UMM_HUGE_MIN`; 0: no huge pools).
    pub(crate) huge_min: u64,
    /// Why discovery found nothing, or skipped devices (empty when all went well).
    skipped: Vec<String>,
    /// Device address → block. One lock: PyTorch calls from its main and autograd threads, few at once.
    pub(crate) live: Mutex<LiveMap>,
}

/// Live blocks by device address.
type LiveMap = umm_backends::KeyMap<Live>;

/// A device's pool, shared.
pub(crate) type SharedPool = Arc<dyn DevicePool>;

static REGISTRY: OnceLock<Registry> = OnceLock::new();

/// The registry if a call made it already (frees and look-ups of addresses need no discovery).
pub(crate) fn initialized() -> Option<&'static Registry> {
    REGISTRY.get()
}

pub(crate) fn registry() -> &'static Registry {
    REGISTRY.get_or_init(|| {
        // Discovery binds each device's context to this thread; put the caller's back afterwards.
        let _scope = ContextScope::enter_saving();
        Registry::discover()
    })
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
            let make_pool: Option<MakePool> = config.as_ref().ok().map(|(config, _)| {
                let (device, config, reserved) = (device.clone(), config.clone(), Arc::clone(&reserved));
                Arc::new(move |purpose: Purpose<'_>, _: usize| {
                    let config = PoolConfig { reserved_group: Some(Arc::clone(&reserved)), ..purpose.config(&config) };
                    let first = match purpose {
                        // Virtual reservations where the device has them; plain segments, which cannot sleep, else.
                        Purpose::Tag(_) => PoolConfig { segment_mode: SegmentMode::Virtual, ..config.clone() },
                        Purpose::Graph(_) => config.clone(),
                    };
                    let pool = device.caching_pool(PoolKind::DeviceLocal, first).or_else(|_| {
                        // The device's own pages where they are larger than a private pool's.
                        let fallback = PoolConfig { segment_mode: SegmentMode::Auto, ..config };
                        let fallback = match purpose {
                            Purpose::Graph(_) => PoolConfig { page_size: None, ..fallback },
                            Purpose::Tag(_) => fallback,
                        };
                        device.caching_pool(PoolKind::DeviceLocal, fallback)
                    });
                    pool.map(|p| p as SharedPool).map_err(|e| format!("umm: cannot create {}: {e}", purpose.describe()))
                }) as MakePool
            });
            while devices.len() < info.ordinal {
                let missing = devices.len();
                devices.push(Slot::missing(String::new(), format!("umm: CUDA device {missing} could not be opened")));
            }
            devices.push(Slot::new(info.name.clone(), info.total_bytes, (pool, huge), reserved, make_pool));
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
                // One device's streams, whichever of its pools marks them or waits on them.
                let streams = SimDeviceStreams::default();
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
                    Pool::new(backend.at_address(base).with_streams(&streams), config)
                        .map(|p| Arc::new(StreamPool::new(p)) as Arc<dyn DevicePool>)
                        .map_err(|e| format!("umm: cannot create a pool on simulated device {index}: {e}"))
                };
                let (pool, huge) = match &config {
                    Ok((config, huge_min)) => Self::pools(*huge_min, config, pool),
                    Err(e) => (Err(format!("umm: {e}")), None),
                };
                let make_pool: Option<MakePool> = config.as_ref().ok().map(|(config, _)| {
                    let (name, config, reserved) = (name.clone(), config.clone(), Arc::clone(&reserved));
                    let streams = streams.clone();
                    Arc::new(move |purpose: Purpose<'_>, number: usize| {
                        let config =
                            PoolConfig { reserved_group: Some(Arc::clone(&reserved)), ..purpose.config(&config) };
                        // Each tagged pool's addresses lie apart from the main and huge pools' and each other's;
                        // its pages keep their bytes, so that offloading them has something to copy.
                        let backend = SimBackend::new(name.clone(), bytes).holding_bytes().with_streams(&streams);
                        simulated_tag_base(index, number)
                            .and_then(|base| Pool::new(backend.at_address(base), config))
                            .map(|p| Arc::new(StreamPool::new(p)) as SharedPool)
                            .map_err(|e| {
                                format!("umm: cannot create {} on simulated device {index}: {e}", purpose.describe())
                            })
                    }) as MakePool
                });
                Slot::new(name, bytes, (pool, huge), reserved, make_pool)
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
    pub(crate) fn pool(&self, device: i64) -> Result<(&Slot, &SharedPool), String> {
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
    pub(crate) fn targets(&self, device: i64) -> Result<Vec<(&Slot, &SharedPool)>, String> {
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
    alloc_to(size, device, stream, None)
}

/// Allocates like [`alloc`], from private pool `graph` when given (which must be retained), else from the pool
/// of the thread's tag or the device's main or huge pool.
// Inlined into each C entry point: the call would be a tenth of a cached allocation's instructions.
#[inline(always)]
pub(crate) fn alloc_to(size: i64, device: i64, stream: StreamId, graph: Option<PoolId>) -> Result<u64, String> {
    if size <= 0 {
        return Err(format!("umm_alloc: size {size} on device {device}: a size must be above zero"));
    }
    let reg = registry();
    let (slot, main) = reg.pool(device)?;
    let tagged = match (graph, crate::tag::current()) {
        (Some(id), _) => Some(slot.graph_pool(id).map_err(|e| format!("umm_alloc: {e}"))?),
        (None, Some(tag)) => Some(slot.tagged_pool(&tag).map_err(|e| format!("umm_alloc: {e}"))?),
        (None, None) => None,
    };
    let (pool, huge) = match &tagged {
        Some(pool) => (pool, false),
        None => slot.pool_for(main, size as u64, reg.huge_min),
    };
    let _scope = ContextScope::enter();
    // A pool that grows during a capture calls what the driver's strict capture modes refuse (see `graph_pool`).
    let _relaxed = (slot.capturing() && !reg.simulated).then(cuda::RelaxedCaptureMode::enter);
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
    let live = Live {
        device: device as usize,
        requested: size as u64,
        stream,
        huge,
        tagged,
        graph: graph.is_some(),
        block,
        trace_id,
    };
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
    free_on(ptr, device, Some(stream))
}

/// Frees the block at `ptr` on `stream`, or on the stream it was allocated on (`None`, PyTorch's `raw_delete`).
#[inline(always)]
fn free_on(ptr: u64, device: i64, stream: Option<StreamId>) -> Result<(), String> {
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
    let stream = stream.unwrap_or(live.stream);
    crate::share::forget(ptr, &live.block);
    trace::record_free(live.trace_id);
    let pool = live_pool(reg, &live)?;
    let _scope = ContextScope::enter();
    let slot = reg.devices.get(live.device);
    let _relaxed = (slot.is_some_and(Slot::capturing) && !reg.simulated).then(cuda::RelaxedCaptureMode::enter);
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
    if let (true, Some(slot)) = (live.graph, slot) {
        slot.drop_graph_pool_if_unused(|g| Arc::ptr_eq(&g.pool, pool));
    }
    Ok(())
}

/// Frees the block at `ptr` on the stream it was allocated on (PyTorch's `raw_delete`): reuse waits only for
/// the streams it was marked as used on.
pub(crate) fn delete(ptr: u64) -> Result<(), String> {
    free_on(ptr, -1, None).map_err(|e| e.replacen("umm_free", "umm_delete", 1))
}

pub(crate) fn live_pool<'a>(reg: &'a Registry, live: &'a Live) -> Result<&'a SharedPool, String> {
    if let Some(pool) = &live.tagged {
        return Ok(pool);
    }
    let (slot, main) = reg.pool(live.device as i64)?;
    Ok(if live.huge { slot.huge.as_ref().unwrap_or(main) } else { main })
}

/// The segment that holds the live block at `ptr`: its first address and size, for a plain segment; the block
/// itself for a block in a virtual reservation, whose pages are no one allocation of the driver's.
pub(crate) fn base_allocation(ptr: u64) -> Result<(u64, u64), String> {
    let unknown = || format!("umm_base_allocation: {ptr:#x} is not a live block of umm");
    let reg = REGISTRY.get().ok_or_else(unknown)?;
    let (pool, size) = {
        let live = reg.live.lock();
        let entry = live.get(&ptr).ok_or_else(unknown)?;
        (SharedPool::clone(live_pool(reg, entry)?), entry.block.size())
    };
    let segment = pool.snapshot().segments.into_iter().find(|s| {
        let base = s.address.unwrap_or(0);
        (base..base + s.size).contains(&ptr)
    });
    Ok(match segment {
        Some(s) if !s.virtual_reservation => (s.address.unwrap_or(ptr), s.size),
        _ => (ptr, size),
    })
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

/// Starts recording the last `max_entries` allocation events of every device for [`snapshot_json`]'s
/// `device_traces` (dropping what was recorded before); 0 stops and keeps them.
pub(crate) fn record_history(max_entries: i64) -> Result<(), String> {
    let entries = u64::try_from(max_entries)
        .map_err(|_| format!("umm_record_history: {max_entries} entries: a count is 0 (stop) or above"))?;
    history::record(entries)
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
}
