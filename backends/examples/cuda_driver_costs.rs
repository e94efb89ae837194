//! What the CUDA driver calls behind a pool cost on this GPU, measured through pools (segments are the pools'
//! to create and destroy): a `Direct` pool's allocate and free of a new segment (cuMemAlloc, cuMemFree) against
//! a virtual pool's allocate onto unmapped pages (cuMemCreate + cuMemMap + cuMemSetAccess per page) and
//! `release_cached` (unmap and release), next to a cached allocate + free in both segment modes. Medians of
//! repeated calls; numbers to explain replay results with, not a replacement for `umm replay --backend cuda`.
//!
//! `cargo run --release -p umm-backends --features cuda --example cuda_driver_costs`

use std::time::Instant;
use umm_backends::cuda::{self, CudaDevice};
use umm_backends::{Pool, PoolConfig, PoolKind, SegmentMode, Strategy, StreamId};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

fn main() {
    let found = cuda::discover();
    let Some(dev) = found.devices.into_iter().next() else {
        eprintln!("no CUDA device: {}", found.skipped.join("; "));
        std::process::exit(1);
    };
    println!("{}", dev.info().name);
    let mut rows = Vec::new();
    let direct = pool(&dev, PoolConfig { strategy: Strategy::Direct, ..PoolConfig::default() });
    for size in [2 * MIB, 20 * MIB, 200 * MIB] {
        let (mut create, mut destroy) = (Vec::new(), Vec::new());
        for _ in 0..200 {
            let mut block = None;
            create.push(time_us(|| block = Some(direct.allocate(size, S0).expect("cuMemAlloc"))));
            let block = block.expect("allocated above");
            destroy.push(time_us(|| direct.free(&block).expect("cuMemFree")));
        }
        rows.push((format!("direct pool: cuMemAlloc {} MiB", size / MIB), median(create), median(destroy)));
    }
    if dev.supports_virtual_memory() {
        let mapped = pool(&dev, PoolConfig { segment_mode: SegmentMode::Virtual, ..PoolConfig::default() });
        for pages in [1u64, 10, 100] {
            // Above the small-segment sizes, so the block goes to the reservation: one mapping per page.
            let len = (pages * 2 * MIB).max(12 * MIB);
            let (mut map, mut unmap) = (Vec::new(), Vec::new());
            for _ in 0..100 {
                let mut block = None;
                map.push(time_us(|| block = Some(mapped.allocate(len, S0).expect("map"))));
                mapped.free(&block.expect("allocated above")).expect("free");
                unmap.push(time_us(|| {
                    mapped.release_cached();
                }));
            }
            let label = format!("virtual pool: map {} x 2 MiB", len / (2 * MIB));
            rows.push((label, median(map), median(unmap)));
        }
    }
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        if mode == SegmentMode::Virtual && !dev.supports_virtual_memory() {
            continue;
        }
        let pool = pool(&dev, PoolConfig { segment_mode: mode, ..PoolConfig::default() });
        let sizes = [512u64, 4096, MIB, 3 * MIB, 24 * MIB];
        let n = 200_000;
        for &size in &sizes {
            pool.free(&pool.allocate(size, S0).expect("warm-up")).expect("free");
        }
        let t = Instant::now();
        for i in 0..n {
            let block = pool.allocate(sizes[i % sizes.len()], S0).expect("cached allocate");
            pool.free(&block).expect("free");
        }
        let per_op_us = t.elapsed().as_secs_f64() * 1e6 / (2 * n) as f64;
        rows.push((format!("pool cached alloc+free ({mode}), per op"), per_op_us, 0.0));
    }
    println!("\n{:<44} {:>12} {:>12}", "operation (median)", "alloc/map", "free/unmap");
    for (name, a, b) in rows {
        println!("{name:<44} {a:>10.3}us {b:>10.3}us");
    }
}

fn pool(dev: &CudaDevice, config: PoolConfig) -> Pool<umm_backends::cuda::CudaBackend> {
    dev.pool(PoolKind::DeviceLocal, config).expect("pool")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_us(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6
}
