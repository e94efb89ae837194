//! The books of stitched blocks (`pool/stitch.rs` makes and serves them): the ranges of one virtual arena whose
//! pages are mapped a second time, side by side.

use crate::engine::{BlockId, SegmentId};

/// Stitched ranges an arena holds, in use or kept; past it the least recently used kept one goes. A repeating
/// workload needs one per distinct large request that its free pieces serve.
pub(in crate::pool) const MAX_KEPT_STITCHES: usize = 64;

/// Kept ranges forgotten to make room for new ones after which no new range is made (until a full release of
/// cached memory): past it the workload does not repeat the requests its ranges serve, and every new range would
/// cost device calls to save memory only for a moment. Such a pool then maps pages, and settles (what the bound
/// trades: docs/PERFORMANCE.md, "Figures behind the code").
pub(in crate::pool) const MAX_STITCH_EVICTIONS: u64 = MAX_KEPT_STITCHES as u64;

/// The stitched blocks of one virtual arena.
pub(in crate::pool) struct Stitcher {
    /// The virtual arena whose pages they map.
    pub(in crate::pool) source: usize,
    /// The arena of class [`ArenaClass::Stitched`] holding their address ranges.
    pub(in crate::pool) arena: usize,
    /// By segment of `arena`.
    pub(in crate::pool) stitches: Vec<Option<Stitch>>,
    /// Advanced at every use: orders kept ranges by their last use.
    pub(in crate::pool) clock: u64,
}

/// One stitched address range.
pub(in crate::pool) struct Stitch {
    /// Its length: whole pages.
    pub(in crate::pool) capacity: u64,
    /// The reservation pages it maps, in its order.
    pub(in crate::pool) runs: Vec<Run>,
    /// The holder blocks in the source arena while a block of this range is live; empty while it is kept.
    pub(in crate::pool) holders: Vec<BlockId>,
    pub(in crate::pool) last_used: u64,
}

/// Whole pages of one reservation, mapped consecutively in a stitched range.
#[derive(Clone, Copy)]
pub(in crate::pool) struct Run {
    pub(in crate::pool) segment: SegmentId,
    pub(in crate::pool) offset: u64,
    pub(in crate::pool) len: u64,
    /// Where the free block covering the run was last seen (see [`crate::engine::Engine::allocate_range`]).
    pub(in crate::pool) hint: Option<u32>,
}
