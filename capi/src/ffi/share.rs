//! Blocks shared with other processes (declared in `capi/include/umm.h`): a live block's handle as bytes, and
//! a handle of another process's block mapped here and unmapped.

use super::guarded;
use crate::share;
use std::ffi::{c_int, c_void};

/// Writes the handle of the live block at `ptr` (any process may open it with `umm_ipc_open`) into `buf`: its
/// length goes to `*len`, and the bytes too when `capacity` holds them. Returns 0, 1 when `capacity` is too
/// small (`*len` then says how much is needed; nothing else changes), or -1 with a message (an address umm did
/// not hand out, a simulated device, pinned memory). The handle is `c` and the driver's IPC handle of a plain
/// segment, or `e` and the file descriptors of the pages of a virtual reservation, which stay open until the
/// block is freed (the format: `IpcHandle::to_bytes` of `umm_backends::cuda`).
///
/// # Safety
/// `buf` is writable for `capacity` bytes (or NULL with `capacity` 0); `len` is writable for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn umm_ipc_handle(ptr: *mut c_void, buf: *mut u8, capacity: usize, len: *mut usize) -> c_int {
    guarded("umm_ipc_handle", -1, || {
        let bytes = share::handle_bytes(ptr as usize as u64)?;
        // SAFETY: the caller's contract.
        let out = unsafe { len.as_mut() }.ok_or("umm_ipc_handle: len is NULL")?;
        *out = bytes.len();
        if bytes.len() > capacity || buf.is_null() {
            return Ok(1);
        }
        // SAFETY: the caller's contract: `buf` holds `capacity` bytes, at least `bytes.len()`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
        Ok(0)
    })
}

/// Maps the block another process shared (`len` bytes of its handle from `umm_ipc_handle`) on `device`, which
/// must be the device it lies on; returns its address here, or NULL with a message. The pages of a virtual
/// reservation are copied out of the sharing process (`pidfd_getfd`: this process must be allowed to trace
/// that one), mapped once, side by side.
///
/// # Safety
/// `bytes` is readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn umm_ipc_open(device: c_int, bytes: *const u8, len: usize) -> *mut c_void {
    guarded("umm_ipc_open", std::ptr::null_mut(), || {
        if bytes.is_null() {
            return Err("umm_ipc_open: the handle is NULL".into());
        }
        // SAFETY: the caller's contract.
        let handle = unsafe { std::slice::from_raw_parts(bytes, len) };
        share::open(i64::from(device), handle).map(|ptr| ptr as usize as *mut c_void)
    })
}

/// Unmaps a block `umm_ipc_open` mapped, after the work queued on it. Returns 0, or -1 with a message.
#[no_mangle]
pub extern "C" fn umm_ipc_close(ptr: *mut c_void) -> c_int {
    guarded("umm_ipc_close", -1, || share::close(ptr as usize as u64).map(|()| 0))
}
