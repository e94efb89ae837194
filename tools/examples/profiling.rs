//! Seeing the memory: turn the profiler on, allocate with labels, then write a snapshot (segments, blocks with
//! labels and call sites, events) and a timeline plot, and print the leak report.
//!
//! `cargo run --release --example profiling` writes `profiling_snapshot.json` and `profiling_timeline.svg` in
//! `umm-profiling` under the system's temporary directory (or in the directory given as the first argument), and
//! prints their paths.

use std::path::{Path, PathBuf};
use umm::{AllocOptions, DeviceSelector, Placement, UniversalMemoryManager};
use umm_tools::plot::{PlotOptions, Timeline};

#[allow(dead_code)] // a test includes this file for `default_dir` and `run`
fn main() -> Result<(), umm::Error> {
    let out = std::env::args().nth(1).map_or_else(default_dir, PathBuf::from);
    run(&out)
}

/// Where the files go when no directory is given: not the current directory, which is usually a checkout's root,
/// where files left behind get committed by mistake.
pub fn default_dir() -> PathBuf {
    std::env::temp_dir().join("umm-profiling")
}

/// Runs the toy loop and writes the snapshot and the timeline into `out` (created if missing).
pub fn run(out: &Path) -> Result<(), umm::Error> {
    std::fs::create_dir_all(out).map_err(|source| umm::Error::Io { path: out.display().to_string(), source })?;
    // A simulated 8 GiB device stands in for a GPU, so the example runs anywhere; real devices are used too.
    let mm = UniversalMemoryManager::builder().from_env().simulated_device(8 << 30).profile(true).build()?;
    let gpu = mm.devices().len() - 1;
    let on_gpu = |label: &str| {
        AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(gpu)).label(label)
    };

    // A toy training loop: weights live throughout; activations pile up in the forward pass and go in the
    // backward pass; gradients appear at the end of each step.
    let weights = mm.allocate_universal_with::<f32>(64 << 20, on_gpu("weights"))?;
    let host = AllocOptions::new().device(DeviceSelector::Host).label("host staging");
    let mut staging = mm.allocate_universal_with::<u8>(1 << 20, host)?;
    staging.fill(0)?;
    for _step in 0..3 {
        let mut activations = Vec::new();
        for layer in 0..8 {
            activations.push(mm.allocate_universal_with::<f32>((16 + 4 * layer) << 20, on_gpu("activation"))?);
        }
        while let Some(a) = activations.pop() {
            let scratch = mm.allocate_universal_with::<f32>(8 << 20, on_gpu("scratch"))?;
            drop((a, scratch));
        }
        let _gradients = mm.allocate_universal_with::<f32>(64 << 20, on_gpu("gradients"))?;
    }
    // Something kept alive by mistake: the leak report names it with its line.
    let forgotten = mm.allocate_universal_with::<f32>(10 << 20, on_gpu("forgotten cache"))?;

    let snapshot = mm.snapshot();
    let snapshot_path = out.join("profiling_snapshot.json");
    snapshot.save(&snapshot_path)?;
    let timeline = Timeline::from_snapshot(&snapshot, "profiling example")?;
    let svg_path = out.join("profiling_timeline.svg");
    umm_tools::plot::write_svg(&timeline, &PlotOptions::default(), &svg_path)?;
    println!(
        "{} events recorded; snapshot: {}; timeline: {}",
        snapshot.events.len(),
        snapshot_path.display(),
        svg_path.display()
    );
    println!("\nlive now: {}", mm.leak_report());
    drop((weights, staging, forgotten));
    Ok(())
}
