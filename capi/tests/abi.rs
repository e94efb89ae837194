//! The C ABI's answers to bad input, called as C would call it. On a machine without CUDA (CI) every device is
//! missing; on a GPU machine the same checks use a device ordinal that does not exist. The eight-thread workload
//! with `umm_record_stream` on real streams runs on a GPU machine and skips elsewhere; its error paths from eight
//! threads run everywhere, and `tests/sim.rs` runs the library's live-pointer paths over simulated devices.
//!
//! On a GPU machine: `UMM_REQUIRE_BACKENDS=cuda cargo test -p umm-capi --test abi`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;
use std::sync::{Arc, Barrier, Mutex};
use umm_backends::testing::skip_or_fail;
use umm_capi::*;

/// Held by the tests that allocate on device 0: its statistics are process-wide, and a test that checks that
/// nothing is left allocated must not see another test's blocks.
static DEVICE_0: Mutex<()> = Mutex::new(());

fn device_0() -> std::sync::MutexGuard<'static, ()> {
    DEVICE_0.lock().unwrap_or_else(|e| e.into_inner())
}

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
    umm_clear_error();
    assert_eq!(umm_mark_step(device), -1);
    assert!(last_error().is_some_and(|e| e.starts_with("umm_mark_step")), "{:?}", last_error());
    // "Every device" with no devices is nothing to do, not an error.
    if !cuda_present() {
        assert_eq!(umm_empty_cache(-1), 0);
        assert_eq!(umm_set_limit(-1, 0), 0);
        assert_eq!(umm_reset_peaks(-1), 0);
        assert_eq!(umm_mark_step(-1), 0);
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
    let _device = device_0();
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

/// On a GPU machine: a step that repeats is served from a plan once steps are marked, each block at its own place.
#[test]
fn marked_steps_are_planned_on_a_gpu_when_present() {
    if !cuda_present() {
        return skip_or_fail("cuda", "planned steps through the C ABI need a device");
    }
    let _device = device_0();
    let before = stats_of_device_0();
    let sizes: [isize; 5] = [3 << 20, 1 << 20, 24 << 20, 512 << 10, 7 << 20];
    assert_eq!(umm_mark_step(0), 0, "{:?}", last_error());
    for _ in 0..5 {
        let live: Vec<*mut c_void> = sizes.iter().map(|&size| alloc(size, 0)).collect();
        assert!(live.iter().all(|p| !p.is_null()), "{:?}", last_error());
        // Blocks live at once never share a byte.
        let mut ranges: Vec<(usize, usize)> =
            live.iter().zip(&sizes).map(|(&p, &n)| (p as usize, n as usize)).collect();
        ranges.sort_unstable();
        assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "{ranges:x?}");
        for (p, size) in live.into_iter().zip(sizes).rev() {
            free(p, size, 0);
        }
        assert_eq!(umm_mark_step(0), 0, "{:?}", last_error());
    }
    let after = stats_of_device_0();
    let grew = |key: &str| after[key].as_u64().unwrap() - before[key].as_u64().unwrap();
    assert!(grew("num_steps_planned") >= 2, "{after}");
    assert!(grew("num_planned_allocs") >= 2 * sizes.len() as u64, "{after}");
    assert!(after["planned_bytes"].as_u64().unwrap() >= (35 << 20) + (512 << 10), "{after}");
}

/// Device 0's statistics as JSON.
fn stats_of_device_0() -> serde_json::Value {
    let s = umm_stats_json(0);
    assert!(!s.is_null(), "{:?}", last_error());
    // SAFETY: a NUL-terminated string from umm_stats_json, copied at once and freed once below.
    let json = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    // SAFETY: `s` came from umm_stats_json and is freed once, here.
    unsafe { umm_string_free(s) };
    serde_json::from_str(&json).unwrap()
}

const THREADS: usize = 8;

#[test]
fn eight_threads_allocate_write_record_streams_and_free_leaving_nothing_allocated() {
    use umm_backends::cuda::{self, cudarc::driver::result};
    if !cuda_present() {
        alloc(1, 0);
        let why = last_error().unwrap_or_default();
        return skip_or_fail("cuda", &format!("the eight-thread C ABI workload needs a device: {why}"));
    }
    let _device = device_0();
    let ctx = cuda::discover().devices.into_iter().next().expect("umm_device_count saw a device").context().clone();
    let before = stats_of_device_0();
    let start = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (ctx, start) = (Arc::clone(&ctx), Arc::clone(&start));
            std::thread::spawn(move || {
                ctx.bind_to_thread().unwrap();
                // Each thread's own streams: the one it allocates on and one that also uses its blocks.
                let (mine, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
                let (s_mine, s_other) = (mine.cu_stream() as Stream, other.cu_stream() as Stream);
                umm_clear_error();
                start.wait();
                let mut live: Vec<(*mut c_void, isize)> = Vec::new();
                for i in 0..400usize {
                    let size = [256isize, 4096, 100_000, 1 << 20, 3 << 20][(t + i) % 5] + (i % 7) as isize;
                    // SAFETY: both streams are live streams of device 0's primary context; they are returned to
                    // the main thread, which drops them only after every block allocated or recorded on them was
                    // freed, the streams synced and the pending frees processed (umm_empty_cache).
                    let p = unsafe { umm_alloc(size, 0, s_mine) };
                    assert!(!p.is_null(), "thread {t}, step {i}: {:?}", last_error());
                    let value = (t * 31 + i) as u8;
                    // SAFETY: `p` is a live block of `size` bytes of device 0, allocated on `mine`.
                    unsafe { result::memset_d8_async(p as u64, value, size as usize, mine.cu_stream()) }.unwrap();
                    if i % 3 == 0 {
                        // SAFETY: as for umm_alloc above.
                        assert_eq!(unsafe { umm_record_stream(p, s_other) }, 0, "{:?}", last_error());
                        // Work on the other stream that reads the block after the memset.
                        mine.synchronize().unwrap();
                        let mut last = [0u8; 1];
                        // SAFETY: the last byte of the live block, read on `other`, which was recorded as a user.
                        unsafe { result::memcpy_dtoh_async(&mut last, p as u64 + size as u64 - 1, other.cu_stream()) }
                            .unwrap();
                        other.synchronize().unwrap();
                        assert_eq!(last[0], value, "thread {t}, step {i}: another thread wrote this thread's block");
                    }
                    live.push((p, size));
                    // Keep a few blocks live; free the oldest, on its own stream or (every fifth) on the other.
                    if live.len() > 4 {
                        let (q, n) = live.remove(0);
                        let stream = if i % 5 == 0 { s_other } else { s_mine };
                        // SAFETY: `q` is live and was allocated here; the stream is live (see above).
                        unsafe { umm_free(q, n, 0, stream) };
                        assert_eq!(last_error(), None, "thread {t}, step {i}");
                    }
                }
                for (q, n) in live {
                    // SAFETY: as above.
                    unsafe { umm_free(q, n, 0, s_other) };
                }
                mine.synchronize().unwrap();
                other.synchronize().unwrap();
                assert_eq!(last_error(), None, "thread {t}: no error was stored on this thread");
                // The streams stay live until the pending frees recorded on them are processed (below).
                (mine, other)
            })
        })
        .collect();
    let streams: Vec<_> = workers.into_iter().map(|w| w.join().expect("a worker thread failed")).collect();
    // Every stream has passed its work: the pending frees go back to the pool.
    assert!(umm_empty_cache(0) >= 0, "{:?}", last_error());
    let after = stats_of_device_0();
    for key in ["allocated_bytes", "active_blocks", "requested_bytes"] {
        assert_eq!(after[key]["current"], before[key]["current"], "{key}: {after}");
    }
    assert_eq!(after["live_pointers"].as_u64(), Some(0), "{after}");
    assert_eq!(after["pending_frees"].as_u64(), Some(0), "{after}");
    let frees = after["num_frees"].as_u64().unwrap() - before["num_frees"].as_u64().unwrap();
    assert_eq!(frees, (THREADS * 400) as u64, "every block went back to the pool once: {after}");
    assert_eq!(last_error(), None, "nothing leaked into the main thread's error");
    drop(streams);
}

#[test]
fn error_paths_from_eight_threads_keep_each_threads_own_last_error() {
    // Device ordinals that have no pool here and on a GPU machine.
    let missing = if cuda_present() { 4096 } else { 0 };
    let _device = cuda_present().then(device_0);
    umm_clear_error();
    let start = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                assert!(umm_device_count() >= 0);
                // In step with the other threads (nothing here panics, so no thread is left at the barrier):
                // each stores an error, waits until every thread has stored one, then reads its own.
                let seen: Vec<(String, Option<String>)> = (0..50usize)
                    .map(|i| {
                        let bogus = (0x7200_0000_0000usize + (t << 24) + (i << 8) + 1) as *mut c_void;
                        free(bogus, 64, 0);
                        start.wait();
                        (format!("{:#x}", bogus as usize), last_error())
                    })
                    .collect();
                for (name, msg) in seen {
                    let msg = msg.expect("a message");
                    assert!(msg.contains(&name), "thread {t} read another thread's error: {msg}");
                }
                for i in 0..200usize {
                    // An address unique to this thread and step, never handed out (umm's are 256-byte aligned).
                    let bogus = (0x7100_0000_0000usize + (t << 24) + (i << 8) + 1) as *mut c_void;
                    let name = format!("{:#x}", bogus as usize);
                    umm_clear_error();
                    assert_eq!(last_error(), None, "thread {t}: cleared");
                    // Unknown pointer, freed twice: a message naming this thread's address each time.
                    for _ in 0..2 {
                        free(bogus, 64, 0);
                        let msg = last_error().expect("a message");
                        assert!(msg.contains(&name) && msg.contains("not allocated by umm"), "thread {t}: {msg}");
                    }
                    assert_eq!(record_stream(bogus), -1);
                    let msg = last_error().expect("a message");
                    assert!(msg.starts_with("umm_record_stream") && msg.contains(&name), "thread {t}: {msg}");
                    // A bad size names this thread's size.
                    let size = -((t * 1000 + i + 1) as isize);
                    assert!(alloc(size, 0).is_null());
                    let msg = last_error().expect("a message");
                    assert!(msg.contains(&format!("size {size} ")), "thread {t}: {msg}");
                    // A missing device, then freeing NULL, which succeeds and leaves the last error alone.
                    assert!(alloc(4096, missing).is_null());
                    let msg = last_error().expect("a message");
                    assert!(msg.contains(&format!("no CUDA pool for device {missing}")), "thread {t}: {msg}");
                    free(ptr::null_mut(), 0, 0);
                    assert_eq!(last_error().as_deref(), Some(msg.as_str()), "thread {t}: NULL free kept the error");
                    assert!(umm_stats_json(missing).is_null());
                    assert_eq!(umm_set_limit(missing, 1 << 20), -1);
                    assert!(last_error().expect("a message").contains(&missing.to_string()), "thread {t}");
                }
                // On a GPU: a real double free from this thread.
                if cuda_present() {
                    let p = alloc(1000 + t as isize, 0);
                    assert!(!p.is_null(), "{:?}", last_error());
                    umm_clear_error();
                    free(p, 1000, 0);
                    assert_eq!(last_error(), None);
                    free(p, 1000, 0);
                    let msg = last_error().expect("a double free leaves a message");
                    assert!(msg.contains(&format!("{:#x}", p as usize)) && msg.contains("already freed"), "{msg}");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker thread failed");
    }
    assert_eq!(last_error(), None, "no thread's error reached the main thread");
}
