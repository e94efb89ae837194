//! The C functions of private pools and captures (declared in `capi/include/umm.h`), and `umm_delete`.

use super::{guarded, Stream};
use crate::graph_pool;
pub use crate::graph_pool::PoolId;
use crate::registry;
pub use crate::sim_streams::SimStreamOp;
use std::ffi::{c_int, c_void};
use umm_backends::cuda::foreign_stream;

/// Allocates `size` bytes on `device` for `stream` from private pool `pool`, which must be retained
/// ([`umm_pool_retain`]). A block freed later goes back to that pool only. NULL with a message otherwise, as
/// [`super::umm_alloc`].
///
/// # Safety
/// As [`super::umm_alloc`].
#[no_mangle]
pub unsafe extern "C" fn umm_alloc_to_pool(size: isize, device: c_int, stream: Stream, pool: PoolId) -> *mut c_void {
    guarded("umm_alloc_to_pool", std::ptr::null_mut(), || {
        // SAFETY: this function's contract is `foreign_stream`'s.
        let stream = unsafe { foreign_stream(stream as usize as u64) };
        registry::alloc_to(size as i64, i64::from(device), stream, Some(pool)).map(|p| p as usize as *mut c_void)
    })
}

/// Frees memory from [`super::umm_alloc`] or [`umm_alloc_to_pool`] on the stream it was allocated on (PyTorch's
/// `raw_delete`). NULL is ignored; an address umm did not hand out changes nothing and leaves a message.
#[no_mangle]
pub extern "C" fn umm_delete(ptr: *mut c_void) {
    guarded("umm_delete", (), || registry::delete(ptr as usize as u64))
}

/// Retains private pool `pool` of `device`, making it on first use (PyTorch's `createOrIncrefPool`). Returns the
/// use count after the retain, or -1 with a message.
#[no_mangle]
pub extern "C" fn umm_pool_retain(device: c_int, pool: PoolId) -> c_int {
    guarded("umm_pool_retain", -1, || graph_pool::retain(i64::from(device), pool).map(|n| n as c_int))
}

/// Releases private pool `pool` of `device` once (PyTorch's `releasePool`); at no use left its memory goes back
/// to the device once its last block is freed. Returns the use count after the release, or -1 with a message.
#[no_mangle]
pub extern "C" fn umm_pool_release(device: c_int, pool: PoolId) -> c_int {
    guarded("umm_pool_release", -1, || graph_pool::release(i64::from(device), pool).map(|n| n as c_int))
}

/// The use count of private pool `pool` of `device` (0: none), or -1 with a message.
#[no_mangle]
pub extern "C" fn umm_pool_use_count(device: c_int, pool: PoolId) -> c_int {
    guarded("umm_pool_use_count", -1, || graph_pool::use_count(i64::from(device), pool).map(|n| n as c_int))
}

/// A stream capture (a CUDA graph being recorded) began on `device`: until the matching [`umm_capture_end`],
/// every pool of the device makes only calls the driver allows during a capture. Captures nest. 0, or -1 with a
/// message.
#[no_mangle]
pub extern "C" fn umm_capture_begin(device: c_int) -> c_int {
    guarded("umm_capture_begin", -1, || graph_pool::capture_begin(i64::from(device)).map(|()| 0))
}

/// A capture begun with [`umm_capture_begin`] ended. 0, or -1 with a message (also without a capture underway).
#[no_mangle]
pub extern "C" fn umm_capture_end(device: c_int) -> c_int {
    guarded("umm_capture_end", -1, || graph_pool::capture_end(i64::from(device)).map(|()| 0))
}

/// Simulated devices only (`UMM_CAPI_SIM`): `stream` captures from now on (`capturing` = 1) or no longer (0), as
/// the CUDA driver would know it; the device then counts every call a driver refuses during a capture
/// (`capture_violations` in [`super::umm_stats_json`]). 0, or -1 with a message on a real device.
///
/// # Safety
/// As [`super::umm_alloc`] for `stream`.
#[no_mangle]
pub unsafe extern "C" fn umm_sim_capture(device: c_int, stream: Stream, capturing: c_int) -> c_int {
    guarded("umm_sim_capture", -1, || {
        // SAFETY: this function's contract is `foreign_stream`'s.
        let stream = unsafe { foreign_stream(stream as usize as u64) };
        graph_pool::simulate_capture(i64::from(device), stream, capturing != 0).map(|()| 0)
    })
}

/// Simulated devices (`UMM_CAPI_SIM`) only: drives or asks the device's streams, for tests that check
/// stream-ordered reuse through the C ABI. `op` is a [`SimStreamOp`] (`umm.h`'s `umm_sim_op`): queue an item of work on
/// `stream` (answers its number, from 1), hold its work back, run it up to item `arg`, run all of it, answer the
/// items run, answer the last item of stream `arg` that `stream`'s later work is ordered after, or answer a
/// number for the byte at address `arg` (equal numbers: the same byte of device memory). -1 with a message on a
/// real device or for an unknown `op`.
///
/// # Safety
/// As [`super::umm_alloc`] for `stream`.
#[no_mangle]
pub unsafe extern "C" fn umm_sim_stream(device: c_int, stream: Stream, op: c_int, arg: u64) -> i64 {
    guarded("umm_sim_stream", -1, || {
        // SAFETY: this function's contract is `foreign_stream`'s.
        let stream = unsafe { foreign_stream(stream as usize as u64) };
        crate::sim_streams::sim_stream(i64::from(device), stream, op, arg).map(|n| n as i64)
    })
}

/// Writes the addresses of the live blocks of private pool `pool` on `device` to `out` (at most `capacity` of
/// them, in no order) and returns how many it has: more than `capacity` means the list was cut short. -1 with a
/// message for an unknown device.
///
/// # Safety
/// `out` is NULL (with `capacity` 0) or writable for `capacity` addresses.
#[no_mangle]
pub unsafe extern "C" fn umm_pool_live(device: c_int, pool: PoolId, out: *mut *mut c_void, capacity: usize) -> isize {
    guarded("umm_pool_live", -1, || {
        let live = graph_pool::live_blocks(i64::from(device), pool)?;
        if capacity > 0 {
            if out.is_null() {
                return Err("umm_pool_live: out is NULL".into());
            }
            // SAFETY: the caller's contract: writable for `capacity` addresses.
            let slots = unsafe { std::slice::from_raw_parts_mut(out, capacity) };
            for (slot, &p) in slots.iter_mut().zip(&live) {
                *slot = p as usize as *mut c_void;
            }
        }
        Ok(live.len() as isize)
    })
}
