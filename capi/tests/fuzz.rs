//! Fuzzed calls into the C ABI, as C would make them: random sizes (0, negative, `isize::MAX`), devices out of
//! range, streams, pointers never allocated, double frees, frees of interior pointers, limits, statistics. Each
//! case is a sequence of calls checked against a model of the live pointers: a call succeeds, or fails with NULL
//! or -1 and a message from `umm_last_error` naming the size, device or pointer at fault; no call panics (the ABI
//! would report a caught panic as an internal error), hangs or aborts. Blocks that are handed out are checked
//! for alignment and overlap.
//!
//! 10,000 cases in CI, 100,000 in the ignored test (`cargo test --release -p umm-capi --test fuzz -- --ignored`);
//! `UMM_FUZZ_CASES=N` overrides both. Without CUDA every device is missing and the error paths are what runs;
//! on a GPU machine blocks are allocated, freed and reused for real.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use umm_capi::*;

/// The registry is process-wide: the tests of this file take turns.
static TURN: Mutex<()> = Mutex::new(());

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

fn cases(default: u64) -> u64 {
    std::env::var("UMM_FUZZ_CASES").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// Which pointer a free or `record_stream` gets.
#[derive(Debug, Clone, Copy)]
enum Target {
    Null,
    /// The n-th block handed out in this case (live, or freed already: a double free).
    Block(usize),
    /// An address inside the n-th block, past its start.
    Interior(usize, u64),
    /// An address umm never handed out.
    Random(u64),
}

#[derive(Debug, Clone, Copy)]
enum Call {
    Alloc { size: isize, device: c_int, stream: usize },
    Free { target: Target, size: isize, device: c_int, stream: usize },
    RecordStream { target: Target, stream: usize },
    Stats { device: c_int },
    EmptyCache { device: c_int },
    SetLimit { device: c_int, bytes: u64 },
    ResetPeaks { device: c_int },
    DeviceCount,
    ClearError,
}

fn device(rng: &mut Rng, count: c_int) -> c_int {
    match rng.below(6) {
        0 => rng.pick(&[-1, -2, c_int::MIN, c_int::MAX, count, count + 1, 4096]),
        1 => rng.next() as c_int,
        _ => rng.below(count.max(1) as u64 + 1) as c_int,
    }
}

fn size(rng: &mut Rng) -> isize {
    match rng.below(10) {
        0 => rng.pick(&[0, -1, isize::MIN, isize::MAX, isize::MAX - 255, 1 << 50, -(1 << 20)]),
        1 => 1 << rng.below(31),
        2 => rng.next() as isize,
        3 => (1 << 20) + rng.below(1 << 22) as isize,
        _ => 1 + rng.below(1 << 16) as isize,
    }
}

fn target(rng: &mut Rng, handed_out: usize) -> Target {
    match rng.below(8) {
        0 => Target::Null,
        1 => Target::Random(rng.next()),
        2 => Target::Random(rng.pick(&[1, 8, 0x1000, 0xdead_b000, 0x7f00_0000_0000, u64::MAX, u64::MAX - 255])),
        3 | 4 if handed_out > 0 => Target::Interior(rng.below(handed_out as u64) as usize, 1 + rng.below(1 << 12)),
        _ if handed_out > 0 => Target::Block(rng.below(handed_out as u64) as usize),
        _ => Target::Random(rng.next() & !0xff),
    }
}

fn calls(rng: &mut Rng, count: c_int) -> Vec<Call> {
    let mut calls = Vec::new();
    let mut allocs = 0;
    // Streams: NULL (index 0) wherever a device exists; without one, a few made-up handles too, which umm records
    // but never hands to a driver (there is none). A real GPU gets only NULL: its streams must be live.
    let streams = if count > 0 { 1 } else { 4 };
    for _ in 0..1 + rng.below(30) {
        let call = match rng.below(14) {
            0..=4 => {
                allocs += 1;
                Call::Alloc { size: size(rng), device: device(rng, count), stream: rng.below(streams) as usize }
            }
            5..=8 => Call::Free {
                target: target(rng, allocs),
                size: size(rng),
                device: device(rng, count),
                stream: rng.below(streams) as usize,
            },
            9 => Call::RecordStream { target: target(rng, allocs), stream: rng.below(streams) as usize },
            10 => Call::Stats { device: device(rng, count) },
            11 => match rng.below(3) {
                0 => Call::EmptyCache { device: device(rng, count) },
                1 => Call::ResetPeaks { device: device(rng, count) },
                _ => {
                    let any = rng.next();
                    Call::SetLimit {
                        device: device(rng, count),
                        bytes: rng.pick(&[0, 0, 1, 4096, 1 << 20, 1 << 30, 64 << 30, u64::MAX, any]),
                    }
                }
            },
            12 => Call::DeviceCount,
            _ => Call::ClearError,
        };
        calls.push(call);
    }
    calls
}

fn stream(index: usize) -> *mut c_void {
    // Index 0 is NULL, the legacy default stream; the others are made-up handles used only without a GPU.
    if index == 0 {
        ptr::null_mut()
    } else {
        (0x5_0000 + index * 0x100) as *mut c_void
    }
}

fn last_error() -> Option<String> {
    let p = umm_last_error();
    // SAFETY: NULL or a NUL-terminated string valid until the next umm call on this thread; copied at once.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The message a failed call left, which must name `what` and must not be a caught panic.
fn failed_with(call: &Call, what: &[String]) -> Result<(), String> {
    let message = last_error().ok_or_else(|| format!("{call:?} failed without a message"))?;
    if message.contains("panic") {
        return Err(format!("{call:?} panicked: {message}"));
    }
    if what.iter().any(|w| message.contains(w.as_str())) {
        Ok(())
    } else {
        Err(format!("{call:?}: the message names none of {what:?}: {message}"))
    }
}

fn succeeded(call: &Call) -> Result<(), String> {
    match last_error() {
        Some(message) => Err(format!("{call:?} succeeded but left a message: {message}")),
        None => Ok(()),
    }
}

/// Runs one case's calls against a model: the blocks handed out (address, size, live).
fn run_case(calls: &[Call], count: c_int) -> Result<(), String> {
    let mut blocks: Vec<(u64, u64, bool)> = Vec::new();
    let mut live: BTreeMap<u64, usize> = BTreeMap::new();
    let device_words = |d: c_int| vec![format!("device {d}"), "no CUDA".to_string()];
    let address = |t: Target, blocks: &[(u64, u64, bool)]| match t {
        Target::Null => 0,
        Target::Block(i) => blocks.get(i).map_or(0xbad0_0000, |b| b.0),
        Target::Interior(i, off) => blocks.get(i).map_or(0xbad0_0100, |b| b.0 + off % b.1.max(2).saturating_sub(1) + 1),
        Target::Random(a) => a,
    };
    let result = (|| {
        for call in calls {
            umm_clear_error();
            match *call {
                Call::Alloc { size, device, stream: s } => {
                    // SAFETY: the stream is NULL, or (without a GPU) a handle umm records but never uses.
                    let p = unsafe { umm_alloc(size, device, stream(s)) } as u64;
                    if p == 0 {
                        let mut what = device_words(device);
                        what.push(format!("size {size}"));
                        what.push("umm_alloc".into());
                        failed_with(call, &what)?;
                        if size <= 0 && !last_error().unwrap_or_default().contains(&format!("size {size}")) {
                            return Err(format!("{call:?}: a bad size without the size"));
                        }
                        blocks.push((0, 0, false));
                        continue;
                    }
                    succeeded(call)?;
                    if size <= 0 || device < 0 || device >= count {
                        return Err(format!("{call:?} succeeded at {p:#x}"));
                    }
                    let bytes = size as u64;
                    if !p.is_multiple_of(256) {
                        return Err(format!("{call:?}: {p:#x} is not 256-byte aligned"));
                    }
                    // No overlap with a live block.
                    if let Some((&q, &i)) = live.range(..p.saturating_add(bytes)).next_back() {
                        if q + blocks[i].1 > p {
                            return Err(format!("{call:?}: [{p:#x}, +{bytes}) overlaps the live block at {q:#x}"));
                        }
                    }
                    live.insert(p, blocks.len());
                    blocks.push((p, bytes, true));
                }
                Call::Free { target, size, device, stream: s } => {
                    let p = address(target, &blocks);
                    // SAFETY: as for umm_alloc; the pointer is only an address to umm.
                    unsafe { umm_free(p as *mut c_void, size, device, stream(s)) };
                    if p == 0 {
                        succeeded(call)?;
                    } else if let Some(i) = live.remove(&p) {
                        blocks[i].2 = false;
                        succeeded(call)?;
                    } else {
                        failed_with(call, &[format!("{p:#x}")])?;
                    }
                }
                Call::RecordStream { target, stream: s } => {
                    let p = address(target, &blocks);
                    // SAFETY: as for umm_alloc.
                    let r = unsafe { umm_record_stream(p as *mut c_void, stream(s)) };
                    match (r, live.contains_key(&p)) {
                        (0, true) => succeeded(call)?,
                        (-1, false) => failed_with(call, &[format!("{p:#x}")])?,
                        (r, is_live) => return Err(format!("{call:?} returned {r} for a block live: {is_live}")),
                    }
                }
                Call::Stats { device } => {
                    let s = umm_stats_json(device);
                    if s.is_null() {
                        failed_with(call, &device_words(device))?;
                        continue;
                    }
                    // SAFETY: a NUL-terminated string from umm_stats_json, freed once right after.
                    let json = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
                    // SAFETY: `s` came from umm_stats_json and is freed once, here; `json` is an owned copy.
                    unsafe { umm_string_free(s) };
                    let v: serde_json::Value = serde_json::from_str(&json).map_err(|e| format!("stats JSON: {e}"))?;
                    let ours = blocks.iter().filter(|b| b.2).count() as u64;
                    if v["live_pointers"].as_u64().is_none_or(|n| n < ours) {
                        return Err(format!(
                            "{call:?}: live_pointers {} below the {ours} of this case",
                            v["live_pointers"]
                        ));
                    }
                }
                Call::EmptyCache { device } => {
                    if umm_empty_cache(device) < 0 {
                        failed_with(call, &device_words(device))?;
                    }
                }
                Call::SetLimit { device, bytes } => {
                    if umm_set_limit(device, bytes) != 0 {
                        let mut what = device_words(device);
                        what.push(format!("{bytes} bytes"));
                        failed_with(call, &what)?;
                    }
                }
                Call::ResetPeaks { device } => {
                    if umm_reset_peaks(device) != 0 {
                        failed_with(call, &device_words(device))?;
                    }
                }
                Call::DeviceCount => {
                    if umm_device_count() != count {
                        return Err(format!("the device count changed from {count}"));
                    }
                }
                Call::ClearError => {
                    umm_clear_error();
                    if last_error().is_some() {
                        return Err("umm_clear_error left a message".into());
                    }
                }
            }
        }
        Ok(())
    })();
    // Leave nothing behind for the next case: free what is live, lift limits.
    for &p in live.keys() {
        // SAFETY: NULL stream; a block this case allocated.
        unsafe { umm_free(p as *mut c_void, 0, 0, ptr::null_mut()) };
    }
    umm_set_limit(-1, 0);
    result
}

fn fuzz(cases: u64) {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let count = umm_device_count();
    assert!(count >= 0, "umm_device_count: {count}");
    let mut failures = Vec::new();
    let mut failed = 0;
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    for case in 0..cases {
        let seed = 0xC0FFEE ^ case.wrapping_mul(0x100_0000_01B3);
        let calls = calls(&mut Rng(seed), count);
        let began = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| run_case(&calls, count)));
        let took = began.elapsed();
        slowest = slowest.max(took);
        let problem = match outcome {
            Ok(Ok(())) if took > Duration::from_secs(20) => Some(format!("took {took:?}: a hang")),
            Ok(Ok(())) => None,
            Ok(Err(why)) => Some(why),
            Err(_) => Some("a panic in Rust code calling the ABI".into()),
        };
        if let Some(why) = problem {
            failed += 1;
            if failures.len() < 8 {
                failures.push(format!("seed {seed:#x}: {why}\n    calls: {calls:?}"));
            }
        }
    }
    eprintln!(
        "fuzz C ABI ({count} CUDA devices): {cases} cases, {failed} failed, {:.1} s, slowest case {slowest:?}",
        start.elapsed().as_secs_f64()
    );
    assert!(failed == 0, "fuzz C ABI: {failed} of {cases} cases failed:\n{}", failures.join("\n"));
}

#[test]
fn c_abi_calls() {
    fuzz(cases(10_000));
}

#[test]
#[ignore = "100,000 cases: run with --release -- --ignored"]
fn c_abi_calls_long() {
    fuzz(cases(100_000));
}

/// Double frees and interior frees, named: each leaves the block's neighbours alone and says which address.
#[test]
fn double_and_interior_frees_change_nothing_and_name_the_address() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let count = umm_device_count();
    let calls = [
        Call::Alloc { size: 4096, device: 0, stream: 0 },
        Call::Free { target: Target::Interior(0, 256), size: 4096, device: 0, stream: 0 },
        Call::Free { target: Target::Block(0), size: 4096, device: 0, stream: 0 },
        Call::Free { target: Target::Block(0), size: 4096, device: 0, stream: 0 },
        Call::RecordStream { target: Target::Block(0), stream: 0 },
        Call::Free { target: Target::Random(u64::MAX), size: -1, device: c_int::MIN, stream: 0 },
        Call::Alloc { size: isize::MAX, device: 0, stream: 0 },
        Call::SetLimit { device: 0, bytes: u64::MAX },
    ];
    run_case(&calls, count).unwrap();
}
