//! What the planners place: one allocation's lifetime and size. Below both the greedy heuristics
//! ([`super::solve()`]) and the search after them (`improve`), which each take it.

/// One allocation to place: its lifetime, in steps, from `first` to `last` (both included), and its size in
/// bytes, already rounded up to whatever alignment the plan's offsets need (the planner does not align: every
/// offset it gives is a sum of sizes, so sizes that are multiples of an alignment give offsets that are too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanItem {
    /// First step the allocation is live at.
    pub first: u64,
    /// Last step it is live at (included). At least `first`.
    pub last: u64,
    /// Bytes it takes, already aligned.
    pub size: u64,
}
