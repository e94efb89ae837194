//! [`UniversalMemoryManager`]: discovers devices, decides placements, hands out [`UniversalBuffer`]s from the
//! per-device pools, and reports statistics and recommendations.

use crate::buffer::{BufferMeta, UniversalBuffer};
use crate::config::UmmConfig;
use crate::device::{self, Device};
use crate::error::{Error, Result};
use crate::figures::{self, RefreshState, Signature};
use crate::host_info::HostInfo;
use crate::options::AllocOptions;
use crate::placement_cache::{self, Epoch, Key, Placed};
use crate::profiler::{AllocEvent, Profiler};
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use umm_backends::{MemoryPool, OwnedBlock};
use umm_placement::{
    AccessPattern, Api, Decider, Decision, DeviceKind, DeviceSelector, DeviceView, Placement, Recommendations,
    SizeClass, UsageTracker,
};

/// Numbers managers, so that a thread's placements (see [`placement_cache`]) name the manager they belong to.
static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct Inner {
    pub(crate) config: UmmConfig,
    /// What pools made from now on are configured with: `config.pool`, with the limit
    /// [`UniversalMemoryManager::set_limit`] set last. Written under its lock while every pool made so far takes
    /// the new limit, so that no pool made meanwhile misses it.
    pub(crate) pool_config: RwLock<umm_backends::PoolConfig>,
    pub(crate) host: HostInfo,
    pub(crate) devices: Vec<Arc<Device>>,
    pub(crate) skipped: Vec<String>,
    pub(crate) decider: Decider,
    pub(crate) tracker: Arc<UsageTracker>,
    pub(crate) profiler: Arc<Profiler>,
    /// The usage evidence `Auto` follows, as of the last refresh.
    evidence: RwLock<Option<Arc<Recommendations>>>,
    /// This manager's number among managers (see [`placement_cache::Key`]).
    id: u64,
    /// Moves when a refresh finds that what decisions depend on has changed.
    epoch: Epoch,
    /// The devices as of the last refresh: what decisions are made on.
    views: RwLock<Arc<[DeviceView]>>,
    /// When the views were refreshed (nanoseconds since `born`).
    refreshed_ns: AtomicU64,
    born: Instant,
    /// Held by the thread refreshing the views: what decisions depend on, and the last refresh's baselines.
    refresh: Mutex<RefreshState>,
    /// Whether Auto may choose among several accelerators: then the figures are estimated again when a pool
    /// grows ([`crate::figures`]).
    several_accelerators: bool,
    /// The placements threads reuse (they hold `Weak`s): kept alive by the manager, not by idle threads.
    placed: Mutex<Vec<Arc<Placed>>>,
    /// The current device's index, where explicit placements without a selector go; [`NO_DEVICE`] for none.
    current: AtomicUsize,
    /// The sleeping tags ([`crate::sleep`]).
    pub(crate) sleepers: crate::tags::Sleepers,
}

/// [`Inner::current`] when there is no current device.
const NO_DEVICE: usize = usize::MAX;

/// The device explicit placements go to unless told otherwise: the GPU (or simulated GPU) with the most memory,
/// the first one among equals, CUDA's before another API's; `None` where there is none (software devices do not
/// count: they are host memory behind a slower API).
fn best_real_device(views: &[DeviceView]) -> Option<usize> {
    let real =
        |d: &&DeviceView| matches!(d.kind, DeviceKind::DiscreteGpu | DeviceKind::IntegratedGpu | DeviceKind::Simulated);
    views
        .iter()
        .filter(real)
        .max_by(|a, b| {
            let cuda = |d: &DeviceView| d.has_api(umm_placement::Api::Cuda);
            (a.total_bytes, cuda(a), std::cmp::Reverse(a.index)).cmp(&(
                b.total_bytes,
                cuda(b),
                std::cmp::Reverse(b.index),
            ))
        })
        .map(|d| d.index)
}

/// The manager. `Send + Sync`; share it by reference or `Arc`. Buffers keep what they need alive, so they may
/// outlive it.
pub struct UniversalMemoryManager {
    pub(crate) inner: Arc<Inner>,
}

impl UniversalMemoryManager {
    /// The manager over `config` (already read from the environment and checked: [`Builder::build`]): discovers
    /// the devices and measures them.
    pub(crate) fn assemble(mut config: UmmConfig, test_devices: &[device::TestDevice]) -> Result<Self> {
        // Every pool of the manager counts its reserved bytes in one group: the true peak of their sum.
        config.pool.reserved_group.get_or_insert_with(umm_backends::ReservedGroup::new);
        let host = HostInfo::discover();
        let found = device::discover(&config, &host, test_devices);
        let decider = Decider::new(config.decision)?;
        let tracker = Arc::new(UsageTracker::new(config.decision.thresholds)?);
        let profiler = Arc::new(Profiler::new(&config.profiler)?);
        let (views, baselines) = figures::measure(&found.devices);
        let signature = Signature::of(&views, config.decision.pressure_threshold, None);
        let current = best_real_device(&views).unwrap_or(NO_DEVICE);
        // Software devices do not count: Auto shuns them while the host is there.
        let several_accelerators = views.iter().filter(|v| v.is_accelerator() && v.kind != DeviceKind::Cpu).count() > 1;
        Ok(UniversalMemoryManager {
            inner: Arc::new(Inner {
                pool_config: RwLock::new(config.pool.clone()),
                config,
                host,
                devices: found.devices,
                skipped: found.skipped,
                decider,
                tracker,
                profiler,
                evidence: RwLock::new(None),
                id: NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed),
                epoch: Epoch::default(),
                views: RwLock::new(Arc::from(views)),
                refreshed_ns: AtomicU64::new(0),
                born: Instant::now(),
                refresh: Mutex::new(RefreshState { signature, baselines }),
                several_accelerators,
                placed: Mutex::new(Vec::new()),
                current: AtomicUsize::new(current),
                sleepers: crate::tags::Sleepers::default(),
            }),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &UmmConfig {
        &self.inner.config
    }

    /// The host's memory and processor.
    pub fn host(&self) -> &HostInfo {
        &self.inner.host
    }

    /// Every device; index 0 is the host.
    pub fn devices(&self) -> &[Arc<Device>] {
        &self.inner.devices
    }

    /// Why devices, platforms or whole APIs were skipped during discovery.
    pub fn skipped(&self) -> &[String] {
        &self.inner.skipped
    }

    /// The placer's views of all devices, with free memory now.
    pub fn device_views(&self) -> Vec<DeviceView> {
        self.inner.devices.iter().map(|d| d.view()).collect()
    }

    /// Where a request would go, and why, without allocating. Decided on the device figures of the last refresh
    /// (at most a few milliseconds old while allocations go on; see [`UniversalMemoryManager::cleanup`]).
    pub fn decide(&self, bytes: u64, options: &AllocOptions) -> Result<Decision> {
        let request = options.request(bytes).current(self.current_device());
        let evidence = self.evidence();
        let views = Arc::clone(&self.inner.views.read());
        Ok(self.inner.decider.decide_shared(&request, &views, evidence.as_deref())?)
    }

    /// The current device: where explicit placements (`DeviceLocal`, `ReadOnly`, `HostPinned`) without a
    /// selector go when it offers their pool, so that consecutive buffers land on one device and API, as with
    /// cudarc's or PyTorch's current device. By default the GPU with the most memory (CUDA's view of it first);
    /// `None` on a machine without one, where those placements go to host memory. `Auto` is not bound to it.
    pub fn current_device(&self) -> Option<usize> {
        Some(self.inner.current.load(Ordering::Relaxed)).filter(|&d| d != NO_DEVICE)
    }

    /// Sets the current device (see [`UniversalMemoryManager::current_device`]) to device `index`, any device
    /// [`UniversalMemoryManager::devices`] lists, a software one included, or to none. Later decisions use it;
    /// buffers already placed stay where they are.
    ///
    /// # Errors
    /// [`Error::Placement`] ([`umm_placement::Error::NoDevice`]) when no device has that index.
    pub fn set_current_device(&self, index: Option<usize>) -> Result<()> {
        if let Some(index) = index {
            if !self.inner.devices.iter().any(|d| d.index() == index) {
                let views = self.inner.views.read();
                return Err(umm_placement::Error::NoDevice {
                    asked: format!("device index {index} as the current device"),
                    available: views.iter().map(|d| format!("{} ({})", d.index, d.name)).collect::<Vec<_>>().join(", "),
                }
                .into());
            }
        }
        self.inner.current.store(index.unwrap_or(NO_DEVICE), Ordering::Relaxed);
        // Placements threads remember were made for the old device.
        self.inner.epoch.advance();
        Ok(())
    }

    /// Allocates `n` elements of `T` where `placement` (and the decision table) says.
    #[track_caller]
    #[inline]
    pub fn allocate_universal<T: bytemuck::Pod>(&self, n: usize, placement: Placement) -> Result<UniversalBuffer<T>> {
        self.allocate_universal_with(n, AllocOptions::new().placement(placement))
    }

    /// Allocates a buffer holding a copy of `data`. With `Placement::ReadOnly` it is read-only afterwards.
    #[track_caller]
    pub fn allocate_universal_from<T: bytemuck::Pod>(
        &self,
        data: &[T],
        placement: Placement,
    ) -> Result<UniversalBuffer<T>> {
        let access = if placement == Placement::ReadOnly { AccessPattern::ReadOnly } else { AccessPattern::Unknown };
        let options = AllocOptions::new().placement(placement).access(access);
        self.allocate_inner::<T>(data.len(), &options, Some(bytemuck::cast_slice(data)))
    }

    /// Allocates a buffer holding a copy of `data`, with full options (device, access pattern). With
    /// `Placement::ReadOnly` it is read-only afterwards: the only way to put data in a read-only buffer on a
    /// chosen device.
    #[track_caller]
    pub fn allocate_universal_from_with<T: bytemuck::Pod>(
        &self,
        data: &[T],
        options: AllocOptions,
    ) -> Result<UniversalBuffer<T>> {
        self.allocate_inner::<T>(data.len(), &options, Some(bytemuck::cast_slice(data)))
    }

    /// Allocates `n` elements of `T` with full options.
    ///
    /// `n == 0` gives a working empty buffer (no memory is taken; reads and writes of zero elements succeed),
    /// so generic code need not special-case empty tensors. `n * size_of::<T>()` overflowing 64 bits is
    /// [`Error::SizeOverflow`].
    #[track_caller]
    #[inline]
    pub fn allocate_universal_with<T: bytemuck::Pod>(
        &self,
        n: usize,
        options: AllocOptions,
    ) -> Result<UniversalBuffer<T>> {
        self.allocate_inner(n, &options, None)
    }

    /// Places and allocates `n` elements; `initial` (exactly `n` elements' bytes) fills the block at allocation,
    /// after which a ReadOnly buffer is sealed.
    #[track_caller]
    pub(crate) fn allocate_inner<T: bytemuck::Pod>(
        &self,
        n: usize,
        options: &AllocOptions,
        initial: Option<&[u8]>,
    ) -> Result<UniversalBuffer<T>> {
        let elem = std::mem::size_of::<T>();
        // Built only on overflow: an error made eagerly would be dropped on every successful allocation.
        let bytes = (n as u64).checked_mul(elem as u64).ok_or_else(|| Error::SizeOverflow {
            elements: n,
            elem_size: elem,
            type_name: std::any::type_name::<T>(),
        })?;
        // Decide on at least one byte so an empty buffer still reports where it would live.
        if placement_cache::tick() {
            self.inner.refresh_if_due();
        }
        let (mut placed, mut cached, mut big) = self.placement(bytes, options, true)?;
        let own = options.extras.as_ref().and_then(|e| e.tag.as_ref());
        let tag = crate::tags::tag_of(&self.inner.sleepers, own)?;
        let block = if bytes == 0 {
            None
        } else {
            loop {
                let pool = match &tag {
                    Some(tag) => {
                        let (kind, api) = (placed.decision.pool, placed.api);
                        placed.device.tagged_pool(tag, kind, api, &self.inner.pool_config.read())?
                    }
                    None => Arc::clone(placed.pool.as_ref().expect("placements for a non-empty buffer have a pool")),
                };
                // One atomic load, only where Auto chooses among devices: did this allocation take memory from the
                // device?
                let reserved = placed.balanced.then(|| pool.reserved_bytes());
                let block = match initial {
                    Some(data) => OwnedBlock::allocate_filled(pool, data, options.stream),
                    None => OwnedBlock::allocate(pool, bytes, options.stream, options.zeroed),
                };
                if let (Some(before), Ok(block)) = (reserved, &block) {
                    if block.pool().reserved_bytes() != before {
                        self.inner.rebalance();
                    }
                }
                match block {
                    // The placement was made on figures up to a refresh interval old: decide again on fresh ones.
                    Err(umm_backends::Error::OutOfMemory { .. }) if cached => {
                        self.inner.refresh();
                        (placed, cached, big) = self.placement(bytes, options, false)?;
                    }
                    other => break Some(other?),
                }
            }
        };
        if big {
            // A block this large may have moved the device's pressure state: the next decision should know.
            self.inner.refresh();
        }
        let decision = &placed.decision;
        let track = placed.tracker.register_sampled(bytes, options.placement, options.access, decision.pool);
        let profile_id = placed.profiler.on_alloc(&AllocEvent {
            device: decision.device,
            pool: decision.pool,
            api: placed.api,
            bytes,
            stream: options.stream,
            label: options.label_text(),
            location: std::panic::Location::caller(),
            block_key: block.as_ref().map(|b| b.info().key),
            pool_handle: block.as_ref().map(OwnedBlock::pool),
        });
        if let Some(data) = initial {
            placed.tracker.record_host_write(&track, data.len() as u64);
        }
        Ok(UniversalBuffer::new(
            initial.is_some(),
            block,
            n,
            BufferMeta {
                requested: options.placement,
                access: options.access,
                placed,
                label: options.label_text().map(|l| Box::new(l.to_string())),
                read_only: options.placement == Placement::ReadOnly,
                filled: false,
                migrated_via: None,
            },
            track,
            profile_id,
        ))
    }

    /// The placement of a request: with `reuse`, the calling thread's for requests like it when the epoch has
    /// not moved, else a fresh decision, which is remembered for the next request. Also returns whether it was
    /// reused, and whether the request is too big for a remembered placement to serve (a sizeable share of the
    /// device's free memory).
    pub(crate) fn placement(
        &self,
        bytes: u64,
        options: &AllocOptions,
        reuse: bool,
    ) -> Result<(Arc<Placed>, bool, bool)> {
        let inner = &self.inner;
        let key = Key {
            manager: inner.id,
            placement: options.placement,
            access: options.access,
            selector: options.selector,
            class: SizeClass::of(bytes.max(1), &inner.config.decision.thresholds),
        };
        let epoch = inner.epoch.now();
        if let Some(placed) = placement_cache::lookup(&key, epoch, bytes).filter(|_| reuse) {
            return Ok((placed, true, false));
        }
        // An explicit placement without a selector goes to the current device, where there is one: no choice.
        let to_current = options.placement != Placement::Auto
            && options.selector == DeviceSelector::Any
            && self.current_device().is_some();
        let balanced = inner.several_accelerators
            && !to_current
            && matches!(options.selector, DeviceSelector::Any | DeviceSelector::Api(_));
        if balanced {
            // A choice among devices is made on figures as they stand, not as the last refresh left them.
            inner.rebalance();
        }
        let epoch = inner.epoch.now();
        let decision = self.decide(bytes.max(1), options)?;
        let device = Arc::clone(&inner.devices[decision.device]);
        let api = match options.selector {
            DeviceSelector::Api(api) => Some(api),
            _ => None,
        };
        let pool = match device.pool(decision.pool, api, &inner.pool_config.read()) {
            // This thread's own handle on the pool: its buffers count on it, not on the pool every thread shares.
            Ok(pool) => Some(Arc::new(umm_backends::PoolLease::new(pool)) as Arc<dyn umm_backends::MemoryPool>),
            Err(e) if bytes > 0 => return Err(e),
            // An empty buffer needs no pool; a device that cannot make one still places it.
            Err(_) => None,
        };
        let (max_bytes, budget) = {
            let views = inner.views.read();
            let view = &views[decision.device];
            let share =
                if view.total_bytes == 0 { u64::MAX } else { view.free_bytes / placement_cache::CACHED_SHARE_OF_FREE };
            // A bigger request may not fit the device's largest single allocation: decided afresh.
            let max_bytes = if view.max_allocation == 0 { share } else { share.min(view.max_allocation) };
            let budget = if balanced {
                figures::spread_budget(&views, decision.device, decision.pool, options.selector)
            } else {
                u64::MAX
            };
            (max_bytes, budget)
        };
        let keep = pool.is_some();
        let placed = Arc::new(Placed {
            decision,
            device,
            pool,
            api,
            tracker: Arc::clone(&inner.tracker),
            profiler: Arc::clone(&inner.profiler),
            balanced,
        });
        if keep {
            let mut kept = inner.placed.lock();
            kept.push(Arc::clone(&placed));
            if let Some(replaced) = placement_cache::remember(key, epoch, max_bytes, budget, &placed) {
                kept.retain(|p| !std::ptr::eq(Arc::as_ptr(p), replaced.as_ptr()));
            }
        }
        Ok((placed, false, bytes > max_bytes))
    }

    fn evidence(&self) -> Option<Arc<Recommendations>> {
        self.inner.evidence.read().clone()
    }

    /// The indices of the devices that can reach device `index`'s memory as peers, as the CUDA driver reports
    /// them (empty for a device without CUDA, or an index that names no device).
    pub fn peers_of(&self, index: usize) -> Vec<usize> {
        fn cuda_info(device: &Device) -> Option<&umm_backends::DeviceInfo> {
            device.api_infos().into_iter().find(|i| i.api == Api::Cuda)
        }
        let devices = self.devices();
        let Some(info) = devices.get(index).and_then(|d| cuda_info(d)) else { return Vec::new() };
        let Some((_, listed)) = info.details.iter().find(|(key, _)| key == "peers") else { return Vec::new() };
        listed
            .split(", ")
            .filter_map(|p| p.strip_prefix("cuda:")?.parse::<usize>().ok())
            .filter_map(|ordinal| devices.iter().find(|d| cuda_info(d).is_some_and(|i| i.ordinal == ordinal)))
            .map(|d| d.index())
            .collect()
    }

    /// The pool a buffer of `bytes` with `options` would come from (placement, access pattern, selector and tag
    /// as [`allocate_universal_with`](Self::allocate_universal_with) decides), for callers that carve their own
    /// blocks out of it: a planned arena (`umm_tools::plan::PlannedArena`), a pool-level measurement.
    ///
    /// # Errors
    /// The decision's errors (no such device, an impossible placement), and [`Error::InvalidConfig`] where the
    /// decision is plain host memory, which no pool serves.
    pub fn pool_for(&self, bytes: u64, options: &AllocOptions) -> Result<Arc<dyn MemoryPool>> {
        let (placed, _, _) = self.placement(bytes, options, false)?;
        placed.pool.clone().ok_or_else(|| {
            Error::InvalidConfig(format!(
                "{bytes} bytes with {options:?} go to plain host memory, which no pool serves"
            ))
        })
    }

    /// The recommended placement for small, medium and large buffers, read-only data and frequently accessed
    /// data, each with its reason and evidence. Also refreshes the evidence that `Auto` follows.
    pub fn placement_recommendations(&self) -> Recommendations {
        let recs = self.inner.tracker.recommendations();
        *self.inner.evidence.write() = Some(Arc::new(recs.clone()));
        self.inner.epoch.advance();
        recs
    }

    /// The usage tracker behind the recommendations.
    pub fn usage_tracker(&self) -> &UsageTracker {
        &self.inner.tracker
    }
}

impl Inner {
    /// Refreshes the device figures and the evidence if the last refresh is older than
    /// [`UmmConfig::device_refresh`].
    fn refresh_if_due(&self) {
        let now = self.born.elapsed().as_nanos() as u64;
        if now.saturating_sub(self.refreshed_ns.load(Ordering::Relaxed)) >= self.config.device_refresh.as_nanos() as u64
        {
            self.refresh();
        }
    }

    /// Asks every device for its free memory and the tracker for its evidence, and moves the epoch when what
    /// decisions depend on changed. One thread at a time; a thread that finds another refreshing goes on with
    /// the figures it has.
    pub(crate) fn refresh(&self) {
        let Some(mut state) = self.refresh.try_lock() else { return };
        let (views, baselines) = figures::measure(&self.devices);
        let evidence = self.tracker.recommendations();
        let fresh = Signature::of(&views, self.config.decision.pressure_threshold, Some(&evidence));
        *self.views.write() = Arc::from(views);
        *self.evidence.write() = Some(Arc::new(evidence));
        self.refreshed_ns.store(self.born.elapsed().as_nanos() as u64, Ordering::Relaxed);
        state.baselines = baselines;
        if state.signature != fresh {
            state.signature = fresh;
            self.epoch.advance();
        }
        // Placements that no thread remembers and no buffer uses (their threads exited) go.
        self.placed.lock().retain(|p| Arc::strong_count(p) > 1 || Arc::weak_count(p) > 0);
    }

    /// Estimates the device figures again from the pools' books, without asking the devices, and moves the epoch
    /// when the devices' pressure or order changed ([`figures::estimate`]): after a pool grew, and before a
    /// choice among several accelerators.
    fn rebalance(&self) {
        let mut state = self.refresh.lock();
        let views = figures::estimate(&self.devices, &self.views.read(), &state.baselines);
        let fresh = state.signature.with_views(&views, self.config.decision.pressure_threshold);
        *self.views.write() = Arc::from(views);
        if state.signature != fresh {
            state.signature = fresh;
            self.epoch.advance();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.config.profiler.leak_warning {
            let leaks = self.profiler.leak_report();
            if !leaks.is_empty() {
                crate::notice::warn(format_args!(
                    "memory manager dropped while buffers are alive (they stay valid until dropped; \
                     UMM_LEAK_WARNING=0 silences this): {}",
                    leaks.to_string().trim_end()
                ));
            } else if !self.config.profiler.live_table {
                // No table to list them from: the pools' own counts still tell that buffers are alive.
                let total = self.memory_stats().total;
                let (blocks, bytes) = (total.active_blocks.current, total.requested_bytes.current);
                if blocks > 0 {
                    crate::notice::warn(format_args!(
                        "memory manager dropped while {blocks} buffer(s) of {bytes} bytes are alive (they stay valid \
                         until dropped; UMM_LIVE_TABLE=1 lists them with their call sites, UMM_LEAK_WARNING=0 \
                         silences this)"
                    ));
                }
            }
        }
        self.profiler.flush_trace();
    }
}

impl std::fmt::Debug for UniversalMemoryManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniversalMemoryManager").field("devices", &self.inner.devices).finish()
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<UniversalMemoryManager>();
    is::<UniversalBuffer<f32>>();
}
