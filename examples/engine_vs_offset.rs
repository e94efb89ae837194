//! Replays one trace through the bare engine or through offset-allocator, as `benches/replay.rs` does, in a
//! process of its own: for instruction counts (run it under `valgrind --tool=cachegrind` with 1 and with 4
//! passes; the difference over 3 passes and the trace's ops is the cost of one warm op) and for alternating
//! timings, which this shared machine needs more than criterion's back-to-back ones.
//!
//! `cargo run --release --example engine_vs_offset -- TRACE engine|offset PASSES`
use umm::backends::engine::{BlockId, Engine};
use umm::trace::{Op, Trace};

/// Segment size for a request the engine cannot place: the pool's policy, as in `benches/replay.rs`.
fn segment_for(size: u64, scale: u64) -> u64 {
    let mib = (1 << 20) / scale;
    let granule = 2 * mib;
    match size {
        s if s <= mib => granule,
        s if s < 10 * mib => 20 * mib,
        s => s.div_ceil(granule) * granule,
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 4 || !matches!(a[2].as_str(), "engine" | "offset") {
        eprintln!("usage: engine_vs_offset TRACE engine|offset PASSES");
        std::process::exit(2);
    }
    let trace = Trace::load(std::path::Path::new(&a[1])).unwrap_or_else(|e| panic!("{}: {e}", a[1]));
    let mode = a[2].clone();
    let passes: usize = a[3].parse().expect("PASSES is a number");
    // offset-allocator counts in u32 units: traces past 4 GiB replay with sizes divided by 256, as in the bench.
    let scale = if trace.peak_live_bytes.saturating_mul(2) > u64::from(u32::MAX) { 256 } else { 1 };
    let ops: Vec<Op> = trace
        .ops
        .iter()
        .map(|&op| match op {
            Op::Alloc { slot, bytes, stream } => Op::Alloc { slot, bytes: bytes.div_ceil(scale), stream },
            f => f,
        })
        .collect();
    let t = std::time::Instant::now();
    if mode == "engine" {
        let mut engine = Engine::new(if scale == 1 { 256 } else { 1 }).expect("a power of two");
        let mut slots: Vec<Option<BlockId>> = vec![None; trace.slots as usize];
        for _ in 0..passes {
            for op in &ops {
                match *op {
                    Op::Alloc { slot, bytes, .. } => {
                        let alloc = match engine.allocate(bytes) {
                            Some(a) => a,
                            None => {
                                let seg = engine.add_segment(segment_for(bytes, scale)).expect("valid size");
                                engine.allocate_in(seg, bytes).expect("a fresh segment fits")
                            }
                        };
                        slots[slot as usize] = Some(alloc.block);
                    }
                    Op::Free { slot } => {
                        if let Some(b) = slots[slot as usize].take() {
                            engine.free(b);
                        }
                    }
                }
            }
            for b in slots.iter_mut().filter_map(Option::take) {
                engine.free(b);
            }
        }
    } else {
        let capacity = (trace.peak_live_bytes.div_ceil(scale).saturating_mul(2)).min(u64::from(u32::MAX)) as u32;
        let mut al =
            offset_allocator::Allocator::<u32>::with_max_allocs(capacity, (trace.slots + 1024).min(u32::MAX - 2));
        let mut slots: Vec<Option<offset_allocator::Allocation<u32>>> = vec![None; trace.slots as usize];
        for _ in 0..passes {
            for op in &ops {
                match *op {
                    Op::Alloc { slot, bytes, .. } => {
                        if let Some(x) = al.allocate(bytes as u32) {
                            slots[slot as usize] = Some(x);
                        }
                    }
                    Op::Free { slot } => {
                        if let Some(b) = slots[slot as usize].take() {
                            al.free(b);
                        }
                    }
                }
            }
            for b in slots.iter_mut().filter_map(Option::take) {
                al.free(b);
            }
        }
    }
    eprintln!("{} ns/op", t.elapsed().as_nanos() as f64 / (passes * ops.len()) as f64);
}
