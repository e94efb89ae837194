//! Plans a small training-like step ahead of time and serves it from one block of host memory.
//!
//! `cargo run --example plan`: records which tensors each step of a toy forward/backward pass uses, computes
//! a reuse plan, then runs the step five times through a `PlannedArena` (the fifth with a longer sequence, so
//! its activations deviate from the plan and come from the pool).

use std::sync::Arc;
use umm::backends::{HostBackend, MemoryPool, Pool, PoolConfig, StreamId};
use umm_tools::plan::{LifetimeAnalyzer, PlannedArena};

/// The sizes a toy two-layer step allocates, in order, and when each is freed (index of the allocation after
/// which it goes). Activations live until the backward pass reaches their layer.
fn step(seq: u64) -> Vec<(u64, usize)> {
    let act = 4096 * seq;
    vec![
        (act, 5),     // 0: input
        (act, 4),     // 1: layer 1 activation
        (act, 3),     // 2: layer 2 activation
        (act * 2, 4), // 3: scores, freed after the layer 2 gradient
        (act, 5),     // 4: layer 2 gradient
        (act, 5),     // 5: layer 1 gradient
    ]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Learn the lifetimes: at each point of the step, which tensors are in use.
    let plan_step = step(128);
    let mut analyzer = LifetimeAnalyzer::new();
    for t in 0..plan_step.len() {
        let live: Vec<(u64, u64)> = plan_step
            .iter()
            .enumerate()
            .filter(|&(i, &(_, freed_after))| i <= t && t <= freed_after)
            .map(|(i, &(bytes, _))| (i as u64, bytes))
            .collect();
        analyzer.record_usage(t as u64, &live)?;
    }
    let plan = analyzer.compute_reuse_plan();
    plan.verify()?;
    println!(
        "plan: {} tensors, {} bytes without reuse, {} with the plan ({}), lower bound {}",
        plan.allocations.len(),
        analyzer.total_bytes(),
        plan.peak_bytes,
        plan.heuristic,
        plan.lower_bound_bytes
    );

    // Serve the step from one block of the plan's size.
    let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(HostBackend::new("host", 1 << 30), PoolConfig::default())?);
    let mut arena = PlannedArena::new(&plan, pool, StreamId(0))?;
    for (i, seq) in [128, 128, 128, 128, 192].into_iter().enumerate() {
        arena.begin_step();
        let sizes = step(seq);
        let mut live = Vec::new();
        for (t, &(bytes, _)) in sizes.iter().enumerate() {
            let mut block = arena.allocate(bytes)?;
            arena.fill(&mut block, 0, bytes, t as u8)?;
            live.push(Some(block));
            // Free what the step is done with after this allocation.
            for (j, &(_, freed_after)) in sizes.iter().enumerate() {
                if freed_after == t {
                    if let Some(block) = live[j].take() {
                        let mut first = [0u8; 1];
                        arena.read(&block, 0, &mut first)?;
                        assert_eq!(first[0], j as u8, "tensor {j} kept its bytes");
                        arena.free(block)?;
                    }
                }
            }
        }
        let stats = arena.stats();
        println!("step {i} (seq {seq}): {} planned, {} from the pool so far", stats.planned_hits, stats.fallbacks);
    }
    Ok(())
}
