//! The unsafe layer of the OpenCL backend: owned `cl_mem` and `cl_event` handles that release themselves without
//! panicking, and the enqueue calls (blocking and non-blocking copies, fills, maps) over them. Every call returns
//! a [`ClFailure`] instead of panicking; the safe backend in `mod.rs` turns it into the crate's error.
//!
//! Memory safety argument, once: an OpenCL call can only harm host memory through the host pointers passed to it.
//! Blocking copies take a Rust slice of exactly the transfer's length; non-blocking ones own their host buffer in
//! a [`PendingRead`]/[`PendingWrite`] that waits for the transfer before it lets the buffer go (and leaks it if the
//! wait fails). Device-side ranges are checked by OpenCL itself (`CL_INVALID_VALUE`), so a wrong offset is an
//! error, not undefined behaviour. Handles are owned (one reference each) and released once, in `Drop`.
//!
//! So the copies, fills and maps are safe functions; only [`unmap`] and [`mapped_host_ptr`], which rely on the
//! caller for the mapping's address and lifetime, are `unsafe fn`s with a `# Safety` section.

#![allow(unsafe_code)]

use opencl3::command_queue::{
    enqueue_copy_buffer, enqueue_fill_buffer, enqueue_map_buffer, enqueue_read_buffer, enqueue_unmap_mem_object,
    enqueue_write_buffer, CommandQueue,
};
use opencl3::context::Context;
use opencl3::error_codes::error_text;
use opencl3::event::{get_event_info, release_event, wait_for_events, CL_COMPLETE, CL_EVENT_COMMAND_EXECUTION_STATUS};
use opencl3::memory::{
    create_buffer, create_sub_buffer, release_mem_object, retain_mem_object, Buffer, ClMem,
    CL_BUFFER_CREATE_TYPE_REGION, CL_MAP_READ, CL_MAP_WRITE,
};
use opencl3::types::{cl_buffer_region, cl_event, cl_int, cl_mem, cl_mem_flags, CL_BLOCKING, CL_NON_BLOCKING};
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::ptr::{self, NonNull};

/// A failed OpenCL call: which one, and its status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClFailure {
    /// The OpenCL entry point, e.g. `clCreateBuffer`.
    pub call: &'static str,
    /// The status it returned (negative), or cl3's dynamic-loading codes (-2000: libOpenCL could not be loaded,
    /// -2001: the loader lacks the function).
    pub code: cl_int,
}

impl ClFailure {
    fn at(call: &'static str) -> impl Fn(cl_int) -> Self {
        move |code| Self { call, code }
    }
}

impl std::fmt::Display for ClFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, error_text(self.code), self.code)
    }
}

/// One owned reference to a buffer or sub-buffer.
#[derive(Debug)]
pub(super) struct MemObject(cl_mem);

// SAFETY: a cl_mem is a handle to a reference-counted driver object; the OpenCL specification makes every API
// call on memory objects thread-safe (only clSetKernelArg is not, and it is not called on a shared kernel here).
unsafe impl Send for MemObject {}
// SAFETY: as for Send: the handle is never mutated, and all calls taking it are thread-safe.
unsafe impl Sync for MemObject {}

impl MemObject {
    /// Creates a buffer of `size` bytes with `flags` (no host pointer: the flags must not ask for one).
    pub(super) fn create(context: &Context, flags: cl_mem_flags, size: usize) -> Result<Self, ClFailure> {
        // SAFETY: `context` is a live context (borrowed); the host pointer is null, which is valid for every flag
        // combination that does not include USE_HOST_PTR or COPY_HOST_PTR (the driver rejects those with an
        // error rather than reading through null).
        let mem = unsafe { create_buffer(context.get(), flags, size, ptr::null_mut()) }
            .map_err(ClFailure::at("clCreateBuffer"))?;
        Ok(Self(mem))
    }

    /// A sub-buffer of `size` bytes at `origin`, inheriting this buffer's access flags. The origin must be
    /// aligned to CL_DEVICE_MEM_BASE_ADDR_ALIGN, which OpenCL checks (CL_MISALIGNED_SUB_BUFFER_OFFSET).
    pub(super) fn sub_buffer(&self, origin: usize, size: usize) -> Result<Self, ClFailure> {
        let region = cl_buffer_region { origin, size };
        // SAFETY: `self.0` is a live buffer we hold a reference to; `region` is a valid cl_buffer_region that
        // outlives the call, as CL_BUFFER_CREATE_TYPE_REGION requires; flags 0 inherit the parent's flags.
        let mem = unsafe {
            create_sub_buffer(self.0, 0, CL_BUFFER_CREATE_TYPE_REGION, ptr::from_ref(&region).cast::<c_void>())
        }
        .map_err(ClFailure::at("clCreateSubBuffer"))?;
        Ok(Self(mem))
    }

    /// A reference of umm's own to the buffer behind `buffer` (which may be dropped afterwards: OpenCL keeps
    /// the object while any reference lives).
    pub(super) fn retained<T>(buffer: &Buffer<T>) -> Result<Self, ClFailure> {
        let mem = buffer.get();
        // SAFETY: `buffer` holds a reference to this live object for the whole call (opencl3's `Buffer` owns one
        // and releases it only on drop), so retaining it is valid; the new reference is released once, in `Drop`.
        unsafe { retain_mem_object(mem) }.map_err(ClFailure::at("clRetainMemObject"))?;
        Ok(Self(mem))
    }

    /// The raw handle, valid while `self` lives.
    pub(super) fn raw(&self) -> cl_mem {
        self.0
    }

    /// Hands this reference over to opencl3's `Buffer<T>`, which releases it when dropped.
    pub(super) fn into_buffer<T>(self) -> Buffer<T> {
        let this = ManuallyDrop::new(self);
        Buffer::new(this.0)
    }
}

impl Drop for MemObject {
    fn drop(&mut self) {
        // SAFETY: we own exactly one reference to this live object and release it exactly once (here).
        if let Err(code) = unsafe { release_mem_object(self.0) } {
            log::error!("{}", ClFailure { call: "clReleaseMemObject", code });
        }
    }
}

/// An owned OpenCL event: the completion of one enqueued command.
#[derive(Debug)]
pub struct ClEvent(cl_event);

// SAFETY: events are reference-counted driver objects whose API calls are thread-safe.
unsafe impl Send for ClEvent {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for ClEvent {}

impl ClEvent {
    /// Blocks until the command completes; an error if it terminated abnormally.
    pub fn wait(&self) -> crate::Result<()> {
        Ok(wait_for_events(&[self.0]).map_err(ClFailure::at("clWaitForEvents"))?)
    }

    /// Whether the command has completed (successfully or not), without blocking.
    pub fn is_complete(&self) -> crate::Result<bool> {
        let status =
            get_event_info(self.0, CL_EVENT_COMMAND_EXECUTION_STATUS).map_err(ClFailure::at("clGetEventInfo"))?;
        Ok(cl_int::from(status) <= CL_COMPLETE)
    }

    /// The raw handle, valid while `self` lives: put it in an opencl3 wait list to order a kernel after it.
    pub fn raw(&self) -> cl_event {
        self.0
    }
}

impl Drop for ClEvent {
    fn drop(&mut self) {
        // SAFETY: we own one reference to this event (returned by an enqueue call) and release it once.
        if let Err(code) = unsafe { release_event(self.0) } {
            log::error!("{}", ClFailure { call: "clReleaseEvent", code });
        }
    }
}

/// Copies `src` into `mem` at `offset` and returns when the copy is done.
pub(super) fn write(queue: &CommandQueue, mem: &MemObject, offset: usize, src: &[u8]) -> Result<(), ClFailure> {
    // SAFETY: the copy is blocking, so the driver reads `src` (a live slice of exactly `src.len()` bytes) only
    // during this call; `queue` and `mem` are live handles.
    let event = unsafe {
        enqueue_write_buffer(
            queue.get(),
            mem.raw(),
            CL_BLOCKING,
            offset,
            src.len(),
            src.as_ptr().cast(),
            0,
            ptr::null(),
        )
    }
    .map_err(ClFailure::at("clEnqueueWriteBuffer"))?;
    drop(ClEvent(event));
    Ok(())
}

/// Copies bytes of `mem` at `offset` into `dst` and returns when the copy is done.
pub(super) fn read(queue: &CommandQueue, mem: &MemObject, offset: usize, dst: &mut [u8]) -> Result<(), ClFailure> {
    // SAFETY: blocking, so the driver writes `dst` (exclusively borrowed, exactly `dst.len()` bytes) only during
    // this call; `queue` and `mem` are live handles.
    let event = unsafe {
        enqueue_read_buffer(
            queue.get(),
            mem.raw(),
            CL_BLOCKING,
            offset,
            dst.len(),
            dst.as_mut_ptr().cast(),
            0,
            ptr::null(),
        )
    }
    .map_err(ClFailure::at("clEnqueueReadBuffer"))?;
    drop(ClEvent(event));
    Ok(())
}

/// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset` on the device (both buffers of
/// `queue`'s context) and returns when the copy is done.
pub(super) fn copy(
    queue: &CommandQueue,
    src: &MemObject,
    src_offset: usize,
    dst: &MemObject,
    dst_offset: usize,
    len: usize,
) -> Result<(), ClFailure> {
    // SAFETY: no host memory is involved: the driver checks both device ranges (CL_INVALID_VALUE) and refuses
    // overlapping ones (CL_MEM_COPY_OVERLAP); `queue`, `src` and `dst` are live handles of one context.
    let event =
        unsafe { enqueue_copy_buffer(queue.get(), src.raw(), dst.raw(), src_offset, dst_offset, len, 0, ptr::null()) }
            .map_err(ClFailure::at("clEnqueueCopyBuffer"))?;
    let event = ClEvent(event);
    wait_for_events(&[event.raw()]).map_err(ClFailure::at("clWaitForEvents"))
}

/// Enqueues setting `len` bytes of `mem` at `offset` to `value` (OpenCL 1.2). Returns at once.
pub(super) fn fill(
    queue: &CommandQueue,
    mem: &MemObject,
    offset: usize,
    len: usize,
    value: u8,
) -> Result<ClEvent, ClFailure> {
    // SAFETY: the driver copies the one-byte pattern before clEnqueueFillBuffer returns (the specification lets
    // the application reuse the pattern memory at once), so a pointer to a local is enough.
    let event = unsafe {
        enqueue_fill_buffer(queue.get(), mem.raw(), ptr::from_ref(&value).cast(), 1, offset, len, 0, ptr::null())
    }
    .map_err(ClFailure::at("clEnqueueFillBuffer"))?;
    Ok(ClEvent(event))
}

/// A non-blocking write in flight: owns the source bytes until the device has read them.
#[derive(Debug)]
pub struct PendingWrite {
    event: Option<ClEvent>,
    data: ManuallyDrop<Vec<u8>>,
}

/// A non-blocking read in flight: owns the destination bytes until the device has written them.
#[derive(Debug)]
pub struct PendingRead {
    event: Option<ClEvent>,
    data: ManuallyDrop<Vec<u8>>,
}

/// Enqueues copying `data` into `mem` at `offset` without waiting.
pub(super) fn write_async(
    queue: &CommandQueue,
    mem: &MemObject,
    offset: usize,
    data: Vec<u8>,
) -> Result<PendingWrite, ClFailure> {
    // SAFETY: the heap buffer of `data` does not move when the Vec is moved into the PendingWrite below, and the
    // PendingWrite frees it only after the event has completed (or never, if waiting fails). On an enqueue error
    // nothing was enqueued and `data` is simply dropped.
    let event = unsafe {
        enqueue_write_buffer(
            queue.get(),
            mem.raw(),
            CL_NON_BLOCKING,
            offset,
            data.len(),
            data.as_ptr().cast(),
            0,
            ptr::null(),
        )
    }
    .map_err(ClFailure::at("clEnqueueWriteBuffer"))?;
    // Start the transfer now rather than at the next blocking call.
    let _ = queue.flush();
    Ok(PendingWrite { event: Some(ClEvent(event)), data: ManuallyDrop::new(data) })
}

/// Enqueues copying `len` bytes of `mem` at `offset` into a new host buffer without waiting.
pub(super) fn read_async(
    queue: &CommandQueue,
    mem: &MemObject,
    offset: usize,
    len: usize,
) -> Result<PendingRead, ClFailure> {
    let mut data = vec![0u8; len];
    // SAFETY: as in `write_async`: the heap buffer stays put and alive until the read has completed; nothing
    // else can reach it meanwhile because the PendingRead owns it privately.
    let event = unsafe {
        enqueue_read_buffer(
            queue.get(),
            mem.raw(),
            CL_NON_BLOCKING,
            offset,
            len,
            data.as_mut_ptr().cast(),
            0,
            ptr::null(),
        )
    }
    .map_err(ClFailure::at("clEnqueueReadBuffer"))?;
    let _ = queue.flush();
    Ok(PendingRead { event: Some(ClEvent(event)), data: ManuallyDrop::new(data) })
}

/// Waits for `event`; on failure the device may still touch `data`, so it is leaked rather than freed.
fn settle(event: &mut Option<ClEvent>, data: &mut ManuallyDrop<Vec<u8>>) -> crate::Result<Vec<u8>> {
    let Some(ev) = event.take() else {
        return Ok(Vec::new());
    };
    match ev.wait() {
        // SAFETY: the transfer has completed, so the driver no longer uses the buffer; `event` is now None, so
        // `data` is taken exactly once (Drop and a second settle return early).
        Ok(()) => Ok(unsafe { ManuallyDrop::take(data) }),
        Err(e) => {
            log::error!("{e}: leaking the {} byte host buffer of the transfer", data.len());
            Err(e)
        }
    }
}

macro_rules! pending_impl {
    ($ty:ident) => {
        impl $ty {
            /// Blocks until the transfer is done and returns its host buffer (the bytes read, or the bytes written
            /// for reuse).
            pub fn wait(mut self) -> crate::Result<Vec<u8>> {
                settle(&mut self.event, &mut self.data)
            }

            /// Whether the transfer has completed, without blocking.
            pub fn is_complete(&self) -> crate::Result<bool> {
                self.event.as_ref().map_or(Ok(true), ClEvent::is_complete)
            }

            /// The transfer's event, to order later commands after it.
            pub fn event(&self) -> Option<&ClEvent> {
                self.event.as_ref()
            }
        }

        impl Drop for $ty {
            fn drop(&mut self) {
                // Waiting here is what keeps the host buffer alive for the device; the result is logged inside.
                let _ = settle(&mut self.event, &mut self.data);
            }
        }
    };
}
pending_impl!(PendingWrite);
pending_impl!(PendingRead);

/// Maps all `size` bytes of `mem` for reading and writing and returns the host address. The mapping lasts until
/// [`unmap`]; used only on devices that share memory with the host.
pub(super) fn map(queue: &CommandQueue, mem: &MemObject, size: usize) -> Result<NonNull<u8>, ClFailure> {
    let mut mapped: cl_mem = ptr::null_mut();
    // SAFETY: a blocking map of a live buffer; the driver writes the mapped address into `mapped` (a local).
    let event = unsafe {
        enqueue_map_buffer(
            queue.get(),
            mem.raw(),
            CL_BLOCKING,
            CL_MAP_READ | CL_MAP_WRITE,
            0,
            size,
            &mut mapped,
            0,
            ptr::null(),
        )
    }
    .map_err(ClFailure::at("clEnqueueMapBuffer"))?;
    drop(ClEvent(event));
    NonNull::new(mapped.cast::<u8>()).ok_or(ClFailure { call: "clEnqueueMapBuffer", code: -5 })
}

/// Ends a mapping made by [`map`]. Never panics; a failure is logged.
///
/// # Safety
/// `addr` is the address [`map`] returned for `mem`, not unmapped yet, and nothing reads or writes through it
/// afterwards (no slice or `HostPtr` of it is used again).
pub(super) unsafe fn unmap(queue: &CommandQueue, mem: &MemObject, addr: usize) {
    // SAFETY: this function's contract; `queue` and `mem` are live handles (borrowed).
    match unsafe { enqueue_unmap_mem_object(queue.get(), mem.raw(), addr as *mut c_void, 0, ptr::null()) } {
        Ok(event) => drop(ClEvent(event)),
        Err(code) => log::error!("{}", ClFailure { call: "clEnqueueUnmapMemObject", code }),
    }
}

/// The host address of byte `offset` of a buffer persistently mapped at `base`; `None` for address 0.
///
/// # Safety
/// - `base` is the address [`map`] returned for a live buffer that stays mapped until its segment is destroyed,
///   and `offset` is less than the buffer's size;
/// - until then the backend touches the bytes only in the copies and fills the pool asks for, as
///   [`crate::HostPtr::new`] requires.
pub(super) unsafe fn mapped_host_ptr(base: usize, offset: usize) -> Option<crate::HostPtr> {
    let ptr = std::ptr::NonNull::new((base + offset) as *mut u8)?;
    // SAFETY: `HostPtr::new`'s contract is this function's; the device writes the bytes only through work the user
    // enqueued, which `settle` waits for. A mapped region holds the buffer's contents, written by the driver, so
    // every byte is initialised.
    Some(unsafe { crate::HostPtr::new(ptr) })
}
