//! GPU→GPU migration against a raw peer copy, for every ordered pair of CUDA devices: the median time of
//! `migrate` of a 256 MiB buffer (a block from the target's pool, a peer copy, the source block back to its pool)
//! from plain (cuMemAlloc) and from virtual (cuMemCreate/cuMemMap) segments, beside a raw `cuMemcpyPeerAsync`
//! between two cuMemAlloc buffers with peer access enabled, then a synchronize. Prints one row per pair with both rates and umm's share of the raw rate; needs two or
//! more CUDA devices (says so and exits otherwise).
//!
//! `cargo run --release --example multi_gpu_migrate -- [ROUNDS]`

use std::time::{Duration, Instant};
use umm::backends::cuda::cudarc::driver::CudaContext;
use umm::{Api, DeviceSelector, MigrateTo, Placement, SegmentMode, UmmConfig, UniversalMemoryManager};

const BYTES: usize = 256 << 20;

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn gb_per_s(t: Duration) -> f64 {
    BYTES as f64 / t.as_secs_f64() / 1e9
}

fn manager(mode: SegmentMode) -> UniversalMemoryManager {
    let mut config = UmmConfig { cuda: true, opencl: false, wgpu: false, ..UmmConfig::default() };
    config.pool.segment_mode = mode;
    UniversalMemoryManager::builder().config(config).build().expect("a manager")
}

/// Median time of `rounds` migrations of a 256 MiB buffer from device `a` to device `b` (manager indices), each
/// followed by one back (untimed), after a warm-up round trip that fills both pools' caches.
fn umm_migration(mm: &UniversalMemoryManager, a: usize, b: usize, rounds: usize) -> Duration {
    let on = |g: usize| MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Index(g));
    let mut buf = mm
        .allocate_universal_with::<u8>(BYTES, umm::AllocOptions::new().device(DeviceSelector::Index(a)))
        .expect("a buffer on the first GPU");
    buf = buf.migrate(mm, on(b)).and_then(|x| x.migrate(mm, on(a))).expect("a warm-up round trip");
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        buf = buf.migrate(mm, on(b)).expect("a peer migration");
        times.push(start.elapsed());
        buf = buf.migrate(mm, on(a)).expect("a peer migration back");
    }
    median(times)
}

/// Median time of `rounds` raw peer copies of 256 MiB from CUDA ordinal `a` to ordinal `b`: `cuMemcpyPeerAsync`
/// between two `cuMemAlloc` buffers (not cudarc's stream-ordered allocations, whose pools would need their own
/// peer grants), with peer access enabled both ways, on the primary contexts umm uses, then a synchronize.
#[allow(unsafe_code)]
fn raw_peer_copy(a: usize, b: usize, rounds: usize) -> Duration {
    use umm::backends::cuda::cudarc::driver::result;
    let (ctx_a, ctx_b) = (CudaContext::new(a).expect("context"), CudaContext::new(b).expect("context"));
    let peer = umm::backends::cuda::enable_peer_access(&ctx_b, &ctx_a).expect("peer query")
        && umm::backends::cuda::enable_peer_access(&ctx_a, &ctx_b).expect("peer query");
    assert!(peer, "no peer access between cuda:{a} and cuda:{b}");
    ctx_a.bind_to_thread().expect("bind");
    // SAFETY: a plain device allocation in the bound context `a`; freed below in the same context.
    let src = unsafe { result::malloc_sync(BYTES) }.expect("source");
    // SAFETY: `src` is `BYTES` long and nothing else uses it.
    unsafe { result::memset_d8_sync(src, 7, BYTES) }.expect("memset");
    ctx_b.bind_to_thread().expect("bind");
    // SAFETY: as for `src`, in context `b`.
    let dst = unsafe { result::malloc_sync(BYTES) }.expect("destination");
    let stream = ctx_b.default_stream();
    let mut times = Vec::with_capacity(rounds);
    for round in 0..=rounds {
        let start = Instant::now();
        // SAFETY: both buffers are live allocations of `BYTES` in their contexts; the copy is waited for before
        // either is freed.
        unsafe { result::memcpy_peer_async(ctx_b.cu_ctx(), dst, ctx_a.cu_ctx(), src, BYTES, stream.cu_stream()) }
            .expect("peer copy");
        stream.synchronize().expect("sync");
        if round > 0 {
            times.push(start.elapsed());
        }
    }
    // SAFETY: allocated above in context `b` (bound), no work pending.
    unsafe { result::free_sync(dst) }.expect("free");
    ctx_a.bind_to_thread().expect("bind");
    // SAFETY: allocated above in context `a`, no work pending.
    unsafe { result::free_sync(src) }.expect("free");
    median(times)
}

fn main() {
    let rounds: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let (plain, virt) = (manager(SegmentMode::Plain), manager(SegmentMode::Auto));
    let ordinal = |index: usize| {
        plain.devices()[index].api_infos().iter().find(|i| i.api == Api::Cuda).map(|i| i.ordinal).expect("cuda")
    };
    let gpus: Vec<usize> =
        plain.devices().iter().filter(|d| d.apis().contains(&Api::Cuda)).map(|d| d.index()).collect();
    if gpus.len() < 2 {
        println!("{} CUDA device(s) found; this example needs two", gpus.len());
        return;
    }
    println!("migrate of {} MiB GPU->GPU, median of {rounds}, GB/s (share of the raw peer copy):", BYTES >> 20);
    println!("{:>8} {:>10} {:>16} {:>16}", "pair", "raw peer", "umm, plain", "umm, virtual");
    let mut worst = f64::INFINITY;
    for &a in &gpus {
        for &b in gpus.iter().filter(|&&b| b != a) {
            let raw = gb_per_s(raw_peer_copy(ordinal(a), ordinal(b), rounds));
            let p = gb_per_s(umm_migration(&plain, a, b, rounds));
            let v = gb_per_s(umm_migration(&virt, a, b, rounds));
            worst = worst.min(p / raw).min(v / raw);
            println!(
                "{:>8} {raw:>10.1} {p:>9.1} ({:>3.0}%) {v:>9.1} ({:>3.0}%)",
                format!("{a}->{b}"),
                100.0 * p / raw,
                100.0 * v / raw
            );
        }
    }
    println!("lowest share of the raw peer copy: {:.0}%", 100.0 * worst);
}
