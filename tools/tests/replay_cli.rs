//! `umm replay` run as a user runs it: the built binary on traces written to a temp dir.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIELDS: [&str; 32] = [
    "trace",
    "backend",
    "device",
    "ops",
    "allocs",
    "frees",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "reserved_over_live",
    "peak_reserved_bytes_warm",
    "ns_per_op_cold",
    "ns_per_op_warm",
    "device_allocs",
    "device_frees",
    "warm_stream_marks",
    "warm_stream_marks_last",
    "blocks_shared",
    "warm_device_calls",
    "warm_device_calls_last",
    "pages_shared",
    "segments_shared",
    "oom_retries",
    "ooms",
    "limit_bytes",
    "peak_reserved_bytes_last",
    "ns_per_op_last",
    "steps",
    "steps_planned",
    "planned_allocs",
    "plan_fallbacks",
    "stitches",
    "stitched_allocs",
];

/// Writes a small trace (a few sizes, two streams, one block left live) and returns its path.
fn small_trace(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("umm-replay-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut text = String::from("# umm-trace v1\n");
    for i in 0..200u64 {
        text.push_str(&format!("a {i} {} {}\n", (512 * (1 + i % 7)) << (i % 3 * 5), i % 2));
        if i >= 3 {
            text.push_str(&format!("f {}\n", i - 3));
        }
    }
    let path = dir.join(format!("{name}.trace"));
    std::fs::write(&path, text).unwrap();
    path
}

fn umm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_umm")).args(args).output().expect("the umm binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Asserts a failure with a clean message on stderr (no panic, no backtrace) and returns that message.
fn failure(output: &Output) -> String {
    let stderr = text(&output.stderr);
    assert!(!output.status.success(), "expected failure; stdout {}", text(&output.stdout));
    assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "{stderr}");
    stderr
}

fn json_lines(output: &Output) -> Vec<serde_json::Value> {
    text(&output.stdout).lines().map(|l| serde_json::from_str(l).expect("each line is a JSON object")).collect()
}

#[test]
fn table_has_a_header_and_one_row_per_trace() {
    let (a, b) = (small_trace("table_a"), small_trace("table_b"));
    let output = umm(&["replay", "--repeat", "2", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    for column in ["trace", "ops", "peak live", "peak reserved", "reserved/live", "ns/op cold", "ns/op warm"] {
        assert!(stdout.contains(column), "column {column} in\n{stdout}");
    }
    for column in ["device allocs", "retries", "ooms"] {
        assert!(stdout.contains(column), "column {column} in\n{stdout}");
    }
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("table_")).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows[0].split_whitespace().nth(1) == Some("397"), "ops column: {}", rows[0]);
}

#[test]
fn json_has_every_field_on_every_backend() {
    let path = small_trace("json");
    for backend in ["sim", "sim-plain", "sim-wgpu", "host"] {
        let output = umm(&["replay", "--backend", backend, "--json", "--repeat", "3", path.to_str().unwrap()]);
        assert!(output.status.success(), "{backend}: {}", text(&output.stderr));
        let lines = json_lines(&output);
        assert_eq!(lines.len(), 1);
        let object = lines[0].as_object().unwrap();
        for field in FIELDS {
            assert!(object.contains_key(field), "{backend}: field {field} in {object:?}");
        }
        assert_eq!(object.len(), FIELDS.len(), "no other fields: {object:?}");
        assert_eq!(lines[0]["trace"], "json");
        assert_eq!(lines[0]["backend"], backend);
        assert_eq!(lines[0]["ops"], 397);
        assert_eq!(lines[0]["allocs"], 200);
        assert_eq!(lines[0]["frees"], 197);
        assert_eq!(lines[0]["ooms"], 0);
        assert!(lines[0]["limit_bytes"].is_null());
        let ratio = lines[0]["reserved_over_live"].as_f64().unwrap();
        assert!(ratio >= 1.0, "{backend}: reserved/live {ratio}");
        assert!(lines[0]["ns_per_op_warm"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn limits_are_applied_and_ooms_reported() {
    let path = small_trace("limit");
    let args = ["replay", "--backend", "sim-plain", "--json", "--limit", "4MiB", path.to_str().unwrap()];
    // Out of memory fails the command (a script can tell), naming the trace and the flag that accepts it.
    let stderr = failure(&umm(&args));
    assert!(stderr.contains("limit:") && stderr.contains("--allow-oom"), "{stderr}");
    let output = umm(&[&args[..], &["--allow-oom"]].concat());
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report = &json_lines(&output)[0];
    assert_eq!(report["limit_bytes"], 4 << 20);
    assert!(report["ooms"].as_u64().unwrap() > 0, "blocks up to 3.5 MiB, three live, cannot fit 4 MiB: {report}");
    assert!(report["peak_reserved_bytes"].as_u64().unwrap() <= 4 << 20);

    let output = umm(&["replay", "--json", "--limit", "50%", "--capacity", "1GiB", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(json_lines(&output)[0]["limit_bytes"], 512 << 20);
}

#[test]
fn bad_limits_name_the_flag_and_what_it_accepts() {
    let path = small_trace("bad_limit");
    for bad in ["2XB", "lots", "1.5", "0", "-3GiB", "", "0.5", "150%"] {
        let flag = format!("--limit={bad}");
        let stderr = failure(&umm(&["replay", &flag, path.to_str().unwrap()]));
        assert!(stderr.contains("--limit"), "{bad}: {stderr}");
        assert!(stderr.contains("GiB") && stderr.contains("90%"), "{bad}: names both accepted forms: {stderr}");
    }
    let stderr = failure(&umm(&["replay", "--repeat", "many", path.to_str().unwrap()]));
    assert!(stderr.contains("--repeat"), "{stderr}");
}

#[test]
fn a_bare_number_is_refused_as_a_limit_since_it_could_be_bytes_or_a_fraction() {
    let path = small_trace("bare_limit");
    for (bare, bytes, percent) in [("1", "1B", "100%"), ("1.0", "", "100%"), ("4194304", "4194304B", "")] {
        let stderr = failure(&umm(&["replay", "--limit", bare, path.to_str().unwrap()]));
        assert!(stderr.contains("no unit"), "{bare}: {stderr}");
        assert!(stderr.contains(bytes) && stderr.contains(percent), "{bare}: spells out both readings: {stderr}");
    }
    let output = umm(&["replay", "--json", "--allow-oom", "--limit", "4194304B", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(json_lines(&output)[0]["limit_bytes"], 4 << 20);
    let output = umm(&["replay", "--json", "--limit", "100%", "--capacity", "1GiB", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(json_lines(&output)[0]["limit_bytes"], 1 << 30);
}

#[test]
fn a_capacity_of_zero_is_refused() {
    let path = small_trace("zero_capacity");
    for command in [&["replay", "--capacity", "0"][..], &["replay", "--backend", "host", "--capacity", "0GiB"]] {
        let mut args = command.to_vec();
        args.push(path.to_str().unwrap());
        let stderr = failure(&umm(&args));
        assert!(stderr.contains("--capacity") && stderr.contains("above zero"), "{args:?}: {stderr}");
    }
    let stderr = failure(&umm(&["snapshot", "--capacity", "0", path.to_str().unwrap()]));
    assert!(stderr.contains("--capacity") && stderr.contains("above zero"), "{stderr}");
    let stderr = failure(&umm(&["devices", "--sim", "0"]));
    assert!(stderr.contains("--sim") && stderr.contains("above zero"), "{stderr}");
}

/// `umm` with extra environment variables.
fn umm_env(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_umm"));
    command.args(args).envs(vars.iter().copied());
    command.output().expect("the umm binary runs")
}

#[test]
fn a_misspelt_umm_variable_draws_one_warning_with_the_closest_name() {
    let (a, b) = (small_trace("misspelt_a"), small_trace("misspelt_b"));
    let output = umm_env(&["replay", "--json", a.to_str().unwrap(), b.to_str().unwrap()], &[("UMM_LIMT", "2GiB")]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    assert_eq!(stderr.matches("UMM_LIMT").count(), 1, "once per process, though each trace reads the env: {stderr}");
    assert!(stderr.contains("did you mean UMM_LIMIT?"), "{stderr}");
    let output = umm_env(&["devices", "--json"], &[("UMM_BACKENDS", "none"), ("UMM_POISSON", "1")]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(text(&output.stderr).contains("UMM_POISSON") && text(&output.stderr).contains("UMM_POISON?"));
}

#[test]
fn environment_errors_name_the_variable_and_its_value() {
    for (var, value) in [("UMM_SMALL_MAX", "1TiB"), ("UMM_LARGE_SEGMENT", "1"), ("UMM_BACKENDS", "")] {
        let stderr = failure(&umm_env(&["devices"], &[(var, value)]));
        assert!(stderr.contains(&format!("{var}={value:?}")), "{stderr}");
    }
    let stderr = failure(&umm_env(&["devices"], &[("UMM_LARGE_SEGMENT", "1")]));
    assert!(stderr.contains("2.00 MiB"), "names the minimum: {stderr}");
}

#[test]
fn unknown_backend_lists_the_available_ones() {
    let path = small_trace("backend");
    let stderr = failure(&umm(&["replay", "--backend", "vulkan", path.to_str().unwrap()]));
    assert!(stderr.contains("vulkan"), "{stderr}");
    assert!(stderr.contains("sim") && stderr.contains("sim-plain") && stderr.contains("host"), "{stderr}");
}

#[test]
fn missing_and_malformed_files_are_errors_but_other_traces_still_run() {
    let good = small_trace("good");
    let missing = good.with_file_name("missing.trace.gz");
    let malformed = good.with_file_name("malformed.trace");
    std::fs::write(&malformed, "# umm-trace v1\na 1 100 0\nf 2\n").unwrap();
    let output =
        umm(&["replay", "--json", missing.to_str().unwrap(), good.to_str().unwrap(), malformed.to_str().unwrap()]);
    let stderr = failure(&output);
    assert!(stderr.contains(missing.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains(&format!("{}:3:", malformed.display())), "{stderr}");
    let lines = json_lines(&output);
    assert_eq!(lines.len(), 1, "the good trace is still reported");
    assert_eq!(lines[0]["trace"], "good");
}

#[test]
fn random_bytes_are_refused_as_not_an_umm_trace_naming_the_file() {
    let path = small_trace("random").with_file_name("random.bin");
    let bytes: Vec<u8> = (0..2048u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8 | 0x80).collect();
    std::fs::write(&path, bytes).unwrap();
    let stderr = failure(&umm(&["replay", path.to_str().unwrap()]));
    assert!(stderr.contains(path.to_str().unwrap()) && stderr.contains("not an umm trace"), "{stderr}");
    assert!(stderr.contains("plain or gzip") && !stderr.contains("valid UTF-8"), "{stderr}");
}

#[test]
fn an_unknown_snapshot_point_lists_the_accepted_ones() {
    let path = small_trace("snapshot_at");
    let stderr = failure(&umm(&["snapshot", "--at", "middle", path.to_str().unwrap()]));
    assert!(stderr.contains("--at") && stderr.contains("middle"), "{stderr}");
    assert!(stderr.contains("end, peak"), "lists the accepted values: {stderr}");
    assert_eq!("PEAK".parse::<umm::observe::SnapshotAt>(), Ok(umm::observe::SnapshotAt::Peak));
}

#[test]
fn host_refuses_a_trace_larger_than_its_memory() {
    let path = small_trace("host_small");
    let stderr = failure(&umm(&["replay", "--backend", "host", "--capacity", "1MiB", path.to_str().unwrap()]));
    assert!(stderr.contains("host_small") && stderr.contains("available"), "{stderr}");
}

#[test]
fn no_trace_is_a_usage_error() {
    let stderr = failure(&umm(&["replay"]));
    assert!(stderr.contains("TRACE"), "{stderr}");
}

#[test]
fn gpt2_train_on_sim_reserves_at_most_ten_percent_over_live() {
    // The sample committed with the repository, so this runs from any clone.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/gpt2_train.trace.gz");
    let output = umm(&["replay", "--backend", "sim", "--json", "--repeat", "1", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report = &json_lines(&output)[0];
    assert_eq!(report["ooms"], 0);
    let ratio = report["reserved_over_live"].as_f64().unwrap();
    assert!(ratio <= 1.10, "gpt2_train reserved/live {ratio} > 1.10: {report}");
}

#[test]
fn steps_per_pass_are_planned_and_a_bad_steps_value_is_refused() {
    let path = small_trace("steps");
    let output = umm(&["replay", "--json", "--repeat", "3", "--steps", "pass", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let line = &json_lines(&output)[0];
    assert_eq!((line["steps"].as_u64(), line["steps_planned"].as_u64()), (Some(5), Some(2)), "{line}");
    assert!(line["planned_allocs"].as_u64().unwrap() > 0, "{line}");
    assert!(line["peak_reserved_bytes_last"].as_u64() <= line["peak_reserved_bytes"].as_u64(), "{line}");

    let output = umm(&["replay", "--steps", "sometimes", path.to_str().unwrap()]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("--steps") && stderr.contains("trace, pass, off"), "{stderr}");
}

/// A trace of one allocation larger than the device: the replay runs out of memory, fails, and prints a dash
/// where a ratio to a peak it never reached would be.
#[test]
fn an_allocation_larger_than_the_device_fails_the_replay_and_prints_no_ratio() {
    let dir = std::env::temp_dir().join(format!("umm-replay-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("huge.trace");
    std::fs::write(&path, format!("# umm-trace v1\na 0 {} 0\nf 0\n", 1000u64 << 40)).unwrap();
    let stderr = failure(&umm(&["replay", path.to_str().unwrap()]));
    assert!(stderr.contains("huge: 1 allocation") && stderr.contains("--allow-oom"), "{stderr}");
    let output = umm(&["replay", "--allow-oom", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let row: Vec<&str> = stdout.lines().find(|l| l.starts_with("huge")).unwrap().split_whitespace().collect();
    assert!(!row.contains(&"0.000"), "no ratio to a peak never reached: {stdout}");
    let output = umm(&["replay", "--allow-oom", "--json", path.to_str().unwrap()]);
    let line = &json_lines(&output)[0];
    assert_eq!(line["ooms"], 1);
    assert!(line["reserved_over_live"].is_null(), "{line}");
}

/// Without warm replays there is no warm figure: a dash in the table, null in JSON, not the cold one again.
#[test]
fn no_warm_replays_print_no_warm_figures() {
    let path = small_trace("cold_only");
    let output = umm(&["replay", "--repeat", "0", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    // Cells are at least two spaces apart; a cell has single spaces at most ("peak live", "1.2 MiB").
    let cells = |first: &str| -> Vec<String> {
        let line = stdout.lines().find(|l| l.starts_with(first)).unwrap();
        line.split("  ").map(str::trim).filter(|c| !c.is_empty()).map(String::from).collect()
    };
    let (header, row) = (cells("trace"), cells("cold_only"));
    assert_eq!(header.len(), row.len(), "{stdout}");
    for column in ["ns/op warm", "warm device calls", "last pass calls"] {
        let at = header.iter().position(|h| h == column).unwrap();
        assert_eq!(row[at], "-", "{column}: {stdout}");
    }
    let output = umm(&["replay", "--repeat", "0", "--json", path.to_str().unwrap()]);
    let line = &json_lines(&output)[0];
    assert!(line["ns_per_op_warm"].is_null() && line["ns_per_op_cold"].as_f64().unwrap() > 0.0, "{line}");
    for warm in ["peak_reserved_bytes_warm", "warm_device_calls", "warm_device_calls_last"] {
        assert!(line[warm].is_null(), "{warm}: {line}");
    }
}
