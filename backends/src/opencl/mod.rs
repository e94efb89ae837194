//! OpenCL devices through `opencl3`, whose `cl3` layer opens libOpenCL.so.1 at run time (`dlopen`): the crate
//! builds without any OpenCL package, and a machine without one simply lists no OpenCL device. (The older `ocl`
//! crate links libOpenCL at build time, panics when no platform exists and retries for about 10 s first.)
//!
//! Every device gets one context and one in-order command queue, shared (through an `Arc`) by its pools, so
//! copies, fills and kernels enqueued on [`OpenClDevice::queue`] run in the order they were issued: a block freed
//! and handed out again is never written before the work queued by its previous owner. Kernels enqueued on
//! another queue are the caller's to order.
//!
//! Segments are `cl_mem` buffers created with flags by placement: `DeviceLocal` READ_WRITE, `HostPinned`
//! READ_WRITE | ALLOC_HOST_PTR, `ReadOnly` READ_ONLY (kernels may only read it; the host fills it once after
//! allocation). Blocks are ranges of segments at offsets aligned to CL_DEVICE_MEM_BASE_ADDR_ALIGN, so each one
//! can become a real sub-buffer ([`cl_sub_buffer`]) to pass to a kernel.
//!
//! Decisions:
//! - Requests larger than CL_DEVICE_MAX_MEM_ALLOC_SIZE are refused with [`crate::Error::TooLarge`] (the pool
//!   checks [`Backend::max_segment_size`] before touching the device): a block must be one buffer to be one
//!   kernel argument, so splitting it across segments would hand out something no kernel can use.
//! - Alignment is the device's base address alignment in bytes (at least 4, rounded up to a power of two).
//! - Host pointers: on devices that share memory with the host (CPU devices such as PoCL, integrated GPUs),
//!   `HostPinned` segments are mapped once at creation and stay mapped, and [`Backend::host_ptr`] returns the
//!   mapped address: zero-copy access. The view is coherent with kernels after the queue has finished the work
//!   (for example after a blocking read or `queue().finish()`). Elsewhere `host_ptr` is `None` and bytes move
//!   through the queue.

mod blocks;
mod discover;
mod raw;

pub use blocks::{
    block_sub_buffer, block_sub_buffer_range, cl_sub_buffer, copy_block, fill_block_async, read_block_async,
    write_block_async, write_owned_block_async,
};
pub use discover::discover;
/// The opencl3 this crate was built with, so that callers build programs and kernels with the same version.
pub use opencl3;
pub use raw::{ClEvent, ClFailure, PendingRead, PendingWrite};

use crate::adopt::{Adoption, Ownership};
use crate::HostPtr;
use crate::{Api, Backend, DeviceInfo, DevicePath, Error, MemoryPool, OwnedBlock, Pool, PoolConfig, PoolKind, Result};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::Device;
use opencl3::memory::{Buffer, CL_MEM_ALLOC_HOST_PTR, CL_MEM_READ_ONLY, CL_MEM_READ_WRITE};
use opencl3::types::{cl_mem, cl_mem_flags};
use raw::MemObject;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Backend name used in errors that are not tied to one pool.
const API: &str = "opencl";

/// What every pool of one device shares. Field order is drop order: the queue goes before its context.
struct DeviceShared {
    queue: CommandQueue,
    context: Context,
    device: Device,
    name: String,
    ordinal: usize,
    alignment: u64,
    max_allocation: u64,
    capacity: u64,
    /// Whether `HostPinned` segments are mapped persistently (the device shares memory with the host).
    host_mappable: bool,
    /// Whether clEnqueueFillBuffer exists (OpenCL 1.2).
    has_fill: bool,
    /// Bytes of segments alive on this device, across its pools.
    held: AtomicU64,
}

impl Drop for DeviceShared {
    fn drop(&mut self) {
        if let Err(e) = self.queue.finish() {
            log::error!("clFinish on {} failed: {e}", self.name);
        }
    }
}

impl From<ClFailure> for Error {
    fn from(e: ClFailure) -> Self {
        Error::Driver { backend: API.into(), call: e.call.into(), message: e.to_string() }
    }
}

/// One OpenCL device with its context and queue. Cheap to clone (an `Arc`).
#[derive(Clone)]
pub struct OpenClDevice {
    info: DeviceInfo,
    shared: Arc<DeviceShared>,
}

impl std::fmt::Debug for OpenClDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenClDevice").field("info", &self.info).finish_non_exhaustive()
    }
}

impl OpenClDevice {
    /// What discovery learnt about the device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The device's context: build programs in it to run kernels on pool buffers.
    pub fn context(&self) -> &Context {
        &self.shared.context
    }

    /// The device's in-order queue, shared by its pools: enqueue kernels here to have them ordered with the
    /// pools' copies.
    pub fn queue(&self) -> &CommandQueue {
        &self.shared.queue
    }

    /// The opencl3 device.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// A backend for `placement` on this device (pools usually come from [`OpenClDevice::pool`]).
    pub fn backend(&self, placement: PoolKind) -> OpenClBackend {
        let placement = placement.on_device();
        let d = &self.shared;
        OpenClBackend {
            name: format!("opencl:{} {placement} ({})", d.ordinal, d.name),
            device: Arc::clone(d),
            placement,
            adoption: None,
        }
    }

    /// Adopts an opencl3 buffer made in this device's context ([`OpenClDevice::context`]) as the one block of a
    /// pool of its own, taking it over: umm keeps a reference of its own and drops `buffer` (so the buffer is
    /// released when the block is freed, unless other references to it live elsewhere). See
    /// [`OpenClDevice::adopt_borrowed`] for the errors.
    pub fn adopt<T>(&self, buffer: Buffer<T>) -> Result<OwnedBlock> {
        self.adopt_as(&buffer, Ownership::Owned)
    }

    /// Adopts an opencl3 buffer made in this device's context as the one block of a pool of its own, leaving it
    /// its owner's: umm holds a reference of its own while the block lives and releases only that one. Errors:
    /// a buffer of another context ([`Error::Unsupported`]), an empty one ([`Error::ZeroSize`]), a failed query
    /// ([`Error::Driver`]).
    pub fn adopt_borrowed<T>(&self, buffer: &Buffer<T>) -> Result<OwnedBlock> {
        self.adopt_as(buffer, Ownership::Borrowed)
    }

    fn adopt_as<T>(&self, buffer: &Buffer<T>, ownership: Ownership) -> Result<OwnedBlock> {
        use opencl3::memory::ClMem;
        let d = &self.shared;
        let name = format!("opencl:{} adopted ({})", d.ordinal, d.name);
        let fail = |call: &str, code: i32| Error::Driver {
            backend: name.clone(),
            call: call.into(),
            message: opencl3::error_codes::error_text(code).to_string(),
        };
        let context = buffer.context().map_err(|e| fail("clGetMemObjectInfo", e.0))?;
        if context != d.context.get() {
            return Err(Error::Unsupported {
                backend: name,
                what: "adopting a buffer of another OpenCL context: make it in this device's context".into(),
            });
        }
        let size = buffer.size().map_err(|e| fail("clGetMemObjectInfo", e.0))? as u64;
        if size == 0 {
            return Err(Error::ZeroSize { device: name });
        }
        let mem = MemObject::retained(buffer)?;
        let segment = OpenClSegment(Arc::new(SegmentInner { mem, size, mapped: None, device: Arc::clone(d) }));
        let backend = OpenClBackend {
            name,
            device: Arc::clone(d),
            placement: PoolKind::DeviceLocal,
            adoption: Some(Adoption::new(segment, None, ownership)),
        };
        let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(backend, crate::adopt::pool_config())?);
        OwnedBlock::allocate(pool, size, crate::StreamId(0), false)
    }

    /// A pool of `placement` memory on this device. Pools of one device share its context and queue, so blocks
    /// of different pools can be arguments of one kernel.
    pub fn pool(&self, placement: PoolKind, config: PoolConfig) -> Result<Pool<OpenClBackend>> {
        Pool::new(self.backend(placement), config)
    }
}

struct SegmentInner {
    mem: MemObject,
    size: u64,
    /// Host address of byte 0 while persistently mapped (an integer, so the segment stays `Send + Sync`).
    mapped: Option<usize>,
    device: Arc<DeviceShared>,
}

/// One segment: an OpenCL buffer (reference-counted; the last clone unmaps and releases it).
#[derive(Clone)]
pub struct OpenClSegment(Arc<SegmentInner>);

impl std::fmt::Debug for OpenClSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenClSegment").field("size", &self.0.size).field("mapped", &self.0.mapped.is_some()).finish()
    }
}

impl OpenClSegment {
    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.0.size
    }

    /// The segment's `cl_mem`, valid while the segment lives.
    pub fn as_raw(&self) -> cl_mem {
        self.0.mem.raw()
    }
}

impl Drop for SegmentInner {
    #[allow(unsafe_code)] // Discharges `raw::unmap`'s contract.
    fn drop(&mut self) {
        if let Some(addr) = self.mapped {
            // SAFETY: `mapped` is what `raw::map` returned for `mem` in `create_segment`, unmapped once, here, as
            // the segment's last reference goes; the pool destroys a segment only once no block in it is live, so
            // no slice of the mapping is used afterwards.
            unsafe { raw::unmap(&self.device.queue, &self.mem, addr) };
        }
        self.device.held.fetch_sub(self.size, Ordering::Relaxed);
    }
}

/// A sub-buffer: one block as its own `cl_mem`, to set as a kernel argument. Releases its reference on drop
/// (OpenCL keeps the parent segment alive meanwhile). Use it only while its block is allocated.
#[derive(Debug)]
pub struct SubBuffer {
    mem: MemObject,
    offset: u64,
    size: u64,
}

impl SubBuffer {
    /// The sub-buffer's `cl_mem`: `ExecuteKernel::new(&k).set_arg(&sub.as_raw())`.
    pub fn as_raw(&self) -> cl_mem {
        self.mem.raw()
    }

    /// Its origin inside the segment.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Hands the sub-buffer to opencl3 as a typed `Buffer<T>` (which releases it when dropped), for opencl3's
    /// own enqueue calls.
    pub fn into_buffer<T>(self) -> Buffer<T> {
        self.mem.into_buffer()
    }
}

/// The OpenCL backend of one (device, placement).
pub struct OpenClBackend {
    name: String,
    device: Arc<DeviceShared>,
    placement: PoolKind,
    /// For the backend of an adopted buffer: that buffer (see [`crate::adopt`]).
    adoption: Option<Adoption<OpenClSegment>>,
}

impl std::fmt::Debug for OpenClBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenClBackend").field("name", &self.name).field("placement", &self.placement).finish()
    }
}

impl OpenClBackend {
    /// The placement this backend's segments are made for.
    pub fn placement(&self) -> PoolKind {
        self.placement
    }

    /// The device's context.
    pub fn context(&self) -> &Context {
        &self.device.context
    }

    /// The device's in-order queue (shared by all pools of the device).
    pub fn queue(&self) -> &CommandQueue {
        &self.device.queue
    }

    /// Waits for everything enqueued on the device's queue.
    pub fn finish(&self) -> Result<()> {
        self.device.queue.finish().map_err(|e| self.err(ClFailure { call: "clFinish", code: e.0 }))
    }

    fn flags(&self) -> cl_mem_flags {
        match self.placement {
            PoolKind::DeviceLocal => CL_MEM_READ_WRITE,
            // `backend` stores `placement.on_device()`, so `Host` never reaches here; it would mean pinned memory.
            PoolKind::Host | PoolKind::HostPinned => CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR,
            PoolKind::ReadOnly => CL_MEM_READ_ONLY,
        }
    }

    fn err(&self, e: ClFailure) -> Error {
        Error::Driver { backend: self.name.clone(), call: e.call.into(), message: e.to_string() }
    }

    /// Checks `[offset, offset + len)` against the segment; returns both as `usize`.
    fn range(&self, segment: &OpenClSegment, offset: u64, len: u64) -> Result<(usize, usize)> {
        match offset.checked_add(len) {
            Some(end) if end <= segment.size() => Ok((offset as usize, len as usize)),
            _ => Err(Error::OutOfBounds(format!(
                "{len} bytes at {offset} in an OpenCL segment of {} bytes on {}",
                segment.size(),
                self.name
            ))),
        }
    }

    /// A sub-buffer of `size` bytes at `offset` of `segment`. The offset must be a multiple of the device's
    /// base address alignment (every block offset is).
    pub fn sub_buffer(&self, segment: &OpenClSegment, offset: u64, size: u64) -> Result<SubBuffer> {
        if size == 0 {
            return Err(Error::ZeroSize { device: self.name.clone() });
        }
        let (origin, len) = self.range(segment, offset, size)?;
        if !offset.is_multiple_of(self.device.alignment) {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: format!(
                    "a sub-buffer at origin {offset}: origins must be multiples of CL_DEVICE_MEM_BASE_ADDR_ALIGN \
                     ({} bytes)",
                    self.device.alignment
                ),
            });
        }
        let mem = segment.0.mem.sub_buffer(origin, len).map_err(|e| self.err(e))?;
        Ok(SubBuffer { mem, offset, size })
    }

    /// Enqueues copying `data` into the segment at `offset` and returns without waiting; the returned transfer
    /// owns `data` until the device has read it.
    pub fn write_async(&self, segment: &OpenClSegment, offset: u64, data: Vec<u8>) -> Result<PendingWrite> {
        let (offset, _) = self.range(segment, offset, data.len() as u64)?;
        raw::write_async(&self.device.queue, &segment.0.mem, offset, data).map_err(|e| self.err(e))
    }

    /// Enqueues copying `len` bytes at `offset` into a new host buffer and returns without waiting.
    pub fn read_async(&self, segment: &OpenClSegment, offset: u64, len: u64) -> Result<PendingRead> {
        let (offset, len) = self.range(segment, offset, len)?;
        raw::read_async(&self.device.queue, &segment.0.mem, offset, len).map_err(|e| self.err(e))
    }

    /// Enqueues setting `len` bytes at `offset` to `value` and returns its event without waiting (OpenCL 1.2).
    pub fn fill_async(&self, segment: &OpenClSegment, offset: u64, len: u64, value: u8) -> Result<ClEvent> {
        let (offset, len) = self.range(segment, offset, len)?;
        if !self.device.has_fill {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: "clEnqueueFillBuffer (OpenCL 1.2)".into(),
            });
        }
        raw::fill(&self.device.queue, &segment.0.mem, offset, len, value).map_err(|e| self.err(e))
    }
}

impl crate::backend::sealed::Sealed for OpenClBackend {}

impl Backend for OpenClBackend {
    type Segment = OpenClSegment;

    fn name(&self) -> &str {
        &self.name
    }
    fn api(&self) -> Api {
        Api::OpenCl
    }
    fn alignment(&self) -> u64 {
        // An adopted buffer's one block starts at origin 0 (aligned for any sub-buffer) and spans it exactly.
        if self.adoption.is_some() {
            return 1;
        }
        self.device.alignment
    }
    fn segment_granularity(&self) -> u64 {
        if self.adoption.is_some() {
            return 1;
        }
        self.device.alignment.max(4096)
    }
    fn max_segment_size(&self) -> u64 {
        self.device.max_allocation
    }
    fn capacity(&self) -> u64 {
        self.device.capacity
    }
    fn free_bytes(&self) -> u64 {
        // OpenCL has no free-memory query: report what this process has not taken.
        self.device.capacity.saturating_sub(self.device.held.load(Ordering::Relaxed))
    }

    /// One clCreateBuffer (plus one map for host-visible `HostPinned` segments). O(1).
    fn create_segment(&self, size: u64) -> Result<OpenClSegment> {
        if let Some(adoption) = &self.adoption {
            let segment = adoption.take(&self.name)?;
            self.device.held.fetch_add(segment.size(), Ordering::Relaxed);
            return Ok(segment);
        }
        if size > self.device.max_allocation {
            return Err(Error::TooLarge {
                device: self.name.clone(),
                requested: size,
                max: self.device.max_allocation,
            });
        }
        let len = usize::try_from(size).map_err(|_| Error::SizeOverflow { what: format!("{size} bytes as usize") })?;
        let mem = MemObject::create(&self.device.context, self.flags(), len).map_err(|e| self.err(e))?;
        let mapped = if self.placement == PoolKind::HostPinned && self.device.host_mappable {
            Some(raw::map(&self.device.queue, &mem, len).map_err(|e| self.err(e))?.as_ptr() as usize)
        } else {
            None
        };
        self.device.held.fetch_add(size, Ordering::Relaxed);
        Ok(OpenClSegment(Arc::new(SegmentInner { mem, size, mapped, device: Arc::clone(&self.device) })))
    }

    fn destroy_segment(&self, segment: OpenClSegment, _: crate::backend::PoolAccess) {
        // The last reference unmaps and releases the buffer (see SegmentInner's Drop).
        drop(segment);
    }

    fn write(&self, segment: &OpenClSegment, offset: u64, src: &[u8]) -> Result<()> {
        let (offset, len) = self.range(segment, offset, src.len() as u64)?;
        if len == 0 {
            return Ok(());
        }
        raw::write(&self.device.queue, &segment.0.mem, offset, src).map_err(|e| self.err(e))
    }

    fn read(&self, segment: &OpenClSegment, offset: u64, dst: &mut [u8]) -> Result<()> {
        let (offset, len) = self.range(segment, offset, dst.len() as u64)?;
        if len == 0 {
            return Ok(());
        }
        raw::read(&self.device.queue, &segment.0.mem, offset, dst).map_err(|e| self.err(e))
    }

    fn fill(&self, segment: &OpenClSegment, offset: u64, len: u64, value: u8) -> Result<()> {
        let (start, n) = self.range(segment, offset, len)?;
        if n == 0 {
            return Ok(());
        }
        if self.device.has_fill {
            let event = raw::fill(&self.device.queue, &segment.0.mem, start, n, value).map_err(|e| self.err(e))?;
            return event.wait();
        }
        const CHUNK: usize = 1 << 20;
        let chunk = vec![value; CHUNK.min(n)];
        let mut done = 0;
        while done < n {
            let k = CHUNK.min(n - done);
            raw::write(&self.device.queue, &segment.0.mem, start + done, &chunk[..k]).map_err(|e| self.err(e))?;
            done += k;
        }
        Ok(())
    }

    fn settle(&self) -> Result<()> {
        self.finish()
    }
    #[allow(unsafe_code)] // Discharges `raw::mapped_host_ptr`'s contract.
    fn host_ptr(&self, segment: &OpenClSegment, offset: u64) -> Option<HostPtr> {
        let base = segment.0.mapped?;
        // SAFETY: `base` is the mapping `raw::map` made for the live `segment` (unmapped only when its last
        // reference drops, after the pool destroyed it), `offset` is checked against its size here, and this
        // backend touches its bytes only in `write`, `read` and `fill`, when the pool asks.
        (offset < segment.size()).then(|| unsafe { raw::mapped_host_ptr(base, offset as usize) }).flatten()
    }
    fn may_be_host_addressable(&self) -> bool {
        true
    }

    /// Pools of one device share its context and queue: `clEnqueueCopyBuffer` joins them.
    fn copy_on_device(
        &self,
        segment: &OpenClSegment,
        offset: u64,
        src: &Self,
        src_segment: &OpenClSegment,
        src_offset: u64,
        len: u64,
    ) -> Result<Option<DevicePath>> {
        if !Arc::ptr_eq(&src.device, &self.device) {
            return Ok(None);
        }
        blocks::copy_segments(src, src_segment, src_offset, self, segment, offset, len)?;
        Ok(Some(DevicePath::OpenClDevice))
    }
}

#[cfg(test)]
mod tests;
