//! The test kit (the `testing` feature; the crates' own tests turn it on): what umm's suites use to fail a
//! backend on purpose and to skip a backend whose runtime is absent. Not part of the library a program links.
//!
//! - [`fault`]: [`FaultyBackend`](fault::FaultyBackend) wraps any backend and fails the k-th call of a kind.
//! - [`skip_or_fail`]: a skipped test says why, unless `UMM_REQUIRE_BACKENDS` requires the backend.

pub mod fault;

use crate::backend_required;

/// Prints why `backend`'s test is skipped, or panics with that reason if [`backend_required`] says it must be
/// present.
pub fn skip_or_fail(backend: &str, reason: &str) {
    assert!(!backend_required(backend), "{backend} is required by UMM_REQUIRE_BACKENDS but unavailable: {reason}");
    eprintln!("skipping {backend} test: {reason}");
}
