//! Overlapping batch uploads with compute: [`DoubleBuffer`] (two device buffers, the next batch uploading into
//! one while kernels read the other) and [`Prefetcher`] (worker threads that upload batches of an iterator
//! ahead of the loop that consumes them).
//!
//! How an upload runs depends on the memory it lands in:
//!
//! | memory | upload | done when |
//! |--------|--------|-----------|
//! | CUDA   | a copy from pinned staging (the device's pinned pool) on a copy stream of its own, `cuMemcpyHtoDAsync` | an event recorded after it, which the compute stream waits on |
//! | OpenCL | a non-blocking `clEnqueueWriteBuffer` on the device's in-order queue | its event (kernels queued later are ordered after it anyway) |
//! | wgpu   | `queue.write_buffer`, which wgpu stages at once | before the next submission on the device's queue |
//! | host   | a `memcpy` | at once |

mod double_buffer;
mod prefetch;

pub use double_buffer::{DoubleBuffer, Front};
pub use prefetch::{DeviceBatch, Prefetch, PrefetchError, Prefetcher};

use crate::buffer::UniversalBuffer;

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;

use crate::manager::UniversalMemoryManager;
use crate::options::AllocOptions;
use std::sync::Arc;
#[allow(unused_imports)] // Used by the match arms of the enabled backends.
use umm_placement::Api;
use umm_placement::{DeviceSelector, Placement};

/// Where overlap helpers put their device buffers: a device selector (any device by default), a placement
/// (`DeviceLocal` by default) and a label; on CUDA, the stream kernels read the buffers on.
///
/// ```
/// use umm::overlap::OverlapOptions;
/// use umm::{Api, DeviceSelector};
///
/// let options = OverlapOptions::new().device(DeviceSelector::Api(Api::OpenCl)).label("batches");
/// let from_selector: OverlapOptions = DeviceSelector::Host.into();
/// # let _ = (options, from_selector);
/// ```
#[derive(Clone, Default)]
pub struct OverlapOptions {
    selector: DeviceSelector,
    placement: Option<Placement>,
    label: Option<String>,
    #[cfg(feature = "cuda")]
    cuda_stream: Option<Arc<umm_backends::cuda::cudarc::driver::CudaStream>>,
}

impl std::fmt::Debug for OverlapOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("OverlapOptions");
        d.field("selector", &self.selector).field("placement", &self.placement).field("label", &self.label);
        #[cfg(feature = "cuda")]
        d.field("cuda_stream", &self.cuda_stream.as_ref().map(|s| s.cu_stream() as usize));
        d.finish()
    }
}

impl OverlapOptions {
    /// Any device, `DeviceLocal` memory, no label, the device's default CUDA stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Which device (or API) the buffers live on.
    pub fn device(mut self, selector: DeviceSelector) -> Self {
        self.selector = selector;
        self
    }

    /// Where the device buffers live (`DeviceLocal` unless set). Uploads into pinned memory are host copies;
    /// a [`DoubleBuffer`] refuses `ReadOnly` memory, which takes one write only.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = Some(placement);
        self
    }

    /// A label for the device buffers (in statistics, errors and leak reports).
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// The CUDA stream kernels read the buffers on (the context's default stream unless set): a
    /// [`DoubleBuffer`] makes it wait for each upload, and makes its uploads wait for the kernels queued on it
    /// before they overwrite a buffer. Ignored for memory of other APIs.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(mut self, stream: Arc<umm_backends::cuda::cudarc::driver::CudaStream>) -> Self {
        self.cuda_stream = Some(stream);
        self
    }

    /// The allocation options of every buffer: the selector pinned to the device the manager chooses now, so
    /// that all buffers land on one device (and, for an API selector, through that API).
    fn resolve(&self, mm: &UniversalMemoryManager) -> Result<AllocOptions> {
        let placement = self.placement.unwrap_or(Placement::DeviceLocal);
        let probe = AllocOptions::new().placement(placement).device(self.selector);
        let selector = match self.selector {
            DeviceSelector::Api(api) => DeviceSelector::Api(api),
            _ => DeviceSelector::Index(mm.decide(1, &probe)?.device),
        };
        let mut options = AllocOptions::new().placement(placement).device(selector);
        if let Some(label) = &self.label {
            options = options.label(label.clone());
        }
        Ok(options)
    }
}

impl From<DeviceSelector> for OverlapOptions {
    fn from(selector: DeviceSelector) -> Self {
        Self::new().device(selector)
    }
}

/// A handle on the same manager, for worker threads.
fn share(mm: &UniversalMemoryManager) -> UniversalMemoryManager {
    UniversalMemoryManager { inner: Arc::clone(&mm.inner) }
}

impl UniversalMemoryManager {
    /// Two device buffers of `capacity` elements of `T` (and, on CUDA, pinned staging), for uploading the next
    /// batch while kernels read the current one; see [`DoubleBuffer`]. `options` is an [`OverlapOptions`] or a
    /// [`DeviceSelector`]. Errors: [`Error::ZeroParameter`] for a capacity of 0, and what allocating the
    /// buffers raises.
    pub fn double_buffer<T: bytemuck::Pod>(
        &self,
        capacity: usize,
        options: impl Into<OverlapOptions>,
    ) -> Result<DoubleBuffer<T>> {
        DoubleBuffer::new(self, capacity, options.into())
    }

    /// A [`Prefetcher`] that keeps `lookahead` batches uploaded ahead of the loop with `workers` threads; its
    /// [`Prefetcher::wrap`] and [`Prefetcher::try_wrap`] check both (a zero is [`Error::ZeroParameter`]).
    pub fn prefetcher(&self, lookahead: usize, workers: usize) -> Prefetcher {
        Prefetcher::new(share(self), lookahead, workers)
    }
}

/// How uploads reach one kind of memory.
enum Route {
    /// A blocking write (host memory, simulated devices, empty buffers).
    Blocking,
    #[cfg(feature = "cuda")]
    Cuda(cuda::Route),
    #[cfg(feature = "opencl")]
    OpenCl,
    #[cfg(feature = "wgpu")]
    Wgpu,
}

/// An upload in flight.
enum Pending {
    None,
    #[cfg(feature = "cuda")]
    Cuda(umm_backends::cuda::cudarc::driver::CudaEvent),
    #[cfg(feature = "opencl")]
    OpenCl(umm_backends::opencl::PendingWrite),
}

/// One lane of uploads into buffers of one device: its route, its staging memory and its upload in flight.
/// Uploads on a lane run one after another: starting one first waits (on the host) for the previous one, whose
/// staging it reuses.
struct Lane {
    pending: Pending,
    /// Pinned staging (CUDA): reused, grown when a batch needs more. Freed before the route's copy stream goes,
    /// so that its free can be ordered after that stream's work.
    #[cfg(feature = "cuda")]
    pinned: Option<umm_backends::OwnedBlock>,
    /// The host bytes of the last OpenCL write, handed back when it completed, reused for the next.
    #[cfg(feature = "opencl")]
    spare: Vec<u8>,
    route: Route,
}

impl Lane {
    /// A lane for buffers like `buffer` (same device and API). `compute` is the CUDA stream kernels run on.
    fn for_buffer<T: bytemuck::Pod>(
        mm: &UniversalMemoryManager,
        buffer: &UniversalBuffer<T>,
        #[cfg(feature = "cuda")] compute: Option<&Arc<umm_backends::cuda::cudarc::driver::CudaStream>>,
    ) -> Result<Self> {
        let route = match buffer.api() {
            // Copies from pinned staging go to device memory; pinned buffers are written from the host directly.
            #[cfg(feature = "cuda")]
            Some(Api::Cuda) if buffer.placement() == umm_placement::PoolKind::DeviceLocal => {
                Route::Cuda(cuda::Route::new(mm, buffer, compute)?)
            }
            #[cfg(feature = "opencl")]
            Some(Api::OpenCl) => Route::OpenCl,
            #[cfg(feature = "wgpu")]
            Some(Api::Wgpu) => Route::Wgpu,
            _ => Route::Blocking,
        };
        let _ = mm;
        Ok(Self {
            pending: Pending::None,
            #[cfg(feature = "cuda")]
            pinned: None,
            #[cfg(feature = "opencl")]
            spare: Vec::new(),
            route,
        })
    }

    /// Starts uploading `data` into the first elements of `buffer` (which holds at least as many) and returns
    /// as soon as the route allows: after staging on CUDA, after enqueueing on OpenCL and wgpu, after the copy
    /// on the host.
    fn start<T: bytemuck::Pod>(&mut self, buffer: &mut UniversalBuffer<T>, data: &[T]) -> Result<()> {
        self.finish()?;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.is_empty() {
            return Ok(());
        }
        match &self.route {
            Route::Blocking => buffer.write_at(0, data),
            #[cfg(feature = "cuda")]
            Route::Cuda(route) => {
                let block = buffer.block.as_mut().expect("a non-empty upload has a block");
                let event = route.upload(&mut self.pinned, block, bytes)?;
                buffer.record_device_use();
                self.pending = Pending::Cuda(event);
                Ok(())
            }
            #[cfg(feature = "opencl")]
            Route::OpenCl => {
                let block = buffer.block.as_mut().expect("a non-empty upload has a block");
                let mut staged = std::mem::take(&mut self.spare);
                staged.clear();
                staged.extend_from_slice(bytes);
                if let Some(write) = umm_backends::opencl::write_owned_block_async(block, 0, staged)? {
                    self.pending = Pending::OpenCl(write);
                }
                buffer.record_device_use();
                Ok(())
            }
            #[cfg(feature = "wgpu")]
            Route::Wgpu => {
                let block = buffer.block.as_mut().expect("a non-empty upload has a block");
                umm_backends::wgpu_backend::write_block_queued(block, 0, bytes)?;
                buffer.record_device_use();
                Ok(())
            }
        }
    }

    /// Waits (on the host) until the upload in flight, if any, has completed.
    fn finish(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.pending, Pending::None) {
            Pending::None => Ok(()),
            #[cfg(feature = "cuda")]
            Pending::Cuda(event) => cuda::wait(&event),
            #[cfg(feature = "opencl")]
            Pending::OpenCl(write) => {
                self.spare = write.wait()?;
                Ok(())
            }
        }
    }

    /// Makes the uploads in flight complete before work later queued by kernels: on CUDA, the compute stream
    /// waits for the upload's event (the host does not); elsewhere, the host waits.
    fn order_before_compute(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let (Route::Cuda(route), Pending::Cuda(event)) = (&self.route, &self.pending) {
            return route.compute_waits_for(event);
        }
        self.finish()
    }

    /// Makes the next upload wait for the kernels queued so far on the compute stream (CUDA: they may still
    /// read the buffer it overwrites). Elsewhere nothing: queues are in order, and host kernels are done.
    fn after_compute(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Route::Cuda(route) = &self.route {
            return route.copies_wait_for_compute();
        }
        Ok(())
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Staging must outlive the copy that reads it.
        if let Err(e) = self.finish() {
            log::error!("an upload in flight failed while its lane was dropped: {e}");
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA route: pinned staging from the device's pinned pool, a copy stream, events.

    use super::*;
    use crate::error::Error;
    use umm_backends::cuda::cudarc::driver::{CudaEvent, CudaStream, DriverError};
    use umm_backends::{MemoryPool, OwnedBlock, StreamId};
    use umm_placement::PoolKind;

    fn driver(call: &str, e: DriverError) -> Error {
        Error::Backend(umm_backends::Error::Driver {
            backend: "cuda".into(),
            call: call.into(),
            message: e.to_string(),
        })
    }

    /// Host wait for an event.
    pub(super) fn wait(event: &CudaEvent) -> Result<()> {
        event.synchronize().map_err(|e| driver("cuEventSynchronize", e))
    }

    pub(super) struct Route {
        pinned_pool: Arc<dyn MemoryPool>,
        copy: Arc<CudaStream>,
        compute: Arc<CudaStream>,
    }

    impl Route {
        pub(super) fn new<T: bytemuck::Pod>(
            mm: &UniversalMemoryManager,
            buffer: &UniversalBuffer<T>,
            compute: Option<&Arc<CudaStream>>,
        ) -> Result<Self> {
            let device = buffer.device();
            let cuda = device.cuda().ok_or_else(|| {
                Error::InvalidConfig(format!("{} holds CUDA memory but has no CUDA context", device.name()))
            })?;
            let ctx = cuda.context();
            let inner = &mm.inner;
            let pinned_pool =
                inner.devices[device.index()].pool(PoolKind::HostPinned, Some(Api::Cuda), &inner.pool_config.read())?;
            let copy = ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?;
            let compute = match compute {
                Some(s) if s.context().cu_ctx() != ctx.cu_ctx() => {
                    return Err(Error::InvalidConfig(format!(
                        "the CUDA stream given belongs to cuda:{}, not to {}",
                        s.context().ordinal(),
                        device.name()
                    )))
                }
                Some(s) => Arc::clone(s),
                None => ctx.default_stream(),
            };
            Ok(Self { pinned_pool, copy, compute })
        }

        /// Stages `bytes` in pinned memory (grown as needed), queues the copy into `block` on the copy stream
        /// and returns the event recorded after it. The caller waited for the lane's previous upload, so the
        /// staging is free.
        pub(super) fn upload(
            &self,
            pinned: &mut Option<OwnedBlock>,
            block: &mut OwnedBlock,
            bytes: &[u8],
        ) -> Result<CudaEvent> {
            let len = bytes.len() as u64;
            if pinned.as_ref().is_none_or(|p| p.len() < len) {
                *pinned = None;
                *pinned = Some(OwnedBlock::allocate(Arc::clone(&self.pinned_pool), len, StreamId::default(), false)?);
            }
            let staging = pinned.as_mut().expect("allocated above");
            // A host copy into pinned memory (no device synchronization).
            staging.write(0, bytes)?;
            umm_backends::cuda::upload_block_async(staging, block, len, &self.copy)?;
            self.copy.record_event(None).map_err(|e| driver("cuEventRecord", e))
        }

        pub(super) fn compute_waits_for(&self, event: &CudaEvent) -> Result<()> {
            self.compute.wait(event).map_err(|e| driver("cuStreamWaitEvent", e))
        }

        pub(super) fn copies_wait_for_compute(&self) -> Result<()> {
            let done = self.compute.record_event(None).map_err(|e| driver("cuEventRecord", e))?;
            self.copy.wait(&done).map_err(|e| driver("cuStreamWaitEvent", e))
        }
    }
}
