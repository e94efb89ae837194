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

use clap::{Parser, ValueEnum};
use serde::Serialize;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use umm::backends::{Backend, BlockHandle, HostBackend, Pool, PoolConfig, SimBackend, StreamId};
use umm::{AllocOptions, HostInfo, Placement, UniversalBuffer, UniversalMemoryManager};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// Live blocks per thread.
const LIVE: usize = 16;
/// Ops between two reads of the clock: often enough to stop within microseconds of the deadline, rarely enough
/// that reading the clock is a small part of an op.
const CHECK_EVERY: u64 = 16;
/// The simulated device's capacity: it holds no bytes, so it may claim far more than any run reserves.
const SIM_CAPACITY: u64 = 1 << 40;
/// Every thread allocates and frees on the default stream: the threads contend for the same arenas, as threads
/// of a CPU program sharing one allocator do.
const STREAM: StreamId = StreamId(0);

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
enum Workload {
    Small,
    Large,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Small => "small",
            Workload::Large => "large",
        }
    }

    fn sizes(self) -> &'static [u64] {
        match self {
            Workload::Small => &[256, 4 * KIB, 64 * KIB, MIB],
            Workload::Large => &[2 * MIB, 8 * MIB, 32 * MIB, 64 * MIB],
        }
    }

    /// The most bytes `threads` threads can hold at once: every live block of the largest size.
    fn worst_case_bytes(self, threads: usize) -> u64 {
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

// ---------------------------------------------------------------------------------------------------------------
// The allocators under test, behind one small trait so that every one runs the same thread loop.

/// One allocator shared by every thread of a run.
trait Allocator: Send + Sync + 'static {
    type Block: Send;
    /// Allocates `bytes`; the error as text, so that the thread can report it after the start barrier.
    fn allocate(&self, bytes: u64) -> Result<Self::Block, String>;
    /// Returns a block; panics if the allocator refuses it (it handed the block out, so that is a bug).
    fn free(&self, block: Self::Block);
    /// Bytes allocated now, from the allocator's statistics.
    fn allocated_bytes(&self) -> u64;
    /// Device allocations (segments created, pages mapped) so far: the timed run should make few.
    fn device_allocs(&self) -> u64;
    /// Allocations served so far per device, for an allocator that chooses the device itself; empty otherwise.
    fn allocations_by_device(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}

/// Checks that a pool's block holds the request (a pool rounds up, never down).
fn checked_block(result: umm::backends::Result<BlockHandle>, bytes: u64) -> Result<BlockHandle, String> {
    let block = result.map_err(|e| format!("allocating {bytes} bytes failed: {e}"))?;
    if block.size() < bytes {
        return Err(format!("asked for {bytes} bytes, got a block of {}", block.size()));
    }
    Ok(block)
}

impl<B: Backend> Allocator for Pool<B> {
    type Block = BlockHandle;
    fn allocate(&self, bytes: u64) -> Result<BlockHandle, String> {
        checked_block(Pool::allocate(self, bytes, STREAM), bytes)
    }
    fn free(&self, block: BlockHandle) {
        Pool::free(self, &block).unwrap_or_else(|e| panic!("freeing {block:?} failed: {e}"));
    }
    fn allocated_bytes(&self) -> u64 {
        self.stats().allocated_bytes.current
    }
    fn device_allocs(&self) -> u64 {
        self.stats().num_device_alloc
    }
}

#[cfg(feature = "cuda")]
impl Allocator for umm::backends::cuda::CudaPool {
    type Block = BlockHandle;
    fn allocate(&self, bytes: u64) -> Result<BlockHandle, String> {
        checked_block(umm::backends::cuda::CudaPool::allocate(self, bytes, STREAM), bytes)
    }
    fn free(&self, block: BlockHandle) {
        umm::backends::cuda::CudaPool::free(self, &block).unwrap_or_else(|e| panic!("freeing {block:?} failed: {e}"));
    }
    fn allocated_bytes(&self) -> u64 {
        self.pool().stats().allocated_bytes.current
    }
    fn device_allocs(&self) -> u64 {
        self.pool().stats().num_device_alloc
    }
}

/// The whole manager: placement decision, usage tracking and profiler hooks around the device's pool. With
/// options, `allocate_universal_with` those options; else `allocate_universal(n, Placement::DeviceLocal)`.
struct Universal(UniversalMemoryManager, Option<AllocOptions>);

impl Allocator for Universal {
    type Block = UniversalBuffer<u8>;
    fn allocate(&self, bytes: u64) -> Result<UniversalBuffer<u8>, String> {
        let n = bytes as usize;
        let buffer = match &self.1 {
            None => self.0.allocate_universal::<u8>(n, Placement::DeviceLocal),
            Some(options) => self.0.allocate_universal_with::<u8>(n, options.clone()),
        }
        .map_err(|e| format!("allocate_universal of {bytes} bytes failed: {e}"))?;
        if buffer.len() != n {
            return Err(format!("asked for {n} bytes, got a buffer of {}", buffer.len()));
        }
        Ok(buffer)
    }
    fn free(&self, block: UniversalBuffer<u8>) {
        // Dropping a buffer returns its block to its pool.
        drop(block);
    }
    fn allocated_bytes(&self) -> u64 {
        self.0.global_memory_stats().total.allocated_bytes.current
    }
    fn device_allocs(&self) -> u64 {
        self.0.global_memory_stats().total.num_device_alloc
    }
    fn allocations_by_device(&self) -> Vec<(String, u64)> {
        self.0.global_memory_stats().devices.into_iter().map(|d| (d.name, d.total.num_allocs)).collect()
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The thread loop and its timing.

/// Marsaglia's xorshift64: a few instructions per number, so the generator costs little next to an op.
struct XorShift(u64);

impl XorShift {
    /// Seeded by the thread's index; the odd multiplier keeps every seed non-zero (zero is a fixed point).
    fn for_thread(index: usize) -> Self {
        Self((index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n`, from the high bits (the better-mixed ones).
    fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
}

/// What one thread did between the barrier and its deadline.
struct ThreadRun {
    pairs: u64,
    start: Instant,
    end: Instant,
}

/// One thread: fill 16 slots, wait for the others, then replace random slots until `secs` have passed, and free
/// everything (outside the timed part).
fn thread_body<A: Allocator>(
    allocator: &A,
    sizes: &[u64],
    index: usize,
    secs: Duration,
    barrier: &Barrier,
) -> ThreadRun {
    let mut rng = XorShift::for_thread(index);
    let filled: Result<Vec<Option<A::Block>>, String> =
        (0..LIVE).map(|_| allocator.allocate(sizes[rng.below(sizes.len())]).map(Some)).collect();
    // Every thread reaches the barrier, even one whose fill failed: a thread missing from it would leave the
    // others waiting for ever. The failure is reported right after.
    barrier.wait();
    let mut live = filled.unwrap_or_else(|e| panic!("thread {index}: {e}"));
    let start = Instant::now();
    let deadline = start + secs;
    let mut pairs = 0u64;
    let mut end = start;
    while end < deadline {
        for _ in 0..CHECK_EVERY {
            let slot = rng.below(LIVE);
            let bytes = black_box(sizes[rng.below(sizes.len())]);
            allocator.free(live[slot].take().expect("every slot holds a block between ops"));
            let block = allocator.allocate(bytes).unwrap_or_else(|e| panic!("thread {index}: {e}"));
            // The block is stored and freed later anyway; black_box keeps the compiler from reasoning about it.
            live[slot] = Some(black_box(block));
        }
        pairs += CHECK_EVERY;
        end = Instant::now();
    }
    for block in live.into_iter().flatten() {
        allocator.free(block);
    }
    ThreadRun { pairs, start, end }
}

/// One run of `threads` threads on `allocator`: total pairs and elapsed time.
struct Measurement {
    pairs: u64,
    elapsed: Duration,
}

/// Runs `threads` threads sharing `allocator` and joins them; a thread's panic is passed on.
fn run_threads<A: Allocator>(allocator: &Arc<A>, sizes: &'static [u64], threads: usize, secs: Duration) -> Measurement {
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|index| {
            let (allocator, barrier) = (Arc::clone(allocator), Arc::clone(&barrier));
            std::thread::spawn(move || thread_body(&*allocator, sizes, index, secs, &barrier))
        })
        .collect();
    let runs: Vec<ThreadRun> =
        handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect();
    // From the first thread's start to the last one's finish: a thread that was scheduled late (more threads than
    // cores) still counts its full time, and the others' time while it waited counts too.
    let first = runs.iter().map(|r| r.start).min().expect("at least one thread");
    let last = runs.iter().map(|r| r.end).max().expect("at least one thread");
    Measurement { pairs: runs.iter().map(|r| r.pairs).sum(), elapsed: last - first }
}

// ---------------------------------------------------------------------------------------------------------------
// Configurations, rows and the table.

/// One row of the table (and of the JSON file).
#[derive(Debug, Clone, Serialize)]
struct Row {
    pool: &'static str,
    device: String,
    workload: &'static str,
    threads: usize,
    pairs: u64,
    elapsed_s: f64,
    mops_per_s: f64,
    /// Over the 1-thread row of the same pool and workload (`None` when that one was skipped).
    speedup: Option<f64>,
    ns_per_pair_per_thread: f64,
    /// Segments created and pages mapped during the timed run (after the warm-up, a workload that fits what it
    /// reserved makes none).
    device_allocs: u64,
}

/// One allocator to measure: how to make a fresh one per configuration, and what it runs on.
struct Subject<A> {
    pool: &'static str,
    device: String,
    /// The memory that bounds how much the configuration may hold (`None`: no bound, the sim device).
    memory: Option<u64>,
    make: Box<dyn Fn() -> Arc<A>>,
    /// Run after each configuration (the shared manager gives its cached memory back here).
    reset: Box<dyn Fn(&A)>,
}

/// Every configuration of `subject`: a fresh allocator, a warm-up, the timed run, and the check that nothing
/// is left allocated.
fn bench<A: Allocator>(
    subject: &Subject<A>,
    workloads: &[Workload],
    thread_counts: &[usize],
    secs: Duration,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for &workload in workloads {
        let mut one_thread: Option<f64> = None;
        for &threads in thread_counts {
            let worst = workload.worst_case_bytes(threads);
            if let Some(memory) = subject.memory.filter(|&m| worst > m / 4 * 3) {
                println!(
                    "{:<10} {:<6} {threads:>7}  skipped: up to {:.1} GiB live, over 3/4 of {:.1} GiB (see --max-threads)",
                    subject.pool,
                    workload.name(),
                    worst as f64 / GIB,
                    memory as f64 / GIB
                );
                continue;
            }
            let allocator = (subject.make)();
            // Warm-up with the same seeds: the timed run starts on segments (and pages) that already exist.
            run_threads(&allocator, workload.sizes(), threads, secs);
            let (before, device_allocs) = (allocator.allocations_by_device(), allocator.device_allocs());
            let m = run_threads(&allocator, workload.sizes(), threads, secs);
            let device = served_by(&subject.device, &before, &allocator.allocations_by_device());
            let device_allocs = allocator.device_allocs() - device_allocs;
            let left = allocator.allocated_bytes();
            assert_eq!(left, 0, "{} {} {threads} threads: {left} bytes still allocated", subject.pool, workload.name());
            (subject.reset)(&allocator);
            let seconds = m.elapsed.as_secs_f64();
            let mops = m.pairs as f64 / seconds / 1e6;
            if threads == 1 {
                one_thread = Some(mops);
            }
            let row = Row {
                pool: subject.pool,
                device,
                workload: workload.name(),
                threads,
                pairs: m.pairs,
                elapsed_s: seconds,
                mops_per_s: mops,
                speedup: one_thread.map(|base| mops / base),
                ns_per_pair_per_thread: seconds * 1e9 * threads as f64 / m.pairs as f64,
                device_allocs,
            };
            print_row(&row);
            rows.push(row);
        }
    }
    rows
}

/// Where the timed run's allocations went: `fallback` for a pool of one device, else each device that served
/// any with its share (the manager may move requests between devices, under memory pressure for one).
fn served_by(fallback: &str, before: &[(String, u64)], after: &[(String, u64)]) -> String {
    // The manager's device list is fixed at discovery, so the two lists pair up by position.
    let served: Vec<(&str, u64)> = after
        .iter()
        .zip(before)
        .map(|((name, a), (_, b))| (name.as_str(), a.saturating_sub(*b)))
        .filter(|&(_, n)| n > 0)
        .collect();
    let total: u64 = served.iter().map(|&(_, n)| n).sum();
    match served[..] {
        [] => fallback.to_string(),
        [(name, _)] => name.to_string(),
        _ => served
            .iter()
            .map(|&(name, n)| match 100.0 * n as f64 / total as f64 {
                share if share < 0.5 => format!("{name} <1%"),
                share => format!("{name} {share:.0}%"),
            })
            .collect::<Vec<_>>()
            .join(", "),
    }
}

fn print_table_header() {
    println!(
        "{:<10} {:<6} {:>7} {:>10} {:>8} {:>16} {:>9}  served by",
        "pool", "load", "threads", "M ops/s", "speedup", "ns/pair/thread", "dev alloc"
    );
}

fn print_row(row: &Row) {
    let speedup = row.speedup.map_or("-".to_string(), |s| format!("{s:.2}x"));
    println!(
        "{:<10} {:<6} {:>7} {:>10.3} {:>8} {:>16.1} {:>9}  {}",
        row.pool,
        row.workload,
        row.threads,
        row.mops_per_s,
        speedup,
        row.ns_per_pair_per_thread,
        row.device_allocs,
        row.device
    );
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

// ---------------------------------------------------------------------------------------------------------------
// The subjects.

/// The bare pools' configuration: the default, with the `UMM_*` variables applied as the manager applies them
/// (`UMM_THREAD_CACHE=0` measures a pool without thread caches, say).
fn pool_config() -> PoolConfig {
    let mut config = umm::UmmConfig::default();
    config.apply_env().unwrap_or_else(|e| panic!("{e}"));
    config.pool
}

fn host_subject(host_memory: u64, need: u64) -> Subject<Pool<HostBackend>> {
    // The backend's capacity caps its largest segment: the machine's memory, or the run's need if unknown.
    let capacity = host_memory.max(need);
    Subject {
        pool: "host",
        device: "host memory".into(),
        memory: (host_memory > 0).then_some(host_memory),
        make: Box::new(move || {
            Arc::new(Pool::new(HostBackend::new("host", capacity), pool_config()).expect("host pool"))
        }),
        reset: Box::new(|_| {}),
    }
}

fn sim_subject(need: u64) -> Subject<Pool<SimBackend>> {
    let capacity = SIM_CAPACITY.max(need.saturating_mul(4));
    Subject {
        pool: "sim",
        device: "simulated device".into(),
        memory: None,
        make: Box::new(move || Arc::new(Pool::new(SimBackend::new("sim", capacity), pool_config()).expect("sim pool"))),
        reset: Box::new(|_| {}),
    }
}

/// The CUDA device pool of the first device, or why there is none. Discovery never fails: without a driver it
/// reports the reason.
#[cfg(feature = "cuda")]
fn cuda_subject() -> Result<Subject<umm::backends::cuda::CudaPool>, String> {
    use umm::backends::{cuda, PoolKind};
    let found = cuda::discover();
    let Some(device) = found.devices.into_iter().next() else {
        return Err(if found.skipped.is_empty() { "no CUDA device".into() } else { found.skipped.join("; ") });
    };
    let name = device.info().name.clone();
    println!("CUDA device: {name} ({:.1} GiB)", device.info().total_bytes as f64 / GIB);
    Ok(Subject {
        pool: "cuda",
        device: name,
        memory: Some(device.info().total_bytes),
        make: Box::new(move || {
            // `caching_pool` gives an `Arc<CudaPool>`: the pool with record-stream semantics, as users get it.
            device.caching_pool(PoolKind::DeviceLocal, pool_config()).expect("CUDA device pool")
        }),
        reset: Box::new(|_| {}),
    })
}

fn sim_wgpu_subject(need: u64) -> Subject<Pool<SimBackend>> {
    let capacity = SIM_CAPACITY.max(need.saturating_mul(4));
    Subject {
        pool: "sim-wgpu",
        device: "simulated device, a segment per block".into(),
        memory: None,
        make: Box::new(move || {
            Arc::new(Pool::new(SimBackend::segment_per_block("sim-wgpu", capacity), pool_config()).expect("sim pool"))
        }),
        reset: Box::new(|_| {}),
    }
}

/// The device-local pool of the first wgpu adapter, preferring one that is not a CPU (lavapipe, llvmpipe).
#[cfg(feature = "wgpu")]
fn wgpu_subject() -> Result<Subject<Pool<umm::backends::wgpu_backend::WgpuBackend>>, String> {
    use umm::backends::{wgpu_backend, PoolKind};
    let found = wgpu_backend::discover();
    let mut devices = found.devices;
    devices.sort_by_key(|d| d.adapter_info().device_type == wgpu_backend::wgpu::DeviceType::Cpu);
    let Some(device) = devices.into_iter().next() else {
        return Err(if found.skipped.is_empty() { "no wgpu adapter".into() } else { found.skipped.join("; ") });
    };
    let name = format!("{} ({:?})", device.info().name, device.adapter_info().backend);
    println!("wgpu device: {name}");
    Ok(Subject {
        pool: "wgpu",
        device: name,
        memory: Some(device.info().total_bytes),
        make: Box::new(move || Arc::new(device.pool(PoolKind::DeviceLocal, pool_config()).expect("wgpu pool"))),
        reset: Box::new(|_| {}),
    })
}

/// One manager for every configuration (discovery is slow); the probe allocation shows where DeviceLocal goes.
/// `wgpu`: on the wgpu device, and the manager sees only wgpu devices (and the host).
fn universal_subject(wgpu: bool) -> Result<Subject<Universal>, String> {
    let mm = if wgpu {
        UniversalMemoryManager::builder().backends(false, false, true).build()
    } else {
        UniversalMemoryManager::new()
    }
    .map_err(|e| format!("the manager could not be built: {e}"))?;
    let options = wgpu.then(|| {
        AllocOptions::new().placement(Placement::DeviceLocal).device(umm::DeviceSelector::Api(umm::Api::Wgpu))
    });
    let probe = match &options {
        None => mm.allocate_universal::<u8>(MIB as usize, Placement::DeviceLocal),
        Some(options) => mm.allocate_universal_with::<u8>(MIB as usize, options.clone()),
    }
    .map_err(|e| e.to_string())?;
    let device = probe.device().name().to_string();
    let memory = probe.device().total_bytes();
    let pool = if wgpu { "universal-wgpu" } else { "universal" };
    println!("{pool}: Placement::DeviceLocal lands on {device} ({} pool)", probe.placement());
    drop(probe);
    let shared = Arc::new(Universal(mm, options));
    Ok(Subject {
        pool,
        device,
        memory: Some(memory),
        make: Box::new(move || Arc::clone(&shared)),
        reset: Box::new(|u| {
            // So that each configuration warms up from an empty cache, as the fresh pools of the others do.
            u.0.release_all_cached();
        }),
    })
}

/// A subject made ready to run: discovery is done (and its lines printed) before the table starts.
type Planned = Box<dyn FnOnce(&[Workload], &[usize], Duration) -> Vec<Row>>;

fn planned<A: Allocator>(subject: Subject<A>) -> Planned {
    Box::new(move |workloads, counts, secs| bench(&subject, workloads, counts, secs))
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
