//! The `umm` command line: `umm replay` replays allocation traces through umm's pools and reports memory and
//! time per op; `umm devices` lists every device; `umm snapshot` replays a trace with the profiler on and writes
//! a snapshot; `umm plot` draws a snapshot or a trace as a timeline SVG; `umm plan` computes an offline reuse
//! plan for a trace and compares it with the lower bound and with what the pool reserved. `umm replay` and
//! `umm plan` also take PyTorch memory snapshots, converted to traces, and set PyTorch's own figures beside umm's.

#[path = "umm/args.rs"]
mod args;

use args::{Cli, Command, DevicesArgs, PlanArgs, PlotArgs, ReplayArgs, SnapshotArgs};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use umm::observe;
use umm::trace::Trace;
use umm_tools::plot::{PlotOptions, Timeline};
use umm_tools::replay::{self, human_bytes, ReplayOptions, ReplayReport};
use umm_tools::torch_snapshot::{self, SnapshotFigures, TorchSnapshot};

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
    let table = umm_tools::DeviceTable::of(&builder.build()?);
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
    umm_tools::plot::write_svg(&timeline, &options, &args.output)?;
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

/// An input of `umm replay` or `umm plan`: an umm trace, or one device of a PyTorch memory snapshot converted
/// to a trace.
struct Input {
    trace: Trace,
    torch: Option<TorchInput>,
}

/// Where a converted trace came from, and PyTorch's figures for it.
struct TorchInput {
    file: String,
    figures: SnapshotFigures,
    /// Whether the device was chosen as the one with the most events (no `--device`).
    busiest: bool,
}

/// Loads `path`: a PyTorch snapshot (by its first bytes or name) is converted, taking `device`'s trace or else
/// the busiest device's.
fn load_input(path: &Path, device: Option<usize>) -> Result<Input, String> {
    if !torch_snapshot::is_snapshot_file(path) {
        return Trace::load(path).map(|trace| Input { trace, torch: None }).map_err(|e| e.to_string());
    }
    let snapshot = TorchSnapshot::read(path).map_err(|e| e.to_string())?;
    let chosen = device.or_else(|| snapshot.busiest_device()).unwrap_or(0);
    let converted = snapshot.convert(chosen).map_err(|e| e.to_string())?;
    let torch = TorchInput { file: path.display().to_string(), figures: converted.figures, busiest: device.is_none() };
    Ok(Input { trace: converted.trace, torch: Some(torch) })
}

/// A report of a converted snapshot in JSON: the report's fields, then `source` and PyTorch's figures, each
/// named `torch_...`.
#[derive(Serialize)]
struct WithTorch<'a, R: Serialize> {
    #[serde(flatten)]
    report: &'a R,
    source: &'static str,
    torch_snapshot: &'a str,
    /// Whether the device was chosen as the one with the most events.
    torch_device_busiest: bool,
    #[serde(flatten)]
    figures: serde_json::Map<String, serde_json::Value>,
    torch_reserved_over_allocated: f64,
}

/// One JSON line: `report`'s fields, with PyTorch's for a converted snapshot.
fn json_line(report: &impl Serialize, torch: Option<&TorchInput>) -> String {
    let json = match torch {
        None => serde_json::to_string(report),
        Some(torch) => serde_json::to_value(&torch.figures).and_then(|figures| {
            let figures = match figures {
                serde_json::Value::Object(fields) => fields
                    .into_iter()
                    .map(|(key, value)| (if key.starts_with("torch_") { key } else { format!("torch_{key}") }, value))
                    .collect(),
                _ => serde_json::Map::new(),
            };
            serde_json::to_string(&WithTorch {
                report,
                source: "pytorch-snapshot",
                torch_snapshot: &torch.file,
                torch_device_busiest: torch.busiest,
                figures,
                torch_reserved_over_allocated: torch.figures.torch_reserved_over_allocated(),
            })
        }),
    };
    json.unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// Writes `line` to stdout; false when stdout is gone.
fn print_line(line: &str) -> bool {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}

/// Plans each trace, replays it on the simulated device for the pool's reserved peak, and prints a table or one
/// JSON object per trace. A trace that fails is reported (naming the file) and the others still run.
fn plan_command(args: &PlanArgs) -> ExitCode {
    let mut rows = Vec::new();
    let mut failed = false;
    let mut any_snapshot = false;
    for path in &args.traces {
        let result = load_input(path, args.device).and_then(|input| {
            let trace = &input.trace;
            let (plan, mut report) =
                umm_tools::plan::plan_trace(trace, args.alignment).map_err(|e| format!("{}: {e}", path.display()))?;
            let replayed = replay::replay_on("sim", trace, ReplayOptions::default()).map_err(|e| e.to_string())?;
            report.pool_reserved_bytes = Some(replayed.peak_reserved_bytes);
            Ok((plan.heuristic, report, input.torch))
        });
        match result {
            Ok((_, report, torch)) if args.json => {
                if !print_line(&json_line(&report, torch.as_ref())) {
                    return ExitCode::FAILURE;
                }
            }
            Ok((heuristic, report, torch)) => {
                let bound = report.lower_bound_bytes.max(1) as f64;
                any_snapshot |= torch.is_some();
                let torch_reserved = torch.as_ref().map(|t| t.figures.torch_peak_reserved_bytes);
                rows.push(vec![
                    report.trace.clone(),
                    human_bytes(report.lower_bound_bytes),
                    human_bytes(report.plan_peak_bytes),
                    format!("{:.4}", report.plan_over_lower_bound),
                    report.pool_reserved_bytes.map_or_else(String::new, human_bytes),
                    report.pool_reserved_bytes.map_or_else(String::new, |r| format!("{:.4}", r as f64 / bound)),
                    format!("{:.1}", report.planning_ms),
                    heuristic.to_string(),
                    torch_reserved.map_or_else(String::new, human_bytes),
                    torch_reserved.map_or_else(String::new, |r| format!("{:.4}", r as f64 / bound)),
                ]);
            }
            Err(message) => {
                eprintln!("error: {message}");
                failed = true;
            }
        }
    }
    if !rows.is_empty() {
        println!(
            "alignment {} B; pool reserved: umm's pool replaying the trace on the simulated device{}",
            args.alignment,
            if any_snapshot { "; PyTorch reserved: the most PyTorch reserved over the snapshot's trace" } else { "" }
        );
        let mut header = vec![
            "trace",
            "lower bound",
            "plan peak",
            "plan/lower",
            "pool reserved",
            "reserved/lower",
            "plan ms",
            "heuristic",
        ];
        if any_snapshot {
            header.extend(["PyTorch reserved", "PyTorch/lower"]);
        }
        for row in &mut rows {
            row.truncate(header.len());
        }
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
    if args.save_trace.is_some() && args.traces.len() > 1 {
        eprintln!("error: --save-trace writes one trace, but {} inputs were given", args.traces.len());
        return ExitCode::FAILURE;
    }
    let mut reports = Vec::new();
    let mut failed = false;
    // Traces whose replay ran out of memory, with how many allocations did: a failure unless --allow-oom.
    let mut short = Vec::new();
    for path in &args.traces {
        let result = load_input(path, args.device).and_then(|input| {
            let Input { trace, torch } = input;
            if let Some(out) = &args.save_trace {
                let comment = match &torch {
                    Some(t) => {
                        format!("converted from the PyTorch memory snapshot {}, device {}", t.file, t.figures.device)
                    }
                    None => format!("saved from {}", path.display()),
                };
                trace.save(out, &comment).map_err(|e| format!("{}: {e}", out.display()))?;
                eprintln!("{}: {} ops written to {}", trace.name, trace.len(), out.display());
            }
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
            report.map(|report| (report, torch))
        });
        if let Ok((report, _)) = &result {
            if report.ooms > 0 {
                short.push(format!("{}: {}", report.trace, count(report.ooms, "allocation")));
            }
        }
        match result {
            Ok((report, torch)) if args.json => {
                if !print_line(&json_line(&report, torch.as_ref())) {
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
        for (report, torch) in &reports {
            if let Some(torch) = torch {
                print_torch(report, torch);
            }
        }
    }
    if !short.is_empty() && !args.allow_oom {
        eprintln!(
            "error: out of memory in the replay ({}): its figures are not the trace's; --allow-oom accepts that",
            short.join(", ")
        );
        failed = true;
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

fn print_table(reports: &[(ReplayReport, Option<TorchInput>)], args: &ReplayArgs) {
    let first = &reports[0].0;
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
        "last pass calls",
        "page moves",
        "blocks lent",
        "last pass marks",
        "retries",
        "ooms",
    ];
    // A figure that does not exist (no warm pass, a peak the replay never reached for lack of memory) is a dash.
    let none = || "-".to_string();
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|(r, _)| {
            let last_pass = if r.ooms > 0 || r.peak_live_bytes == 0 {
                none()
            } else {
                format!("{:.3}", r.peak_reserved_bytes_last as f64 / r.peak_live_bytes as f64)
            };
            vec![
                r.trace.clone(),
                r.ops.to_string(),
                human_bytes(r.peak_live_bytes),
                human_bytes(r.peak_reserved_bytes),
                r.reserved_over_live.map_or_else(none, |ratio| format!("{ratio:.3}")),
                last_pass,
                format!("{}/{}", r.steps_planned, r.steps),
                format!("{:.1}", r.ns_per_op_cold),
                r.ns_per_op_warm.map_or_else(none, |ns| format!("{ns:.1}")),
                r.device_allocs.to_string(),
                r.warm_device_calls.map_or_else(none, |calls| calls.to_string()),
                r.warm_device_calls_last.map_or_else(none, |calls| calls.to_string()),
                (r.pages_shared + r.segments_shared).to_string(),
                r.blocks_shared.to_string(),
                r.warm_stream_marks_last.map_or_else(none, |marks| marks.to_string()),
                r.oom_retries.to_string(),
                r.ooms.to_string(),
            ]
        })
        .collect();
    print_rows(&header, &rows);
}

/// Prints what a converted PyTorch snapshot held and PyTorch's peaks beside umm's: reserved over allocated for
/// both, where umm's allocated is the converted trace's peak of live bytes.
fn print_torch(report: &ReplayReport, torch: &TorchInput) {
    let f = &torch.figures;
    let chosen = match (torch.busiest, f.devices) {
        (true, 2..) => " (the one with the most events; --device picks another)",
        _ => "",
    };
    println!();
    println!("{}: PyTorch memory snapshot {}, device {} of {}{chosen}", report.trace, torch.file, f.device, f.devices);
    println!(
        "{}: {} and {} replayed ({} as the free); {} from before the trace allocated at its start ({} freed in it, \
         {} in use in the segments; {}); {} live at its end",
        count(f.events, "event"),
        count(f.allocs, "alloc"),
        count(f.frees, "free"),
        f.free_action,
        count(f.live_before_from_frees + f.live_before_from_segments, "block"),
        f.live_before_from_frees,
        f.live_before_from_segments,
        human_bytes(f.live_before_bytes),
        f.live_at_end
    );
    if f.ooms > 0 {
        println!(
            "{} (largest request {}): counted, not replayed",
            count(f.ooms, "out-of-memory event"),
            human_bytes(f.largest_oom_request_bytes)
        );
    }
    if !f.not_replayed.is_empty() {
        let skipped: Vec<String> = f.not_replayed.iter().map(|(why, n)| format!("{n} {why}")).collect();
        println!("not replayed: {}", skipped.join(", "));
    }
    for note in &f.notes {
        println!("note: {note}");
    }
    let ratio = |reserved: u64, allocated: u64| {
        if allocated == 0 {
            "-".to_string()
        } else {
            format!("{:.3}", reserved as f64 / allocated as f64)
        }
    };
    let header = ["allocator", "peak reserved", "peak allocated", "reserved/allocated"];
    let rows = [
        vec![
            format!("umm ({})", report.backend),
            human_bytes(report.peak_reserved_bytes),
            human_bytes(report.peak_live_bytes),
            ratio(report.peak_reserved_bytes, report.peak_live_bytes),
        ],
        vec![
            "PyTorch (snapshot)".to_string(),
            human_bytes(f.torch_peak_reserved_bytes),
            human_bytes(f.torch_peak_allocated_bytes),
            ratio(f.torch_peak_reserved_bytes, f.torch_peak_allocated_bytes),
        ],
    ];
    print_rows(&header, &rows);
}

/// `n` and a noun, plural unless `n` is 1.
fn count(n: u64, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// Prints a table: the first column left-aligned, the others right-aligned, each as wide as its widest cell.
fn print_rows(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, &w)) in cells.zip(&widths).enumerate() {
            if i == 0 {
                text.push_str(&format!("{cell:<w$}"));
            } else {
                text.push_str(&format!("  {cell:>w$}"));
            }
        }
        println!("{}", text.trim_end());
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
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
