//! What the CUDA driver calls behind a pool cost on this GPU: one segment from cuMemAlloc against pages from
//! cuMemCreate + cuMemMap + cuMemSetAccess (and their frees), next to a cached allocate + free of the pool in both
//! segment modes. Medians of repeated calls; numbers to explain replay results with, not a replacement for
//! `umm replay --backend cuda`.
//!
//! `cargo run --release -p umm-backends --features cuda --example cuda_driver_costs`

use std::time::Instant;
use umm_backends::cuda;
use umm_backends::{Backend, PoolConfig, PoolPlacement, SegmentMode, StreamId};

const MIB: u64 = 1 << 20;

fn main() {
    let found = cuda::discover();
    let Some(dev) = found.devices.into_iter().next() else {
        eprintln!("no CUDA device: {}", found.skipped.join("; "));
        std::process::exit(1);
    };
    println!("{}", dev.info().name);
    let backend = dev.backend(PoolPlacement::DeviceLocal);
    let reps = 200;
    let mut rows = Vec::new();
    for size in [2 * MIB, 20 * MIB, 200 * MIB] {
        let (mut create, mut destroy) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let mut segment = None;
            create.push(time_us(|| segment = Some(backend.create_segment(size).expect("cuMemAlloc"))));
            destroy.push(time_us(|| backend.destroy_segment(segment.take().expect("created above"))));
        }
        rows.push((format!("cuMemAlloc {} MiB", size / MIB), median(create), median(destroy)));
    }
    if let Some(vm) = backend.virtual_memory() {
        let reservation = backend.reserve_virtual(1 << 30).expect("cuMemAddressReserve");
        for pages in [1u64, 10, 100] {
            let len = pages * vm.page_size;
            let (mut map, mut unmap) = (Vec::new(), Vec::new());
            for _ in 0..reps.min(100) {
                map.push(time_us(|| backend.map_pages(&reservation, 0, len).expect("cuMemMap")));
                unmap.push(time_us(|| backend.unmap_pages(&reservation, 0, len)));
            }
            rows.push((format!("cuMemCreate+Map {} x {} MiB", pages, vm.page_size / MIB), median(map), median(unmap)));
        }
        backend.destroy_segment(reservation);
    }
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        if mode == SegmentMode::Virtual && !dev.supports_virtual_memory() {
            continue;
        }
        let pool = dev
            .pool(PoolPlacement::DeviceLocal, PoolConfig { segment_mode: mode, ..PoolConfig::default() })
            .expect("pool");
        let sizes = [512u64, 4096, MIB, 3 * MIB, 24 * MIB];
        let n = 200_000;
        for &size in &sizes {
            pool.free(&pool.allocate(size, StreamId(0)).expect("warm-up")).expect("free");
        }
        let t = Instant::now();
        for i in 0..n {
            let block = pool.allocate(sizes[i % sizes.len()], StreamId(0)).expect("cached allocate");
            pool.free(&block).expect("free");
        }
        let per_op_us = t.elapsed().as_secs_f64() * 1e6 / (2 * n) as f64;
        rows.push((format!("pool cached alloc+free ({mode}), per op"), per_op_us, 0.0));
    }
    println!("\n{:<44} {:>12} {:>12}", "operation (median)", "create/map", "free/unmap");
    for (name, a, b) in rows {
        println!("{name:<44} {a:>10.3}us {b:>10.3}us");
    }
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
