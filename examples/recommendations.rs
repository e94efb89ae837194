//! Recommendations that follow the workload, and `Auto` and migration following them.
//!
//! Phase 1 keeps medium buffers (1 MiB) on the device: kernels use them, the host only fills them. Phase 2 reads
//! every buffer back to the host after each step: the tracker sees the host traffic and recommends pinned host
//! memory for medium buffers; `Auto` places new medium buffers there, and a buffer kept from phase 1 migrates to
//! the recommended placement. Phase 3 goes back to device-only use and the recommendation returns to device
//! memory. A cleanup round every 16 steps (what `start_periodic_cleanup` does) halves the weight of old
//! evidence, so the recommendations follow the current phase.
//!
//! The workload runs on the first accelerator (the host if there is none). Where that accelerator shares memory
//! with the host (an integrated GPU, PoCL, lavapipe), `Auto` prefers zero-copy pinned memory anyway, so `Auto` is
//! also shown for a simulated discrete GPU, where it moves between device-local and pinned memory.
//!
//! `cargo run --release --example recommendations`

use umm::{AllocOptions, DeviceKind, DeviceSelector, MigrateTo, Placement, Subject, UniversalMemoryManager};

const MEDIUM: usize = 1 << 18; // f32 elements: 1 MiB
const STEPS: usize = 64;

/// One step of a phase: a fresh medium buffer, filled, used by `kernels` kernels, read back `reads` times.
fn step(mm: &UniversalMemoryManager, on: &AllocOptions, kernels: usize, reads: usize) -> Result<(), umm::Error> {
    let mut x = mm.allocate_universal_with::<f32>(MEDIUM, on.clone())?;
    x.fill(1.0)?;
    for _ in 0..kernels {
        x.record_device_use();
    }
    for _ in 0..reads {
        let _ = x.to_vec()?;
    }
    Ok(())
}

fn phase(mm: &UniversalMemoryManager, on: &AllocOptions, kernels: usize, reads: usize) -> Result<(), umm::Error> {
    for i in 0..STEPS {
        step(mm, on, kernels, reads)?;
        if i % 16 == 15 {
            let _ = mm.cleanup();
        }
    }
    Ok(())
}

fn main() -> Result<(), umm::Error> {
    let mm = UniversalMemoryManager::builder().from_env().simulated_device(16 << 30).build()?;
    let sim = mm.devices().iter().find(|d| d.kind() == DeviceKind::Simulated).map(|d| d.index());
    let work = mm
        .devices()
        .iter()
        .find(|d| !matches!(d.kind(), DeviceKind::Host | DeviceKind::Simulated))
        .map_or(0, |d| d.index());
    println!("devices:");
    for device in mm.devices() {
        println!("  {device}");
    }
    println!("the workload runs on device {work}");
    let on = AllocOptions::new().device(DeviceSelector::Index(work));

    let show = |title: &str| report(&mm, title, work, sim);
    show("before any work (the decision table's defaults)");

    phase(&mm, &on, 8, 0)?;
    show("phase 1: medium buffers used by kernels only");
    let mut kept = mm.allocate_universal_with::<f32>(MEDIUM, on.clone().placement(Placement::DeviceLocal))?;
    kept.fill(2.0)?;
    println!("  kept one buffer in {} on device {}", kept.placement(), kept.device().index());

    phase(&mm, &on, 1, 4)?;
    let recommended = show("phase 2: medium buffers read back to the host every step");
    let kept = kept.migrate(&mm, MigrateTo::new(recommended).device(DeviceSelector::Index(work)))?;
    println!(
        "  the kept buffer follows the recommendation: now {} on device {} (moved via {}), contents intact: {}",
        kept.placement(),
        kept.device().index(),
        kept.migrated_via().map_or("-".into(), |p| p.to_string()),
        kept.to_vec()?.iter().all(|&v| v == 2.0)
    );

    phase(&mm, &on, 8, 0)?;
    show("phase 3: kernels only again");
    Ok(())
}

/// Prints the medium-buffer recommendation with its reason and evidence, and where `Auto` puts a new medium
/// buffer on the workload's device and on the simulated discrete GPU. Returns the recommended placement.
fn report(mm: &UniversalMemoryManager, title: &str, work: usize, sim: Option<usize>) -> Placement {
    let recs = mm.placement_recommendations(); // also refreshes the evidence Auto follows
    println!("\n{title}");
    let Some(r) = recs.items.iter().find(|r| r.subject == Subject::MediumBuffers) else { return Placement::Auto };
    let e = &r.evidence;
    println!(
        "  recommendation for {}: {} ({})\n    why: {}\n    evidence: {:.0} buffers, {} host reads, {} host writes, \
         {} device uses",
        r.subject,
        r.placement,
        if r.from_evidence { "learnt" } else { "table default" },
        r.reason,
        e.buffers,
        e.host_reads,
        e.host_writes,
        e.device_uses,
    );
    for (what, device) in [("the workload's device", Some(work)), ("a discrete GPU (simulated)", sim)] {
        let Some(device) = device else { continue };
        let options = AllocOptions::new().device(DeviceSelector::Index(device));
        match mm.decide(MEDIUM as u64 * 4, &options) {
            Ok(d) => println!("  Auto on {what}: {} on device {}\n    why: {}", d.pool, d.device, d.reason()),
            Err(e) => println!("  Auto on {what}: cannot place a 1 MiB buffer: {e}"),
        }
    }
    r.placement
}
