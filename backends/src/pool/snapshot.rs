//! What a pool holds, seen from outside: its statistics and a snapshot of every segment with its blocks,
//! each taken under the pool's lock with the thread caches' books folded in.

use super::state::ArenaClass;
use super::Pool;
use crate::{Backend, PoolStats, StreamId};
use serde::Serialize;

/// One block in a [`PoolSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockSnapshot {
    /// Offset inside the segment.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// Whether the block is free (cached).
    pub free: bool,
    /// [`BlockHandle::key`](crate::BlockHandle::key) of a live block, to join with side tables (labels, call sites).
    pub key: Option<u64>,
}

/// One segment in a [`PoolSnapshot`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SegmentSnapshot {
    /// The stream whose arena holds it.
    pub stream: StreamId,
    /// `"small"` or `"large"` arena.
    pub class: &'static str,
    /// Segment index inside its arena.
    pub index: u32,
    /// Size in bytes (address space for a virtual reservation).
    pub size: u64,
    /// Device address of its first byte, where the backend's memory has addresses
    /// ([`Backend::device_address`]: CUDA, the simulated device).
    pub address: Option<u64>,
    /// Whether it is a virtual reservation.
    pub virtual_reservation: bool,
    /// Physical bytes behind it (the size for a plain segment; mapped pages for a reservation).
    pub physical_bytes: u64,
    /// Its blocks in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// Every segment of a pool with its blocks, and the pool's statistics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolSnapshot {
    /// Pool name.
    pub name: String,
    /// Segments.
    pub segments: Vec<SegmentSnapshot>,
    /// Statistics at the same moment.
    pub stats: PoolStats,
}

impl<B: Backend> Pool<B> {
    /// Statistics now. O(1).
    pub fn stats(&self) -> PoolStats {
        let stats = self.folded_state().stats_now();
        debug_assert_eq!(stats.reserved_bytes.current, self.reserved_bytes(), "the lock-free reserved figure");
        stats
    }

    /// Every segment with its blocks, and the statistics, taken under one lock. O(segments + blocks).
    pub fn snapshot(&self) -> PoolSnapshot {
        self.drain_thread_caches(false);
        let mut state = self.folded_state();
        for arena in 0..state.arenas.len() {
            state.drain_quick(arena);
        }
        let mut segments = Vec::new();
        // A stitched block shows as the pieces of memory it holds, each with its key; its own address range
        // holds no memory and is not shown.
        let holders = Self::stitch_holders(&state);
        // Arenas come in the order their streams were first used, a stream's small one first.
        for (arena_index, arena) in state.arenas.iter().enumerate() {
            if arena.class == ArenaClass::Stitched {
                continue;
            }
            let (stream, arena_index) = (arena.stream, arena_index as u32);
            let key_of = |block: crate::engine::BlockId| {
                let own = (u64::from(arena_index) << 32) | u64::from(block.index());
                holders.get(&(arena_index as usize, block)).copied().unwrap_or(own)
            };
            for id in arena.engine().segment_ids() {
                let entry = arena.entry(id).expect("segment exists");
                let size = arena.engine().segment_size(id).expect("segment exists");
                // Withheld (unmapped) ranges are free address space: shown joined with free neighbours.
                let mut blocks: Vec<BlockSnapshot> = Vec::new();
                for b in arena.engine().blocks_in(id) {
                    let free = b.free || b.withheld;
                    match blocks.last_mut() {
                        Some(last) if free && last.free => last.size += b.size,
                        _ => blocks.push(BlockSnapshot {
                            offset: b.offset,
                            size: b.size,
                            free,
                            key: b.block.map(key_of),
                        }),
                    }
                }
                segments.push(SegmentSnapshot {
                    stream,
                    class: match arena.class {
                        ArenaClass::Small => "small",
                        ArenaClass::Large => "large",
                        ArenaClass::Planned => "planned",
                        ArenaClass::Stitched => unreachable!("stitched ranges are not shown"),
                    },
                    index: id.0,
                    size,
                    address: self.backend.device_address(&entry.handle),
                    virtual_reservation: entry.mapped.is_some(),
                    // A sleeping pool's reservations have no page mapped (the free ones went before the rest slept).
                    physical_bytes: if state.sleep.is_some() { 0 } else { entry.mapped.unwrap_or(size) },
                    blocks,
                });
            }
        }
        PoolSnapshot { name: self.backend.name().to_string(), segments, stats: state.stats_now() }
    }

    /// Sets every peak to its current value (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peaks(&self) {
        let mut state = self.folded_state();
        state.update_split();
        // The sharing budget follows the live peak across resets (see `State::live_high_water`).
        state.live_high_water = state.live_high_water.max(state.stats.allocated_bytes.peak);
        let s = &mut state.stats;
        for stat in [
            &mut s.allocated_bytes,
            &mut s.requested_bytes,
            &mut s.reserved_bytes,
            &mut s.inactive_split_bytes,
            &mut s.active_blocks,
            &mut s.segments,
        ] {
            stat.reset_peak();
        }
    }
}
