//! Withheld ranges: parts of a segment with no memory behind them, such as the unmapped pages of a virtual
//! reservation. A pool withholds free pages when it unmaps them and restores withheld pages when it maps them;
//! the engine keeps the ranges in the segment's address order (between blocks, merged with withheld neighbours)
//! and in a flat list of their own (the search weighs every range, so no index by size is kept for them), so the
//! free index only ever holds memory that is backed.
//!
//! Withheld ranges are multiples of a granule (the page size) chosen by the caller, and start on one.

use super::bins::bin_of;
use super::slab::{Node, NodeState, NIL};
use super::{Allocation, Engine, Segment, SegmentId};
use std::hint::select_unpredictable;

/// `value` rounded up to a multiple of `granule`, a power of two (a mask, not the division that
/// `next_multiple_of` compiles to for a granule known only at run time: a 64-bit division takes 10-20 cycles, and
/// the remap path rounded up to 18 times per miss). The caller knows `value + granule - 1` cannot overflow.
#[inline(always)]
fn align_up(value: u64, granule: u64) -> u64 {
    debug_assert!(granule.is_power_of_two());
    (value + (granule - 1)) & !(granule - 1)
}

/// How many withheld ranges [`Engine::find_withheld`] weighs per chunk (the size of its array of keys).
const WEIGH_CHUNK: usize = 32;

/// Withheld bytes to restore for a request: found by [`Engine::find_withheld`], used by
/// [`Engine::restore_and_allocate`] (with nothing changing the engine in between).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restore {
    /// The segment.
    pub segment: SegmentId,
    /// First byte to restore, a multiple of the granule: the start of a withheld range, or, when the request runs
    /// from the range into the free block after it, the granule that many bytes before the range's end.
    pub offset: u64,
    /// Bytes to restore from there, a multiple of the granule.
    pub len: u64,
    node: u32,
}

/// The best withheld range weighed so far: its node, and its [`restore_key`]. A range wins with a smaller key: fewer
/// bytes to restore, or as many from a smaller range (filling holes before cutting into the untouched rest of a
/// reservation, whatever the order of the scan); on equal keys the first weighed stays.
struct Best {
    index: u32,
    key: u64,
}

/// The key [`Engine::find_withheld`] ranks withheld range `index` by for a request of `size` bytes: the bytes
/// to restore (whole granules; `u64::MAX` when the range cannot serve the request) with the range's size in
/// granules, capped below one granule, in the low bits as the tie-break.
///
/// The request either starts at the free block before the range and runs into it, or ends in the free block after
/// it and starts inside it (the one after only when it is the larger: on a tie the request is served as it was
/// before the block after was weighed, see [`Engine::find_withheld`]): from the larger of the two, which
/// leaves the fewest bytes to restore, `size - free` rounded up to whole granules (the range starts and ends on a
/// granule, so its offset drops out). When that is more than the range holds, the whole range comes back and joins
/// the free blocks on both sides, if together they hold the request. Weighing the free block after as well as the
/// one before restores fewer pages on a miss (docs/PERFORMANCE.md, "Figures behind the code").
///
/// Every choice is a select the compiler must not turn into a branch: which case applies to a range is
/// something a branch predictor cannot learn, and a miss weighs every range (plain `if`s and `min`s compile
/// back into branches).
#[inline(always)]
fn restore_key(nodes: &[Node], index: u32, size: u64, granule: u64) -> u64 {
    let Some(w) = nodes.get(index as usize) else { return u64::MAX };
    let len = w.size;
    let (before, after) = free_around(nodes, w);
    let mask = granule - 1;
    // Callers ask only after the free index missed, so both free blocks are smaller than `size`; saturating keeps
    // the rule (at least one granule) for any caller. Wrapping: a request near u64::MAX needs more than any range
    // holds, and then this value is not used.
    let need = size.saturating_sub(before.max(after));
    let into = (need.wrapping_add(mask) & !mask).max(granule);
    let whole = select_unpredictable(before + len + after >= size, len, u64::MAX);
    let restore = select_unpredictable(need <= len, into, whole);
    restore | (len >> granule.trailing_zeros()).min(mask)
}

/// The sizes of the free blocks before and after withheld range `w` (0 where the neighbour is not free). A missing
/// neighbour reads as the range itself, which is not free: `get` of `NIL` is `None`, so that is one compare and
/// conditional move with no bounds check that could panic.
#[inline(always)]
fn free_around(nodes: &[Node], w: &Node) -> (u64, u64) {
    let prev = nodes.get(w.prev_phys as usize).unwrap_or(w);
    let next = nodes.get(w.next_phys as usize).unwrap_or(w);
    let before = select_unpredictable(prev.state == NodeState::Free, prev.size, 0);
    let after = select_unpredictable(next.state == NodeState::Free, next.size, 0);
    (before, after)
}

/// The range of `ranges` (at most [`WEIGH_CHUNK`]) with the smallest [`restore_key`], the first on a tie. Not
/// inlined: on its own its two loops keep their values in registers, where the caller's chunk loop would make the
/// first spill.
#[inline(never)]
fn best_of(nodes: &[Node], ranges: &[u32], size: u64, granule: u64) -> Best {
    let mut keys = [u64::MAX; WEIGH_CHUNK];
    for (key, &index) in keys.iter_mut().zip(ranges) {
        *key = restore_key(nodes, index, size, granule);
    }
    let mut best = Best { index: NIL, key: u64::MAX };
    for (&key, &index) in keys.iter().zip(ranges) {
        let better = key < best.key;
        best.index = select_unpredictable(better, index, best.index);
        best.key = select_unpredictable(better, key, best.key);
    }
    best
}

impl Engine {
    /// Adds a segment of `size` bytes (rounded up to the alignment) that is withheld from end to end: nothing in it
    /// is allocatable until restored. O(1) amortised. Returns `None` for a zero size, and in an engine of whole
    /// blocks ([`Engine::whole_blocks`]), which withholds nothing.
    pub fn add_withheld_segment(&mut self, size: u64) -> Option<SegmentId> {
        if self.whole {
            return None;
        }
        let id = self.add_segment(size)?;
        let node = self.segments[id.0 as usize].expect("just added").first_block;
        self.unlink(node);
        self.nodes[node].state = NodeState::Withheld;
        self.link(node);
        self.stats.withheld_bytes += self.nodes[node].size;
        Some(id)
    }

    /// Withholds free space, `granule` (a power of two, at least the alignment) at a time: the granules lying
    /// wholly inside free blocks of the segments `eligible` accepts, smallest free blocks first (the large ones
    /// are what future requests fit in), each from its top, until `want` bytes are withheld (rounded up to the
    /// granule). Calls `release(segment, offset, len)` for each range just before withholding it, so the caller
    /// can give its memory back. Returns the bytes withheld (none in an engine of whole blocks). O(free blocks of
    /// a granule or more visited).
    pub fn withhold_free(
        &mut self,
        granule: u64,
        want: u64,
        mut eligible: impl FnMut(SegmentId) -> bool,
        mut release: impl FnMut(SegmentId, u64, u64),
    ) -> u64 {
        debug_assert!(granule.is_power_of_two() && granule >= self.alignment);
        let mut withheld = 0;
        if self.whole {
            return withheld;
        }
        let mut bin = bin_of(granule);
        while withheld < want {
            let Some(class) = self.free.bins.first_at_or_after(bin) else { break };
            let mut cursor = self.free.heads[class];
            while cursor != NIL && withheld < want {
                let node = self.nodes[cursor];
                // Withholding `cursor` leaves its free neighbours alone (there are none: free blocks coalesce)
                // and puts what is left of it, under a granule unless the request is met, in lower classes.
                let next = node.next_free;
                let lo = align_up(node.offset, granule);
                let hi = (node.offset + node.size) & !(granule - 1);
                if hi > lo && eligible(SegmentId(node.segment)) {
                    let wanted = (want - withheld).checked_add(granule - 1).map_or(u64::MAX, |w| w & !(granule - 1));
                    let len = (hi - lo).min(wanted);
                    // From the top, unless only the bottom touches a withheld range: the withheld space then
                    // grows in place rather than starting a new range between two free pieces.
                    let bottom = lo == node.offset
                        && self.is_withheld(node.prev_phys)
                        && !(hi == node.offset + node.size && self.is_withheld(node.next_phys));
                    let start = if bottom { lo } else { hi - len };
                    release(SegmentId(node.segment), start, len);
                    self.withhold_part(cursor, start, start + len);
                    withheld += len;
                }
                cursor = next;
            }
            bin = class + 1;
        }
        withheld
    }

    /// Withholds `[offset, offset + len)` of `segment`, which must lie inside one free block and be a whole
    /// number of `granule`s. Returns whether it did (never in an engine of whole blocks). O(blocks in the
    /// segment): for undoing a restore, a rare path.
    pub fn withhold_range(&mut self, segment: SegmentId, offset: u64, len: u64, granule: u64) -> bool {
        let Some(seg) = self.segment(segment) else { return false };
        if self.whole || len == 0 || !offset.is_multiple_of(granule) || !len.is_multiple_of(granule) {
            return false;
        }
        let mut cursor = seg.first_block;
        while cursor != NIL {
            let node = self.nodes[cursor];
            if node.offset + node.size > offset {
                let inside = node.state == NodeState::Free && node.offset <= offset;
                if !inside || offset + len > node.offset + node.size {
                    return false;
                }
                self.withhold_part(cursor, offset, offset + len);
                return true;
            }
            cursor = node.next_phys;
        }
        false
    }

    /// Where to restore withheld memory for a request of `size` bytes, restoring as little as possible: a
    /// withheld range is weighed with the larger of the free blocks around it (the request starts in the one
    /// before and runs into the range, or starts in the range and runs into the one after) or, when the range is
    /// too short for that, with the free blocks on both sides (the whole range is restored and joins them).
    /// Weighs every withheld range: O(withheld ranges), about 50 instructions each.
    /// A pool has a few dozen (each lies between blocks and is at least a page), and a pool calls this only on a
    /// miss that then maps at least one page, which costs a device tens of microseconds. `None` when nothing
    /// withheld can serve the request, and when `granule` is not a power of two.
    pub fn find_withheld(&self, size: u64, granule: u64) -> Option<Restore> {
        let size = self.block_size(size)?;
        if !granule.is_power_of_two() {
            return None;
        }
        let mut best = Best { index: NIL, key: u64::MAX };
        // Any range can be the best: a large one with a large free block before it needs few new pages, and so
        // can a small one between two free blocks, so weighing only some ranges restores more pages per miss than
        // needed. Every range is weighed, a chunk at a time: the keys first, then the smallest, two loops each
        // with few enough live values to stay in registers (one loop would spill and shuffle them).
        let nodes = self.nodes.as_slice();
        // Chunks are combined as the ranges inside one are (passing `best` into `best_of` would send it through
        // memory).
        for ranges in self.withheld_flat.chunks(WEIGH_CHUNK) {
            let chunk = best_of(nodes, ranges, size, granule);
            let better = chunk.key < best.key;
            best.index = select_unpredictable(better, chunk.index, best.index);
            best.key = select_unpredictable(better, chunk.key, best.key);
        }
        if best.key == u64::MAX {
            return None; // Nothing serves (a range that cannot may still have won a tie on size).
        }
        let w = self.nodes.get(best.index)?;
        let len = best.key & !(granule - 1);
        // The request ends in the free block after the range only when that block is the larger (on a tie it is
        // served from the head, as before the block after was weighed); the restored bytes then end where the
        // range does. When they are the whole range, both ways start at its offset, and restoring it whole joins
        // the free blocks on both sides.
        let (before, after) = free_around(self.nodes.as_slice(), w);
        let offset = if after > before { w.offset + w.size - len } else { w.offset };
        Some(Restore { segment: SegmentId(w.segment), offset, len, node: best.index })
    }

    /// Restores what [`Engine::find_withheld`] chose (the caller has put memory behind it) and allocates `size`
    /// bytes from the free block it joins, at that block's start. O(1).
    ///
    /// Returns `None` (changing nothing) when `restore` no longer describes a withheld range.
    pub fn restore_and_allocate(&mut self, restore: &Restore, size: u64) -> Option<Allocation> {
        let size = self.block_size(size)?;
        let node = self.nodes.get(restore.node)?;
        let from_head = node.offset == restore.offset;
        let valid = node.state == NodeState::Withheld
            && node.segment == restore.segment.0
            && node.size >= restore.len
            && restore.len > 0
            && (from_head || restore.offset.checked_add(restore.len) == Some(node.offset + node.size));
        if !valid {
            return None;
        }
        let (index, range_size) = (restore.node, node.size);
        let free = if from_head { node.prev_phys } else { node.next_phys };
        if restore.len < range_size && free != NIL && self.nodes[free].state == NodeState::Free {
            return self.restore_in_place(index, free, restore.len, !from_head, size);
        }
        if !from_head {
            return None; // Not what find_withheld chose: it serves from a tail only into a free block after.
        }
        self.unlink(index);
        if restore.len < self.nodes[index].size {
            let rest = self.split(index, restore.offset + restore.len);
            self.nodes[rest].state = NodeState::Withheld;
            self.link(rest);
        }
        self.stats.withheld_bytes -= restore.len;
        let index = self.join_neighbours(index, NodeState::Free);
        self.carve_restored(index, size)
    }

    /// The common case of [`Engine::restore_and_allocate`], in place: the first `len` bytes of withheld range
    /// `index` (fewer than it holds), or its last when `from_tail`, are restored into the free block `free` that
    /// borders them, which grows over them while the range shrinks; no node is added or removed. Inlined, as is
    /// [`Engine::carve_restored`]: as calls they cost each remap 46 instructions (callgrind, `pressure`: 666.8 ->
    /// 675.7 per op).
    #[inline(always)]
    fn restore_in_place(&mut self, index: u32, free: u32, len: u64, from_tail: bool, size: u64) -> Option<Allocation> {
        self.unlink_free(free);
        let (w_offset, w_size) = (self.nodes[index].offset, self.nodes[index].size);
        if from_tail {
            self.nodes[free].offset -= len;
            self.resize_withheld(index, w_offset, w_size - len);
        } else {
            self.resize_withheld(index, w_offset + len, w_size - len);
        }
        self.nodes[free].size += len;
        self.stats.withheld_bytes -= len;
        self.carve_restored(free, size)
    }

    /// Carves `size` bytes from the start of free block `index` (in no index), which a restore has just grown; when
    /// it is too small (not what find_withheld promised), keeps it free rather than fail half-way.
    #[inline(always)]
    fn carve_restored(&mut self, index: u32, size: u64) -> Option<Allocation> {
        if self.nodes[index].size < size {
            self.push_free(index);
            return None;
        }
        Some(self.carve(index, size))
    }

    /// The ranges of `segment` that are not withheld (blocks, live or free, in runs), in address order: what has
    /// memory behind it. O(blocks in the segment).
    pub fn backed_ranges(&self, segment: SegmentId) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut cursor = self.segment(segment).map_or(NIL, |s: Segment| s.first_block);
        std::iter::from_fn(move || {
            while cursor != NIL && self.nodes[cursor].state == NodeState::Withheld {
                cursor = self.nodes[cursor].next_phys;
            }
            if cursor == NIL {
                return None;
            }
            let start = self.nodes[cursor].offset;
            let mut end = start;
            while cursor != NIL && self.nodes[cursor].state != NodeState::Withheld {
                end += self.nodes[cursor].size;
                cursor = self.nodes[cursor].next_phys;
            }
            Some((start, end - start))
        })
    }

    /// Withholds `[r0, r1)` of free block `index` (inside it, non-empty): what lies before and after stays free,
    /// and the range joins withheld neighbours.
    #[inline(always)]
    fn withhold_part(&mut self, index: u32, r0: u64, r1: u64) {
        let Node { offset, size, prev_phys, next_phys, .. } = self.nodes[index];
        let end = offset + size;
        debug_assert!(offset <= r0 && r0 < r1 && r1 <= end);
        // The common cases, in place: the part borders a withheld range and the rest of the block stays free, so
        // the block shrinks and the range grows; no node is added or removed.
        if r1 == end && r0 > offset && self.is_withheld(next_phys) {
            self.unlink_free(index);
            self.nodes[index].size = r0 - offset;
            self.push_free(index);
            let (w_size, w_offset) = (self.nodes[next_phys].size, r0);
            self.resize_withheld(next_phys, w_offset, w_size + (r1 - r0));
            self.stats.withheld_bytes += r1 - r0;
            return;
        }
        if r0 == offset && r1 < end && self.is_withheld(prev_phys) {
            self.unlink_free(index);
            self.nodes[index].offset = r1;
            self.nodes[index].size = end - r1;
            self.push_free(index);
            let w_size = self.nodes[prev_phys].size;
            let w_offset = self.nodes[prev_phys].offset;
            self.resize_withheld(prev_phys, w_offset, w_size + (r1 - r0));
            self.stats.withheld_bytes += r1 - r0;
            return;
        }
        self.unlink(index);
        if r1 < offset + size {
            let back = self.split(index, r1);
            self.push_free(back);
        }
        let mut range = index;
        if r0 > offset {
            range = self.split(index, r0);
            self.push_free(index);
        }
        let range = self.join_neighbours(range, NodeState::Withheld);
        self.link(range);
        self.stats.withheld_bytes += r1 - r0;
    }

    /// Whether node `index` exists and is a withheld range.
    fn is_withheld(&self, index: u32) -> bool {
        index != NIL && self.nodes[index].state == NodeState::Withheld
    }

    /// Moves withheld range `index` to `[offset, offset + size)` (its neighbours have moved their edges to
    /// match). O(1): withheld ranges are indexed by the flat list alone, which does not depend on their size.
    fn resize_withheld(&mut self, index: u32, offset: u64, size: u64) {
        let node = &mut self.nodes[index];
        node.offset = offset;
        node.size = size;
    }

    /// Gives node `index` (in no index) the state `state` and merges it with its address neighbours in that
    /// state, taking them out of their index. Returns the node that spans the result, still in no index.
    pub(super) fn join_neighbours(&mut self, index: u32, state: NodeState) -> u32 {
        self.nodes[index].state = state;
        let next = self.nodes[index].next_phys;
        if next != NIL && self.nodes[next].state == state {
            self.unlink(next);
            self.absorb_next(index);
        }
        let prev = self.nodes[index].prev_phys;
        if prev != NIL && self.nodes[prev].state == state {
            self.unlink(prev);
            self.absorb_next(prev);
            return prev;
        }
        index
    }
}
