//! Per-GPU pools under threads: allocate + drop pairs per second through `allocate_universal` with one thread on
//! one GPU, then one thread per GPU at once (each on its own device), small mixed sizes (256 B–1 MiB, 16 live per
//! thread). Prints both rates and the speedup; needs two or more CUDA devices (says so and exits otherwise).
//!
//! `cargo run --release --example multi_gpu_threads -- [SECONDS]`

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use umm::{AllocOptions, DeviceSelector, Placement, UmmConfig, UniversalBuffer, UniversalMemoryManager};

const SIZES: [usize; 4] = [256, 4 << 10, 64 << 10, 1 << 20];
const LIVE: usize = 16;

/// Runs one thread per entry of `gpus` for `secs`, each allocating on its own GPU; returns all pairs per second.
fn run(mm: &Arc<UniversalMemoryManager>, gpus: &[usize], secs: f64) -> f64 {
    let barrier = Arc::new(Barrier::new(gpus.len()));
    let threads: Vec<_> = gpus
        .iter()
        .enumerate()
        .map(|(i, &gpu)| {
            let (mm, barrier) = (Arc::clone(mm), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let options = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(gpu));
                let mut rng = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let mut live: Vec<UniversalBuffer<u8>> = (0..LIVE)
                    .map(|_| mm.allocate_universal_with::<u8>(SIZES[next() as usize % 4], options.clone()).unwrap())
                    .collect();
                barrier.wait();
                let (start, mut pairs) = (Instant::now(), 0u64);
                while start.elapsed() < Duration::from_secs_f64(secs) {
                    for _ in 0..16 {
                        let slot = next() as usize % LIVE;
                        live[slot] =
                            mm.allocate_universal_with::<u8>(SIZES[next() as usize % 4], options.clone()).unwrap();
                        pairs += 1;
                    }
                }
                (pairs, start.elapsed())
            })
        })
        .collect();
    let results: Vec<(u64, Duration)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let longest = results.iter().map(|r| r.1).max().unwrap_or_default();
    results.iter().map(|r| r.0).sum::<u64>() as f64 / longest.as_secs_f64()
}

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0.5);
    let config = UmmConfig { cuda: true, opencl: false, wgpu: false, ..UmmConfig::default() };
    let mm = Arc::new(UniversalMemoryManager::builder().config(config).build().expect("a manager"));
    let gpus: Vec<usize> =
        mm.devices().iter().filter(|d| d.apis().contains(&umm::Api::Cuda)).map(|d| d.index()).collect();
    if gpus.len() < 2 {
        println!("{} CUDA device(s) found; this example needs two", gpus.len());
        return;
    }
    // Warm-up: each GPU's pool fills its caches.
    run(&mm, &gpus, secs / 4.0);
    let one = run(&mm, &gpus[..1], secs);
    let all = run(&mm, &gpus, secs);
    println!("allocate_universal + drop, DeviceLocal, small mixed sizes, {LIVE} live per thread, {secs} s:");
    println!("  1 thread on GPU [{}]: {:.2} M pairs/s", gpus[0], one / 1e6);
    println!("  {} threads, one per GPU: {:.2} M pairs/s ({:.2}x)", gpus.len(), all / 1e6, all / one);
}
