//! What the profiler costs: allocate + drop of a 4 KiB buffer through the manager with event recording off
//! (the default: only the always-on live table) and on, unlabelled and labelled; and the bare pool underneath
//! (allocate + free of the same block) for scale.
//!
//! `cargo bench --bench profiler`

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use umm::{AllocOptions, Placement, StreamId, UniversalMemoryManager};

const N: usize = 4096;

fn manager() -> UniversalMemoryManager {
    // The ring is kept small so the "on" case measures recording, not a growing buffer.
    UniversalMemoryManager::builder().backends(false, false, false).profile_capacity(1 << 12).build().unwrap()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("allocate_drop_4KiB");
    for (name, on, label) in [
        ("profiler_off", false, false),
        ("profiler_on", true, false),
        ("profiler_off_labelled", false, true),
        ("profiler_on_labelled", true, true),
    ] {
        let mm = manager();
        mm.profiler().set_enabled(on);
        let options = if label { AllocOptions::new().label("activations") } else { AllocOptions::new() };
        let options = options.placement(Placement::HostPinned);
        group.bench_function(name, |b| {
            b.iter(|| black_box(mm.allocate_universal_with::<u8>(black_box(N), options.clone()).unwrap()))
        });
    }
    let mm = manager();
    let buffer = mm.allocate_universal::<u8>(N, Placement::HostPinned).unwrap();
    let pool = buffer.pool().unwrap().clone();
    group.bench_function("bare_pool", |b| {
        b.iter(|| {
            let block = pool.allocate(black_box(N as u64), StreamId(0)).unwrap();
            pool.free(&block).unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
