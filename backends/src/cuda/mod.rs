//! CUDA through cudarc with dynamic loading: the same binary runs with and without a driver. Without `libcuda`
//! (or without a GPU) [`discover`] returns no devices and a reason, and prints nothing.
//!
//! - [`discover`] lists the devices; each [`CudaDevice`] holds the device's primary context, shared by its pools.
//! - [`CudaDevice::pool`] makes a `Pool<CudaBackend>` for a [`PoolKind`]: device memory (plain cuMemAlloc
//!   segments, or with `SegmentMode::Auto`/`Virtual` an address reservation mapped in 2 MiB pages), pinned host
//!   memory, or read-only device memory.
//! - [`CudaPool`] wraps such a pool with PyTorch's `record_stream` semantics: a block used on extra streams is
//!   returned to the pool only once events recorded on those streams at the free have completed.
//! - [`CudaBuffer`] is an owned block of a `CudaPool` with copies (blocking and stream-ordered) and views that
//!   implement cudarc's `DevicePtr`/`DevicePtrMut`, so kernels launched through cudarc can use it.
//!
//! # Streams
//! A [`StreamId`] names a `CUstream` of the device's context: `StreamId(0)` is the null stream (the legacy
//! default stream), any other value is the raw `CUstream` handle as an integer. [`stream_id`] makes one from a
//! cudarc stream and registers it; [`foreign_stream`] (`unsafe`) vouches for a stream made elsewhere. Calls that
//! queue work on a stream refuse ids of neither kind, and of streams that were dropped or belong to another
//! device, instead of handing the driver a made-up handle. A block allocated on a stream is freed to that stream's free lists and reused at once there;
//! other streams never get it from the pool while it is cached (the pool keeps per-stream arenas). Its pages go
//! back to the driver only after that stream has passed its work, and a segment only after the whole context
//! has.

mod backend;
mod buffer;
mod capture;
mod host_store;
mod interop;
mod ipc;
mod marks;
mod pages;
pub(crate) mod peer;
mod pool;
mod raw;
mod scope;
mod transfer;

/// The cudarc this crate was built with, so that callers launch kernels with the same version.
pub use cudarc;

pub use backend::{CudaBackend, CudaSegment};
pub use buffer::CudaBuffer;
pub use capture::RelaxedCaptureMode;
pub use interop::{block_view, block_view_mut, copy_block, BlockView, BlockViewMut, CudaPoolExt};
pub use ipc::{ImportedMemory, IpcHandle};
pub use peer::enable_peer_access;
pub use pool::CudaPool;
pub use raw::stream_ids::stream_id;
pub use raw::{foreign_stream, ForeignDeviceMemory};
pub use scope::ContextScope;
pub use transfer::{upload_block_async, PinnedUploadBaseline};

#[cfg(doc)]
use crate::StreamId;
use crate::{Api, DeviceInfo, DeviceKind, Discovery, Error, Pool, PoolConfig, PoolKind, Result};
use cudarc::driver::{sys::CUdevice_attribute as Attr, CudaContext};
use std::sync::Arc;

/// Whether NVRTC (run-time compilation, used through `cudarc::nvrtc`) can be loaded. Prints nothing.
pub fn nvrtc_available() -> bool {
    raw::nvrtc_library_present()
}

/// One CUDA device: its description and its primary context.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    /// VMM page size when the device supports virtual memory management.
    vmm_page: Option<u64>,
    /// Ordinals of the devices that can read and write this one's memory directly (NVLink or PCIe P2P).
    peers: Vec<i32>,
}

/// The ordinals among `0..count` (other than `ordinal`) whose devices can reach device `ordinal`'s memory as
/// peers. A query that fails counts as no.
fn peers_of(ordinal: usize, count: usize) -> Vec<i32> {
    let Ok(this) = raw::device(ordinal as i32) else { return Vec::new() };
    (0..count as i32)
        .filter(|&p| p != ordinal as i32)
        .filter(|&p| raw::device(p).and_then(|peer| raw::can_access_peer(peer, this)).unwrap_or(false))
        .collect()
}

/// Finds every CUDA device. Never panics and prints nothing: without the driver library, without a GPU, or
/// when a device cannot be opened, the reason goes to [`Discovery::skipped`].
pub fn discover() -> Discovery<CudaDevice> {
    let mut found = Discovery { devices: Vec::new(), skipped: Vec::new() };
    if !raw::driver_library_present() {
        found.skipped.push("CUDA: the driver library (libcuda) is not installed".into());
        return found;
    }
    if let Err(e) = cudarc::driver::result::init() {
        found.skipped.push(format!("CUDA: cuInit failed: {e}"));
        return found;
    }
    let count = match cudarc::driver::result::device::get_count() {
        Ok(n) => n,
        Err(e) => {
            found.skipped.push(format!("CUDA: cuDeviceGetCount failed: {e}"));
            return found;
        }
    };
    if count == 0 {
        found.skipped.push("CUDA: the driver reports no devices".into());
    }
    for ordinal in 0..count.max(0) as usize {
        match CudaDevice::open(ordinal, count.max(0) as usize) {
            Ok(device) => found.devices.push(device),
            Err(e) => found.skipped.push(format!("CUDA device {ordinal}: {e}")),
        }
    }
    found
}

impl CudaDevice {
    fn open(ordinal: usize, count: usize) -> Result<Self> {
        let fail = |call: &str, e: cudarc::driver::DriverError| Error::Driver {
            backend: format!("cuda:{ordinal}"),
            call: call.into(),
            message: e.to_string(),
        };
        let ctx = CudaContext::new(ordinal).map_err(|e| fail("cuDevicePrimaryCtxRetain", e))?;
        let attr = |a: Attr| ctx.attribute(a).map_err(|e| fail("cuDeviceGetAttribute", e));
        let name = ctx.name().map_err(|e| fail("cuDeviceGetName", e))?;
        let total = ctx.total_mem().map_err(|e| fail("cuDeviceTotalMem", e))? as u64;
        let free = ctx.mem_get_info().ok().map(|(free, _)| free as u64);
        let (major, minor) = ctx.compute_capability().map_err(|e| fail("cuDeviceGetAttribute", e))?;
        let integrated = attr(Attr::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0;
        let vmm = attr(Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? != 0;
        let vmm_page =
            if vmm { raw::vmm_granularity(ordinal as i32).ok().filter(|g| g.is_power_of_two()) } else { None };
        let pci_bus_id = raw::pci_bus_id(ctx.cu_device()).ok().and_then(|s| normalize_pci_bus_id(&s));
        let uuid = ctx.uuid().ok().map(|u| format_uuid(&u.bytes.map(|b| b as u8)));
        let mut details = vec![("compute_capability".to_string(), format!("{major}.{minor}"))];
        if let Ok(v) = raw::driver_version() {
            details.push(("driver_cuda_version".into(), format!("{}.{}", v / 1000, v % 1000 / 10)));
        }
        if let Ok(sms) = attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) {
            details.push(("multiprocessors".into(), sms.to_string()));
        }
        details
            .push(("virtual_memory".into(), vmm_page.map_or("no".into(), |p| format!("yes ({} KiB pages)", p >> 10))));
        let peers = peers_of(ordinal, count);
        details.push((
            "peers".into(),
            if peers.is_empty() {
                "none".into()
            } else {
                peers.iter().map(|p| format!("cuda:{p}")).collect::<Vec<_>>().join(", ")
            },
        ));
        let info = DeviceInfo {
            api: Api::Cuda,
            ordinal,
            name,
            vendor: "NVIDIA".into(),
            kind: if integrated { DeviceKind::IntegratedGpu } else { DeviceKind::DiscreteGpu },
            total_bytes: total,
            free_bytes: free,
            shares_memory_with_host: integrated,
            alignment: CudaBackend::ALIGNMENT,
            max_allocation: total,
            pci_bus_id,
            uuid,
            details,
        };
        Ok(Self { info, ctx, vmm_page, peers })
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The device's primary context, shared by every pool of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether device pools can use virtual reservations mapped page by page (`SegmentMode::Auto` does then).
    pub fn supports_virtual_memory(&self) -> bool {
        self.vmm_page.is_some()
    }

    /// The backend of a pool for `placement` (for callers that build `Pool`s themselves).
    pub fn backend(&self, placement: PoolKind) -> CudaBackend {
        CudaBackend::new(
            self.ctx.clone(),
            &self.info.name,
            placement,
            self.info.total_bytes,
            self.vmm_page,
            &self.peers,
        )
    }

    /// A pool of this device for `placement`.
    ///
    /// Read-only pools ignore `zero_on_alloc` and `poison_on_free`: their blocks' bytes are set once, from the
    /// data they are created with ([`CudaPoolExt::upload_read_only`]), and every later write is refused.
    /// Errors on an invalid configuration (`SegmentMode::Virtual` for pinned memory or on a device without
    /// virtual memory management).
    pub fn pool(&self, placement: PoolKind, mut config: PoolConfig) -> Result<Pool<CudaBackend>> {
        if placement == PoolKind::ReadOnly {
            config.zero_on_alloc = false;
            config.poison_on_free = false;
        }
        Pool::new(self.backend(placement), config)
    }

    /// Adopts a cudarc slice of this device's context as the one block of a stream-safe pool of its own, taking
    /// it over: the slice is dropped (cudarc frees it on its stream) when the block is freed. The block belongs
    /// to the null stream. Errors: a slice of another device's context ([`Error::Unsupported`]), an empty one
    /// ([`Error::ZeroSize`]).
    pub fn adopt<T: 'static>(&self, slice: cudarc::driver::CudaSlice<T>) -> Result<crate::OwnedBlock> {
        use cudarc::driver::DevicePtr;
        if slice.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::Unsupported {
                backend: format!("cuda:{}", self.info.ordinal),
                what: format!("adopting a slice of the context of cuda:{}", slice.context().ordinal()),
            });
        }
        let bytes = (slice.len() * std::mem::size_of::<T>()) as u64;
        let ptr = {
            let (ptr, _record) = slice.device_ptr(slice.stream());
            ptr
        };
        self.adopt_raw(ptr, bytes, Some(Box::new(slice)), crate::Ownership::Owned)
    }

    /// Adopts device memory made outside umm as the one block of a stream-safe pool of its own, leaving it its
    /// owner's: umm never frees it. Refuses zero bytes ([`Error::ZeroSize`]).
    pub fn adopt_foreign(&self, memory: ForeignDeviceMemory) -> Result<crate::OwnedBlock> {
        self.adopt_raw(memory.ptr(), memory.bytes(), None, crate::Ownership::Borrowed)
    }

    fn adopt_raw(
        &self,
        ptr: u64,
        bytes: u64,
        keeper: Option<crate::adopt::Keeper>,
        ownership: crate::Ownership,
    ) -> Result<crate::OwnedBlock> {
        let backend = self.backend(PoolKind::DeviceLocal).adopting(ptr, bytes, keeper, ownership);
        if bytes == 0 {
            return Err(Error::ZeroSize { device: crate::Backend::name(&backend).to_string() });
        }
        let pool = Arc::new(CudaPool::new(Pool::new(backend, crate::adopt::pool_config())?));
        crate::OwnedBlock::allocate(pool, bytes, crate::StreamId(0), false)
    }

    /// A stream-safe caching pool ([`CudaPool`]) of this device for `placement`.
    pub fn caching_pool(&self, placement: PoolKind, config: PoolConfig) -> Result<Arc<CudaPool>> {
        Ok(Arc::new(CudaPool::new(self.pool(placement, config)?)))
    }
}

/// `domain:bus:device.function` in lowercase hex with a 4-digit domain (when it fits), 2-digit bus and device.
fn normalize_pci_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim();
    let (rest, function) = raw.rsplit_once('.')?;
    let mut parts = rest.split(':').collect::<Vec<_>>();
    if parts.len() == 2 {
        parts.insert(0, "0");
    }
    let [domain, bus, device] = parts[..] else { return None };
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    let (domain, bus, device, function) = (hex(domain)?, hex(bus)?, hex(device)?, hex(function)?);
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// A UUID in the usual 8-4-4-4-12 lowercase hex form (no `GPU-` prefix), as OpenCL and Vulkan report it too.
fn format_uuid(b: &[u8; 16]) -> String {
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", h[..4].concat(), h[4..6].concat(), h[6..8].concat(), h[8..10].concat(), h[10..].concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_bus_ids_are_normalised() {
        assert_eq!(normalize_pci_bus_id("0000:1B:00.0").as_deref(), Some("0000:1b:00.0"));
        assert_eq!(normalize_pci_bus_id("00000000:C1:00.0").as_deref(), Some("0000:c1:00.0"));
        assert_eq!(normalize_pci_bus_id("01:00.1").as_deref(), Some("0000:01:00.1"));
        assert_eq!(normalize_pci_bus_id("garbage"), None);
    }

    #[test]
    fn uuids_are_formatted() {
        let b: [u8; 16] = std::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(format_uuid(&b), "00112233-4455-6677-8899-aabbccddeeff");
    }
}
