//! Replays one trace through the bare engine or through offset-allocator, with the loops of `benches/replay.rs`,
//! in a process of its own: for instruction counts (run it under `valgrind --tool=cachegrind` with 1 and with 4
//! passes; the difference over 3 passes and the trace's ops is the cost of one warm op) and for alternating
//! timings, which this shared machine needs more than criterion's back-to-back ones.
//!
//! `cargo run --release --example engine_vs_offset -- TRACE engine|offset PASSES`

#[path = "../benches/loops/mod.rs"]
mod loops;

use std::time::Duration;
use umm::trace::Trace;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 4 || !matches!(a[2].as_str(), "engine" | "offset") {
        eprintln!("usage: engine_vs_offset TRACE engine|offset PASSES");
        std::process::exit(2);
    }
    let trace = Trace::load(std::path::Path::new(&a[1])).unwrap_or_else(|e| panic!("{}: {e}", a[1]));
    let passes: usize = a[3].parse().expect("PASSES is a number");
    let scale = loops::scale_for(&trace);
    let ops = loops::scaled(&trace, scale);
    let elapsed: Duration = if a[2] == "engine" {
        let mut engine = loops::engine_for(scale);
        let mut slots = vec![None; trace.slots as usize];
        (0..passes).map(|_| loops::engine_pass(&mut engine, &ops, &mut slots, scale)).sum()
    } else {
        let mut allocator = loops::offset_allocator_for(&trace, scale);
        let mut slots = vec![None; trace.slots as usize];
        let mut failures = 0;
        let t = (0..passes).map(|_| loops::offset_pass(&mut allocator, &ops, &mut slots, &mut failures)).sum();
        if failures > 0 {
            eprintln!("offset_allocator failed {failures} allocations");
        }
        t
    };
    eprintln!("{} ns/op", elapsed.as_nanos() as f64 / (passes * ops.len()) as f64);
}
