//! Discovery of wgpu adapters on every backend the platform has, and opening one device per adapter.

use super::device::DeviceShared;
use super::{WgpuBackend, WgpuUsage};
use crate::adopt::Ownership;
use crate::{
    Api, DeviceInfo, DeviceKind, Discovery, Error, MemoryPool, OwnedBlock, Pool, PoolConfig, PoolKind, Result, StreamId,
};
use parking_lot::Mutex;
use std::sync::{Arc, OnceLock};

/// Calls into the driver that set up (creating the instance, enumerating adapters, opening a device) run one at a
/// time in the process, on one instance made once. NVIDIA's Vulkan driver misbehaves when several threads create
/// instances and devices at once (gfx-rs/wgpu#10234: access violations; hangs seen elsewhere on its Linux driver),
/// and two test threads each discovering and opening the same GPU hung there intermittently. These calls happen at
/// discovery and at a device's first pool only, so the lock is never on the allocation path.
static SETUP: Mutex<()> = Mutex::new(());

/// The process's instance over the backends searched (read from `WGPU_BACKEND` and the other `WGPU_*` variables
/// when it is first made), or why it could not be made. Made under [`SETUP`].
fn instance() -> &'static std::result::Result<(wgpu::Instance, wgpu::Backends), String> {
    static INSTANCE: OnceLock<std::result::Result<(wgpu::Instance, wgpu::Backends), String>> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        std::panic::catch_unwind(|| {
            let backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
            let mut descriptor = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
            descriptor.backends = backends;
            (wgpu::Instance::new(descriptor), backends)
        })
        .map_err(|panic| super::watch::panic_text(&panic))
    })
}

/// One wgpu adapter. Its device is opened on the first [`WgpuDevice::pool`] (with the adapter's own limits, so
/// that buffers as large as the adapter allows can be made) and shared by all its pools.
pub struct WgpuDevice {
    info: DeviceInfo,
    adapter: wgpu::Adapter,
    adapter_info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    features: wgpu::Features,
    /// Keeps the instance alive as long as the adapter.
    _instance: wgpu::Instance,
    opened: Mutex<Option<Arc<DeviceShared>>>,
}

impl std::fmt::Debug for WgpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuDevice").field("info", &self.info).finish_non_exhaustive()
    }
}

/// Whether an adapter is a software rasteriser running on the CPU, whatever type it reports.
fn is_software(info: &wgpu::AdapterInfo) -> bool {
    let name = info.name.to_lowercase();
    info.device_type == wgpu::DeviceType::Cpu
        || ["llvmpipe", "lavapipe", "softpipe", "swiftshader", "microsoft basic render driver"]
            .iter()
            .any(|s| name.contains(s))
}

fn vendor_name(vendor: u32) -> String {
    match vendor {
        0x10de => "NVIDIA".into(),
        0x1002 | 0x1022 => "AMD".into(),
        0x8086 => "Intel".into(),
        0x13b5 => "ARM".into(),
        0x5143 => "Qualcomm".into(),
        0x106b => "Apple".into(),
        0x1414 => "Microsoft".into(),
        0x10005 => "Mesa".into(),
        0x1af4 => "Red Hat (virtio)".into(),
        0x15ad => "VMware".into(),
        0 => "unknown".into(),
        other => format!("0x{other:04x}"),
    }
}

/// `domain:bus:device.function`, lowercase; `None` when the backend gave none.
fn normalise_pci(bus_id: &str) -> Option<String> {
    let id = bus_id.trim().to_lowercase();
    match id.matches(':').count() {
        _ if id.is_empty() => None,
        1 => Some(format!("0000:{id}")),
        _ => Some(id),
    }
}

/// What makes two adapters the same device: the PCI address, else the PCI ids, else "the host CPU" for software
/// adapters. `None` when nothing identifies it.
fn identity(info: &wgpu::AdapterInfo) -> Option<String> {
    if let Some(pci) = normalise_pci(&info.device_pci_bus_id) {
        return Some(format!("pci:{pci}"));
    }
    if is_software(info) {
        return Some("cpu:host".into());
    }
    (info.vendor != 0 && info.device != 0).then(|| format!("pci-id:{:04x}:{:04x}", info.vendor, info.device))
}

/// Enumerates the adapters of the primary backends (Vulkan, Metal, DX12), or of the backends `WGPU_BACKEND` names
/// (`WGPU_BACKEND=gl` for GL). GL is left out by default: on a machine with a GPU it shows the GPU a second time
/// through a driver that often cannot open it (`Parent device is lost` on NVIDIA's), and on a headless machine
/// Mesa's GL driver complains on stderr at every discovery. Every adapter is opened here, and one whose device
/// cannot be created is skipped with the reason. Never panics: with no driver installed the result has no devices
/// and says why in `skipped`.
///
/// One physical device seen through two backends (lavapipe on Vulkan and llvmpipe on GL, a GPU on Vulkan and
/// GL) is kept twice; the later one carries `same_device_as` = the earlier one's ordinal in its details, and
/// both carry `identity`, so that the facade can merge them.
pub fn discover() -> Discovery<WgpuDevice> {
    let mut discovery = Discovery { devices: Vec::new(), skipped: Vec::new() };
    discovery.skipped.extend(super::watch::apply_env());
    // On a helper thread, waited for within the bound: a driver that never returns from here becomes a skip.
    let found = super::watch::bounded("enumerate_adapters", "", || {
        let _setup = SETUP.lock();
        let (instance, backends) = instance().as_ref().map_err(Clone::clone)?;
        Ok((instance.clone(), pollster::block_on(instance.enumerate_adapters(*backends))))
    })
    .and_then(|found| found);
    let (instance, adapters) = match found {
        Ok(found) => found,
        Err(why) => {
            discovery.skipped.push(format!("wgpu: creating the instance or enumerating adapters failed: {why}"));
            return discovery;
        }
    };
    if adapters.is_empty() {
        discovery.skipped.push(
            "wgpu: no adapter on the backends searched (no Vulkan, Metal or DX12 driver found, or none of those \
             WGPU_BACKEND names; on Linux install mesa-vulkan-drivers and libvulkan1 for lavapipe)"
                .into(),
        );
    }
    // (identity, backend) of adapters already claimed as the twin of an earlier one.
    let mut twins: Vec<(usize, wgpu::Backend)> = Vec::new();
    for adapter in adapters {
        let adapter_info = adapter.get_info();
        let ordinal = discovery.devices.len();
        let key = identity(&adapter_info);
        let same_as = key.as_ref().and_then(|key| {
            discovery.devices.iter().position(|d: &WgpuDevice| {
                identity(&d.adapter_info).as_ref() == Some(key)
                    && d.adapter_info.backend != adapter_info.backend
                    && !twins.contains(&(d.info.ordinal, adapter_info.backend))
            })
        });
        let info = device_info(ordinal, &adapter, &adapter_info, key, same_as);
        let device = WgpuDevice {
            info,
            limits: adapter.limits(),
            features: adapter.features(),
            adapter,
            adapter_info,
            _instance: instance.clone(),
            opened: Mutex::new(None),
        };
        // Opened now, so that an adapter no device can be made on is never offered (the device is kept for the
        // pools).
        if let Err(e) = device.open() {
            discovery.skipped.push(format!(
                "wgpu: {} ({}): the device cannot be opened: {e}",
                device.info.name, device.adapter_info.backend
            ));
            continue;
        }
        if let Some(other) = same_as {
            twins.push((other, device.adapter_info.backend));
        }
        discovery.devices.push(device);
    }
    discovery
}

fn device_info(
    ordinal: usize,
    adapter: &wgpu::Adapter,
    a: &wgpu::AdapterInfo,
    identity: Option<String>,
    same_as: Option<usize>,
) -> DeviceInfo {
    let limits = adapter.limits();
    let software = is_software(a);
    let kind = match a.device_type {
        _ if software => DeviceKind::Cpu,
        wgpu::DeviceType::DiscreteGpu => DeviceKind::DiscreteGpu,
        wgpu::DeviceType::IntegratedGpu => DeviceKind::IntegratedGpu,
        wgpu::DeviceType::Cpu => DeviceKind::Cpu,
        wgpu::DeviceType::VirtualGpu | wgpu::DeviceType::Other => DeviceKind::Other,
    };
    let shares = matches!(kind, DeviceKind::Cpu | DeviceKind::IntegratedGpu);
    let (total_memory, source) = match crate::host::host_memory() {
        Some((total, _)) if shares => (total, "host memory"),
        _ => (limits.max_buffer_size, "max_buffer_size (wgpu reports no memory size)"),
    };
    let mut details = vec![
        ("backend".to_string(), a.backend.to_string()),
        ("vendor_id".to_string(), format!("0x{:04x}", a.vendor)),
        ("device_id".to_string(), format!("0x{:04x}", a.device)),
        ("wgpu_device_type".to_string(), format!("{:?}", a.device_type)),
        ("driver".to_string(), a.driver.clone()),
        ("driver_info".to_string(), a.driver_info.clone()),
        ("max_buffer_size".to_string(), limits.max_buffer_size.to_string()),
        ("max_storage_buffer_binding_size".to_string(), limits.max_storage_buffer_binding_size.to_string()),
        ("max_uniform_buffer_binding_size".to_string(), limits.max_uniform_buffer_binding_size.to_string()),
        ("min_storage_buffer_offset_alignment".to_string(), limits.min_storage_buffer_offset_alignment.to_string()),
        ("min_uniform_buffer_offset_alignment".to_string(), limits.min_uniform_buffer_offset_alignment.to_string()),
        (
            "mappable_primary_buffers".to_string(),
            adapter.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS).to_string(),
        ),
        ("total_memory_source".to_string(), source.to_string()),
    ];
    if let Some(identity) = identity {
        details.push(("identity".to_string(), identity));
    }
    if let Some(other) = same_as {
        details.push(("same_device_as".to_string(), format!("wgpu:{other}")));
    }
    DeviceInfo {
        api: Api::Wgpu,
        ordinal,
        name: format!("{} ({})", a.name, a.backend),
        vendor: vendor_name(a.vendor),
        kind,
        total_bytes: total_memory,
        free_bytes: None,
        shares_memory_with_host: shares,
        alignment: u64::from(limits.min_storage_buffer_offset_alignment),
        max_allocation: limits.max_buffer_size,
        pci_bus_id: normalise_pci(&a.device_pci_bus_id),
        uuid: None,
        details,
    }
}

impl WgpuDevice {
    /// What discovery found.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// wgpu's own description of the adapter.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.adapter_info
    }

    /// The adapter's limits (the device is opened with these).
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// The adapter.
    pub fn adapter(&self) -> &wgpu::Adapter {
        &self.adapter
    }

    /// Whether host-pinned pools get [`WgpuUsage::Shared`] buffers (mappable and bindable): the adapter offers
    /// `MAPPABLE_PRIMARY_BUFFERS` and shares memory with the host.
    pub fn has_shared_buffers(&self) -> bool {
        self.features.contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS) && self.info.shares_memory_with_host
    }

    /// The pool kind that serves `placement`: DeviceLocal and ReadOnly as named; HostPinned is
    /// [`WgpuUsage::Shared`] where [`WgpuDevice::has_shared_buffers`], else [`WgpuUsage::Upload`] (use
    /// [`WgpuDevice::pool_of`] with [`WgpuUsage::Readback`] for read-back buffers).
    pub fn usage_for(&self, placement: PoolKind) -> WgpuUsage {
        // A device has no pageable host memory of its own: `Host` is served as `HostPinned` (`PoolKind::on_device`).
        match placement {
            PoolKind::DeviceLocal => WgpuUsage::DeviceLocal,
            PoolKind::ReadOnly => WgpuUsage::ReadOnly,
            PoolKind::Host | PoolKind::HostPinned if self.has_shared_buffers() => WgpuUsage::Shared,
            PoolKind::Host | PoolKind::HostPinned => WgpuUsage::Upload,
        }
    }

    /// A pool for `placement` (see [`WgpuDevice::kind_for`]). Opens the device on first use.
    pub fn pool(&self, placement: PoolKind, config: PoolConfig) -> Result<Pool<WgpuBackend>> {
        self.pool_of(self.usage_for(placement), config)
    }

    /// A pool whose buffers are of `kind`. Errors if the kind needs a feature the adapter lacks, or the device
    /// cannot be opened.
    pub fn pool_of(&self, kind: WgpuUsage, config: PoolConfig) -> Result<Pool<WgpuBackend>> {
        if kind == WgpuUsage::Shared && !self.has_shared_buffers() {
            return Err(Error::Unsupported {
                backend: self.info.name.clone(),
                what: "shared (mappable and bindable) buffers: the adapter lacks MAPPABLE_PRIMARY_BUFFERS or does \
                       not share memory with the host; use upload or readback pools"
                    .into(),
            });
        }
        let shared = self.open()?;
        let name = format!("wgpu:{} {} {kind}", self.info.ordinal, self.info.name);
        Pool::new(WgpuBackend::new(name, kind, shared), config)
    }

    /// Adopts `buffer`, made on this adapter's device ([`WgpuDevice::device_and_queue`]), as the one block of a
    /// pool of its own, with the buffer's own usages: umm reads and writes it as it does pooled blocks (reading
    /// needs `COPY_SRC` or `MAP_READ`, writing `COPY_DST` or `MAP_WRITE`). With [`Ownership::Owned`] the buffer
    /// is destroyed when the block is freed; with [`Ownership::Borrowed`] only umm's handle goes. A buffer of
    /// another device fails at its first use with [`Error::Driver`] (wgpu's validation). Refused: an empty buffer
    /// ([`Error::ZeroSize`]), and one whose size is not a multiple of 4 ([`Error::Unsupported`]: wgpu copies
    /// whole words).
    pub fn adopt(&self, buffer: wgpu::Buffer, ownership: Ownership) -> Result<OwnedBlock> {
        let shared = self.open()?;
        let name = format!("wgpu:{} {} adopted", self.info.ordinal, self.info.name);
        let size = buffer.size();
        if size == 0 {
            return Err(Error::ZeroSize { device: name });
        }
        if !size.is_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT) {
            return Err(Error::Unsupported {
                backend: name,
                what: format!(
                    "adopting a buffer of {size} bytes: wgpu copies whole words, so the size must be a multiple of 4"
                ),
            });
        }
        let pool: Arc<dyn MemoryPool> =
            Arc::new(Pool::new(WgpuBackend::adopting(name, shared, buffer, ownership), crate::adopt::pool_config())?);
        OwnedBlock::allocate(pool, size, StreamId(0), false)
    }

    /// The opened device and queue (opening it if no pool has yet), for building pipelines over pooled blocks.
    pub fn device_and_queue(&self) -> Result<(wgpu::Device, wgpu::Queue)> {
        let shared = self.open()?;
        Ok((shared.device.clone(), shared.queue.clone()))
    }

    /// Why the device was lost, once it has been.
    pub fn lost_reason(&self) -> Option<String> {
        self.opened.lock().as_ref().and_then(|s| s.lost_reason())
    }

    fn open(&self) -> Result<Arc<DeviceShared>> {
        let mut opened = self.opened.lock();
        if let Some(shared) = opened.as_ref() {
            return Ok(Arc::clone(shared));
        }
        let mut features = wgpu::Features::empty();
        if self.has_shared_buffers() {
            features |= wgpu::Features::MAPPABLE_PRIMARY_BUFFERS;
        }
        let desc = wgpu::DeviceDescriptor {
            label: Some("umm"),
            required_features: features,
            required_limits: self.limits.clone(),
            ..Default::default()
        };
        let adapter = self.adapter.clone();
        // On a helper thread, waited for within the bound (see `discover`).
        let requested = super::watch::bounded("request_device", &self.info.name, move || {
            let _setup = SETUP.lock();
            pollster::block_on(adapter.request_device(&desc))
        });
        let driver =
            |message: String| Error::Driver { backend: self.info.name.clone(), call: "request_device".into(), message };
        let (device, queue) = match requested {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => return Err(driver(e.to_string())),
            Err(why) => return Err(driver(why)),
        };
        let shared = Arc::new(DeviceShared::new(
            &self.info.name,
            device,
            queue,
            self.info.total_bytes,
            self.info.shares_memory_with_host,
        ));
        *opened = Some(Arc::clone(&shared));
        Ok(shared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_ids_are_normalised() {
        assert_eq!(normalise_pci(""), None);
        assert_eq!(normalise_pci("01:00.0"), Some("0000:01:00.0".into()));
        assert_eq!(normalise_pci("0000:0A:00.0"), Some("0000:0a:00.0".into()));
        assert_eq!(vendor_name(0x10de), "NVIDIA");
        assert_eq!(vendor_name(0xabcd), "0xabcd");
    }
}
