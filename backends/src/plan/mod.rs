//! The offline memory planner's solver: given allocations whose lifetimes are all known ahead of time
//! ([`PlanItem`]: first and last step, aligned size), one offset for each in a single block, two allocations
//! sharing bytes only when their lifetimes never meet, and the block as small as the planner can make it.
//!
//! [`solve()`] runs several greedy heuristics from the literature (greedy by size and greedy by breadth as in
//! TFLite, the lifetime order of XLA's heap simulator; each with best fit or first fit, see [`Order`] and
//! [`Fit`]), keeps the smallest plan, and when none reaches [`lower_bound()`] (the most bytes live at one step,
//! which no plan can beat) runs a bounded, seeded search from their plans (ruin and recreate: the allocations
//! that stand above a target are taken off with their neighbours in time and placed again). The result is the
//! same on every machine, however many threads it has or however loaded it is.
//!
//! This module only places: it neither aligns sizes nor checks a plan. `umm_tools::plan` builds on
//! it (lifetimes from traces, alignment, an independent check of the plan, an arena that serves a plan), and a
//! pool can call it directly to plan offsets itself.
//!
//! ```
//! use umm_backends::plan::{lower_bound, solve, PlanItem};
//!
//! let items = [
//!     PlanItem { first: 0, last: 0, size: 4096 }, // dead after step 0
//!     PlanItem { first: 0, last: 1, size: 4096 },
//!     PlanItem { first: 1, last: 1, size: 8192 }, // may take the first one's bytes (and more)
//! ];
//! let solution = solve(&items);
//! assert_eq!(solution.lower_bound, lower_bound(&items));
//! assert_eq!(solution.lower_bound, 4096 + 8192);
//! assert_eq!(solution.peak, solution.lower_bound);
//! assert_eq!(solution.offsets.len(), items.len());
//! ```

mod improve;
mod item;
mod occupancy;
mod solve;

pub use item::PlanItem;
pub use solve::{lower_bound, solve, Solution};

use serde::Serialize;
use std::fmt;

/// In which order the greedy planner places allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// Largest first (TFLite's greedy by size; XLA's spatial order).
    Size,
    /// Busiest instant first: allocations live at the instant with the most live bytes, largest first, then
    /// those at the next busiest instant (TFLite's greedy by breadth).
    Breadth,
    /// Longest lifetime first, then largest (XLA's temporal order).
    Duration,
}

/// Where the planner puts an allocation among the gaps left by allocations whose lifetimes meet its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fit {
    /// The smallest gap that holds it (lowest offset among equals), else above everything.
    Best,
    /// The lowest gap that holds it, else above everything.
    First,
}

/// Which greedy heuristic made a plan, and whether the search after the heuristics lowered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Heuristic {
    /// The order allocations were placed in.
    pub order: Order,
    /// How each found its gap.
    pub fit: Fit,
    /// Whether the plan is this heuristic's plan as the search after the heuristics lowered it (re-placing the
    /// allocations that stand above a target together with their neighbours in time), rather than the greedy
    /// plan itself.
    pub searched: bool,
}

impl fmt::Display for Heuristic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let order = match self.order {
            Order::Size => "greedy by size",
            Order::Breadth => "greedy by breadth",
            Order::Duration => "greedy by lifetime",
        };
        let fit = match self.fit {
            Fit::Best => "best fit",
            Fit::First => "first fit",
        };
        let searched = if self.searched { ", then search" } else { "" };
        write!(f, "{order}, {fit}{searched}")
    }
}
