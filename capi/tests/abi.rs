//! The C ABI's answers to bad input, called as C would call it. On a machine without CUDA (CI) every device is
//! missing; on a GPU machine the same checks use a device ordinal that does not exist.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;
use umm_backends::skip_or_fail;
use umm_capi::*;

/// `umm_alloc` on the null stream, which is always live: the entry points' only unsafe argument is the stream.
fn alloc(size: isize, device: c_int) -> *mut c_void {
    // SAFETY: a NULL stream is the legacy default stream, valid for any device.
    unsafe { umm_alloc(size, device, ptr::null_mut()) }
}

/// `umm_free` on the null stream (see [`alloc`]).
fn free(p: *mut c_void, size: isize, device: c_int) {
    // SAFETY: as in `alloc`.
    unsafe { umm_free(p, size, device, ptr::null_mut()) }
}

/// `umm_record_stream` on the null stream (see [`alloc`]).
fn record_stream(p: *mut c_void) -> c_int {
    // SAFETY: as in `alloc`.
    unsafe { umm_record_stream(p, ptr::null_mut()) }
}

fn last_error() -> Option<String> {
    let p: *const c_char = umm_last_error();
    // SAFETY: umm_last_error returns NULL or a NUL-terminated string that stays valid until the next umm call on
    // this thread; it is copied at once.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn cuda_present() -> bool {
    umm_device_count() > 0
}

#[test]
fn alloc_without_a_pool_returns_null_with_a_message() {
    umm_clear_error();
    let device = if cuda_present() { 4096 } else { 0 };
    let p = alloc(1 << 20, device);
    assert!(p.is_null());
    let msg = last_error().expect("a message");
    assert!(msg.contains(&format!("no CUDA pool for device {device}")), "{msg}");
    if !cuda_present() {
        assert!(msg.contains("no CUDA device was found"), "{msg}");
    }
    assert_eq!(last_error_message().as_deref(), Some(msg.as_str()));
}

#[test]
fn negative_device_is_an_error() {
    umm_clear_error();
    assert!(alloc(256, -1).is_null());
    assert!(last_error().expect("a message").contains("device -1"));
}

#[test]
fn size_zero_and_negative_return_null_with_a_message() {
    for size in [0isize, -1, isize::MIN] {
        umm_clear_error();
        assert!(alloc(size, 0).is_null());
        let msg = last_error().expect("a message");
        assert!(msg.contains(&format!("size {size}")) && msg.contains("above zero"), "{msg}");
    }
}

#[test]
fn free_of_an_unknown_pointer_is_a_no_op_with_a_message() {
    umm_clear_error();
    let bogus = 0xdead_b000usize as *mut std::ffi::c_void;
    free(bogus, 4096, 0);
    let msg = last_error().expect("a message");
    assert!(msg.contains("0xdeadb000") && msg.contains("not allocated by umm"), "{msg}");
    // Twice: still a no-op, no crash.
    free(bogus, 4096, 0);
    assert_eq!(record_stream(bogus), -1);
}

#[test]
fn free_of_null_does_nothing() {
    umm_clear_error();
    free(ptr::null_mut(), 0, 0);
    assert_eq!(last_error(), None);
}

#[test]
fn stats_of_a_missing_device_is_null_with_a_message() {
    umm_clear_error();
    let device = if cuda_present() { 4096 } else { 0 };
    let s = umm_stats_json(device);
    assert!(s.is_null());
    assert!(last_error().expect("a message").contains("no CUDA pool"));
    // SAFETY: NULL is accepted.
    unsafe { umm_string_free(ptr::null_mut()) };
}

#[test]
fn cache_limit_and_peaks_of_a_missing_device_fail_cleanly() {
    let device = if cuda_present() { 4096 } else { 0 };
    umm_clear_error();
    assert_eq!(umm_empty_cache(device), -1);
    assert!(last_error().is_some());
    assert_eq!(umm_set_limit(device, 1 << 30), -1);
    assert_eq!(umm_reset_peaks(device), -1);
    // "Every device" with no devices is nothing to do, not an error.
    if !cuda_present() {
        assert_eq!(umm_empty_cache(-1), 0);
        assert_eq!(umm_set_limit(-1, 0), 0);
        assert_eq!(umm_reset_peaks(-1), 0);
    }
}

#[test]
fn errors_are_per_thread() {
    umm_clear_error();
    std::thread::spawn(|| {
        assert!(alloc(0, 0).is_null());
        assert!(last_error().is_some());
    })
    .join()
    .unwrap();
    assert_eq!(last_error(), None);
}

/// On a GPU machine: allocate, write nothing, free, reuse, stats JSON, limits.
#[test]
fn round_trip_on_a_gpu_when_present() {
    if !cuda_present() {
        // The failed allocation's message says why there is no device (no driver, no GPU).
        alloc(1, 0);
        let why = last_error().unwrap_or_default();
        return skip_or_fail("cuda", &format!("the CUDA round trip needs a device: {why}"));
    }
    let a = alloc(1000, 0);
    assert!(!a.is_null() && (a as usize).is_multiple_of(256));
    free(a, 1000, 0);
    let b = alloc(1000, 0);
    assert_eq!(a, b, "a block freed on a stream is reused at once on it");
    let s = umm_stats_json(0);
    assert!(!s.is_null());
    // SAFETY: a NUL-terminated string from umm_stats_json, freed once below.
    let json = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    // SAFETY: `s` came from umm_stats_json and is freed once, here; `json` is an owned copy.
    unsafe { umm_string_free(s) };
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["reserved_bytes"]["peak"].as_u64().unwrap() >= 1024);
    assert_eq!(v["live_pointers"].as_u64(), Some(1));
    free(b, 1000, 0);
    assert!(umm_empty_cache(0) >= 0);
}
