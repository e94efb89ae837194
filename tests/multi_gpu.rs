//! Two or more CUDA GPUs: `Auto` spreads a burst of large allocations evenly across them (the balance rule, with
//! each decision's reason), and a buffer migrates between every pair of GPUs by peer copy with its contents
//! intact, from plain (cuMemAlloc) and virtual (cuMemCreate/cuMemMap) segments. Skips, saying why, with fewer
//! than two CUDA devices. The bandwidth of those migrations beside a raw peer copy is
//! `cargo run --release --example multi_gpu_migrate`.
//!
//! Run on a machine with several GPUs: `cargo test --release --test multi_gpu -- --nocapture --test-threads 1`.

#![cfg(feature = "cuda")]

use umm::backends::testing::skip_or_fail;
use umm::backends::Api;
use umm::{
    Device, DeviceSelector, MigrateTo, MigrationPath, Placement, SegmentMode, UmmConfig, UniversalMemoryManager,
};

const MIB: usize = 1 << 20;
const PEER_BYTES: usize = 64 * MIB;

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
    // GPUs of one model start with free memory within a GiB of each other (contexts, other programs): the balance
    // rule then gives each its share, give or take one buffer.
    let counts: Vec<usize> = gpus.iter().map(|&g| per_gpu[g]).collect();
    let (least, most) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
    assert!(most - least <= 2 && *least >= 3, "Auto did not balance: {}", spread.join(", "));
    for b in &buffers {
        assert!(b.decision().reason().contains("spread balance"), "{}", b.decision().reason());
    }
}

#[test]
fn every_pair_of_gpus_migrates_by_peer_copy_with_contents_intact() {
    let Some((mm, gpus)) = two_gpus(SegmentMode::Plain) else { return };
    for &g in &gpus {
        let peers = mm.peers_of(g);
        println!("GPU [{g}] peers: {peers:?}");
        assert!(peers.iter().all(|p| gpus.contains(p) && *p != g), "GPU [{g}] lists peers {peers:?}");
    }
    drop(mm);
    let mut failures = Vec::new();
    // Plain segments are cuMemAlloc memory; Auto maps virtual reservations (cuMemCreate/cuMemMap) where the
    // device supports them, whose peer access is granted per mapping rather than by cuCtxEnablePeerAccess.
    for mode in [SegmentMode::Plain, SegmentMode::Auto] {
        let (mm, gpus) = two_gpus(mode).unwrap();
        for &a in &gpus {
            for &b in gpus.iter().filter(|&&b| b > a) {
                match peer_migrations(&mm, a, b) {
                    Ok(()) => println!("{mode} segments: GPU [{a}] <-> GPU [{b}] by peer copy, contents intact"),
                    Err(e) => failures.push(format!("{mode}, [{a}] <-> [{b}]: {e}")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "peer migrations failed: {failures:?}");
}

/// Migrates a buffer between GPUs `a` and `b` and back twice, checking the path of each migration and the
/// contents after each.
fn peer_migrations(mm: &UniversalMemoryManager, a: usize, b: usize) -> Result<(), String> {
    let on = |g: usize| MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Index(g));
    let data: Vec<u8> = (0..PEER_BYTES).map(|i| (i % 251) as u8).collect();
    let host = mm.allocate_universal_from(&data, Placement::Auto).map_err(|e| e.to_string())?;
    let mut buf = host.migrate(mm, on(a)).map_err(|e| e.to_string())?;
    for round in 0..2 {
        for target in [b, a] {
            buf = buf.migrate(mm, on(target)).map_err(|e| e.to_string())?;
            if buf.device().index() != target || buf.migrated_via() != Some(MigrationPath::CudaPeer) {
                return Err(format!("landed on [{}] via {:?}", buf.device().index(), buf.migrated_via()));
            }
            if buf.to_vec().map_err(|e| e.to_string())? != data {
                return Err(format!("contents changed by the peer migration to [{target}] in round {round}"));
            }
        }
    }
    Ok(())
}
