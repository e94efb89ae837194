//! The segment-block engine: places blocks inside segments by offset and size only. It knows nothing of devices
//! or pointers; a [`crate::Pool`] maps its segments to backend memory.
//!
//! Free blocks are indexed by size class in a TLSF-style two-level bitmap (`bins`), so finding a fit is O(1) in
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
//! Parts of a segment can be *withheld* (`withheld`): address ranges with no memory behind them (a virtual
//! reservation's unmapped pages). They sit in the segment between blocks but out of the free index, in a list of
//! their own, so every block the free index hands out has memory behind it and allocation never has to ask.

#![deny(unsafe_code)]

pub(crate) mod bins;
mod carve;
mod free_index;
mod ranges;
mod records;
mod slab;
mod withheld;

pub use ranges::GranuleRun;
pub use records::{Allocation, BlockId, EngineStats, Freed, SegmentBlock, SegmentId};
pub use withheld::Restore;

use bins::{bin_of, BIN_COUNT};
use free_index::SizeIndex;
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

    /// Whether [`Engine::allocate`] of `size` bytes would find a free block, without taking it. O(1) as
    /// `allocate`'s search.
    pub fn can_allocate(&self, size: u64) -> bool {
        match self.block_size(size) {
            Some(size) if !self.whole => self.find_fit(size).is_some(),
            Some(_) | None => false,
        }
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

    #[inline]
    fn segment(&self, id: SegmentId) -> Option<Segment> {
        self.segments.get(id.0 as usize).copied().flatten()
    }
}

#[cfg(test)]
mod tests;
