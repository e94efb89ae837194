//! The one place outside the backends' own raw layers where the crate turns a host address into a slice.

#![allow(unsafe_code)]

use crate::OwnedBlock;
use std::ptr::NonNull;

/// A host address that a [`crate::Backend`] vouches for (see [`crate::Backend::host_ptr`]). Only an `unsafe`
/// promise makes one, because [`OwnedBlock`] lends `&[u8]` and `&mut [u8]` slices of the memory behind it: a
/// backend implemented outside this crate that returned a wrong address would otherwise turn safe code into
/// undefined behaviour:
/// ```compile_fail,E0133
/// let byte = Box::leak(Box::new(0u8));
/// let vouched = umm_backends::HostPtr::new(std::ptr::NonNull::from(byte)); // error[E0133]: requires unsafe
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPtr(NonNull<u8>);

impl HostPtr {
    /// Vouches for `ptr` as the host address of byte `offset` of a segment that the backend created.
    ///
    /// # Safety
    /// Until the backend destroys the segment, `ptr` must be valid for reads and writes of every byte from
    /// `offset` to the segment's end, and those bytes must be initialised. The backend must touch them only when
    /// asked through the segment (`write`, `read`, `fill`; `destroy_segment`, which only a pool can call), and no
    /// device may write them other than through work queued on the backend's streams or queue, which
    /// [`crate::Backend::settle`] waits for.
    pub unsafe fn new(ptr: NonNull<u8>) -> Self {
        Self(ptr)
    }

    /// The address.
    pub fn as_non_null(self) -> NonNull<u8> {
        self.0
    }
}

/// The `len` bytes at `addr`, borrowed for as long as `owner`.
///
/// # Safety
/// - `addr` is the host address of `owner`'s block, vouched for by its backend with a [`HostPtr`];
/// - `len` is at most the block's requested size;
/// - the device work queued on the pool's memory before this call has completed ([`crate::MemoryPool::settle`]).
pub(crate) unsafe fn bytes(owner: &OwnedBlock, addr: usize, len: usize) -> &[u8] {
    let _ = owner;
    // SAFETY: per this function's contract, `addr` is the host address of `owner`'s block, which the backend
    // vouched for with a `HostPtr` (valid and initialised until the segment is destroyed, touched only when asked
    // through the segment) and which holds at least `len` bytes. The pool and the backend are this crate's
    // (`MemoryPool` and `Backend` are sealed): the pool never hands out overlapping blocks nor destroys a segment
    // that holds a live block, and nothing else can destroy one (it takes a `PoolAccess`) or even reach one
    // (`Pool::segment_of` is crate-private). Nothing but `owner` can free the block or copy into it: its handle
    // never leaves this crate; handles cannot be forged (private fields), are refused by other pools (pool id)
    // and once freed (generations, which never wrap: the engine's, and for a block lent from a thread cache the
    // lending slot's, which it checks under its lock before any copy or free); and the crate's own uses of it (interop, device copies)
    // borrow the owner, mutably where they write. Plain handles get no transfer that outlasts the pool's lock on
    // host-visible memory, so none can land here after their block was freed. `owner`'s writes take
    // `&mut self`, and `host_bytes` waited for the device work queued before it (`settle`), so while this shared
    // slice lives the bytes neither go away nor change, except through kernels the caller launched with
    // `unsafe`, which is the caller's promise. Device work queued before has completed (this function's contract).
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The `len` bytes at `addr`, borrowed mutably for as long as `owner`.
///
/// # Safety
/// As for [`bytes`].
pub(crate) unsafe fn bytes_mut(owner: &mut OwnedBlock, addr: usize, len: usize) -> &mut [u8] {
    let _ = owner;
    // SAFETY: as in `bytes` (whose contract is this function's); in addition `owner` is borrowed mutably, so no other slice of this block exists and no
    // read through the owner runs while this one lives, and no other block overlaps it (the engine never hands
    // out overlapping blocks).
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}
