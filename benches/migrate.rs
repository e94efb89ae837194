//! Migration bandwidth of 64 MiB buffers between pools of different APIs: host → OpenCL (PoCL here), OpenCL →
//! wgpu (lavapipe here), wgpu → host, and each API's device-local → device-local copy on its own device. Each
//! iteration is one [`UniversalBuffer::copy_to`]: the target block comes from the pool's cache after the first
//! iteration, so the time is the byte movement plus a cached allocation and free. Throughput is reported in GB/s
//! (10^9 bytes per second). A pair whose API is absent is skipped with a message.
//!
//! `cargo bench --bench migrate` (add `-- --quick` for a short run).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::Duration;
use umm::{Api, DeviceSelector, MigrateTo, Placement, UniversalBuffer, UniversalMemoryManager};

const BYTES: usize = 64 << 20;

/// Device-local memory on the first device reached through `api` (the host for `Api::Host`).
fn target(mm: &UniversalMemoryManager, api: Api) -> Option<MigrateTo> {
    if api == Api::Host {
        return Some(MigrateTo::new(Placement::Auto).device(DeviceSelector::Host));
    }
    let device = mm.devices().iter().find(|d| d.apis().contains(&api))?;
    Some(MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Index(device.index())))
}

fn migrate(c: &mut Criterion) {
    let mm = UniversalMemoryManager::builder().build().expect("a manager");
    let data: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8).collect();
    let mut group = c.benchmark_group("migrate_64MiB");
    group.throughput(Throughput::BytesDecimal(BYTES as u64)).sample_size(10).measurement_time(Duration::from_secs(5));
    let pairs = [
        (Api::Host, Api::OpenCl),
        (Api::OpenCl, Api::Wgpu),
        (Api::Wgpu, Api::Host),
        (Api::OpenCl, Api::OpenCl),
        (Api::Wgpu, Api::Wgpu),
    ];
    for (from, to) in pairs {
        let name = format!("{from}_to_{to}");
        let (Some(src_at), Some(dst_at)) = (target(&mm, from), target(&mm, to)) else {
            println!("migrate bench: skipping {name}: no {from} or no {to} device");
            continue;
        };
        let host = mm.allocate_universal_from(&data, Placement::Auto).expect("a source");
        let src: UniversalBuffer<u8> = host.migrate(&mm, src_at).expect("source placed");
        let probe = src.copy_to(&mm, dst_at).expect("a first migration");
        assert!(probe.to_vec().expect("readable") == data, "{name}: contents differ");
        println!(
            "migrate bench: {name}: [{}] {} -> [{}] {} via {}",
            src.device().index(),
            src.placement(),
            probe.device().index(),
            probe.placement(),
            probe.migrated_via().map_or("?".into(), |p| p.to_string())
        );
        drop(probe);
        group.bench_function(name, |b| b.iter(|| src.copy_to(&mm, dst_at).expect("migration")));
    }
    group.finish();
}

criterion_group!(benches, migrate);
criterion_main!(benches);
