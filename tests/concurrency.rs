//! Many threads moving bytes through one device at once. On every device present (host memory, each OpenCL
//! device, each wgpu adapter, each CUDA device) and every placement it offers, 8 threads each allocate a buffer,
//! write a pattern unique to the thread and the cycle, read it back, check it and free it, over and over. The
//! buffers (1 KiB to 64 KiB, some zeroed at allocation) are small enough that several threads' blocks lie in one
//! segment at once, so two threads working on two blocks work on one device buffer. Each thread keeps its
//! previous buffer until the next one is written and checks it again, which catches a write that lands in a
//! neighbouring block.
//!
//! `UMM_CONCURRENCY_CYCLES` sets the cycles per thread and placement. 20,000 is the full run; the defaults keep
//! CI short on a 2-core machine with software devices, where the full run takes about 75 s on PoCL and 7 min on
//! lavapipe and llvmpipe together (1,000 cycles there still see dozens of failures when the wgpu backend lets
//! two threads at one buffer). A backend whose runtime is absent skips, saying why, unless
//! `UMM_REQUIRE_BACKENDS` names it.

use std::fmt::Write as _;
use std::time::Instant;
use umm::backends::testing::skip_or_fail;
use umm::{AllocOptions, Api, Device, DeviceSelector, Placement, PoolKind, UniversalBuffer, UniversalMemoryManager};

const THREADS: usize = 8;
/// Elements (u32) per buffer, taken in turn: dozens of such blocks share a 2 MiB segment.
const SIZES: [usize; 4] = [1024, 257, 4096, 16_384];
/// Every this many cycles a buffer is zeroed at allocation, which clears its block on the device.
const ZEROED_EVERY: usize = 4;
/// Failure messages shown per (device, placement); the rest are counted.
const SHOWN: usize = 12;

/// Cycles per thread and placement: `UMM_CONCURRENCY_CYCLES`, else `default`.
fn cycles(default: usize) -> usize {
    match std::env::var("UMM_CONCURRENCY_CYCLES") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("UMM_CONCURRENCY_CYCLES={v:?} is not a count")),
        Err(_) => default,
    }
}

/// Element `i` of the pattern of `thread` in `cycle`. For a fixed `i` no two (thread, cycle) pairs give the same
/// value (thread < 16, cycle < 2^28), so [`origin`] can tell whose bytes a wrong element holds.
fn value(thread: usize, cycle: usize, i: usize) -> u32 {
    let tag = (thread as u32) << 28 | (cycle as u32 & 0x0FFF_FFFF);
    tag.rotate_left(i as u32 % 32) ^ (i as u32).wrapping_mul(0x9E37_79B9)
}

/// The (thread, cycle) whose pattern puts `v` at element `i`.
fn origin(v: u32, i: usize) -> (u32, u32) {
    let tag = (v ^ (i as u32).wrapping_mul(0x9E37_79B9)).rotate_right(i as u32 % 32);
    (tag >> 28, tag & 0x0FFF_FFFF)
}

/// `text` on one line: driver errors come with their chain of causes over several indented lines.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A buffer of one thread and the cycle whose pattern it must hold.
struct Live {
    buffer: UniversalBuffer<u32>,
    cycle: usize,
}

/// Reads `live` back and compares it with its pattern; the error says where it differs and whose bytes are there.
fn check(live: &Live, thread: usize) -> Result<(), String> {
    let n = live.buffer.len();
    let at = live.buffer.block_info().map(|b| format!("segment {} offset {}", b.segment, b.offset)).unwrap_or_default();
    let mut out = vec![0u32; n];
    live.buffer.read(&mut out).map_err(|e| format!("reading {n} u32 ({at}): {e}"))?;
    let wrong: Vec<usize> = (0..n).filter(|&i| out[i] != value(thread, live.cycle, i)).collect();
    let Some(&first) = wrong.first() else { return Ok(()) };
    let (t, c) = origin(out[first], first);
    Err(format!(
        "{} of {n} u32 differ ({at}); first at element {first}: {:#010x}, expected {:#010x} (thread {t} cycle {c} \
         writes that value there)",
        wrong.len(),
        out[first],
        value(thread, live.cycle, first),
    ))
}

/// One (device, placement) to run on, and how failures name it.
struct Target<'a> {
    mm: &'a UniversalMemoryManager,
    device: &'a Device,
    api: Api,
    placement: Placement,
    /// The pool the buffers must land in.
    kind: PoolKind,
}

impl Target<'_> {
    fn name(&self) -> String {
        format!("[{}] {} via {} ({})", self.device.index(), self.device.name(), self.api, self.kind)
    }

    /// One thread's cycles; its failures, each naming the device, thread, cycle and what went wrong.
    fn run_thread(&self, thread: usize, cycles: usize) -> Vec<String> {
        let mut failures = Vec::new();
        let mut previous: Option<Live> = None;
        for cycle in 0..cycles {
            let fail = |what: String| one_line(&format!("{}: thread {thread} cycle {cycle}: {what}", self.name()));
            match self.cycle(thread, cycle) {
                Ok(live) => {
                    if let Some(old) = previous.replace(live) {
                        if let Err(e) = check(&old, thread) {
                            failures.push(fail(format!("re-reading cycle {}'s buffer: {e}", old.cycle)));
                        }
                    }
                }
                Err(e) => failures.push(fail(e)),
            }
        }
        failures
    }

    /// Allocates, writes and checks one buffer.
    fn cycle(&self, thread: usize, cycle: usize) -> Result<Live, String> {
        let n = SIZES[(thread + cycle) % SIZES.len()];
        let data: Vec<u32> = (0..n).map(|i| value(thread, cycle, i)).collect();
        let options = AllocOptions::new().placement(self.placement).device(DeviceSelector::Index(self.device.index()));
        // A read-only buffer is filled once, when it is allocated: its data go in with the allocation.
        let read_only = self.placement == Placement::ReadOnly;
        let zeroed = !read_only && cycle % ZEROED_EVERY == ZEROED_EVERY - 1;
        let allocated = if read_only {
            self.mm.allocate_universal_from_with::<u32>(&data, options)
        } else {
            self.mm.allocate_universal_with::<u32>(n, options.zeroed(zeroed))
        };
        let mut buffer = allocated.map_err(|e| format!("allocating {n} u32 (zeroed: {zeroed}): {e}"))?;
        if (buffer.device().index(), buffer.placement()) != (self.device.index(), self.kind) {
            return Err(format!(
                "landed in {} on {}: {}",
                buffer.placement(),
                buffer.device(),
                buffer.decision().reason()
            ));
        }
        if !read_only {
            buffer.write(&data).map_err(|e| format!("writing {n} u32: {e}"))?;
        }
        let live = Live { buffer, cycle };
        check(&live, thread)?;
        Ok(live)
    }
}

/// Runs [`THREADS`] threads of `cycles` on `target`; the failures as one report, `None` if there were none.
#[must_use]
fn run(target: &Target<'_>, cycles: usize) -> Option<String> {
    let start = Instant::now();
    let results: Vec<Vec<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS).map(|t| s.spawn(move || target.run_thread(t, cycles))).collect();
        let panicked = |t: usize| vec![format!("{}: thread {t} panicked", target.name())];
        handles.into_iter().enumerate().map(|(t, h)| h.join().unwrap_or_else(|_| panicked(t))).collect()
    });
    let failed: usize = results.iter().map(Vec::len).sum();
    let (name, ops) = (target.name(), THREADS * cycles);
    eprintln!(
        "{name}: {THREADS} threads x {cycles} cycles in {:.1} s, {failed} failures",
        start.elapsed().as_secs_f64()
    );
    if failed == 0 {
        return None;
    }
    let percent = 100.0 * failed as f64 / ops as f64;
    let mut report = format!("{name}: {failed} failures in {ops} cycles ({percent:.2}%); per thread:");
    for (t, r) in results.iter().enumerate() {
        let _ = write!(report, " {t}:{}", r.len());
    }
    for line in results.iter().flatten().take(SHOWN) {
        let _ = write!(report, "\n  {line}");
    }
    if failed > SHOWN {
        let _ = write!(report, "\n  ... and {} more", failed - SHOWN);
    }
    Some(report)
}

/// A manager that sees the host and `api`'s devices only, so that each device is reached through `api`.
fn manager(api: Api) -> UniversalMemoryManager {
    let on = |a: Api| api == a;
    UniversalMemoryManager::builder().backends(on(Api::Cuda), on(Api::OpenCl), on(Api::Wgpu)).build().unwrap()
}

/// Every device of `api` and every placement each offers; skips (or fails, when required) without a device.
fn every_device_of(api: Api, default_cycles: usize) {
    let mm = manager(api);
    let devices = &mm.devices()[1..];
    if devices.is_empty() {
        let skipped = if mm.skipped().is_empty() { "nothing skipped".into() } else { mm.skipped().join("; ") };
        return skip_or_fail(&api.to_string(), &format!("concurrency: no {api} device ({skipped})"));
    }
    let cycles = cycles(default_cycles);
    let mut reports = Vec::new();
    for device in devices {
        for kind in device.pool_kinds() {
            let placement = match kind {
                PoolKind::HostPinned => Placement::HostPinned,
                PoolKind::DeviceLocal => Placement::DeviceLocal,
                // Each cycle fills the buffer at allocation and then only reads.
                PoolKind::ReadOnly => Placement::ReadOnly,
                PoolKind::Host => continue,
            };
            reports.extend(run(&Target { mm: &mm, device, api, placement, kind }, cycles));
        }
    }
    assert!(reports.is_empty(), "{}", reports.join("\n"));
}

#[test]
fn threads_round_trip_host_buffers() {
    let mm = manager(Api::Host);
    let device = &mm.devices()[0];
    // The host has one pool; pinned requests are served from it and say so.
    let target =
        Target { mm: &mm, device, api: Api::Host, placement: Placement::HostPinned, kind: PoolKind::HostPinned };
    if let Some(report) = run(&target, cycles(20_000)) {
        panic!("{report}");
    }
}

#[test]
fn threads_round_trip_opencl_buffers() {
    every_device_of(Api::OpenCl, 5_000);
}

#[test]
fn threads_round_trip_wgpu_buffers() {
    every_device_of(Api::Wgpu, 1_000);
}

#[test]
fn threads_round_trip_cuda_buffers() {
    every_device_of(Api::Cuda, 5_000);
}

#[test]
fn patterns_name_their_writer() {
    for (t, c, i) in [(0, 0, 0), (7, 19_999, 1023), (3, 12_345, 31), (15, (1 << 28) - 1, 16_383)] {
        assert_eq!(origin(value(t, c, i), i), (t as u32, c as u32));
    }
    assert_ne!(value(1, 2, 5), value(2, 1, 5));
}
