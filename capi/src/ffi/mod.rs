//! The exported C functions (declared in `capi/include/umm.h`) and every `unsafe` of the crate.
//!
//! Each function catches panics (`catch_unwind`), so none crosses the ABI; failures return NULL or -1 and store a
//! message for [`umm_last_error`]. The work itself is in the safe `crate::registry`.
#![allow(unsafe_code)]

pub(crate) mod exit;
mod graphs;
mod share;
mod views;

pub use graphs::*;
pub use share::*;
pub use views::*;

use crate::{error, registry, sleep, snapshot, tag, trace};
use std::ffi::CStr;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use umm_backends::cuda::foreign_stream;

/// `cudaStream_t` / `CUstream`: an opaque handle, NULL for the legacy default stream.
pub type Stream = *mut c_void;

/// Runs `body`; a returned error or a panic stores a message and yields `failed`.
fn guarded<T>(what: &str, failed: T, body: impl FnOnce() -> Result<T, String>) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => value,
        Ok(Err(message)) => {
            error::set(message);
            failed
        }
        Err(panic) => {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            error::set(format!("{what}: internal error (panic caught at the C boundary): {detail}"));
            failed
        }
    }
}

/// Allocates `size` bytes of device memory on CUDA device `device` for use on `stream` (NULL: the legacy
/// default stream). The signature of PyTorch's `CUDAPluggableAllocator` `alloc_fn`.
///
/// Returns NULL with a message for [`umm_last_error`] when `size <= 0`, when umm has no pool for `device`
/// (no driver, no such device), or when memory runs out after cached blocks were released.
///
/// # Safety
/// `stream` is NULL or a live `CUstream` of `device`'s primary context that stays live until the block is freed
/// (the contract of PyTorch's allocator interface).
#[no_mangle]
pub unsafe extern "C" fn umm_alloc(size: isize, device: c_int, stream: Stream) -> *mut c_void {
    guarded("umm_alloc", std::ptr::null_mut(), || {
        // SAFETY: this function's contract is `foreign_stream`'s.
        let stream = unsafe { foreign_stream(stream as usize as u64) };
        registry::alloc(size as i64, i64::from(device), stream).map(|p| p as usize as *mut c_void)
    })
}

/// Frees memory from [`umm_alloc`]. The signature of PyTorch's `CUDAPluggableAllocator` `free_fn`; `size` and
/// `device` are not needed (the address identifies the block). `stream` is the stream of the free: if it is not
/// the allocation's stream, reuse waits for the work queued on it. NULL is ignored; an address umm did not hand
/// out changes nothing and leaves a message for [`umm_last_error`].
///
/// # Safety
/// `stream` is NULL or a live `CUstream` of the block's device that stays live until the work queued on it
/// before this call has completed (umm records an event on it).
#[no_mangle]
pub unsafe extern "C" fn umm_free(ptr: *mut c_void, size: isize, device: c_int, stream: Stream) {
    let _ = size;
    guarded("umm_free", (), || {
        // SAFETY: this function's contract is `foreign_stream`'s.
        let stream = unsafe { foreign_stream(stream as usize as u64) };
        registry::free(ptr as usize as u64, i64::from(device), stream)
    })
}

/// Marks the live allocation at `ptr` as used on `stream` too (PyTorch's `record_stream`): its free then waits
/// for the work queued on `stream` before the memory is reused. Returns 0, or -1 with a message.
///
/// # Safety
/// `stream` is NULL or a live `CUstream` of the block's device that stays live until the block is freed and the
/// work queued on it by then has completed.
#[no_mangle]
pub unsafe extern "C" fn umm_record_stream(ptr: *mut c_void, stream: Stream) -> c_int {
    guarded("umm_record_stream", -1, || {
        // SAFETY: this function's contract is `foreign_stream`'s.
        let stream = unsafe { foreign_stream(stream as usize as u64) };
        registry::record_stream(ptr as usize as u64, stream).map(|()| 0)
    })
}

/// The number of CUDA devices umm sees (0 without a driver or GPU). Discovers devices on first use.
#[no_mangle]
pub extern "C" fn umm_device_count() -> c_int {
    guarded("umm_device_count", -1, || Ok(registry::device_count() as c_int))
}

/// This thread's last error message, or NULL if none was stored since the last [`umm_clear_error`]. The string
/// belongs to umm and stays valid until the next umm call on this thread that fails or clears it.
#[no_mangle]
pub extern "C" fn umm_last_error() -> *const c_char {
    catch_unwind(error::as_ptr).unwrap_or(std::ptr::null())
}

/// Forgets this thread's last error.
#[no_mangle]
pub extern "C" fn umm_clear_error() {
    let _ = catch_unwind(error::clear);
}

/// Statistics of `device`'s pool as a JSON object (`allocated_bytes`, `reserved_bytes`, ... each with `current`
/// and `peak`; counters; `hit_rate`; `fragmentation_ratio`). The caller frees it with [`umm_string_free`].
/// NULL with a message if umm has no pool for `device`.
#[no_mangle]
pub extern "C" fn umm_stats_json(device: c_int) -> *mut c_char {
    json_string("umm_stats_json", || snapshot::stats_json(i64::from(device)))
}

/// The memory of `device` (or every device for -1) as a JSON object in the shape of PyTorch's
/// `torch.cuda.memory._snapshot()`: `segments` (each with `address`, `total_size`, `allocated_size`,
/// `requested_size`, `stream`, `segment_type`, `is_expandable` and its `blocks`, each with `address`, `size`,
/// `requested_size` and `state`) and `device_traces` (one list per device of the events recorded since
/// [`umm_record_history`]). The caller frees it with [`umm_string_free`]. NULL with a message if umm has no pool
/// for `device`.
#[no_mangle]
pub extern "C" fn umm_snapshot_json(device: c_int) -> *mut c_char {
    json_string("umm_snapshot_json", || snapshot::snapshot_json(i64::from(device)))
}

/// A JSON text from `make` as a C string the caller frees with [`umm_string_free`]; NULL with a message on failure.
fn json_string(what: &str, make: impl FnOnce() -> Result<String, String>) -> *mut c_char {
    guarded(what, std::ptr::null_mut(), || {
        let c = CString::new(make()?).map_err(|e| format!("{what}: {e}"))?;
        Ok(c.into_raw())
    })
}

/// Starts recording the last `max_entries` allocation events of every device (alloc, free_requested,
/// free_completed, segment_alloc/segment_free or segment_map/segment_unmap as reserved memory changes, oom), as
/// PyTorch's `torch.cuda.memory._record_memory_history(max_entries=...)` does; what was recorded before is
/// dropped. 0 stops recording and keeps the events for the next [`umm_snapshot_json`]. Returns 0, or -1 with a
/// message (a negative count, or one above 2^26).
#[no_mangle]
pub extern "C" fn umm_record_history(max_entries: i64) -> c_int {
    guarded("umm_record_history", -1, || registry::record_history(max_entries).map(|()| 0))
}

/// Frees a string returned by umm ([`umm_stats_json`], [`umm_snapshot_json`]). NULL is ignored.
///
/// # Safety
/// `s` is NULL or a pointer returned by [`umm_stats_json`] or [`umm_snapshot_json`] that was not freed yet.
#[no_mangle]
pub unsafe extern "C" fn umm_string_free(s: *mut c_char) {
    if s.is_null() {
        return;
    }
    // SAFETY: the caller passes a pointer from `CString::into_raw` in `umm_stats_json`, freed once.
    drop(unsafe { CString::from_raw(s) });
}

/// Gives the cached (allocated-from-the-driver but unused) memory of `device`, or of every device for -1, back
/// to the driver. Returns the bytes released, or -1 with a message.
#[no_mangle]
pub extern "C" fn umm_empty_cache(device: c_int) -> i64 {
    guarded("umm_empty_cache", -1, || registry::empty_cache(i64::from(device)).map(|b| b as i64))
}

/// Caps the bytes umm reserves on `device` (or every device for -1) at `bytes`; 0 removes the cap. Cached
/// memory above the cap is released now; an allocation that cannot fit under it returns NULL. Returns 0, or -1
/// with a message.
#[no_mangle]
pub extern "C" fn umm_set_limit(device: c_int, bytes: u64) -> c_int {
    guarded("umm_set_limit", -1, || registry::set_limit(i64::from(device), bytes).map(|()| 0))
}

/// Resets the peak statistics of `device` (or every device for -1) to the current values. Returns 0, or -1
/// with a message.
#[no_mangle]
pub extern "C" fn umm_reset_peaks(device: c_int) -> c_int {
    guarded("umm_reset_peaks", -1, || registry::reset_peaks(i64::from(device)).map(|()| 0))
}

/// Marks the end of a training or inference step on `device` (or every device for -1), and the start of the
/// next. Call it once per step, at the same point of every step: once two steps in a row make the same
/// allocations and frees, the allocations that live within a step are served at planned offsets of one segment
/// of the step's peak size, and a step that does something else is served by the pool as before
/// (`UMM_PLAN_STEPS=off` only counts steps). Returns 0, or -1 with a message.
#[no_mangle]
pub extern "C" fn umm_mark_step(device: c_int) -> c_int {
    guarded("umm_mark_step", -1, || registry::mark_step(i64::from(device)).map(|()| 0))
}

/// Writes the allocations and frees recorded for `UMM_TRACE` so far to the trace file, which then holds a
/// complete trace up to this call (a gzip file one more complete member). umm also writes them out every 16,384
/// lines, in [`umm_empty_cache`] and when the process exits through `exit` (an `atexit` handler, which a normal
/// end of a C or Python program runs); call this before `_exit`/`os._exit`, or to read the trace while the program
/// runs. Returns 0, also without `UMM_TRACE` or before umm has started (its first allocation or query); -1 with a
/// message when the file of `UMM_TRACE` could not be created or a write to it failed.
#[no_mangle]
pub extern "C" fn umm_trace_flush() -> c_int {
    guarded("umm_trace_flush", -1, || trace::flush().map(|()| 0).map_err(|e| format!("umm_trace_flush: {e}")))
}

/// A C string argument as text: `None` for NULL; an error naming `what` for one that is not UTF-8.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string that stays valid during the call.
unsafe fn text_arg<'a>(what: &str, text: *const c_char) -> Result<Option<&'a str>, String> {
    if text.is_null() {
        return Ok(None);
    }
    // SAFETY: this function's contract: a valid NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) };
    text.to_str().map(Some).map_err(|e| format!("{what}: not UTF-8: {e}"))
}

/// Sets the calling thread's tag: its allocations from now on go to the pool of that tag on their device, which
/// [`umm_sleep`] puts to sleep and [`umm_wake`] wakes as a whole (`"weights"`, `"kv_cache"`). NULL or `""`
/// clears it. A tag has 1 to 128 bytes, without control characters or commas. Returns 0, or -1 with a message
/// (the tag then stays as it was).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn umm_set_tag(tag: *const c_char) -> c_int {
    guarded("umm_set_tag", -1, || {
        // SAFETY: this function's contract is `text_arg`'s.
        let tag = unsafe { text_arg("umm_set_tag", tag) }?;
        tag::set_current(tag).map(|()| 0)
    })
}

/// Puts tags to sleep on every device, keeping every block's address: `offload` (comma-separated tags) are
/// copied to pinned host memory, `discard` ones dropped; then their device pages are unmapped and given back.
/// The device's queued work is waited for first. Until [`umm_wake`] the tags refuse allocations; their blocks
/// must not be used. All or nothing: when a tag's pool cannot sleep (a device without virtual memory
/// management, `UMM_SEGMENT_MODE=plain`), the pools already asleep wake again. Returns a JSON report (`pools`,
/// each with `device`, `tag`, `report`; `bytes_released`, `bytes_offloaded`, `seconds`) to free with
/// [`umm_string_free`], or NULL with a message.
///
/// # Safety
/// `offload` and `discard` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn umm_sleep(offload: *const c_char, discard: *const c_char) -> *mut c_char {
    json_string("umm_sleep", || {
        // SAFETY: this function's contract is `text_arg`'s.
        let (offload, discard) = unsafe { (text_arg("umm_sleep", offload)?, text_arg("umm_sleep", discard)?) };
        let offload = sleep::parse_list("umm_sleep", offload.unwrap_or(""))?;
        let discard = sleep::parse_list("umm_sleep", discard.unwrap_or(""))?;
        sleep::sleep(&offload, &discard)
    })
}

/// Wakes `tags` (comma-separated; NULL or `""`: every sleeping tag) on every device: new pages are mapped at
/// the blocks' old addresses and offloaded bytes copied back, so pointers held by kernels and captured CUDA
/// graphs work again; discarded blocks hold undefined bytes. A tag whose memory the device cannot give stays
/// asleep with its bytes kept. Returns a JSON report (`pools`; `bytes_mapped`, `bytes_restored`, `seconds`) to
/// free with [`umm_string_free`], or NULL with a message.
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn umm_wake(tags: *const c_char) -> *mut c_char {
    json_string("umm_wake", || {
        // SAFETY: this function's contract is `text_arg`'s.
        let list = unsafe { text_arg("umm_wake", tags) }?;
        sleep::wake(&sleep::parse_list("umm_wake", list.unwrap_or(""))?)
    })
}

/// The sleeping tags as a JSON object, tag → `"offload"` or `"discard"`, to free with [`umm_string_free`].
#[no_mangle]
pub extern "C" fn umm_sleeping_json() -> *mut c_char {
    json_string("umm_sleeping_json", || Ok(sleep::sleeping_json()))
}
