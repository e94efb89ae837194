//! A plan (an offset for every allocation) and its independent check.

use super::PlanError;
use serde::Serialize;
use std::collections::BTreeMap;
// The heuristics' vocabulary lives with the solver, in `umm_backends::plan`; `umm_tools::plan` re-exports it.
pub use umm_backends::plan::{Fit, Heuristic, Order};

/// One allocation of a plan: its lifetime and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlannedAllocation {
    /// The tensor's id (see [`super::Lifetime::id`]).
    pub id: u64,
    /// Bytes asked for.
    pub bytes: u64,
    /// Bytes reserved for it: `bytes` rounded up to the plan's alignment.
    pub size: u64,
    /// First step it is live at.
    pub first: u64,
    /// Last step it is live at (included).
    pub last: u64,
    /// Offset of its first byte in the plan's block: a multiple of the alignment.
    pub offset: u64,
}

impl PlannedAllocation {
    /// Whether the two lifetimes share a step.
    pub fn meets(&self, other: &PlannedAllocation) -> bool {
        self.first <= other.last && other.first <= self.last
    }

    /// Whether the two byte ranges share a byte.
    pub fn shares_bytes(&self, other: &PlannedAllocation) -> bool {
        self.offset < other.offset.saturating_add(other.size) && other.offset < self.offset.saturating_add(self.size)
    }
}

/// An offset for every allocation such that two allocations live at the same step never share a byte.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReusePlan {
    /// Alignment of every offset and size.
    pub alignment: u64,
    /// The allocations, in the order they were first recorded (for a trace: allocation order).
    pub allocations: Vec<PlannedAllocation>,
    /// Bytes the plan needs: the highest end of any allocation.
    pub peak_bytes: u64,
    /// The most aligned bytes live at one step: no plan can need less.
    pub lower_bound_bytes: u64,
    /// The heuristic whose plan this is.
    pub heuristic: Heuristic,
}

impl ReusePlan {
    /// `peak_bytes / lower_bound_bytes`: 1.0 is optimal (1.0 for an empty plan too).
    pub fn over_lower_bound(&self) -> f64 {
        if self.lower_bound_bytes == 0 {
            1.0
        } else {
            self.peak_bytes as f64 / self.lower_bound_bytes as f64
        }
    }

    /// Checks the plan without trusting how it was made: every allocation is aligned, holds its request and lies
    /// below `peak_bytes`; no two allocations live at the same step share a byte; `lower_bound_bytes` is the most
    /// bytes live at one step.
    ///
    /// A sweep over time: allocations enter at their first step and leave after their last, and the live ones
    /// are kept in an ordered map by offset. Live ranges never overlap (each entering one is checked), so only
    /// the live range starting closest below the new one's end can overlap it: O(n log n) in all.
    pub fn verify(&self) -> Result<(), PlanError> {
        for a in &self.allocations {
            self.check_allocation(a)?;
        }
        // (time, 0 = leave / 1 = enter, allocation): at one time, leaving comes first, since lifetimes include
        // their last step and an allocation leaving at `t` left after step `t - 1`.
        let mut events: Vec<(u64, u8, u32)> = Vec::with_capacity(self.allocations.len() * 2);
        for (i, a) in self.allocations.iter().enumerate() {
            let i = u32::try_from(i).expect("fewer than 2^32 allocations");
            events.push((a.first, 1, i));
            // An allocation whose last step is u64::MAX never leaves.
            if let Some(after) = a.last.checked_add(1) {
                events.push((after, 0, i));
            }
        }
        events.sort_unstable();
        let mut live: BTreeMap<u64, u32> = BTreeMap::new();
        let (mut live_bytes, mut most_live) = (0u64, 0u64);
        for (_, enter, i) in events {
            let a = &self.allocations[i as usize];
            if enter == 0 {
                live.remove(&a.offset);
                live_bytes -= a.size;
                continue;
            }
            let end = a.offset + a.size; // checked by `check_allocation`
            if let Some((_, &j)) = live.range(..end).next_back() {
                let b = &self.allocations[j as usize];
                if b.offset + b.size > a.offset {
                    return Err(overlap(b, a));
                }
            }
            live.insert(a.offset, i);
            live_bytes += a.size;
            most_live = most_live.max(live_bytes);
        }
        if most_live != self.lower_bound_bytes {
            return Err(PlanError::WrongLowerBound { claimed: self.lower_bound_bytes, actual: most_live });
        }
        Ok(())
    }

    fn check_allocation(&self, a: &PlannedAllocation) -> Result<(), PlanError> {
        let bad = |what: String| Err(PlanError::BadAllocation { id: a.id, what });
        let align = self.alignment;
        if !align.is_power_of_two() {
            return Err(PlanError::InvalidAlignment { alignment: align });
        }
        if a.first > a.last {
            return bad(format!("its last step {} comes before its first {}", a.last, a.first));
        }
        if a.bytes == 0 || a.size < a.bytes {
            return bad(format!("{} bytes reserved for a request of {}", a.size, a.bytes));
        }
        if !a.offset.is_multiple_of(align) || !a.size.is_multiple_of(align) {
            return bad(format!("offset {} or size {} is not a multiple of the alignment {align}", a.offset, a.size));
        }
        match a.offset.checked_add(a.size) {
            Some(end) if end <= self.peak_bytes => Ok(()),
            _ => bad(format!("bytes {}..+{} run past the plan's peak of {}", a.offset, a.size, self.peak_bytes)),
        }
    }
}

fn overlap(a: &PlannedAllocation, b: &PlannedAllocation) -> PlanError {
    PlanError::Overlap {
        a: a.id,
        a_start: a.offset,
        a_end: a.offset + a.size,
        a_first: a.first,
        a_last: a.last,
        b: b.id,
        b_start: b.offset,
        b_end: b.offset + b.size,
        b_first: b.first,
        b_last: b.last,
    }
}
