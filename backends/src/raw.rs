//! The one place outside the backends' own raw layers where the crate turns a host address into a slice.

#![allow(unsafe_code)]

pub(crate) mod lock;

use crate::OwnedBlock;

/// The `len` bytes at `addr`, borrowed for as long as `owner`.
pub(crate) fn bytes(owner: &OwnedBlock, addr: usize, len: usize) -> &[u8] {
    let _ = owner;
    // SAFETY: `addr` is the host address of `owner`'s block, which the backend reported as host-addressable and
    // which holds at least `len` (the requested size) bytes. The pool never destroys a segment that holds a live
    // block, and the block stays live while `owner` exists, so the memory is valid for the returned lifetime.
    // Every byte of host, pinned and mapped memory is initialised as far as Rust is concerned (plain bytes).
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The `len` bytes at `addr`, borrowed mutably for as long as `owner`.
pub(crate) fn bytes_mut(owner: &mut OwnedBlock, addr: usize, len: usize) -> &mut [u8] {
    let _ = owner;
    // SAFETY: as in `bytes`; in addition `owner` is borrowed mutably, so no other slice of this block made
    // through `OwnedBlock` exists, and no other block overlaps it (the engine never hands out overlapping blocks).
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}
