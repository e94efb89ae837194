//! The `umm` command line: `umm replay` replays allocation traces through umm's pools and reports memory and
//! time per op; `umm devices` lists every device; `umm snapshot` replays a trace with the profiler on and writes
//! a snapshot; `umm plot` draws a snapshot or a trace as a timeline SVG; `umm plan` computes an offline reuse
//! plan for a trace and compares it with the lower bound and with what the pool reserved.

#[path = "umm/args.rs"]
mod args;

use args::{Cli, Command, DevicesArgs, PlanArgs, PlotArgs, ReplayArgs, SnapshotArgs};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use umm::observe;
use umm::plot::{PlotOptions, Timeline};
use umm::replay::{self, human_bytes, ReplayOptions, ReplayReport};
use umm::trace::Trace;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => replay_command(&args),
        Command::Devices(args) => report(devices_command(&args)),
        Command::Snapshot(args) => report(snapshot_command(&args)),
        Command::Plot(args) => report(plot_command(&args)),
        Command::Plan(args) => plan_command(&args),
    }
}

fn report(result: Result<(), umm::Error>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn devices_command(args: &DevicesArgs) -> Result<(), umm::Error> {
    let mut builder = umm::UniversalMemoryManager::builder().from_env();
    for &capacity in &args.simulated {
        builder = builder.simulated_device(capacity);
    }
    let table = builder.build()?.device_table();
    if args.json {
        let json = serde_json::to_string_pretty(&table)
            .map_err(|source| umm::Error::Json { what: "devices".into(), source })?;
        println!("{json}");
    } else {
        print!("{table}");
    }
    Ok(())
}

fn snapshot_command(args: &SnapshotArgs) -> Result<(), umm::Error> {
    let trace = Trace::load(&args.trace)?;
    let capacity = args.capacity.unwrap_or(replay::SIM_CAPACITY);
    let (snapshot, ooms) = observe::snapshot_trace(&trace, capacity, args.limit, args.at)?;
    snapshot.save(&args.output)?;
    let segments: usize = snapshot.pools.iter().map(|p| p.segments.len()).sum();
    println!(
        "{}: {} ops replayed on a simulated {} device; snapshot at the {} ({} segments, {} live, {} events{}) \
         written to {}",
        trace.name,
        trace.ops.len(),
        human_bytes(capacity),
        args.at,
        segments,
        human_bytes(snapshot.live_bytes()),
        snapshot.events.len(),
        if ooms > 0 { format!(", {ooms} allocations out of memory") } else { String::new() },
        args.output.display()
    );
    Ok(())
}

fn plot_command(args: &PlotArgs) -> Result<(), umm::Error> {
    let timeline = Timeline::load(&args.input)?;
    let options = PlotOptions { width: args.width, panel_height: args.height, max_shapes: args.max_shapes };
    umm::plot::write_svg(&timeline, &options, &args.output)?;
    for panel in &timeline.panels {
        let (step, bytes) = panel.peak();
        println!(
            "{}: {} allocations, peak {} at {} {step}",
            panel.name,
            panel.spans.len(),
            human_bytes(bytes),
            timeline.step_name
        );
    }
    println!("wrote {}", args.output.display());
    Ok(())
}

/// Plans each trace, replays it on the simulated device for the pool's reserved peak, and prints a table or one
/// JSON object per trace. A trace that fails is reported (naming the file) and the others still run.
fn plan_command(args: &PlanArgs) -> ExitCode {
    let mut rows = Vec::new();
    let mut failed = false;
    for path in &args.traces {
        let result = Trace::load(path).map_err(|e| e.to_string()).and_then(|trace| {
            let (plan, mut report) =
                umm::plan::plan_trace(&trace, args.alignment).map_err(|e| format!("{}: {e}", path.display()))?;
            let replayed = replay::replay_on("sim", &trace, ReplayOptions::default()).map_err(|e| e.to_string())?;
            report.pool_reserved_bytes = Some(replayed.peak_reserved_bytes);
            Ok((plan.heuristic, report))
        });
        match result {
            Ok((_, report)) if args.json => {
                let line = serde_json::to_string(&report).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
                let mut out = std::io::stdout().lock();
                if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                    return ExitCode::FAILURE;
                }
            }
            Ok((heuristic, report)) => rows.push([
                report.trace.clone(),
                human_bytes(report.lower_bound_bytes),
                human_bytes(report.plan_peak_bytes),
                format!("{:.4}", report.plan_over_lower_bound),
                report.pool_reserved_bytes.map_or_else(String::new, human_bytes),
                report
                    .pool_reserved_bytes
                    .map_or_else(String::new, |r| format!("{:.4}", r as f64 / report.lower_bound_bytes.max(1) as f64)),
                format!("{:.1}", report.planning_ms),
                heuristic.to_string(),
            ]),
            Err(message) => {
                eprintln!("error: {message}");
                failed = true;
            }
        }
    }
    if !rows.is_empty() {
        println!(
            "alignment {} B; pool reserved: umm's pool replaying the trace on the simulated device",
            args.alignment
        );
        let header = [
            "trace",
            "lower bound",
            "plan peak",
            "plan/lower",
            "pool reserved",
            "reserved/lower",
            "plan ms",
            "heuristic",
        ];
        print_rows(&header, &rows);
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
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
                steps: args.steps,
                ..ReplayOptions::default()
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

/// Bytes the host can give without swapping.
fn available_host_memory() -> Option<u64> {
    umm::backends::host_memory().map(|(_, available)| available).filter(|&bytes| bytes > 0)
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
        "last pass",
        "steps planned",
        "ns/op cold",
        "ns/op warm",
        "device allocs",
        "warm device calls",
        "retries",
        "ooms",
    ];
    let rows: Vec<[String; 13]> = reports
        .iter()
        .map(|r| {
            [
                r.trace.clone(),
                r.ops.to_string(),
                human_bytes(r.peak_live_bytes),
                human_bytes(r.peak_reserved_bytes),
                format!("{:.3}", r.reserved_over_live),
                format!("{:.3}", r.peak_reserved_bytes_last as f64 / r.peak_live_bytes.max(1) as f64),
                format!("{}/{}", r.steps_planned, r.steps),
                format!("{:.1}", r.ns_per_op_cold),
                format!("{:.1}", r.ns_per_op_warm),
                r.device_allocs.to_string(),
                r.warm_device_calls.to_string(),
                r.oom_retries.to_string(),
                r.ooms.to_string(),
            ]
        })
        .collect();
    print_rows(&header, &rows);
}

/// Prints a table: the first column left-aligned, the others right-aligned, each as wide as its widest cell.
fn print_rows<const N: usize>(header: &[&str; N], rows: &[[String; N]]) {
    let mut widths = header.map(str::len);
    for row in rows {
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
    line(header);
    for row in rows {
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
