//! The main job: discover every device, place buffers of each size class with `Auto`, move data through them,
//! ask for recommendations, clean up, and print the statistics.
//!
//! `cargo run --release --example quickstart`

use umm::{AccessPattern, AllocOptions, Placement, UniversalMemoryManager};

fn main() -> Result<(), umm::Error> {
    let mm = UniversalMemoryManager::new()?;
    println!("devices:");
    for device in mm.devices() {
        println!("  {device}");
    }
    for reason in mm.skipped() {
        println!("  (skipped: {reason})");
    }

    // One buffer per size class, placed by the decision table.
    for n in [1_000usize, 1 << 18, 1 << 23] {
        let mut x = mm.allocate_universal::<f32>(n, Placement::Auto)?;
        let input: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        x.write(&input)?;
        let out = x.to_vec()?;
        assert_eq!(out, input, "round trip through {} changed the data", x.placement());
        println!("\n{:>9} f32 -> {} on {}\n  why: {}", n, x.placement(), x.device().name(), x.decision().reason());
    }

    // Read-only weights, filled once; a staging buffer the host touches often.
    let weights: Vec<f32> = (0..4096).map(|i| (i as f32).sin()).collect();
    let w = mm.allocate_universal_from(&weights, Placement::ReadOnly)?;
    println!("\nweights -> {} ({})", w.placement(), w.decision().reason());
    let staging = mm.allocate_universal_with::<u8>(
        1 << 20,
        AllocOptions::new().access(AccessPattern::HostFrequent).label("staging").zeroed(true),
    )?;
    assert!(staging.to_vec()?.iter().all(|&b| b == 0));
    println!("staging -> {} ({})", staging.placement(), staging.decision().reason());

    // A training-loop-like churn: the pool serves repeats from cache.
    for _ in 0..1000 {
        let _activations = mm.allocate_universal::<f32>(1 << 16, Placement::DeviceLocal)?;
    }

    println!("\nrecommendations:");
    for rec in &mm.placement_recommendations().items {
        println!("  {rec}");
    }
    drop((w, staging));
    let released = mm.release_all_cached();
    println!(
        "\ncleanup released {} bytes in {} segments in {:?}",
        released.bytes_released, released.segments_released, released.elapsed
    );
    let stats = mm.global_memory_stats();
    println!(
        "\ntotal: {} allocations, {:.1}% cache hits, peak reserved {} bytes, peak allocated {} bytes",
        stats.total.num_allocs,
        100.0 * stats.total.hit_rate(),
        stats.total.reserved_bytes.peak,
        stats.total.allocated_bytes.peak
    );
    Ok(())
}
