//! Collecting lifetimes: from steps of tensor usage or from a trace.

use super::{round_up, PlanError, PlannedAllocation, ReusePlan, DEFAULT_ALIGNMENT};
use std::collections::HashMap;
use std::path::Path;
use umm::trace::{Op, Trace};
use umm_backends::plan::PlanItem;

/// One tensor's lifetime: it is in use at every step from `first` to `last`, both included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetime {
    /// The tensor's id, as recorded (for a trace: the allocation's ordinal, 0 for the first allocation).
    pub id: u64,
    /// Bytes asked for.
    pub bytes: u64,
    /// First step (for a trace: the index of the allocation op).
    pub first: u64,
    /// Last step, included (for a trace: the index of the free op, or the trace's op count for a block never
    /// freed).
    pub last: u64,
}

/// Learns tensor lifetimes and computes a [`ReusePlan`] from them.
///
/// Lifetimes come from [`record_usage`](Self::record_usage) calls (a tensor lives from the first step it is
/// recorded at to the last, even across steps it is not named in), or from a trace
/// ([`from_trace`](Self::from_trace), [`from_trace_file`](Self::from_trace_file)), where each allocation lives
/// from its allocation op to its free op. Sizes are rounded up to the analyzer's alignment
/// ([`DEFAULT_ALIGNMENT`] unless [`with_alignment`](Self::with_alignment) says otherwise) for every figure it
/// gives, since that is what a pool or the [`super::PlannedArena`] will hand out.
#[derive(Debug, Clone)]
pub struct LifetimeAnalyzer {
    alignment: u64,
    lifetimes: Vec<Lifetime>,
    /// Tensor id → index in `lifetimes`.
    index: HashMap<u64, usize>,
    last_step: Option<u64>,
    /// The sum of the aligned sizes, kept within `u64`: every plan's peak is at most this sum (each tensor is
    /// placed in a gap or on top of what it meets), so no figure of the planner can overflow.
    total: u64,
}

impl Default for LifetimeAnalyzer {
    fn default() -> Self {
        Self::new()
    }
}

impl LifetimeAnalyzer {
    /// An empty analyzer with [`DEFAULT_ALIGNMENT`].
    pub fn new() -> Self {
        Self { alignment: DEFAULT_ALIGNMENT, lifetimes: Vec::new(), index: HashMap::new(), last_step: None, total: 0 }
    }

    /// An empty analyzer that rounds sizes and offsets to `alignment` (a power of two; use a multiple of the
    /// pool's block alignment, [`umm_backends::MemoryPool::alignment`], for a plan a [`super::PlannedArena`]
    /// on that pool can use).
    pub fn with_alignment(alignment: u64) -> Result<Self, PlanError> {
        if !alignment.is_power_of_two() {
            return Err(PlanError::InvalidAlignment { alignment });
        }
        Ok(Self { alignment, ..Self::new() })
    }

    /// The alignment of sizes and offsets.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Records that at `step` the tensors `(id, size in bytes)` are in use. Steps may repeat but not go
    /// backwards. A tensor's lifetime runs from the first step it is recorded at to the last.
    ///
    /// Errors, leaving the analyzer as it was: a step before the latest one recorded
    /// ([`PlanError::StepBackwards`]), a tensor recorded with a size other than its first one
    /// ([`PlanError::SizeMismatch`], also within one call), a zero size ([`PlanError::ZeroSize`]), a size that
    /// overflows when aligned ([`PlanError::TooLarge`]), aligned sizes that add up past `u64::MAX`
    /// ([`PlanError::TotalTooLarge`]).
    pub fn record_usage(&mut self, step: u64, tensors: &[(u64, u64)]) -> Result<(), PlanError> {
        if let Some(previous) = self.last_step.filter(|&previous| step < previous) {
            return Err(PlanError::StepBackwards { step, previous });
        }
        // Check everything first so an error changes nothing.
        let mut new: HashMap<u64, u64> = HashMap::new();
        let mut total = self.total;
        for &(id, bytes) in tensors {
            self.check_size(id, bytes, step)?;
            let known = self.index.get(&id).map(|&i| self.lifetimes[i].bytes).or_else(|| new.get(&id).copied());
            match known {
                Some(first_bytes) if first_bytes != bytes => {
                    return Err(PlanError::SizeMismatch { id, step, first_bytes, bytes })
                }
                Some(_) => {}
                None => {
                    new.insert(id, bytes);
                    total = total
                        .checked_add(self.aligned(bytes))
                        .ok_or(PlanError::TotalTooLarge { id, alignment: self.alignment })?;
                }
            }
        }
        self.total = total;
        for &(id, bytes) in tensors {
            match self.index.get(&id) {
                Some(&i) => self.lifetimes[i].last = step,
                None => {
                    self.index.insert(id, self.lifetimes.len());
                    self.lifetimes.push(Lifetime { id, bytes, first: step, last: step });
                }
            }
        }
        self.last_step = Some(step);
        Ok(())
    }

    fn check_size(&self, id: u64, bytes: u64, step: u64) -> Result<(), PlanError> {
        if bytes == 0 {
            return Err(PlanError::ZeroSize { id, step });
        }
        round_up(bytes, self.alignment).ok_or(PlanError::TooLarge { id, bytes, alignment: self.alignment })?;
        Ok(())
    }

    /// The lifetimes of a trace, with [`DEFAULT_ALIGNMENT`]: allocation `n` (counting from 0 in trace order)
    /// gets id `n` and lives from its allocation op's index to its free op's index (the op count when it is
    /// never freed). O(ops).
    ///
    /// Errors when an allocation's size overflows when aligned ([`PlanError::TooLarge`]) or the aligned sizes add
    /// up past `u64::MAX` ([`PlanError::TotalTooLarge`]).
    pub fn from_trace(trace: &Trace) -> Result<Self, PlanError> {
        let mut analyzer = Self::new();
        analyzer.add_trace(trace)?;
        Ok(analyzer)
    }

    /// [`from_trace`](Self::from_trace) with another alignment.
    pub fn from_trace_with_alignment(trace: &Trace, alignment: u64) -> Result<Self, PlanError> {
        let mut analyzer = Self::with_alignment(alignment)?;
        analyzer.add_trace(trace)?;
        Ok(analyzer)
    }

    /// Loads a trace file (`umm-trace v1`, plain or gzip, such as one the manager recorded with
    /// [`umm::Builder::record_trace`]) and takes its lifetimes as [`from_trace`](Self::from_trace) does.
    /// Errors name the file and, for malformed content, the line.
    pub fn from_trace_file(path: impl AsRef<Path>) -> Result<Self, PlanError> {
        Self::from_trace(&Trace::load(path)?)
    }

    fn add_trace(&mut self, trace: &Trace) -> Result<(), PlanError> {
        let end = trace.ops.len() as u64;
        // Slot → index in `lifetimes` of the allocation live in it.
        let mut live: Vec<usize> = vec![usize::MAX; trace.slots as usize];
        self.lifetimes.reserve(trace.allocs as usize);
        for (step, op) in trace.ops.iter().enumerate() {
            match *op {
                Op::Alloc { slot, bytes, .. } => {
                    let id = self.lifetimes.len() as u64;
                    live[slot as usize] = self.lifetimes.len();
                    self.index.insert(id, self.lifetimes.len());
                    // The reader refuses zero sizes; the aligned size and the running total must fit.
                    let size = round_up(bytes, self.alignment).ok_or(PlanError::TooLarge {
                        id,
                        bytes,
                        alignment: self.alignment,
                    })?;
                    self.total = self
                        .total
                        .checked_add(size)
                        .ok_or(PlanError::TotalTooLarge { id, alignment: self.alignment })?;
                    self.lifetimes.push(Lifetime { id, bytes, first: step as u64, last: end });
                }
                Op::Free { slot } => self.lifetimes[live[slot as usize]].last = step as u64,
            }
        }
        self.last_step = Some(end);
        Ok(())
    }

    /// The lifetimes, in the order tensors were first recorded.
    pub fn lifetimes(&self) -> &[Lifetime] {
        &self.lifetimes
    }

    /// Number of tensors recorded.
    pub fn len(&self) -> usize {
        self.lifetimes.len()
    }

    /// Whether no tensor was recorded.
    pub fn is_empty(&self) -> bool {
        self.lifetimes.is_empty()
    }

    fn aligned(&self, bytes: u64) -> u64 {
        // Checked when recorded.
        round_up(bytes, self.alignment).unwrap_or(u64::MAX)
    }

    /// Bytes every tensor would take with no reuse at all: the sum of aligned sizes.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// The most aligned bytes live at any one step: no plan can be smaller. O(n log n).
    pub fn lower_bound_bytes(&self) -> u64 {
        umm_backends::plan::lower_bound(&self.items())
    }

    /// Bytes that reuse can save at best: [`total_bytes`](Self::total_bytes) (no reuse) minus
    /// [`lower_bound_bytes`](Self::lower_bound_bytes) (the most live at once, which any plan needs).
    pub fn reusable_bytes(&self) -> u64 {
        self.total_bytes() - self.lower_bound_bytes()
    }

    fn items(&self) -> Vec<PlanItem> {
        self.lifetimes.iter().map(|l| PlanItem { first: l.first, last: l.last, size: self.aligned(l.bytes) }).collect()
    }

    /// Assigns every tensor an offset such that tensors whose lifetimes meet never share bytes. Runs several
    /// greedy heuristics and keeps the smallest plan (see [`super::Heuristic`]); stops early at one that reaches
    /// the lower bound. About O(n log n + p log p) per heuristic, where p is the number of pairs of tensors live
    /// at the same time. When none reaches the bound, a search re-places the tensors that stand above a target
    /// together with their neighbours in time, from the heuristics' plans, and keeps what it finds if lower; its
    /// work is bounded (about half a second on a 2-core machine at most) and its random choices seeded, so
    /// the same lifetimes always get the same plan. The solver is [`umm_backends::plan::solve`]; this aligns the
    /// sizes for it and names its offsets.
    pub fn compute_reuse_plan(&self) -> ReusePlan {
        let items = self.items();
        let solution = umm_backends::plan::solve(&items);
        let allocations = self
            .lifetimes
            .iter()
            .zip(&items)
            .zip(&solution.offsets)
            .map(|((l, item), &offset)| PlannedAllocation {
                id: l.id,
                bytes: l.bytes,
                size: item.size,
                first: l.first,
                last: l.last,
                offset,
            })
            .collect();
        ReusePlan {
            alignment: self.alignment,
            allocations,
            peak_bytes: solution.peak,
            lower_bound_bytes: solution.lower_bound,
            heuristic: solution.heuristic,
        }
    }
}
