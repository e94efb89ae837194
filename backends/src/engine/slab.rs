//! Block nodes in one dense vector, addressed by `u32` index, with vacant slots reused. Each node carries its
//! address-order neighbours (for coalescing) and its size-class list links (for the free index), so the engine
//! never allocates on the hot path once the slab has grown to the working set.

use std::ops::{Index, IndexMut};

/// "No node": the end of a list.
pub(super) const NIL: u32 = u32::MAX;

/// The generation no id is issued with. A slot whose node reaches it is retired, never reused, so generations
/// never wrap: a stale id cannot match a later block of its slot, however many times the slot is reused (a u32
/// would otherwise wrap after 2^32 frees of one slot, minutes of a tight loop).
pub(super) const RETIRED: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NodeState {
    Free,
    Live,
    /// Freed by its owner but kept out of the free index by the caller (a pool's quick cache): still occupies
    /// its range, can only be unparked or freed.
    Parked,
    /// An address range with no memory behind it: in the list of withheld ranges, never handed out (see
    /// `withheld`).
    Withheld,
    Vacant,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Node {
    pub offset: u64,
    pub size: u64,
    pub segment: u32,
    /// Bumped whenever the block stops being live, so stale [`super::BlockId`]s are refused.
    pub generation: u32,
    pub prev_phys: u32,
    pub next_phys: u32,
    pub prev_free: u32,
    pub next_free: u32,
    /// The size class whose list holds the node, while it is in one (saves recomputing it on unlink).
    pub bin: u16,
    /// A withheld range's place in the engine's flat list of them (padding otherwise: the node stays 48 bytes).
    pub flat: u32,
    pub state: NodeState,
}

// The `flat` field lives in what was padding: a node stays 48 bytes.
const _: () = assert!(std::mem::size_of::<Node>() == 48);

impl Node {
    pub(super) fn free(segment: u32, offset: u64, size: u64) -> Self {
        Self {
            offset,
            size,
            segment,
            generation: 0,
            prev_phys: NIL,
            next_phys: NIL,
            prev_free: NIL,
            next_free: NIL,
            bin: 0,
            flat: 0,
            state: NodeState::Free,
        }
    }
}

/// Vacant slots form a list threaded through their own `next_free` links (a stack: the slot vacated last is
/// reused first, while its cache line is warm), so vacating and reusing a slot touch no second vector.
#[derive(Debug, Clone)]
pub(super) struct Slab {
    nodes: Vec<Node>,
    vacant_head: u32,
}

impl Default for Slab {
    fn default() -> Self {
        Self { nodes: Vec::new(), vacant_head: NIL }
    }
}

impl Slab {
    /// Stores `node` in a vacant slot (keeping that slot's generation moving forward) or a new one. O(1) amortised.
    #[inline]
    pub(super) fn insert(&mut self, mut node: Node) -> u32 {
        let index = self.vacant_head;
        if index == NIL {
            self.nodes.push(node);
            return (self.nodes.len() - 1) as u32;
        }
        let slot = &mut self.nodes[index as usize];
        self.vacant_head = slot.next_free;
        node.generation = slot.generation.wrapping_add(1);
        *slot = node;
        index
    }

    /// Marks slot `index` vacant, for reuse unless its generation is (next to) [`RETIRED`]: reusing it would
    /// bump the generation into [`RETIRED`]. O(1).
    #[inline]
    pub(super) fn remove(&mut self, index: u32) {
        let node = &mut self.nodes[index as usize];
        node.state = NodeState::Vacant;
        if node.generation >= RETIRED - 1 {
            return;
        }
        node.next_free = self.vacant_head;
        self.vacant_head = index;
    }

    /// All slots, vacant ones included, to read several nodes through one bounds-checked slice.
    #[inline(always)]
    pub(super) fn as_slice(&self) -> &[Node] {
        &self.nodes
    }

    /// All slots, vacant ones included. A caller that touches several nodes takes the slice once: the vector's
    /// pointer and length then stay in registers instead of being reloaded (and rechecked) after every store.
    #[inline(always)]
    pub(super) fn as_mut_slice(&mut self) -> &mut [Node] {
        &mut self.nodes
    }

    /// The node at `index` unless the slot is out of range or vacant. O(1).
    #[inline]
    pub(super) fn get(&self, index: u32) -> Option<&Node> {
        self.nodes.get(index as usize).filter(|n| n.state != NodeState::Vacant)
    }
}

impl Index<u32> for Slab {
    type Output = Node;
    #[inline]
    fn index(&self, index: u32) -> &Node {
        &self.nodes[index as usize]
    }
}

impl IndexMut<u32> for Slab {
    #[inline]
    fn index_mut(&mut self, index: u32) -> &mut Node {
        &mut self.nodes[index as usize]
    }
}
