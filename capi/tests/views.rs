//! Statistics, snapshots and recorded events as C structures (`umm_stats`, `umm_snapshot_visit`), and
//! `umm_base_allocation`, over simulated devices: the same figures as the JSON functions, which PyTorch's
//! `memory_stats()` and `_snapshot()` read through the `umm_torch` adapter.

use std::ffi::c_void;
use umm_capi::*;

mod common;

use common::{alloc, free, last_error, stats, MIB};

#[derive(Default)]
struct Seen {
    segments: Vec<(u64, u64, u64, usize)>,
    allocated_blocks: u64,
    traces: Vec<UmmTraceEntry>,
}

unsafe extern "C" fn on_segment(ctx: *mut c_void, s: *const UmmSegmentInfo) {
    // SAFETY: `ctx` is the `Seen` the test passed; `s` and its blocks live across the call.
    let (seen, s) = unsafe { (&mut *(ctx as *mut Seen), &*s) };
    // SAFETY: as above: `num_blocks` blocks at `blocks`.
    let blocks = unsafe { std::slice::from_raw_parts(s.blocks, s.num_blocks) };
    seen.allocated_blocks += blocks.iter().filter(|b| b.allocated == 1).map(|b| b.size).sum::<u64>();
    seen.segments.push((s.address, s.total_size, s.allocated_size, s.num_blocks));
}

unsafe extern "C" fn on_trace(ctx: *mut c_void, e: *const UmmTraceEntry) {
    // SAFETY: as in `on_segment`.
    unsafe { (*(ctx as *mut Seen)).traces.push(*e) };
}

#[test]
fn the_structures_hold_what_the_json_says() {
    let _g = common::simulated();
    assert_eq!(umm_record_history(1000), 0);
    let small = alloc(MIB / 2, 0, 0);
    let large = alloc(64 * MIB, 0, 0);
    let mut s = UmmStats::default();
    // SAFETY: `s` is writable.
    assert_eq!(unsafe { umm_stats(0, &mut s) }, 0);
    let json = stats(0);
    assert_eq!(s.allocated_bytes.current, json["allocated_bytes"]["current"].as_u64().unwrap());
    assert_eq!(s.reserved_bytes.peak, json["reserved_bytes"]["peak"].as_u64().unwrap());
    assert_eq!(s.num_allocs, json["num_allocs"].as_u64().unwrap());
    assert_eq!(s.device_total_bytes, 4 << 30);
    // SAFETY: NULL is refused, not written.
    assert_eq!(unsafe { umm_stats(0, std::ptr::null_mut()) }, -1);
    // SAFETY: `s` is writable.
    assert_eq!(unsafe { umm_stats(7, &mut s) }, -1, "an unknown device");

    let mut seen = Seen::default();
    // SAFETY: the visitors take `seen` and call nothing of umm.
    let rc = unsafe { umm_snapshot_visit(0, Some(on_segment), Some(on_trace), &mut seen as *mut Seen as *mut c_void) };
    assert_eq!(rc, 0, "{}", last_error());
    let total: u64 = seen.segments.iter().map(|s| s.1).sum();
    assert_eq!(total, s.reserved_bytes.current, "segments add up to reserved memory");
    assert_eq!(seen.allocated_blocks, s.allocated_bytes.current, "allocated blocks add up to allocated memory");
    assert!(seen.traces.iter().any(|e| e.action == 0 && e.addr == large as u64), "the allocation was recorded");

    // A plain segment's base holds the small block; a block of a virtual reservation is its own base.
    let mut size = 0usize;
    // SAFETY: `size` is writable.
    let base = unsafe { umm_base_allocation(small, &mut size) } as u64;
    assert!(base <= small as u64 && small as u64 + MIB as u64 / 2 <= base + size as u64, "{base:#x} {size}");
    // SAFETY: as above.
    assert_eq!(unsafe { umm_base_allocation(large, &mut size) }, large);
    assert!(size as u64 >= 64 * MIB as u64);
    // SAFETY: as above.
    assert!(unsafe { umm_base_allocation(8 as *mut c_void, &mut size) }.is_null());
    assert!(last_error().contains("not a live block"), "{}", last_error());
    free(small, 0, 0);
    free(large, 0, 0);
    assert_eq!(umm_record_history(0), 0);
}

/// `umm_base_allocation`'s figures: a small block's plain segment of 2 MiB, from its first byte, whichever block
/// of it is asked for; a block of a virtual reservation is its own base, with its own size, wherever it lies in
/// the reservation. On a stream of its own, so that both segments are new.
#[test]
fn base_allocations_are_the_plain_segment_or_the_block_itself() {
    let _g = common::simulated();
    const ON: usize = 13;
    let (first, second) = (alloc(MIB / 2, 0, ON), alloc(MIB / 2, 0, ON));
    assert_eq!(second as u64, first as u64 + MIB as u64 / 2, "one after the other in one small segment");
    let (large, after) = (alloc(40 * MIB, 0, ON), alloc(8 * MIB, 0, ON));
    let mut size = 0usize;
    // SAFETY: `size` is writable.
    assert_eq!(unsafe { umm_base_allocation(second, &mut size) }, first);
    assert_eq!(size, 2 << 20);
    // SAFETY: as above.
    assert_eq!(unsafe { umm_base_allocation(after, &mut size) }, after);
    assert_eq!(size, 8 << 20);
    for p in [first, second, large, after] {
        free(p, 0, ON);
    }
}

/// Sharing through the C ABI on simulated devices, whose memory no other process can reach: every call refuses
/// with a message that says why, and a buffer too small is answered with the length needed, not an error.
#[test]
fn sharing_refuses_what_no_other_process_can_reach() {
    let _g = common::simulated();
    let block = alloc(MIB, 0, 0);
    let mut len = 0usize;
    let mut buf = [0u8; 256];
    // SAFETY: `buf` holds 256 bytes; `len` is writable.
    assert_eq!(unsafe { umm_ipc_handle(block, buf.as_mut_ptr(), buf.len(), &mut len) }, -1);
    assert!(last_error().contains("simulated"), "{}", last_error());
    // SAFETY: as above.
    assert_eq!(unsafe { umm_ipc_handle(8 as *mut c_void, buf.as_mut_ptr(), buf.len(), &mut len) }, -1);
    assert!(last_error().contains("not a live block"), "{}", last_error());
    // SAFETY: `buf` holds 81 readable bytes.
    assert!(unsafe { umm_ipc_open(0, buf.as_ptr(), 81) }.is_null());
    assert!(last_error().contains("umm_ipc_open") && last_error().contains("simulated"), "{}", last_error());
    // SAFETY: NULL is refused, not read.
    assert!(unsafe { umm_ipc_open(0, std::ptr::null(), 81) }.is_null());
    assert!(last_error().contains("NULL"), "{}", last_error());
    // SAFETY: as above.
    assert!(unsafe { umm_ipc_open(9, buf.as_ptr(), 81) }.is_null(), "an unknown device");
    assert_eq!(umm_ipc_close(block), -1, "a block of this process was never opened");
    assert!(last_error().contains("umm_ipc_close"), "{}", last_error());
    free(block, 0, 0);
}
