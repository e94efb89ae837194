//! CUDA backend tests: what only CUDA has. Without a driver or GPU, discovery must be empty, give a reason and
//! print nothing, and the GPU tests skip (or fail when `UMM_REQUIRE_BACKENDS` names `cuda`). On a GPU they check
//! record-stream semantics (reuse deferred while another stream is held back by a host flag, and a pool dropped
//! with a pending free), pinned and read-only memory with kernels, page trims of virtual reservations, warm-up,
//! copies and stream handles. What every backend must do (round trips, dirty reuse against fresh buffers with an
//! NVRTC kernel, zeroing, poison, limits and out of memory, stream reuse, threads, statistics) is in the
//! conformance suite (`tests/conformance.rs`), which runs on CUDA's placements and segment modes too.
//!
//! The tests may run in parallel: only `device_exhaustion_releases_the_cache_and_reports_the_driver`, ignored by
//! default, takes the whole device. Measurements live elsewhere: driver call costs in
//! `examples/cuda_driver_costs.rs`, traces on the device with `umm replay --backend cuda`
//! (`UMM_SEGMENT_MODE=plain` or `virtual`).

#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};
use umm_backends::cuda::cudarc::driver::{
    CudaContext, CudaFunction, DevicePtr, DeviceSlice, LaunchConfig, PushKernelArg,
};
use umm_backends::cuda::{self, CudaBuffer, CudaDevice, CudaPool, CudaPoolExt};
use umm_backends::testing::skip_or_fail;
use umm_backends::{Api, Backend, DeviceKind, Error, Limit, PoolConfig, PoolKind, SegmentMode, Strategy, StreamId};

const KERNELS: &str = r#"
// Waits until the host sets *flag (pinned host memory, read through its device-mapped address), then writes
// 42.0 at out[0]; gives up after timeout_cycles and writes -1.0 instead, so that a lost flag fails the test
// rather than hanging it.
extern "C" __global__ void wait_for_flag_then_write(const volatile unsigned int* flag, long long timeout_cycles,
                                                    float* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    long long start = clock64();
    while (*flag == 0) {
        if (clock64() - start > timeout_cycles) { out[0] = -1.0f; return; }
    }
    out[0] = 42.0f;
}
extern "C" __global__ void scale(const float* x, float* y, float f, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * f;
}
"#;

// ----- helpers -----

/// The tests of this file share the GPU, except the two that hold a stream back on a host flag, which run
/// alone: a driver call that waits for the whole device (freeing device memory does) on another test's thread,
/// made while such a kernel waits, can hold driver locks that the flag test's own thread needs before it sets
/// the flag, and then the kernel gives up waiting (about 1 run in 4 with 4 test threads on an H200).
static GPU_TURNS: RwLock<()> = RwLock::new(());

/// A test's device and its turn on the GPU ([`GPU_TURNS`]).
struct Gpu {
    dev: CudaDevice,
    _turn: Turn,
}

enum Turn {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

impl std::ops::Deref for Gpu {
    type Target = CudaDevice;
    fn deref(&self) -> &CudaDevice {
        &self.dev
    }
}

/// The first CUDA device, shared with the other tests (or a skip).
fn gpu() -> Option<Gpu> {
    device_with(Turn::Shared(GPU_TURNS.read().unwrap_or_else(|e| e.into_inner())))
}

/// The first CUDA device, with no other test of this file using the GPU until the test ends.
fn gpu_alone() -> Option<Gpu> {
    device_with(Turn::Alone(GPU_TURNS.write().unwrap_or_else(|e| e.into_inner())))
}

fn device_with(turn: Turn) -> Option<Gpu> {
    let found = cuda::discover();
    match found.devices.into_iter().next() {
        Some(dev) => Some(Gpu { dev, _turn: turn }),
        None => {
            skip_or_fail("cuda", &found.skipped.join("; "));
            None
        }
    }
}

struct Kernels {
    wait_for_flag: CudaFunction,
    scale: CudaFunction,
}

fn kernels(ctx: &Arc<CudaContext>) -> Option<Kernels> {
    if !cuda::nvrtc_available() {
        skip_or_fail("cuda", "NVRTC (libnvrtc) is not available to compile the test kernels");
        return None;
    }
    let ptx = cuda::cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    let module = ctx.load_module(ptx).expect("module loads");
    Some(Kernels {
        wait_for_flag: module.load_function("wait_for_flag_then_write").unwrap(),
        scale: module.load_function("scale").unwrap(),
    })
}

/// How long a kernel waits for a host flag before it gives up (about 10 s at 2 GHz), and how long the host
/// waits for such a kernel's stream: every wait is bounded, so a lost flag or a stream that never finishes
/// fails the test instead of hanging it.
const FLAG_TIMEOUT_CYCLES: i64 = 20_000_000_000;
const HOST_WAIT: Duration = Duration::from_secs(30);

/// A 32-bit flag in pinned, device-mapped host memory from umm's pinned pool: a kernel polls it through its
/// device address ([`CudaPool::device_ptr`]) while the host sets it through its host address with an atomic
/// store, which needs no driver call (a host slice of a `CudaBuffer` would synchronize the context, and so
/// wait for the kernel that waits for the flag).
struct HostFlag {
    pool: Arc<CudaPool>,
    block: umm_backends::BlockHandle,
    host: usize,
    device: u64,
}

impl HostFlag {
    fn new(dev: &CudaDevice) -> Self {
        let pool = dev.caching_pool(PoolKind::HostPinned, PoolConfig::default()).unwrap();
        let block = pool.allocate(256, StreamId(0)).unwrap();
        let host = pool.pool().host_ptr(&block).expect("pinned memory has a host address").as_ptr() as usize;
        let device = pool.device_ptr(&block).unwrap();
        let flag = Self { pool, block, host, device };
        flag.atomic().store(0, Ordering::SeqCst);
        flag
    }

    #[allow(unsafe_code)] // AtomicU32::from_ptr over the pinned block.
    fn atomic(&self) -> &AtomicU32 {
        // SAFETY: `host` is the host address of a live pinned block of 256 bytes (256-byte aligned, so aligned
        // for a u32), freed only when `self` drops; the host touches it only through this atomic, and the device
        // only reads it.
        unsafe { AtomicU32::from_ptr(self.host as *mut u32) }
    }

    /// Lets the kernels waiting for the flag go on.
    fn set(&self) {
        self.atomic().store(1, Ordering::SeqCst);
    }
}

impl Drop for HostFlag {
    fn drop(&mut self) {
        self.pool.free(&self.block).unwrap();
    }
}

/// Launches `wait_for_flag_then_write` on `stream`: it holds `stream` back until `flag` is set, then writes
/// 42.0 at `out`, the device address of a live block of at least 4 bytes that stays unreused until `stream`
/// passes the kernel.
fn launch_wait_for_flag(k: &Kernels, stream: &Arc<cuda::cudarc::driver::CudaStream>, flag: &HostFlag, out: u64) {
    let mut builder = stream.launch_builder(&k.wait_for_flag);
    builder.arg(&flag.device).arg(&FLAG_TIMEOUT_CYCLES).arg(&out);
    // SAFETY: wait_for_flag_then_write(const volatile unsigned*, long long, float*) reads one u32 at the flag's
    // device address (a live pinned block that outlives the kernel: the flag is dropped after every wait on it)
    // and writes one float at `out`, which the caller keeps unreused until the stream passes the kernel.
    unsafe { builder.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 }) }.unwrap();
}

fn config(mode: SegmentMode) -> PoolConfig {
    PoolConfig { segment_mode: mode, ..PoolConfig::default() }
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

// ----- without a GPU too -----

/// The child half of `discovery_prints_nothing`: runs discovery when asked to by the parent.
#[test]
fn discovery_child() {
    if std::env::var_os("UMM_CUDA_DISCOVERY_CHILD").is_none() {
        return;
    }
    let found = cuda::discover();
    println!("devices={} skipped={:?}", found.devices.len(), found.skipped);
    assert!(!found.devices.is_empty() || !found.skipped.is_empty(), "no devices must come with a reason");
}

#[test]
fn discovery_prints_nothing_and_never_panics() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "discovery_child", "--nocapture", "--test-threads=1"])
        .env("UMM_CUDA_DISCOVERY_CHILD", "1")
        .output()
        .expect("the test binary re-runs itself");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "discovery failed: {stdout}\n{stderr}");
    assert!(stderr.is_empty(), "discovery wrote to stderr: {stderr}");
    assert!(stdout.contains("devices="), "{stdout}");
    let found = cuda::discover();
    if found.devices.is_empty() {
        assert!(!found.skipped.is_empty());
        eprintln!("no CUDA here, as expected on this machine: {:?}", found.skipped);
    }
}

// ----- on a GPU -----

#[test]
fn discovery_reports_device_facts() {
    let Some(dev) = gpu() else { return };
    let info = dev.info();
    println!("{info:#?}");
    assert_eq!(info.api, Api::Cuda);
    assert!(!info.name.is_empty() && info.total_bytes > 0);
    assert!(info.free_bytes.is_some_and(|f| f > 0 && f <= info.total_bytes));
    assert_eq!(info.alignment, 256);
    let pci = info.pci_bus_id.as_deref().expect("PCI bus id");
    let ok = pci.len() == 12
        && pci.chars().enumerate().all(|(i, c)| match i {
            4 | 7 => c == ':',
            10 => c == '.',
            _ => c.is_ascii_hexdigit() && !c.is_ascii_uppercase(),
        });
    assert!(ok, "PCI bus id {pci} is not dddd:bb:dd.f");
    let uuid = info.uuid.as_deref().expect("uuid");
    assert_eq!(uuid.len(), 36, "{uuid}");
    assert!(info.details.iter().any(|(k, _)| k == "compute_capability"));
    assert_eq!(info.shares_memory_with_host, info.kind == DeviceKind::IntegratedGpu);
}

/// `synchronize_pending` waits for the streams a freed block was recorded on and returns it, without polling.
#[test]
fn synchronize_pending_returns_a_block_recorded_on_another_stream() {
    let Some(dev) = gpu() else { return };
    let ctx = dev.context().clone();
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let pool = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    let b = CudaBuffer::allocate(&pool, 4096, cuda::stream_id(&s1)).unwrap();
    b.record_stream(cuda::stream_id(&s2)).unwrap();
    drop(b);
    assert_eq!(pool.synchronize_pending().unwrap(), 1);
}

/// Reuse deferred by `record_stream`, checked without timing: stream 2 runs a kernel that waits for a host flag, so the test
/// knows stream 2 has not passed the kernel while it checks that the block freed with stream 2 recorded is not
/// reused, however long the checks take; then it sets the flag and checks the block comes back once stream 2
/// is done, holding what the kernel wrote.
#[test]
fn record_stream_defers_reuse_while_the_other_stream_waits_for_a_host_flag() {
    let Some(dev) = gpu_alone() else { return };
    let ctx = dev.context().clone();
    let Some(k) = kernels(&ctx) else { return };
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let id1 = cuda::stream_id(&s1);
    let flag = HostFlag::new(&dev);
    let pool = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    let mut buf = CudaBuffer::allocate(&pool, 1 << 20, id1).unwrap();
    let original = buf.device_ptr();
    {
        // The view marks s2 as a user of the block.
        let view = buf.view_mut::<f32>(&s2).unwrap();
        let (ptr, _guard) = view.device_ptr(&s2);
        launch_wait_for_flag(&k, &s2, &flag, ptr);
    }
    drop(buf);
    assert_eq!(pool.pending_frees(), 1, "the free waits for s2");
    // s2 is held back until the flag is set: the block must not come back, now or after a while.
    let other = CudaBuffer::allocate(&pool, 1 << 20, id1).unwrap();
    assert_ne!(other.device_ptr(), original, "reused while s2 may still write it");
    // s2 cannot pass the kernel before the flag is set, however long this takes: no wait is needed to be sure.
    assert_eq!(pool.process_pending().unwrap(), 0, "returned while s2 is still held back");
    let third = CudaBuffer::allocate(&pool, 1 << 20, id1).unwrap();
    assert_ne!(third.device_ptr(), original, "reused while s2 is still held back");
    assert_eq!(pool.pending_frees(), 1);
    drop((other, third));
    flag.set();
    // Once s2 has passed the kernel, its recorded event has too: one pass returns the block.
    s2.synchronize().unwrap();
    pool.process_pending().unwrap();
    assert_eq!(pool.pending_frees(), 0, "returned once s2 is done");
    let again = CudaBuffer::allocate(&pool, 1 << 20, id1).unwrap();
    assert_eq!(again.device_ptr(), original, "reused once s2 is done");
    let mut first = [0u8; 4];
    again.read(0, &mut first).unwrap();
    assert_eq!(f32::from_le_bytes(first), 42.0, "the kernel saw the flag (-1.0: it timed out waiting)");
}

/// A pool dropped while a freed block still waits for another stream (a pending `record_stream` free) and
/// another block is live: the drop waits for that stream before it releases the memory, so the kernel still
/// writing the block does not write freed memory (which would show as an illegal address on the stream).
#[test]
fn dropping_a_pool_with_a_pending_free_waits_for_its_stream() {
    let Some(dev) = gpu_alone() else { return };
    let ctx = dev.context().clone();
    let Some(k) = kernels(&ctx) else { return };
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let id1 = cuda::stream_id(&s1);
    let flag = Arc::new(HostFlag::new(&dev));
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        if mode == SegmentMode::Virtual && !dev.supports_virtual_memory() {
            continue;
        }
        flag.atomic().store(0, Ordering::SeqCst);
        let pool = dev.caching_pool(PoolKind::DeviceLocal, config(mode)).unwrap();
        let live = pool.allocate(3 << 20, id1).unwrap();
        let pending = pool.allocate(8 << 20, id1).unwrap();
        pool.record_stream(&pending, cuda::stream_id(&s2)).unwrap();
        launch_wait_for_flag(&k, &s2, &flag, pool.device_ptr(&pending).unwrap());
        pool.free(&pending).unwrap();
        assert_eq!(pool.pending_frees(), 1);
        assert_eq!(pool.pool().stats().active_blocks.current, 2, "the live block and the pending one");
        let pool = Arc::into_inner(pool).expect("the test holds the only handle on the pool");
        let setter = {
            let flag = Arc::clone(&flag);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                flag.set();
            })
        };
        let start = Instant::now();
        drop(pool);
        let waited = start.elapsed();
        setter.join().unwrap();
        assert!(waited >= Duration::from_millis(250), "{mode:?}: the drop returned after {waited:?}, before s2 passed");
        assert!(waited < HOST_WAIT, "{mode:?}: the drop took {waited:?}");
        // The kernel wrote into memory the pool still held: no illegal address on s2.
        s2.synchronize().unwrap_or_else(|e| panic!("{mode:?}: s2 failed after the pool dropped: {e}"));
        assert!(live.size() >= 3 << 20, "the handle of a block of the dropped pool is plain data");
    }
}

#[test]
fn pinned_memory_is_a_host_slice_and_usable_by_kernels() {
    let Some(dev) = gpu() else { return };
    let ctx = dev.context().clone();
    let Some(k) = kernels(&ctx) else { return };
    let stream = ctx.new_stream().unwrap();
    let s = cuda::stream_id(&stream);
    let pinned = dev.caching_pool(PoolKind::HostPinned, PoolConfig::default()).unwrap();
    let device = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    let n = 100_003usize;
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut host = CudaBuffer::allocate(&pinned, n as u64 * 4, s).unwrap();
    host.host_bytes_mut().expect("pinned memory is host memory").copy_from_slice(&to_bytes(&data));
    let mut out = CudaBuffer::allocate(&pinned, n as u64 * 4, s).unwrap();
    // A kernel reads and writes pinned memory directly through its device-mapped address.
    let (x, y) = (host.device_ptr(), out.device_ptr());
    let (f, nn) = (3.0f32, n as i32);
    let mut builder = stream.launch_builder(&k.scale);
    builder.arg(&x).arg(&y).arg(&f).arg(&nn);
    // SAFETY: scale(const float*, float*, float, int) over n floats of two live pinned blocks of n floats.
    unsafe { builder.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    stream.synchronize().unwrap();
    let got = from_bytes(out.host_bytes().unwrap());
    assert!(got.iter().zip(&data).all(|(g, d)| *g == d * 3.0));
    // Asynchronous copies from pinned memory on a stream: pinned -> device -> pinned.
    let mut dev_buf = CudaBuffer::allocate(&device, n as u64 * 4, s).unwrap();
    dev_buf.copy_from_async(0, &host, 0, n as u64 * 4, s).unwrap();
    out.host_bytes_mut().unwrap().fill(0);
    out.copy_from_async(0, &dev_buf, 0, n as u64 * 4, s).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(out.host_bytes().unwrap(), host.host_bytes().unwrap());
    assert!(host.info().size >= n as u64 * 4 && host.host_bytes().is_some());
    // A cudarc copy through a view of the buffer lands in its pinned bytes; the view borrows the buffer, so no
    // host slice of it is alive meanwhile.
    let ones = vec![1.0f32; n];
    stream.memcpy_htod(&ones, &mut out.view_mut::<f32>(&stream).unwrap()).unwrap();
    stream.synchronize().unwrap();
    assert!(from_bytes(out.host_bytes().unwrap()).iter().all(|&v| v == 1.0));
    // Range views: copies through part of a view land in that part alone; the halves of a split are disjoint.
    {
        let mut view = out.view_mut::<f32>(&stream).unwrap();
        let twos = vec![2.0f32; 4];
        stream.memcpy_htod(&twos, &mut view.slice_mut(8..12).unwrap()).unwrap();
        let (mut low, mut high) = view.split_at_mut(n / 2).unwrap();
        assert_eq!((low.len(), high.len()), (n / 2, n - n / 2));
        assert_eq!(high.device_address(), low.device_address() + (n / 2 * 4) as u64);
        stream.memcpy_htod(&[5.0f32], &mut low.slice_mut(..1).unwrap()).unwrap();
        stream.memcpy_htod(&[7.0f32], &mut high.slice_mut(n - n / 2 - 1..).unwrap()).unwrap();
        assert!(matches!(view.slice(..n + 1), Err(Error::OutOfBounds(_))));
        assert!(matches!(view.split_at_mut(n + 1), Err(Error::OutOfBounds(_))));
        let back = stream.clone_dtoh(&view.slice(8..12).unwrap()).unwrap();
        assert_eq!(back, twos);
    }
    stream.synchronize().unwrap();
    let got = from_bytes(out.host_bytes().unwrap());
    for (i, &v) in got.iter().enumerate() {
        let want = match i {
            0 => 5.0,
            8..=11 => 2.0,
            _ if i == n - 1 => 7.0,
            _ => 1.0,
        };
        assert_eq!(v, want, "element {i}");
    }
    // A plain handle's view is bound to neither handle nor pool, so on pinned memory it is refused: it could
    // outlive the block and write bytes that a CudaBuffer lends as a host slice.
    let plain = pinned.allocate(4096, s).unwrap();
    let unsupported = |e: Error| matches!(e, Error::Unsupported { ref what, .. } if what.contains("CudaBuffer::view"));
    // SAFETY: no view is made (both calls fail), so nothing can outlive the block.
    unsafe {
        assert!(unsupported(pinned.pool().view::<f32>(&plain, &stream).unwrap_err()));
        assert!(unsupported(pinned.pool().view_mut::<f32>(&plain, &stream).unwrap_err()));
    }
    // So is a device copy through plain handles, which runs without the pools' locks; stream-ordered writes and
    // fills of pinned memory run from the host, under the lock, and land at once.
    let on_device = device.allocate(4096, s).unwrap();
    for r in [
        cuda::copy_block(pinned.pool(), &plain, device.pool(), &on_device, 16),
        cuda::copy_block(device.pool(), &on_device, pinned.pool(), &plain, 16),
    ] {
        assert!(matches!(r, Err(Error::Unsupported { ref what, .. }) if what.contains("pinned")), "{r:?}");
    }
    pinned.write_on_stream(&plain, 0, &[5; 32], s).unwrap();
    pinned.fill_async(&plain, 16, 16, 6, s).unwrap();
    let mut back = [0; 32];
    pinned.pool().read(&plain, 0, &mut back).unwrap();
    assert_eq!((back[..16].to_vec(), back[16..].to_vec()), (vec![5; 16], vec![6; 16]));
    device.free(&on_device).unwrap();
    pinned.free(&plain).unwrap();
}

#[test]
fn read_only_memory_is_filled_once_and_refuses_writes() {
    let Some(dev) = gpu() else { return };
    let ro = dev.caching_pool(PoolKind::ReadOnly, PoolConfig { zero_on_alloc: true, ..PoolConfig::default() }).unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut buf = CudaBuffer::from_bytes(&ro, &data, StreamId(0)).unwrap();
    assert!(buf.is_read_only());
    assert_eq!(buf.to_vec().unwrap(), data);
    let unsupported = |r: Result<(), Error>| matches!(r, Err(Error::Unsupported { .. }));
    assert!(unsupported(buf.write(0, &[1, 2, 3])));
    let ctx = dev.context().clone();
    let stream = ctx.default_stream();
    assert!(matches!(buf.view_mut::<u8>(&stream), Err(Error::Unsupported { .. })));
    assert!(buf.view::<u8>(&stream).is_ok());
    // The pool's own handle API refuses writes to read-only blocks too.
    let plain = ro.allocate(4096, StreamId(0)).unwrap();
    assert!(unsupported(ro.pool().write(&plain, 0, &[1])));
    assert!(unsupported(ro.pool().fill(&plain, 0, 16, 0)));
    assert!(unsupported(ro.write_on_stream(&plain, 0, &[1], StreamId(0))));
    // SAFETY: the view is dropped at once, and no work is queued through it.
    unsafe {
        assert!(matches!(ro.pool().view_mut::<u8>(&plain, &stream), Err(Error::Unsupported { .. })));
        assert!(ro.pool().view::<u8>(&plain, &stream).is_ok());
    }
    ro.free(&plain).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data, "still the original bytes");
}

/// Real device exhaustion: more than the device has free, in one plain segment. It takes the whole device, so it
/// is ignored by default (pool limits and their out-of-memory errors are in the conformance suite, safe in
/// parallel): run it alone with `--ignored device_exhaustion`. (Not under compute-sanitizer, which reports the
/// driver's out-of-memory answer as an API error.)
#[test]
#[ignore = "takes the whole GPU: run alone"]
fn device_exhaustion_releases_the_cache_and_reports_the_driver() {
    let Some(dev) = gpu() else { return };
    const MIB: u64 = 1 << 20;
    let pool = dev.pool(PoolKind::DeviceLocal, config(SegmentMode::Plain)).unwrap();
    let keep = pool.allocate(256 * MIB, StreamId(0)).unwrap();
    pool.free(&keep).unwrap();
    let total = dev.info().total_bytes;
    match pool.allocate(total, StreamId(0)) {
        Err(Error::OutOfMemory { requested, free, limit, .. }) => {
            assert!(requested >= total && free < total);
            assert_eq!(limit, None);
            assert_eq!(pool.stats().reserved_bytes.current, 0, "the cached segment was released before giving up");
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    // The context is still usable afterwards.
    let again = pool.allocate(MIB, StreamId(0)).unwrap();
    pool.fill(&again, 0, MIB, 1).unwrap();
    pool.free(&again).unwrap();
}

/// Pages given back wait for the work of the stream their blocks were freed on, and for no other stream's: a
/// kernel held back on s2 does not hold up a trim of s1's arena, while a kernel still writing a block freed on s1
/// does, until it has passed (no illegal address on s1 afterwards).
#[test]
fn unmapping_pages_waits_for_their_stream_and_no_other() {
    let Some(dev) = gpu_alone() else { return };
    if !dev.supports_virtual_memory() {
        return skip_or_fail("cuda-vmm", "no virtual memory management on this device");
    }
    let ctx = dev.context().clone();
    let Some(k) = kernels(&ctx) else { return };
    const MIB: u64 = 1 << 20;
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let id1 = cuda::stream_id(&s1);
    let config = PoolConfig { page_size: Some(2 * MIB), mapped_slack: None, ..config(SegmentMode::Virtual) };
    let pool = dev.caching_pool(PoolKind::DeviceLocal, config).unwrap();
    // `keep` stays live, so the reservation never empties: an empty one is destroyed, which waits for the device.
    let keep = pool.allocate(8 * MIB, id1).unwrap();
    let trim = |what: &str| {
        let start = Instant::now();
        let report = pool.pool().release_cached();
        assert_eq!(report.segments_released, 0, "{what}: {report:?}");
        assert!(report.pages_unmapped >= 4, "{what}: {report:?}");
        start.elapsed()
    };

    // Another stream's kernel, held back on a flag, writes into `keep`: the trim must not wait for it.
    let flag = HostFlag::new(&dev);
    pool.free(&pool.allocate(8 * MIB, id1).unwrap()).unwrap();
    launch_wait_for_flag(&k, &s2, &flag, pool.device_ptr(&keep).unwrap());
    let past_kernel = s2.record_event(None).unwrap();
    trim("s2 held back");
    // s2 cannot pass the kernel until the flag is set: a trim that waited for s2 would have returned only after.
    assert!(!past_kernel.is_complete(), "s2 passed its held-back kernel before the flag was set");
    flag.set();
    s2.synchronize().unwrap();
    let mut out = [0u8; 4];
    pool.pool().read(&keep, 0, &mut out).unwrap();
    assert_eq!(f32::from_le_bytes(out), 42.0, "the kernel saw the flag (-1.0: it timed out waiting)");

    // s1's own kernel writes a block freed on s1 after the launch: the trim must wait for it.
    let flag = Arc::new(HostFlag::new(&dev));
    let block = pool.allocate(8 * MIB, id1).unwrap();
    launch_wait_for_flag(&k, &s1, &flag, pool.device_ptr(&block).unwrap());
    pool.free(&block).unwrap();
    let setter = {
        let flag = Arc::clone(&flag);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            flag.set();
        })
    };
    let waited = trim("s1 held back");
    setter.join().unwrap();
    assert!(waited >= Duration::from_millis(250), "the trim returned after {waited:?}, before s1 passed its kernel");
    assert!(waited < HOST_WAIT, "the trim took {waited:?}");
    s1.synchronize().unwrap_or_else(|e| panic!("s1 failed after its pages were unmapped: {e}"));
    pool.free(&keep).unwrap();
}

#[test]
fn trims_move_free_pages_to_new_blocks_and_leave_live_data_alone() {
    let Some(dev) = gpu() else { return };
    if !dev.supports_virtual_memory() {
        // `UMM_REQUIRE_BACKENDS=cuda-vmm` makes a device without it a failure.
        return skip_or_fail("cuda-vmm", "no virtual memory management on this device");
    }
    const MIB: u64 = 1 << 20;
    // Without a limit and a page size, 8 MiB pages; under a limit, the device's own 2 MiB.
    let page_of = |config: PoolConfig| {
        let pool = dev.pool(PoolKind::DeviceLocal, config).unwrap();
        pool.backend().virtual_memory().expect("virtual memory").page_size
    };
    assert_eq!(page_of(config(SegmentMode::Virtual)), umm_backends::DEFAULT_PAGE_UNLIMITED);
    assert_eq!(page_of(PoolConfig { limit: Some(Limit::Bytes(1 << 30)), ..config(SegmentMode::Virtual) }), 2 * MIB);
    // The device's own 2 MiB pages, and 8 MiB pages (one cuMemCreate each) as `page_size` asks for.
    for (page_size, stitch) in [2 * MIB, 8 * MIB].into_iter().flat_map(|p| [(Some(p), false), (Some(p), true)]) {
        // No slack: any mapping above the live set first unmaps free pages (which the backend then maps again);
        // with stitching, the free pages are mapped a second time instead, where they lie.
        let config = PoolConfig { mapped_slack: Some(0.0), page_size, stitch, ..config(SegmentMode::Virtual) };
        let pool = dev.pool(PoolKind::DeviceLocal, config).unwrap();
        let page = pool.backend().virtual_memory().expect("virtual memory").page_size;
        assert_eq!(Some(page), page_size);
        let s = StreamId(0);
        let pattern =
            |seed: u8, len: u64| (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<u8>>();
        let [a, b, c] = [20 * MIB, 20 * MIB, 20 * MIB].map(|size| pool.allocate(size, s).unwrap());
        pool.write(&a, 0, &pattern(1, 20 * MIB)).unwrap();
        pool.write(&c, 0, &pattern(3, 20 * MIB)).unwrap();
        pool.free(&b).unwrap();
        let before = pool.stats();
        // 30 MiB fits no mapped hole: b's pages move to the new block, or are mapped there a second time.
        let d = pool.allocate(30 * MIB, s).unwrap();
        let after = pool.stats();
        if stitch {
            assert_eq!(after.num_device_free, before.num_device_free, "nothing unmapped: {after:?}");
            assert_eq!((after.num_stitches, after.num_stitched_allocs), (1, 1), "a stitched block: {after:?}");
        } else {
            assert!(after.num_device_free > before.num_device_free, "a trim unmapped b's pages: {after:?}");
        }
        // Pages shared by a live block and free space stay mapped: up to two pages above the live set.
        assert!(after.reserved_bytes.current <= 70 * MIB + 2 * page, "reserved follows the live set: {after:?}");
        pool.write(&d, 0, &pattern(4, 30 * MIB)).unwrap();
        for (block, seed, len) in [(&a, 1, 20 * MIB), (&c, 3, 20 * MIB), (&d, 4, 30 * MIB)] {
            let mut back = vec![0u8; len as usize];
            pool.read(block, 0, &mut back).unwrap();
            assert!(back == pattern(seed, len), "block with seed {seed} changed ({page}-byte pages, stitch {stitch})");
        }
        for block in [a, c, d] {
            pool.free(&block).unwrap();
        }
        let released = pool.release_cached();
        assert_eq!(pool.stats().reserved_bytes.current, 0, "{released:?}");
    }
}

#[test]
fn warm_up_and_batch_allocation_serve_from_cache() {
    let Some(dev) = gpu() else { return };
    let pool = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    let s = StreamId(0);
    const MIB: u64 = 1 << 20;
    pool.warm_up(&[(MIB, 4), (8 * MIB, 2), (40 * MIB, 1)], s).unwrap();
    let before = pool.pool().stats();
    assert_eq!(before.allocated_bytes.current, 0);
    assert!(before.reserved_bytes.current >= 4 * MIB + 16 * MIB + 40 * MIB);
    let blocks = pool.allocate_batch(&[MIB, MIB, MIB, MIB, 8 * MIB, 8 * MIB, 40 * MIB], s).unwrap();
    let after = pool.pool().stats();
    assert_eq!(after.cache_hits - before.cache_hits, 7, "all served from the warmed cache");
    assert_eq!(after.num_device_alloc, before.num_device_alloc, "no new device memory");
    for b in &blocks {
        pool.free(b).unwrap();
    }
    // A batch that cannot be served leaves nothing allocated.
    pool.pool().set_limit(Some(Limit::Bytes(80 * MIB))).unwrap();
    let err = pool.allocate_batch(&[40 * MIB, 40 * MIB, 40 * MIB], s).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(pool.pool().stats().allocated_bytes.current, 0);
}

#[test]
fn copies_between_host_and_device_and_device_and_device() {
    let Some(dev) = gpu() else { return };
    let plain = dev.caching_pool(PoolKind::DeviceLocal, config(SegmentMode::Plain)).unwrap();
    let other = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    let s = StreamId(0);
    let data: Vec<u8> = (0..5_000_017u32).map(|i| (i % 253) as u8).collect();
    let mut a = CudaBuffer::allocate(&plain, data.len() as u64, s).unwrap();
    a.write(0, &data).unwrap();
    assert_eq!(a.to_vec().unwrap(), data);
    let mut b = CudaBuffer::zeroed(&other, data.len() as u64, s).unwrap();
    b.copy_from(0, &a, 0, data.len() as u64).unwrap();
    assert_eq!(b.to_vec().unwrap(), data);
    // Partial copies at offsets, and bounds.
    b.copy_from(10, &a, 1000, 500).unwrap();
    let mut part = vec![0u8; 500];
    b.read(10, &mut part).unwrap();
    assert_eq!(part, data[1000..1500]);
    assert!(matches!(b.copy_from(data.len() as u64 - 10, &a, 0, 11), Err(Error::OutOfBounds(_))));
    // Through cudarc's own copy functions, which take our views.
    let ctx = dev.context().clone();
    let stream = ctx.new_stream().unwrap();
    let mut c = CudaBuffer::allocate(&plain, 4096, cuda::stream_id(&stream)).unwrap();
    let words: Vec<u32> = (0..1024).map(|i| i * 3 + 1).collect();
    {
        let mut view = c.view_mut::<u32>(&stream).unwrap();
        stream.memcpy_htod(&words, &mut view).unwrap();
    }
    let back: Vec<u32> = stream.clone_dtoh(&c.view::<u32>(&stream).unwrap()).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(back, words);
}

/// Proof that compute-sanitizer sees this process's kernels: with `UMM_CUDA_PLANT_OOB=1` a kernel writes past
/// the end of a Direct (own cuMemAlloc) block; memcheck must report it. Off by default.
#[test]
fn planted_out_of_bounds_write_for_the_sanitizer() {
    if std::env::var_os("UMM_CUDA_PLANT_OOB").is_none() {
        return;
    }
    let Some(dev) = gpu() else { return };
    let ctx = dev.context().clone();
    let Some(k) = kernels(&ctx) else { return };
    let stream = ctx.new_stream().unwrap();
    let pool = dev
        .pool(PoolKind::DeviceLocal, PoolConfig { strategy: Strategy::Direct, ..config(SegmentMode::Plain) })
        .unwrap();
    let x = pool.allocate(4096, cuda::stream_id(&stream)).unwrap();
    let ptr = pool.device_ptr(&x).unwrap();
    let n: i32 = (2 << 20) / 4 + 256; // past the 2 MiB segment
    let f = 1.0f32;
    let mut builder = stream.launch_builder(&k.scale);
    builder.arg(&ptr).arg(&ptr).arg(&f).arg(&n);
    // SAFETY: deliberately not: this writes past the segment, for the sanitizer to find (only when asked).
    unsafe { builder.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    let _ = stream.synchronize();
}

/// An asynchronous copy into a pinned buffer that is dropped before the copy ends leaves the memory to the next
/// block on that stream; that block's host slice must not be lent while the copy still writes it.
#[test]
fn a_host_slice_waits_for_copies_queued_into_its_memory_earlier() {
    let Some(dev) = gpu() else { return };
    let stream = dev.context().new_stream().unwrap();
    let s = cuda::stream_id(&stream);
    let pinned = dev.caching_pool(PoolKind::HostPinned, PoolConfig::default()).unwrap();
    let device = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    const LEN: u64 = 256 << 20; // long enough (tens of ms over PCIe) for an early slice to see it unfinished
    let mut source = CudaBuffer::allocate(&device, LEN, s).unwrap();
    source.write(0, &vec![0xAB; LEN as usize]).unwrap();
    for round in 0..3 {
        let mut target = CudaBuffer::zeroed(&pinned, LEN, s).unwrap();
        let place = target.info();
        target.copy_from_async(0, &source, 0, LEN, s).unwrap();
        drop(target); // the copy is still queued on `s`, the block's own stream: its memory is reusable at once
        let pool: Arc<dyn umm_backends::MemoryPool> = pinned.clone();
        let next = umm_backends::OwnedBlock::allocate(pool, LEN, s, false).unwrap();
        let bytes = next.host_bytes().expect("pinned memory is host memory");
        let reused = next.info() == place;
        assert!(bytes.iter().all(|&b| b == 0xAB), "round {round}: the slice saw the copy unfinished");
        if reused {
            return;
        }
    }
    panic!("in 3 rounds the pinned block was never reused: the test checked nothing");
}

/// Stream ids reach the driver as `CUstream` handles, so only streams umm has seen live are passed on: a made-up
/// id, or that of a dropped stream, is an error instead of a dangling handle inside the driver.
#[test]
fn only_live_registered_streams_reach_the_driver() {
    let Some(dev) = gpu() else { return };
    let pool = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    let block = pool.allocate(4096, StreamId(0)).unwrap();
    let refused = |r: Result<(), Error>, why: &str| {
        assert!(matches!(r, Err(Error::Unsupported { ref what, .. }) if what.contains(why)), "{why}: {r:?}");
    };
    refused(pool.record_stream(&block, StreamId(0xdead_beef)), "not a stream umm has seen");
    refused(pool.fill_async(&block, 0, 16, 1, StreamId(0xdead_beef)), "not a stream umm has seen");
    let stream = dev.context().new_stream().unwrap();
    let id = cuda::stream_id(&stream);
    pool.record_stream(&block, id).unwrap();
    pool.fill_async(&block, 0, 16, 7, id).unwrap();
    stream.synchronize().unwrap();
    let mut back = [0; 16];
    pool.pool().read(&block, 0, &mut back).unwrap();
    assert_eq!(back, [7; 16]);
    let other = dev.context().new_stream().unwrap();
    let dropped = cuda::stream_id(&other);
    drop(other);
    refused(pool.fill_async(&block, 0, 16, 1, dropped), "dropped");
    // A stream made outside cudarc is accepted on its creator's word (the C ABI's way).
    let raw = dev.context().new_stream().unwrap();
    // SAFETY: `raw` is a live stream of this device's context and outlives every use below.
    let vouched = unsafe { cuda::foreign_stream(cuda::stream_id(&raw).0) };
    pool.fill_async(&block, 0, 16, 9, vouched).unwrap();
    raw.synchronize().unwrap();
    pool.free(&block).unwrap(); // recorded on `stream`: an event there, then back to the pool
    assert_eq!(pool.synchronize_pending().unwrap(), 1);
}
