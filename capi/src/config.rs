//! What the environment asks of the C ABI's pools, read once at the first call: `UMM_SEGMENT_MODE`,
//! `UMM_STRATEGY`, the slacks, `UMM_PAGE_SIZE`, `UMM_ALIGNMENT`, `UMM_CROSS_STREAM`, `UMM_HUGE_MIN` and the simulated devices of
//! `UMM_CAPI_SIM`. Every invalid value is an error that names its variable.

use umm_backends::{PoolConfig, SegmentMode, SimBackend, Strategy};

/// Default of `UMM_HUGE_MIN`: 0, no huge pool.
pub(crate) const DEFAULT_HUGE_MIN: u64 = 0;

/// The pool configuration: PyTorch's segment policy (the default), with `UMM_SEGMENT_MODE` (auto, plain,
/// virtual), `UMM_MAPPED_SLACK` and `UMM_SEGMENT_SLACK` (a fraction or off), `UMM_CROSS_STREAM` (off, completed,
/// wait), `UMM_PLAN_STEPS` (on, off), `UMM_PAGE_SIZE` (a power of two of
/// bytes: the page size of virtual reservations), `UMM_ALIGNMENT` (where blocks start), `UMM_THREAD_CACHE` and `UMM_THREAD_CACHE_LARGE` (the
/// per-thread caches' bounds, 0 for off) and `UMM_STRATEGY` (pooled, direct) read through `var` (the
/// environment). An error names the variable and its value.
pub(crate) fn pool_config(var: impl Fn(&str) -> Option<String>) -> Result<PoolConfig, String> {
    let mut config = PoolConfig::default();
    if let Some(v) = var("UMM_SEGMENT_MODE") {
        config.segment_mode = v
            .parse::<SegmentMode>()
            .map_err(|_| format!("UMM_SEGMENT_MODE={v:?} is not one of auto, plain, virtual"))?;
    }
    if let Some(v) = var("UMM_MAPPED_SLACK") {
        config.mapped_slack = PoolConfig::parse_slack(&v)
            .ok_or_else(|| format!("UMM_MAPPED_SLACK={v:?} is not a fraction >= 0 (0.03) or off"))?;
    }
    if let Some(v) = var("UMM_SEGMENT_SLACK") {
        config.segment_slack = PoolConfig::parse_slack(&v)
            .ok_or_else(|| format!("UMM_SEGMENT_SLACK={v:?} is not a fraction >= 0 (0.1) or off"))?;
    }
    if let Some(v) = var("UMM_CROSS_STREAM") {
        config.cross_stream =
            v.trim().parse().map_err(|_| format!("UMM_CROSS_STREAM={v:?} is not one of off, completed, wait"))?;
    }
    if let Some(v) = var("UMM_PAGE_SIZE") {
        config.page_size = Some(match umm_placement::units::parse_size(&v) {
            Ok(page) if page.is_power_of_two() => page,
            Ok(page) => return Err(format!("UMM_PAGE_SIZE={v:?} is not a power of two of bytes (8MiB): {page} bytes")),
            Err(e) => return Err(format!("UMM_PAGE_SIZE={v:?} is not a power of two of bytes (8MiB): {e}")),
        });
    }
    if let Some(v) = var("UMM_ALIGNMENT") {
        const WHAT: &str = "a power of two of bytes up to 64KiB (512)";
        config.alignment = Some(match umm_placement::units::parse_size(&v) {
            Ok(align) if align.is_power_of_two() && align <= umm_backends::pool::MAX_ALIGNMENT => align,
            Ok(align) => return Err(format!("UMM_ALIGNMENT={v:?} is not {WHAT}: {align} bytes")),
            Err(e) => return Err(format!("UMM_ALIGNMENT={v:?} is not {WHAT}: {e}")),
        });
    }
    for (name, field) in [
        ("UMM_THREAD_CACHE", &mut config.thread_cache_bytes),
        ("UMM_THREAD_CACHE_LARGE", &mut config.thread_cache_large_bytes),
    ] {
        if let Some(v) = var(name) {
            *field = umm_placement::units::parse_size(&v)
                .map_err(|e| format!("{name}={v:?} is not a byte count, 0 for off (8MiB, 0): {e}"))?;
        }
    }
    if let Some(v) = var("UMM_PLAN_STEPS") {
        config.plan_steps = match v.trim().to_ascii_lowercase().as_str() {
            "on" | "1" | "true" | "yes" => true,
            "off" | "0" | "false" | "no" => false,
            _ => return Err(format!("UMM_PLAN_STEPS={v:?} is not one of on, off (1/0, true/false, yes/no)")),
        };
    }
    if let Some(v) = var("UMM_STITCH") {
        config.stitch = match v.trim().to_ascii_lowercase().as_str() {
            "on" | "1" | "true" | "yes" => true,
            "off" | "0" | "false" | "no" => false,
            _ => return Err(format!("UMM_STITCH={v:?} is not one of on, off (1/0, true/false, yes/no)")),
        };
    }
    if let Some(v) = var("UMM_STRATEGY") {
        config.strategy =
            v.parse::<Strategy>().map_err(|_| format!("UMM_STRATEGY={v:?} is not one of pooled, direct"))?;
    }
    Ok(config)
}

/// `UMM_HUGE_MIN` read through `var`: a byte count, 0 (the default) for no huge pool.
pub(crate) fn huge_min(var: impl Fn(&str) -> Option<String>) -> Result<u64, String> {
    match var("UMM_HUGE_MIN") {
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("UMM_HUGE_MIN={v:?} is not a byte count (an integer such as 1073741824; 0 disables)")),
        None => Ok(DEFAULT_HUGE_MIN),
    }
}

/// The environment variable `name`; a value that is not Unicode comes back lossily converted, so that it is
/// reported as invalid rather than ignored.
pub(crate) fn env_var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// `UMM_CAPI_SIM` read through `var`: `None` (unset: CUDA devices), or the simulated devices' count and bytes
/// each, from `16GiB` (one device) or `2x16GiB`.
pub(crate) fn simulated_devices(var: impl Fn(&str) -> Option<String>) -> Option<Result<(usize, u64), String>> {
    let value = var("UMM_CAPI_SIM")?;
    let refuse =
        |why: String| format!("UMM_CAPI_SIM={value:?} is not a size (16GiB) or a count and a size (2x16GiB): {why}");
    let text = value.trim();
    let (count, size) = match text.split_once(['x', 'X']) {
        Some((count, size)) if !count.is_empty() && count.bytes().all(|b| b.is_ascii_digit()) => (count, size),
        _ => ("1", text),
    };
    let parsed = count
        .parse::<usize>()
        .map_err(|e| refuse(format!("count: {e}")))
        .and_then(|n| if (1..=64).contains(&n) { Ok(n) } else { Err(refuse(format!("{n} devices is not 1 to 64"))) })
        .and_then(|n| match umm_placement::units::parse_size(size) {
            Ok(bytes) if bytes >= SimBackend::PAGE => Ok((n, bytes)),
            Ok(bytes) => Err(refuse(format!("{bytes} bytes is below one 2 MiB page"))),
            Err(e) => Err(refuse(e)),
        });
    Some(parsed)
}

/// Where simulated device `index`'s addresses begin: 1 TiB apart, none at 0.
pub(crate) fn simulated_base(index: usize) -> u64 {
    (index as u64 + 1) << 40
}

/// Tagged pools a simulated device can have.
const SIMULATED_TAGS: usize = 256;

/// Where the addresses of simulated device `index`'s tagged pool `number` begin: 1 TiB apart, above every
/// device's main and huge pools (devices are at most 64).
pub(crate) fn simulated_tag_base(index: usize, number: usize) -> Result<u64, umm_backends::Error> {
    if number >= SIMULATED_TAGS {
        return Err(umm_backends::Error::InvalidConfig(format!(
            "a simulated device has at most {SIMULATED_TAGS} tags"
        )));
    }
    Ok((128 + (index * SIMULATED_TAGS + number) as u64) << 40)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    /// Valid values set the field they name; a page size must be a power of two.
    #[test]
    fn each_variable_sets_its_field() {
        let config = pool_config(vars(&[
            ("UMM_SEGMENT_MODE", "plain"),
            ("UMM_PLAN_STEPS", "off"),
            ("UMM_STITCH", "no"),
            ("UMM_PAGE_SIZE", "8MiB"),
            ("UMM_STRATEGY", "direct"),
            ("UMM_CROSS_STREAM", "wait"),
            ("UMM_MAPPED_SLACK", "0.05"),
            ("UMM_SEGMENT_SLACK", "off"),
            ("UMM_ALIGNMENT", "512"),
            ("UMM_THREAD_CACHE", "0"),
            ("UMM_THREAD_CACHE_LARGE", "64MiB"),
        ]))
        .unwrap();
        assert_eq!(config.alignment, Some(512));
        assert_eq!((config.thread_cache_bytes, config.thread_cache_large_bytes), (0, 64 << 20));
        assert_eq!(config.segment_mode, SegmentMode::Plain);
        assert!(!config.plan_steps && !config.stitch);
        assert_eq!(config.page_size, Some(8 << 20));
        assert_eq!(config.strategy, Strategy::Direct);
        assert_eq!(config.cross_stream, umm_backends::CrossStream::Wait);
        assert_eq!((config.mapped_slack, config.segment_slack), (Some(0.05), None));
        for on in ["on", "1", "true", "yes"] {
            let lookup = move |name: &str| (name == "UMM_PLAN_STEPS" || name == "UMM_STITCH").then(|| on.to_string());
            let config = pool_config(lookup).unwrap();
            assert!(config.plan_steps && config.stitch, "{on}");
        }
        for off in ["off", "0", "false", "no"] {
            let lookup = move |name: &str| (name == "UMM_PLAN_STEPS" || name == "UMM_STITCH").then(|| off.to_string());
            let config = pool_config(lookup).unwrap();
            assert!(!config.plan_steps && !config.stitch, "{off}");
        }
        let err = pool_config(vars(&[("UMM_PAGE_SIZE", "3MiB")])).unwrap_err();
        assert!(err.contains("not a power of two") && err.contains("3145728 bytes"), "{err}");
        let err = pool_config(vars(&[("UMM_THREAD_CACHE_LARGE", "-1")])).unwrap_err();
        assert!(err.contains("UMM_THREAD_CACHE_LARGE") && err.contains("-1"), "{err}");
        for bad in ["384", "128KiB", "lots"] {
            let err = pool_config(move |name: &str| (name == "UMM_ALIGNMENT").then(|| bad.to_string())).unwrap_err();
            assert!(err.contains("UMM_ALIGNMENT") && err.contains(bad), "{bad}: {err}");
        }
        assert_eq!(pool_config(vars(&[])).unwrap(), PoolConfig::default());
        assert_eq!(huge_min(vars(&[("UMM_HUGE_MIN", "1073741824")])), Ok(1 << 30));
        assert_eq!(huge_min(vars(&[])), Ok(0));
    }

    /// `UMM_CAPI_SIM`: a size, or a count and a size; at least one page; 1 to 64 devices.
    #[test]
    fn simulated_devices_are_read_from_a_size_or_a_count_and_a_size() {
        let read = |v: &'static str| simulated_devices(move |name: &str| (name == "UMM_CAPI_SIM").then(|| v.into()));
        assert_eq!(read("16GiB"), Some(Ok((1, 16 << 30))));
        assert_eq!(read("2x16GiB"), Some(Ok((2, 16 << 30))));
        assert_eq!(read(" 3X2MiB "), Some(Ok((3, 2 << 20))), "one page is enough");
        for (bad, why) in [
            ("x16GiB", "UMM_CAPI_SIM=\"x16GiB\""),
            ("2x", "UMM_CAPI_SIM=\"2x\""),
            ("1x1MiB", "below one 2 MiB page"),
            ("65x1GiB", "65 devices"),
            ("0x1GiB", "0 devices"),
        ] {
            let err = read(bad).expect("set").unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
        assert_eq!(simulated_devices(|_: &str| None), None, "unset: CUDA's devices");
    }

    /// Simulated devices start 1 TiB apart, none at 0; a huge pool next to a virtual main pool takes the
    /// requests of at least its size until a limit is set, at addresses of its own.
    /// Random values for every variable the C ABI reads: `Ok`, or an error that names the variable and quotes
    /// its value; never a panic. 10,000 cases (`UMM_FUZZ_CASES` overrides).
    #[test]
    fn fuzzed_variables_are_read_or_refused_by_name() {
        let cases: u64 = std::env::var("UMM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
        const VARS: [&str; 11] = [
            "UMM_ALIGNMENT",
            "UMM_THREAD_CACHE",
            "UMM_THREAD_CACHE_LARGE",
            "UMM_CROSS_STREAM",
            "UMM_PLAN_STEPS",
            "UMM_SEGMENT_MODE",
            "UMM_MAPPED_SLACK",
            "UMM_SEGMENT_SLACK",
            "UMM_PAGE_SIZE",
            "UMM_STRATEGY",
            "UMM_HUGE_MIN",
        ];
        const VALUES: [&str; 28] = [
            "wait",
            "on",
            "True",
            "Completed",
            "",
            " ",
            "0",
            "1",
            "-1",
            "0.1",
            "NaN",
            "inf",
            "off",
            "none",
            "auto",
            "plain",
            "virtual",
            "VIRTUAL",
            "pooled",
            "direct",
            "8MiB",
            "3MiB",
            "1e30B",
            "99999999999999999999",
            "18446744073709551615",
            "2 MiB",
            "µ",
            "\u{0}",
        ];
        let mut state = 0x1234_5678_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..cases {
            let name = VARS[(next() % 6) as usize];
            let value = if next() % 4 == 0 {
                (0..next() % 8).map(|_| char::from_u32((next() % 0x3000) as u32).unwrap_or('?')).collect()
            } else {
                format!("{}{}", VALUES[(next() % 24) as usize], ["", "MiB", " ", "%"][(next() % 4) as usize])
            };
            let lookup = |k: &str| (k == name).then(|| value.clone());
            for result in [pool_config(lookup).map(|_| ()), huge_min(lookup).map(|_| ())] {
                if let Err(e) = result {
                    assert!(e.contains(&format!("{name}={value:?}")), "{name}={value:?}: {e}");
                }
            }
        }
    }
}
