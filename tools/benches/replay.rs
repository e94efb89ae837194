//! Replays the shared traces (`../shared/traces`, or the folder in `UMM_TRACES`) through (a) the bare
//! segment-block engine, (b) the `offset-allocator` crate and (c) the full `Pool<SimBackend>`, and reports time
//! per op. Only the op loops are timed; every pass starts with nothing live and a warm allocator.
//!
//! offset-allocator counts in `u32` units: for traces whose memory does not fit in 4 GiB, sizes are divided by
//! 256 (rounded up) for both the engine and offset-allocator, and the bench name ends in `_sizes_div256`. The pool
//! always gets real sizes.

#[path = "../../benches/loops/mod.rs"]
mod loops;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use loops::{engine_for, engine_pass, offset_allocator_for, offset_capacity, offset_pass, scale_for, scaled};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use umm::backends::{BlockHandle, Pool, PoolConfig, SimBackend, StreamId};
use umm::trace::{Op, Trace};

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
        let scale = scale_for(&trace);
        let ops = scaled(&trace, scale);
        let suffix = if scale == 1 { String::new() } else { format!("_sizes_div{scale}") };
        let mut group = c.benchmark_group(format!("replay/{}", trace.name));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(trace.ops.len() as u64));

        let mut slots = vec![None; trace.slots as usize];
        let mut engine = engine_for(scale);
        group.bench_function(format!("engine{suffix}"), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| engine_pass(&mut engine, &ops, &mut slots, scale)).sum())
        });

        let mut slots = vec![None; trace.slots as usize];
        let mut allocator = offset_allocator_for(&trace, scale);
        let mut failures = 0;
        group.bench_function(format!("offset_allocator{suffix}"), |b| {
            b.iter_custom(|iters| {
                (0..iters).map(|_| offset_pass(&mut allocator, &ops, &mut slots, &mut failures)).sum()
            })
        });
        if failures > 0 {
            println!(
                "replay/{}: offset_allocator failed {failures} allocations in a range of {}",
                trace.name,
                offset_capacity(&trace, scale)
            );
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
