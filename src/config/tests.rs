use super::*;
use std::collections::HashMap;

fn apply(var: &str, value: &str) -> Result<UmmConfig> {
    let mut config = UmmConfig::default();
    config.apply_vars(|k| (k == var).then(|| value.to_string()))?;
    Ok(config)
}

#[test]
fn umm_limit_takes_a_unit_or_a_percentage_and_refuses_bare_numbers() {
    assert_eq!(apply("UMM_LIMIT", "80%").unwrap().pool.limit, Some(Limit::Fraction(0.8)));
    assert_eq!(apply("UMM_LIMIT", "1048576B").unwrap().pool.limit, Some(Limit::Bytes(1 << 20)));
    for bare in ["1", "1.0", "0.8", "1048576"] {
        let text = apply("UMM_LIMIT", bare).unwrap_err().to_string();
        assert!(text.contains("UMM_LIMIT") && text.contains(bare), "{bare}: {text}");
        assert!(text.contains("GiB") && text.contains("90%"), "{bare}: names both forms: {text}");
    }
}

#[test]
fn env_values_apply_and_errors_name_the_variable() {
    let vars: HashMap<&str, &str> = [
        ("UMM_LIMIT", "1GiB"),
        ("UMM_STRATEGY", "direct"),
        ("UMM_ZERO", "on"),
        ("UMM_BACKENDS", "opencl"),
        ("UMM_PAGE_SIZE", "8MiB"),
        ("UMM_ALIGNMENT", "512"),
        ("UMM_THREAD_CACHE", "0"),
        ("UMM_THREAD_CACHE_LARGE", "64MiB"),
        ("UMM_CROSS_STREAM", " Wait"),
        ("UMM_PLAN_STEPS", "off"),
        ("UMM_STITCH", "off"),
        ("UMM_SPREAD", " Current_First"),
        ("UMM_WGPU_TIMEOUT", "5"),
        ("UMM_WGPU_WATCHDOG", "off"),
    ]
    .into();
    let mut config = UmmConfig::default();
    config.apply_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap();
    assert_eq!(config.pool.limit, Some(Limit::Bytes(1 << 30)));
    assert_eq!(config.pool.page_size, Some(8 << 20));
    assert_eq!(config.pool.alignment, Some(512));
    assert_eq!((config.pool.thread_cache_bytes, config.pool.thread_cache_large_bytes), (0, 64 << 20));
    assert_eq!(config.pool.strategy, Strategy::Direct);
    assert_eq!(config.pool.cross_stream, umm_backends::CrossStream::Wait);
    assert!(!config.pool.plan_steps);
    assert!(!config.pool.stitch);
    assert_eq!(config.decision.spread, umm_placement::Spread::CurrentFirst);
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
        ("UMM_ALIGNMENT", "384"),
        ("UMM_ALIGNMENT", "1MiB"),
        ("UMM_THREAD_CACHE", "lots"),
        ("UMM_THREAD_CACHE_LARGE", "-1"),
        ("UMM_PROFILE", "sometimes"),
        ("UMM_PROFILE_CAPACITY", "lots"),
        ("UMM_TRACE", " "),
        ("UMM_CROSS_STREAM", "sometimes"),
        ("UMM_PLAN_STEPS", "sometimes"),
        ("UMM_STITCH", "sometimes"),
        ("UMM_SPREAD", "fill"),
        #[cfg(feature = "wgpu")]
        ("UMM_WGPU_TIMEOUT", "off"),
        #[cfg(feature = "wgpu")]
        ("UMM_WGPU_WATCHDOG", "soon"),
    ] {
        let err = UmmConfig::default().apply_vars(|k| (k == var).then(|| value.to_string())).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(var) && text.contains("expected"), "{var}: {text}");
    }
    // An unknown backend: the message quotes the value with the unknown name and lists the names accepted.
    // The fields are checked, not the text, since the value itself already contains "cuda".
    let err = UmmConfig::default().apply_vars(|k| (k == "UMM_BACKENDS").then(|| "cuda,metal".to_string())).unwrap_err();
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
    assert!(err.to_string().contains("UMM_SMALL_MAX=\"32MiB\""), "{err}");
}

#[test]
fn segment_sizes_below_their_minimum_name_the_variable_and_the_minimum() {
    for (var, value, min) in [
        ("UMM_LARGE_SEGMENT", "1", "2.00 MiB"),
        ("UMM_LARGE_SEGMENT", "1MiB", "2.00 MiB"),
        ("UMM_SMALL_SEGMENT", "4KiB", "1.00 MiB"),
    ] {
        let err = apply(var, value).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::InvalidEnv { .. }), "{text}");
        assert!(text.contains(var) && text.contains(value) && text.contains(min), "{var}={value}: {text}");
    }
    assert_eq!(apply("UMM_LARGE_SEGMENT", "2MiB").unwrap().pool.large_segment_size, 2 << 20);
    assert_eq!(apply("UMM_SMALL_SEGMENT", "1MiB").unwrap().pool.small_segment_size, 1 << 20);
}

#[test]
fn an_empty_backend_list_is_refused_and_none_is_how_to_say_no_accelerator() {
    for empty in ["", " ", ",", " , "] {
        let text = apply("UMM_BACKENDS", empty).unwrap_err().to_string();
        assert!(text.contains("UMM_BACKENDS") && text.contains("none"), "{empty:?}: {text}");
    }
    let config = apply("UMM_BACKENDS", "none").unwrap();
    assert!(!config.cuda && !config.opencl && !config.wgpu);
}

#[test]
fn threshold_errors_name_the_variable_its_value_and_the_value_it_conflicts_with() {
    let text = apply("UMM_SMALL_MAX", "1TiB").unwrap_err().to_string();
    assert!(text.contains("UMM_SMALL_MAX=\"1TiB\"") && text.contains("16.00 MiB"), "{text}");
    let text = apply("UMM_MEDIUM_MAX", "1KiB").unwrap_err().to_string();
    assert!(text.contains("UMM_MEDIUM_MAX=\"1KiB\"") && text.contains("64.00 KiB"), "{text}");
    let vars: HashMap<&str, &str> = [("UMM_SMALL_MAX", "8MiB"), ("UMM_MEDIUM_MAX", "4MiB")].into();
    let text = UmmConfig::default().apply_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap_err().to_string();
    assert!(text.contains("UMM_SMALL_MAX=\"8MiB\"") && text.contains("UMM_MEDIUM_MAX"), "{text}");
    // Values valid alone that clash with a builder value: the error lists what the environment set.
    let mut config = UmmConfig::default();
    config.pool.small_request_max = 4 << 20;
    let text = config.apply_vars(|k| (k == "UMM_ZERO").then(|| "1".to_string())).unwrap_err().to_string();
    assert!(text.contains("small_segment_size") && text.contains("UMM_ZERO=\"1\""), "{text}");
}

#[test]
fn unknown_umm_variables_are_found_with_the_closest_known_name() {
    let found = unknown_vars(["UMM_LIMT", "umm_limit", "UMM_LARGE_SEGMNT", "UMM_FROBNICATE", "PATH", "UMM_ZERO"]);
    let pairs: Vec<(&str, Option<&str>)> = found.iter().map(|u| (u.name.as_str(), u.suggestion)).collect();
    assert_eq!(
        pairs,
        [
            ("UMM_LIMT", Some("UMM_LIMIT")),
            ("umm_limit", Some("UMM_LIMIT")),
            ("UMM_LARGE_SEGMNT", Some("UMM_LARGE_SEGMENT")),
            ("UMM_FROBNICATE", None),
        ]
    );
    assert!(found[0].to_string().contains("did you mean UMM_LIMIT?"), "{}", found[0]);
    assert!(unknown_vars(KNOWN_VARS.iter().copied()).is_empty());
}
