//! Raw host memory calls. Callers (the host backend) check every range against its segment first.

#![allow(unsafe_code)]

use std::alloc::Layout;

/// Allocates `size` bytes aligned to `align`; `None` when the layout is invalid or the allocator refuses.
pub(super) fn alloc(size: u64, align: u64) -> Option<usize> {
    let layout = Layout::from_size_align(usize::try_from(size).ok()?, usize::try_from(align).ok()?).ok()?;
    if layout.size() == 0 {
        return None;
    }
    // SAFETY: the layout has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc(layout) };
    (!ptr.is_null()).then_some(ptr as usize)
}

/// Frees memory from [`alloc`] with the same size and alignment.
pub(super) fn dealloc(addr: usize, size: u64, align: u64) {
    let layout = Layout::from_size_align(size as usize, align as usize).expect("layout was valid at allocation");
    // SAFETY: `addr` came from `alloc` with this exact layout (the backend stores both) and is freed once: the pool
    // destroys each segment exactly once.
    unsafe { std::alloc::dealloc(addr as *mut u8, layout) }
}

/// Copies `src` to host address `addr`.
pub(super) fn copy_in(addr: usize, src: &[u8]) {
    // SAFETY: the backend checked that `[addr, addr + src.len())` lies inside one live segment; `src` is a
    // separate Rust slice, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) }
}

/// Copies from host address `addr` into `dst`.
pub(super) fn copy_out(addr: usize, dst: &mut [u8]) {
    // SAFETY: as in `copy_in`, with the roles swapped; `dst` is exclusively borrowed.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// Sets `len` bytes at `addr` to `value`.
pub(super) fn fill(addr: usize, len: usize, value: u8) {
    // SAFETY: the backend checked that `[addr, addr + len)` lies inside one live segment.
    unsafe { std::ptr::write_bytes(addr as *mut u8, value, len) }
}
