//! The front door against the pool under it: `allocate_universal_with::<f32>(1024, …)` + drop on a manager with
//! every device this machine has, for `Auto`, `DeviceLocal`, `HostPinned` and `Auto` with an access pattern,
//! each beside allocate + free of the same size on the very pool those buffers land in.
//!
//! `cargo bench --bench facade` (`UMM_BACKENDS` and the other `UMM_*` variables apply).

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use umm::{AccessPattern, AllocOptions, Placement, StreamId, UniversalMemoryManager};

const N: usize = 1024;

fn bench(c: &mut Criterion) {
    let mm = UniversalMemoryManager::new().expect("a manager");
    let mut group = c.benchmark_group("allocate_drop_4KiB");
    for (name, options) in [
        ("auto", AllocOptions::new().placement(Placement::Auto)),
        ("device_local", AllocOptions::new().placement(Placement::DeviceLocal)),
        ("host_pinned", AllocOptions::new().placement(Placement::HostPinned)),
        ("auto_read_write", AllocOptions::new().placement(Placement::Auto).access(AccessPattern::ReadWrite)),
    ] {
        let probe = mm.allocate_universal_with::<f32>(N, options.clone()).expect("a buffer");
        let pool = probe.pool().expect("a non-empty buffer has a pool").clone();
        let device = probe.device().name().to_string();
        drop(probe);
        group.bench_function(format!("{name}/manager ({device})"), |b| {
            b.iter(|| black_box(mm.allocate_universal_with::<f32>(black_box(N), options.clone()).unwrap()))
        });
        group.bench_function(format!("{name}/bare_pool ({device})"), |b| {
            b.iter(|| {
                let block = pool.allocate(black_box((N * 4) as u64), StreamId(0)).unwrap();
                pool.free(&block).unwrap();
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
