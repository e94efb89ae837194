//! `UMM_REQUIRE_BACKENDS` against this build's features. The backend test files are compiled only with their
//! cargo feature, so `cargo test -p umm-backends` with `UMM_REQUIRE_BACKENDS=opencl` would otherwise build no
//! OpenCL test at all and pass: this file has no feature gate, and fails for a required backend not built in.

use umm_backends::backend_required;

/// Every name that `UMM_REQUIRE_BACKENDS` can hold: a backend, or a capability some machines lack (named by the
/// tests that need it), with the cargo feature its tests need and whether that feature is on in this build
/// (`None`: tests in every build).
const KNOWN: [(&str, Option<&str>, bool); 7] = [
    ("cuda", Some("cuda"), cfg!(feature = "cuda")),
    ("cuda-vmm", Some("cuda"), cfg!(feature = "cuda")),
    ("multi-gpu", Some("cuda"), cfg!(feature = "cuda")),
    ("opencl", Some("opencl"), cfg!(feature = "opencl")),
    ("opencl-shared-memory", Some("opencl"), cfg!(feature = "opencl")),
    ("wgpu", Some("wgpu"), cfg!(feature = "wgpu")),
    ("c-header", None, true),
];

#[test]
fn every_required_backend_is_compiled_in() {
    let list = std::env::var("UMM_REQUIRE_BACKENDS").unwrap_or_default();
    let missing: Vec<&str> =
        KNOWN.iter().filter(|&&(name, _, built)| backend_required(name) && !built).map(|k| k.0).collect();
    let mut features: Vec<&str> = KNOWN.iter().filter(|k| missing.contains(&k.0)).filter_map(|k| k.1).collect();
    features.dedup();
    assert!(
        missing.is_empty(),
        "UMM_REQUIRE_BACKENDS={list:?} requires {missing:?}, but this build lacks the cargo feature(s), so their \
         tests were not compiled: enable them (e.g. --features {}) or test the workspace",
        features.join(",")
    );
}

#[test]
fn required_backend_names_are_known() {
    // A misspelt name (`opencl3`, `vulkan`) is required by no test, so it would turn no skip into a failure.
    let list = std::env::var("UMM_REQUIRE_BACKENDS").unwrap_or_default();
    let unknown: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty() && !n.eq_ignore_ascii_case("all"))
        .filter(|n| !KNOWN.iter().any(|(name, _, _)| n.eq_ignore_ascii_case(name)))
        .collect();
    assert!(
        unknown.is_empty(),
        "UMM_REQUIRE_BACKENDS={list:?} names {unknown:?}; known: {}, all",
        KNOWN.map(|k| k.0).join(", ")
    );
}
