//! Raw host memory calls. Every function whose soundness depends on its caller is an `unsafe fn` whose `# Safety`
//! section lists what the caller (the host backend) must ensure: that an allocation is freed once with its own
//! layout, and that every range lies inside one live segment. The range checks stay in the backend (which turns a
//! bad range into `Error::OutOfBounds`): the raw functions would need the segment's liveness promised anyway, so
//! taking its length too would not make them safe.

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
///
/// # Safety
/// - `allocation` was returned by [`alloc`] called with this `size` and `align`;
/// - it has not been freed yet, and nothing reads or writes it afterwards (no slice or [`HostPtr`] of it is used
///   again).
pub(super) unsafe fn dealloc(allocation: Allocation, size: u64, align: u64) {
    let layout = layout(size, align).expect("layout was valid at allocation");
    // SAFETY: per this function's contract, `base` came from `alloc_zeroed` with this exact layout (`alloc` built
    // it from the same size and alignment) and is freed once.
    unsafe { std::alloc::dealloc(allocation.base as *mut u8, layout) }
}

/// Copies `src` to host address `addr`.
///
/// # Safety
/// `[addr, addr + src.len())` lies inside one live segment (an allocation from [`alloc`] not yet freed, or
/// adopted memory still kept), and no other reference to those bytes is in use during the call.
pub(super) unsafe fn copy_in(addr: usize, src: &[u8]) {
    // SAFETY: the destination range is valid for writes and unaliased (this function's contract); `src` is a
    // separate Rust slice, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) }
}

/// Copies from host address `addr` into `dst`.
///
/// # Safety
/// `[addr, addr + dst.len())` lies inside one live segment, and nothing writes those bytes during the call.
pub(super) unsafe fn copy_out(addr: usize, dst: &mut [u8]) {
    // SAFETY: the source range is valid for reads and initialised (segments are zeroed or adopted `Pod` data) per
    // this function's contract; `dst` is exclusively borrowed, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// Sets `len` bytes at `addr` to `value`.
///
/// # Safety
/// `[addr, addr + len)` lies inside one live segment, and no other reference to those bytes is in use during the
/// call.
pub(super) unsafe fn fill(addr: usize, len: usize, value: u8) {
    // SAFETY: the range is valid for writes and unaliased (this function's contract).
    unsafe { std::ptr::write_bytes(addr as *mut u8, value, len) }
}

/// The host address of byte `offset` of the segment allocated at `addr`.
///
/// # Safety
/// - `addr` is the start of a live segment: an allocation from [`alloc`], or adopted memory (an owned `Vec` of
///   `bytemuck::Pod` elements kept until the segment is destroyed, or a `&'static mut` slice of them handed over
///   for good);
/// - `offset` is less than the segment's size;
/// - the segment is freed only when its pool destroys it, and until then its bytes are touched only through the
///   segment ([`copy_in`], [`copy_out`], [`fill`], when the pool asks), as [`HostPtr::new`] requires.
pub(super) unsafe fn host_ptr(addr: usize, offset: usize) -> HostPtr {
    let ptr = NonNull::new((addr + offset) as *mut u8).expect("a live allocation does not start at address 0");
    // SAFETY: `HostPtr::new`'s contract is this function's: the bytes from `offset` to the segment's end are live
    // and touched only through the segment until the pool destroys it. No device writes host memory. `alloc`
    // zeroes every byte, and adopted elements are `bytemuck::Pod` values (no padding), so all of them are
    // initialised.
    unsafe { HostPtr::new(ptr) }
}
