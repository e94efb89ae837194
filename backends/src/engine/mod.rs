//! The segment-block engine: places blocks inside segments by offset and size only. It knows nothing of devices
//! or pointers; a [`crate::Pool`] maps its segments to backend memory.
//!
//! Free blocks are indexed by size class in a TLSF-style two-level bitmap ([`bins`]), so finding a fit is O(1) in
//! all but one case: the engine looks for the best fit among a bounded number of blocks in the request's own
//! class, else takes the head of the next non-empty class (every block there fits, within 1/32 of each other).
//! Only when no larger class has a free block does it walk the rest of the request's own class (O(blocks in that
//! class)), so that a miss is a true miss and the pool does not grow while a fitting block is free. Allocation
//! splits the chosen block; freeing coalesces it with its free address neighbours, so a segment whose blocks are
//! all free is again one block and can be released whole.
//!
//! An engine made with [`Engine::whole_blocks`] never splits: every block is a whole segment, and a free segment
//! serves a request only when it is at most [`WHOLE_FIT_SLACK`] larger (for backends that cannot share one
//! segment between blocks, such as wgpu, whose buffers each have one usage state per pass).
//!
//! Parts of a segment can be *withheld* ([`withheld`]): address ranges with no memory behind them (a virtual
//! reservation's unmapped pages). They sit in the segment between blocks but out of the free index, in a list of
//! their own, so every block the free index hands out has memory behind it and allocation never has to ask.

#![deny(unsafe_code)]

pub(crate) mod bins;
mod ranges;
mod slab;
mod withheld;

pub use ranges::GranuleRun;
pub use withheld::Restore;

use bins::{bin_of, BinMaps, BIN_COUNT};
use slab::{Node, NodeState, NIL, RETIRED};

/// How many blocks of the request's own size class are examined for the best fit before settling for the best
/// seen (or moving to the next class). Bounds allocation to O(1) even when many blocks of one class are free.
const FIT_SCAN_LIMIT: usize = 8;

/// In an engine of whole blocks, the most a free segment may exceed the request it serves, as a fraction
/// (`1 / 2^WHOLE_FIT_SLACK_SHIFT` = 1/4): a larger one would hand out memory nobody asked for, and a new segment
/// of the request's size is made instead. A smaller slack makes requests whose shapes vary miss each other's
/// segments and make new ones (the figures behind 1/4: docs/PERFORMANCE.md, "Figures behind the code").
pub const WHOLE_FIT_SLACK_SHIFT: u32 = 2;

/// [`WHOLE_FIT_SLACK_SHIFT`] as a fraction, for documentation and reports.
pub const WHOLE_FIT_SLACK: f64 = 1.0 / (1u64 << WHOLE_FIT_SLACK_SHIFT) as f64;

// Nodes remember their size class in a u16.
const _: () = assert!(BIN_COUNT <= u16::MAX as usize + 1);

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
    fn new(index: u32, generation: u32) -> Self {
        Self(u64::from(generation) << 32 | u64::from(index))
    }

    /// The slot index, dense from zero: usable to key side tables. O(1).
    #[inline(always)]
    pub fn index(self) -> u32 {
        self.0 as u32
    }

    #[inline(always)]
    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// A block handed out by [`Engine::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// The block, for [`Engine::free`].
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

/// What [`Engine::free`] did.
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

/// A block inside a segment, as reported by [`Engine::blocks_in`]: where it lies and whether it is free (what a
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

#[derive(Debug, Clone, Copy)]
struct Segment {
    size: u64,
    first_block: u32,
    live_blocks: u32,
}

/// The engine. Not thread-safe by itself: a pool wraps it in a lock.
#[derive(Debug, Clone)]
pub struct Engine {
    alignment: u64,
    /// Blocks are whole segments: never split (see [`Engine::whole_blocks`]).
    whole: bool,
    nodes: slab::Slab,
    segments: Vec<Option<Segment>>,
    vacant_segments: Vec<u32>,
    free: SizeIndex,
    /// Every withheld range, in no order: the only index they have, since `find_withheld` weighs them all (a
    /// counted loop over independent loads). Their place here is in `Node::flat`.
    withheld_flat: Vec<u32>,
    stats: EngineStats,
}

/// Free blocks by size class: a list head per class and the classes' occupancy bitmaps.
#[derive(Debug, Clone)]
struct SizeIndex {
    heads: Box<[u32; BIN_COUNT]>,
    bins: BinMaps,
}

impl SizeIndex {
    fn new() -> Self {
        Self { heads: Box::new([NIL; BIN_COUNT]), bins: BinMaps::new() }
    }
}

impl Engine {
    /// An engine whose block offsets and sizes are multiples of `alignment` (a power of two). O(1).
    ///
    /// Returns `None` when `alignment` is zero or not a power of two.
    pub fn new(alignment: u64) -> Option<Self> {
        if !alignment.is_power_of_two() {
            return None;
        }
        Some(Self {
            alignment,
            whole: false,
            nodes: slab::Slab::default(),
            segments: Vec::new(),
            vacant_segments: Vec::new(),
            free: SizeIndex::new(),
            withheld_flat: Vec::new(),
            stats: EngineStats::default(),
        })
    }

    /// An engine whose every block is a whole segment: allocation never splits a free segment, and takes one
    /// only when it exceeds the request (rounded up to `alignment`) by at most [`WHOLE_FIT_SLACK`]; otherwise
    /// it misses, and the caller adds a segment of the request's size. The handed-out block's size is the
    /// segment's. Withheld ranges are not for such an engine (a withheld part would be split off a segment).
    /// O(1).
    ///
    /// Returns `None` when `alignment` is zero or not a power of two.
    pub fn whole_blocks(alignment: u64) -> Option<Self> {
        Some(Self { whole: true, ..Self::new(alignment)? })
    }

    /// Whether every block is a whole segment ([`Engine::whole_blocks`]). O(1).
    pub fn is_whole_blocks(&self) -> bool {
        self.whole
    }

    /// The alignment every block honours. O(1).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The size of a block for a request of `size` bytes: rounded up to the alignment; `None` for zero and on
    /// overflow, both caught by one compare (zero minus one wraps to the largest value; an overflowed sum
    /// rounds below the request). O(1).
    #[inline(always)]
    fn block_size(&self, size: u64) -> Option<u64> {
        let mask = self.alignment - 1;
        let rounded = size.wrapping_add(mask) & !mask;
        (size.wrapping_sub(1) < rounded).then_some(rounded)
    }

    /// Current counts. O(1).
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Adds a free segment of `size` bytes (rounded up to the alignment). O(1) amortised.
    ///
    /// Returns `None` for a zero size or one that overflows when rounded.
    pub fn add_segment(&mut self, size: u64) -> Option<SegmentId> {
        let size = self.block_size(size)?;
        let id = match self.vacant_segments.pop() {
            Some(id) => id,
            None => {
                self.segments.push(None);
                (self.segments.len() - 1) as u32
            }
        };
        let node = self.nodes.insert(Node::free(id, 0, size));
        self.segments[id as usize] = Some(Segment { size, first_block: node, live_blocks: 0 });
        self.push_free(node);
        self.stats.reserved_bytes += size;
        self.stats.empty_segment_bytes += size;
        self.stats.segments += 1;
        Some(SegmentId(id))
    }

    /// Removes a segment with no live block and returns its size. O(1) for a segment that is one free block;
    /// O(ranges) when parts of it are withheld.
    ///
    /// Returns `None` if the segment does not exist or still holds live blocks.
    pub fn remove_segment(&mut self, id: SegmentId) -> Option<u64> {
        let seg = self.segment(id)?;
        if seg.live_blocks != 0 {
            return None;
        }
        let mut node = seg.first_block;
        while node != NIL {
            let next = self.nodes[node].next_phys;
            if self.nodes[node].state == NodeState::Withheld {
                self.stats.withheld_bytes -= self.nodes[node].size;
            }
            self.unlink(node);
            self.nodes.remove(node);
            node = next;
        }
        self.segments[id.0 as usize] = None;
        self.vacant_segments.push(id.0);
        self.stats.reserved_bytes -= seg.size;
        self.stats.empty_segment_bytes -= seg.size;
        self.stats.segments -= 1;
        Some(seg.size)
    }

    /// Size of a segment, if it exists. O(1).
    pub fn segment_size(&self, id: SegmentId) -> Option<u64> {
        self.segment(id).map(|s| s.size)
    }

    /// Whether the segment exists and holds no live block. O(1).
    pub fn is_segment_empty(&self, id: SegmentId) -> bool {
        self.segment(id).is_some_and(|s| s.live_blocks == 0)
    }

    /// Ids of all segments. O(segments).
    pub fn segment_ids(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.segments.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| SegmentId(i as u32))
    }

    /// Ids of the entirely free segments. O(segments).
    pub fn empty_segments(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some_and(|s| s.live_blocks == 0))
            .map(|(i, _)| SegmentId(i as u32))
    }

    /// The blocks of a segment in address order. O(blocks in the segment).
    pub fn blocks_in(&self, id: SegmentId) -> impl Iterator<Item = SegmentBlock> + '_ {
        let mut next = self.segment(id).map_or(NIL, |s| s.first_block);
        std::iter::from_fn(move || {
            if next == NIL {
                return None;
            }
            let node = &self.nodes[next];
            let info = SegmentBlock {
                offset: node.offset,
                size: node.size,
                free: node.state == NodeState::Free,
                withheld: node.state == NodeState::Withheld,
                block: matches!(node.state, NodeState::Live | NodeState::Parked)
                    .then_some(BlockId::new(next, node.generation)),
            };
            next = node.next_phys;
            Some(info)
        })
    }

    /// The live block `id`, if it is live. O(1).
    #[inline]
    pub fn block(&self, id: BlockId) -> Option<Allocation> {
        let node = self.nodes.get(id.index())?;
        (node.state == NodeState::Live && node.generation == id.generation()).then_some(Allocation {
            block: id,
            segment: SegmentId(node.segment),
            offset: node.offset,
            size: node.size,
            segment_was_empty: false,
        })
    }

    /// Allocates a block of at least `size` bytes (rounded up to the alignment) from the free blocks: best fit
    /// among a bounded scan of the request's size class, else the first block of the next non-empty class; the
    /// chosen block is split and the remainder stays free. O(1), except when no larger class has a free block:
    /// then the rest of the request's class is walked (O(free blocks in that class)) before reporting a miss.
    ///
    /// Returns `None` when `size` is zero or no free block fits (the caller adds a segment and retries).
    #[inline]
    pub fn allocate(&mut self, size: u64) -> Option<Allocation> {
        let size = self.block_size(size)?;
        let node = self.find_fit(size)?;
        if self.whole {
            return self.take_whole(node, size);
        }
        Some(self.take(node, size))
    }

    /// In an engine of whole blocks, `found` (what `find_fit` chose for `size`) unsplit if it exceeds `size` by
    /// at most [`WHOLE_FIT_SLACK`]. When it does not, it was the head of a higher class, and a block of the
    /// request's own class past the bounded scan may still fit (blocks of one class lie within 1/32 of each
    /// other, so any that holds `size` is within the slack). So `None` means no free segment within 1/16 above
    /// `size`: the head of the first non-empty higher class is less than 1/32 above any block of its class.
    /// Kept out of line and cold: engines that split never come here.
    #[cold]
    #[inline(never)]
    fn take_whole(&mut self, found: u32, size: u64) -> Option<Allocation> {
        let fits = |engine: &Self, node: u32| engine.nodes[node].size - size <= size >> WHOLE_FIT_SLACK_SHIFT;
        let node = if fits(self, found) {
            found
        } else {
            let head = self.free.heads[bin_of(size)];
            let node = if head == NIL { None } else { self.first_fit_in_class(head, size) }?;
            fits(self, node).then_some(node)?
        };
        let whole = self.nodes[node].size;
        Some(self.take(node, whole))
    }

    /// In an engine of whole blocks, an empty segment of at least `want` bytes, as tight as the free index finds
    /// (the best fit, or one within 1/32 of it), and its size: the one segment whose release covers `want` with
    /// the least memory given back beyond it. `None` when none is that large, for zero, and in an engine that
    /// splits (its free blocks are not segments). O(1) but for the walk [`Engine::allocate`] makes on a miss.
    pub fn empty_segment_covering(&self, want: u64) -> Option<(SegmentId, u64)> {
        if !self.whole {
            return None;
        }
        let node = &self.nodes[self.find_fit(self.block_size(want)?)?];
        Some((SegmentId(node.segment), node.size))
    }

    /// Allocates `size` bytes from the start of an entirely free segment, bypassing the size-class search
    /// (used right after [`Engine::add_segment`]); in an engine of whole blocks, the whole segment, however
    /// much larger than `size` it is. O(1).
    pub fn allocate_in(&mut self, segment: SegmentId, size: u64) -> Option<Allocation> {
        let size = self.block_size(size)?;
        let seg = self.segment(segment)?;
        let first = &self.nodes[seg.first_block];
        if seg.live_blocks != 0 || first.state != NodeState::Free || first.size < size {
            return None;
        }
        let size = if self.whole { first.size } else { size };
        Some(self.take(seg.first_block, size))
    }

    /// Allocates exactly `[offset, offset + size)` (`size` rounded up to the alignment) of `segment`, where a plan
    /// placed it: `after` names the live block that the caller knows ends closest below `offset` (`None`: no
    /// live block lies below it in the segment), and the free block right after that one must cover the range.
    /// The free block is split around the range; what lies before and after it stays free. O(1): the caller's
    /// knowledge of its neighbour replaces a search by address, which the engine does not index.
    ///
    /// Returns `None` (and changes nothing) when the range is not free as described: `after` not live or in
    /// another segment, the block after it live or too short, an offset off the alignment, a zero or
    /// overflowing size, or a segment that does not exist. A `None` is never unsafe: the caller allocates
    /// elsewhere.
    pub fn allocate_at(
        &mut self,
        segment: SegmentId,
        after: Option<BlockId>,
        offset: u64,
        size: u64,
    ) -> Option<Allocation> {
        let (size, end) = self.named_range(offset, size)?;
        let candidate = match after {
            Some(id) => {
                let node = self.nodes.get(id.index())?;
                if node.state != NodeState::Live || node.generation != id.generation() || node.segment != segment.0 {
                    return None;
                }
                node.next_phys
            }
            None => self.segment(segment)?.first_block,
        };
        let node = self.nodes.get(candidate)?;
        let start = node.offset;
        if node.state != NodeState::Free || start > offset || start + node.size < end {
            return None;
        }
        Some(self.take_at(candidate, offset, size))
    }

    /// Parks a live block: it keeps its range but stops being live, so a later free or park of its old id is
    /// refused. Returns the id to [`Engine::unpark`] or [`Engine::free`] it with. O(1).
    #[inline]
    pub fn park(&mut self, id: BlockId) -> Option<BlockId> {
        let node = self.nodes.get(id.index())?;
        if node.state != NodeState::Live || node.generation != id.generation() {
            return None;
        }
        // Live ids are below RETIRED, so this does not wrap.
        let generation = node.generation + 1;
        let node = &mut self.nodes[id.index()];
        node.state = NodeState::Parked;
        node.generation = generation;
        let mut index = id.index();
        if generation == RETIRED {
            index = self.relocate(index);
        }
        Some(BlockId::new(index, self.nodes[index].generation))
    }

    /// Makes a parked block live again (same id). O(1).
    #[inline]
    pub fn unpark(&mut self, id: BlockId) -> Option<BlockId> {
        let node = self.nodes.get(id.index())?;
        if node.state != NodeState::Parked || node.generation != id.generation() {
            return None;
        }
        self.nodes[id.index()].state = NodeState::Live;
        Some(id)
    }

    /// Frees a live or parked block and coalesces it with free address neighbours. O(1).
    ///
    /// Returns `None` (and changes nothing) for a block that is neither: never handed out, already freed, or
    /// a stale id whose slot now holds another block.
    // Always inlined: as a call, its Freed comes back through memory and the call's register saves cost more
    // than the rest of a same-size free.
    #[inline(always)]
    pub fn free(&mut self, id: BlockId) -> Option<Freed> {
        let node = self.nodes.get(id.index())?;
        if !matches!(node.state, NodeState::Live | NodeState::Parked) || node.generation != id.generation() {
            return None;
        }
        let (segment, size) = (node.segment, node.size);
        // The block's next neighbour stays the merged block's next neighbour when the previous one absorbs it.
        let (prev, next) = (node.prev_phys, node.next_phys);
        let mut merged = id.index();
        let node = &mut self.nodes.as_mut_slice()[merged as usize];
        node.state = NodeState::Free;
        // Live and parked ids are below RETIRED, so this does not wrap. A node that reaches RETIRED and survives
        // the coalescing moves to another slot below (one absorbed by its neighbour retires its slot).
        node.generation += 1;

        if prev != NIL && self.nodes[prev].state == NodeState::Free {
            self.unlink_free(prev);
            self.absorb_next(prev);
            merged = prev;
        }
        if next != NIL && self.nodes[next].state == NodeState::Free {
            self.unlink_free(next);
            self.absorb_next(merged);
        }
        if self.nodes[merged].generation == RETIRED {
            merged = self.relocate(merged);
        }
        self.push_free(merged);

        let seg = self.segments[segment as usize].as_mut().expect("live block in a missing segment");
        seg.live_blocks -= 1;
        let now_empty = seg.live_blocks == 0;
        if now_empty {
            self.stats.empty_segment_bytes += seg.size;
        }
        self.stats.allocated_bytes -= size;
        self.stats.live_blocks -= 1;
        Some(Freed { segment: SegmentId(segment), size, segment_now_empty: now_empty })
    }

    /// Checks that every free block sits in the list of its own size class, with consistent links, that the class
    /// bitmaps and the free-block count agree, and that the flat list holds every withheld range once, each
    /// knowing its place (tests only). O(nodes).
    #[cfg(test)]
    pub(crate) fn check_index(&self) {
        let list = &self.free;
        let mut count = 0;
        for bin in 0..BIN_COUNT {
            let mut cursor = list.heads[bin];
            assert_eq!(cursor != NIL, list.bins.first_at_or_after(bin) == Some(bin), "bitmap of class {bin}");
            let mut prev = NIL;
            while cursor != NIL {
                let node = &self.nodes[cursor];
                assert_eq!(node.state, NodeState::Free, "node {cursor} in the free index");
                assert_eq!(bin_of(node.size), bin, "node {cursor} of {} bytes in class {bin}", node.size);
                assert_eq!(usize::from(node.bin), bin, "node {cursor} remembers its class");
                assert_eq!(node.prev_free, prev, "back link of node {cursor}");
                (prev, cursor) = (cursor, node.next_free);
                count += 1;
            }
        }
        assert_eq!(count, self.stats.free_blocks, "free blocks in the index");
        for (place, &index) in self.withheld_flat.iter().enumerate() {
            assert_eq!(self.nodes[index].state, NodeState::Withheld, "node {index} in the flat list");
            assert_eq!(self.nodes[index].flat as usize, place, "node {index} remembers its place");
        }
        let withheld = (0..self.nodes.as_slice().len() as u32)
            .filter(|&i| self.nodes.get(i).is_some_and(|n| n.state == NodeState::Withheld))
            .count();
        assert_eq!(withheld, self.withheld_flat.len(), "every withheld range in the flat list, once");
    }

    #[inline]
    fn segment(&self, id: SegmentId) -> Option<Segment> {
        self.segments.get(id.0 as usize).copied().flatten()
    }

    /// Finds a free block of at least `size` bytes. O(1) (a bounded scan and a bitmap search) unless no larger
    /// class has a free block, when the request's class is walked to the end.
    ///
    /// Only the checks of the common cases are inline (the own class empty, or its head an exact fit); the scans
    /// are calls, so that `allocate` stays small enough to be inlined into its callers' loops.
    #[inline]
    fn find_fit(&self, size: u64) -> Option<u32> {
        let bin = bin_of(size);
        let head = self.free.heads[bin];
        // The request's own class holds blocks both smaller and larger than `size`.
        if head != NIL {
            if self.nodes[head].size == size {
                return Some(head);
            }
            if let Some(node) = self.best_in_class(head, size) {
                return Some(node);
            }
        }
        // Every block of a higher class is larger than `size`, and they differ by under 1/32: take the head.
        if let Some(higher) = self.free.bins.first_at_or_after(bin + 1) {
            return Some(self.free.heads[higher]);
        }
        if head != NIL {
            return self.first_fit_in_class(head, size);
        }
        None
    }

    /// The smallest block of at least `size` bytes among the first [`FIT_SCAN_LIMIT`] of a class list.
    #[inline(never)]
    fn best_in_class(&self, head: u32, size: u64) -> Option<u32> {
        let mut cursor = head;
        let mut best: Option<(u32, u64)> = None;
        for _ in 0..FIT_SCAN_LIMIT {
            if cursor == NIL {
                break;
            }
            let node = &self.nodes[cursor];
            if node.size >= size && best.is_none_or(|(_, s)| node.size < s) {
                best = Some((cursor, node.size));
                if node.size == size {
                    break;
                }
            }
            cursor = node.next_free;
        }
        best.map(|(n, _)| n)
    }

    /// The first block of at least `size` bytes in a whole class list: when nothing larger is free, so that a
    /// miss means no free block fits (callers map or reserve new memory on a miss).
    #[cold]
    #[inline(never)]
    fn first_fit_in_class(&self, head: u32, size: u64) -> Option<u32> {
        let mut cursor = head;
        while cursor != NIL {
            if self.nodes[cursor].size >= size {
                return Some(cursor);
            }
            cursor = self.nodes[cursor].next_free;
        }
        None
    }

    /// Takes free block `index` for a request of `size` bytes, splitting off the remainder.
    #[inline]
    fn take(&mut self, index: u32, size: u64) -> Allocation {
        self.unlink_free(index);
        self.carve(index, size)
    }

    /// The block size and end of a range named by offset and size (for [`Engine::allocate_at`] and
    /// [`Engine::allocate_range`]): `None` for a zero or overflowing size, an offset off the alignment, and in an
    /// engine of whole blocks, which never splits.
    #[inline]
    fn named_range(&self, offset: u64, size: u64) -> Option<(u64, u64)> {
        let size = self.block_size(size)?;
        let end = offset.checked_add(size)?;
        (!self.whole && offset.is_multiple_of(self.alignment)).then_some((size, end))
    }

    /// Takes `[offset, offset + size)` out of free block `index`, which covers it: the part before stays free, the
    /// range becomes a live block, the part after stays free.
    #[inline]
    fn take_at(&mut self, index: u32, offset: u64, size: u64) -> Allocation {
        self.unlink_free(index);
        let placed = if self.nodes[index].offset < offset {
            let placed = self.split(index, offset);
            self.push_free(index);
            placed
        } else {
            index
        };
        self.carve(placed, size)
    }

    /// Makes block `index` (already out of the free index) live for `size` bytes, splitting off the remainder.
    #[inline]
    fn carve(&mut self, index: u32, size: u64) -> Allocation {
        // Fields are read one by one, not as a copy of the node: its fields were just stored one by one, and a
        // wide load over narrow stores still in flight stalls (no store forwarding).
        let (offset, block_size, segment) =
            (self.nodes[index].offset, self.nodes[index].size, self.nodes[index].segment);
        debug_assert!(block_size >= size);
        if block_size > size {
            let rest = self.split(index, offset + size);
            self.push_free(rest);
        }
        let node = &mut self.nodes[index];
        node.state = NodeState::Live;
        let generation = node.generation;
        let seg = self.segments[segment as usize].as_mut().expect("free block in a missing segment");
        let was_empty = seg.live_blocks == 0;
        if was_empty {
            self.stats.empty_segment_bytes -= seg.size;
        }
        seg.live_blocks += 1;
        self.stats.allocated_bytes += size;
        self.stats.live_blocks += 1;
        Allocation {
            block: BlockId::new(index, generation),
            segment: SegmentId(segment),
            offset,
            size,
            segment_was_empty: was_empty,
        }
    }

    /// Moves node `index` (in no free list) to another slot, whose own generation it takes, and retires slot
    /// `index` for good: the node's generation reached [`RETIRED`]. Returns the new index. Runs once per 2^32
    /// uses of a slot.
    #[cold]
    #[inline(never)]
    fn relocate(&mut self, index: u32) -> u32 {
        let mut node = self.nodes[index];
        node.generation = 0; // kept by a new slot; a reused slot moves its own generation forward instead
        let moved = self.nodes.insert(node);
        let (prev, next) = (node.prev_phys, node.next_phys);
        if prev != NIL {
            self.nodes[prev].next_phys = moved;
        } else {
            let seg = self.segments[node.segment as usize].as_mut().expect("a node's segment exists");
            seg.first_block = moved;
        }
        if next != NIL {
            self.nodes[next].prev_phys = moved;
        }
        self.nodes.remove(index); // its generation is RETIRED: the slot is never reused
        moved
    }

    /// Sets the generation of live block `id`'s node (tests only: to reach [`RETIRED`] without 2^32 frees).
    #[cfg(test)]
    pub(crate) fn age(&mut self, id: BlockId, generation: u32) -> BlockId {
        assert!(self.block(id).is_some() && generation < RETIRED);
        self.nodes[id.index()].generation = generation;
        BlockId::new(id.index(), generation)
    }

    /// Merges the physical successor of `index` (already unlinked from its class) into it.
    #[inline]
    fn absorb_next(&mut self, index: u32) {
        let nodes = self.nodes.as_mut_slice();
        let next = nodes[index as usize].next_phys;
        let (next_size, after) = (nodes[next as usize].size, nodes[next as usize].next_phys);
        let node = &mut nodes[index as usize];
        node.size += next_size;
        node.next_phys = after;
        if after != NIL {
            nodes[after as usize].prev_phys = index;
        }
        self.nodes.remove(next);
    }

    /// Splits node `index` at offset `at` (inside it): the node keeps `[offset, at)`, a new free node (in no
    /// index) gets the rest, and is returned. The caller links whichever needs linking.
    #[inline]
    fn split(&mut self, index: u32, at: u64) -> u32 {
        let n = &self.nodes[index];
        let (offset, end, segment, next_phys) = (n.offset, n.offset + n.size, n.segment, n.next_phys);
        debug_assert!(at > offset && at < end);
        let mut rest_node = Node::free(segment, at, end - at);
        rest_node.prev_phys = index;
        rest_node.next_phys = next_phys;
        let rest = self.nodes.insert(rest_node);
        let nodes = self.nodes.as_mut_slice();
        if next_phys != NIL {
            nodes[next_phys as usize].prev_phys = rest;
        }
        let node = &mut nodes[index as usize];
        node.next_phys = rest;
        node.size = at - offset;
        rest
    }

    /// Makes node `index` a free block at the head of its class.
    #[inline(always)]
    fn push_free(&mut self, index: u32) {
        self.link_into(index, false);
    }

    /// Takes free block `index` out of the free index.
    #[inline(always)]
    fn unlink_free(&mut self, index: u32) {
        debug_assert_eq!(self.nodes[index].state, NodeState::Free);
        self.unlink_from(index, false);
    }

    /// Puts node `index` into the index its state belongs to (free or withheld), at the head of its class.
    #[inline]
    fn link(&mut self, index: u32) {
        self.link_into(index, self.nodes[index].state == NodeState::Withheld);
    }

    /// Takes node `index` out of the index its state belongs to.
    #[inline]
    fn unlink(&mut self, index: u32) {
        self.unlink_from(index, self.nodes[index].state == NodeState::Withheld);
    }

    /// Links node `index` into the free index or, when `withheld`, the list of withheld ranges, and gives it the
    /// state that index holds. Inlined with a constant `withheld` on the allocation paths, so they pay nothing
    /// for withheld ranges existing.
    #[inline(always)]
    fn link_into(&mut self, index: u32, withheld: bool) {
        let nodes = self.nodes.as_mut_slice();
        let node = &mut nodes[index as usize];
        if withheld {
            node.state = NodeState::Withheld;
            node.flat = self.withheld_flat.len() as u32;
            self.withheld_flat.push(index);
            return;
        }
        node.state = NodeState::Free;
        let bin = bin_of(node.size);
        let list = &mut self.free;
        let head = list.heads[bin];
        list.heads[bin] = index;
        list.bins.set(bin);
        node.prev_free = NIL;
        node.next_free = head;
        node.bin = bin as u16;
        if head != NIL {
            nodes[head as usize].prev_free = index;
        }
        self.stats.free_blocks += 1;
    }

    /// Takes node `index` out of the free index or, when `withheld`, the list of withheld ranges.
    #[inline(always)]
    fn unlink_from(&mut self, index: u32, withheld: bool) {
        let nodes = self.nodes.as_mut_slice();
        if withheld {
            let place = nodes[index as usize].flat;
            self.withheld_flat.swap_remove(place as usize);
            if let Some(&moved) = self.withheld_flat.get(place as usize) {
                nodes[moved as usize].flat = place;
            }
            return;
        }
        let node = &nodes[index as usize];
        let (prev_free, next_free, bin) = (node.prev_free, node.next_free, node.bin);
        if prev_free != NIL {
            nodes[prev_free as usize].next_free = next_free;
        } else {
            let list = &mut self.free;
            let bin = usize::from(bin);
            list.heads[bin] = next_free;
            if next_free == NIL {
                list.bins.clear(bin);
            }
        }
        if next_free != NIL {
            nodes[next_free as usize].prev_free = prev_free;
        }
        self.stats.free_blocks -= 1;
    }
}

#[cfg(test)]
mod tests;
