//! Adopting memory made elsewhere ([`UniversalMemoryManager::adopt`]), as UniversalCompute's
//! `FromMemoryBuffer(buffer, takeOwnership)` does: a host `Vec`, a `wgpu::Buffer`, an OpenCL buffer or a cudarc
//! `CudaSlice` becomes a [`UniversalBuffer`], either taken over (released through its own API when the buffer
//! is dropped) or borrowed (never freed by umm).
//!
//! An adopted buffer is the one block of a pool of its own (see [`umm_backends::adopt`]), listed among its
//! device's pools while it lives: it shows in [`UniversalMemoryManager::global_memory_stats`], in snapshots
//! and in leak reports like any buffer, reads, writes, fills and migrates like one, and gives the same kernel
//! views ([`crate::interop`]).

use crate::buffer::{BufferMeta, UniversalBuffer};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::manager::UniversalMemoryManager;
use crate::placement_cache::Placed;
use crate::profiler::AllocEvent;
use std::sync::Arc;
use umm_backends::{OwnedBlock, Ownership, StreamId};
use umm_placement::{AccessPattern, Api, Decision, DeviceSelector, Placement, PoolKind, SizeClass};

/// What [`UniversalMemoryManager::adopt`] wraps. Made by its constructors (or `From<Vec<T>>`).
pub struct Adoptable<'a, T: bytemuck::Pod> {
    source: Source<'a, T>,
}

enum Source<'a, T: bytemuck::Pod> {
    Vec(Vec<T>),
    Static(&'static mut [T]),
    #[cfg(feature = "wgpu")]
    Wgpu(umm_backends::wgpu_backend::wgpu::Buffer, Ownership),
    #[cfg(feature = "opencl")]
    OpenCl(umm_backends::opencl::opencl3::memory::Buffer<T>),
    #[cfg(feature = "opencl")]
    OpenClBorrowed(&'a umm_backends::opencl::opencl3::memory::Buffer<T>),
    #[cfg(feature = "cuda")]
    Cuda(umm_backends::cuda::cudarc::driver::CudaSlice<T>),
    #[cfg(feature = "cuda")]
    CudaForeign(umm_backends::cuda::ForeignDeviceMemory),
    #[allow(dead_code)]
    Never(std::marker::PhantomData<&'a T>),
}

impl<'a, T: bytemuck::Pod + Send + Sync> Adoptable<'a, T> {
    /// A host vector, taken over: freed when the buffer is dropped.
    pub fn vec(data: Vec<T>) -> Self {
        Self { source: Source::Vec(data) }
    }

    /// Host memory that lives for the rest of the program (`Box::leak`, a static), borrowed for good: never
    /// freed by umm.
    pub fn host_static(data: &'static mut [T]) -> Self {
        Self { source: Source::Static(data) }
    }

    /// A `wgpu::Buffer` made on the device of a manager's wgpu adapter ([`Device::wgpu`]). Owned: destroyed
    /// when the buffer is dropped; borrowed: only umm's handle goes. Its usages stay its own: reads need
    /// `COPY_SRC` or `MAP_READ`, writes `COPY_DST` or `MAP_WRITE`, [`UniversalBuffer::wgpu_binding`]
    /// `STORAGE`.
    #[cfg(feature = "wgpu")]
    pub fn wgpu(buffer: umm_backends::wgpu_backend::wgpu::Buffer, ownership: Ownership) -> Self {
        Self { source: Source::Wgpu(buffer, ownership) }
    }

    /// An opencl3 buffer made in the context of a manager's OpenCL device ([`Device::opencl`]), taken over:
    /// released when the buffer is dropped (unless references to it are held elsewhere).
    #[cfg(feature = "opencl")]
    pub fn opencl(buffer: umm_backends::opencl::opencl3::memory::Buffer<T>) -> Self {
        Self { source: Source::OpenCl(buffer) }
    }

    /// An opencl3 buffer, borrowed: umm holds a reference of its own while the buffer lives and never releases
    /// the owner's.
    #[cfg(feature = "opencl")]
    pub fn opencl_borrowed(buffer: &'a umm_backends::opencl::opencl3::memory::Buffer<T>) -> Self {
        Self { source: Source::OpenClBorrowed(buffer) }
    }

    /// A cudarc slice of a manager's CUDA device's context ([`Device::cuda`]), taken over: dropped (cudarc frees
    /// it) when the buffer is dropped.
    #[cfg(feature = "cuda")]
    pub fn cuda(slice: umm_backends::cuda::cudarc::driver::CudaSlice<T>) -> Self {
        Self { source: Source::Cuda(slice) }
    }

    /// Device memory made outside umm, borrowed: never freed by umm. Making the
    /// [`ForeignDeviceMemory`](umm_backends::cuda::ForeignDeviceMemory) is the `unsafe` promise that it stays
    /// valid while the buffer lives.
    #[cfg(feature = "cuda")]
    pub fn cuda_foreign(memory: umm_backends::cuda::ForeignDeviceMemory) -> Self {
        Self { source: Source::CudaForeign(memory) }
    }

    /// Whether umm will release the memory when the buffer is dropped.
    pub fn ownership(&self) -> Ownership {
        match &self.source {
            Source::Vec(_) => Ownership::Owned,
            #[cfg(feature = "wgpu")]
            Source::Wgpu(_, ownership) => *ownership,
            #[cfg(feature = "opencl")]
            Source::OpenCl(_) => Ownership::Owned,
            #[cfg(feature = "cuda")]
            Source::Cuda(_) => Ownership::Owned,
            _ => Ownership::Borrowed,
        }
    }
}

impl<T: bytemuck::Pod + Send + Sync> From<Vec<T>> for Adoptable<'_, T> {
    fn from(data: Vec<T>) -> Self {
        Self::vec(data)
    }
}

/// Options of an adoption: the device (needed only to pick among several wgpu adapters or CUDA devices for
/// foreign memory), a label and an access pattern.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdoptOptions {
    device: DeviceSelector,
    label: Option<String>,
    access: AccessPattern,
}

impl AdoptOptions {
    /// Any device, no label, unknown access pattern.
    pub fn new() -> Self {
        Self::default()
    }
    /// The device the memory belongs to, as [`DeviceSelector::Index`] (other selectors pick the first device
    /// of the memory's API that matches them).
    pub fn device(mut self, selector: DeviceSelector) -> Self {
        self.device = selector;
        self
    }
    /// A label shown in errors, statistics and leak reports.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
    /// How the buffer will be used.
    pub fn access(mut self, access: AccessPattern) -> Self {
        self.access = access;
        self
    }
}

impl UniversalMemoryManager {
    /// Wraps memory made elsewhere as a [`UniversalBuffer`] of `size / size_of::<T>()` elements (see
    /// [`Adoptable`] for the sources and who releases each).
    ///
    /// Errors: no device of the memory's API, or none that the memory belongs to (an OpenCL buffer of another
    /// context, a CUDA slice of another context, a selector naming a device of another API):
    /// [`Error::Adopt`]; a size that is not a whole number of `T` ([`umm_backends::Error::InvalidConfig`]),
    /// empty device memory ([`umm_backends::Error::ZeroSize`]; an empty `Vec` or static slice gives an empty host
    /// buffer, as an allocation of 0 elements does), a wgpu buffer whose size is not a multiple of 4
    /// ([`umm_backends::Error::Unsupported`]). Memory taken over is released when adoption fails.
    #[track_caller]
    pub fn adopt<'a, T: bytemuck::Pod + Send + Sync>(
        &self,
        source: impl Into<Adoptable<'a, T>>,
        options: AdoptOptions,
    ) -> Result<UniversalBuffer<T>> {
        let source = source.into();
        let ownership = source.ownership();
        let elem = std::mem::size_of::<T>();
        let (device, api, kind, block): (Arc<Device>, Api, PoolKind, OwnedBlock) = match source.source {
            // Empty host memory has nothing to take over: the empty buffer an allocation of 0 elements gives.
            Source::Vec(data) if data.is_empty() => return self.adopt_empty(options),
            Source::Static(data) if data.is_empty() => return self.adopt_empty(options),
            Source::Vec(data) => {
                let device = self.host_device();
                let block = umm_backends::host::adopt_vec("host", self.inner.host.total_bytes, data)?;
                (device, Api::Host, PoolKind::Host, block)
            }
            Source::Static(data) => {
                let device = self.host_device();
                let block = umm_backends::host::adopt_static("host", self.inner.host.total_bytes, data)?;
                (device, Api::Host, PoolKind::Host, block)
            }
            #[cfg(feature = "wgpu")]
            Source::Wgpu(buffer, ownership) => {
                umm_backends::adopt::element_count(buffer.size(), elem, "a wgpu buffer")?;
                let device = self.api_device(Api::Wgpu, options.device, "a wgpu buffer")?;
                let wgpu = device.wgpu().expect("a device seen through wgpu has a wgpu handle");
                let block = wgpu.adopt(buffer, ownership)?;
                (device, Api::Wgpu, PoolKind::DeviceLocal, block)
            }
            #[cfg(feature = "opencl")]
            Source::OpenCl(buffer) => {
                let (device, block) = self.adopt_opencl(&buffer, options.device, elem)?;
                (device, Api::OpenCl, PoolKind::DeviceLocal, block)
            }
            #[cfg(feature = "opencl")]
            Source::OpenClBorrowed(buffer) => {
                let (device, block) = self.adopt_opencl(buffer, options.device, elem)?;
                (device, Api::OpenCl, PoolKind::DeviceLocal, block)
            }
            #[cfg(feature = "cuda")]
            Source::Cuda(slice) => {
                let ctx = slice.context().cu_ctx();
                let device = self
                    .inner
                    .devices
                    .iter()
                    .find(|d| d.cuda().is_some_and(|c| c.context().cu_ctx() == ctx))
                    .cloned()
                    .ok_or_else(|| Error::Adopt {
                        what: "a CUDA slice",
                        reason: format!(
                            "no CUDA device of this manager has the slice's context (cuda:{})",
                            slice.context().ordinal()
                        ),
                    })?;
                let block = device.cuda().expect("found by its CUDA handle").adopt(slice)?;
                (device, Api::Cuda, PoolKind::DeviceLocal, block)
            }
            #[cfg(feature = "cuda")]
            Source::CudaForeign(memory) => {
                umm_backends::adopt::element_count(memory.bytes(), elem, "foreign CUDA memory")?;
                let device = self.api_device(Api::Cuda, options.device, "foreign CUDA memory")?;
                let block =
                    device.cuda().expect("a device seen through CUDA has a CUDA handle").adopt_foreign(memory)?;
                (device, Api::Cuda, PoolKind::DeviceLocal, block)
            }
            Source::Never(_) => unreachable!("never constructed"),
        };
        let bytes = block.len();
        let len = umm_backends::adopt::element_count(bytes, elem, "memory")?;
        device.register_adopted(api, kind, block.pool());
        let thresholds = &self.inner.config.decision.thresholds;
        let decision = Decision::adopted(
            device.index(),
            kind,
            SizeClass::of(bytes.max(1), thresholds),
            api,
            ownership == Ownership::Owned,
        );
        let placed = Arc::new(Placed {
            decision,
            device,
            pool: Some(Arc::clone(block.pool())),
            api: Some(api),
            tracker: Arc::clone(&self.inner.tracker),
            profiler: Arc::clone(&self.inner.profiler),
            balanced: false,
        });
        let track = placed.tracker.register_sampled(bytes, Placement::Auto, options.access, kind);
        let profile_id = placed.profiler.on_alloc(&AllocEvent {
            device: placed.decision.device,
            pool: kind,
            api: Some(api),
            bytes,
            stream: StreamId::default(),
            label: options.label.as_deref(),
            location: std::panic::Location::caller(),
            block_key: Some(block.info().key),
            pool_handle: Some(block.pool()),
        });
        let meta = BufferMeta {
            requested: Placement::Auto,
            access: options.access,
            placed,
            label: options.label.map(Box::new),
            read_only: false,
            filled: false,
            migrated_via: None,
        };
        Ok(UniversalBuffer::new(false, Some(block), len, meta, track, profile_id))
    }

    /// An empty host buffer, as [`UniversalMemoryManager::allocate_universal_with`] makes for 0 elements.
    #[track_caller]
    fn adopt_empty<T: bytemuck::Pod>(&self, options: AdoptOptions) -> Result<UniversalBuffer<T>> {
        let mut alloc = crate::AllocOptions::new().device(DeviceSelector::Host).access(options.access);
        if let Some(label) = options.label {
            alloc = alloc.label(label);
        }
        self.allocate_universal_with(0, alloc)
    }

    fn host_device(&self) -> Arc<Device> {
        Arc::clone(&self.inner.devices[0])
    }

    /// The device of `api` that `selector` names (the first of that API for a selector that names none).
    #[allow(dead_code)]
    fn api_device(&self, api: Api, selector: DeviceSelector, what: &'static str) -> Result<Arc<Device>> {
        let devices = &self.inner.devices;
        let found = match selector {
            DeviceSelector::Index(i) => {
                let device = devices.get(i).ok_or_else(|| Error::Adopt {
                    what,
                    reason: format!("there is no device {i} (the manager has {})", devices.len()),
                })?;
                if !device.has_api(api) {
                    return Err(Error::Adopt {
                        what,
                        reason: format!("device {i} ({}) is not seen through {api}", device.name()),
                    });
                }
                Some(device)
            }
            _ => devices.iter().find(|d| d.has_api(api)),
        };
        found.cloned().ok_or_else(|| Error::Adopt { what, reason: format!("this manager has no {api} device") })
    }

    #[cfg(feature = "opencl")]
    fn adopt_opencl<T: bytemuck::Pod>(
        &self,
        buffer: &umm_backends::opencl::opencl3::memory::Buffer<T>,
        selector: DeviceSelector,
        elem: usize,
    ) -> Result<(Arc<Device>, OwnedBlock)> {
        use umm_backends::opencl::opencl3::memory::ClMem;
        let what = "an OpenCL buffer";
        let size =
            buffer.size().map_err(|e| Error::Adopt { what, reason: format!("clGetMemObjectInfo failed: {e}") })?;
        umm_backends::adopt::element_count(size as u64, elem, what)?;
        let context =
            buffer.context().map_err(|e| Error::Adopt { what, reason: format!("clGetMemObjectInfo failed: {e}") })?;
        let device = self
            .inner
            .devices
            .iter()
            .filter(|d| !matches!(selector, DeviceSelector::Index(i) if i != d.index()))
            .find(|d| d.opencl().is_some_and(|cl| cl.context().get() == context))
            .cloned()
            .ok_or_else(|| Error::Adopt {
                what,
                reason: format!(
                    "it was made in a context of none of this manager's OpenCL devices ({})",
                    selector.describe()
                ),
            })?;
        let block = device.opencl().expect("found by its OpenCL handle").adopt_borrowed(buffer)?;
        // umm takes a reference of its own; a buffer taken over is dropped by the caller afterwards, which
        // releases the owner's reference, so that the memory goes with umm's.
        Ok((device, block))
    }
}
