//! What `umm plan` reports for one trace.

use super::{LifetimeAnalyzer, PlanError, ReusePlan};
use serde::Serialize;
use std::time::Instant;
use umm::trace::Trace;

/// One trace's plan in figures: the `umm plan --json` object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    /// Trace name.
    pub trace: String,
    /// Bytes the plan needs.
    pub plan_peak_bytes: u64,
    /// The most aligned bytes live at once: no plan needs less.
    pub lower_bound_bytes: u64,
    /// `plan_peak_bytes / lower_bound_bytes` (1.0 for a trace that allocates nothing).
    pub plan_over_lower_bound: f64,
    /// Milliseconds to take the lifetimes from the loaded trace and compute the plan (loading and verifying
    /// not included).
    pub planning_ms: f64,
    /// The peak of bytes umm's pool reserved replaying the trace on the simulated device, as `umm replay`
    /// does; `None` until measured (the CLI fills it in).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_reserved_bytes: Option<u64>,
}

/// Plans `trace` with sizes and offsets aligned to `alignment`, verifies the plan, and returns it with its
/// report (`pool_reserved_bytes` left `None`).
pub fn plan_trace(trace: &Trace, alignment: u64) -> Result<(ReusePlan, PlanReport), PlanError> {
    let start = Instant::now();
    let plan = LifetimeAnalyzer::from_trace_with_alignment(trace, alignment)?.compute_reuse_plan();
    let planning_ms = start.elapsed().as_secs_f64() * 1e3;
    plan.verify()?;
    let report = PlanReport {
        trace: trace.name.clone(),
        plan_peak_bytes: plan.peak_bytes,
        lower_bound_bytes: plan.lower_bound_bytes,
        plan_over_lower_bound: plan.over_lower_bound(),
        planning_ms,
        pool_reserved_bytes: None,
    };
    Ok((plan, report))
}
