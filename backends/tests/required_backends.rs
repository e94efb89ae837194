//! `UMM_REQUIRE_BACKENDS` against this build's features. The backend test files are compiled only with their
//! cargo feature, so `cargo test -p umm-backends` with `UMM_REQUIRE_BACKENDS=opencl` would otherwise build no
//! OpenCL test at all and pass: this file has no feature gate, and fails for a required backend not built in.

use umm_backends::backend_required;

/// Every backend that `UMM_REQUIRE_BACKENDS` can name, and whether its cargo feature is on in this build.
const BUILT: [(&str, bool); 3] =
    [("cuda", cfg!(feature = "cuda")), ("opencl", cfg!(feature = "opencl")), ("wgpu", cfg!(feature = "wgpu"))];

#[test]
fn every_required_backend_is_compiled_in() {
    let list = std::env::var("UMM_REQUIRE_BACKENDS").unwrap_or_default();
    let missing: Vec<&str> =
        BUILT.iter().filter(|&&(name, built)| backend_required(name) && !built).map(|b| b.0).collect();
    assert!(
        missing.is_empty(),
        "UMM_REQUIRE_BACKENDS={list:?} requires {missing:?}, but this build lacks the cargo feature(s), so their \
         tests were not compiled: enable them (e.g. --features {}) or test the workspace",
        missing.join(",")
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
        .filter(|n| !BUILT.iter().any(|(name, _)| n.eq_ignore_ascii_case(name)))
        .collect();
    assert!(
        unknown.is_empty(),
        "UMM_REQUIRE_BACKENDS={list:?} names {unknown:?}; known: {}, all",
        BUILT.map(|b| b.0).join(", ")
    );
}
