//! The books a pool's [`State`](super::state::State) keeps for its steps, stitched blocks and sleep: data and the
//! rules that touch nothing else. What the pool does with them, under its lock, is in `steps.rs`, `stitch.rs` and
//! `sleep.rs` beside this folder.

pub(super) mod sleep;
pub(super) mod steps;
pub(super) mod stitch;
