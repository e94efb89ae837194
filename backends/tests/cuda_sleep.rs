//! Sleep and wake on a CUDA device (`Pool::sleep`, `Pool::wake` over virtual reservations): the device gets
//! its memory back, offloaded bytes return at the same addresses, a kernel given a block's address before the
//! sleep reads the restored bytes after the wake, and 100 cycles under 4 threads leak nothing. Skips without a
//! GPU (fails with `UMM_REQUIRE_BACKENDS=cuda`); run under `compute-sanitizer` on the GPU machine.

#![cfg(feature = "cuda")]

use std::sync::Arc;
use umm_backends::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use umm_backends::cuda::{self, CudaDevice, CudaPool};
use umm_backends::testing::skip_or_fail;
use umm_backends::{Backend, BlockHandle, MemoryPool, PoolConfig, PoolKind, SegmentMode, SleepAction, StreamId};

mod cycles;

use cycles::pattern;

const MIB: u64 = 1 << 20;

const DOUBLE: &str = r#"
extern "C" __global__ void double_it(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
"#;

/// The tests of this file read the device's free memory, which another test's allocations would move: they
/// take the device in turn.
static TURNS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The first CUDA device and this test's turn on it (or a skip).
fn device() -> Option<(CudaDevice, std::sync::MutexGuard<'static, ()>)> {
    let turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let found = cuda::discover();
    let device = found.devices.into_iter().next();
    if device.is_none() {
        skip_or_fail("cuda", &found.skipped.join("; "));
    }
    device.map(|d| (d, turn))
}

/// A tagged pool on virtual reservations, or a skip where the device has no virtual memory management.
fn tagged(dev: &CudaDevice, tag: &str) -> Option<Arc<CudaPool>> {
    let config = PoolConfig { segment_mode: SegmentMode::Virtual, ..PoolConfig::default() }.tagged(tag);
    match dev.caching_pool(PoolKind::DeviceLocal, config) {
        Ok(pool) => Some(pool),
        Err(e) => {
            skip_or_fail("cuda-vmm", &format!("no virtual memory management: {e}"));
            None
        }
    }
}

fn free_bytes(pool: &CudaPool) -> u64 {
    pool.pool().backend().free_bytes()
}

#[test]
fn the_device_gets_its_memory_back_and_the_bytes_return_at_the_same_addresses() {
    let Some((dev, _turn)) = device() else { return };
    let Some(pool) = tagged(&dev, "weights") else { return };
    let sizes = [1000, 3 * MIB + 17, 256 * MIB, 64];
    let blocks: Vec<(BlockHandle, Vec<u8>, u64)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let block = pool.allocate(size, StreamId(0)).unwrap();
            let bytes = pattern(i as u64, size as usize);
            pool.write(&block, 0, &bytes).unwrap();
            let address = pool.device_ptr(&block).unwrap();
            (block, bytes, address)
        })
        .collect();
    let (free_awake, reserved) = (free_bytes(&pool), pool.reserved_bytes());
    let report = pool.sleep(SleepAction::Offload).unwrap();
    assert!(report.pinned, "offloaded into page-locked memory");
    assert_eq!(pool.reserved_bytes(), 0);
    let given_back = free_bytes(&pool) - free_awake;
    // The driver's figure moves in its own granules; the pool's pages are at least what it reserved.
    assert!(given_back + 2 * MIB >= reserved, "{given_back} of {reserved} reserved bytes went back");
    eprintln!(
        "offloaded {} MiB in {:?} ({:.1} GB/s), whole sleep {:?}",
        report.bytes_offloaded / MIB,
        report.copy_time,
        report.bytes_offloaded as f64 / report.copy_time.as_secs_f64() / 1e9,
        report.elapsed
    );
    assert!(pool.read(&blocks[0].0, 0, &mut [0; 4]).unwrap_err().is_asleep());
    let woken = pool.wake().unwrap();
    eprintln!(
        "restored {} MiB in {:?} ({:.1} GB/s), whole wake {:?}",
        woken.bytes_restored / MIB,
        woken.copy_time,
        woken.bytes_restored as f64 / woken.copy_time.as_secs_f64() / 1e9,
        woken.elapsed
    );
    for (block, bytes, address) in &blocks {
        assert_eq!(pool.device_ptr(block).unwrap(), *address);
        let mut now = vec![0; bytes.len()];
        pool.read(block, 0, &mut now).unwrap();
        assert!(now == *bytes, "a block of {} bytes came back changed", bytes.len());
    }
    for (block, ..) in &blocks {
        pool.free(block).unwrap();
    }
}

/// A kernel launched after the wake on the address a block had before the sleep: the same address, the
/// restored bytes (what a captured CUDA graph replays on).
#[test]
fn a_kernel_given_the_old_address_reads_the_restored_bytes() {
    let Some((dev, _turn)) = device() else { return };
    let Some(pool) = tagged(&dev, "weights") else { return };
    if !cuda::nvrtc_available() {
        skip_or_fail("cuda", "NVRTC is not available to compile the kernel");
        return;
    }
    let ctx = dev.context().clone();
    let module = ctx.load_module(cuda::cudarc::nvrtc::compile_ptx(DOUBLE).unwrap()).unwrap();
    let double = module.load_function("double_it").unwrap();
    let n = 1 << 20;
    let input: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
    let x = pool.allocate(4 * n as u64, StreamId(0)).unwrap();
    let y = pool.allocate(4 * n as u64, StreamId(0)).unwrap();
    let input_bytes: Vec<u8> = input.iter().flat_map(|f| f.to_le_bytes()).collect();
    pool.write(&x, 0, &input_bytes).unwrap();
    let (xp, yp) = (pool.device_ptr(&x).unwrap(), pool.device_ptr(&y).unwrap());
    pool.sleep(SleepAction::Offload).unwrap();
    pool.wake().unwrap();
    let stream = ctx.default_stream();
    let mut builder = stream.launch_builder(&double);
    let count = n as i32;
    builder.arg(&xp).arg(&yp).arg(&count);
    let config =
        LaunchConfig { grid_dim: ((n as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: double_it(const float*, float*, int) reads and writes n floats of two live blocks of 4n bytes,
    // mapped again by the wake at the addresses taken before the sleep; the stream is synchronized below.
    unsafe { builder.launch(config) }.unwrap();
    stream.synchronize().unwrap();
    let mut out = vec![0u8; 4 * n];
    pool.read(&y, 0, &mut out).unwrap();
    let out: Vec<f32> = out.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert!(out.iter().zip(&input).all(|(o, i)| *o == 2.0 * i), "the kernel read the restored bytes");
    pool.free(&x).unwrap();
    pool.free(&y).unwrap();
}

/// 100 cycles of sleep (offload) and wake while 4 threads allocate, write, check and free: no byte lost, and at
/// the end the device has all its memory back and no host store is held.
#[test]
fn a_hundred_cycles_under_four_threads_lose_no_byte_and_leak_nothing() {
    let Some((dev, _turn)) = device() else { return };
    let Some(pool) = tagged(&dev, "cycles") else { return };
    let baseline = free_bytes(&pool);
    cycles::work_through_cycles(&*pool, 4, 1, [512, 40_000, 3 * MIB], 100);
    let stats = pool.stats();
    assert_eq!((stats.active_blocks.current, stats.asleep_bytes), (0, 0));
    pool.release_cached();
    assert_eq!((pool.reserved_bytes(), pool.stats().host_store_bytes), (0, 0));
    let now = free_bytes(&pool);
    assert!(now + 4 * MIB >= baseline, "the device's free memory is back: {now} of {baseline}");
}
