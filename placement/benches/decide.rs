//! What one placement decision costs (the front door's path when no earlier placement can be reused), and what
//! rendering its reason costs on top: a machine with the host, a discrete GPU and a software device, Auto and
//! explicit placements, with and without usage evidence.
//!
//! `cargo bench -p umm-placement --bench decide`

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::sync::Arc;
use umm_placement::{
    AccessPattern, Api, Decider, DeviceKind, DeviceView, Placement, PoolKind, Request, Thresholds, UsageTracker,
};

fn machine() -> Arc<[DeviceView]> {
    let gpu = DeviceView {
        index: 1,
        name: "NVIDIA H100 80GB HBM3".into(),
        kind: DeviceKind::DiscreteGpu,
        apis: vec![Api::Cuda, Api::OpenCl],
        shares_memory_with_host: false,
        total_bytes: 80 << 30,
        free_bytes: 70 << 30,
        cached_bytes: 0,
        pools: vec![PoolKind::DeviceLocal, PoolKind::ReadOnly, PoolKind::HostPinned],
        max_allocation: 0,
    };
    let cpu = DeviceView {
        index: 2,
        name: "llvmpipe (LLVM 15.0.7, 256 bits)".into(),
        kind: DeviceKind::Cpu,
        apis: vec![Api::Wgpu],
        shares_memory_with_host: true,
        total_bytes: 2 << 30,
        free_bytes: 2 << 30,
        cached_bytes: 0,
        pools: vec![PoolKind::DeviceLocal, PoolKind::HostPinned],
        max_allocation: 1 << 30,
    };
    vec![DeviceView::host(0, 64 << 30, 32 << 30), gpu, cpu].into()
}

fn bench(c: &mut Criterion) {
    let devices = machine();
    let decider = Decider::default();
    let tracker = UsageTracker::new(Thresholds::default()).expect("tracker");
    for _ in 0..100 {
        let id = tracker.register(1 << 20, Placement::Auto, AccessPattern::ReadWrite, PoolKind::DeviceLocal);
        tracker.record_host_read(&id, 1 << 20);
    }
    let evidence = tracker.recommendations();
    let mut group = c.benchmark_group("decide");
    for (name, req, ev) in [
        ("auto_4KiB", Request::new(4096), None),
        ("auto_1MiB_evidence", Request::new(1 << 20).access(AccessPattern::ReadWrite), Some(&evidence)),
        ("device_local_64MiB", Request::new(64 << 20).placement(Placement::DeviceLocal), None),
    ] {
        group.bench_function(name, |b| b.iter(|| black_box(decider.decide_shared(black_box(&req), &devices, ev))));
        let decision = decider.decide_shared(&req, &devices, ev).expect("a decision");
        group.bench_function(format!("{name}/reason"), |b| b.iter(|| black_box(decision.reason())));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
