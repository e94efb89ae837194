//! Configuration: what the builder sets and what `UMM_*` environment variables override.
//!
//! | variable | accepts | sets |
//! |---|---|---|
//! | `UMM_LIMIT` | a size with a unit (`2GiB`, `1500MB`, `1048576B`) or a percentage of the device (`80%`); a bare number is refused | every pool's cap on reserved bytes |
//! | `UMM_STRATEGY` | `pooled` or `direct` | caching (pooled) or one segment per block (direct, for debugging) |
//! | `UMM_SEGMENT_MODE` | `auto`, `plain` or `virtual` | virtual reservations for large blocks where supported |
//! | `UMM_SMALL_SEGMENT`, `UMM_LARGE_SEGMENT` | bytes, at least 1 MiB and 2 MiB | segment sizes of the small and large classes |
//! | `UMM_SMALL_MAX`, `UMM_MEDIUM_MAX` | bytes | size-class thresholds of the decision table |
//! | `UMM_PRESSURE` | a fraction in [0, 1] | used share of a device above which Auto avoids it |
//! | `UMM_SPREAD` | `balance` or `current_first` | how Auto chooses among several GPUs: the most memory free to umm (default), or the current device until it is under pressure |
//! | `UMM_ZERO`, `UMM_POISON` | `0`/`1`, `true`/`false`, `on`/`off` | zero every allocation; poison every freed block |
//! | `UMM_PLAN_STEPS` | `0`/`1`, `true`/`false`, `on`/`off` (default on) | serve repeating steps marked with `mark_step` from a plan; off, steps are only counted |
//! | `UMM_STITCH` | `0`/`1`, `true`/`false`, `on`/`off` (default on) | serve a large request that no free range holds from free pages mapped side by side a second time (stitched blocks) rather than new pages; off, new pages are mapped |
//! | `UMM_BACKENDS` | a comma list of `cuda`, `opencl`, `wgpu` (or `none`; not empty) | which APIs discovery probes |
//! | `UMM_MAPPED_SLACK` | a fraction >= 0 or `off` | opt-in trimming on the allocation path: how far reserved may exceed live memory in virtual reservations before free pages are unmapped to map others (default `off`: only the limit, out of memory and cleanup rounds trim, so a repeating workload makes no driver call once warm) |
//! | `UMM_CROSS_STREAM` | `off`, `completed`, `wait` | when memory one stream freed may serve another stream's miss: once a mark after the free has passed (default), at once with the taker made to wait for it on the device, or never |
//! | `UMM_SEGMENT_SLACK` | a fraction >= 0 or `off` | how far reserved may exceed live memory before a new plain segment first replaces empty ones (default 0.1) |
//! | `UMM_PAGE_SIZE` | bytes, a power of two (`8MiB`) | page size of virtual reservations (default 8 MiB without a limit, the device's own page, 2 MiB on CUDA, under one): larger pages map and unmap with fewer driver calls, at some memory |
//! | `UMM_ALIGNMENT` | bytes, a power of two up to 64 KiB (`512`) | where blocks start (default the backend's alignment, 256 bytes on CUDA; never below it): 512 places blocks as PyTorch's allocator does |
//! | `UMM_THREAD_CACHE`, `UMM_THREAD_CACHE_LARGE` | bytes, `0` for off | most bytes of free small (large) blocks one thread's cache keeps per stream (default 32 MiB and 1 GiB; large blocks only once threads contend, up to a sixteenth of the bound each) |
//! | `UMM_CLEANUP_IDLE_ROUNDS` | an integer | cleanups a cached segment must sit idle before `cleanup()` frees it |
//! | `UMM_PROFILE` | `0`/`1`, `true`/`false`, `on`/`off` | record allocation, free and segment events from the start |
//! | `UMM_PROFILE_CAPACITY` | an integer | events the profiler's ring keeps (default 100000) |
//! | `UMM_LEAK_WARNING` | `0`/`1`, `true`/`false`, `on`/`off` | warn when a manager is dropped while buffers are alive (default on) |
//! | `UMM_LIVE_TABLE` | `0`/`1`, `true`/`false`, `on`/`off` | keep the table of live buffers that leak reports and the leak warning read (default on; off saves a lock round trip per buffer) |
//! | `UMM_WGPU_TIMEOUT` | seconds above 0 (default 60) | how long the wgpu backend waits for the device or for a setup call (instance, adapters, device) before it gives up with an error naming the call |
//! | `UMM_WGPU_WATCHDOG` | seconds, or `off` (default) | report on stderr any call into wgpu in flight longer than this, with every call in flight and where each thread waits |
//! | `UMM_TRACE` | a file path (`{pid}` is replaced by the process id; `.gz` compresses) | write every allocation and free as an `umm-trace v1` file |
//!
//! `UMM_PROFILE`, `UMM_PROFILE_CAPACITY`, `UMM_TRACE`, `UMM_LEAK_WARNING` and `UMM_LIVE_TABLE` are read by every
//! [`crate::Builder`], even without `from_env`, so that any program using the library can be profiled or traced
//! without changing it.
//!
//! Every invalid value is an error naming the variable and its value. `UMM_SMALL_SEGMENT` must be at least the
//! largest small request (1 MiB) and `UMM_LARGE_SEGMENT` at least twice that (2 MiB); an empty `UMM_BACKENDS` is
//! refused (`none` turns every accelerator API off). A variable named `UMM_...` that umm does not read draws a
//! warning, once per process, naming the closest known variable ([`warn_unknown_env_vars`]).

use crate::error::{Error, Result};
use crate::profiler::ProfilerConfig;
use serde::Serialize;
use umm_backends::{Limit, PoolConfig, SegmentMode, Strategy};
use umm_placement::DecisionConfig;

/// The manager's configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UmmConfig {
    /// Placement decision table settings.
    pub decision: DecisionConfig,
    /// Settings every pool is created with.
    pub pool: PoolConfig,
    /// Probe CUDA devices (when built with the `cuda` feature).
    pub cuda: bool,
    /// Probe OpenCL devices (when built with the `opencl` feature).
    pub opencl: bool,
    /// Probe wgpu adapters (when built with the `wgpu` feature).
    pub wgpu: bool,
    /// Simulated devices to add (capacity in bytes each): stand-ins for GPUs in tests and replays.
    pub simulated_devices: Vec<u64>,
    /// How many cleanup rounds a cached segment must sit unused before [`crate::UniversalMemoryManager::cleanup`]
    /// releases it.
    pub cleanup_idle_rounds: u64,
    /// Event recording and `UMM_TRACE` recording.
    pub profiler: ProfilerConfig,
    /// How old the device figures (free memory, pressure) that placement decisions use may get while
    /// allocations go on (default 2 ms): they are refreshed off the allocation path, never per buffer.
    #[serde(with = "duration_ms")]
    pub device_refresh: std::time::Duration,
}

mod duration_ms {
    pub fn serialize<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1e3)
    }
}

impl Default for UmmConfig {
    fn default() -> Self {
        Self {
            decision: DecisionConfig::default(),
            pool: PoolConfig::default(),
            cuda: true,
            opencl: true,
            wgpu: true,
            simulated_devices: Vec::new(),
            cleanup_idle_rounds: 2,
            profiler: ProfilerConfig::default(),
            device_refresh: std::time::Duration::from_millis(2),
        }
    }
}

impl UmmConfig {
    /// Applies every `UMM_*` variable that is set. An invalid value is an error naming the variable, its value
    /// and what it accepts. Also warns, once per process, about `UMM_*` variables that umm does not read
    /// ([`warn_unknown_env_vars`]).
    pub fn apply_env(&mut self) -> Result<()> {
        warn_unknown_env_vars();
        self.apply_vars(env_var)
    }

    /// Applies variables from `lookup` (the environment, or a map in tests). An error names the variable and its
    /// value; where the values are each valid but do not fit together (`UMM_SMALL_MAX` above `UMM_MEDIUM_MAX`),
    /// it names the variable that breaks the rule and the value it conflicts with.
    pub fn apply_vars(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<()> {
        let seen = std::cell::RefCell::new(Vec::<String>::new());
        let lookup = |name: &str| {
            let value = lookup(name);
            if let Some(v) = &value {
                seen.borrow_mut().push(format!("{name}={v:?}"));
            }
            value
        };
        if let Some(v) = lookup("UMM_LIMIT") {
            self.pool.limit = Some(parse_limit(&v).map_err(|e| invalid_because("UMM_LIMIT", v, Limit::ACCEPTED, &e))?);
        }
        if let Some(v) = lookup("UMM_STRATEGY") {
            self.pool.strategy = v.parse::<Strategy>().map_err(|_| invalid("UMM_STRATEGY", v, "pooled or direct"))?;
        }
        if let Some(v) = lookup("UMM_SEGMENT_MODE") {
            self.pool.segment_mode =
                v.parse::<SegmentMode>().map_err(|_| invalid("UMM_SEGMENT_MODE", v, "auto, plain or virtual"))?;
        }
        self.apply_segment_vars(lookup)?;
        self.apply_threshold_vars(lookup)?;
        for (var, field) in [
            ("UMM_THREAD_CACHE", &mut self.pool.thread_cache_bytes),
            ("UMM_THREAD_CACHE_LARGE", &mut self.pool.thread_cache_large_bytes),
        ] {
            if let Some(v) = lookup(var) {
                *field = parse_size(&v)
                    .map_err(|e| invalid_because(var, v, "a byte count, 0 for off (8MiB, 0, 268435456)", &e))?;
            }
        }
        if let Some(v) = lookup("UMM_PRESSURE") {
            self.decision.pressure_threshold = v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|f| (0.0..=1.0).contains(f))
                .ok_or_else(|| invalid("UMM_PRESSURE", v, "a fraction in [0, 1]"))?;
        }
        // Read by the wgpu backend itself at discovery (the bound is the process's); refused here when malformed.
        #[cfg(feature = "wgpu")]
        for var in ["UMM_WGPU_TIMEOUT", "UMM_WGPU_WATCHDOG"] {
            if let Some(v) = lookup(var) {
                let parsed = umm_backends::wgpu_backend::parse_seconds(&v);
                if parsed.is_err() || (var == "UMM_WGPU_TIMEOUT" && parsed == Ok(None)) {
                    return Err(invalid(var, v, "a number of seconds above 0 (UMM_WGPU_WATCHDOG also takes off)"));
                }
            }
        }
        if let Some(v) = lookup("UMM_SPREAD") {
            self.decision.spread =
                v.trim().parse().map_err(|_| invalid("UMM_SPREAD", v, "balance or current_first"))?;
        }
        for (var, field) in [
            ("UMM_ZERO", &mut self.pool.zero_on_alloc),
            ("UMM_POISON", &mut self.pool.poison_on_free),
            ("UMM_PLAN_STEPS", &mut self.pool.plan_steps),
            ("UMM_STITCH", &mut self.pool.stitch),
        ] {
            if let Some(v) = lookup(var) {
                *field = parse_bool(&v).ok_or_else(|| invalid(var, v, "0/1, true/false, on/off or yes/no"))?;
            }
        }
        if let Some(v) = lookup("UMM_BACKENDS") {
            (self.cuda, self.opencl, self.wgpu) =
                parse_backends(&v).map_err(|expected| invalid("UMM_BACKENDS", v, expected))?;
        }
        if let Some(v) = lookup("UMM_MAPPED_SLACK") {
            self.pool.mapped_slack = PoolConfig::parse_slack(&v)
                .ok_or_else(|| invalid("UMM_MAPPED_SLACK", v, "a fraction >= 0 (0.03) or off"))?;
        }
        if let Some(v) = lookup("UMM_SEGMENT_SLACK") {
            self.pool.segment_slack = PoolConfig::parse_slack(&v)
                .ok_or_else(|| invalid("UMM_SEGMENT_SLACK", v, "a fraction >= 0 (0.1) or off"))?;
        }
        if let Some(v) = lookup("UMM_CROSS_STREAM") {
            self.pool.cross_stream =
                v.trim().parse().map_err(|_| invalid("UMM_CROSS_STREAM", v, "one of off, completed, wait"))?;
        }
        if let Some(v) = lookup("UMM_PAGE_SIZE") {
            const PAGE: &str = "a power of two of bytes (2MiB, 8MiB, 8388608)";
            self.pool.page_size = Some(match parse_size(&v) {
                Ok(bytes) if bytes.is_power_of_two() => bytes,
                Ok(bytes) => return Err(invalid_because("UMM_PAGE_SIZE", v, PAGE, &format!("{bytes} is not one"))),
                Err(e) => return Err(invalid_because("UMM_PAGE_SIZE", v, PAGE, &e)),
            });
        }
        if let Some(v) = lookup("UMM_ALIGNMENT") {
            const ALIGN: &str = "a power of two of bytes up to 64KiB (512)";
            self.pool.alignment = Some(match parse_size(&v) {
                Ok(bytes) if bytes.is_power_of_two() && bytes <= umm_backends::pool::MAX_ALIGNMENT => bytes,
                Ok(bytes) => return Err(invalid_because("UMM_ALIGNMENT", v, ALIGN, &format!("{bytes} is not one"))),
                Err(e) => return Err(invalid_because("UMM_ALIGNMENT", v, ALIGN, &e)),
            });
        }
        if let Some(v) = lookup("UMM_CLEANUP_IDLE_ROUNDS") {
            self.cleanup_idle_rounds =
                v.trim().parse().map_err(|_| invalid("UMM_CLEANUP_IDLE_ROUNDS", v, "a non-negative integer"))?;
        }
        self.apply_profiler_vars(lookup)?;
        self.validate().map_err(|e| {
            let seen = seen.borrow();
            if seen.is_empty() {
                e
            } else {
                Error::InvalidConfig(format!("{e} (with {} from the environment)", seen.join(", ")))
            }
        })
    }

    /// `UMM_SMALL_SEGMENT` and `UMM_LARGE_SEGMENT`, each with its least sensible value: a small segment must hold
    /// the largest small request, and a large segment (shared by medium requests, those above the small ones,
    /// that fit in half of it) must hold two of the smallest medium requests. Anything smaller gives segments
    /// that no request of their class can use, so every such request would get a segment of its own.
    fn apply_segment_vars(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<()> {
        let small_request_max = self.pool.small_request_max;
        for (var, field, min, why) in [
            (
                "UMM_SMALL_SEGMENT",
                &mut self.pool.small_segment_size,
                small_request_max,
                "a small segment must hold the largest small request",
            ),
            (
                "UMM_LARGE_SEGMENT",
                &mut self.pool.large_segment_size,
                2 * small_request_max,
                "a large segment is shared by requests above the small ones that fit in half of it",
            ),
        ] {
            if let Some(v) = lookup(var) {
                let min_text = umm_placement::units::human_bytes(min);
                let expected = format!("a size of at least {min_text} ({why}), such as 2MiB or 20MiB");
                *field = match parse_size(&v) {
                    Ok(bytes) if bytes >= min => bytes,
                    Ok(_) => return Err(invalid(var, v, expected)),
                    Err(e) => return Err(invalid_because(var, v, expected, &e)),
                };
            }
        }
        Ok(())
    }

    /// `UMM_SMALL_MAX` and `UMM_MEDIUM_MAX`: each a size above zero, the small one below the medium one.
    fn apply_threshold_vars(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<()> {
        let small = lookup("UMM_SMALL_MAX");
        let medium = lookup("UMM_MEDIUM_MAX");
        let thresholds = &mut self.decision.thresholds;
        for (var, value, field) in [
            ("UMM_SMALL_MAX", &small, &mut thresholds.small_max),
            ("UMM_MEDIUM_MAX", &medium, &mut thresholds.medium_max),
        ] {
            if let Some(v) = value {
                const EXPECTED: &str = "a byte count above zero (64KiB, 16MiB, 65536)";
                *field = match parse_size(v) {
                    Ok(bytes) if bytes > 0 => bytes,
                    Ok(_) => return Err(invalid(var, v.clone(), EXPECTED)),
                    Err(e) => return Err(invalid_because(var, v.clone(), EXPECTED, &e)),
                };
            }
        }
        if thresholds.validate().is_ok() {
            return Ok(());
        }
        let (small_max, medium_max) = (thresholds.small_max, thresholds.medium_max);
        let source = |set: &Option<String>, var: &str| {
            if set.is_some() {
                format!("set by {var}")
            } else {
                "the default".to_string()
            }
        };
        Err(match (small, medium) {
            (Some(v), medium) => invalid(
                "UMM_SMALL_MAX",
                v,
                format!(
                    "a size below the medium threshold, {} ({} bytes, {})",
                    umm_placement::units::human_bytes(medium_max),
                    medium_max,
                    source(&medium, "UMM_MEDIUM_MAX")
                ),
            ),
            (None, Some(v)) => invalid(
                "UMM_MEDIUM_MAX",
                v,
                format!(
                    "a size above the small threshold, {} ({small_max} bytes, the default)",
                    umm_placement::units::human_bytes(small_max)
                ),
            ),
            (None, None) => Error::Placement(umm_placement::Error::InvalidThresholds { small_max, medium_max }),
        })
    }

    /// Applies `UMM_PROFILE`, `UMM_PROFILE_CAPACITY`, `UMM_TRACE`, `UMM_LEAK_WARNING` and `UMM_LIVE_TABLE` from
    /// `lookup`.
    pub fn apply_profiler_vars(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = lookup("UMM_PROFILE") {
            self.profiler.enabled =
                parse_bool(&v).ok_or_else(|| invalid("UMM_PROFILE", v, "0/1, true/false, on/off or yes/no"))?;
        }
        if let Some(v) = lookup("UMM_PROFILE_CAPACITY") {
            self.profiler.capacity = v
                .trim()
                .parse()
                .map_err(|_| invalid("UMM_PROFILE_CAPACITY", v, "a non-negative integer (events kept)"))?;
        }
        if let Some(v) = lookup("UMM_TRACE") {
            if v.trim().is_empty() {
                return Err(invalid("UMM_TRACE", v, "a file path"));
            }
            self.profiler.trace_path = Some(v.trim().into());
        }
        if let Some(v) = lookup("UMM_LEAK_WARNING") {
            self.profiler.leak_warning =
                parse_bool(&v).ok_or_else(|| invalid("UMM_LEAK_WARNING", v, "0/1, true/false, on/off or yes/no"))?;
        }
        if let Some(v) = lookup("UMM_LIVE_TABLE") {
            self.profiler.live_table =
                parse_bool(&v).ok_or_else(|| invalid("UMM_LIVE_TABLE", v, "0/1, true/false, on/off or yes/no"))?;
        }
        Ok(())
    }

    /// Checks the values against each other.
    pub fn validate(&self) -> Result<()> {
        if self.simulated_devices.contains(&0) {
            return Err(Error::InvalidConfig(
                "a simulated device of 0 bytes holds nothing: give a capacity above zero".into(),
            ));
        }
        self.decision.validate()?;
        self.pool.validate()?;
        Ok(())
    }
}

/// The value of the environment variable `name`; one that is not Unicode comes back lossily converted, so that
/// it is reported as invalid rather than ignored.
pub(crate) fn env_var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

fn invalid(var: &'static str, value: String, expected: impl Into<String>) -> Error {
    Error::InvalidEnv { var, value, expected: expected.into() }
}

/// [`invalid`], adding what the parser found wrong (`` `99999999999TiB` is too large ``), without the parser's
/// own list of accepted forms: a value that looks right but overflows, or has a sign, says so.
fn invalid_because(var: &'static str, value: String, expected: impl Into<String>, parse_error: &str) -> Error {
    let problem = parse_error.split(": expected ").next().unwrap_or(parse_error);
    let problem = problem.split("; a limit is ").next().unwrap_or(problem);
    invalid(var, value, format!("{}; {problem}", expected.into()))
}

/// `UMM_BACKENDS`: which of CUDA, OpenCL and wgpu to probe. An empty list is refused, so that an unset-looking
/// `UMM_BACKENDS=` in a script does not silently turn every accelerator off: `none` says that on purpose.
fn parse_backends(text: &str) -> Result<(bool, bool, bool), &'static str> {
    const EXPECTED: &str = "a comma-separated list of cuda, opencl, wgpu, or none for no accelerator API";
    let (mut cuda, mut opencl, mut wgpu) = (false, false, false);
    let mut names = 0;
    for name in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        names += 1;
        match name.to_ascii_lowercase().as_str() {
            "cuda" => cuda = true,
            "opencl" => opencl = true,
            "wgpu" => wgpu = true,
            "none" | "host" => {}
            _ => return Err(EXPECTED),
        }
    }
    if names == 0 {
        return Err("a comma-separated list of cuda, opencl, wgpu, or none for no accelerator API (an empty value \
                    is refused rather than read as none)");
    }
    Ok((cuda, opencl, wgpu))
}

/// Every `UMM_*` variable that umm reads: the library's (the table above), `UMM_REPLAY_DEVICE` (`umm replay`),
/// and the C ABI's and Python package's (`UMM_HUGE_MIN`, `UMM_CAPI_LIB`, `UMM_CAPI_SIM`, `UMM_TORCH_ADAPTER`,
/// `UMM_TORCH_CACHE`).
pub const KNOWN_VARS: &[&str] = &[
    "UMM_LIMIT",
    "UMM_STRATEGY",
    "UMM_SEGMENT_MODE",
    "UMM_SMALL_SEGMENT",
    "UMM_LARGE_SEGMENT",
    "UMM_SMALL_MAX",
    "UMM_MEDIUM_MAX",
    "UMM_PRESSURE",
    "UMM_SPREAD",
    "UMM_ZERO",
    "UMM_POISON",
    "UMM_PLAN_STEPS",
    "UMM_STITCH",
    "UMM_BACKENDS",
    "UMM_MAPPED_SLACK",
    "UMM_SEGMENT_SLACK",
    "UMM_CROSS_STREAM",
    "UMM_PAGE_SIZE",
    "UMM_ALIGNMENT",
    "UMM_THREAD_CACHE",
    "UMM_THREAD_CACHE_LARGE",
    "UMM_CLEANUP_IDLE_ROUNDS",
    "UMM_PROFILE",
    "UMM_PROFILE_CAPACITY",
    "UMM_TRACE",
    "UMM_WGPU_TIMEOUT",
    "UMM_WGPU_WATCHDOG",
    "UMM_LEAK_WARNING",
    "UMM_LIVE_TABLE",
    "UMM_REPLAY_DEVICE",
    "UMM_HUGE_MIN",
    "UMM_CAPI_LIB",
    "UMM_CAPI_SIM",
    "UMM_TORCH_ADAPTER",
    "UMM_TORCH_CACHE",
];

/// Variables of umm's own test suites and benches (`UMM_REQUIRE_BACKENDS`, cycle counts, fuzzing seeds, child
/// processes): not settings of the library, and not listed among them, but not misspellings either.
const TEST_VARS: &[&str] = &[
    "UMM_REQUIRE_BACKENDS",
    "UMM_TRACES",
    "UMM_CONCURRENCY_CYCLES",
    "UMM_STRESS_CYCLES",
    "UMM_CUDA_ROUNDS",
    "UMM_CUDA_PLANT_OOB",
    "UMM_CUDA_NO_DEVICE_OOM",
    "UMM_CUDA_DISCOVERY_CHILD",
    "UMM_OPENCL_DISCOVERY_CHILD",
    "UMM_OPENCL_THREADS_CHILD",
    "UMM_FUZZ_CASES",
    "UMM_FUZZ_SEED",
    "UMM_CAPI_TRACE_TEST_CHILD",
    "UMM_GRAPH_TEST_SETTINGS",
    "UMM_ORACLE_CASES",
    "UMM_ORACLE_TEST_SETTINGS",
    "UMM_IPC_TEST_HANDLE",
    "UMM_SIM_TEST_HUGE_CHILD",
];

/// A variable named like umm's (`UMM_` in any case) that umm does not read, with the known name closest to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownVar {
    /// The name as set.
    pub name: String,
    /// The known name closest to it, when one is close enough to be a likely misspelling.
    pub suggestion: Option<&'static str>,
}

impl std::fmt::Display for UnknownVar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "environment variable {} is not one umm reads, so it has no effect", self.name)?;
        match self.suggestion {
            Some(known) => write!(f, ": did you mean {known}?"),
            None => write!(f, " (the variables umm reads are listed in the documentation of umm::config)"),
        }
    }
}

/// The names among `names` that start with `UMM_` (in any case) but are not in [`KNOWN_VARS`] (nor among the
/// test suites' own variables), each with the closest known name (by edit distance, ignoring case) when it is
/// within a third of the name's length.
pub fn unknown_vars<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<UnknownVar> {
    names
        .into_iter()
        // Bytes, not `&name[..4]`: a name with a multi-byte character among its first four bytes is not a
        // char boundary there (`UMM€`).
        .filter(|name| {
            name.as_bytes().get(..4).is_some_and(|p| p.eq_ignore_ascii_case(b"UMM_"))
                && !KNOWN_VARS.contains(name)
                && !TEST_VARS.contains(name)
        })
        .map(|name| {
            let upper = name.to_ascii_uppercase();
            let (distance, closest) =
                KNOWN_VARS.iter().map(|known| (edit_distance(&upper, known), *known)).min().unwrap_or((usize::MAX, ""));
            let close_enough = distance <= (name.len() - 4).div_ceil(3).max(1);
            UnknownVar { name: name.to_string(), suggestion: close_enough.then_some(closest) }
        })
        .collect()
}

/// Levenshtein distance over bytes.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            current[j + 1] = (previous[j] + usize::from(ca != cb)).min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}

/// Warns, once per process, about every variable in the environment named like umm's (`UMM_...`) that umm does
/// not read: a misspelt `UMM_LIMT=2GiB` would otherwise leave the pools uncapped without a word. The warning
/// goes to stderr, or through `log` when a logger is installed. [`UmmConfig::apply_env`] and every
/// [`crate::Builder::build`] call it.
pub fn warn_unknown_env_vars() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let names: Vec<String> = std::env::vars_os().map(|(k, _)| k.to_string_lossy().into_owned()).collect();
        for unknown in unknown_vars(names.iter().map(String::as_str)) {
            crate::notice::warn(format_args!("{unknown}"));
        }
    });
}

pub use umm_placement::units::{parse_capacity, parse_size};

/// Parses a pool limit: a size with a unit (`2GiB`, `1048576B`) or a percentage of the device's capacity
/// (`90%`). A bare number is refused, since it could be bytes or a fraction; see [`Limit::parse`].
pub fn parse_limit(text: &str) -> Result<Limit, String> {
    Limit::parse(text)
}

fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
