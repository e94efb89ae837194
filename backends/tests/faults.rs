//! Fault injection ([`umm_backends::fault`]): the k-th call of a kind fails (creating a segment, reserving
//! address space, mapping pages, copying, settling, querying free memory) during replays of the shared traces, on
//! the simulated device in plain and virtual segment modes, with and without a limit, and during a conformance
//! workload on the host and simulated backends. At every failure the error names the call, the statistics match
//! the blocks the test holds and the memory the backend holds, and once the fault is gone the same request
//! succeeds; when the pool drops, every segment is destroyed and every page unmapped.
//!
//! The normal run samples about twenty values of k per kind, trace and scenario, on a prefix of the longer
//! traces, so that a debug build finishes in well under a minute. The full sweep, every k over every whole trace,
//! is `#[ignore]`d: `cargo test -p umm-backends --release --test faults -- --ignored --nocapture`.
//!
//! Traces come from the shared directory beside the repository (`../shared/traces`); without it, from the
//! samples committed in `examples/traces`.

use flate2::read::GzDecoder;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use umm_backends::testing::fault::{is_injected, FaultHandle, FaultKind, FaultyBackend};
use umm_backends::{
    BlockHandle, Error, HostBackend, Limit, MemoryPool, OwnedBlock, Pool, PoolConfig, SegmentMode, SimBackend, StreamId,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The kinds a trace replay calls (the simulated device holds no bytes, and a replay neither copies nor
/// settles; free memory is queried only for an out-of-memory report).
const TRACE_KINDS: [FaultKind; 5] = [
    FaultKind::CreateSegment,
    FaultKind::ReserveVirtual,
    FaultKind::MapPages,
    FaultKind::FreeBytes,
    FaultKind::AliasPages,
];

#[derive(Debug, Clone, Copy)]
enum Op {
    Alloc { slot: u32, bytes: u64, stream: u64 },
    Free { slot: u32 },
}

struct Trace {
    name: String,
    ops: Vec<Op>,
    slots: usize,
    /// The most bytes (requested) live at once.
    peak_live: u64,
}

/// Parses an `umm-trace v1` file (gzip-compressed): `a ID BYTES STREAM` allocates, `f ID` frees; IDs become
/// dense slots.
fn load(path: &Path) -> Trace {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let reader = BufReader::new(GzDecoder::new(file));
    let (mut ops, mut ids, mut vacant, mut slots) = (Vec::new(), HashMap::new(), Vec::new(), 0u32);
    let (mut live, mut peak_live, mut sizes) = (0u64, 0u64, HashMap::new());
    for (number, line) in reader.lines().enumerate() {
        let line = line.unwrap();
        if number == 0 {
            assert_eq!(line.trim(), "# umm-trace v1", "{}: not an umm trace", path.display());
        }
        let mut fields = line.split_ascii_whitespace();
        let op = fields.next();
        let mut numbers = fields.map(|f| f.parse::<u64>().unwrap_or_else(|_| panic!("{}: `{line}`", path.display())));
        match op {
            Some("a") => {
                let (id, bytes, stream) = (numbers.next().unwrap(), numbers.next().unwrap(), numbers.next().unwrap());
                let slot = vacant.pop().unwrap_or_else(|| {
                    slots += 1;
                    slots - 1
                });
                ids.insert(id, slot);
                sizes.insert(id, bytes);
                live += bytes;
                peak_live = peak_live.max(live);
                ops.push(Op::Alloc { slot, bytes, stream });
            }
            Some("f") => {
                let id = numbers.next().unwrap();
                let slot = ids.remove(&id).expect("free of a live block");
                live -= sizes.remove(&id).unwrap();
                vacant.push(slot);
                ops.push(Op::Free { slot });
            }
            _ => {}
        }
    }
    let name = path.file_name().unwrap().to_string_lossy().trim_end_matches(".trace.gz").to_string();
    Trace { name, ops, slots: slots as usize, peak_live }
}

/// The shared traces, or the committed samples when the shared directory is absent (said on stderr).
fn traces() -> &'static [Trace] {
    static TRACES: std::sync::OnceLock<Vec<Trace>> = std::sync::OnceLock::new();
    TRACES.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let shared = root.join("../shared/traces");
        let dir = if shared.is_dir() {
            shared
        } else {
            eprintln!("{} is absent: using the sample traces in examples/traces", shared.display());
            root.join("examples/traces")
        };
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(".trace.gz"))
            .collect();
        paths.sort();
        assert!(!paths.is_empty(), "no traces in {}", dir.display());
        paths.iter().map(|p| load(p)).collect()
    })
}

/// One pool setup a trace is replayed under.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    mode: SegmentMode,
    limit: Option<u64>,
}

/// Plain and virtual segments, each without a limit and with one: 2 GiB for the pressure trace (what it was
/// made for), else the trace's live peak plus a quarter and 64 MiB.
fn scenarios(trace: &Trace) -> Vec<Scenario> {
    let limit = if trace.name == "pressure" {
        2 * GIB
    } else {
        (trace.peak_live + trace.peak_live / 4 + 64 * MIB).div_ceil(2 * MIB) * 2 * MIB
    };
    let mut all = Vec::new();
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        for limit in [None, Some(limit)] {
            all.push(Scenario { mode, limit });
        }
    }
    all
}

/// A fault: the k-th call of `kind` fails, and with `persistent` every later one too until the request that
/// met it has failed.
#[derive(Debug, Clone, Copy)]
struct Fault {
    kind: FaultKind,
    k: u64,
    persistent: bool,
}

/// What one replay saw.
#[derive(Debug, Default, Clone)]
struct Outcome {
    /// Calls of each kind ([`FaultKind::ALL`] order).
    calls: [u64; 7],
    /// Calls failed by injection.
    injected: u64,
    /// Requests that returned an injected error (then succeeded once the fault was gone).
    failed: u64,
    /// Requests during which a fault fired but that succeeded all the same (the pool released its cache and
    /// retried).
    recovered: u64,
    /// Out-of-memory errors not caused by a fault.
    genuine_ooms: u64,
}

/// The blocks a replay holds, and what the pool's statistics must say about them.
#[derive(Default)]
struct Books {
    live: Vec<Option<BlockHandle>>,
    bytes: u64,
    requested: u64,
    count: u64,
    allocs: u64,
    frees: u64,
    errors: u64,
}

impl Books {
    fn hold(&mut self, slot: usize, block: BlockHandle) {
        self.bytes += block.size();
        self.requested += block.requested();
        self.count += 1;
        self.allocs += 1;
        self.live[slot] = Some(block);
    }

    fn release(&mut self, slot: usize) -> BlockHandle {
        let block = self.live[slot].take().expect("the trace frees a live block");
        self.bytes -= block.size();
        self.requested -= block.requested();
        self.count -= 1;
        self.frees += 1;
        block
    }
}

/// The pool's statistics against the test's books and the wrapper's ledger.
fn check_books<B: umm_backends::Backend>(pool: &Pool<B>, books: &Books, faults: &FaultHandle, at: &str) {
    let s = pool.stats();
    assert_eq!(s.allocated_bytes.current, books.bytes, "{at}: allocated bytes");
    assert_eq!(s.requested_bytes.current, books.requested, "{at}: requested bytes");
    assert_eq!(s.active_blocks.current, books.count, "{at}: live blocks");
    assert_eq!(s.num_allocs, books.allocs, "{at}: allocations served");
    assert_eq!(s.num_frees, books.frees, "{at}: frees");
    assert_eq!(s.num_ooms, books.errors, "{at}: failed allocations");
    assert_eq!(s.reserved_bytes.current, faults.resident_bytes(), "{at}: reserved bytes against the device's");
    assert_eq!(s.segments.current + s.stitched_ranges, faults.live_segments(), "{at}: segments against the device's");
    assert!(s.reserved_bytes.current >= s.allocated_bytes.current, "{at}: reserved below allocated");
    // Every call into the device's memory API is counted, failed or not; only those that succeeded allocated.
    let [create, reserve, map] =
        [FaultKind::CreateSegment, FaultKind::ReserveVirtual, FaultKind::MapPages].map(|k| faults.calls(k));
    let alias = faults.calls(FaultKind::AliasPages);
    let calls = create + reserve + map + alias + faults.unmap_calls() + faults.segments_destroyed();
    assert_eq!(s.num_device_calls, calls, "{at}: device calls");
    let failed = faults.injected(FaultKind::CreateSegment) + faults.injected(FaultKind::MapPages);
    assert_eq!(s.num_device_alloc, create + map - failed, "{at}: device allocations");
    if let Some(limit) = s.limit_bytes {
        assert!(
            s.reserved_bytes.current <= limit,
            "{at}: reserved {} over the limit {limit}",
            s.reserved_bytes.current
        );
    }
    let violations = faults.violations();
    assert!(violations.is_empty(), "{at}: {violations:?}");
}

/// The backend calls a fault of `kind` may name.
fn call_names(kind: FaultKind) -> &'static [&'static str] {
    match kind {
        FaultKind::Copy => &["write", "read", "fill"],
        FaultKind::CreateSegment => &["create_segment"],
        FaultKind::ReserveVirtual => &["reserve_virtual"],
        FaultKind::MapPages => &["map_pages"],
        FaultKind::Settle => &["settle"],
        FaultKind::FreeBytes => &["free_bytes"],
        FaultKind::AliasPages => &["alias_pages"],
    }
}

/// Replays `ops` on a fresh simulated device under `scenario`, with `fault` armed; panics on any broken rule.
/// `strict`: the fault-free replay ran out of memory nowhere, so every request must succeed once the fault is
/// gone.
fn replay(trace: &Trace, ops: &[Op], scenario: Scenario, fault: Option<Fault>, strict: bool) -> Outcome {
    let sim = match scenario.mode {
        SegmentMode::Plain => SimBackend::plain("sim-faulty", 64 * GIB),
        _ => SimBackend::new("sim-faulty", 64 * GIB),
    };
    let (backend, faults) = FaultyBackend::new(sim);
    let config =
        PoolConfig { segment_mode: scenario.mode, limit: scenario.limit.map(Limit::Bytes), ..PoolConfig::default() };
    let pool = Pool::new(backend, config).unwrap();
    let at = |i: usize| format!("{} {scenario:?} {fault:?} op {i}", trace.name);
    if let Some(f) = fault {
        if f.persistent {
            faults.fail_from(f.kind, f.k);
        } else {
            faults.fail_nth(f.kind, f.k);
        }
    }
    let mut books = Books { live: vec![None; trace.slots], ..Books::default() };
    let mut outcome = Outcome::default();
    for (i, &op) in ops.iter().enumerate() {
        match op {
            Op::Alloc { slot, bytes, stream } => {
                let before = faults.total_injected();
                match pool.allocate(bytes, StreamId(stream)) {
                    Ok(block) => {
                        books.hold(slot as usize, block);
                        if faults.total_injected() > before {
                            outcome.recovered += 1;
                            check_books(&pool, &books, &faults, &at(i));
                        }
                    }
                    Err(e) => {
                        books.errors += 1;
                        check_books(&pool, &books, &faults, &at(i));
                        let fired = faults.total_injected() > before;
                        if !is_injected(&e) {
                            // Out of memory under a limit, as in the fault-free replay (or a layout an earlier
                            // fault changed); never in a scenario whose fault-free replay had none.
                            assert!(e.is_out_of_memory() && !strict, "{}: {e}", at(i));
                            outcome.genuine_ooms += 1;
                            if fired {
                                faults.clear_all();
                            }
                            continue;
                        }
                        let f = fault.expect("only an armed fault is injected");
                        assert!(fired, "{}: an injected error from no fault: {e}", at(i));
                        let text = e.to_string();
                        assert!(
                            call_names(f.kind).iter().any(|c| text.contains(c)),
                            "{}: the error does not name the call: {text}",
                            at(i)
                        );
                        outcome.failed += 1;
                        faults.clear_all();
                        match pool.allocate(bytes, StreamId(stream)) {
                            Ok(block) => books.hold(slot as usize, block),
                            Err(e) if !strict && e.is_out_of_memory() && !is_injected(&e) => {
                                books.errors += 1;
                                outcome.genuine_ooms += 1;
                            }
                            Err(e) => panic!("{}: the request fails once the fault is gone: {e}", at(i)),
                        }
                        check_books(&pool, &books, &faults, &at(i));
                    }
                }
            }
            Op::Free { slot } => {
                // A block the trace frees may be missing only if its allocation failed for good (a genuine OOM).
                if books.live[slot as usize].is_none() {
                    continue;
                }
                let block = books.release(slot as usize);
                pool.free(&block).unwrap_or_else(|e| panic!("{}: {e}", at(i)));
            }
        }
        if i % 4096 == 0 {
            check_books(&pool, &books, &faults, &at(i));
        }
    }
    check_books(&pool, &books, &faults, &format!("{} end", at(ops.len())));
    for slot in 0..books.live.len() {
        if books.live[slot].is_some() {
            let block = books.release(slot);
            pool.free(&block).unwrap();
        }
    }
    check_books(&pool, &books, &faults, &format!("{} all freed", at(ops.len())));
    pool.release_cached();
    check_books(&pool, &books, &faults, &format!("{} released", at(ops.len())));
    drop(pool);
    faults.check_released().unwrap_or_else(|e| panic!("{} after the pool dropped: {e}", at(ops.len())));
    outcome.calls = FaultKind::ALL.map(|k| faults.calls(k));
    outcome.injected = faults.total_injected();
    outcome
}

/// Totals over a sweep.
#[derive(Debug, Default)]
struct Totals {
    replays: AtomicU64,
    injected: AtomicU64,
    failed: AtomicU64,
    recovered: AtomicU64,
    genuine_ooms: AtomicU64,
    /// Per kind: values of k replayed, faults injected, requests failed, requests recovered.
    by_kind: Mutex<std::collections::BTreeMap<FaultKind, [u64; 4]>>,
}

impl Totals {
    fn add(&self, o: &Outcome, fault: Option<Fault>) {
        self.replays.fetch_add(1, Ordering::Relaxed);
        self.injected.fetch_add(o.injected, Ordering::Relaxed);
        self.failed.fetch_add(o.failed, Ordering::Relaxed);
        self.recovered.fetch_add(o.recovered, Ordering::Relaxed);
        self.genuine_ooms.fetch_add(o.genuine_ooms, Ordering::Relaxed);
        if let Some(f) = fault {
            let mut by_kind = self.by_kind.lock().unwrap();
            let entry = by_kind.entry(f.kind).or_default();
            for (total, n) in entry.iter_mut().zip([1, o.injected, o.failed, o.recovered]) {
                *total += n;
            }
        }
    }

    fn report(&self, what: &str) {
        eprintln!(
            "{what}: {} replays, {} faults injected, {} requests failed with the injected error and then \
             succeeded, {} recovered inside the pool, {} out-of-memory errors without a fault (traces that \
             exceed their limit); 0 leaks, 0 panics, 0 wrong statistics",
            self.replays.load(Ordering::Relaxed),
            self.injected.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.recovered.load(Ordering::Relaxed),
            self.genuine_ooms.load(Ordering::Relaxed),
        );
        for (kind, [replays, injected, failed, recovered]) in self.by_kind.lock().unwrap().iter() {
            eprintln!(
                "  {kind}: {replays} faulted replays, {injected} faults injected, {failed} requests failed, \
                 {recovered} recovered"
            );
        }
    }
}

/// About `n` values spread over `1..=calls`, always with the first and the last.
fn spread(calls: u64, n: u64) -> Vec<u64> {
    if calls <= n {
        return (1..=calls).collect();
    }
    let mut ks: Vec<u64> = (0..n).map(|i| 1 + i * (calls - 1) / (n - 1)).collect();
    ks.dedup();
    ks
}

/// For every trace and scenario, a fault-free replay counts the calls of each kind; then each chosen k of each
/// kind (`pick` from the count) is replayed with a persistent fault and with a one-shot one. Replays run on
/// every core.
fn sweep(verbose: bool, pick: impl Fn(u64) -> Vec<u64> + Sync) -> Totals {
    let totals = Totals::default();
    let mut jobs: Vec<(&Trace, &[Op], Scenario, Fault, bool)> = Vec::new();
    for trace in traces() {
        let ops = &trace.ops[..];
        for scenario in scenarios(trace) {
            let clean = replay(trace, ops, scenario, None, false);
            let strict = clean.genuine_ooms == 0;
            if verbose {
                let calls: Vec<String> =
                    TRACE_KINDS.iter().map(|&k| format!("{k} {}", clean.calls[k as usize])).collect();
                eprintln!(
                    "{} ({} ops) {:?} limit {:?}: {}; {} out-of-memory errors without a fault",
                    trace.name,
                    ops.len(),
                    scenario.mode,
                    scenario.limit,
                    calls.join(", "),
                    clean.genuine_ooms
                );
            }
            totals.add(&clean, None);
            for kind in TRACE_KINDS {
                for k in pick(clean.calls[kind as usize]) {
                    for persistent in [true, false] {
                        jobs.push((trace, ops, scenario, Fault { kind, k, persistent }, strict));
                    }
                }
            }
        }
    }
    let jobs = Mutex::new(jobs);
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let Some((trace, ops, scenario, fault, strict)) = jobs.lock().unwrap().pop() else { break };
                let outcome = replay(trace, ops, scenario, Some(fault), strict);
                assert!(outcome.injected > 0, "{} {scenario:?} {fault:?}: the fault never fired", trace.name);
                // A fault on a stitched block's calls (its range's reservation, its second mappings) is not the
                // request's: the pool maps new pages instead, and the request may succeed.
                let stitch_may_absorb = matches!(fault.kind, FaultKind::ReserveVirtual | FaultKind::AliasPages);
                if fault.persistent && strict && fault.kind != FaultKind::FreeBytes && !stitch_may_absorb {
                    assert_eq!(outcome.failed, 1, "{} {scenario:?} {fault:?}: the request did not fail", trace.name);
                } else if fault.persistent && strict && stitch_may_absorb {
                    assert!(outcome.failed <= 1, "{} {scenario:?} {fault:?}: {} failed", trace.name, outcome.failed);
                }
                totals.add(&outcome, Some(fault));
            });
        }
    });
    totals
}

/// Twenty values of k per kind, trace and scenario.
#[test]
fn sampled_faults_over_every_shared_trace() {
    let totals = sweep(false, |calls| spread(calls, 20));
    totals.report("sampled sweep");
    assert!(totals.injected.load(Ordering::Relaxed) > 0);
}

/// Every k of every kind over every whole trace and scenario. Long: run it in release.
#[test]
#[ignore = "the full sweep: run in release with --ignored"]
fn every_fault_over_every_shared_trace() {
    let start = std::time::Instant::now();
    let totals = sweep(true, |calls| (1..=calls).collect());
    totals.report("full sweep");
    eprintln!("full sweep took {:.1} s", start.elapsed().as_secs_f64());
}

/// A conformance workload through [`MemoryPool`] and [`OwnedBlock`]: allocate (zeroed, filled), write, read,
/// fill, host slices, free, over blocks small and large, with the k-th call of each kind failing for every k.
/// On the host backend bytes are checked too.
fn conformance(pool: Arc<dyn MemoryPool>, faults: &FaultHandle, host: bool) -> u64 {
    let s0 = StreamId(0);
    let mut held: Vec<(BlockHandle, u8)> = Vec::new();
    let sizes = [64u64, 4096, 300_000, 3 * MIB, 12 * MIB];
    let mut failures = 0;
    for round in 0..3u8 {
        for (i, &size) in sizes.iter().enumerate() {
            let value = round * 16 + i as u8 + 1;
            // A zeroed block, then filled.
            let zeroed = if host { pool.allocate_zeroed(size, s0) } else { pool.allocate(size, s0) };
            let block = match zeroed {
                Ok(b) => b,
                Err(e) => {
                    assert!(is_injected(&e), "{e}");
                    failures += 1;
                    faults.clear_all();
                    pool.allocate(size, s0).unwrap()
                }
            };
            if host {
                if let Err(e) = pool.fill(&block, 0, size, value) {
                    assert!(is_injected(&e) && e.to_string().contains("fill"), "{e}");
                    failures += 1;
                    faults.clear_all();
                    pool.fill(&block, 0, size, value).unwrap();
                }
            }
            held.push((block, value));
            // A block filled from host data.
            let data = vec![value; size.min(8192) as usize];
            let filled = if host { pool.allocate_filled(&data, s0) } else { pool.allocate(data.len() as u64, s0) };
            match filled {
                Ok(b) => held.push((b, value)),
                Err(e) => {
                    assert!(is_injected(&e), "{e}");
                    failures += 1;
                }
            }
            // An owned block: write, host slice, dropped.
            let owned = match OwnedBlock::allocate(pool.clone(), size, s0, false) {
                Ok(b) => Some(b),
                Err(e) => {
                    assert!(is_injected(&e), "{e}");
                    failures += 1;
                    None
                }
            };
            if let (Some(mut owned), true) = (owned, host) {
                let data = vec![value; size.min(100) as usize];
                if let Err(e) = owned.write(0, &data) {
                    assert!(is_injected(&e) && e.to_string().contains("write"), "{e}");
                    failures += 1;
                }
                let settles = faults.calls(FaultKind::Settle);
                let injected = faults.injected(FaultKind::Settle);
                let slice = owned.host_bytes().map(<[u8]>::len);
                assert!(faults.calls(FaultKind::Settle) > settles, "a host slice without settling");
                if faults.injected(FaultKind::Settle) > injected {
                    assert_eq!(slice, None, "a host slice lent although settling failed");
                    failures += 1;
                } else {
                    assert_eq!(slice, Some(size as usize));
                }
            }
        }
        // Read back what is held, then free half.
        for (block, value) in held.iter().filter(|_| host) {
            let mut back = vec![0u8; block.requested().min(4096) as usize];
            match pool.read(block, 0, &mut back) {
                Ok(()) => assert!(back.iter().all(|b| b == value), "bytes read back differ"),
                Err(e) => {
                    assert!(is_injected(&e) && e.to_string().contains("read"), "{e}");
                    failures += 1;
                }
            }
        }
        let keep = held.len() / 2;
        for (block, _) in held.drain(keep..) {
            failures += free(&*pool, &block);
        }
        // Memory goes back to the device, so that the next round creates and maps again.
        pool.release_cached();
    }
    for (block, _) in held.drain(..) {
        failures += free(&*pool, &block);
    }
    failures
}

/// Frees `block`; with `poison_on_free` a failed poison write is reported, and the block is freed all the same.
/// Returns 1 for an injected failure.
fn free(pool: &dyn MemoryPool, block: &BlockHandle) -> u64 {
    match pool.free(block) {
        Ok(()) => 0,
        Err(e) => {
            assert!(is_injected(&e) && e.to_string().contains("fill"), "{e}");
            assert!(pool.free(block).unwrap_err().is_unknown_block(), "the block was freed all the same");
            1
        }
    }
}

/// Runs [`conformance`] fault-free to count calls, then once per k of every kind with the k-th call failing.
fn conformance_sweep(make: impl Fn() -> (Arc<dyn MemoryPool>, FaultHandle, bool), kinds: &[FaultKind]) -> u64 {
    let (pool, faults, host) = make();
    conformance(pool.clone(), &faults, host);
    let calls: HashMap<FaultKind, u64> = kinds.iter().map(|&k| (k, faults.calls(k))).collect();
    drop(pool);
    faults.check_released().unwrap();
    let mut injected = 0;
    for &kind in kinds {
        for k in 1..=calls[&kind] {
            let (pool, faults, host) = make();
            faults.fail_nth(kind, k);
            conformance(pool.clone(), &faults, host);
            let s = pool.stats();
            assert_eq!((s.allocated_bytes.current, s.active_blocks.current), (0, 0), "{kind} {k}: blocks left");
            assert_eq!(s.reserved_bytes.current, faults.resident_bytes(), "{kind} {k}");
            injected += faults.total_injected();
            assert_eq!(faults.injected(kind), 1, "{kind} {k}");
            drop(pool);
            faults.check_released().unwrap_or_else(|e| panic!("{kind} {k}: {e}"));
        }
    }
    injected
}

#[test]
fn conformance_workload_on_the_host_backend_survives_every_fault() {
    for (zero, poison) in [(false, false), (true, true)] {
        let make = || {
            let (backend, faults) = FaultyBackend::new(HostBackend::new("host-faulty", 16 * GIB));
            let config = PoolConfig { zero_on_alloc: zero, poison_on_free: poison, ..PoolConfig::default() };
            let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(backend, config).unwrap());
            (pool, faults, true)
        };
        let injected = conformance_sweep(make, &[FaultKind::CreateSegment, FaultKind::Copy, FaultKind::Settle]);
        eprintln!("host conformance (zero {zero}, poison {poison}): {injected} faults injected");
        assert!(injected > 0);
    }
}

#[test]
fn conformance_workload_on_the_simulated_device_survives_every_fault() {
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let make = || {
            let (backend, faults) = FaultyBackend::new(SimBackend::new("sim-faulty", 16 * GIB));
            let config = PoolConfig { segment_mode: mode, ..PoolConfig::default() };
            let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(backend, config).unwrap());
            (pool, faults, false)
        };
        let kinds = [FaultKind::CreateSegment, FaultKind::ReserveVirtual, FaultKind::MapPages];
        let injected = conformance_sweep(make, &kinds);
        eprintln!("sim conformance ({mode:?}): {injected} faults injected");
    }
}

/// The device query: a faulted `free_bytes` reports 0 bytes free, and the out-of-memory error a limit causes
/// says so without the statistics moving.
#[test]
fn a_faulted_free_memory_query_reports_nothing_free() {
    let (backend, faults) = FaultyBackend::new(SimBackend::plain("sim-faulty", 8 * GIB));
    let config = PoolConfig { limit: Some(Limit::Bytes(64 * MIB)), ..PoolConfig::default() };
    let pool = Pool::new(backend, config).unwrap();
    let a = pool.allocate(40 * MIB, StreamId(0)).unwrap();
    faults.fail_next(FaultKind::FreeBytes);
    match pool.allocate(40 * MIB, StreamId(0)).unwrap_err() {
        Error::OutOfMemory { free, cause, .. } => assert_eq!((free, cause), (0, None)),
        other => panic!("expected out of memory, got {other}"),
    }
    assert_eq!(faults.injected(FaultKind::FreeBytes), 1);
    match pool.allocate(40 * MIB, StreamId(0)).unwrap_err() {
        Error::OutOfMemory { free, .. } => assert!(free > 0),
        other => panic!("expected out of memory, got {other}"),
    }
    let s = pool.stats();
    assert_eq!((s.allocated_bytes.current, s.num_ooms), (40 * MIB, 2));
    pool.free(&a).unwrap();
    drop(pool);
    faults.check_released().unwrap();
}

/// A device error that outlasts the pool's retry is reported as out of memory with the device's error, naming
/// the call, as its cause; a one-shot fault is cured by the retry.
#[test]
fn a_persistent_device_fault_names_the_call_in_the_out_of_memory_error() {
    for (mode, kind) in [
        (SegmentMode::Plain, FaultKind::CreateSegment),
        (SegmentMode::Virtual, FaultKind::ReserveVirtual),
        (SegmentMode::Virtual, FaultKind::MapPages),
    ] {
        let (backend, faults) = FaultyBackend::new(SimBackend::new("sim-faulty", 8 * GIB));
        let pool = Pool::new(backend, PoolConfig { segment_mode: mode, ..PoolConfig::default() }).unwrap();
        faults.fail_from(kind, 1);
        let err = pool.allocate(64 * MIB, StreamId(0)).unwrap_err();
        let text = err.to_string();
        assert!(err.is_out_of_memory() && is_injected(&err), "{text}");
        assert!(text.contains(kind.call()) && text.contains("injected fault"), "{text}");
        faults.clear_all();
        faults.fail_next(kind);
        let block = pool.allocate(64 * MIB, StreamId(0)).expect("the retry cures a one-shot fault");
        assert_eq!(faults.injected(kind), 3, "two failed calls of the persistent fault, one of the one-shot");
        let s = pool.stats();
        assert_eq!((s.num_ooms, s.num_alloc_retries, s.allocated_bytes.current), (1, 2, 64 * MIB));
        assert_eq!(s.reserved_bytes.current, faults.resident_bytes());
        pool.free(&block).unwrap();
        drop(pool);
        faults.check_released().unwrap();
    }
}

/// Regression: with `poison_on_free`, a block whose poison could not be written stayed live for the pool's life
/// (an owned block's drop could not free it: allocated bytes never came back); and on a backend that holds no
/// bytes (the simulated device) no block could be freed at all.
#[test]
fn a_failed_poison_write_still_frees_the_block() {
    let (backend, faults) = FaultyBackend::new(HostBackend::new("host-faulty", 16 * GIB));
    let config = PoolConfig { poison_on_free: true, ..PoolConfig::default() };
    let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(backend, config).unwrap());
    let owned = OwnedBlock::allocate(pool.clone(), 4 * MIB, StreamId(0), false).unwrap();
    faults.fail_next(FaultKind::Copy);
    drop(owned);
    assert_eq!(faults.injected(FaultKind::Copy), 1);
    let block = pool.allocate(4 * MIB, StreamId(0)).unwrap();
    faults.fail_next(FaultKind::Copy);
    let err = pool.free(&block).unwrap_err();
    assert!(is_injected(&err) && err.to_string().contains("fill"), "{err}");
    let s = pool.stats();
    assert_eq!((s.allocated_bytes.current, s.active_blocks.current, s.num_frees), (0, 0, 2));
    assert!(pool.free(&block).unwrap_err().is_unknown_block(), "freed once, all the same");
    drop(pool);
    faults.check_released().unwrap();

    let config = PoolConfig { poison_on_free: true, ..PoolConfig::default() };
    let sim = Pool::new(SimBackend::new("sim0", 8 * GIB), config).unwrap();
    let block = sim.allocate(4 * MIB, StreamId(0)).unwrap();
    sim.free(&block).expect("nothing to poison on a device without bytes");
    assert_eq!(sim.stats().allocated_bytes.current, 0);
}

/// A batch is all or nothing: when the k-th device call of the batch fails for good, the blocks already taken
/// go back, the statistics say nothing is allocated, and the same batch succeeds once the fault is gone.
#[test]
fn a_batch_that_meets_a_fault_takes_nothing() {
    let sizes: Vec<u64> = (0..24).map(|i| [4096, 700_000, 3 * MIB, 30 * MIB][i % 4] + i as u64).collect();
    for (mode, kinds) in [
        (SegmentMode::Plain, &[FaultKind::CreateSegment][..]),
        (SegmentMode::Virtual, &[FaultKind::CreateSegment, FaultKind::ReserveVirtual, FaultKind::MapPages][..]),
    ] {
        let make = || {
            let (backend, faults) = FaultyBackend::new(SimBackend::new("sim-faulty", 16 * GIB));
            let config = PoolConfig { segment_mode: mode, ..PoolConfig::default() };
            (Pool::new(backend, config).unwrap(), faults)
        };
        let (pool, faults) = make();
        let blocks = pool.allocate_batch(&sizes, StreamId(0)).unwrap();
        let calls = FaultKind::ALL.map(|k| faults.calls(k));
        for block in &blocks {
            pool.free(block).unwrap();
        }
        for &kind in kinds {
            for k in 1..=calls[kind as usize] {
                let (pool, faults) = make();
                faults.fail_from(kind, k);
                let err = pool.allocate_batch(&sizes, StreamId(0)).unwrap_err();
                assert!(is_injected(&err) && err.to_string().contains(kind.call()), "{mode:?} {kind} {k}: {err}");
                let s = pool.stats();
                let at = format!("{mode:?} {kind} {k}");
                assert_eq!((s.allocated_bytes.current, s.active_blocks.current), (0, 0), "{at}");
                assert_eq!(s.reserved_bytes.current, faults.resident_bytes(), "{at}");
                assert_eq!(s.segments.current, faults.live_segments(), "{at}");
                faults.clear_all();
                let blocks = pool.allocate_batch(&sizes, StreamId(0)).unwrap();
                assert_eq!(pool.stats().active_blocks.current, sizes.len() as u64, "{at}");
                for block in &blocks {
                    pool.free(block).unwrap();
                }
                drop(pool);
                faults.check_released().unwrap_or_else(|e| panic!("{at}: {e}"));
            }
        }
    }
}

/// Threads allocating and freeing through their caches while faults come and go: every error is the injected
/// one (or out of memory under the limit), and the books balance once everything is freed.
#[test]
fn faults_under_contention_leave_the_books_exact() {
    for mode in [SegmentMode::Plain, SegmentMode::Virtual] {
        let (backend, faults) = FaultyBackend::new(SimBackend::new("sim-faulty", 16 * GIB));
        let config = PoolConfig { segment_mode: mode, limit: Some(Limit::Bytes(GIB)), ..PoolConfig::default() };
        let pool = Pool::new(backend, config).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (errors, requests) = (AtomicU64::new(0), AtomicU64::new(0));
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let (pool, stop, errors, requests) = (&pool, &stop, &errors, &requests);
                scope.spawn(move || {
                    let mut held: Vec<BlockHandle> = Vec::new();
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t;
                    // At least 4,000 requests, and on until the faults stop coming.
                    let mut i = 0u64;
                    while i < 4000 || !stop.load(Ordering::Relaxed) {
                        i += 1;
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let bytes = if x.is_multiple_of(4) { 1 + x % (24 * MIB) } else { 1 + x % (256 << 10) };
                        requests.fetch_add(1, Ordering::Relaxed);
                        match pool.allocate(bytes, StreamId(t % 2)) {
                            Ok(block) => held.push(block),
                            Err(e) => {
                                assert!(is_injected(&e) || e.is_out_of_memory(), "{e}");
                                errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        if held.len() > 40 || (i.is_multiple_of(3) && !held.is_empty()) {
                            let block = held.swap_remove((x % held.len() as u64) as usize);
                            pool.free(&block).unwrap();
                        }
                    }
                    for block in held {
                        pool.free(&block).unwrap();
                    }
                });
            }
            // Faults come and go while the threads work.
            scope.spawn(|| {
                for round in 0..200u64 {
                    let kind =
                        [FaultKind::CreateSegment, FaultKind::ReserveVirtual, FaultKind::MapPages][round as usize % 3];
                    let (armed, asked) = (faults.injected(kind), requests.load(Ordering::Relaxed));
                    faults.fail_from(kind, faults.calls(kind) + 1 + round % 3);
                    // The fault stays until a worker has met it, or until the workers have made 64 more requests
                    // without making that call: synchronised by the workers' own counts, not by a clock.
                    while faults.injected(kind) == armed && requests.load(Ordering::Relaxed) < asked + 64 {
                        std::thread::yield_now();
                    }
                    faults.clear_all();
                    if round.is_multiple_of(16) {
                        pool.release_cached();
                    }
                }
                stop.store(true, Ordering::Relaxed);
            });
        });
        faults.clear_all();
        let s = pool.stats();
        assert_eq!((s.allocated_bytes.current, s.requested_bytes.current, s.active_blocks.current), (0, 0, 0));
        assert_eq!(s.num_ooms, errors.load(Ordering::Relaxed), "{mode:?}: failed allocations");
        assert_eq!(s.reserved_bytes.current, faults.resident_bytes(), "{mode:?}");
        assert_eq!(s.segments.current + s.stitched_ranges, faults.live_segments(), "{mode:?}");
        let next = pool.allocate(64 * MIB, StreamId(0)).expect("the pool serves once the faults are gone");
        pool.free(&next).unwrap();
        eprintln!("contention ({mode:?}): {} faults injected, {} requests failed", faults.total_injected(), s.num_ooms);
        assert!(faults.total_injected() > 0 && s.num_ooms > 0, "{mode:?}: the workers met the faults");
        drop(pool);
        faults.check_released().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
    }
}
