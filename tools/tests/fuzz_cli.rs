//! Fuzzed command lines for the `umm` tool. The arguments are parsed in process with the tool's own clap types
//! (`src/bin/umm/args.rs`), and what the tool does with parsed values that needs no device (plot sizes, plan
//! alignments, replays on the simulated device) runs in process too: 10,000 cases in CI, 100,000 in the ignored
//! test. A few hundred random command lines (with random `UMM_*` variables) run the built binary itself on small
//! trace files, each under a time limit. Every run ends in `Ok` or an error naming the argument, value or file;
//! never a panic or a hang.

#[allow(dead_code)]
#[path = "../src/bin/umm/args.rs"]
mod args;
mod fuzz_support;

use args::{Cli, Command};
use clap::error::ErrorKind;
use clap::Parser;
use fuzz_support::{cases, run, size_text, Rng, CI_CASES, LONG_CASES};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use umm::trace::Trace;
use umm_tools::plot::{PlotOptions, Timeline};
use umm_tools::replay::{ReplayOptions, BACKENDS};

const SUBCOMMANDS: &[&str] = &["replay", "devices", "snapshot", "plot", "plan"];
const FLAGS: &[&str] = &[
    "--backend",
    "--limit",
    "--repeat",
    "--capacity",
    "--json",
    "--sim",
    "-o",
    "--output",
    "--at",
    "--width",
    "--height",
    "--max-shapes",
    "--alignment",
    "--help",
    "-h",
    "--",
    "-",
    "--limit=",
    "--capacity=",
    "--repeat=",
    "--unknown",
    "-x",
    "--JSON",
    "-V",
];

/// A value for an option: sizes, numbers at their edges, names the options take and names they do not, paths.
fn value(rng: &mut Rng, traces: &[PathBuf]) -> String {
    match rng.below(9) {
        0 | 1 => size_text(rng),
        2 => rng.edgy_u64().to_string(),
        3 => format!("-{}", rng.edgy_u64()),
        4 => rng.pick(BACKENDS).to_string(),
        5 => rng.pick(&["end", "peak", "PEAK", "middle", "sim2", "", " ", "0", "1", "4096", "3", "65536"]).to_string(),
        6 | 7 if !traces.is_empty() => rng.pick(traces).display().to_string(),
        _ => rng.weird_text(10),
    }
}

/// Each subcommand's own options.
fn options_of(subcommand: &str) -> &'static [&'static str] {
    match subcommand {
        "replay" => &["--backend", "--limit", "--repeat", "--capacity", "--json"],
        "devices" => &["--json", "--sim"],
        "snapshot" => &["--output", "--capacity", "--limit", "--at"],
        "plot" => &["--output", "--width", "--height", "--max-shapes"],
        _ => &["--json", "--alignment"],
    }
}

/// A command line: half the time a subcommand with its own options and a trace, else anything (no subcommand,
/// a misspelt one, options of other subcommands, stray values).
fn argv(rng: &mut Rng, traces: &[PathBuf]) -> Vec<String> {
    if rng.one_in(2) {
        let subcommand = *rng.pick(SUBCOMMANDS);
        let mut args = vec!["umm".to_string(), subcommand.to_string()];
        for _ in 0..rng.below(4) {
            let option = *rng.pick(options_of(subcommand));
            args.push(option.to_string());
            if option != "--json" {
                args.push(value(rng, traces));
            }
        }
        if subcommand != "devices" && !traces.is_empty() {
            args.push(rng.pick(traces).display().to_string());
        }
        return args;
    }
    let mut args = vec!["umm".to_string()];
    match rng.below(12) {
        0 => {}
        1 => args.push(rng.pick(&["replya", "help", "--help", "-V", "--version", "", "Replay", "-"]).to_string()),
        2 => args.push(rng.weird_text(6)),
        _ => args.push(rng.pick(SUBCOMMANDS).to_string()),
    }
    for _ in 0..rng.below(8) {
        match rng.below(3) {
            0 => args.push(value(rng, traces)),
            _ => {
                let flag = *rng.pick(FLAGS);
                if flag.ends_with('=') {
                    args.push(format!("{flag}{}", value(rng, traces)));
                } else {
                    args.push(flag.to_string());
                    if !rng.one_in(4) {
                        args.push(value(rng, traces));
                    }
                }
            }
        }
    }
    args
}

/// What a clap error must say: the argument, value or subcommand at fault, or the argument missing.
fn check_parse_error(error: &clap::Error, argv: &[String]) -> Result<(), String> {
    if matches!(
        error.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        return Ok(());
    }
    let message = error.render().to_string();
    if !message.starts_with("error: ") {
        return Err(format!("an error that does not start with `error: `: {message}"));
    }
    // clap quotes what it refused: a whole argument, or the start of one (`-9` of `-983568`, read as short flags).
    let quoted: Vec<&str> = message.split('\'').skip(1).step_by(2).collect();
    // clap drops control characters when it shows an argument: compare letters and digits where they differ.
    let plain = |s: &str| s.chars().filter(|c| c.is_alphanumeric()).collect::<String>();
    let names_token = quoted.iter().any(|q| {
        argv[1..].iter().any(|t| {
            t == q || (!q.is_empty() && t.starts_with(q)) || (!plain(q).is_empty() && plain(t).contains(&plain(q)))
        })
    });
    let names_token = names_token
        || argv[1..]
            .iter()
            .filter_map(|t| t.split_once('='))
            .any(|(flag, v)| message.contains(&format!("'{v}'")) || message.contains(flag));
    // An argument clap could not place is quoted after `unexpected argument` (with control characters dropped,
    // which may leave nothing comparable).
    let names_token =
        names_token || (error.kind() == ErrorKind::UnknownArgument && message.contains("unexpected argument '"));
    let names_missing = message.contains("required") || message.contains("requires a value") || message.contains('<');
    if !(names_token || names_missing) {
        return Err(format!("{:?} error names no argument: {message}", error.kind()));
    }
    if matches!(error.kind(), ErrorKind::ValueValidation)
        && !["expected", "holds nothing", "a limit is"].iter().any(|w| message.contains(w))
    {
        return Err(format!("a refused value without what is expected: {message}"));
    }
    Ok(())
}

/// A small trace, in memory and on disk.
fn small_trace() -> Trace {
    Trace::parse_str("fuzz", "fuzz.trace", "# umm-trace v1\na 1 4096 0\na 2 3000000 1\nf 1\na 3 100 0\nf 2\n").unwrap()
}

fn parse_target(cases: u64) {
    let trace = small_trace();
    let timeline = Timeline::from_trace(&trace);
    let traces = vec![PathBuf::from("t.trace")];
    run(
        "CLI arguments",
        cases,
        |rng| argv(rng, &traces),
        |argv| {
            let cli = match Cli::try_parse_from(argv) {
                Ok(cli) => cli,
                Err(e) => return check_parse_error(&e, argv),
            };
            // What the tool does with the values that needs no device or file.
            match cli.command {
                Command::Plot(a) => {
                    let options = PlotOptions { width: a.width, panel_height: a.height, max_shapes: a.max_shapes };
                    let svg = umm_tools::plot::render_svg(&timeline, &options);
                    if !svg.starts_with("<svg") && !svg.starts_with("<?xml") {
                        return Err(format!("no SVG for {options:?}"));
                    }
                }
                Command::Plan(a) => {
                    if let Err(e) = umm_tools::plan::plan_trace(&trace, a.alignment) {
                        let message = e.to_string();
                        if !message.contains(&a.alignment.to_string()) {
                            return Err(format!(
                                "a plan error that does not name the alignment {}: {message}",
                                a.alignment
                            ));
                        }
                    }
                }
                Command::Replay(a) if a.backend.starts_with("sim") && BACKENDS.contains(&a.backend.as_str()) => {
                    let opts = ReplayOptions {
                        repeat: a.repeat.min(2),
                        limit: a.limit,
                        sim_capacity: a.capacity,
                        ..ReplayOptions::default()
                    };
                    if let Err(e) = umm_tools::replay::replay_on(&a.backend, &trace, opts) {
                        let message = e.to_string();
                        if !message.contains("fuzz") {
                            return Err(format!("a replay error that does not name the trace: {message}"));
                        }
                    }
                }
                _ => {}
            }
            Ok(())
        },
    );
}

#[test]
fn cli_arguments() {
    parse_target(cases(CI_CASES));
}

#[test]
#[ignore = "100,000 cases: run with --release -- --ignored"]
fn cli_arguments_long() {
    parse_target(cases(LONG_CASES));
}

/// A directory of input files for the binary: traces (valid, gzip, malformed, binary), a snapshot, JSON that is
/// not one, an empty file, a directory.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    let valid = "# umm-trace v1\na 1 4096 0\na 2 3000000 1\nf 1\na 3 100 0\nf 2\n";
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, valid.as_bytes()).unwrap();
    let gz = gz.finish().unwrap();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("valid.trace", valid.into()),
        ("valid.trace.gz", gz.clone()),
        ("truncated.trace.gz", gz[..gz.len() / 2].to_vec()),
        ("malformed.trace", b"# umm-trace v1\na 1 0 0\nf 9\n".to_vec()),
        ("binary.bin", (0..2000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()),
        ("empty.trace", Vec::new()),
        ("not-a-snapshot.json", b"{\"pools\": 3}".to_vec()),
        ("broken.json", b"{\"pools\": [".to_vec()),
    ];
    let mut paths: Vec<PathBuf> = files
        .into_iter()
        .map(|(name, bytes)| {
            let path = dir.join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        })
        .collect();
    paths.push(dir.to_path_buf());
    paths.push(dir.join("missing.trace"));
    paths
}

/// Runs the binary with a random command line and random `UMM_*` variables, a few hundred times: each run exits
/// 0, 1 or 2 within the time limit, without a panic, and a failure prints `error: ` and names something given.
fn binary_target(cases: u64) {
    let dir = std::env::temp_dir().join(format!("umm-fuzz-cli-{}-{cases}", std::process::id()));
    let files = inputs(&dir);
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    run(
        "umm binary",
        cases,
        |rng| {
            let mut argv = argv(rng, &files);
            // Bounded work: few repeats, and outputs inside the scratch directory.
            for i in 1..argv.len() {
                if argv[i - 1] == "--repeat" {
                    argv[i] = rng.below(3).to_string();
                }
                if argv[i - 1] == "-o" || argv[i - 1] == "--output" {
                    argv[i] = out.join(rng.pick(&["a.svg", "b.json", "sub/dir/c.svg", ""])).display().to_string();
                }
            }
            argv.retain(|a| !a.starts_with("--repeat="));
            // A command line cannot hold NUL bytes.
            for a in &mut argv {
                a.retain(|c| c != '\0');
            }
            let mut env: Vec<(&str, String)> = Vec::new();
            if rng.one_in(3) {
                let var = *rng.pick(umm::config::KNOWN_VARS);
                if var != "UMM_TRACE" {
                    env.push((var, size_text(rng).replace('\0', "")));
                }
            }
            (argv, env)
        },
        |(argv, env)| {
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_umm"));
            command
                .args(&argv[1..])
                .current_dir(&out)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            // No accelerator probing: the runs are about arguments, and must not depend on the machine's devices.
            command.env("UMM_BACKENDS", "none").env_remove("UMM_TRACE");
            for (var, value) in env {
                command.env(var, value);
            }
            let mut child = command.spawn().map_err(|e| format!("spawn: {e}"))?;
            // Standard error reaches its end when the child exits: a reader thread reports it, and the wait for
            // that report is the one bound, with no polling.
            let mut pipe = child.stderr.take().expect("stderr is piped");
            let (done, finished) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut text = String::new();
                let read = std::io::Read::read_to_string(&mut pipe, &mut text).map(|_| text);
                let _ = done.send(read);
            });
            let stderr = match finished.recv_timeout(Duration::from_secs(60)) {
                Ok(read) => read.map_err(|e| e.to_string())?,
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err("still running after 60 s: a hang".into());
                }
            };
            let status = child.wait().map_err(|e| e.to_string())?;
            if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
                return Err(format!("panic: {stderr}"));
            }
            match status.code() {
                Some(0) => Ok(()),
                Some(1) | Some(2) if stderr.contains("error: ") || stderr.contains("Usage:") => Ok(()),
                other => Err(format!("exit {other:?} with stderr: {stderr}")),
            }
        },
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn binary_command_lines() {
    binary_target(cases(300).min(300));
}

#[test]
#[ignore = "3,000 runs of the binary"]
fn binary_command_lines_long() {
    binary_target(3_000);
}

// Regressions: inputs the fuzzers found, each with what it gets now.

fn parse_error(args: &[&str]) -> String {
    Cli::try_parse_from(args).err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn numeric_options_say_what_they_expect() {
    // Was clap's "invalid digit found in string" and "number too large to fit in target type".
    let message = parse_error(&["umm", "replay", "--repeat", "lots", "t.trace"]);
    assert!(message.contains("`lots` is not a whole number"), "{message}");
    let message = parse_error(&["umm", "replay", "--repeat", "99999999999999999999999", "t.trace"]);
    assert!(message.contains("is too large: expected a whole number up to"), "{message}");
    let message = parse_error(&["umm", "plan", "--alignment", "3", "t.trace"]);
    assert!(message.contains("`3` is not a power of two"), "{message}");
}

#[test]
fn a_plot_of_u32_max_pixels_is_refused_and_the_library_clamps_it() {
    // `--width 4294967295` kept a column per pixel: a 51 GB allocation that aborted the process.
    let message = parse_error(&["umm", "plot", "t.trace", "--width", "4294967295"]);
    assert!(message.contains("`4294967295` is outside 1 to 32768 pixels"), "{message}");
    let message = parse_error(&["umm", "plot", "t.trace", "--height", "0"]);
    assert!(message.contains("`0` is outside 1 to 32768 pixels"), "{message}");
    let timeline = Timeline::from_trace(&small_trace());
    let options = PlotOptions { width: u32::MAX, panel_height: u32::MAX, max_shapes: usize::MAX };
    assert!(umm_tools::plot::render_svg(&timeline, &options).contains(r#"width="32768""#));
}

#[test]
fn a_simulated_device_near_2_to_the_64_bytes_replays_without_overflow() {
    // `umm replay --capacity 9999999999999999999.73B` overflowed the simulated device's reservation size, then
    // its address space.
    for capacity in [u64::MAX, 9_999_999_999_999_999_999, 1 << 63] {
        for backend in ["sim", "sim-plain"] {
            let opts = ReplayOptions { repeat: 1, sim_capacity: Some(capacity), ..ReplayOptions::default() };
            if let Err(e) = umm_tools::replay::replay_on(backend, &small_trace(), opts) {
                assert!(e.to_string().contains("fuzz"), "{e}");
            }
        }
    }
}
