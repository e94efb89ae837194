//! The one place outside the backends' own raw layers where the crate turns a host address into a slice.

#![allow(unsafe_code)]

pub(crate) mod lock;

use crate::OwnedBlock;

/// The `len` bytes at `addr`, borrowed for as long as `owner`.
pub(crate) fn bytes(owner: &OwnedBlock, addr: usize, len: usize) -> &[u8] {
    let _ = owner;
    // SAFETY: `addr` is the host address of `owner`'s block, which the backend reported as host-addressable and
    // which holds at least `len` (the requested size) bytes. The pool never destroys a segment that holds a live
    // block; `owner` frees the block only when dropped, and its own writes take `&mut self`, so while the slice
    // lives the bytes neither go away nor change through `owner`. Copies through the pool's handle API run under
    // the pool's lock on host-addressable memory, so none lands after a free. Not yet excluded: a caller that
    // passes `owner.handle()` to the pool's own `free`, `write` or `fill` while the slice lives (CHANGELOG,
    // Known issues). Every byte of host, pinned and mapped memory is initialised as far as Rust is concerned.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The `len` bytes at `addr`, borrowed mutably for as long as `owner`.
pub(crate) fn bytes_mut(owner: &mut OwnedBlock, addr: usize, len: usize) -> &mut [u8] {
    let _ = owner;
    // SAFETY: as in `bytes` (with the same gap); in addition `owner` is borrowed mutably, so no other slice of this
    // block made through `OwnedBlock` exists, and no other block overlaps it (the engine never hands out
    // overlapping blocks).
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}
