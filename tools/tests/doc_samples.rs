//! The documentation shows what the commands print now: each sample output in docs/GUIDE.md is compared with the
//! output of its command (a timing column masked), and the README states the trace format's first line and how
//! to install the command as they are. A failure prints the command's output to paste into the guide.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn read(file: &str) -> String {
    std::fs::read_to_string(repository().join(file)).unwrap()
}

/// The `text` block that follows the first line of `doc` containing `after`.
fn sample(doc: &str, after: &str) -> Vec<String> {
    let from = doc.find(after).unwrap_or_else(|| panic!("no `{after}` in the guide"));
    let rest = &doc[from..];
    let start = rest.find("```text\n").expect("a text block follows") + "```text\n".len();
    let end = rest[start..].find("```").unwrap();
    rest[start..start + end].lines().map(String::from).collect()
}

/// `umm ARGS` run from the repository's root, as the guide's commands are.
fn umm(args: &[&str]) -> Vec<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_umm"))
        .args(args)
        .current_dir(repository())
        .env_remove("UMM_TRACE")
        .output()
        .expect("the umm binary runs");
    assert!(output.status.success(), "umm {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).lines().map(String::from).collect()
}

/// A table line's cells (two spaces or more apart), with the cell under `masked` (a header cell) replaced.
fn cells(line: &str, masked: Option<usize>) -> Vec<String> {
    let mut cells: Vec<String> = line.split("  ").map(str::trim).filter(|c| !c.is_empty()).map(String::from).collect();
    if let Some(at) = masked.filter(|&at| at < cells.len()) {
        cells[at] = "*".into();
    }
    cells
}

#[test]
fn the_guides_umm_plan_sample_is_what_umm_plan_prints() {
    let doc = read("docs/GUIDE.md");
    let shown = sample(&doc, "cargo run --release --bin umm -- plan examples/traces/gpt2_train.trace.gz");
    let printed = umm(&["plan", "examples/traces/gpt2_train.trace.gz"]);
    // The planner's time varies from run to run: its column is compared as present, not by value.
    let header = printed.iter().find(|l| l.starts_with("trace")).expect("a header");
    let ms = cells(header, None).iter().position(|c| c == "plan ms");
    let masked = |lines: &[String]| -> Vec<Vec<String>> { lines.iter().map(|l| cells(l, ms)).collect() };
    assert_eq!(
        masked(&shown),
        masked(&printed),
        "docs/GUIDE.md's sample; umm plan prints now:\n{}",
        printed.join("\n")
    );
}

#[test]
fn the_guides_snapshot_sample_is_what_umm_replay_prints() {
    let doc = read("docs/GUIDE.md");
    let shown = sample(&doc, "On the test fixture (`tests/fixtures/make_torch_snapshots.py` writes it):");
    let printed = umm(&["replay", "tools/tests/fixtures/snapshot_p4.pickle"]);
    let start = printed.iter().position(|l| l.starts_with("snapshot_p4: PyTorch memory snapshot")).expect("the part");
    let printed = &printed[start..];
    // The fixture's path is printed as given; the guide names the file.
    let printed: Vec<String> = printed.iter().map(|l| l.replace("tools/tests/fixtures/", "")).collect();
    assert_eq!(shown, printed, "docs/GUIDE.md's sample; umm replay prints now:\n{}", printed.join("\n"));
}

#[test]
fn the_readme_states_the_trace_header_and_a_locked_install() {
    let readme = read("README.md");
    let header = umm::trace::HEADER;
    assert!(readme.contains(&format!("whose first line is exactly `{header}`")), "the README's trace format");
    assert!(!readme.contains("cargo install --path"), "an install that ignores Cargo.lock");
    assert!(readme.contains("cargo install --locked --path tools"));
}

/// The README's count of device calls in warm passes on the simulated device, for the trace in the repository.
#[test]
fn the_readmes_warm_device_calls_on_the_simulated_device_are_what_umm_replay_counts() {
    let readme = read("README.md").split_whitespace().collect::<Vec<_>>().join(" ");
    let printed =
        umm(&["replay", "--backend", "sim", "--repeat", "3", "--json", "examples/traces/gpt2_train.trace.gz"]);
    let report: serde_json::Value = serde_json::from_str(&printed[0]).unwrap();
    let calls = report["warm_device_calls"].as_u64().unwrap();
    let stated = format!("with `--backend sim --repeat 3` warm passes make {calls} device calls on gpt2_train");
    assert!(readme.contains(&stated), "the README should say: {stated}");
}
