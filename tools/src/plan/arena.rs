//! A planned arena: one pool block of a plan's size, carved into the plan's ranges as a repeating step asks for
//! them, with the pool as fallback for whatever the plan did not foresee.

use super::{round_up, PlanError, ReusePlan};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use thiserror::Error;
use umm_backends::{BlockInfo, MemoryPool, OwnedBlock, StreamId};

/// What can go wrong building or using a [`PlannedArena`].
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ArenaError {
    /// The plan does not pass [`ReusePlan::verify`].
    #[error("the plan is invalid: {0}")]
    InvalidPlan(#[from] PlanError),
    /// The plan's offsets would not honour the pool's block alignment.
    #[error(
        "the plan is aligned to {plan} bytes, which is not a multiple of the pool's block alignment of {pool}: \
         plan with LifetimeAnalyzer::with_alignment({pool}) or a multiple of it"
    )]
    Alignment {
        /// The plan's alignment.
        plan: u64,
        /// The pool's.
        pool: u64,
    },
    /// A block of another arena.
    #[error("the block belongs to another arena")]
    ForeignBlock,
    /// A read or write that leaves the block.
    #[error("{len} bytes at offset {offset} run past the end of a block of {block} bytes")]
    OutOfBounds {
        /// Offset in the block.
        offset: u64,
        /// Bytes to move.
        len: u64,
        /// The block's length.
        block: u64,
    },
    /// The pool refused (out of memory for the arena's block or a fallback, or an I/O error).
    #[error(transparent)]
    Pool(#[from] umm_backends::Error),
    /// The manager could not place the arena ([`PlannedArena::on_manager`]): no such device, an impossible
    /// placement.
    #[error(transparent)]
    Placement(#[from] Box<umm::Error>),
}

/// How an arena's allocations were served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ArenaStats {
    /// Bytes of the arena's block (the plan's peak).
    pub segment_bytes: u64,
    /// Steps begun ([`PlannedArena::begin_step`]).
    pub steps: u64,
    /// Allocations served from the plan.
    pub planned_hits: u64,
    /// Allocations served by the pool because the step deviated from the plan.
    pub fallbacks: u64,
    /// Bytes asked for by those.
    pub fallback_bytes: u64,
    /// Planned ranges handed out and not yet freed.
    pub live_planned: u64,
}

/// An allocation from a [`PlannedArena`]: a range of the arena's block, or a pool block when the step deviated.
/// Freed by [`PlannedArena::free`] (it is not `Clone`, so it cannot be used after that). A fallback block
/// dropped without being freed goes back to its pool; a planned range dropped that way stays taken in the arena
/// (later allocations that would overlap it fall back), so it is never handed out twice.
#[derive(Debug)]
pub struct ArenaBlock {
    arena: u64,
    len: u64,
    place: Place,
}

#[derive(Debug)]
enum Place {
    /// `offset` into the arena's block; `index` of the plan's allocation.
    Planned {
        offset: u64,
        index: usize,
    },
    Fallback(OwnedBlock),
}

impl ArenaBlock {
    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The offset in the arena's block when the block was served from the plan; `None` for a fallback.
    pub fn planned_offset(&self) -> Option<u64> {
        match self.place {
            Place::Planned { offset, .. } => Some(offset),
            Place::Fallback(_) => None,
        }
    }

    /// Which allocation of the plan (index in [`ReusePlan::allocations`]) it was served as, if any.
    pub fn planned_index(&self) -> Option<usize> {
        match self.place {
            Place::Planned { index, .. } => Some(index),
            Place::Fallback(_) => None,
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), ArenaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ArenaError::OutOfBounds { offset, len, block: self.len }),
        }
    }
}

/// The byte offset of element `first` of `T` in `block`; [`ArenaError::OutOfBounds`] past its end (or for a
/// zero-sized `T`, which has no elements to address).
fn element_offset<T>(first: usize, block: &ArenaBlock) -> Result<u64, ArenaError> {
    let size = std::mem::size_of::<T>() as u64;
    match (first as u64).checked_mul(size) {
        Some(offset) if size > 0 && offset <= block.len => Ok(offset),
        _ => Err(ArenaError::OutOfBounds { offset: (first as u64).saturating_mul(size), len: size, block: block.len }),
    }
}

/// Serves a repeating step (a training or inference loop) from one block of a [`ReusePlan`]'s peak size.
///
/// The plan's allocations form a schedule in their recorded order. Each step starts with
/// [`begin_step`](Self::begin_step); the step's `n`-th allocation is served from the plan's `n`-th range when it
/// matches: same size once aligned, and the range is free now (no range handed out earlier is still live over
/// it). Otherwise the step has deviated (a different size, order or lifetime than recorded) and the allocation
/// comes from the pool instead, counted in [`ArenaStats::fallbacks`]; the schedule still moves on one place, so
/// a step whose sizes vary (inference with varying lengths) keeps the ranges of the allocations that do match.
///
/// Because every range is checked free before it is handed out, a deviating step never gets overlapping memory,
/// whatever it does. The plan treats the trace as one timeline: on a device with several streams, ranges are
/// reused across them as the trace's order allows, which is the caller's to synchronise (as with any arena).
///
/// Ranges are usable for I/O through [`write`](Self::write), [`read`](Self::read) and [`fill`](Self::fill),
/// which go through the pool's block I/O at the range's offset.
pub struct PlannedArena {
    id: u64,
    /// `None` for an empty plan (the pool refuses zero-byte blocks).
    segment: Option<OwnedBlock>,
    pool: Arc<dyn MemoryPool>,
    stream: StreamId,
    alignment: u64,
    /// (aligned size, offset) of the plan's allocations, in order.
    schedule: Vec<(u64, u64)>,
    cursor: usize,
    /// Planned ranges handed out and not freed: offset → end. They never overlap one another.
    live: BTreeMap<u64, u64>,
    stats: ArenaStats,
}

/// Numbers arenas so a block is refused by every arena but its own.
static NEXT_ARENA: AtomicU64 = AtomicU64::new(0);

impl PlannedArena {
    /// Takes one block of `plan.peak_bytes` from `pool` on `stream`. The plan is verified first, and its
    /// alignment must be a multiple of the pool's block alignment (so every range is as aligned as a pool block
    /// would be).
    pub fn new(plan: &ReusePlan, pool: Arc<dyn MemoryPool>, stream: StreamId) -> Result<Self, ArenaError> {
        plan.verify()?;
        if !plan.alignment.is_multiple_of(pool.alignment()) {
            return Err(ArenaError::Alignment { plan: plan.alignment, pool: pool.alignment() });
        }
        let segment = match plan.peak_bytes {
            0 => None,
            peak => Some(OwnedBlock::allocate(Arc::clone(&pool), peak, stream, false)?),
        };
        Ok(Self {
            id: NEXT_ARENA.fetch_add(1, Ordering::Relaxed),
            segment,
            pool,
            stream,
            alignment: plan.alignment,
            schedule: plan.allocations.iter().map(|a| (a.size, a.offset)).collect(),
            cursor: 0,
            live: BTreeMap::new(),
            stats: ArenaStats { segment_bytes: plan.peak_bytes, ..ArenaStats::default() },
        })
    }

    /// Starts a step: the next allocation is matched against the plan's first. Ranges still live from the last
    /// step stay taken.
    pub fn begin_step(&mut self) {
        self.cursor = 0;
        self.stats.steps += 1;
    }

    /// Allocates `bytes`: the plan's next range when the request matches it and the range is free, else a pool
    /// block (a fallback). Errors only when the pool refuses a fallback (a zero size, out of memory).
    pub fn allocate(&mut self, bytes: u64) -> Result<ArenaBlock, ArenaError> {
        if let Some(&(size, offset)) = self.schedule.get(self.cursor) {
            let index = self.cursor;
            self.cursor += 1;
            if round_up(bytes, self.alignment) == Some(size) && self.is_free(offset, size) {
                self.live.insert(offset, offset + size);
                self.stats.planned_hits += 1;
                self.stats.live_planned += 1;
                return Ok(ArenaBlock { arena: self.id, len: bytes, place: Place::Planned { offset, index } });
            }
        }
        let block = OwnedBlock::allocate(Arc::clone(&self.pool), bytes, self.stream, false)?;
        self.stats.fallbacks += 1;
        self.stats.fallback_bytes += bytes;
        Ok(ArenaBlock { arena: self.id, len: bytes, place: Place::Fallback(block) })
    }

    /// Whether no live range overlaps `[offset, offset + size)`: live ranges are disjoint, so only the one
    /// starting closest below the end can.
    fn is_free(&self, offset: u64, size: u64) -> bool {
        self.live.range(..offset + size).next_back().is_none_or(|(_, &end)| end <= offset)
    }

    /// Frees a block: its range is free for later allocations, or its pool block goes back to the pool.
    pub fn free(&mut self, block: ArenaBlock) -> Result<(), ArenaError> {
        self.own(&block)?;
        match block.place {
            Place::Planned { offset, .. } => {
                self.live.remove(&offset);
                self.stats.live_planned -= 1;
            }
            Place::Fallback(owned) => drop(owned),
        }
        Ok(())
    }

    fn own(&self, block: &ArenaBlock) -> Result<(), ArenaError> {
        if block.arena == self.id {
            Ok(())
        } else {
            Err(ArenaError::ForeignBlock)
        }
    }

    /// Copies `src` into `block` at `offset`.
    pub fn write(&mut self, block: &mut ArenaBlock, offset: u64, src: &[u8]) -> Result<(), ArenaError> {
        self.own(block)?;
        block.check_range(offset, src.len() as u64)?;
        match &mut block.place {
            Place::Planned { offset: base, .. } => self.segment_mut().write(*base + offset, src)?,
            Place::Fallback(owned) => owned.write(offset, src)?,
        }
        Ok(())
    }

    /// Copies `block`'s bytes at `offset` into `dst`.
    pub fn read(&self, block: &ArenaBlock, offset: u64, dst: &mut [u8]) -> Result<(), ArenaError> {
        self.own(block)?;
        block.check_range(offset, dst.len() as u64)?;
        match &block.place {
            Place::Planned { offset: base, .. } => self.segment().read(*base + offset, dst)?,
            Place::Fallback(owned) => owned.read(offset, dst)?,
        }
        Ok(())
    }

    /// Writes `values` into `block` from element `first` on, as the `T`s a typed buffer holds (a `T` is
    /// `size_of::<T>()` bytes from the block's start; no alignment beyond the block's own is needed).
    pub fn write_elements<T: bytemuck::Pod>(
        &mut self,
        block: &mut ArenaBlock,
        first: usize,
        values: &[T],
    ) -> Result<(), ArenaError> {
        let offset = element_offset::<T>(first, block)?;
        self.write(block, offset, bytemuck::cast_slice(values))
    }

    /// The `T`s of `block` from element `first` on, as many as fit whole.
    pub fn read_elements<T: bytemuck::Pod>(&self, block: &ArenaBlock, first: usize) -> Result<Vec<T>, ArenaError> {
        let offset = element_offset::<T>(first, block)?;
        let mut values = vec![T::zeroed(); ((block.len - offset) / std::mem::size_of::<T>().max(1) as u64) as usize];
        self.read(block, offset, bytemuck::cast_slice_mut(&mut values))?;
        Ok(values)
    }

    /// Sets `len` bytes of `block` at `offset` to `value`.
    pub fn fill(&mut self, block: &mut ArenaBlock, offset: u64, len: u64, value: u8) -> Result<(), ArenaError> {
        self.own(block)?;
        block.check_range(offset, len)?;
        match &mut block.place {
            Place::Planned { offset: base, .. } => self.segment_mut().fill(*base + offset, len, value)?,
            Place::Fallback(owned) => owned.fill(offset, len, value)?,
        }
        Ok(())
    }

    // A planned block exists only where the plan has a range, so the segment exists.
    fn segment(&self) -> &OwnedBlock {
        self.segment.as_ref().expect("a planned block implies a non-empty plan")
    }

    fn segment_mut(&mut self) -> &mut OwnedBlock {
        self.segment.as_mut().expect("a planned block implies a non-empty plan")
    }

    /// Where the arena's block lies in its pool; `None` for an empty plan.
    pub fn segment_info(&self) -> Option<BlockInfo> {
        self.segment.as_ref().map(OwnedBlock::info)
    }

    /// How allocations were served so far.
    pub fn stats(&self) -> ArenaStats {
        self.stats
    }
}

impl std::fmt::Debug for PlannedArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannedArena")
            .field("pool", &self.pool.name())
            .field("schedule", &self.schedule.len())
            .field("cursor", &self.cursor)
            .field("stats", &self.stats)
            .finish()
    }
}

impl PlannedArena {
    /// A [`PlannedArena`] for `plan` on the pool a buffer of the plan's peak size with `options` would get from
    /// `manager` (placement, access pattern, selector and stream as for
    /// [`allocate_universal_with`](umm::UniversalMemoryManager::allocate_universal_with)), so that a step's buffers
    /// are planned where the manager would put them, without reaching for a pool by hand. The plan must be aligned
    /// to a multiple of that pool's block alignment ([`ArenaError::Alignment`] says which otherwise).
    ///
    /// # Errors
    /// [`ArenaError::Placement`] for the decision's errors (no such device, an impossible placement), and the
    /// other variants for an invalid plan, a misaligned one, or a pool that cannot hold its peak.
    pub fn on_manager(
        manager: &umm::UniversalMemoryManager,
        plan: &ReusePlan,
        options: &umm::AllocOptions,
    ) -> Result<Self, ArenaError> {
        let pool = manager.pool_for(plan.peak_bytes, options).map_err(Box::new)?;
        PlannedArena::new(plan, pool, options.stream_id())
    }
}
