//! Giving cached memory back between bursts.
//!
//! A pool keeps freed segments cached so the next burst allocates without asking the device. A cleanup round
//! releases the segments that sat unused for `cleanup_idle_rounds` rounds (2 by default, `UMM_CLEANUP_IDLE_ROUNDS`)
//! and lets old usage evidence decay. Part 1 runs rounds by hand after a burst and prints each
//! [`umm::CleanupReport`]; part 2 lets `start_periodic_cleanup` run them on a background thread during a bursty
//! workload and prints the reserved bytes as the cleaner gives them back.
//!
//! `cargo run --release --example periodic_cleanup`

use std::time::{Duration, Instant};
use umm::{Placement, UniversalBuffer, UniversalMemoryManager};

const MIB: usize = 1 << 20;

/// A burst: `count` buffers of 1 to 8 MiB, written once, all live together, then freed.
fn burst(mm: &UniversalMemoryManager, count: usize, seed: usize) -> Result<(), umm::Error> {
    let mut live: Vec<UniversalBuffer<u8>> = Vec::new();
    for i in 0..count {
        let mut x = mm.allocate_universal::<u8>((1 + (i * 7 + seed) % 8) * MIB, Placement::Auto)?;
        x.fill(i as u8)?;
        live.push(x);
    }
    Ok(())
}

fn reserved(mm: &UniversalMemoryManager) -> u64 {
    mm.global_memory_stats().total.reserved_bytes.current
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

fn main() -> Result<(), umm::Error> {
    let mm = UniversalMemoryManager::new()?;
    println!("cleanup releases segments idle for {} rounds", mm.config().cleanup_idle_rounds);

    // Part 1: rounds by hand.
    burst(&mm, 24, 0)?;
    println!("\npart 1: after a burst of 24 buffers, {} stay cached", mib(reserved(&mm)));
    for round in 1..=4 {
        let report = mm.cleanup();
        let per_device: Vec<String> = report
            .devices
            .iter()
            .filter(|d| d.bytes_released > 0)
            .map(|d| format!("[{}] {}: {}", d.index, d.name, mib(d.bytes_released)))
            .collect();
        println!(
            "  round {round}: released {} in {} segments ({:?}){}; {} still reserved",
            mib(report.bytes_released),
            report.segments_released,
            report.elapsed,
            if per_device.is_empty() { String::new() } else { format!(" from {}", per_device.join(", ")) },
            mib(reserved(&mm))
        );
    }

    // Part 2: a background cleaner every 100 ms while bursts come every 400 ms for 2 s, then a quiet second.
    println!("\npart 2: bursts every 400 ms with a cleaner every 100 ms");
    let cleaner = mm.start_periodic_cleanup(Duration::from_millis(100));
    let start = Instant::now();
    let mut last = u64::MAX;
    let mut next_burst = Duration::ZERO;
    let mut bursts = 0;
    while start.elapsed() < Duration::from_secs(3) {
        if start.elapsed() >= next_burst && start.elapsed() < Duration::from_secs(2) {
            burst(&mm, 16, bursts)?;
            bursts += 1;
            next_burst += Duration::from_millis(400);
            println!("  {:>5} ms: burst {bursts} done", start.elapsed().as_millis());
        }
        let now = reserved(&mm);
        if now != last {
            println!("  {:>5} ms: {} reserved", start.elapsed().as_millis(), mib(now));
            last = now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let rounds = cleaner.stop();
    println!("the cleaner ran {rounds} rounds; {} reserved at the end", mib(reserved(&mm)));
    Ok(())
}
