//! Raw CUDA driver calls through cudarc's `sys` layer: the only `unsafe` of the CUDA backend. Every function here
//! returns a `Result` and never panics. Callers bind the device's context to the calling thread first
//! (`CudaContext::bind_to_thread`).
//!
//! As in cudarc's `driver::result`, every function whose soundness depends on its caller is an `unsafe fn` whose
//! `# Safety` section lists what the caller must ensure: that a byte range lies inside live memory, that memory is
//! freed once and after the work queued on it, that a handle is live. Functions that only rely on the bound
//! context stay safe: without one (or with another) the driver returns an error (`CUDA_ERROR_INVALID_CONTEXT`,
//! `CUDA_ERROR_INVALID_HANDLE`), it does not touch memory. Contexts are passed as borrowed `CudaContext`s and
//! streams as [`LiveStream`]s, so that their liveness is the type's, not a promise.
//!
//! cudarc loads `libcuda` lazily and panics if it is missing, so nothing here may run before
//! [`driver_library_present`] said yes (discovery checks it once; every other path starts from a discovered
//! device).

#![allow(unsafe_code)]

pub(super) mod stream_ids;

use crate::StreamId;
use cudarc::driver::{sys, CudaContext, CudaEvent, DriverError};
use std::ffi::{c_char, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use stream_ids::LiveStream;

/// A failed driver call: which call and the driver's code. The backend turns it into [`crate::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Failure {
    pub call: &'static str,
    pub code: sys::CUresult,
}

impl Failure {
    /// The driver's name and description of the code, e.g. `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
    pub fn message(&self) -> String {
        let err = DriverError(self.code);
        match (err.error_name(), err.error_string()) {
            (Ok(name), Ok(text)) => format!("{} ({})", name.to_string_lossy(), text.to_string_lossy()),
            _ => format!("{:?}", self.code),
        }
    }

    /// Whether the driver refused a shareable allocation or an export as unsupported here (rather than for
    /// memory): the driver, the container or the handle's allocation does not allow sharing.
    pub fn refuses_sharing(&self) -> bool {
        use sys::CUresult::*;
        matches!(self.code, CUDA_ERROR_NOT_SUPPORTED | CUDA_ERROR_NOT_PERMITTED | CUDA_ERROR_INVALID_VALUE)
    }
}

pub(super) type Raw<T> = std::result::Result<T, Failure>;

fn check(code: sys::CUresult, call: &'static str) -> Raw<()> {
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(Failure { call, code }),
    }
}

/// The `CUstream` of a stream checked to be live (0: the null, legacy default, stream).
fn cu_stream(stream: &LiveStream) -> sys::CUstream {
    stream.raw() as usize as sys::CUstream
}

/// The [`StreamId`] of a CUDA stream made outside cudarc (by PyTorch, say), registered so that umm's CUDA pools
/// accept it (see [`stream_ids::stream_id`] for cudarc streams).
///
/// # Safety
/// `raw` is 0 or a live `CUstream` of the context of the pools it is used with, and stays live for as long as
/// umm may queue work or record events on it: until every block allocated on it, or marked as used on it with
/// `record_stream`, has been freed and the pool's pending frees have been processed.
pub unsafe fn foreign_stream(raw: u64) -> StreamId {
    // SAFETY: `vouch`'s contract is this function's.
    unsafe { stream_ids::vouch(raw) }
}

/// Device memory allocated outside umm (by PyTorch, a C library, raw driver calls), vouched for so that a
/// CUDA device can adopt it without taking it over ([`super::CudaDevice::adopt_foreign`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForeignDeviceMemory {
    ptr: u64,
    bytes: u64,
}

impl ForeignDeviceMemory {
    /// Vouches for `bytes` bytes of device memory at `ptr`.
    ///
    /// # Safety
    /// `[ptr, ptr + bytes)` is device memory (or memory the device can address) of the context of the device
    /// that adopts it, readable and writable from it, and stays allocated until the buffer that adopts it has
    /// been dropped and the device's work on it is done. Nothing else frees it meanwhile, and nothing else writes
    /// it while umm lends it as a host slice (it never does for device memory).
    pub unsafe fn new(ptr: u64, bytes: u64) -> Self {
        Self { ptr, bytes }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The length in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Whether the CUDA driver library can be loaded. Loads and unloads it; prints nothing.
pub(super) fn driver_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's list of library names and drops what it opened;
    // loading libcuda runs no code that depends on our state.
    unsafe { sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded (for run-time kernel compilation through cudarc).
pub(super) fn nvrtc_library_present() -> bool {
    // SAFETY: as in `driver_library_present`, for libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The PCI bus id as the driver spells it (`0000:01:00.0` or similar).
pub(super) fn pci_bus_id(device: sys::CUdevice) -> Raw<String> {
    let mut buf = [0 as c_char; 64];
    // SAFETY: the buffer is writable for its whole length, which is passed; `device` came from cuDeviceGet.
    check(unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, device) }, "cuDeviceGetPCIBusId")?;
    let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
    let text = CStr::from_bytes_until_nul(&bytes).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(text)
}

/// The driver's CUDA version, e.g. 12080 for 12.8.
pub(super) fn driver_version() -> Raw<i32> {
    let mut version = 0;
    // SAFETY: `version` is a valid place for one int.
    check(unsafe { sys::cuDriverGetVersion(&mut version) }, "cuDriverGetVersion")?;
    Ok(version)
}

/// Free and total device memory of the current context's device. Safe: without a bound context the driver
/// returns an error.
pub(super) fn mem_info() -> Raw<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both are valid places for one size_t; the caller bound the context.
    check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
    Ok((free as u64, total as u64))
}

// ----- plain device memory -----

/// `cuMemAlloc`: `size` bytes of device memory in the current context. Safe: without a bound context the driver
/// returns an error.
pub(super) fn mem_alloc(size: u64) -> Raw<u64> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid out-parameter; the caller bound the context.
    check(unsafe { sys::cuMemAlloc_v2(&mut ptr, size as usize) }, "cuMemAlloc")?;
    Ok(ptr)
}

/// `cuMemFree` of a pointer from [`mem_alloc`].
///
/// # Safety
/// - `ptr` was returned by [`mem_alloc`] and is not freed yet (freeing it twice could free another allocation
///   that got the same address meanwhile);
/// - no work queued before this call still uses the memory (the caller synchronized the context), and nothing
///   uses `ptr` afterwards.
pub(super) unsafe fn mem_free(ptr: u64) -> Raw<()> {
    // SAFETY: this function's contract: `ptr` is a live allocation from `cuMemAlloc`, freed once, no longer used.
    check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree")
}

// ----- pinned host memory -----

/// `cuMemHostAlloc(PORTABLE | DEVICEMAP)`: page-locked host memory usable from every context, mapped into the
/// device's address space. Returns (host address, device address); with unified addressing they are equal.
pub(super) fn host_alloc(size: u64) -> Raw<(usize, u64)> {
    let mut host: *mut c_void = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: `host` is a valid out-parameter; the caller bound the context.
    check(unsafe { sys::cuMemHostAlloc(&mut host, size as usize, flags) }, "cuMemHostAlloc")?;
    let mut device = 0;
    // SAFETY: `host` was just returned by cuMemHostAlloc with DEVICEMAP; flags must be 0.
    let code = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
    if let Err(e) = check(code, "cuMemHostGetDevicePointer") {
        // SAFETY: `host` came from cuMemHostAlloc above and nothing else holds it.
        let _ = unsafe { sys::cuMemFreeHost(host) };
        return Err(e);
    }
    Ok((host as usize, device))
}

/// `cuMemFreeHost` of an address from [`host_alloc`].
///
/// # Safety
/// - `host` was returned by [`host_alloc`] and is not freed yet;
/// - no work queued before this call still uses the memory (the caller synchronized the context), and nothing
///   reads or writes it afterwards (no slice or `HostPtr` of it is used again).
pub(super) unsafe fn host_free(host: usize) -> Raw<()> {
    // SAFETY: this function's contract: `host` is a live allocation from `cuMemHostAlloc`, freed once, no longer
    // used.
    check(unsafe { sys::cuMemFreeHost(host as *mut c_void) }, "cuMemFreeHost")
}

/// Copies `src` into host memory at `addr`.
///
/// # Safety
/// `[addr, addr + src.len())` lies inside one live pinned allocation ([`host_alloc`]), and no other reference to
/// those bytes is in use during the call.
pub(super) unsafe fn host_copy_in(addr: usize, src: &[u8]) {
    // SAFETY: the destination is valid for writes and unaliased (this function's contract); `src` is a separate
    // Rust slice, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) }
}

/// Copies host memory at `addr` into `dst`.
///
/// # Safety
/// `[addr, addr + dst.len())` lies inside one live pinned allocation ([`host_alloc`]), and nothing on the host
/// writes those bytes during the call.
pub(super) unsafe fn host_copy_out(addr: usize, dst: &mut [u8]) {
    // SAFETY: the source is valid for reads (this function's contract) and initialised (pinned pages come from
    // the driver); `dst` is exclusively borrowed, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// Sets `len` bytes of host memory at `addr` to `value`.
///
/// # Safety
/// As for [`host_copy_in`], for `[addr, addr + len)`.
pub(super) unsafe fn host_fill(addr: usize, len: usize, value: u8) {
    // SAFETY: the range is valid for writes and unaliased (this function's contract).
    unsafe { std::ptr::write_bytes(addr as *mut u8, value, len) }
}

/// The host address of byte `offset` of the pinned segment whose host address is `host`; `None` for address 0.
///
/// # Safety
/// - `host` is the host address of a live pinned segment ([`host_alloc`]) and `offset` is less than its size;
/// - the segment is freed only when its pool destroys it, and until then the backend touches its bytes only in
///   the copies and fills the pool asks for, as [`crate::HostPtr::new`] requires.
pub(super) unsafe fn pinned_host_ptr(host: usize, offset: usize) -> Option<crate::HostPtr> {
    let ptr = std::ptr::NonNull::new((host + offset) as *mut u8)?;
    // SAFETY: `HostPtr::new`'s contract is this function's; in addition the device writes the pages only through
    // work the user queued (kernels, async copies), which `settle` waits for. The pages come from the driver,
    // written by it or zeroed by the OS, so every byte is initialised.
    Some(unsafe { crate::HostPtr::new(ptr) })
}

/// The `len` bytes of pinned memory at `addr`, borrowed for as long as `owner`.
///
/// # Safety
/// - `addr` is the host address of `owner`'s live pinned block, which holds at least `len` bytes, and `owner`
///   frees it only when dropped;
/// - the caller synchronized the context, so no work queued before still writes the bytes.
pub(super) unsafe fn host_slice<O>(owner: &O, addr: usize, len: usize) -> &[u8] {
    let _ = owner;
    // SAFETY: per this function's contract, `addr` is the host address of `owner`'s live pinned block of at least
    // `len` bytes, and pinned memory is plain initialised bytes. `owner` frees the block only when dropped; the
    // caller synchronized the context, and every write through `owner` (copies, writable views) takes `&mut`, so
    // the bytes do not change while the slice lives. Nothing else can free or write the block: its handle never
    // leaves this crate (`CudaBuffer` shows only `BlockInfo`), handles cannot be forged, are refused by other
    // pools and once freed (generations never wrap), and plain handles get no view or transfer of pinned memory
    // that outlasts the pool's lock. Kernels writing the memory are launched with `unsafe`, the launcher's
    // promise.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The `len` bytes of pinned memory at `addr`, borrowed mutably for as long as `owner`.
///
/// # Safety
/// As for [`host_slice`].
pub(super) unsafe fn host_slice_mut<O>(owner: &mut O, addr: usize, len: usize) -> &mut [u8] {
    let _ = owner;
    // SAFETY: as in `host_slice`, whose contract is this function's; `owner` is borrowed mutably and blocks never overlap, so this is the only
    // slice of these bytes made through the API.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

// ----- virtual memory management -----

fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    allocation_prop_with(ordinal, sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_NONE)
}

fn allocation_prop_with(ordinal: i32, handles: sys::CUmemAllocationHandleType) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType_enum::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handles,
        location: sys::CUmemLocation { type_: sys::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` (minimum) for device memory on `ordinal`.
pub(super) fn vmm_granularity(ordinal: i32) -> Raw<u64> {
    let prop = allocation_prop(ordinal);
    let mut granularity = 0usize;
    let minimum = sys::CUmemAllocationGranularity_flags_enum::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: `prop` is a fully initialised property struct; `granularity` is a valid out-parameter.
    let code = unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, minimum) };
    check(code, "cuMemGetAllocationGranularity")?;
    Ok(granularity as u64)
}

/// `cuMemAddressReserve`: `size` bytes of address space aligned to `alignment`.
pub(super) fn address_reserve(size: u64, alignment: u64) -> Raw<u64> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a valid out-parameter; no fixed address is asked for (0), flags must be 0.
    let code = unsafe { sys::cuMemAddressReserve(&mut ptr, size as usize, alignment as usize, 0, 0) };
    check(code, "cuMemAddressReserve")?;
    Ok(ptr)
}

/// `cuMemAddressFree` of a reservation from [`address_reserve`] with nothing mapped in it.
///
/// # Safety
/// `[ptr, ptr + size)` is exactly one reservation from [`address_reserve`], not freed yet, with every page
/// unmapped ([`mem_unmap`]); nothing uses the addresses afterwards.
pub(super) unsafe fn address_free(ptr: u64, size: u64) -> Raw<()> {
    // SAFETY: this function's contract.
    check(unsafe { sys::cuMemAddressFree(ptr, size as usize) }, "cuMemAddressFree")
}

/// `cuMemCreate`: `size` bytes of physical device memory on `ordinal`. Returns the allocation handle.
/// `exportable`: the allocation can be shared with another process as a POSIX file descriptor
/// ([`export_posix_fd`]); drivers or containers that do not allow it answer `CUDA_ERROR_NOT_SUPPORTED` or
/// `CUDA_ERROR_NOT_PERMITTED` ([`Failure::refuses_sharing`]).
pub(super) fn mem_create(size: u64, ordinal: i32, exportable: bool) -> Raw<u64> {
    let prop = if exportable {
        allocation_prop_with(ordinal, sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    } else {
        allocation_prop(ordinal)
    };
    let mut handle = 0;
    // SAFETY: `prop` is fully initialised; `handle` is a valid out-parameter; flags must be 0.
    check(unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) }, "cuMemCreate")?;
    Ok(handle)
}

/// `cuMemRetainAllocationHandle`: the handle of the physical allocation mapped at `ptr`, with one more
/// reference to it, which the caller gives back with one [`mem_release`]. Safe: the driver checks `ptr` (an
/// address with nothing mapped is an error), and an extra reference never given back leaks memory, it does not
/// free any.
pub(super) fn retain_handle(ptr: u64) -> Raw<u64> {
    let mut handle = 0;
    // SAFETY: `handle` is a valid out-parameter; the address is only looked up.
    let code = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, ptr as *mut c_void) };
    check(code, "cuMemRetainAllocationHandle")?;
    Ok(handle)
}

/// `cuMemRelease` of a reference to a physical allocation: the one [`mem_create`] made, or one more from
/// [`retain_handle`].
///
/// # Safety
/// `handle` holds a reference from [`mem_create`] or [`retain_handle`] that is released once (a release too
/// many could drop another allocation that got the same handle value meanwhile); it is not mapped again through
/// that reference afterwards.
pub(super) unsafe fn mem_release(handle: u64) -> Raw<()> {
    // SAFETY: this function's contract; the memory is freed when its last mapping goes.
    check(unsafe { sys::cuMemRelease(handle) }, "cuMemRelease")
}

/// `cuMemMap`: maps all of `handle` (of `size` bytes) at `ptr`.
///
/// # Safety
/// `[ptr, ptr + size)` lies inside a live reservation of the caller's and is not mapped; `handle` is a live
/// allocation from [`mem_create`] of exactly `size` bytes, or one from [`import_posix_fd`] (whose size the driver
/// checks), not released.
pub(super) unsafe fn mem_map(ptr: u64, size: u64, handle: u64) -> Raw<()> {
    // SAFETY: this function's contract; offset and flags must be 0.
    check(unsafe { sys::cuMemMap(ptr, size as usize, 0, handle, 0) }, "cuMemMap")
}

/// `cuMemUnmap` of one whole mapping made by [`mem_map`].
///
/// # Safety
/// `[ptr, ptr + size)` is exactly one mapping made by [`mem_map`], not unmapped yet; no work queued before this
/// call still uses it (the caller synchronized the context), and nothing uses it afterwards until it is mapped
/// again.
pub(super) unsafe fn mem_unmap(ptr: u64, size: u64) -> Raw<()> {
    // SAFETY: this function's contract.
    check(unsafe { sys::cuMemUnmap(ptr, size as usize) }, "cuMemUnmap")
}

/// `cuMemSetAccess`: read-write access to the mapped range from each device in `ordinals` (the owner first, then
/// the peers that can reach it). Safe: on a range that is not fully mapped the driver returns an error, and
/// granting access changes no memory.
pub(super) fn set_access(ptr: u64, size: u64, ordinals: &[i32]) -> Raw<()> {
    let descs: Vec<sys::CUmemAccessDesc> = ordinals
        .iter()
        .map(|&id| sys::CUmemAccessDesc {
            location: sys::CUmemLocation { type_: sys::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE, id },
            flags: sys::CUmemAccess_flags_enum::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect();
    // SAFETY: `[ptr, ptr + size)` is fully mapped (the backend just mapped it); `descs.len()` descriptors are
    // passed, each naming a device ordinal the driver reported.
    check(unsafe { sys::cuMemSetAccess(ptr, size as usize, descs.as_ptr(), descs.len()) }, "cuMemSetAccess")
}

/// `cuDeviceCanAccessPeer`: whether device `device` can read and write memory of device `peer` directly.
pub(super) fn can_access_peer(device: sys::CUdevice, peer: sys::CUdevice) -> Raw<bool> {
    let mut can = 0;
    // SAFETY: `can` is a valid place for one int; both devices came from cuDeviceGet.
    check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, device, peer) }, "cuDeviceCanAccessPeer")?;
    Ok(can != 0)
}

/// `cuDeviceGet`: the device handle of `ordinal`.
pub(super) fn device(ordinal: i32) -> Raw<sys::CUdevice> {
    let mut device = 0;
    // SAFETY: `device` is a valid place for one CUdevice; the driver checks the ordinal.
    check(unsafe { sys::cuDeviceGet(&mut device, ordinal) }, "cuDeviceGet")?;
    Ok(device)
}

// ----- copies, fills, synchronisation -----

/// Blocking copy of `src` into device memory at `dst`.
///
/// # Safety
/// `[dst, dst + src.len())` lies inside live memory of the bound context (a segment or block checked by the
/// caller) that no host reference reads or writes during the call.
pub(super) unsafe fn copy_htod(dst: u64, src: &[u8]) -> Raw<()> {
    // SAFETY: the destination range is the caller's (this function's contract); `src` is a valid slice for the
    // call's duration (the call returns once it has been read).
    check(unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) }, "cuMemcpyHtoD")
}

/// Blocking copy of device memory at `src` into `dst`.
///
/// # Safety
/// `[src, src + dst.len())` lies inside live memory of the bound context (checked by the caller) that no host
/// reference writes during the call.
pub(super) unsafe fn copy_dtoh(dst: &mut [u8], src: u64) -> Raw<()> {
    // SAFETY: the source range is the caller's (this function's contract); `dst` is exclusively borrowed and the
    // call returns only once the copy has completed.
    check(unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) }, "cuMemcpyDtoH")
}

/// Copy of `len` bytes between two CUDA addresses (device or pinned; unified addressing), ordered on the null
/// stream.
///
/// # Safety
/// `[src, src + len)` and `[dst, dst + len)` lie inside live blocks (device or pinned memory, which unified
/// addressing tells apart), and no host reference reads or writes the destination (nor writes the source) during
/// the call.
pub(super) unsafe fn copy(dst: u64, src: u64, len: u64) -> Raw<()> {
    // SAFETY: both ranges are the caller's (this function's contract).
    check(unsafe { sys::cuMemcpy(dst, src, len as usize) }, "cuMemcpy")
}

/// `cuMemcpyPeer`: copy of `len` bytes from `src` in `src_ctx` to `dst` in `dst_ctx` (two devices), ordered
/// after the legacy default streams of both contexts; returns once the copy is done for most uses (callers
/// synchronize the destination context afterwards anyway).
///
/// # Safety
/// `[src, src + len)` lies inside a live block of `src_ctx` and `[dst, dst + len)` inside a live block of
/// `dst_ctx`; no host reference reads or writes the destination (nor writes the source) during the copy.
pub(super) unsafe fn copy_peer(dst: u64, dst_ctx: &CudaContext, src: u64, src_ctx: &CudaContext, len: u64) -> Raw<()> {
    // SAFETY: both ranges are the caller's (this function's contract); both contexts are borrowed, so live.
    check(unsafe { sys::cuMemcpyPeer(dst, dst_ctx.cu_ctx(), src, src_ctx.cu_ctx(), len as usize) }, "cuMemcpyPeer")
}

/// `cuCtxEnablePeerAccess`: lets the bound context reach `peer`'s memory directly (NVLink or PCIe P2P), so that
/// peer copies skip host staging. Returns whether access is enabled now (`false` where the devices cannot).
/// Safe: `peer` is borrowed, so live; the bound context itself or none is an error from the driver.
pub(super) fn enable_peer_access(peer: &CudaContext) -> Raw<bool> {
    use sys::CUresult::*;
    // SAFETY: `peer` is a live context (borrowed); flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
        CUDA_SUCCESS | CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
        CUDA_ERROR_PEER_ACCESS_UNSUPPORTED | CUDA_ERROR_TOO_MANY_PEERS => Ok(false),
        code => Err(Failure { call: "cuCtxEnablePeerAccess", code }),
    }
}

/// Copy of `len` bytes between two CUDA addresses, queued on `stream`.
///
/// # Safety
/// `[src, src + len)` and `[dst, dst + len)` lie inside live blocks of the bound context (device or pinned
/// memory, never pageable), which stay allocated and are not lent as host slices until `stream` has passed this
/// copy.
pub(super) unsafe fn copy_async(dst: u64, src: u64, len: u64, stream: &LiveStream) -> Raw<()> {
    // SAFETY: both ranges are the caller's until the copy is done (this function's contract); `stream` is a live
    // stream of the bound context or the null stream (a `LiveStream`, checked and kept alive).
    check(unsafe { sys::cuMemcpyAsync(dst, src, len as usize, cu_stream(stream)) }, "cuMemcpyAsync")
}

/// Copy of host bytes into device memory, queued on `stream`; returns once `src` has been staged, so `src` may
/// be dropped afterwards.
///
/// # Safety
/// - `[dst, dst + src.len())` lies inside device memory of the bound context that the caller found live (a
///   checked block), not lent as a host slice until `stream` has passed this copy;
/// - the caller synchronizes `stream` before `src` goes away or changes (the driver may read pinned memory
///   later).
pub(super) unsafe fn copy_htod_async(dst: u64, src: &[u8], stream: &LiveStream) -> Raw<()> {
    // SAFETY: the device range is the caller's and `src` stays valid until the copy is done (this function's
    // contract); `stream` is a live stream of the bound context (a `LiveStream`).
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), cu_stream(stream)) },
        "cuMemcpyHtoDAsync",
    )
}

/// Copy of `len` bytes of page-locked host memory at host address `src` into device memory at `dst`, queued on
/// `stream` (`cuMemcpyHtoDAsync`): a DMA that the device runs while the host goes on.
///
/// # Safety
/// `[src, src + len)` lies inside a live pinned allocation ([`host_alloc`]) and `[dst, dst + len)` inside live
/// device memory of the bound context, and both stay allocated until `stream` has passed this copy.
pub(super) unsafe fn copy_htod_async_pinned(dst: u64, src: usize, len: u64, stream: &LiveStream) -> Raw<()> {
    // SAFETY: both ranges are the caller's until the copy is done (this function's contract). The driver only
    // reads `src`: a host write to it meanwhile changes the bytes copied, never memory the Rust program owns
    // elsewhere. `stream` is a live stream of the bound context (a `LiveStream`).
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len as usize, cu_stream(stream)) },
        "cuMemcpyHtoDAsync",
    )
}

/// Sets `len` bytes of device memory at `dst` to `value` (asynchronous on the null stream).
///
/// # Safety
/// `[dst, dst + len)` lies inside device memory of the bound context that the caller found live (a checked
/// segment or block), and no host reference to it is in use while the fill runs (device memory never is; pinned
/// memory only through an owned block, borrowed for the call).
pub(super) unsafe fn memset(dst: u64, value: u8, len: u64) -> Raw<()> {
    // SAFETY: the range is the caller's (this function's contract).
    check(unsafe { sys::cuMemsetD8_v2(dst, value, len as usize) }, "cuMemsetD8")
}

/// Sets `len` bytes of device memory at `dst` to `value`, queued on `stream`.
///
/// # Safety
/// As for [`memset`], until `stream` has passed this fill.
pub(super) unsafe fn memset_async(dst: u64, value: u8, len: u64, stream: &LiveStream) -> Raw<()> {
    // SAFETY: the range is the caller's (this function's contract); `stream` is a live stream of the bound context
    // or the null stream (a `LiveStream`).
    check(unsafe { sys::cuMemsetD8Async(dst, value, len as usize, cu_stream(stream)) }, "cuMemsetD8Async")
}

/// Waits for all work queued in the bound context. Safe: without a bound context the driver returns an error.
pub(super) fn ctx_synchronize() -> Raw<()> {
    // SAFETY: no pointers involved; the caller bound the context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// Waits for all work queued on `stream`.
pub(super) fn stream_synchronize(stream: &LiveStream) -> Raw<()> {
    // SAFETY: `stream` is a live stream of the bound context or the null stream (a `LiveStream`).
    check(unsafe { sys::cuStreamSynchronize(cu_stream(stream)) }, "cuStreamSynchronize")
}

/// Records `event` at the current end of `stream`. Safe: both are live (borrowed); an event and a stream of
/// different contexts are an error from the driver.
pub(super) fn event_record(event: &CudaEvent, stream: &LiveStream) -> Raw<()> {
    // SAFETY: the event is live (borrowed) and belongs to the bound context, as does `stream` (a `LiveStream`:
    // checked against the registry of live streams and their contexts, and kept alive while borrowed).
    check(unsafe { sys::cuEventRecord(event.cu_event(), cu_stream(stream)) }, "cuEventRecord")
}

/// Makes work queued on `stream` from now on wait for `event` on the device (the host does not wait). Safe: both
/// are live (borrowed); an event of another context is an error from the driver.
pub(super) fn stream_wait_event(stream: &LiveStream, event: &CudaEvent) -> Raw<()> {
    // SAFETY: as in `event_record`: the event is live and of the bound context, the stream a `LiveStream`.
    check(unsafe { sys::cuStreamWaitEvent(cu_stream(stream), event.cu_event(), 0) }, "cuStreamWaitEvent")
}

// ----- the calling thread's current context -----

/// The context current on the calling thread (`None`: none is). `Err` when the driver cannot say.
pub(super) fn current_context() -> Raw<Option<sys::CUcontext>> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid place for one context handle.
    check(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
    Ok((!ctx.is_null()).then_some(ctx))
}

/// Makes `ctx` current on the calling thread again (`None`: unbinds).
///
/// # Safety
/// `ctx` is `None` or a live context: one read with [`current_context`] on this thread at the start of a call
/// into umm and restored at its end (the caller made it current, so it keeps it alive for the whole call; umm
/// never destroys a context it did not create, and keeps every primary context it uses retained).
pub(super) unsafe fn restore_context(ctx: Option<sys::CUcontext>) -> Raw<()> {
    // SAFETY: per this function's contract, `ctx` is a live context (or null, which unbinds).
    check(unsafe { sys::cuCtxSetCurrent(ctx.unwrap_or(std::ptr::null_mut())) }, "cuCtxSetCurrent")
}

/// Sets the calling thread's stream-capture mode (`cuThreadExchangeStreamCaptureMode`) and returns the mode it
/// had. Safe: the mode is a per-thread setting of the driver that only decides which later calls it refuses.
pub(super) fn exchange_capture_mode(mode: sys::CUstreamCaptureMode) -> Raw<sys::CUstreamCaptureMode> {
    let mut mode = mode;
    // SAFETY: `mode` is a live local the driver writes the previous mode into.
    check(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }, "cuThreadExchangeStreamCaptureMode")?;
    Ok(mode)
}

// ----- sharing memory between processes -----

/// `cuIpcGetMemHandle`: the handle another process opens to reach the `cuMemAlloc` allocation whose first byte is
/// at `ptr`. Safe: the driver refuses an address that is not one (memory mapped with `cuMemMap`, say).
pub(super) fn ipc_get_mem_handle(ptr: u64) -> Raw<[u8; 64]> {
    let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: `handle` is a valid out-parameter; the caller bound the context.
    check(unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) }, "cuIpcGetMemHandle")?;
    Ok(handle.reserved.map(|b| b as u8))
}

/// `cuIpcOpenMemHandle`: maps another process's allocation into this one; returns its address here. Safe: the
/// driver checks the handle; the mapping stays until [`ipc_close_mem_handle`].
pub(super) fn ipc_open_mem_handle(handle: &[u8; 64]) -> Raw<u64> {
    let handle = sys::CUipcMemHandle_st { reserved: handle.map(|b| b as std::ffi::c_char) };
    let mut ptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: `ptr` is a valid out-parameter; the caller bound the context.
    check(unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) }, "cuIpcOpenMemHandle")?;
    Ok(ptr)
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor: a new descriptor of the physical allocation
/// `handle`, owned by the caller. Safe: the driver checks the handle (one made without
/// [`mem_create`]'s `exportable` is refused), and the descriptor is a new one the driver opened for this call.
pub(super) fn export_posix_fd(handle: u64) -> Raw<OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    let kind = sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for POSIX descriptors the driver writes one `int` to the out-parameter, which `fd` is.
    let code = unsafe { sys::cuMemExportToShareableHandle((&raw mut fd).cast(), handle, kind, 0) };
    check(code, "cuMemExportToShareableHandle")?;
    // SAFETY: the call succeeded, so `fd` is a descriptor the driver just opened for this process and nothing
    // else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor (from [`export_posix_fd`], in this process or,
/// through [`pidfd_getfd`], another's): the allocation's handle here, with one reference the caller gives back
/// with [`mem_release`]. Safe: the driver checks the descriptor; `fd` is only read.
pub(super) fn import_posix_fd(fd: BorrowedFd<'_>) -> Raw<u64> {
    let mut handle = 0;
    let kind = sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // For POSIX descriptors the driver takes the descriptor's number itself in place of a pointer.
    let os_handle = fd.as_raw_fd() as isize as *mut c_void;
    // SAFETY: `handle` is a valid out-parameter; the descriptor is live for the call (borrowed).
    let code = unsafe { sys::cuMemImportFromShareableHandle(&mut handle, os_handle, kind) };
    check(code, "cuMemImportFromShareableHandle")?;
    Ok(handle)
}

/// `pidfd_open(2)`: a descriptor of process `pid`, through which [`pidfd_getfd`] copies its descriptors.
pub(super) fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: a system call with two integer arguments; it touches no memory of this process.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the call succeeded, so `fd` is a new descriptor owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `pidfd_getfd(2)`: a copy, in this process, of descriptor `fd` of the process `pidfd` names. The kernel allows
/// it where this process may trace that one (same user; under Yama's `ptrace_scope` 1, an ancestor, or a process
/// that allowed it).
pub(super) fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: a system call with integer arguments; it touches no memory of this process.
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the call succeeded, so `copy` is a new descriptor owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(copy as RawFd) })
}

/// `cuIpcCloseMemHandle`: unmaps memory opened with [`ipc_open_mem_handle`].
///
/// # Safety
/// `ptr` came from [`ipc_open_mem_handle`], is closed once, and no work queued before this call still uses it.
pub(super) unsafe fn ipc_close_mem_handle(ptr: u64) -> Raw<()> {
    // SAFETY: this function's contract.
    check(unsafe { sys::cuIpcCloseMemHandle(ptr) }, "cuIpcCloseMemHandle")
}
