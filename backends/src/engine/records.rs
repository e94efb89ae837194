//! What the engine hands out and reports: segment and block ids, an allocation, what a free did, the blocks of a
//! segment, and the counts it keeps current.

/// Identifies a segment inside one engine. Ids of removed segments are reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub u32);

/// Identifies a live block. The generation makes a stale id (a block freed and its slot reused) detectable.
///
/// Slot index and generation are packed in one `u64` (index in the low half) so that an id is always written and
/// read as one 8-byte word. As two `u32` fields, an id returned through memory (an `Allocation` from a call that
/// is not inlined) would be stored as two 4-byte halves and read back as one 8-byte load, which the CPU cannot
/// forward from the store buffer: a stall on every allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockId(u64);

impl BlockId {
    #[inline(always)]
    pub(super) fn new(index: u32, generation: u32) -> Self {
        Self(u64::from(generation) << 32 | u64::from(index))
    }

    /// The slot index, dense from zero: usable to key side tables. O(1).
    #[inline(always)]
    pub fn index(self) -> u32 {
        self.0 as u32
    }

    #[inline(always)]
    pub(super) fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// A block handed out by [`Engine::allocate`](super::Engine::allocate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// The block, for [`Engine::free`](super::Engine::free).
    pub block: BlockId,
    /// The segment it lies in.
    pub segment: SegmentId,
    /// Offset of the block's first byte inside the segment (a multiple of the engine's alignment).
    pub offset: u64,
    /// Size of the block in bytes (the request rounded up to the alignment).
    pub size: u64,
    /// Whether the block came out of a segment that was entirely free before.
    pub segment_was_empty: bool,
}

/// What [`Engine::free`](super::Engine::free) did.
///
/// It carries no offset: copying a block's offset and size, adjacent in the node, the compiler would load both
/// with one 16-byte load, and when the block was carved just before (an allocation freed at once) that load spans
/// the two 8-byte stores of the carve, which the CPU cannot forward from its store buffer: a stall on every free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// The segment the block was in.
    pub segment: SegmentId,
    /// Size of the freed block.
    pub size: u64,
    /// Whether the segment is now entirely free (one block spanning it).
    pub segment_now_empty: bool,
}

/// A block inside a segment, as reported by [`Engine::blocks_in`](super::Engine::blocks_in): where it lies and whether it is free (what a
/// snapshot draws). Not [`crate::BlockInfo`], which describes a live block a pool handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentBlock {
    /// Offset inside the segment.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// Whether the block is free.
    pub free: bool,
    /// Whether the range is withheld (no memory behind it; neither free nor live).
    pub withheld: bool,
    /// The block id when live or parked (parked blocks are held by a cache: lent out by a thread cache, or
    /// free in one).
    pub block: Option<BlockId>,
}

/// Byte and block counts the engine keeps current in O(1) per operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// Sum of segment sizes.
    pub reserved_bytes: u64,
    /// Sum of live block sizes.
    pub allocated_bytes: u64,
    /// Sum of the sizes of segments that are entirely free.
    pub empty_segment_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Free blocks (after coalescing).
    pub free_blocks: u64,
    /// Bytes in withheld ranges (counted in `reserved_bytes`, not allocatable).
    pub withheld_bytes: u64,
    /// Segments.
    pub segments: u64,
}

impl EngineStats {
    /// Free bytes inside segments that also hold live blocks: memory lost to splitting (PyTorch's
    /// `inactive_split_bytes`). Withheld ranges of such segments are counted too: the engine's `reserved_bytes`
    /// includes them, though no memory is behind them; a pool reports the figure for mapped memory only. O(1).
    pub fn inactive_split_bytes(&self) -> u64 {
        self.reserved_bytes - self.allocated_bytes - self.empty_segment_bytes
    }
}
