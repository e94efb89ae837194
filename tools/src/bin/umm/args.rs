//! The `umm` tool's command line, as clap parses it. A module of its own so that tests parse arguments in
//! process (`tests/fuzz_cli.rs` includes it) exactly as the tool does.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use umm::backends::Limit;
use umm::observe::SnapshotAt;
use umm_tools::plot::PlotOptions;
use umm_tools::replay;

#[derive(Debug, Parser)]
#[command(name = "umm", version, about = "umm: a universal memory manager for accelerators")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Replay allocation traces (umm-trace v1, plain or gzip, or PyTorch memory snapshots) through a pool and
    /// report memory and time per op.
    Replay(ReplayArgs),
    /// List every device with its APIs, memory, limits and pool usage (nvidia-smi and clinfo in one table).
    Devices(DevicesArgs),
    /// Replay a trace on a simulated device with the profiler on and write a snapshot (segments, blocks, events).
    Snapshot(SnapshotArgs),
    /// Draw a snapshot (JSON) or a trace as a timeline of live memory per device: a self-contained SVG.
    Plot(PlotArgs),
    /// Plan every allocation of a trace at a fixed offset (lifetimes known ahead) and compare the plan's peak with
    /// the lower bound (most bytes live at once) and with what umm's pool reserved replaying it.
    Plan(PlanArgs),
}

#[derive(Debug, Args)]
pub(crate) struct PlanArgs {
    /// Print one JSON object per trace (one per line) instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Alignment of planned sizes and offsets in bytes (a power of two).
    #[arg(long, default_value_t = umm_tools::plan::DEFAULT_ALIGNMENT, value_parser = power_of_two)]
    pub(crate) alignment: u64,
    /// For a PyTorch memory snapshot: the device whose trace to plan (default: the one with the most events).
    #[arg(long, value_parser = whole::<usize>)]
    pub(crate) device: Option<usize>,
    /// Trace files: umm-trace v1 (plain or gzip) or PyTorch memory snapshots (torch.cuda.memory._dump_snapshot's
    /// pickle, told by its first bytes or a .pickle or .pkl name).
    #[arg(required = true)]
    pub(crate) traces: Vec<PathBuf>,
}

#[derive(Debug, Args)]
pub(crate) struct DevicesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Add a simulated device of this capacity (repeatable), as UMM's tests and replays do.
    #[arg(long = "sim", value_parser = replay::parse_capacity)]
    pub(crate) simulated: Vec<u64>,
}

#[derive(Debug, Args)]
pub(crate) struct SnapshotArgs {
    /// The trace (umm-trace v1, plain or gzip).
    pub(crate) trace: PathBuf,
    /// Where to write the snapshot JSON.
    #[arg(short, long, default_value = "snapshot.json")]
    pub(crate) output: PathBuf,
    /// Capacity of the simulated device (default 80GiB, an H100).
    #[arg(long, value_parser = replay::parse_capacity)]
    pub(crate) capacity: Option<u64>,
    /// Cap on the pool's reserved memory: a size with a unit (2GiB, 1.5GB, 1048576B) or a percentage of the
    /// device (90%).
    #[arg(long, value_parser = replay::parse_limit)]
    pub(crate) limit: Option<Limit>,
    /// When to take the snapshot: `end` (after the last op) or `peak` (when live bytes first reach the peak).
    #[arg(long, default_value = "end")]
    pub(crate) at: SnapshotAt,
}

#[derive(Debug, Args)]
pub(crate) struct PlotArgs {
    /// A snapshot (JSON, from `umm snapshot` or `mm.snapshot()`) or a trace.
    pub(crate) input: PathBuf,
    /// Where to write the SVG.
    #[arg(short, long, default_value = "timeline.svg")]
    pub(crate) output: PathBuf,
    /// Width in pixels.
    #[arg(long, default_value_t = PlotOptions::default().width, value_parser = pixels)]
    pub(crate) width: u32,
    /// Height of each device's panel in pixels.
    #[arg(long, default_value_t = PlotOptions::default().panel_height, value_parser = pixels)]
    pub(crate) height: u32,
    /// Allocations drawn as bands of their own (the largest); smaller ones are merged into one grey band.
    #[arg(long, default_value_t = PlotOptions::default().max_shapes, value_parser = whole::<usize>)]
    pub(crate) max_shapes: usize,
}

#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// Backend to replay on: sim (simulated device with virtual memory, like CUDA), sim-plain (segments only,
    /// like OpenCL), sim-wgpu (a segment per block, like wgpu), host (this machine's memory), or cuda, opencl, wgpu where built in (the first
    /// device found; UMM_REPLAY_DEVICE=N picks another).
    #[arg(long, default_value = "sim")]
    pub(crate) backend: String,
    /// Cap on the pool's reserved memory: a size with a unit (2GiB, 1.5GB, 1048576B) or a percentage of the
    /// device (90%).
    #[arg(long, value_parser = replay::parse_limit)]
    pub(crate) limit: Option<Limit>,
    /// Warm replays after the cold one; ns/op warm is their median (a dash with 0).
    #[arg(long, default_value_t = 5, value_parser = whole::<usize>)]
    pub(crate) repeat: usize,
    /// Device capacity, as a size: for sim, sim-plain and sim-wgpu (default 80GiB, an H100), and for host (default the
    /// memory available now, MemAvailable).
    #[arg(long, value_parser = replay::parse_capacity)]
    pub(crate) capacity: Option<u64>,
    /// Where steps end, so that a repeating step is served from a plan: trace (the trace's `s` lines, recorded
    /// by umm_mark_step or UniversalMemoryManager::mark_step), pass (the whole trace is one step: for traces of
    /// one step recorded without marks) or off.
    #[arg(long, default_value = "trace", value_parser = |s: &str| s.parse::<replay::StepMarks>())]
    pub(crate) steps: replay::StepMarks,
    /// Print one JSON object per trace (one per line) instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Exit with success even when allocations of a replay ran out of memory (counted in `ooms`): by default
    /// that is a failure, since the replay did not reach the trace's peak.
    #[arg(long)]
    pub(crate) allow_oom: bool,
    /// For a PyTorch memory snapshot: the device whose trace to replay (default: the one with the most events).
    #[arg(long, value_parser = whole::<usize>)]
    pub(crate) device: Option<usize>,
    /// Also write the trace replayed as umm-trace v1 (gzip-compressed when the name ends in .gz): a PyTorch
    /// snapshot's converted trace, kept for later replays and plans. Takes one input.
    #[arg(long, value_name = "PATH")]
    pub(crate) save_trace: Option<PathBuf>,
    /// Trace files: umm-trace v1 (plain or gzip) or PyTorch memory snapshots (torch.cuda.memory._dump_snapshot's
    /// pickle, told by its first bytes or a .pickle or .pkl name).
    #[arg(required = true)]
    pub(crate) traces: Vec<PathBuf>,
}

/// A whole number for a count or a size in pixels. clap's own parser says `invalid digit found in string`; this
/// says what the text is and what is expected.
fn whole<T: std::str::FromStr + std::fmt::Display + num_max::Max>(text: &str) -> Result<T, String> {
    let t = text.trim();
    t.parse::<T>().map_err(|_| {
        if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
            format!("`{t}` is too large: expected a whole number up to {}", T::MAX)
        } else {
            format!("`{t}` is not a whole number: expected one such as 0, 5 or 1200")
        }
    })
}

/// A width or height of a plot in pixels: 1 to [`umm_tools::plot::MAX_PIXELS`].
fn pixels(text: &str) -> Result<u32, String> {
    let max = umm_tools::plot::MAX_PIXELS;
    match whole::<u32>(text) {
        Ok(pixels @ 1..) if pixels <= max => Ok(pixels),
        Ok(_) => Err(format!("`{}` is outside 1 to {max} pixels: expected a size such as 1200", text.trim())),
        Err(_) if text.trim().bytes().all(|b| b.is_ascii_digit()) && !text.trim().is_empty() => {
            Err(format!("`{}` is outside 1 to {max} pixels: expected a size such as 1200", text.trim()))
        }
        Err(e) => Err(e),
    }
}

/// A plan's alignment: a power of two of bytes.
fn power_of_two(text: &str) -> Result<u64, String> {
    let bytes = whole::<u64>(text)?;
    if bytes.is_power_of_two() {
        Ok(bytes)
    } else {
        Err(format!("`{}` is not a power of two: expected one such as 256, 512 or 4096", text.trim()))
    }
}

/// The largest value of the integer types [`whole`] reads, for its message.
mod num_max {
    pub trait Max {
        const MAX: Self;
    }
    impl Max for u32 {
        const MAX: Self = u32::MAX;
    }
    impl Max for u64 {
        const MAX: Self = u64::MAX;
    }
    impl Max for usize {
        const MAX: Self = usize::MAX;
    }
}
