//! Replays the shared traces (`../shared/traces`, or the folder in `UMM_TRACES`) through (a) the bare
//! segment-block engine, (b) the `offset-allocator` crate and (c) the full `Pool<SimBackend>`, and reports time
//! per op. Only the op loops are timed; every pass starts with nothing live and a warm allocator.
//!
//! offset-allocator counts in `u32` units: for traces whose memory does not fit in 4 GiB, sizes are divided by
//! 256 (rounded up) for both the engine and offset-allocator, and the bench name ends in `_sizes_div256`. The pool
//! always gets real sizes.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use umm::backends::engine::{BlockId, Engine};
use umm::backends::{BlockHandle, Pool, PoolConfig, SimBackend, StreamId};
use umm::trace::{Op, Trace};

/// Sizes are divided by this when a trace does not fit offset-allocator's `u32` range.
const SCALE: u64 = 256;

fn traces() -> Vec<Trace> {
    let dir = std::env::var_os("UMM_TRACES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/traces"));
    let Ok(entries) = std::fs::read_dir(&dir) else {
        println!("replay bench: no traces at {} (set UMM_TRACES to a folder of traces); skipping", dir.display());
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> =
        entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.to_string_lossy().contains(".trace")).collect();
    paths.sort();
    paths
        .iter()
        .filter_map(|p| match Trace::load(p) {
            Ok(t) => Some(t),
            Err(e) => {
                println!("replay bench: skipping {}: {e}", p.display());
                None
            }
        })
        .collect()
}

/// A trace's ops with sizes divided by `scale` (rounded up), as the engine and offset-allocator see them.
fn scaled(trace: &Trace, scale: u64) -> Vec<Op> {
    trace
        .ops
        .iter()
        .map(|&op| match op {
            Op::Alloc { slot, bytes, stream } => Op::Alloc { slot, bytes: bytes.div_ceil(scale), stream },
            free => free,
        })
        .collect()
}

/// Segment size for a request the engine cannot place, following the pool's policy (2 MiB small segments,
/// 20 MiB medium ones, large requests rounded to 2 MiB), in the same units as the sizes.
fn segment_for(size: u64, scale: u64) -> u64 {
    let mib = (1 << 20) / scale;
    let granule = 2 * mib;
    match size {
        s if s <= mib => granule,
        s if s < 10 * mib => 20 * mib,
        s => s.div_ceil(granule) * granule,
    }
}

fn engine_pass(engine: &mut Engine, ops: &[Op], slots: &mut [Option<BlockId>], scale: u64) -> Duration {
    let start = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc { slot, bytes, .. } => {
                let alloc = match engine.allocate(bytes) {
                    Some(a) => a,
                    None => {
                        let seg = engine.add_segment(segment_for(bytes, scale)).expect("segment size is valid");
                        engine.allocate_in(seg, bytes).expect("a fresh segment fits")
                    }
                };
                slots[slot as usize] = Some(alloc.block);
            }
            Op::Free { slot } => {
                // Like offset-allocator's free below, the result is not looked at: the engine's state changes
                // either way, so nothing can be optimised out.
                if let Some(block) = slots[slot as usize].take() {
                    engine.free(block);
                }
            }
        }
    }
    let elapsed = start.elapsed();
    for block in slots.iter_mut().filter_map(Option::take) {
        engine.free(block);
    }
    elapsed
}

type OffsetAllocation = offset_allocator::Allocation<u32>;

fn offset_pass(
    allocator: &mut offset_allocator::Allocator<u32>,
    ops: &[Op],
    slots: &mut [Option<OffsetAllocation>],
    failures: &mut u64,
) -> Duration {
    let start = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc { slot, bytes, .. } => match allocator.allocate(bytes as u32) {
                Some(a) => slots[slot as usize] = Some(a),
                None => *failures += 1,
            },
            Op::Free { slot } => {
                if let Some(a) = slots[slot as usize].take() {
                    allocator.free(a);
                }
            }
        }
    }
    let elapsed = start.elapsed();
    for a in slots.iter_mut().filter_map(Option::take) {
        allocator.free(a);
    }
    elapsed
}

fn pool_pass(pool: &Pool<SimBackend>, ops: &[Op], slots: &mut [Option<BlockHandle>]) -> Duration {
    let start = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc { slot, bytes, stream } => {
                slots[slot as usize] = pool.allocate(bytes, StreamId(u64::from(stream))).ok();
            }
            Op::Free { slot } => {
                if let Some(block) = slots[slot as usize].take() {
                    pool.free(&block).expect("live block");
                }
            }
        }
    }
    let elapsed = start.elapsed();
    for block in slots.iter_mut().filter_map(Option::take) {
        pool.free(&block).expect("live block");
    }
    elapsed
}

fn bench_replay(c: &mut Criterion) {
    for trace in traces() {
        // offset-allocator needs its whole range up front: give it twice the peak (room for fragmentation).
        let scale = if trace.peak_live_bytes.saturating_mul(2) > u64::from(u32::MAX) { SCALE } else { 1 };
        let ops = scaled(&trace, scale);
        let capacity = (trace.peak_live_bytes.div_ceil(scale).saturating_mul(2)).min(u64::from(u32::MAX)) as u32;
        let suffix = if scale == 1 { String::new() } else { format!("_sizes_div{scale}") };
        let mut group = c.benchmark_group(format!("replay/{}", trace.name));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(trace.ops.len() as u64));

        let mut slots = vec![None; trace.slots as usize];
        let alignment = if scale == 1 { 256 } else { 1 };
        let mut engine = Engine::new(alignment).expect("power of two");
        group.bench_function(format!("engine{suffix}"), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| engine_pass(&mut engine, &ops, &mut slots, scale)).sum())
        });

        let mut slots = vec![None; trace.slots as usize];
        let max_allocs = (trace.slots + 1024).min(u32::MAX - 2);
        let mut allocator = offset_allocator::Allocator::<u32>::with_max_allocs(capacity, max_allocs);
        let mut failures = 0;
        group.bench_function(format!("offset_allocator{suffix}"), |b| {
            b.iter_custom(|iters| {
                (0..iters).map(|_| offset_pass(&mut allocator, &ops, &mut slots, &mut failures)).sum()
            })
        });
        if failures > 0 {
            println!("replay/{}: offset_allocator failed {failures} allocations in a range of {capacity}", trace.name);
        }

        let mut slots = vec![None; trace.slots as usize];
        let pool = Pool::new(SimBackend::new("sim", 80 << 30), PoolConfig::default()).expect("valid pool");
        group.bench_function("pool_sim", |b| {
            b.iter_custom(|iters| (0..iters).map(|_| pool_pass(&pool, &trace.ops, &mut slots)).sum())
        });
        group.finish();
    }
}

criterion_group!(benches, bench_replay);
criterion_main!(benches);
