//! Replays one trace through the bare engine or through offset-allocator, with the loops of `benches/replay.rs`:
//! for instruction counts (run it under `valgrind --tool=cachegrind` with 1 and with 4 passes; the difference over
//! 3 passes and the trace's ops is the cost of one warm op) and for timings that this shared machine trusts more
//! than criterion's back-to-back ones: `both` alternates the two in one process, pass by pass, and prints the
//! fastest pass of each, so drift and noisy neighbours hit both alike.
//!
//! `cargo run --release --example engine_vs_offset -- TRACE engine|offset|both PASSES`

#[path = "../benches/loops/mod.rs"]
mod loops;

use umm::trace::Trace;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 4 || !matches!(a[2].as_str(), "engine" | "offset" | "both") {
        eprintln!("usage: engine_vs_offset TRACE engine|offset|both PASSES");
        std::process::exit(2);
    }
    let trace = Trace::load(std::path::Path::new(&a[1])).unwrap_or_else(|e| panic!("{}: {e}", a[1]));
    let passes: usize = a[3].parse().expect("PASSES is a number");
    let scale = loops::scale_for(&trace);
    let ops = loops::scaled(&trace, scale);
    let per_op = |d: std::time::Duration| d.as_nanos() as f64 / ops.len() as f64;

    let (run_engine, run_offset) = (a[2] != "offset", a[2] != "engine");
    // Only what runs is built, so a single-allocator run under cachegrind counts nothing of the other.
    let mut engine = run_engine.then(|| loops::engine_for(scale));
    let mut engine_slots = vec![None; if run_engine { trace.slots as usize } else { 0 }];
    let mut allocator = run_offset.then(|| loops::offset_allocator_for(&trace, scale));
    let mut offset_slots = vec![None; if run_offset { trace.slots as usize } else { 0 }];
    let mut failures = 0;
    let (mut engine_best, mut offset_best) = (f64::MAX, f64::MAX);
    let (mut engine_total, mut offset_total) = (0.0, 0.0);
    for pass in 0..passes {
        // Alternate which goes first, so neither always runs on the other's leftovers.
        for turn in [pass % 2 == 0, pass % 2 == 1] {
            if let (true, Some(engine)) = (turn, engine.as_mut()) {
                let t = per_op(loops::engine_pass(engine, &ops, &mut engine_slots, scale));
                (engine_best, engine_total) = (engine_best.min(t), engine_total + t);
            } else if let (false, Some(allocator)) = (turn, allocator.as_mut()) {
                let t = per_op(loops::offset_pass(allocator, &ops, &mut offset_slots, &mut failures));
                (offset_best, offset_total) = (offset_best.min(t), offset_total + t);
            }
        }
    }
    if failures > 0 {
        eprintln!("offset_allocator failed {failures} allocations");
    }
    let n = passes as f64;
    if run_engine {
        eprintln!("engine: {:.2} ns/op mean, {engine_best:.2} fastest pass", engine_total / n);
    }
    if run_offset {
        eprintln!("offset: {:.2} ns/op mean, {offset_best:.2} fastest pass", offset_total / n);
    }
    if run_engine && run_offset {
        eprintln!("engine/offset (fastest passes): {:.3}", engine_best / offset_best);
    }
}
