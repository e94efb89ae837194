//! Raw host memory calls. Callers (the host backend) check every range against its segment first.

#![allow(unsafe_code)]

use crate::backend::HostPtr;
use std::alloc::Layout;
use std::ptr::NonNull;

/// A zeroed host allocation: `addr` (aligned as asked) is where the segment starts, `base` what the allocator
/// returned (freed with the same length).
#[derive(Debug, Clone, Copy)]
pub(super) struct Allocation {
    pub addr: usize,
    pub base: usize,
}

/// The allocator's alignment for segments: one that `alloc_zeroed` serves with `calloc` on every platform, so
/// that large segments get fresh zero pages from the OS untouched (with a larger alignment the standard library
/// allocates and then writes every byte). The segment's own alignment comes from over-allocating.
const CALLOC_ALIGN: usize = 8;

/// Allocates `size` zeroed bytes starting at a multiple of `align` (a power of two); `None` when the sizes
/// overflow or the allocator refuses. Zeroed, because owned blocks lend the bytes as `&[u8]`, which must not
/// cover uninitialised memory.
pub(super) fn alloc(size: u64, align: u64) -> Option<Allocation> {
    let layout = layout(size, align)?;
    // SAFETY: the layout has a non-zero size (`size + align` with `align >= 1`).
    let base = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
    (base != 0).then(|| Allocation { addr: base.next_multiple_of(align as usize), base })
}

/// The allocator layout for a segment of `size` bytes aligned to `align`: room to align the start.
fn layout(size: u64, align: u64) -> Option<Layout> {
    let total = usize::try_from(size).ok()?.checked_add(usize::try_from(align).ok()?)?;
    Layout::from_size_align(total, CALLOC_ALIGN).ok()
}

/// Frees an allocation from [`alloc`] made with the same size and alignment.
pub(super) fn dealloc(allocation: Allocation, size: u64, align: u64) {
    let layout = layout(size, align).expect("layout was valid at allocation");
    // SAFETY: `base` came from `alloc_zeroed` with this exact layout (the backend keeps size and alignment) and is
    // freed once: only a pool destroys segments (`destroy_segment` takes a `PoolAccess`), each exactly once.
    unsafe { std::alloc::dealloc(allocation.base as *mut u8, layout) }
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

/// The host address of byte `offset` of the segment allocated at `addr`.
pub(super) fn host_ptr(addr: usize, offset: usize) -> HostPtr {
    let ptr = NonNull::new((addr + offset) as *mut u8).expect("a live allocation does not start at address 0");
    // SAFETY: `addr` is a live allocation from `alloc`, or adopted memory (an owned `Vec` of plain-old-data
    // elements kept until the segment is destroyed, or a `&'static mut` slice of them handed over for good), and
    // the backend checked `offset` against its size. It is freed only when the pool destroys the segment, and the
    // backend touches its bytes only in `copy_in`, `copy_out` and `fill`, when asked through the segment. No
    // device writes host memory. `alloc` zeroes every byte, and adopted elements are `bytemuck::Pod` values
    // (no padding), so all of them are initialised.
    unsafe { HostPtr::new(ptr) }
}
