//! Block surgery: taking a free block for a request (splitting off what is left), merging a freed block's
//! neighbour into it, and moving a node whose slot has run out of generations.

use super::slab::{Node, NodeState, NIL};
use super::{Allocation, BlockId, Engine, SegmentId};

impl Engine {
    /// Takes free block `index` for a request of `size` bytes, splitting off the remainder.
    #[inline]
    pub(super) fn take(&mut self, index: u32, size: u64) -> Allocation {
        self.unlink_free(index);
        self.carve(index, size)
    }

    /// The block size and end of a range named by offset and size (for [`Engine::allocate_at`] and
    /// [`Engine::allocate_range`]): `None` for a zero or overflowing size, an offset off the alignment, and in an
    /// engine of whole blocks, which never splits.
    #[inline]
    pub(super) fn named_range(&self, offset: u64, size: u64) -> Option<(u64, u64)> {
        let size = self.block_size(size)?;
        let end = offset.checked_add(size)?;
        (!self.whole && offset.is_multiple_of(self.alignment)).then_some((size, end))
    }

    /// Takes `[offset, offset + size)` out of free block `index`, which covers it: the part before stays free, the
    /// range becomes a live block, the part after stays free.
    #[inline]
    pub(super) fn take_at(&mut self, index: u32, offset: u64, size: u64) -> Allocation {
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
    pub(super) fn carve(&mut self, index: u32, size: u64) -> Allocation {
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
    /// `index` for good: the node's generation reached [`RETIRED`](super::slab::RETIRED). Returns the new index. Runs once per 2^32
    /// uses of a slot.
    #[cold]
    #[inline(never)]
    pub(super) fn relocate(&mut self, index: u32) -> u32 {
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

    /// Sets the generation of live block `id`'s node (tests only: to reach [`RETIRED`](super::slab::RETIRED) without 2^32 frees).
    #[cfg(test)]
    pub(crate) fn age(&mut self, id: BlockId, generation: u32) -> BlockId {
        assert!(self.block(id).is_some() && generation < super::slab::RETIRED);
        self.nodes[id.index()].generation = generation;
        BlockId::new(id.index(), generation)
    }

    /// Merges the physical successor of `index` (already unlinked from its class) into it.
    #[inline]
    pub(super) fn absorb_next(&mut self, index: u32) {
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
    pub(super) fn split(&mut self, index: u32, at: u64) -> u32 {
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
}
