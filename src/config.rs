//! Configuration: what the builder sets and what `UMM_*` environment variables override.
//!
//! | variable | accepts | sets |
//! |---|---|---|
//! | `UMM_LIMIT` | bytes (`2GiB`, `1500MB`, `1048576`) or a fraction in (0, 1] (`0.8`) | every pool's cap on reserved bytes |
//! | `UMM_STRATEGY` | `pooled` or `direct` | caching (pooled) or one segment per block (direct, for debugging) |
//! | `UMM_SEGMENT_MODE` | `auto`, `plain` or `virtual` | virtual reservations for large blocks where supported |
//! | `UMM_SMALL_SEGMENT`, `UMM_LARGE_SEGMENT` | bytes | segment sizes of the small and large classes |
//! | `UMM_SMALL_MAX`, `UMM_MEDIUM_MAX` | bytes | size-class thresholds of the decision table |
//! | `UMM_PRESSURE` | a fraction in [0, 1] | used share of a device above which Auto avoids it |
//! | `UMM_ZERO`, `UMM_POISON` | `0`/`1`, `true`/`false`, `on`/`off` | zero every allocation; poison every freed block |
//! | `UMM_BACKENDS` | a comma list of `cuda`, `opencl`, `wgpu` (or `none`) | which APIs discovery probes |
//! | `UMM_MAPPED_SLACK` | a fraction >= 0 or `off` | how far reserved may exceed live memory in virtual reservations before free pages are unmapped (default 0.03) |
//! | `UMM_PAGE_SIZE` | bytes, a power of two (`8MiB`) | page size of virtual reservations (default the device's own, 2 MiB on CUDA): larger pages map and unmap with fewer driver calls, at some memory |
//! | `UMM_THREAD_CACHE`, `UMM_THREAD_CACHE_LARGE` | bytes, `0` for off | most bytes of free small (large) blocks one thread's cache keeps per stream (default 32 MiB and 1 GiB; large blocks only once threads contend, up to a sixteenth of the bound each) |
//! | `UMM_CLEANUP_IDLE_ROUNDS` | an integer | cleanups a cached segment must sit idle before `cleanup()` frees it |
//! | `UMM_PROFILE` | `0`/`1`, `true`/`false`, `on`/`off` | record allocation, free and segment events from the start |
//! | `UMM_PROFILE_CAPACITY` | an integer | events the profiler's ring keeps (default 100000) |
//! | `UMM_TRACE` | a file path (`{pid}` is replaced by the process id; `.gz` compresses) | write every allocation and free as an `umm-trace v1` file |
//!
//! `UMM_PROFILE`, `UMM_PROFILE_CAPACITY` and `UMM_TRACE` are read by every [`crate::Builder`], even without
//! `from_env`, so that any program using the library can be profiled or traced without changing it.

use crate::profiler::ProfilerConfig;
use crate::{Error, Result};
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
    /// Applies every `UMM_*` variable that is set. An invalid value is an error naming the variable and what it
    /// accepts.
    pub fn apply_env(&mut self) -> Result<()> {
        self.apply_vars(|name| std::env::var(name).ok())
    }

    /// Applies variables from `lookup` (the environment, or a map in tests).
    pub fn apply_vars(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = lookup("UMM_LIMIT") {
            self.pool.limit = Some(parse_limit(&v).map_err(|_| Error::InvalidEnv {
                var: "UMM_LIMIT",
                value: v,
                expected: "a byte count (2GiB, 1500MB, 1048576) or a fraction in (0, 1]",
            })?);
        }
        if let Some(v) = lookup("UMM_STRATEGY") {
            self.pool.strategy = v.parse::<Strategy>().map_err(|_| Error::InvalidEnv {
                var: "UMM_STRATEGY",
                value: v,
                expected: "pooled or direct",
            })?;
        }
        if let Some(v) = lookup("UMM_SEGMENT_MODE") {
            self.pool.segment_mode = v.parse::<SegmentMode>().map_err(|_| Error::InvalidEnv {
                var: "UMM_SEGMENT_MODE",
                value: v,
                expected: "auto, plain or virtual",
            })?;
        }
        for (var, field) in [
            ("UMM_SMALL_SEGMENT", &mut self.pool.small_segment_size),
            ("UMM_LARGE_SEGMENT", &mut self.pool.large_segment_size),
            ("UMM_SMALL_MAX", &mut self.decision.thresholds.small_max),
            ("UMM_MEDIUM_MAX", &mut self.decision.thresholds.medium_max),
        ] {
            if let Some(v) = lookup(var) {
                *field = parse_size(&v).ok().filter(|&b| b > 0).ok_or(Error::InvalidEnv {
                    var,
                    value: v,
                    expected: "a byte count above zero (64KiB, 16MiB, 65536)",
                })?;
            }
        }
        for (var, field) in [
            ("UMM_THREAD_CACHE", &mut self.pool.thread_cache_bytes),
            ("UMM_THREAD_CACHE_LARGE", &mut self.pool.thread_cache_large_bytes),
        ] {
            if let Some(v) = lookup(var) {
                *field = parse_size(&v).map_err(|_| Error::InvalidEnv {
                    var,
                    value: v,
                    expected: "a byte count, 0 for off (8MiB, 0, 268435456)",
                })?;
            }
        }
        if let Some(v) = lookup("UMM_PRESSURE") {
            self.decision.pressure_threshold = v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|f| (0.0..=1.0).contains(f))
                .ok_or(Error::InvalidEnv { var: "UMM_PRESSURE", value: v, expected: "a fraction in [0, 1]" })?;
        }
        for (var, field) in [("UMM_ZERO", &mut self.pool.zero_on_alloc), ("UMM_POISON", &mut self.pool.poison_on_free)]
        {
            if let Some(v) = lookup(var) {
                *field = parse_bool(&v).ok_or(Error::InvalidEnv {
                    var,
                    value: v,
                    expected: "0/1, true/false, on/off or yes/no",
                })?;
            }
        }
        if let Some(v) = lookup("UMM_BACKENDS") {
            let (mut cuda, mut opencl, mut wgpu) = (false, false, false);
            for name in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                match name.to_ascii_lowercase().as_str() {
                    "cuda" => cuda = true,
                    "opencl" => opencl = true,
                    "wgpu" => wgpu = true,
                    "none" | "host" => {}
                    _ => {
                        return Err(Error::InvalidEnv {
                            var: "UMM_BACKENDS",
                            value: v.clone(),
                            expected: "a comma-separated list of cuda, opencl, wgpu (or none)",
                        })
                    }
                }
            }
            (self.cuda, self.opencl, self.wgpu) = (cuda, opencl, wgpu);
        }
        if let Some(v) = lookup("UMM_MAPPED_SLACK") {
            self.pool.mapped_slack = PoolConfig::parse_mapped_slack(&v).ok_or_else(|| Error::InvalidEnv {
                var: "UMM_MAPPED_SLACK",
                value: v.clone(),
                expected: "a fraction >= 0 (0.03) or off",
            })?;
        }
        if let Some(v) = lookup("UMM_PAGE_SIZE") {
            self.pool.page_size =
                Some(parse_size(&v).ok().filter(|b| b.is_power_of_two()).ok_or(Error::InvalidEnv {
                    var: "UMM_PAGE_SIZE",
                    value: v,
                    expected: "a power of two of bytes (2MiB, 8MiB, 8388608)",
                })?);
        }
        if let Some(v) = lookup("UMM_CLEANUP_IDLE_ROUNDS") {
            self.cleanup_idle_rounds = v.trim().parse().map_err(|_| Error::InvalidEnv {
                var: "UMM_CLEANUP_IDLE_ROUNDS",
                value: v,
                expected: "a non-negative integer",
            })?;
        }
        self.apply_profiler_vars(lookup)?;
        self.validate()
    }

    /// Applies `UMM_PROFILE`, `UMM_PROFILE_CAPACITY` and `UMM_TRACE` from `lookup`.
    pub fn apply_profiler_vars(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = lookup("UMM_PROFILE") {
            self.profiler.enabled = parse_bool(&v).ok_or(Error::InvalidEnv {
                var: "UMM_PROFILE",
                value: v,
                expected: "0/1, true/false, on/off or yes/no",
            })?;
        }
        if let Some(v) = lookup("UMM_PROFILE_CAPACITY") {
            self.profiler.capacity = v.trim().parse().map_err(|_| Error::InvalidEnv {
                var: "UMM_PROFILE_CAPACITY",
                value: v,
                expected: "a non-negative integer (events kept)",
            })?;
        }
        if let Some(v) = lookup("UMM_TRACE") {
            if v.trim().is_empty() {
                return Err(Error::InvalidEnv { var: "UMM_TRACE", value: v, expected: "a file path" });
            }
            self.profiler.trace_path = Some(v.trim().into());
        }
        Ok(())
    }

    /// Checks the values against each other.
    pub fn validate(&self) -> Result<()> {
        self.decision.validate()?;
        self.pool.validate()?;
        Ok(())
    }
}

pub use umm_backends::parse_size;

/// Parses a pool limit: a size as [`parse_size`] reads it, or a fraction of the device's capacity in `(0, 1]`
/// written with a decimal point and no unit (`0.9`).
pub fn parse_limit(text: &str) -> Result<Limit, String> {
    let t = text.trim();
    if t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.') {
        let fraction: f64 = t.parse().map_err(|_| format!("`{t}` is not a number"))?;
        if fraction > 0.0 && fraction <= 1.0 {
            return Ok(Limit::Fraction(fraction));
        }
        return Err(format!(
            "`{t}` is a fraction outside (0, 1]: give a fraction of the device's capacity such as 0.9, \
             or a size such as 2GiB"
        ));
    }
    let bytes = parse_size(t).map_err(|e| format!("{e}; or a fraction of the device's capacity such as 0.9"))?;
    match bytes {
        0 => Err("a limit of zero bytes allows nothing: give a size such as 2GiB or a fraction such as 0.9".into()),
        bytes => Ok(Limit::Bytes(bytes)),
    }
}

fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn env_values_apply_and_errors_name_the_variable() {
        let vars: HashMap<&str, &str> = [
            ("UMM_LIMIT", "1GiB"),
            ("UMM_STRATEGY", "direct"),
            ("UMM_ZERO", "on"),
            ("UMM_BACKENDS", "opencl"),
            ("UMM_PAGE_SIZE", "8MiB"),
            ("UMM_THREAD_CACHE", "0"),
            ("UMM_THREAD_CACHE_LARGE", "64MiB"),
        ]
        .into();
        let mut config = UmmConfig::default();
        config.apply_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(config.pool.limit, Some(Limit::Bytes(1 << 30)));
        assert_eq!(config.pool.page_size, Some(8 << 20));
        assert_eq!((config.pool.thread_cache_bytes, config.pool.thread_cache_large_bytes), (0, 64 << 20));
        assert_eq!(config.pool.strategy, Strategy::Direct);
        assert!(config.pool.zero_on_alloc);
        assert!(!config.cuda && config.opencl && !config.wgpu);

        let vars: HashMap<&str, &str> =
            [("UMM_PROFILE", "1"), ("UMM_PROFILE_CAPACITY", "64"), ("UMM_TRACE", "/tmp/x.trace")].into();
        config.apply_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert!(config.profiler.enabled);
        assert_eq!(config.profiler.capacity, 64);
        assert_eq!(config.profiler.trace_path.as_deref(), Some(std::path::Path::new("/tmp/x.trace")));

        for (var, value) in [
            ("UMM_LIMIT", "lots"),
            ("UMM_STRATEGY", "hoard"),
            ("UMM_SEGMENT_MODE", "weird"),
            ("UMM_SMALL_MAX", "0"),
            ("UMM_PRESSURE", "1.5"),
            ("UMM_POISON", "maybe"),
            ("UMM_BACKENDS", "cuda,metal"),
            ("UMM_CLEANUP_IDLE_ROUNDS", "-1"),
            ("UMM_PAGE_SIZE", "3MiB"),
            ("UMM_THREAD_CACHE", "lots"),
            ("UMM_THREAD_CACHE_LARGE", "-1"),
            ("UMM_PROFILE", "sometimes"),
            ("UMM_PROFILE_CAPACITY", "lots"),
            ("UMM_TRACE", " "),
        ] {
            let err = UmmConfig::default().apply_vars(|k| (k == var).then(|| value.to_string())).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(var) && text.contains("expected"), "{var}: {text}");
        }
        // An unknown backend: the message quotes the value with the unknown name and lists the names accepted.
        // The fields are checked, not the text, since the value itself already contains "cuda".
        let err =
            UmmConfig::default().apply_vars(|k| (k == "UMM_BACKENDS").then(|| "cuda,metal".to_string())).unwrap_err();
        let text = err.to_string();
        match &err {
            Error::InvalidEnv { var: "UMM_BACKENDS", value, expected } => {
                assert_eq!(value, "cuda,metal", "{text}");
                assert!(text.contains("metal"), "the unknown name is in the message: {text}");
                for known in ["cuda", "opencl", "wgpu"] {
                    assert!(expected.contains(known), "the accepted list names {known}: {text}");
                }
            }
            other => panic!("UMM_BACKENDS=cuda,metal should be InvalidEnv for UMM_BACKENDS, got {other:?}"),
        }
        let err = UmmConfig::default()
            .apply_vars(|k| match k {
                "UMM_SMALL_MAX" => Some("32MiB".into()),
                _ => None,
            })
            .unwrap_err();
        assert!(err.to_string().contains("small_max"), "{err}");
    }
}
