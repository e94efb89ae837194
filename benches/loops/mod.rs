//! The replay loops that time the bare engine and offset-allocator, shared by `benches/replay.rs` (criterion) and
//! `examples/engine_vs_offset.rs` (one allocator per process, for instruction counts and alternating timings),
//! so that both measure the same code.

use std::time::{Duration, Instant};
use umm::backends::engine::{BlockId, Engine};
use umm::trace::{Op, Trace};

/// Sizes are divided by this when a trace does not fit offset-allocator's `u32` range.
pub const SCALE: u64 = 256;

/// The size divisor for `trace`: 1, or [`SCALE`] when twice its peak does not fit offset-allocator's `u32` range.
pub fn scale_for(trace: &Trace) -> u64 {
    if trace.peak_live_bytes.saturating_mul(2) > u64::from(u32::MAX) {
        SCALE
    } else {
        1
    }
}

/// offset-allocator needs its whole range up front: twice the peak (room for fragmentation), in scaled units.
pub fn offset_capacity(trace: &Trace, scale: u64) -> u32 {
    (trace.peak_live_bytes.div_ceil(scale).saturating_mul(2)).min(u64::from(u32::MAX)) as u32
}

/// An engine with the pool's alignment (256 bytes; 1 for scaled sizes).
pub fn engine_for(scale: u64) -> Engine {
    Engine::new(if scale == 1 { 256 } else { 1 }).expect("power of two")
}

/// An offset-allocator with room for `trace` (scaled by `scale`).
pub fn offset_allocator_for(trace: &Trace, scale: u64) -> offset_allocator::Allocator<u32> {
    let max_allocs = (trace.slots + 1024).min(u32::MAX - 2);
    offset_allocator::Allocator::<u32>::with_max_allocs(offset_capacity(trace, scale), max_allocs)
}

/// A trace's ops with sizes divided by `scale` (rounded up), as the engine and offset-allocator see them.
pub fn scaled(trace: &Trace, scale: u64) -> Vec<Op> {
    trace
        .ops
        .iter()
        .map(|&op| match op {
            Op::Alloc { slot, bytes, stream } => Op::Alloc { slot, bytes: bytes.div_ceil(scale), stream },
            free => free,
        })
        .collect()
}

/// Segment size for a request the engine cannot place, following the pool's policy (2 MiB small segments,
/// 20 MiB medium ones, large requests rounded to 2 MiB), in the same units as the sizes.
pub fn segment_for(size: u64, scale: u64) -> u64 {
    let mib = (1 << 20) / scale;
    let granule = 2 * mib;
    match size {
        s if s <= mib => granule,
        s if s < 10 * mib => 20 * mib,
        s => s.div_ceil(granule) * granule,
    }
}

pub fn engine_pass(engine: &mut Engine, ops: &[Op], slots: &mut [Option<BlockId>], scale: u64) -> Duration {
    let start = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc { slot, bytes, .. } => {
                let alloc = match engine.allocate(bytes) {
                    Some(a) => a,
                    None => {
                        let seg = engine.add_segment(segment_for(bytes, scale)).expect("segment size is valid");
                        engine.allocate_in(seg, bytes).expect("a fresh segment fits")
                    }
                };
                slots[slot as usize] = Some(alloc.block);
            }
            Op::Free { slot } => {
                // Like offset-allocator's free below, the result is not looked at: the engine's state changes
                // either way, so nothing can be optimised out.
                if let Some(block) = slots[slot as usize].take() {
                    engine.free(block);
                }
            }
        }
    }
    let elapsed = start.elapsed();
    for block in slots.iter_mut().filter_map(Option::take) {
        engine.free(block);
    }
    elapsed
}

pub type OffsetAllocation = offset_allocator::Allocation<u32>;

pub fn offset_pass(
    allocator: &mut offset_allocator::Allocator<u32>,
    ops: &[Op],
    slots: &mut [Option<OffsetAllocation>],
    failures: &mut u64,
) -> Duration {
    let start = Instant::now();
    for op in ops {
        match *op {
            Op::Alloc { slot, bytes, .. } => match allocator.allocate(bytes as u32) {
                Some(a) => slots[slot as usize] = Some(a),
                None => *failures += 1,
            },
            Op::Free { slot } => {
                if let Some(a) = slots[slot as usize].take() {
                    allocator.free(a);
                }
            }
        }
    }
    let elapsed = start.elapsed();
    for a in slots.iter_mut().filter_map(Option::take) {
        allocator.free(a);
    }
    elapsed
}
