//! What the planners place: one allocation's lifetime and size. Below both the greedy heuristics
//! ([`super::solve`]) and the search after them ([`super::improve`]), which each take it.

/// One allocation to place: lifetime (steps, both included) and aligned size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    pub first: u64,
    pub last: u64,
    pub size: u64,
}
