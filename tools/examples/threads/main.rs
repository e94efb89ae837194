//! Thread scaling: how many allocate+free pairs per second one shared pool serves as threads are added.
//!
//! For 1, 2, 4, 8 and 16 threads (and the machine's core count when it is not among them), every thread shares
//! ONE allocator through an `Arc`: the bare host pool (`Pool<HostBackend>`), the simulated device's pool
//! (`Pool<SimBackend>`), the CUDA device pool (`CudaPool`, where a CUDA device is found), and
//! `UniversalMemoryManager::allocate_universal::<u8>(n, Placement::DeviceLocal)` + drop on one manager. On request
//! (`--pools`): `sim-wgpu` (the simulated device with a segment per block, as wgpu pools have), `wgpu` (the
//! device-local pool of the first wgpu adapter, a hardware one where there is one) and `universal-wgpu`
//! (`allocate_universal` with `DeviceLocal` on the wgpu device).
//!
//! Each thread keeps 16 live blocks; one op frees a random one of them and allocates a new random size into its
//! slot (one op = one allocate+free pair). Sizes come from {256 B, 4 KiB, 64 KiB, 1 MiB} (`small`) or
//! {2, 8, 32, 64} MiB (`large`), drawn by a xorshift generator per thread, seeded by the thread's index, so every
//! run asks for the same sequence. Each configuration gets a fresh pool, a warm-up run of the same length (so
//! the first touch of new memory is not what is timed), then the timed run: all threads start at a barrier and
//! run for `--secs`; ops/s is all pairs over the time from the first thread's start to the last one's finish.
//!
//! `cargo run --release --example threads -- [--secs 0.3] [--max-threads N] [--workloads small,large]
//!  [--pools host,sim,cuda,universal,sim-wgpu,wgpu,universal-wgpu] [--json rows.json]`
//!
//! The large workload holds up to threads × 16 × 64 MiB at once (about 26 MiB a block on average: 7 GiB of host
//! memory at 16 threads); a configuration whose worst case exceeds 3/4 of its device's memory is skipped with
//! the reason, and `--max-threads`, `--workloads` and `--pools` cut the run down.

mod allocators;
mod bench;
mod subjects;
mod timing;

use bench::{planned, Planned};
use bench::{print_table_header, Row};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;
#[cfg(feature = "cuda")]
use subjects::cuda_subject;
#[cfg(feature = "wgpu")]
use subjects::wgpu_subject;
use subjects::{host_subject, sim_subject, sim_wgpu_subject, universal_subject};
use umm::HostInfo;

const KIB: u64 = 1 << 10;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: f64 = (1u64 << 30) as f64;
/// Live blocks per thread.
pub(crate) const LIVE: usize = 16;

#[derive(Parser, Debug)]
#[command(about = "allocate+free pairs per second on one shared pool, by thread count")]
struct Args {
    /// Seconds each configuration runs (the warm-up before it runs as long).
    #[arg(long, default_value_t = 0.3)]
    secs: f64,
    /// The most threads to run (default: 16, or the core count when larger).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_threads: Option<u64>,
    /// Workloads to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "small,large")]
    workloads: Vec<Workload>,
    /// Allocators to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "host,sim,cuda,universal")]
    pools: Vec<PoolKind>,
    /// Also write the rows as a JSON array of objects to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Workload {
    Small,
    Large,
}

impl Workload {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Workload::Small => "small",
            Workload::Large => "large",
        }
    }

    pub(crate) fn sizes(self) -> &'static [u64] {
        match self {
            Workload::Small => &[256, 4 * KIB, 64 * KIB, MIB],
            Workload::Large => &[2 * MIB, 8 * MIB, 32 * MIB, 64 * MIB],
        }
    }

    /// The most bytes `threads` threads can hold at once: every live block of the largest size.
    pub(crate) fn worst_case_bytes(self, threads: usize) -> u64 {
        threads as u64 * LIVE as u64 * self.sizes().iter().max().copied().unwrap_or(0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PoolKind {
    Host,
    Sim,
    Cuda,
    Universal,
    SimWgpu,
    Wgpu,
    UniversalWgpu,
}

/// 1, 2, 4, 8, 16 and the core count, up to `max`, in order.
fn thread_counts(cores: usize, max: usize) -> Vec<usize> {
    let mut counts: Vec<usize> = [1, 2, 4, 8, 16, cores].into_iter().filter(|&t| t <= max).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// The processor's model name from /proc/cpuinfo, or "unknown" (other systems, or no such line).
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn main() {
    let args = Args::parse();
    assert!(args.secs.is_finite() && args.secs > 0.0, "--secs must be a positive number of seconds");
    let secs = Duration::from_secs_f64(args.secs);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max_threads = args.max_threads.map_or(cores.max(16), |m| m as usize);
    let counts = thread_counts(cores, max_threads);
    let host_memory = HostInfo::discover().total_bytes;
    let need = args.workloads.iter().map(|w| w.worst_case_bytes(max_threads)).max().unwrap_or(0);

    println!("CPU: {} ({cores} cores)", cpu_model());
    println!("host memory: {:.1} GiB", host_memory as f64 / GIB);
    println!(
        "threads {counts:?}; {LIVE} live blocks per thread; {} s per configuration after a warm-up as long",
        args.secs
    );
    let mut plans: Vec<Planned> = Vec::new();
    for kind in &args.pools {
        match kind {
            PoolKind::Host => plans.push(planned(host_subject(host_memory, need))),
            PoolKind::Sim => plans.push(planned(sim_subject(need))),
            #[cfg(feature = "cuda")]
            PoolKind::Cuda => match cuda_subject() {
                Ok(subject) => plans.push(planned(subject)),
                Err(reason) => println!("cuda: skipped: {reason}"),
            },
            #[cfg(not(feature = "cuda"))]
            PoolKind::Cuda => println!("cuda: skipped: built without the `cuda` feature"),
            PoolKind::Universal | PoolKind::UniversalWgpu => {
                let wgpu = *kind == PoolKind::UniversalWgpu;
                match universal_subject(wgpu) {
                    Ok(subject) => plans.push(planned(subject)),
                    Err(reason) => println!("{kind:?}: skipped: {reason}"),
                }
            }
            PoolKind::SimWgpu => plans.push(planned(sim_wgpu_subject(need))),
            #[cfg(feature = "wgpu")]
            PoolKind::Wgpu => match wgpu_subject() {
                Ok(subject) => plans.push(planned(subject)),
                Err(reason) => println!("wgpu: skipped: {reason}"),
            },
            #[cfg(not(feature = "wgpu"))]
            PoolKind::Wgpu => println!("wgpu: skipped: built without the `wgpu` feature"),
        }
    }
    println!();
    print_table_header();
    let rows: Vec<Row> = plans.into_iter().flat_map(|run| run(&args.workloads, &counts, secs)).collect();
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&rows).expect("rows serialise");
        std::fs::write(path, text + "\n").unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        println!("\n{} rows written to {}", rows.len(), path.display());
    }
}
