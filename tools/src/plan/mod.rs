//! Offline memory planning: when every allocation's lifetime is known ahead of time (a training or inference
//! step that repeats, or a recorded trace), one block of memory can hold them all, each at a fixed offset, with
//! two allocations sharing bytes only when their lifetimes never meet.
//!
//! - [`LifetimeAnalyzer`] collects lifetimes: from [`LifetimeAnalyzer::record_usage`] (at step `s` these
//!   tensors are in use), from a loaded [`Trace`](umm::trace::Trace) or from a trace file. The manager can
//!   record its own allocations to a file ([`umm::Builder::record_trace`], `UMM_TRACE`); a plan is made from
//!   that file with [`LifetimeAnalyzer::from_trace_file`] (the manager does not hand its recording over in
//!   memory).
//! - [`LifetimeAnalyzer::compute_reuse_plan`] assigns offsets ([`ReusePlan`]) with the solver in
//!   [`umm_backends::plan`] (where a pool can call it too): several greedy heuristics from the literature
//!   (greedy by size and greedy by breadth as in TFLite, the lifetime order of XLA's heap simulator; each with
//!   best fit and first fit), the smallest plan kept; when none reaches the lower bound, a bounded, seeded
//!   search (ruin and recreate: the tensors that stand above a target are taken off with their neighbours in
//!   time and placed again) from their plans. [`ReusePlan::verify`] checks a plan independently of how it was
//!   made.
//! - [`PlannedArena`] serves a repeating step from one pool block of the plan's size and falls back to the pool
//!   when the step does something the plan did not foresee.
//!
//! ```
//! use umm_tools::plan::LifetimeAnalyzer;
//!
//! let mut analyzer = LifetimeAnalyzer::new();
//! analyzer.record_usage(0, &[(1, 4096), (2, 4096)])?; // tensors 1 and 2 in use at step 0
//! analyzer.record_usage(1, &[(2, 4096), (3, 8192)])?; // 1 is dead: 3 may take its bytes (and more)
//! let plan = analyzer.compute_reuse_plan();
//! plan.verify()?;
//! assert_eq!(plan.lower_bound_bytes, 4096 + 8192);
//! assert_eq!(plan.peak_bytes, plan.lower_bound_bytes);
//! # Ok::<(), umm_tools::plan::PlanError>(())
//! ```

mod analyzer;
mod arena;
mod report;
mod reuse;

pub use analyzer::{Lifetime, LifetimeAnalyzer};
pub use arena::{ArenaBlock, ArenaError, ArenaStats, PlannedArena};
pub use report::{plan_trace, PlanReport};
pub use reuse::{Fit, Heuristic, Order, PlannedAllocation, ReusePlan};

use thiserror::Error;

/// Alignment of every planned offset and size unless another is asked for: 512 bytes, a multiple of every
/// backend's block alignment (host 64, sim and CUDA 256, wgpu and OpenCL at most 256 on the devices umm meets)
/// and the granularity PyTorch rounds its blocks to, so a plan made from a PyTorch trace keeps its sizes.
pub const DEFAULT_ALIGNMENT: u64 = 512;

/// What can go wrong collecting lifetimes, and what [`ReusePlan::verify`] finds wrong with a plan.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A tensor was recorded with a size other than the one it was first recorded with.
    #[error("tensor {id} is recorded with {bytes} bytes at step {step}, but it was first recorded with {first_bytes}")]
    SizeMismatch {
        /// The tensor.
        id: u64,
        /// The step of the conflicting record.
        step: u64,
        /// The size it was first recorded with.
        first_bytes: u64,
        /// The size recorded at `step`.
        bytes: u64,
    },
    /// [`LifetimeAnalyzer::record_usage`] was called with a step before one already recorded.
    #[error("step {step} is recorded after step {previous}: steps must not go backwards")]
    StepBackwards {
        /// The step given.
        step: u64,
        /// The latest step recorded before.
        previous: u64,
    },
    /// A tensor of zero bytes: it needs no memory, so it has no place in a plan.
    #[error("tensor {id} is recorded with zero bytes at step {step}")]
    ZeroSize {
        /// The tensor.
        id: u64,
        /// The step.
        step: u64,
    },
    /// A tensor whose size overflows when rounded up to the alignment.
    #[error("tensor {id} of {bytes} bytes is too large to round up to the alignment of {alignment}")]
    TooLarge {
        /// The tensor.
        id: u64,
        /// Its size.
        bytes: u64,
        /// The alignment.
        alignment: u64,
    },
    /// Tensors whose sizes, rounded up to the alignment, add up to more than `u64::MAX` bytes: no plan could
    /// give each its own offset in one addressable range, and the planner's figures would overflow.
    #[error(
        "the tensors' sizes, rounded up to the alignment of {alignment} bytes, add up to more than 2^64 bytes \
         (at tensor {id}): no plan can address them"
    )]
    TotalTooLarge {
        /// The tensor whose size passed the total.
        id: u64,
        /// The alignment.
        alignment: u64,
    },
    /// An alignment that is not a power of two.
    #[error("alignment {alignment} is not a power of two")]
    InvalidAlignment {
        /// The alignment given.
        alignment: u64,
    },
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] umm::trace::TraceError),
    /// Verification: two allocations whose lifetimes meet share bytes.
    #[error(
        "allocations {a} (bytes {a_start}..{a_end}, live {a_first}..={a_last}) and {b} (bytes {b_start}..{b_end}, \
         live {b_first}..={b_last}) are live at the same time and overlap in memory"
    )]
    Overlap {
        /// Id of the allocation placed first in the check.
        a: u64,
        /// Its byte range start.
        a_start: u64,
        /// Its byte range end (exclusive).
        a_end: u64,
        /// Its first step.
        a_first: u64,
        /// Its last step.
        a_last: u64,
        /// Id of the other allocation.
        b: u64,
        /// Its byte range start.
        b_start: u64,
        /// Its byte range end (exclusive).
        b_end: u64,
        /// Its first step.
        b_first: u64,
        /// Its last step.
        b_last: u64,
    },
    /// Verification: an allocation whose planned place is unusable (misaligned, too small for its request,
    /// past the plan's peak, or ending before it starts).
    #[error("allocation {id}: {what}")]
    BadAllocation {
        /// The allocation's id.
        id: u64,
        /// What is wrong.
        what: String,
    },
    /// Verification: the plan's lower bound is not the most bytes live at any instant.
    #[error("the plan claims a lower bound of {claimed} bytes, but at most {actual} bytes are live at any instant")]
    WrongLowerBound {
        /// `lower_bound_bytes` in the plan.
        claimed: u64,
        /// Recomputed from the allocations.
        actual: u64,
    },
}

/// `bytes` rounded up to `alignment` (a power of two); `None` on overflow.
fn round_up(bytes: u64, alignment: u64) -> Option<u64> {
    bytes.checked_add(alignment - 1).map(|b| b & !(alignment - 1))
}
