//! Replays a [`Trace`] through a pool and reports what it cost: memory (peak reserved against the trace's own
//! peak of live bytes) and time per op, cold (a fresh pool) and warm (the same pool again, caches full).
//!
//! The loop is generic over the backend (`Pool<B>`, monomorphised, no dynamic dispatch) and keeps live blocks
//! in a `Vec` indexed by the trace's dense slots, so it measures the pool and little else. Only the op loop is
//! timed.

use serde::Serialize;
use std::time::{Duration, Instant};
use thiserror::Error;
use umm::trace::{Op, Trace};
use umm_backends::{Backend, BlockHandle, HostBackend, Limit, Pool, PoolConfig, SimBackend, StreamId};

/// Backends `umm replay` knows, in the order they are listed to users.
pub const BACKENDS: &[&str] = &[
    "sim",
    "sim-plain",
    "sim-wgpu",
    "host",
    #[cfg(feature = "cuda")]
    "cuda",
    #[cfg(feature = "opencl")]
    "opencl",
    #[cfg(feature = "wgpu")]
    "wgpu",
];

/// Default capacity of the simulated device: an H100's 80 GiB.
pub const SIM_CAPACITY: u64 = 80 << 30;

/// Ops between two progress reports (and two reads of the clock).
const CHUNK: usize = 1 << 16;

/// What can go wrong in a replay.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The backend name is not one this build knows.
    #[error("unknown backend `{name}`; available: {}", available.join(", "))]
    UnknownBackend {
        /// The name asked for.
        name: String,
        /// The names this build knows.
        available: Vec<String>,
    },
    /// `UMM_REPLAY_DEVICE` is not a device index.
    #[error("UMM_REPLAY_DEVICE={value:?}: expected a device index (0 for the first device the backend finds)")]
    InvalidDevice {
        /// The variable's value.
        value: String,
    },
    /// The trace needs more memory than the backend has, so it is refused before running.
    #[error(
        "trace {trace} needs {needed} bytes ({}) live at its peak, more than the {available} bytes ({}) {backend} has available",
        human_bytes(*needed),
        human_bytes(*available)
    )]
    TooLarge {
        /// Trace name.
        trace: String,
        /// Backend name.
        backend: String,
        /// The trace's peak of live bytes.
        needed: u64,
        /// Memory available to the backend.
        available: u64,
    },
    /// Creating the pool, or an operation other than an out-of-memory allocation, failed.
    #[error("{backend} pool for trace {trace}: {source}")]
    Pool {
        /// Trace name.
        trace: String,
        /// Backend name.
        backend: String,
        /// The pool's error (boxed: it is large and this path is cold).
        #[source]
        source: Box<umm_backends::Error>,
    },
}

/// How to replay.
#[derive(Default)]
pub struct ReplayOptions<'a> {
    /// Warm replays after the cold one; `ns_per_op_warm` is their median. 0 leaves it `None`.
    pub repeat: usize,
    /// Cap on the pool's reserved bytes.
    pub limit: Option<Limit>,
    /// Capacity of the simulated device (`sim`, `sim-plain`, `sim-wgpu`); [`SIM_CAPACITY`] when `None`.
    pub sim_capacity: Option<u64>,
    /// Memory the host backend may use (the CLI passes the machine's available memory); required for `host`.
    pub host_capacity: Option<u64>,
    /// Called every few thousand ops with (ops done, ops in all passes).
    pub progress: Option<&'a mut dyn FnMut(u64, u64)>,
    /// The stream each of the trace's stream numbers runs on (`streams[k]` for stream `k`); a number past the
    /// end is used as it is. Empty on backends whose streams are plain numbers; the CUDA replay of a trace
    /// with several streams makes one CUDA stream for each.
    pub streams: Vec<StreamId>,
    /// Where steps end ([`umm_backends::Pool::mark_step`]).
    pub steps: StepMarks,
}

/// Where a replay marks the end of a step, so that a repeating step is served from a plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepMarks {
    /// Where the trace's `s` lines say (none in a trace without them).
    #[default]
    Trace,
    /// At the end of every pass (and once before the first, which starts the recording): the whole trace is one
    /// step, for traces of one step recorded without marks. The trace's own marks are ignored.
    Pass,
    /// Nowhere: the trace's marks are ignored.
    Off,
}

impl std::str::FromStr for StepMarks {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "trace" => Ok(Self::Trace),
            "pass" => Ok(Self::Pass),
            "off" => Ok(Self::Off),
            _ => Err(format!("{s:?} is not one of trace, pass, off")),
        }
    }
}

impl ReplayOptions<'_> {
    /// Options with `repeat` warm passes and nothing else set.
    pub fn with_repeat(repeat: usize) -> Self {
        Self { repeat, ..Self::default() }
    }
}

/// The outcome of replaying one trace on one backend: the `umm replay --json` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Trace name.
    pub trace: String,
    /// Backend name (`sim`, `sim-plain`, `host`, ...).
    pub backend: String,
    /// The device the pool ran on, in words.
    pub device: String,
    /// Ops in the trace.
    pub ops: u64,
    /// Allocation ops.
    pub allocs: u64,
    /// Free ops.
    pub frees: u64,
    /// The trace's own maximum of live bytes.
    pub peak_live_bytes: u64,
    /// The pool's peak of reserved bytes during the cold pass.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes`; `None` for a trace that allocates nothing, and for a replay
    /// whose cold pass ran out of memory (it never held the trace's peak, so the ratio would mean nothing).
    pub reserved_over_live: Option<f64>,
    /// The pool's peak of reserved bytes over the warm passes: what a repeating workload holds once it runs
    /// steadily; `None` without warm passes.
    pub peak_reserved_bytes_warm: Option<u64>,
    /// Nanoseconds per op of the first replay, on a fresh pool.
    pub ns_per_op_cold: f64,
    /// Median nanoseconds per op of the warm replays on the same pool; `None` without warm replays.
    pub ns_per_op_warm: Option<f64>,
    /// Segments created or page ranges mapped during the cold pass.
    pub device_allocs: u64,
    /// Segments destroyed or page ranges unmapped during the cold pass.
    pub device_frees: u64,
    /// Calls into the device's memory API during the warm passes, all of them together: segments created and
    /// destroyed, ranges reserved, pages mapped and unmapped (see `PoolStats::num_device_calls`). A workload that
    /// repeats should make none. `None` without warm passes.
    pub warm_device_calls: Option<u64>,
    /// Calls into the device's memory API during the last warm pass alone: where a repeating workload has
    /// settled, this is 0. `None` without warm passes.
    pub warm_device_calls_last: Option<u64>,
    /// Stream marks (CUDA events) recorded during warm passes, so that memory one stream freed could serve
    /// another ([`umm_backends::PoolStats::num_stream_marks`]): an event record each, not in the device calls.
    /// `None` without warm passes.
    pub warm_stream_marks: Option<u64>,
    /// Stream marks recorded during the last warm pass alone. `None` without warm passes.
    pub warm_stream_marks_last: Option<u64>,
    /// Pages unmapped in one stream's reservation so that another stream's could map their memory, over all
    /// passes ([`umm_backends::PoolStats::num_pages_shared`]): each such move is two device calls.
    pub pages_shared: u64,
    /// Empty segments moved from one stream's arena to another's over all passes
    /// ([`umm_backends::PoolStats::num_segments_shared`]).
    pub segments_shared: u64,
    /// Free blocks of one stream's reservations lent to another stream where they lie, over all passes
    /// ([`umm_backends::PoolStats::num_blocks_shared`]): no device call but a stream mark at most.
    pub blocks_shared: u64,
    /// Allocations of the cold pass that released cached memory and retried.
    pub oom_retries: u64,
    /// Allocations that failed with out of memory and were skipped (most in any pass).
    pub ooms: u64,
    /// The pool's limit in bytes, if any.
    pub limit_bytes: Option<u64>,
    /// The pool's peak of reserved bytes over the last pass alone: where a planned step settles.
    pub peak_reserved_bytes_last: u64,
    /// Nanoseconds per op of the last pass alone (served from a plan where steps are planned).
    pub ns_per_op_last: f64,
    /// Steps marked over all passes.
    pub steps: u64,
    /// Steps that ran as their plan foresaw.
    pub steps_planned: u64,
    /// Allocations placed at their planned offsets.
    pub planned_allocs: u64,
    /// Allocations a plan foresaw that the pool served instead.
    pub plan_fallbacks: u64,
    /// Stitched blocks made over all passes ([`umm_backends::PoolStats::num_stitches`]): free pages mapped side by
    /// side a second time to serve a request no free range held.
    pub stitches: u64,
    /// Allocations served by stitched blocks over all passes, made for them or kept from before.
    pub stitched_allocs: u64,
}

/// Replays `trace` on a fresh pool of the backend named `backend` (one of [`BACKENDS`]).
pub fn replay_on(backend: &str, trace: &Trace, opts: ReplayOptions<'_>) -> Result<ReplayReport, ReplayError> {
    // UMM_* pool variables (segment mode, slack, strategy, segment sizes) apply to replays too.
    let mut umm_config = umm::UmmConfig::default();
    umm_config.apply_env().map_err(|e| ReplayError::Pool {
        trace: trace.name.clone(),
        backend: backend.into(),
        source: Box::new(umm_backends::Error::InvalidConfig(e.to_string())),
    })?;
    let config = PoolConfig { limit: opts.limit.or(umm_config.pool.limit), ..umm_config.pool };
    let sim_capacity = opts.sim_capacity.unwrap_or(SIM_CAPACITY);
    let pool_error =
        |source| ReplayError::Pool { trace: trace.name.clone(), backend: backend.into(), source: Box::new(source) };
    if opts.sim_capacity == Some(0) || opts.host_capacity == Some(0) {
        return Err(pool_error(umm_backends::Error::InvalidConfig(
            "a device capacity of 0 bytes holds nothing: give a capacity above zero".into(),
        )));
    }
    match backend {
        "sim" => {
            let device = format!("simulated {} device with virtual memory (CUDA-like)", human_bytes(sim_capacity));
            let pool = Pool::new(SimBackend::new("sim", sim_capacity), config).map_err(pool_error)?;
            replay(trace, &pool, backend, &device, opts)
        }
        "sim-plain" => {
            let device = format!("simulated {} device, plain segments only", human_bytes(sim_capacity));
            let pool = Pool::new(SimBackend::plain("sim-plain", sim_capacity), config).map_err(pool_error)?;
            replay(trace, &pool, backend, &device, opts)
        }
        "sim-wgpu" => {
            let device = format!("simulated {} device, a segment per block (wgpu-like)", human_bytes(sim_capacity));
            let sim = SimBackend::segment_per_block("sim-wgpu", sim_capacity);
            let pool = Pool::new(sim, config).map_err(pool_error)?;
            replay(trace, &pool, backend, &device, opts)
        }
        "host" => {
            let available = opts.host_capacity.ok_or_else(|| {
                pool_error(umm_backends::Error::InvalidConfig("host replay needs the available host memory".into()))
            })?;
            if trace.peak_live_bytes > available {
                return Err(ReplayError::TooLarge {
                    trace: trace.name.clone(),
                    backend: backend.into(),
                    needed: trace.peak_live_bytes,
                    available,
                });
            }
            let device = format!("host memory ({} available)", human_bytes(available));
            let pool = Pool::new(HostBackend::new("host", available), config).map_err(pool_error)?;
            replay(trace, &pool, backend, &device, opts)
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            let device = first_device(backend, umm_backends::cuda::discover(), trace)?;
            let pool = device.pool(umm_backends::PoolKind::DeviceLocal, config).map_err(pool_error)?;
            // A trace of one stream keeps the null stream; several get a CUDA stream each, kept alive here.
            let cuda_error = |e: umm_backends::cuda::cudarc::driver::DriverError| {
                pool_error(umm_backends::Error::Driver {
                    backend: backend.into(),
                    call: "cuStreamCreate".into(),
                    message: e.to_string(),
                })
            };
            let streams = match trace.streams {
                0 | 1 => Vec::new(),
                n => {
                    (0..n).map(|_| device.context().new_stream()).collect::<Result<Vec<_>, _>>().map_err(cuda_error)?
                }
            };
            let mut opts = opts;
            opts.streams = streams.iter().map(umm_backends::cuda::stream_id).collect();
            replay(trace, &pool, backend, &device.info().name, opts)
        }
        #[cfg(feature = "opencl")]
        "opencl" => {
            let device = first_device(backend, umm_backends::opencl::discover(), trace)?;
            let pool = device.pool(umm_backends::PoolKind::DeviceLocal, config).map_err(pool_error)?;
            replay(trace, &pool, backend, &device.info().name, opts)
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            let device = first_device(backend, umm_backends::wgpu_backend::discover(), trace)?;
            let pool = device.pool(umm_backends::PoolKind::DeviceLocal, config).map_err(pool_error)?;
            replay(trace, &pool, backend, &device.info().name, opts)
        }
        other => Err(ReplayError::UnknownBackend {
            name: other.into(),
            available: BACKENDS.iter().map(|s| s.to_string()).collect(),
        }),
    }
}

/// The first device a backend discovered (`UMM_REPLAY_DEVICE=N` picks another), or why there is none.
#[allow(dead_code)]
fn first_device<D>(backend: &str, found: umm_backends::Discovery<D>, trace: &Trace) -> Result<D, ReplayError> {
    let index = device_index(std::env::var("UMM_REPLAY_DEVICE").ok().as_deref())?;
    let count = found.devices.len();
    found.devices.into_iter().nth(index).ok_or_else(|| ReplayError::Pool {
        trace: trace.name.clone(),
        backend: backend.into(),
        source: Box::new(umm_backends::Error::Unavailable {
            backend: backend.into(),
            reason: format!(
                "device {index} asked for, {count} found{}",
                if found.skipped.is_empty() { String::new() } else { format!(" ({})", found.skipped.join("; ")) }
            ),
        }),
    })
}

/// The device index `UMM_REPLAY_DEVICE` asks for: 0 when unset, an error naming the variable when it is not a
/// number.
pub fn device_index(value: Option<&str>) -> Result<usize, ReplayError> {
    let Some(value) = value else { return Ok(0) };
    value.trim().parse().map_err(|_| ReplayError::InvalidDevice { value: value.into() })
}

/// Replays `trace` on `pool`, which should be fresh (its statistics are taken as the cold pass's), then
/// `opts.repeat` more times on the same pool. Live blocks left at the end of a pass are freed (untimed) so every
/// pass starts with nothing live.
pub fn replay<B: Backend>(
    trace: &Trace,
    pool: &Pool<B>,
    backend: &str,
    device: &str,
    mut opts: ReplayOptions<'_>,
) -> Result<ReplayReport, ReplayError> {
    let pool_error =
        |source| ReplayError::Pool { trace: trace.name.clone(), backend: backend.into(), source: Box::new(source) };
    let ops = trace.ops.len() as u64;
    let total = ops * (1 + opts.repeat as u64);
    let mut slots: Vec<Option<BlockHandle>> = vec![None; trace.slots as usize];

    let mut progress = |done: u64| {
        if let Some(report) = opts.progress.as_mut() {
            report(done, total);
        }
    };
    let streams = std::mem::take(&mut opts.streams);
    let marks: &[usize] = if opts.steps == StepMarks::Trace { &trace.steps } else { &[] };
    let per_pass = opts.steps == StepMarks::Pass;
    // A pass ends with its live blocks freed, then the step marked: a block the trace leaves live lives within
    // the pass's step.
    let end_pass = |slots: &mut [Option<BlockHandle>]| {
        free_all(pool, slots)?;
        if per_pass {
            pool.mark_step();
        }
        Ok(())
    };
    if per_pass {
        pool.mark_step();
    }
    let cold = run_pass(trace, pool, &streams, marks, &mut slots, &mut |n| progress(n)).map_err(pool_error)?;
    let stats = pool.stats();
    end_pass(&mut slots).map_err(pool_error)?;
    pool.reset_peaks();

    let mut warm = Vec::with_capacity(opts.repeat);
    let mut ooms = cold.ooms;
    let mut peak_warm = 0;
    let mut peak_last = stats.reserved_bytes.peak;
    let mut calls_before_last = stats.num_device_calls;
    let mut marks_before_last = stats.num_stream_marks;
    for pass in 1..=opts.repeat as u64 {
        if pass == opts.repeat as u64 {
            let now = pool.stats();
            calls_before_last = now.num_device_calls;
            marks_before_last = now.num_stream_marks;
            if pass > 1 {
                peak_warm = now.reserved_bytes.peak;
                pool.reset_peaks();
            }
        }
        let result = run_pass(trace, pool, &streams, marks, &mut slots, &mut |n| progress(pass * ops + n))
            .map_err(pool_error)?;
        end_pass(&mut slots).map_err(pool_error)?;
        ooms = ooms.max(result.ooms);
        warm.push(result.elapsed);
        peak_last = pool.stats().reserved_bytes.peak;
    }
    let after = pool.stats();
    let warm_passes = opts.repeat > 0;
    let warm_device_calls = warm_passes.then(|| after.num_device_calls - stats.num_device_calls);
    let warm_device_calls_last = warm_passes.then(|| after.num_device_calls - calls_before_last);
    let warm_stream_marks = warm_passes.then(|| after.num_stream_marks - stats.num_stream_marks);
    let warm_stream_marks_last = warm_passes.then(|| after.num_stream_marks - marks_before_last);
    let peak_reserved_warm = warm_passes.then(|| after.reserved_bytes.peak.max(peak_warm));
    let per_op = |d: Duration| if ops == 0 { 0.0 } else { d.as_nanos() as f64 / ops as f64 };
    let ns_per_op_cold = per_op(cold.elapsed);
    let ns_per_op_last = warm.last().map_or(ns_per_op_cold, |&d| per_op(d));
    let ns_per_op_warm = (!warm.is_empty()).then(|| per_op(median(&mut warm)));
    let peak_reserved = stats.reserved_bytes.peak;
    Ok(ReplayReport {
        trace: trace.name.clone(),
        backend: backend.into(),
        device: device.into(),
        ops,
        allocs: trace.allocs,
        frees: trace.frees,
        peak_live_bytes: trace.peak_live_bytes,
        peak_reserved_bytes: peak_reserved,
        reserved_over_live: (trace.peak_live_bytes > 0 && cold.ooms == 0)
            .then(|| peak_reserved as f64 / trace.peak_live_bytes as f64),
        peak_reserved_bytes_warm: peak_reserved_warm,
        ns_per_op_cold,
        ns_per_op_warm,
        device_allocs: stats.num_device_alloc,
        device_frees: stats.num_device_free,
        warm_device_calls,
        warm_device_calls_last,
        warm_stream_marks,
        warm_stream_marks_last,
        pages_shared: after.num_pages_shared,
        segments_shared: after.num_segments_shared,
        blocks_shared: after.num_blocks_shared,
        oom_retries: stats.num_alloc_retries,
        ooms,
        limit_bytes: stats.limit_bytes,
        peak_reserved_bytes_last: peak_last,
        ns_per_op_last,
        steps: after.num_steps,
        steps_planned: after.num_steps_planned,
        planned_allocs: after.num_planned_allocs,
        plan_fallbacks: after.num_plan_fallbacks,
        stitches: after.num_stitches,
        stitched_allocs: after.num_stitched_allocs,
    })
}

struct Pass {
    elapsed: Duration,
    ooms: u64,
}

/// One pass over the trace, marking the end of a step after each op count in `marks` (ascending). Only the op
/// loops and the marks are timed; progress is reported between chunks.
fn run_pass<B: Backend>(
    trace: &Trace,
    pool: &Pool<B>,
    streams: &[StreamId],
    marks: &[usize],
    slots: &mut [Option<BlockHandle>],
    progress: &mut dyn FnMut(u64),
) -> umm_backends::Result<Pass> {
    let mut pass = Pass { elapsed: Duration::ZERO, ooms: 0 };
    let (ops, mut marks, mut at) = (&trace.ops, marks.iter().copied().peekable(), 0);
    while at < ops.len() || marks.peek().is_some() {
        let end = marks.peek().map_or(ops.len(), |&mark| mark.min(ops.len())).min(at + CHUNK);
        let start = Instant::now();
        pass.ooms += run_ops(&ops[at..end], pool, streams, slots)?;
        while marks.next_if(|&mark| mark <= end).is_some() {
            pool.mark_step();
        }
        pass.elapsed += start.elapsed();
        at = end;
        progress(at as u64);
    }
    Ok(pass)
}

/// The timed loop. Returns the allocations that failed for lack of memory (skipped, and their frees ignored).
#[inline(never)]
fn run_ops<B: Backend>(
    ops: &[Op],
    pool: &Pool<B>,
    streams: &[StreamId],
    slots: &mut [Option<BlockHandle>],
) -> umm_backends::Result<u64> {
    let mut ooms = 0;
    for op in ops {
        match *op {
            Op::Alloc { slot, bytes, stream } => {
                let stream = streams.get(stream as usize).copied().unwrap_or(StreamId(u64::from(stream)));
                match pool.allocate(bytes, stream) {
                    Ok(block) => slots[slot as usize] = Some(block),
                    Err(umm_backends::Error::OutOfMemory { .. } | umm_backends::Error::TooLarge { .. }) => ooms += 1,
                    Err(e) => return Err(e),
                }
            }
            Op::Free { slot } => {
                if let Some(block) = slots[slot as usize].take() {
                    pool.free(&block)?;
                }
            }
        }
    }
    Ok(ooms)
}

fn free_all<B: Backend>(pool: &Pool<B>, slots: &mut [Option<BlockHandle>]) -> umm_backends::Result<()> {
    for block in slots.iter_mut().filter_map(Option::take) {
        pool.free(&block)?;
    }
    Ok(())
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort_unstable();
    let mid = times.len() / 2;
    if times.len() % 2 == 1 {
        times[mid]
    } else {
        (times[mid - 1] + times[mid]) / 2
    }
}

pub use umm::config::{parse_capacity, parse_limit, parse_size};

pub use umm_placement::units::human_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_sizes_with_units_or_percentages() {
        assert_eq!(parse_limit("90%"), Ok(Limit::Fraction(0.9)));
        assert_eq!(parse_limit("2GiB"), Ok(Limit::Bytes(2 << 30)));
        for bad in ["0.9", "1.0", "1", "1.5", "0%", "0", "0B"] {
            let err = parse_limit(bad).unwrap_err();
            assert!(err.contains(&format!("`{bad}`")), "the value is named: {bad}: {err}");
        }
        assert_eq!(parse_capacity("1GiB"), Ok(1 << 30));
        assert!(parse_capacity("0").unwrap_err().contains("above zero"));
        assert!(parse_capacity("0GiB").unwrap_err().contains("holds nothing"));
    }

    #[test]
    fn replay_counts_ooms_and_skips_their_frees() {
        let text = "# umm-trace v1\na 1 1048576 0\na 2 4194304 0\nf 2\nf 1\na 3 2097152 0\n";
        let trace = Trace::parse_str("t", "t", text).unwrap();
        let opts = ReplayOptions { repeat: 2, limit: Some(Limit::Bytes(4 << 20)), ..ReplayOptions::default() };
        let report = replay_on("sim-plain", &trace, opts).unwrap();
        assert_eq!(report.ooms, 1, "{report:?}");
        assert_eq!(report.limit_bytes, Some(4 << 20));
        assert!(report.peak_reserved_bytes <= 4 << 20);
        assert_eq!((report.ops, report.allocs, report.frees), (5, 3, 2));
        assert_eq!(report.peak_live_bytes, 5 << 20);
    }

    #[test]
    fn unknown_backend_lists_the_known_ones() {
        let trace = Trace::parse_str("t", "t", "# umm-trace v1\n").unwrap();
        let err = replay_on("vulkan", &trace, ReplayOptions::default()).unwrap_err().to_string();
        assert!(err.contains("vulkan") && err.contains("sim, sim-plain, sim-wgpu, host"), "{err}");
    }

    #[test]
    fn host_refuses_traces_larger_than_available_memory() {
        let trace = Trace::parse_str("big", "big", "# umm-trace v1\na 1 4096 0\n").unwrap();
        let opts = ReplayOptions { host_capacity: Some(1024), ..ReplayOptions::default() };
        let err = replay_on("host", &trace, opts).unwrap_err();
        assert!(matches!(err, ReplayError::TooLarge { needed: 4096, available: 1024, .. }), "{err}");
        let opts = ReplayOptions { host_capacity: Some(1 << 30), repeat: 1, ..ReplayOptions::default() };
        let report = replay_on("host", &trace, opts).unwrap();
        assert_eq!(report.allocs, 1);
    }

    #[test]
    fn replay_device_index_is_a_number_or_an_error_naming_the_variable() {
        assert_eq!(device_index(None).unwrap(), 0);
        assert_eq!(device_index(Some("3")).unwrap(), 3);
        assert_eq!(device_index(Some(" 1 ")).unwrap(), 1);
        for bad in ["", "one", "-1", "1.5"] {
            let err = device_index(Some(bad)).unwrap_err();
            assert!(matches!(err, ReplayError::InvalidDevice { ref value } if value == bad), "{bad}: {err}");
            assert!(err.to_string().contains("UMM_REPLAY_DEVICE"), "{err}");
        }
    }
}
