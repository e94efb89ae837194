//! What the C ABI's tests over simulated devices share: the environment set once before the first call into the
//! library, one test at a time, and the calls wrapped with their safety arguments (allocations on a stream
//! number, JSON strings read and freed, the thread's last error).

#![allow(dead_code)] // Each test binary uses its own part.

use serde_json::Value;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Mutex, MutexGuard, Once};
use umm_capi::*;

pub const MIB: isize = 1 << 20;

/// Two simulated devices of 4 GiB (`UMM_CAPI_SIM`), set before any test of the binary calls into the library
/// (it reads its environment once, at the first call), and a guard that runs the binary's tests one at a time.
pub fn simulated() -> MutexGuard<'static, ()> {
    static INIT: Once = Once::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    INIT.call_once(|| {
        std::env::set_var("UMM_CAPI_SIM", "2x4GiB");
        std::env::remove_var("UMM_TRACE");
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stream number `id` as the C ABI takes it (0 is the default stream).
pub fn stream(id: usize) -> *mut c_void {
    id as *mut c_void
}

pub fn alloc(size: isize, device: c_int, on: usize) -> *mut c_void {
    // SAFETY: a simulated device queues no work: any stream value is fine.
    unsafe { umm_alloc(size, device, stream(on)) }
}

pub fn free(p: *mut c_void, device: c_int, on: usize) {
    // SAFETY: as in `alloc`.
    unsafe { umm_free(p, 0, device, stream(on)) }
}

pub fn last_error() -> String {
    let p: *const c_char = umm_last_error();
    assert!(!p.is_null(), "a message was left");
    // SAFETY: NULL was ruled out; the string stays valid until the next failing umm call on this thread.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A JSON string from umm, freed; the thread's last error for NULL.
pub fn json(p: *mut c_char) -> Result<Value, String> {
    if p.is_null() {
        return Err(last_error());
    }
    // SAFETY: a string from umm, read once and freed once.
    let value = serde_json::from_str(&unsafe { CStr::from_ptr(p) }.to_string_lossy()).expect("JSON");
    // SAFETY: as above.
    unsafe { umm_string_free(p) };
    Ok(value)
}

pub fn stats(device: c_int) -> Value {
    json(umm_stats_json(device)).unwrap()
}
