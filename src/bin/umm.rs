//! The `umm` command line: `umm replay` replays allocation traces through umm's pools and reports memory and
//! time per op. Structured as subcommands so that others (`devices`, `snapshot`, `plot`) slot in beside it.

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use umm::backends::Limit;
use umm::replay::{self, human_bytes, ReplayOptions, ReplayReport};
use umm::trace::Trace;

#[derive(Parser)]
#[command(name = "umm", version, about = "umm: a universal memory manager for accelerators")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay allocation traces (umm-trace v1, plain or gzip) through a pool and report memory and time per op.
    Replay(ReplayArgs),
}

#[derive(Args)]
struct ReplayArgs {
    /// Backend to replay on: sim (simulated device with virtual memory, like CUDA), sim-plain (segments only,
    /// like OpenCL and wgpu) or host (this machine's memory).
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Cap on the pool's reserved memory: a size (2GiB, 1.5GB, 1048576) or a fraction of the device (0.9).
    #[arg(long, value_parser = replay::parse_limit)]
    limit: Option<Limit>,
    /// Warm replays after the cold one; ns/op warm is their median.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Device capacity, as a size: for sim and sim-plain (default 80GiB, an H100), and for host (default the
    /// memory available now, MemAvailable).
    #[arg(long, value_parser = replay::parse_size)]
    capacity: Option<u64>,
    /// Print one JSON object per trace (one per line) instead of a table.
    #[arg(long)]
    json: bool,
    /// Trace files.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => replay_command(&args),
    }
}

fn replay_command(args: &ReplayArgs) -> ExitCode {
    if !replay::BACKENDS.contains(&args.backend.as_str()) {
        eprintln!("error: unknown backend `{}`; available: {}", args.backend, replay::BACKENDS.join(", "));
        return ExitCode::FAILURE;
    }
    let host_capacity = match (args.backend.as_str(), args.capacity) {
        ("host", None) => match available_host_memory() {
            Some(bytes) => Some(bytes),
            None => {
                eprintln!("error: cannot read the available host memory; pass it with --capacity");
                return ExitCode::FAILURE;
            }
        },
        (_, capacity) => capacity,
    };
    let mut reports = Vec::new();
    let mut failed = false;
    for path in &args.traces {
        let result = Trace::load(path).map_err(|e| e.to_string()).and_then(|trace| {
            let mut bar = Progress::new(&trace.name);
            let mut progress = |done, total| bar.update(done, total);
            let opts = ReplayOptions {
                repeat: args.repeat,
                limit: args.limit,
                sim_capacity: args.capacity,
                host_capacity,
                progress: Some(&mut progress),
            };
            let report = replay::replay_on(&args.backend, &trace, opts).map_err(|e| e.to_string());
            bar.finish();
            report
        });
        match result {
            Ok(report) if args.json => {
                let line = serde_json::to_string(&report).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
                let mut out = std::io::stdout().lock();
                if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                    return ExitCode::FAILURE;
                }
            }
            Ok(report) => reports.push(report),
            Err(message) => {
                eprintln!("error: {message}");
                failed = true;
            }
        }
    }
    if !args.json && !reports.is_empty() {
        print_table(&reports, args);
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Bytes the host can give without swapping: `MemAvailable` from /proc/meminfo, else sysinfo's figure.
fn available_host_memory() -> Option<u64> {
    let from_proc = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    });
    from_proc.or_else(|| {
        let mut system = sysinfo::System::new().ok()?;
        system.refresh_memory();
        Some(system.available_memory()).filter(|&bytes| bytes > 0)
    })
}

fn print_table(reports: &[ReplayReport], args: &ReplayArgs) {
    let first = &reports[0];
    let limit = first.limit_bytes.map_or_else(|| "none".to_string(), human_bytes);
    println!("backend {} ({}), limit {limit}, {} warm replays", first.backend, first.device, args.repeat);
    let header = [
        "trace",
        "ops",
        "peak live",
        "peak reserved",
        "reserved/live",
        "ns/op cold",
        "ns/op warm",
        "device allocs",
        "retries",
        "ooms",
    ];
    let rows: Vec<[String; 10]> = reports
        .iter()
        .map(|r| {
            [
                r.trace.clone(),
                r.ops.to_string(),
                human_bytes(r.peak_live_bytes),
                human_bytes(r.peak_reserved_bytes),
                format!("{:.3}", r.reserved_over_live),
                format!("{:.1}", r.ns_per_op_cold),
                format!("{:.1}", r.ns_per_op_warm),
                r.device_allocs.to_string(),
                r.oom_retries.to_string(),
                r.ooms.to_string(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: &[&str]| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 0 {
                text.push_str(&format!("{cell:<w$}"));
            } else {
                text.push_str(&format!("  {cell:>w$}"));
            }
        }
        println!("{}", text.trim_end());
    };
    line(&header);
    for row in &rows {
        line(&row.each_ref().map(String::as_str));
    }
}

/// A progress bar on stderr that appears only when stderr is a terminal and the replay runs longer than half a
/// second.
struct Progress {
    bar: Option<ProgressBar>,
    start: Instant,
    shown: bool,
}

impl Progress {
    const DELAY: Duration = Duration::from_millis(500);

    fn new(name: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
            let style = ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} ops ({eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style.progress_chars("=> "));
            bar.set_prefix(name.to_string());
            bar
        });
        Self { bar, start: Instant::now(), shown: false }
    }

    fn update(&mut self, done: u64, total: u64) {
        let Some(bar) = &self.bar else { return };
        if !self.shown && self.start.elapsed() >= Self::DELAY {
            bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
        bar.set_length(total);
        bar.set_position(done);
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
