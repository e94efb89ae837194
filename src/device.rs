//! The device registry: every device discovered through every API, merged so that one physical GPU seen through
//! two APIs is one [`Device`] with two APIs. Pools are created on first use.

use crate::config::UmmConfig;
use crate::discovery::{ApiEntry, ApiHandle};
use crate::host_info::HostInfo;
use parking_lot::Mutex;
use std::fmt;
use std::sync::{Arc, Weak};
use umm_backends::{DeviceInfo, HostBackend, MemoryPool, Pool, PoolConfig, SegmentMode, SimBackend};
use umm_placement::{Api, DeviceKind, DeviceView, PoolKind};

/// The pool of an adopted buffer, held weakly: it lives as long as its buffer.
type AdoptedPool = (Api, PoolKind, Weak<dyn MemoryPool>);

/// A pool made for a device, with the API and kind it was made for.
pub type DevicePool = (Api, PoolKind, Arc<dyn MemoryPool>);

/// A tagged pool of a device ([`crate::AllocOptions::tag`]), with its tag, API and kind.
pub type TaggedPool = (Arc<str>, Api, PoolKind, Arc<dyn MemoryPool>);

/// A device: the host, a GPU, a CPU device (PoCL, lavapipe) or a simulated device, with the APIs it is seen
/// through and the pools made for it so far.
pub struct Device {
    index: usize,
    name: String,
    kind: DeviceKind,
    shares_memory_with_host: bool,
    total_bytes: u64,
    pci_bus_id: Option<String>,
    apis: Vec<ApiEntry>,
    pools: Mutex<Vec<DevicePool>>,
    /// The pools of tagged requests, one per tag, API and kind, created on first use: a tag sleeps and wakes as
    /// a whole ([`crate::UniversalMemoryManager::sleep`]).
    tagged: Mutex<Vec<TaggedPool>>,
    /// The pools of adopted buffers, one each, alive while their buffer is.
    adopted: Mutex<Vec<AdoptedPool>>,
}

impl Device {
    /// Index among the manager's devices (0 is the host).
    pub fn index(&self) -> usize {
        self.index
    }
    /// Name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Kind.
    pub fn kind(&self) -> DeviceKind {
        self.kind
    }
    /// The APIs through which this device is reached, preferred first.
    pub fn apis(&self) -> Vec<Api> {
        self.apis.iter().map(|a| a.api).collect()
    }
    /// Whether device memory is host memory.
    pub fn shares_memory_with_host(&self) -> bool {
        self.shares_memory_with_host
    }
    /// Total memory in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
    /// PCI bus id (`dddd:bb:dd.f`), when any API reports it.
    pub fn pci_bus_id(&self) -> Option<&str> {
        self.pci_bus_id.as_deref()
    }
    /// What each API reports about the device.
    pub fn api_infos(&self) -> Vec<&DeviceInfo> {
        self.apis.iter().map(|a| &a.info).collect()
    }

    /// Free memory now: the lowest figure among the device's pools and its discovery report.
    pub fn free_bytes(&self) -> u64 {
        let pools = self.pools.lock();
        // Pinned pools report host memory: only device-memory pools speak for an accelerator.
        let from_pools = pools
            .iter()
            .filter(|(_, kind, _)| self.kind == DeviceKind::Host || *kind != PoolKind::HostPinned)
            .map(|(_, _, p)| p.free_bytes())
            .min();
        let from_info = self.apis.iter().filter_map(|a| a.info.free_bytes).min();
        from_pools.or(from_info).unwrap_or(self.total_bytes)
    }

    /// The pools created so far, with their API and kind, then the tagged pools
    /// ([`crate::AllocOptions::tag`]), then the pool of each live adopted buffer
    /// ([`crate::UniversalMemoryManager::adopt`]).
    pub fn pools(&self) -> Vec<DevicePool> {
        let mut pools = self.pools.lock().clone();
        pools.extend(self.tagged.lock().iter().map(|(_, api, kind, pool)| (*api, *kind, Arc::clone(pool))));
        let mut adopted = self.adopted.lock();
        adopted.retain(|(_, _, pool)| pool.strong_count() > 0);
        pools.extend(adopted.iter().filter_map(|(api, kind, pool)| Some((*api, *kind, pool.upgrade()?))));
        pools
    }

    /// Lists the pool of an adopted buffer among the device's pools while the buffer lives.
    pub(crate) fn register_adopted(&self, api: Api, kind: PoolKind, pool: &Arc<dyn MemoryPool>) {
        let mut adopted = self.adopted.lock();
        adopted.retain(|(_, _, pool)| pool.strong_count() > 0);
        adopted.push((api, kind, Arc::downgrade(pool)));
    }

    /// The backend device objects of the APIs this device is seen through.
    #[cfg_attr(not(any(feature = "cuda", feature = "opencl", feature = "wgpu")), allow(dead_code))]
    pub(crate) fn handles(&self) -> impl Iterator<Item = &ApiHandle> {
        self.apis.iter().map(|a| &a.handle)
    }

    /// The pool kinds this device offers.
    pub fn pool_kinds(&self) -> Vec<PoolKind> {
        let mut kinds: Vec<PoolKind> = Vec::new();
        for entry in &self.apis {
            for &kind in &entry.placements {
                if !kinds.contains(&kind) {
                    kinds.push(kind);
                }
            }
        }
        if self.kind == DeviceKind::Host {
            kinds = vec![PoolKind::Host, PoolKind::HostPinned];
        }
        kinds
    }

    /// The placer's view of this device.
    pub fn view(&self) -> DeviceView {
        DeviceView {
            index: self.index,
            name: self.name.clone(),
            kind: self.kind,
            apis: self.apis(),
            shares_memory_with_host: self.shares_memory_with_host,
            total_bytes: self.total_bytes,
            free_bytes: self.free_bytes(),
            cached_bytes: 0,
            pools: self.pool_kinds(),
            max_allocation: self.apis.iter().map(|a| a.info.max_allocation).max().unwrap_or(0),
        }
    }

    /// The tagged pools created so far, with their tags.
    pub fn tagged_pools(&self) -> Vec<TaggedPool> {
        self.tagged.lock().clone()
    }

    /// The pool of tag `tag` for requests that would go to the pool of `kind` through `api`, created on first
    /// use with [`PoolConfig::tagged`] (every block in virtual reservations where the device has them).
    pub(crate) fn tagged_pool(
        &self,
        tag: &Arc<str>,
        kind: PoolKind,
        api: Option<Api>,
        config: &PoolConfig,
    ) -> crate::error::Result<Arc<dyn MemoryPool>> {
        let kind = if self.kind == DeviceKind::Host { PoolKind::Host } else { kind };
        let api = match api {
            Some(api) => api,
            // The API the untagged pool of this kind goes through.
            None => self.entry_for(kind, None)?.0.api,
        };
        let mut tagged = self.tagged.lock();
        if let Some((_, _, _, pool)) = tagged.iter().find(|(t, a, k, _)| t == tag && *a == api && *k == kind) {
            return Ok(Arc::clone(pool));
        }
        // Virtual reservations where the device has them, so that the tag can sleep; plain segments elsewhere,
        // where sleep says why it cannot.
        let config = PoolConfig { segment_mode: SegmentMode::Virtual, ..config.tagged(tag) };
        let (_, pool) = self.make_pool(kind, Some(api), &config)?;
        tagged.push((Arc::clone(tag), api, kind, Arc::clone(&pool)));
        Ok(pool)
    }

    /// The pool of `kind` through `api` (or the preferred API offering it), created on first use.
    pub(crate) fn pool(
        &self,
        kind: PoolKind,
        api: Option<Api>,
        config: &PoolConfig,
    ) -> crate::error::Result<Arc<dyn MemoryPool>> {
        // On the host, pinned requests share the host pool: without an accelerator there is nothing to pin for.
        let kind = if self.kind == DeviceKind::Host { PoolKind::Host } else { kind };
        let (entry, _) = self.entry_for(kind, api)?;
        let mut pools = self.pools.lock();
        if let Some((_, _, pool)) = pools.iter().find(|(a, k, _)| *a == entry.api && *k == kind) {
            return Ok(Arc::clone(pool));
        }
        let (api, pool) = self.make_pool(kind, Some(entry.api), config)?;
        pools.push((api, kind, Arc::clone(&pool)));
        Ok(pool)
    }

    /// The API entry that offers pools of `kind` (through `api`, if named), and the placement its factory makes.
    fn entry_for(&self, kind: PoolKind, api: Option<Api>) -> crate::error::Result<(&ApiEntry, PoolKind)> {
        let placement = kind.on_device();
        let entry = self
            .apis
            .iter()
            .filter(|e| api.is_none_or(|a| a == e.api))
            .find(|e| self.kind == DeviceKind::Host || e.placements.contains(&placement))
            .ok_or_else(|| {
                crate::error::Error::InvalidConfig(format!(
                    "device {} offers no {kind} pool through {}",
                    self.name,
                    api.map_or_else(|| "any API".to_string(), |a| a.to_string())
                ))
            })?;
        Ok((entry, placement))
    }

    /// A new pool of `kind` through `api` (or the preferred API offering it), with that API.
    fn make_pool(
        &self,
        kind: PoolKind,
        api: Option<Api>,
        config: &PoolConfig,
    ) -> crate::error::Result<(Api, Arc<dyn MemoryPool>)> {
        let (entry, placement) = self.entry_for(kind, api)?;
        let pool = match (entry.factory)(placement, config) {
            // `virtual` asks for reservations where the device has them (`UMM_SEGMENT_MODE`'s documentation): the
            // host and devices without virtual memory keep plain segments rather than refuse every allocation.
            Err(e) if e.is_invalid_config() && config.segment_mode == SegmentMode::Virtual => {
                let plain = PoolConfig { segment_mode: SegmentMode::Auto, ..config.clone() };
                let pool = (entry.factory)(placement, &plain).map_err(|_| e)?;
                log::info!(
                    "segment_mode virtual (UMM_SEGMENT_MODE): {} through {} has no virtual memory; its {kind} pool \
                     uses plain segments",
                    self.name,
                    entry.api
                );
                pool
            }
            other => other?,
        };
        Ok((entry.api, pool))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let apis: Vec<String> = self.apis.iter().map(|a| a.api.to_string()).collect();
        write!(
            f,
            "[{}] {} ({}; {}; {:.1} GiB{})",
            self.index,
            self.name,
            self.kind,
            apis.join("+"),
            self.total_bytes as f64 / f64::from(1u32 << 30),
            if self.shares_memory_with_host && self.kind != DeviceKind::Host { "; shares host memory" } else { "" }
        )
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// Everything discovery found, and what it skipped.
pub(crate) struct Discovered {
    pub(crate) devices: Vec<Arc<Device>>,
    pub(crate) skipped: Vec<String>,
}

/// Discovers the host, every enabled API's devices, and the configured simulated devices.
pub(crate) fn discover(config: &UmmConfig, host: &HostInfo, test_devices: &[TestDevice]) -> Discovered {
    let mut entries: Vec<ApiEntry> = Vec::new();
    let mut skipped = Vec::new();
    let host_alignment = host.preferred_alignment();
    let host_capacity = host.total_bytes;
    entries.push(ApiEntry {
        api: Api::Host,
        info: DeviceInfo {
            api: Api::Host,
            ordinal: 0,
            name: "host".into(),
            vendor: host.cpu_vendor.clone().unwrap_or_default(),
            kind: DeviceKind::Host,
            total_bytes: host.total_bytes,
            free_bytes: Some(host.available_bytes),
            shares_memory_with_host: true,
            alignment: host_alignment,
            max_allocation: host.total_bytes,
            pci_bus_id: None,
            uuid: None,
            details: host.cpu_brand.iter().map(|b| ("cpu".to_string(), b.clone())).collect(),
        },
        placements: vec![PoolKind::HostPinned],
        factory: Box::new(move |_, config| {
            let backend = HostBackend::new("host", host_capacity).with_alignment(host_alignment)?;
            Ok(Arc::new(Pool::new(backend, config.clone())?) as Arc<dyn MemoryPool>)
        }),
        handle: ApiHandle::Plain,
    });
    crate::discovery::discover_all(config, &mut entries, &mut skipped);
    for (i, &capacity) in config.simulated_devices.iter().enumerate() {
        entries.push(simulated_entry(
            i,
            capacity,
            "simulated: keeps the bytes written to it (memory taken on first touch)",
            move |name, _, config| {
                // Bytes kept, as the C ABI's simulated devices keep them: copies, fills and an offloading sleep
                // work as on a GPU.
                let backend = SimBackend::new(name, capacity).holding_bytes();
                Ok(Arc::new(Pool::new(backend, config.clone())?) as Arc<dyn MemoryPool>)
            },
        ));
    }
    for (i, test) in test_devices.iter().enumerate() {
        let factory = Arc::clone(&test.factory);
        let ordinal = config.simulated_devices.len() + i;
        entries.push(simulated_entry(
            ordinal,
            test.capacity,
            "test device: its pools are made by the test",
            move |name, placement, config| factory(name, placement, config),
        ));
    }
    Discovered { devices: merge(entries), skipped }
}

/// Makes the pool of one placement of a test device from the pool's name, its placement and its configuration
/// (see [`crate::Builder::simulated_device_with_pools`]).
pub(crate) type TestPoolFactory =
    dyn Fn(&str, PoolKind, &PoolConfig) -> umm_backends::Result<Arc<dyn MemoryPool>> + Send + Sync;

/// A simulated device whose pools a test makes (see [`crate::Builder::simulated_device_with_pools`]).
#[derive(Clone)]
pub(crate) struct TestDevice {
    pub(crate) capacity: u64,
    pub(crate) factory: Arc<TestPoolFactory>,
}

impl fmt::Debug for TestDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestDevice").field("capacity", &self.capacity).finish_non_exhaustive()
    }
}

/// The entry of simulated device `sim{ordinal}` of `capacity` bytes (DeviceLocal and ReadOnly pools), whose
/// pools `make` makes from the pool's name (`sim{ordinal}/{placement}`), placement and configuration.
fn simulated_entry(
    ordinal: usize,
    capacity: u64,
    note: &str,
    make: impl Fn(&str, PoolKind, &PoolConfig) -> umm_backends::Result<Arc<dyn MemoryPool>> + Send + Sync + 'static,
) -> ApiEntry {
    let name = format!("sim{ordinal}");
    ApiEntry {
        api: Api::Sim,
        info: DeviceInfo {
            api: Api::Sim,
            ordinal,
            name: name.clone(),
            vendor: "umm".into(),
            kind: DeviceKind::Simulated,
            total_bytes: capacity,
            free_bytes: Some(capacity),
            shares_memory_with_host: false,
            alignment: SimBackend::ALIGNMENT,
            max_allocation: capacity,
            pci_bus_id: None,
            uuid: None,
            details: vec![("note".into(), note.into())],
        },
        placements: vec![PoolKind::DeviceLocal, PoolKind::ReadOnly],
        factory: Box::new(move |placement, config| make(&format!("{name}/{placement}"), placement, config)),
        handle: ApiHandle::Plain,
    }
}

/// Groups API entries into devices: entries with the same PCI bus id or UUID are one device.
fn merge(entries: Vec<ApiEntry>) -> Vec<Arc<Device>> {
    let mut groups: Vec<Vec<ApiEntry>> = Vec::new();
    for entry in entries {
        let same = |other: &ApiEntry| {
            let a = &entry.info;
            let b = &other.info;
            (a.pci_bus_id.is_some() && a.pci_bus_id == b.pci_bus_id) || (a.uuid.is_some() && a.uuid == b.uuid)
        };
        match groups.iter_mut().find(|g| g.iter().any(same)) {
            Some(group) => group.push(entry),
            None => groups.push(vec![entry]),
        }
    }
    groups
        .into_iter()
        .enumerate()
        .map(|(index, apis)| {
            let first = &apis[0].info;
            Arc::new(Device {
                index,
                name: first.name.clone(),
                kind: first.kind,
                shares_memory_with_host: apis.iter().any(|a| a.info.shares_memory_with_host),
                total_bytes: apis.iter().map(|a| a.info.total_bytes).max().unwrap_or(0),
                pci_bus_id: apis.iter().find_map(|a| a.info.pci_bus_id.clone()),
                apis,
                pools: Mutex::new(Vec::new()),
                tagged: Mutex::new(Vec::new()),
                adopted: Mutex::new(Vec::new()),
            })
        })
        .collect()
}
