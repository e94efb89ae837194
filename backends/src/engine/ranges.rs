//! Blocks at given addresses: whole granules (pages) lying inside free blocks, found without taking them, and
//! a named range taken wherever the free block covering it lies. A pool uses them to serve one request from
//! free pages scattered over its reservations ([`crate::pool`]'s stitched blocks): it looks the pages up, then
//! holds each range in the engine while their second mapping is in use.

use super::bins::bin_of;
use super::slab::{NodeState, NIL};
use super::{Allocation, Engine, SegmentId};

/// A range of whole granules inside one free block, as [`Engine::free_granules`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GranuleRun {
    /// The segment it lies in.
    pub segment: SegmentId,
    /// Offset of its first byte, a multiple of the granule.
    pub offset: u64,
    /// Length, a whole number of granules.
    pub len: u64,
}

impl Engine {
    /// Whole `granule`s (a power of two, at least the alignment) lying inside free blocks, smallest free blocks
    /// first (the large ones are what later requests fit in, as [`Engine::withhold_free`] has it), each block's
    /// from its bottom, until `want` bytes (rounded up to the granule) are found: the runs, in the order found.
    /// Changes nothing; returns fewer bytes than wanted when the free blocks hold fewer. O(free blocks of a
    /// granule or more visited).
    pub fn free_granules(&self, granule: u64, want: u64) -> Vec<GranuleRun> {
        let mut runs = Vec::new();
        if self.whole || !granule.is_power_of_two() || granule < self.alignment {
            return runs;
        }
        let want = want.checked_add(granule - 1).map_or(u64::MAX, |w| w & !(granule - 1));
        let mut found = 0;
        let mut bin = bin_of(granule);
        while found < want {
            let Some(class) = self.free.bins.first_at_or_after(bin) else { break };
            let mut cursor = self.free.heads[class];
            while cursor != NIL && found < want {
                let node = &self.nodes[cursor];
                let lo = (node.offset + (granule - 1)) & !(granule - 1);
                let hi = (node.offset + node.size) & !(granule - 1);
                if hi > lo {
                    let len = (hi - lo).min(want - found);
                    runs.push(GranuleRun { segment: SegmentId(node.segment), offset: lo, len });
                    found += len;
                }
                cursor = node.next_free;
            }
            bin = class + 1;
        }
        runs
    }

    /// Allocates exactly `[offset, offset + size)` (`size` rounded up to the alignment) of `segment` from the
    /// free block covering it, which is split around the range: what lies before and after stays free. `hint`
    /// names the node where the caller last saw that free block (the index of a block it held there and freed):
    /// when the node at that index is still a free block covering the range it is taken at once, O(1); otherwise
    /// the segment is walked by address, O(blocks in the segment).
    ///
    /// Returns `None` (and changes nothing) when no single free block covers the range (some of it is live,
    /// parked or withheld), for an offset off the alignment, a zero or overflowing size, a segment that does not
    /// exist, and in an engine of whole blocks.
    pub fn allocate_range(
        &mut self,
        segment: SegmentId,
        hint: Option<u32>,
        offset: u64,
        size: u64,
    ) -> Option<Allocation> {
        let (size, end) = self.named_range(offset, size)?;
        let covers = |engine: &Engine, index: u32| {
            engine.nodes.get(index).is_some_and(|n| {
                n.state == NodeState::Free && n.segment == segment.0 && n.offset <= offset && n.offset + n.size >= end
            })
        };
        let index = match hint.filter(|&h| covers(self, h)) {
            Some(h) => h,
            None => {
                let mut cursor = self.segment(segment)?.first_block;
                while cursor != NIL && self.nodes[cursor].offset + self.nodes[cursor].size <= offset {
                    cursor = self.nodes[cursor].next_phys;
                }
                if cursor == NIL || !covers(self, cursor) {
                    return None;
                }
                cursor
            }
        };
        Some(self.take_at(index, offset, size))
    }

    /// Restores `len` bytes (a whole number of `granule`s) of withheld space as free space, from the start of the
    /// smallest withheld range that holds them (filling holes before cutting into the untouched rest of a
    /// reservation): the caller has put memory behind `[offset, offset + len)` of the returned segment, or
    /// withholds it again with [`Engine::withhold_range`]. The restored bytes join the free blocks around them.
    /// `None` (nothing changed) when no withheld range is long enough, or `len` is zero or off the granule.
    /// O(withheld ranges).
    pub fn restore_free(&mut self, len: u64, granule: u64) -> Option<(SegmentId, u64)> {
        if len == 0 || !granule.is_power_of_two() || !len.is_multiple_of(granule) {
            return None;
        }
        let index = self
            .withheld_flat
            .iter()
            .copied()
            .filter(|&w| self.nodes[w].size >= len)
            .min_by_key(|&w| (self.nodes[w].size, self.nodes[w].segment, self.nodes[w].offset))?;
        let (segment, offset, size) = (self.nodes[index].segment, self.nodes[index].offset, self.nodes[index].size);
        self.unlink(index);
        if len < size {
            let rest = self.split(index, offset + len);
            self.nodes[rest].state = NodeState::Withheld;
            self.link(rest);
        }
        self.stats.withheld_bytes -= len;
        let joined = self.join_neighbours(index, NodeState::Free);
        self.push_free(joined);
        Some((SegmentId(segment), offset))
    }
}
