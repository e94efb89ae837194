//! Two (or more) CUDA GPUs: `Auto` spreads large allocations across them by free memory, and a buffer migrates
//! GPU→GPU by peer copy. Prints the spread and the bandwidth of umm's migrate against a raw peer copy
//! (`cuMemcpyPeerAsync` through cudarc, then a synchronize) of 256 MiB, median of 10, in the same process, for
//! plain (cuMemAlloc) and virtual (cuMemCreate/cuMemMap) segments.
//! Skips, saying why, with fewer than two CUDA devices.
//!
//! Run on a 2-GPU machine: `cargo test --release --test multi_gpu -- --nocapture --test-threads 1`.

#![cfg(feature = "cuda")]

use std::time::{Duration, Instant};
use umm::backends::cuda::cudarc::driver::CudaContext;
use umm::backends::{skip_or_fail, Api};
use umm::{
    Device, DeviceSelector, MigrateTo, MigrationPath, Placement, SegmentMode, UmmConfig, UniversalMemoryManager,
};

const MIB: usize = 1 << 20;
const PEER_BYTES: usize = 256 * MIB;
const ROUNDS: usize = 10;

/// A manager with CUDA only (segments made as `mode` says), and the indices of its CUDA devices; `None` (after
/// printing why) with fewer than two.
fn two_gpus(mode: SegmentMode) -> Option<(UniversalMemoryManager, Vec<usize>)> {
    let mut config = UmmConfig { cuda: true, opencl: false, wgpu: false, ..UmmConfig::default() };
    config.pool.segment_mode = mode;
    let mm = UniversalMemoryManager::builder().config(config).build().unwrap();
    let gpus: Vec<usize> = mm.devices().iter().filter(|d| cuda_ordinal(d).is_some()).map(|d| d.index()).collect();
    if gpus.len() < 2 {
        let reason = format!(
            "multi-GPU test: {} CUDA device(s) found, 2 needed{}",
            gpus.len(),
            if mm.skipped().is_empty() { String::new() } else { format!(" ({})", mm.skipped().join("; ")) }
        );
        // No CUDA device at all fails when `UMM_REQUIRE_BACKENDS` names cuda; a single GPU is CUDA present, just
        // not enough of it, which fails when it names multi-gpu.
        skip_or_fail(if gpus.is_empty() { "cuda" } else { "multi-gpu" }, &reason);
        return None;
    }
    Some((mm, gpus))
}

/// The CUDA ordinal of a manager device seen through CUDA.
fn cuda_ordinal(device: &Device) -> Option<usize> {
    device.api_infos().iter().find(|i| i.api == Api::Cuda).map(|i| i.ordinal)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn gb_per_s(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

#[test]
fn auto_spreads_large_allocations_across_gpus_by_free_memory() {
    let Some((mm, gpus)) = two_gpus(SegmentMode::Auto) else { return };
    for &g in &gpus {
        println!("{}", mm.devices()[g]);
    }
    let mut buffers = Vec::new();
    let mut per_gpu = vec![0usize; mm.devices().len()];
    for i in 0..(4 * gpus.len()) {
        let b = mm.allocate_universal::<f32>(256 * MIB, Placement::Auto).unwrap(); // 1 GiB each
        println!("allocation {i}: 1 GiB on [{}] {}: {}", b.device().index(), b.placement(), b.decision().reason());
        per_gpu[b.device().index()] += 1;
        buffers.push(b);
    }
    let spread: Vec<String> = gpus.iter().map(|&g| format!("GPU [{g}]: {} GiB", per_gpu[g])).collect();
    println!("Auto spread of {} x 1 GiB: {}", buffers.len(), spread.join(", "));
    for &g in &gpus {
        assert!(per_gpu[g] > 0, "Auto left GPU [{g}] unused: {}", spread.join(", "));
    }
}

#[test]
fn gpu_to_gpu_migration_is_a_peer_copy_and_its_bandwidth_is_reported() {
    let Some((mm, gpus)) = two_gpus(SegmentMode::Plain) else { return };
    let ordinals = (cuda_ordinal(&mm.devices()[gpus[0]]).unwrap(), cuda_ordinal(&mm.devices()[gpus[1]]).unwrap());
    let table = mm.device_table();
    for line in table.to_string().lines().filter(|l| l.starts_with("peers:")) {
        println!("{line}");
    }
    for &g in &gpus {
        let peers = &table.devices[g].peers;
        assert!(peers.iter().all(|p| gpus.contains(p) && *p != g), "GPU [{g}] lists peers {peers:?}");
    }
    drop(mm);
    // Raw baseline: cudarc's cross-context memcpy_dtod is cuMemcpyPeerAsync, between cuMemAlloc buffers with peer
    // access enabled.
    let raw_before = raw_peer_copy(ordinals);
    let mut failures = Vec::new();
    // Plain segments are cuMemAlloc memory; Auto maps virtual reservations (cuMemCreate/cuMemMap) where the
    // device supports them, whose peer access is granted per mapping rather than by cuCtxEnablePeerAccess.
    for mode in [SegmentMode::Plain, SegmentMode::Auto] {
        let (mm, gpus) = two_gpus(mode).unwrap();
        match umm_peer_migrations(&mm, gpus[0], gpus[1]) {
            Ok(t) => println!(
                "umm migrate, {mode} segments (alloc from cache + cuMemcpyPeer + free), {} MiB GPU [{}] <-> GPU \
                 [{}], median of {}: {:.1} GB/s ({:.2} ms)",
                PEER_BYTES / MIB,
                gpus[0],
                gpus[1],
                2 * ROUNDS,
                gb_per_s(PEER_BYTES, t),
                t.as_secs_f64() * 1e3
            ),
            Err(e) => {
                println!("umm migrate, {mode} segments: FAILED: {e}");
                failures.push(format!("{mode}: {e}"));
            }
        }
    }
    let raw_after = raw_peer_copy(ordinals);
    for (when, t) in [("first", raw_before), ("again, after umm's migrations", raw_after)] {
        println!(
            "raw cuMemcpyPeerAsync (cudarc, cuMemAlloc memory, peer access enabled) {when}, {} MiB, median of \
             {ROUNDS}: {:.1} GB/s \
             ({:.2} ms)",
            PEER_BYTES / MIB,
            gb_per_s(PEER_BYTES, t),
            t.as_secs_f64() * 1e3
        );
    }
    assert!(failures.is_empty(), "peer migrations failed: {failures:?}");
}

/// Migrates a 256 MiB buffer between GPUs `a` and `b` `2 * ROUNDS` times (after a warm-up round trip that fills
/// the pools' caches), checks the path of each and the contents after them, then checks the contents after each
/// of four more migrations; returns the median time of one timed migration.
fn umm_peer_migrations(mm: &UniversalMemoryManager, a: usize, b: usize) -> Result<Duration, String> {
    let on = |g: usize| MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Index(g));
    let data: Vec<u8> = (0..PEER_BYTES).map(|i| (i % 251) as u8).collect();
    let host = mm.allocate_universal_from(&data, Placement::Auto).map_err(|e| e.to_string())?;
    let mut buf = host.migrate(mm, on(a)).map_err(|e| e.to_string())?;
    let mut times = Vec::new();
    for round in 0..=ROUNDS {
        for target in [b, a] {
            let start = Instant::now();
            buf = buf.migrate(mm, on(target)).map_err(|e| e.to_string())?;
            let t = start.elapsed();
            if buf.device().index() != target || buf.migrated_via() != Some(MigrationPath::CudaPeer) {
                return Err(format!("landed on [{}] via {:?}", buf.device().index(), buf.migrated_via()));
            }
            if round > 0 {
                times.push(t);
            }
        }
    }
    if buf.to_vec().map_err(|e| e.to_string())? != data {
        return Err(format!("contents changed over {} timed peer migrations", 2 * ROUNDS + 2));
    }
    // Then copies checked one by one (reading back between copies would change what the timed ones measure).
    for round in 0..2 {
        for target in [b, a] {
            buf = buf.migrate(mm, on(target)).map_err(|e| e.to_string())?;
            if buf.to_vec().map_err(|e| e.to_string())? != data {
                return Err(format!("contents changed by the peer migration to [{target}] in checked round {round}"));
            }
        }
    }
    Ok(median(times))
}

/// Median time of `ROUNDS` peer copies of `PEER_BYTES` from CUDA device `a` to CUDA device `b` (ordinals):
/// `cuMemcpyPeerAsync` between two `cuMemAlloc` buffers, with peer access enabled both ways, on the same primary
/// contexts that umm uses, then a synchronize.
#[allow(unsafe_code)]
fn raw_peer_copy((a, b): (usize, usize)) -> Duration {
    use umm::backends::cuda::cudarc::driver::result;
    let (ctx_a, ctx_b) = (CudaContext::new(a).unwrap(), CudaContext::new(b).unwrap());
    let peer = umm::backends::cuda::enable_peer_access(&ctx_b, &ctx_a).unwrap()
        && umm::backends::cuda::enable_peer_access(&ctx_a, &ctx_b).unwrap();
    println!(
        "raw baseline: peer access between cuda:{a} and cuda:{b}: {}",
        if peer { "enabled" } else { "not possible" }
    );
    ctx_a.bind_to_thread().unwrap();
    // SAFETY: a plain device allocation in the bound context `a`; freed below in the same context.
    let src = unsafe { result::malloc_sync(PEER_BYTES) }.unwrap();
    // SAFETY: `src` is `PEER_BYTES` long and nothing else uses it.
    unsafe { result::memset_d8_sync(src, 7, PEER_BYTES) }.unwrap();
    ctx_b.bind_to_thread().unwrap();
    // SAFETY: as for `src`, in context `b`.
    let dst = unsafe { result::malloc_sync(PEER_BYTES) }.unwrap();
    let stream = ctx_b.default_stream();
    let mut times = Vec::new();
    for round in 0..=ROUNDS {
        let start = Instant::now();
        // SAFETY: both buffers are live allocations of `PEER_BYTES` in their contexts; the copy is waited for
        // before either is freed.
        unsafe { result::memcpy_peer_async(ctx_b.cu_ctx(), dst, ctx_a.cu_ctx(), src, PEER_BYTES, stream.cu_stream()) }
            .unwrap();
        stream.synchronize().unwrap();
        if round > 0 {
            times.push(start.elapsed());
        }
    }
    // SAFETY: allocated above in context `b` (bound), no work pending.
    unsafe { result::free_sync(dst) }.unwrap();
    ctx_a.bind_to_thread().unwrap();
    // SAFETY: allocated above in context `a`, no work pending.
    unsafe { result::free_sync(src) }.unwrap();
    median(times)
}
