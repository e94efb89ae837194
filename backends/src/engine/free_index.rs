//! The free index: free blocks by size class (a list head per class and the classes' occupancy bitmaps), how a fit
//! is found in it, and how blocks enter and leave it (and the list of withheld ranges, its counterpart).

use super::bins::{bin_of, BinMaps, BIN_COUNT};
use super::slab::{NodeState, NIL};
use super::{Engine, FIT_SCAN_LIMIT};

/// Free blocks by size class: a list head per class and the classes' occupancy bitmaps. Fields are open to the
/// engine's rooms: the scans that walk classes (withheld ranges, granule runs) read them directly.
#[derive(Debug, Clone)]
pub(super) struct SizeIndex {
    pub(super) heads: Box<[u32; BIN_COUNT]>,
    pub(super) bins: BinMaps,
}

impl SizeIndex {
    pub(super) fn new() -> Self {
        Self { heads: Box::new([NIL; BIN_COUNT]), bins: BinMaps::new() }
    }
}

impl Engine {
    /// Finds a free block of at least `size` bytes. O(1) (a bounded scan and a bitmap search) unless no larger
    /// class has a free block, when the request's class is walked to the end.
    ///
    /// Only the checks of the common cases are inline (the own class empty, or its head an exact fit); the scans
    /// are calls, so that `allocate` stays small enough to be inlined into its callers' loops.
    #[inline]
    pub(super) fn find_fit(&self, size: u64) -> Option<u32> {
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
    pub(super) fn first_fit_in_class(&self, head: u32, size: u64) -> Option<u32> {
        let mut cursor = head;
        while cursor != NIL {
            if self.nodes[cursor].size >= size {
                return Some(cursor);
            }
            cursor = self.nodes[cursor].next_free;
        }
        None
    }

    /// Makes node `index` a free block at the head of its class.
    #[inline(always)]
    pub(super) fn push_free(&mut self, index: u32) {
        self.link_into(index, false);
    }

    /// Takes free block `index` out of the free index.
    #[inline(always)]
    pub(super) fn unlink_free(&mut self, index: u32) {
        debug_assert_eq!(self.nodes[index].state, NodeState::Free);
        self.unlink_from(index, false);
    }

    /// Puts node `index` into the index its state belongs to (free or withheld), at the head of its class.
    #[inline]
    pub(super) fn link(&mut self, index: u32) {
        self.link_into(index, self.nodes[index].state == NodeState::Withheld);
    }

    /// Takes node `index` out of the index its state belongs to.
    #[inline]
    pub(super) fn unlink(&mut self, index: u32) {
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
}
