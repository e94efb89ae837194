//! PyTorch memory snapshots: the pickles `tests/fixtures/make_torch_snapshots.py` writes (the numbers below are
//! worked out in its comments) read, converted and replayed, through the library and through the `umm` binary;
//! every bad input refused with a message that says what is wrong; and a fuzz target of mutated snapshots that
//! must each read or fail cleanly (10,000 cases, `UMM_FUZZ_CASES` overrides; 100,000 in the ignored test).

mod fuzz_support;

use fuzz_support::{cases, run, Rng, CI_CASES, LONG_CASES};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use umm::trace::{Op, Trace, TraceWriter};
use umm_tools::torch_snapshot::{Action, BlockState, TorchSnapshot, TorchSnapshotError, MAX_SNAPSHOT_BYTES};

const MIB: u64 = 1 << 20;
const A: u64 = 0x7F00_0000_0000;
const D: u64 = 0x7F00_0A00_0000;
const E: u64 = 0x7E00_0000_0000;
const S: i128 = 0x55D5_0000_1000;
const T: i128 = 0xFFFF_8000_0000_1000;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn snapshot(name: &str) -> TorchSnapshot {
    TorchSnapshot::read(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("umm-torch-snapshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn alloc(slot: u32, bytes: u64, stream: u32) -> Op {
    Op::Alloc { slot, bytes, stream }
}

fn free(slot: u32) -> Op {
    Op::Free { slot }
}

/// Device 0 of the main fixture: X, Y (freed in the trace) and S1, S2 (in use in the segments) first, then the
/// trace's own allocs and frees; stream S is 1.
fn device0_ops() -> Vec<Op> {
    vec![
        alloc(0, MIB, 0),
        alloc(1, 3072, 1),
        alloc(2, 2_000_000, 0),
        alloc(3, 400, 1),
        free(0),
        alloc(0, 512, 1),
        alloc(4, 4 * MIB, 0),
        alloc(5, 8 * MIB, 0),
        free(4),
        alloc(4, 2 * MIB, 0),
        alloc(6, 40 * MIB, 0),
        free(6),
        free(0),
        free(1),
        alloc(1, 1536, 0),
    ]
}

/// 1 MiB + 3072 + 2,000,000 + 400 live from the start, then b1, b2, b3, b4 and b5 with X and b2 freed.
const DEVICE0_PEAK: u64 = 54_432_784;

// ---------------------------------------------------------------------------------------------------------------
// Reading and converting

#[test]
fn protocols_2_4_and_5_read_alike() {
    let p2 = snapshot("snapshot_p2.pickle");
    let p4 = snapshot("snapshot_p4.pickle");
    let p5 = snapshot("snapshot_p5.pickle");
    assert_eq!((p2.protocol, p4.protocol, p5.protocol), (2, 4, 5));
    assert_eq!((&p2.segments, &p2.device_traces), (&p4.segments, &p4.device_traces));
    assert_eq!((&p4.segments, &p4.device_traces), (&p5.segments, &p5.device_traces));
    assert_eq!(p4.name, "snapshot_p4");
    assert_eq!(p2.to_trace(0).unwrap().ops, p5.to_trace(0).unwrap().ops);
}

#[test]
fn segments_events_and_large_integers_are_read_as_written() {
    let s = snapshot("snapshot_p4.pickle");
    assert_eq!((s.devices(), s.busiest_device()), (2, Some(0)));
    assert_eq!(s.device_traces.iter().map(Vec::len).collect::<Vec<_>>(), [22, 10]);
    assert_eq!(s.segments.len(), 4);
    let a = &s.segments[0];
    assert_eq!((a.device, a.address, a.total_size, a.stream, a.is_expandable), (0, A, 20 * MIB, 0, false));
    // Blocks of A carry no address: side by side from A.
    let addresses: Vec<u64> = a.blocks.iter().map(|b| b.address - A).collect();
    assert_eq!(addresses, [0, 2 * MIB, 4 * MIB, 6 * MIB, 8 * MIB, 16 * MIB, 16 * MIB + 1536]);
    assert_eq!((a.blocks[0].size, a.blocks[0].requested_size), (2 * MIB, 2_000_000));
    assert_eq!(a.blocks[4].state, BlockState::ActivePendingFree);
    let d = &s.segments[2];
    assert_eq!((d.address, d.stream, d.blocks[1].address, d.blocks[1].requested_size), (D, S, D + 3072, 400));
    assert_eq!(d.blocks[1].state, BlockState::ActiveAllocated);
    let e = &s.segments[3];
    assert_eq!((e.device, e.address, e.stream, e.is_expandable), (1, E, T, true));

    let events = &s.device_traces[0];
    assert_eq!((events[0].action.clone(), events[0].addr, events[0].size), (Action::FreeRequested, A + 2 * MIB, MIB));
    assert_eq!((events[2].action.clone(), events[2].stream), (Action::SegmentAlloc, S));
    assert_eq!((events[9].action.clone(), events[9].size), (Action::Oom, 32 << 30));
    assert_eq!(events[19].action, Action::UserDefined);
    assert_eq!(events[5].time_us, Some(1_700_000_000_000_005));
    assert!(s.device_traces[1].iter().all(|e| e.stream == T));
    assert_eq!(s.device_traces[1][0].action, Action::SegmentMap);
}

#[test]
fn device_0_converts_with_blocks_from_before_the_trace_allocated_first() {
    let converted = snapshot("snapshot_p4.pickle").convert(0).unwrap();
    let t = &converted.trace;
    assert_eq!(t.ops, device0_ops());
    assert_eq!(t.name, "snapshot_p4");
    assert_eq!((t.allocs, t.frees, t.slots, t.streams), (10, 5, 7, 2));
    assert_eq!((t.peak_live_bytes, t.max_block_bytes), (DEVICE0_PEAK, 40 * MIB));
    assert!(t.steps.is_empty());

    let f = &converted.figures;
    assert_eq!((f.device, f.devices, f.events, f.free_action.as_str()), (0, 2, 22, "free_completed"));
    assert_eq!((f.allocs, f.frees, f.live_at_end), (6, 5, 5));
    assert_eq!((f.live_before_from_frees, f.live_before_from_segments), (2, 2));
    assert_eq!(f.live_before_bytes, MIB + 3072 + 2_000_000 + 400);
    assert_eq!((f.ooms, f.largest_oom_request_bytes, f.segment_events), (1, 32 << 30, 3));
    let skipped: Vec<(&str, u64)> = f.not_replayed.iter().map(|(k, &v)| (k.as_str(), v)).collect();
    assert_eq!(
        skipped,
        [("free_requested (frees are taken from free_completed)", 5), ("snapshot", 1), ("user_defined", 1)]
    );
    // Segments A (20 MiB), B (2) and D (2) at the dump; B was allocated in the trace, C (40) came and went.
    assert_eq!((f.reserved_at_end, f.reserved_at_start), (24 * MIB, 22 * MIB));
    assert_eq!(f.torch_peak_reserved_bytes, 64 * MIB);
    assert_eq!(f.torch_peak_allocated_bytes, DEVICE0_PEAK);
    assert!((f.torch_reserved_over_allocated() - 67_108_864.0 / 54_432_784.0).abs() < 1e-12);
    assert!(f.notes.is_empty(), "{:?}", f.notes);
}

#[test]
fn device_1_takes_free_requested_and_counts_mapped_pages_as_reserved() {
    let converted = snapshot("snapshot_p2.pickle").convert(1).unwrap();
    let t = &converted.trace;
    assert_eq!(
        t.ops,
        [
            alloc(0, 2 * MIB, 1),
            alloc(1, 3 * MIB, 1),
            alloc(2, MIB, 1),
            alloc(3, 2 * MIB, 1),
            free(1),
            free(0),
            free(3),
            alloc(3, MIB, 1),
        ]
    );
    assert_eq!((t.allocs, t.frees, t.peak_live_bytes, t.streams), (5, 3, 8 * MIB, 2));
    let f = &converted.figures;
    assert_eq!((f.free_action.as_str(), f.allocs, f.frees, f.live_at_end), ("free_requested", 4, 3, 2));
    assert_eq!((f.live_before_from_frees, f.live_before_from_segments, f.live_before_bytes), (1, 0, 2 * MIB));
    assert_eq!((f.reserved_at_start, f.reserved_at_end, f.torch_peak_reserved_bytes), (2 * MIB, 6 * MIB, 8 * MIB));
    assert_eq!((f.torch_peak_allocated_bytes, f.segment_events, f.ooms), (8 * MIB, 3, 0));
    assert!(f.not_replayed.is_empty(), "{:?}", f.not_replayed);
}

#[test]
fn a_free_of_an_unknown_address_in_a_complete_trace_is_a_block_from_before() {
    let converted = snapshot("unknown_free.pickle").convert(0).unwrap();
    assert_eq!(
        converted.trace.ops,
        [alloc(0, 777, 0), alloc(1, 1000, 0), alloc(2, 2000, 0), free(1), free(0), free(2)]
    );
    let f = &converted.figures;
    assert_eq!((f.live_before_from_frees, f.live_before_bytes, f.frees, f.live_at_end), (1, 777, 3, 0));
    assert_eq!(f.torch_peak_allocated_bytes, 3777);
    // No segments and no segment events: PyTorch's reserved bytes are unknown, and the figures say so.
    assert_eq!(f.torch_peak_reserved_bytes, 0);
    assert!(f.notes.iter().any(|n| n.contains("reserved figures are incomplete")), "{:?}", f.notes);
}

#[test]
fn the_converted_trace_saves_and_loads_back_the_same() {
    let trace = snapshot("snapshot_p5.pickle").to_trace(0).unwrap();
    for name in ["saved.trace", "saved.trace.gz"] {
        let path = scratch(name);
        trace.save(&path, "from snapshot_p5.pickle").unwrap();
        let loaded = Trace::load(&path).unwrap();
        assert_eq!((loaded.ops.as_slice(), loaded.slots, loaded.peak_live_bytes), (&trace.ops[..], 7, DEVICE0_PEAK));
        assert_eq!(loaded.name, "saved");
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Bad inputs

fn read_bytes(bytes: &[u8]) -> Result<TorchSnapshot, TorchSnapshotError> {
    TorchSnapshot::from_bytes("bad", "bad.pickle", bytes)
}

fn message(result: Result<TorchSnapshot, TorchSnapshotError>) -> String {
    let err = result.expect_err("refused");
    let text = err.to_string();
    assert!(text.starts_with("bad.pickle: ") || text.contains("tests/fixtures/"), "names the file: {text}");
    text
}

#[test]
fn every_truncation_of_a_snapshot_says_it_is_truncated() {
    assert_eq!(message(read_bytes(&[])), "bad.pickle: not a PyTorch memory snapshot: byte 0: the file is empty");
    for name in ["snapshot_p2.pickle", "snapshot_p4.pickle"] {
        let bytes = std::fs::read(fixture(name)).unwrap();
        for len in 1..bytes.len() {
            let text = message(read_bytes(&bytes[..len]));
            assert!(text.contains("truncated"), "{name} cut at {len}: {text}");
        }
    }
}

#[test]
fn opcodes_that_make_objects_are_refused_naming_the_opcode_and_its_offset() {
    let bytes = std::fs::read(fixture("class_instance.pickle")).unwrap();
    let err = read_bytes(&bytes).unwrap_err();
    let TorchSnapshotError::Pickle { offset, ref what, .. } = err else { panic!("{err:?}") };
    assert_eq!(bytes[offset as usize], 0x93, "the offset is the opcode's: {err}");
    assert!(what.starts_with("STACK_GLOBAL (0x93): refused: it names or builds a Python class"), "{what}");
    assert!(err.to_string().contains(&format!("byte {offset}: STACK_GLOBAL")), "{err}");

    let text = message(read_bytes(b"\x80\x02cbuiltins\nset\n)R."));
    assert!(text.contains("byte 2: GLOBAL (0x63): refused"), "{text}");
    let text = message(read_bytes(&[0x80, 4, 0x8c, 1, b'x', b'P', b'.']));
    assert!(text.contains("byte 5: PERSID (0x50)"), "{text}");
    let text = message(read_bytes(&[0x80, 6, b'N', b'.']));
    assert!(text.contains("protocol 6"), "{text}");
}

#[test]
fn a_dict_without_device_traces_says_how_to_record_one() {
    let text = TorchSnapshot::read(fixture("no_device_traces.pickle")).unwrap_err().to_string();
    assert!(
        text.ends_with(
            "no_device_traces.pickle: not a PyTorch memory snapshot: the dict has no `device_traces` (its keys: \
         'segments', 'allocator_settings'); record with torch.cuda.memory._record_memory_history(max_entries=...) \
         before _dump_snapshot"
        ),
        "{text}"
    );
    let text = message(read_bytes(b"\x80\x04]."));
    assert!(text.contains("the pickle holds a list of 0, not the dict"), "{text}");
}

#[test]
fn a_device_out_of_range_names_the_devices_there_are() {
    let err = snapshot("snapshot_p4.pickle").convert(2).unwrap_err();
    assert!(matches!(err, TorchSnapshotError::NoDevice { device: 2, devices: 2, .. }), "{err:?}");
    assert!(err.to_string().ends_with("device 2 asked for, but the snapshot has traces of devices 0 to 1"), "{err}");
    let err = snapshot("unknown_free.pickle").convert(1).unwrap_err().to_string();
    assert!(err.ends_with("device 1 asked for, but the snapshot has a trace of device 0 only"), "{err}");
}

#[test]
fn a_negative_size_names_the_event_and_field() {
    let text = TorchSnapshot::read(fixture("negative_size.pickle")).unwrap_err().to_string();
    assert!(
        text.ends_with("`device_traces[0][0].size` is -4096: a size cannot be negative (in an `alloc` event)"),
        "{text}"
    );
}

#[test]
fn garbage_is_refused_by_its_first_byte_or_its_first_bad_opcode() {
    let mut rng = Rng::new(7);
    for _ in 0..200 {
        let len = 1 + rng.below(300) as usize;
        let mut bytes = rng.bytes(len);
        let text = message(read_bytes(&bytes));
        if bytes[0] != 0x80 {
            assert!(text.contains(&format!("byte 0: the file starts with 0x{:02x}, not 0x80", bytes[0])), "{text}");
        }
        bytes[0] = 0x80;
        bytes[1..].iter_mut().take(1).for_each(|b| *b %= 6);
        let text = message(read_bytes(&bytes));
        assert!(text.contains("not a PyTorch memory snapshot: byte "), "{text}");
    }
}

#[test]
fn a_file_over_the_limit_is_refused_before_it_is_read() {
    let path = scratch("huge.pickle");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(MAX_SNAPSHOT_BYTES + 1).unwrap();
    let err = TorchSnapshot::read(&path).unwrap_err();
    assert!(matches!(err, TorchSnapshotError::TooLarge { bytes, .. } if bytes == MAX_SNAPSHOT_BYTES + 1), "{err}");
    std::fs::remove_file(&path).unwrap();
}

// ---------------------------------------------------------------------------------------------------------------
// The binary

fn umm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_umm"))
        .args(args)
        .env("UMM_BACKENDS", "none")
        .env_remove("UMM_TRACE")
        .output()
        .expect("the umm binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn success(output: &Output) -> String {
    assert!(output.status.success(), "stderr: {}", text(&output.stderr));
    text(&output.stdout)
}

fn failure(output: &Output) -> String {
    let stderr = text(&output.stderr);
    assert!(!output.status.success(), "expected failure; stdout {}", text(&output.stdout));
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn json(output: &Output) -> Vec<serde_json::Value> {
    success(output).lines().map(|l| serde_json::from_str(l).expect("a JSON object per line")).collect()
}

fn path(name: &str) -> String {
    fixture(name).display().to_string()
}

/// The cells of the table row starting with `label`, after it.
fn row(stdout: &str, label: &str) -> Vec<String> {
    let line = stdout.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("row {label} in\n{stdout}"));
    line[label.len()..].split("  ").map(str::trim).filter(|c| !c.is_empty()).map(String::from).collect()
}

#[test]
fn replay_sets_pytorch_peaks_beside_umms_and_says_which_device() {
    let stdout = success(&umm(&["replay", "--repeat", "1", &path("snapshot_p4.pickle")]));
    assert_eq!(row(&stdout, "snapshot_p4")[..2], ["15", "51.91 MiB"], "{stdout}");
    assert!(
        stdout.contains(&format!(
            "snapshot_p4: PyTorch memory snapshot {}, device 0 of 2 (the one with the most events; --device picks \
             another)",
            path("snapshot_p4.pickle")
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "22 events: 6 allocs and 5 frees replayed (free_completed as the free); 4 blocks from before the trace \
             allocated at its start (2 freed in it, 2 in use in the segments; 2.91 MiB); 5 live at its end"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("1 out-of-memory event (largest request 32.00 GiB): counted, not replayed"), "{stdout}");
    assert!(
        stdout.contains(
            "not replayed: 5 free_requested (frees are taken from free_completed), 1 snapshot, 1 user_defined"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("allocator           peak reserved  peak allocated  reserved/allocated"), "{stdout}");
    assert_eq!(row(&stdout, "PyTorch (snapshot)"), ["64.00 MiB", "51.91 MiB", "1.233"], "{stdout}");
    let umm_row = row(&stdout, "umm (sim)");
    assert_eq!(umm_row[1], "51.91 MiB", "{stdout}");
}

#[test]
fn replay_json_carries_the_source_and_pytorchs_figures() {
    let lines = json(&umm(&["replay", "--json", "--repeat", "1", &path("snapshot_p4.pickle")]));
    let r = &lines[0];
    assert_eq!(r["source"], "pytorch-snapshot");
    assert_eq!(r["trace"], "snapshot_p4");
    assert_eq!((r["ops"].as_u64(), r["allocs"].as_u64(), r["frees"].as_u64()), (Some(15), Some(10), Some(5)));
    assert_eq!(r["peak_live_bytes"], DEVICE0_PEAK);
    assert_eq!(r["torch_peak_reserved_bytes"], 64 * MIB);
    assert_eq!(r["torch_peak_allocated_bytes"], DEVICE0_PEAK);
    assert_eq!(
        (r["torch_reserved_at_start"].as_u64(), r["torch_reserved_at_end"].as_u64()),
        (Some(22 * MIB), Some(24 * MIB))
    );
    assert_eq!((r["torch_device"].as_u64(), r["torch_devices"].as_u64()), (Some(0), Some(2)));
    assert_eq!(r["torch_device_busiest"], true);
    assert_eq!((r["torch_events"].as_u64(), r["torch_ooms"].as_u64()), (Some(22), Some(1)));
    assert_eq!(r["torch_free_action"], "free_completed");
    assert_eq!(r["torch_not_replayed"]["snapshot"], 1);
    assert_eq!(r["torch_snapshot"], path("snapshot_p4.pickle"));
    let ratio = r["torch_reserved_over_allocated"].as_f64().unwrap();
    assert!((ratio - 1.232_875_834_533_835).abs() < 1e-9, "{ratio}");
    assert!(r["peak_reserved_bytes"].as_u64().unwrap() >= DEVICE0_PEAK);
    assert!(r["reserved_over_live"].as_f64().unwrap() >= 1.0);

    // --device picks another; a plain trace beside it gets no PyTorch fields.
    let lines = json(&umm(&[
        "replay",
        "--json",
        "--repeat",
        "0",
        "--device",
        "1",
        &path("snapshot_p2.pickle"),
        &format!("{}/../examples/traces/gpt2_train.trace.gz", env!("CARGO_MANIFEST_DIR")),
    ]));
    let r = &lines[0];
    assert_eq!((r["torch_device"].as_u64(), r["torch_device_busiest"].as_bool()), (Some(1), Some(false)));
    assert_eq!((r["ops"].as_u64(), r["torch_peak_reserved_bytes"].as_u64()), (Some(8), Some(8 * MIB)));
    assert_eq!(r["torch_free_action"], "free_requested");
    let plain = lines[1].as_object().unwrap();
    assert_eq!(plain["trace"], "gpt2_train");
    assert!(plain.keys().all(|k| k != "source" && !k.starts_with("torch_")), "{plain:?}");
}

#[test]
fn plan_prints_pytorchs_peak_reserved_beside_the_bound() {
    let stdout = success(&umm(&["plan", &path("snapshot_p4.pickle")]));
    assert!(stdout.contains("PyTorch reserved: the most PyTorch reserved over the snapshot's trace"), "{stdout}");
    assert!(stdout.lines().nth(1).unwrap().ends_with("heuristic  PyTorch reserved  PyTorch/lower"), "{stdout}");
    let cells = row(&stdout, "snapshot_p4");
    // The bound is the peak of live bytes with every block rounded up to 512 bytes.
    assert_eq!(cells[..3], ["51.91 MiB", "51.91 MiB", "1.0000"], "{stdout}");
    assert_eq!(cells[cells.len() - 2..], ["64.00 MiB", "1.2329"], "{stdout}");

    let lines = json(&umm(&["plan", "--json", &path("snapshot_p4.pickle")]));
    let r = &lines[0];
    assert_eq!((r["lower_bound_bytes"].as_u64(), r["plan_peak_bytes"].as_u64()), (Some(54_433_280), Some(54_433_280)));
    assert_eq!(r["source"], "pytorch-snapshot");
    assert_eq!(r["torch_peak_reserved_bytes"], 64 * MIB);
    // A plain trace alone gets the table it always had.
    let stdout =
        success(&umm(&["plan", &format!("{}/../examples/traces/gpt2_train.trace.gz", env!("CARGO_MANIFEST_DIR"))]));
    assert!(!stdout.contains("PyTorch"), "{stdout}");
}

#[test]
fn save_trace_keeps_the_converted_trace_for_later_replays() {
    let out = scratch("cli.trace.gz");
    let output = umm(&["replay", "--repeat", "0", "--save-trace", out.to_str().unwrap(), &path("snapshot_p4.pickle")]);
    success(&output);
    assert!(text(&output.stderr).contains(&format!("snapshot_p4: 15 ops written to {}", out.display())));
    let loaded = Trace::load(&out).unwrap();
    assert_eq!(loaded.ops, device0_ops());
    let lines = json(&umm(&["replay", "--json", "--repeat", "0", out.to_str().unwrap()]));
    assert_eq!((lines[0]["ops"].as_u64(), lines[0]["peak_live_bytes"].as_u64()), (Some(15), Some(DEVICE0_PEAK)));

    let err = failure(&umm(&["replay", "--save-trace", "x.trace", "a.pickle", "b.pickle"]));
    assert!(err.contains("error: --save-trace writes one trace, but 2 inputs were given"), "{err}");
}

#[test]
fn snapshots_are_told_by_their_first_bytes_whatever_their_name() {
    let renamed = scratch("snapshot.bin");
    std::fs::copy(fixture("snapshot_p4.pickle"), &renamed).unwrap();
    let lines = json(&umm(&["replay", "--json", "--repeat", "0", renamed.to_str().unwrap()]));
    assert_eq!((lines[0]["trace"].as_str(), lines[0]["ops"].as_u64()), (Some("snapshot.bin"), Some(15)));
    // 0x80 followed by anything but a protocol from 2 to 5 is binary data, refused as not an umm trace.
    let binary = scratch("binary.bin");
    std::fs::write(&binary, b"\x80\xefxyz").unwrap();
    let stderr = failure(&umm(&["replay", binary.to_str().unwrap()]));
    assert!(stderr.contains("not an umm trace"), "{stderr}");
}

#[test]
fn bad_snapshots_are_errors_naming_the_file_and_the_other_inputs_still_run() {
    let garbage = scratch("garbage.pkl");
    std::fs::write(&garbage, b"PK\x03\x04 not a pickle").unwrap();
    let truncated = scratch("truncated.pickle");
    let bytes = std::fs::read(fixture("snapshot_p2.pickle")).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let cases: [(String, &str); 6] = [
        (garbage.display().to_string(), "byte 0: the file starts with 0x50, not 0x80"),
        (truncated.display().to_string(), "truncated"),
        (path("class_instance.pickle"), "STACK_GLOBAL (0x93): refused"),
        (path("no_device_traces.pickle"), "the dict has no `device_traces`"),
        (path("negative_size.pickle"), "a size cannot be negative"),
        (scratch("missing.pickle").display().to_string(), "No such file"),
    ];
    for (file, expected) in &cases {
        let other = path("unknown_free.pickle");
        for args in [vec!["replay", "--repeat", "0", file, &other], vec!["plan", file, &other]] {
            let (command, output) = (args[0], umm(&args));
            let stderr = failure(&output);
            assert!(stderr.contains(&format!("error: {file}: ")) && stderr.contains(expected), "{command}: {stderr}");
            assert!(text(&output.stdout).contains("unknown_free"), "{command}: the other input ran");
        }
    }
    let stderr = failure(&umm(&["replay", "--device", "7", &path("snapshot_p4.pickle")]));
    assert!(stderr.contains("device 7 asked for, but the snapshot has traces of devices 0 to 1"), "{stderr}");
}

// ---------------------------------------------------------------------------------------------------------------
// Fuzzing

/// Bytes shown escaped, so a failing input can be pasted back into a test.
struct Bytes(Vec<u8>);

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "b\"{}\"", self.0.escape_ascii())
    }
}

/// Opcodes and arguments worth writing over a snapshot: containers, memo references far and near, lengths at
/// their edges, refused opcodes.
const SPLICES: &[&[u8]] = &[
    b"(",
    b")",
    b"]",
    b"}",
    b"e",
    b"u",
    b"s",
    b"a",
    b"t",
    b".",
    b"0",
    b"1",
    b"2",
    b"N",
    b"\x88",
    b"\x94",
    b"h\x00",
    b"h\xff",
    b"j\xff\xff\xff\xff",
    b"q\x05",
    b"r\x00\x00\x00\x80",
    b"\x8a\x08",
    b"\x8a\xff",
    b"\x8b\xff\xff\xff\x7f",
    b"\x8c\xff",
    b"X\xff\xff\xff\xff",
    b"\x8d\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\x95\xff\xff\xff\xff\xff\xff\xff\xff",
    b"J\xff\xff\xff\xff",
    // Every opcode the reader refuses (`REFUSED` in the reader's unit tests), so that a refusal met mid-file,
    // after containers and memo entries, is exercised as well as one at the start.
    b"c",
    b"\x93",
    b"R",
    b"b",
    b"i",
    b"o",
    b"\x81",
    b"\x92",
    b"\x82\x01",
    b"\x83\x01\x00",
    b"\x84\x01\x00\x00\x00",
    b"P",
    b"Q",
    b"\x97",
    b"\x98",
    b"F1.0\n",
    b"I1\n",
    b"L1\n",
    b"S'x'\n",
    b"T\x01\x00\x00\x00x",
    b"U\x01x",
    b"Vx\n",
    b"g0\n",
    b"p0\n",
    b"\x8f",
    b"\x90",
    b"\x91",
    b"\x8c\x05alloc",
    b"\x8c\x04size",
    b"\x8c\x04addr",
    b"\x8c\x0efree_completed",
    b"\x8c\x05state",
];

fn mutate(rng: &mut Rng, fixtures: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = rng.pick(fixtures).clone();
    for _ in 0..rng.range(1, 4) {
        let at = rng.below(bytes.len() as u64 + 1) as usize;
        match rng.below(7) {
            0 => {
                if let Some(b) = bytes.get_mut(at) {
                    *b ^= 1 << rng.below(8);
                }
            }
            1 => {
                if let Some(b) = bytes.get_mut(at) {
                    *b = rng.next_u64() as u8;
                }
            }
            2 => bytes.truncate(at),
            3 => {
                let splice = rng.pick(SPLICES);
                let end = (at + splice.len()).min(bytes.len());
                bytes.splice(at..end, splice.iter().copied());
            }
            4 => {
                let splice = rng.pick(SPLICES);
                bytes.splice(at..at, splice.iter().copied());
            }
            5 => {
                let len = rng.below(64) as usize;
                let from = rng.below(bytes.len() as u64 + 1) as usize;
                let slice: Vec<u8> = bytes[from..(from + len).min(bytes.len())].to_vec();
                bytes.splice(at..at, slice);
            }
            _ => {
                let end = (at + rng.below(32) as usize).min(bytes.len());
                bytes.drain(at..end);
            }
        }
    }
    bytes
}

/// Python values, to write random snapshots as `pickle.dump` would.
enum Py {
    None,
    Bool(bool),
    Int(i128),
    Str(String),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    Dict(Vec<(&'static str, Py)>),
}

/// Writes `value` as protocol 4 opcodes (without frames), memoizing containers now and then.
fn pickle(value: &Py, out: &mut Vec<u8>, rng: &mut Rng) {
    match value {
        Py::None => out.push(b'N'),
        Py::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
        Py::Int(n) => {
            let bytes = n.to_le_bytes();
            let mut len = 16;
            while len > 1
                && ((bytes[len - 1] == 0 && bytes[len - 2] < 0x80)
                    || (bytes[len - 1] == 0xff && bytes[len - 2] >= 0x80))
            {
                len -= 1;
            }
            out.extend_from_slice(&[0x8a, len as u8]);
            out.extend_from_slice(&bytes[..len]);
        }
        Py::Str(text) => {
            out.extend_from_slice(&[0x8c, text.len() as u8]);
            out.extend_from_slice(text.as_bytes());
        }
        Py::List(items) | Py::Tuple(items) => {
            let list = matches!(value, Py::List(_));
            out.extend_from_slice(if list { b"](" } else { b"(" });
            for item in items {
                pickle(item, out, rng);
            }
            out.push(if list { b'e' } else { b't' });
        }
        Py::Dict(items) => {
            out.extend_from_slice(b"}(");
            for (key, item) in items {
                pickle(&Py::Str(key.to_string()), out, rng);
                pickle(item, out, rng);
            }
            out.push(b'u');
        }
    }
    if rng.one_in(4) {
        out.push(0x94);
    }
}

/// A random snapshot: events of every action over a few addresses, sizes and streams at their edges, segments
/// with blocks in every state, fields sometimes missing or of the wrong kind.
fn random_snapshot(rng: &mut Rng) -> Vec<u8> {
    const ACTIONS: &[&str] = &[
        "alloc",
        "alloc",
        "alloc",
        "free_completed",
        "free_completed",
        "free_requested",
        "free_requested",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
        "user_defined",
        "later",
    ];
    let addresses: Vec<i128> = (0..rng.range(1, 8)).map(|_| i128::from(rng.edgy_u64())).collect();
    // One snapshot in four has a few fields missing or of the wrong kind; the others read.
    let sloppy = rng.one_in(4);
    let int = |rng: &mut Rng, values: &[i128]| -> Py {
        match if sloppy { rng.below(200) } else { 99 } {
            0 => Py::Int(-(rng.below(1000) as i128)),
            1 => Py::Str("7".into()),
            2 => Py::None,
            3 => Py::Int(i128::MAX),
            _ => Py::Int(*rng.pick(values)),
        }
    };
    let sizes: Vec<i128> = (0..8).map(|_| i128::from(rng.edgy_u64() >> rng.below(40))).collect();
    let streams = [0i128, 0, 7, 1 << 63, -1, u64::MAX as i128];
    let devices = rng.below(4) as usize;
    let mut traces = Vec::new();
    for _ in 0..devices {
        let events = (0..rng.below(40))
            .map(|_| {
                let mut fields = vec![("action", Py::Str(rng.pick(ACTIONS).to_string()))];
                if !(sloppy && rng.one_in(100)) {
                    fields.push(("addr", int(rng, &addresses)));
                }
                if !(sloppy && rng.one_in(100)) {
                    fields.push(("size", int(rng, &sizes)));
                }
                fields.push(("stream", int(rng, &streams)));
                fields.push(("frames", Py::List(vec![])));
                Py::Dict(fields)
            })
            .collect();
        traces.push(Py::List(events));
    }
    let states = ["active_allocated", "active_pending_free", "inactive", "mystery"];
    let segments = (0..rng.below(5))
        .map(|_| {
            let blocks = (0..rng.below(5))
                .map(|_| {
                    let mut fields = vec![
                        ("size", int(rng, &sizes)),
                        ("requested_size", int(rng, &sizes)),
                        ("state", Py::Str(rng.pick(&states).to_string())),
                    ];
                    if rng.one_in(2) {
                        fields.push(("address", int(rng, &addresses)));
                    }
                    Py::Dict(fields)
                })
                .collect();
            Py::Dict(vec![
                ("device", Py::Int(rng.below(devices as u64 + 2) as i128)),
                ("address", int(rng, &addresses)),
                ("total_size", int(rng, &sizes)),
                ("stream", int(rng, &streams)),
                ("segment_pool_id", Py::Tuple(vec![Py::Int(0), Py::Int(0)])),
                ("is_expandable", Py::Bool(rng.one_in(2))),
                ("blocks", Py::List(blocks)),
            ])
        })
        .collect();
    let snapshot = Py::Dict(vec![("segments", Py::List(segments)), ("device_traces", Py::List(traces))]);
    let mut out = vec![0x80, 4];
    pickle(&snapshot, &mut out, rng);
    out.push(b'.');
    out
}

/// A read snapshot converted on every device (and one past them): each conversion is a consistent trace that
/// writes and reads back the same, or an error naming the device.
fn check_snapshot(snapshot: &TorchSnapshot) -> Result<(), String> {
    for device in 0..=snapshot.devices() {
        let converted = match snapshot.convert(device) {
            Ok(converted) => converted,
            Err(TorchSnapshotError::NoDevice { device: d, .. }) if d == snapshot.devices() => continue,
            Err(e) => return Err(format!("device {device}: {e}")),
        };
        let (t, f) = (&converted.trace, &converted.figures);
        if t.allocs - t.frees != f.live_at_end
            || t.peak_live_bytes != f.torch_peak_allocated_bytes
            || f.live_before_bytes > f.torch_peak_allocated_bytes
            || f.torch_peak_reserved_bytes < f.reserved_at_start.max(f.reserved_at_end)
        {
            return Err(format!("device {device}: figures disagree: {t:?} {f:?}"));
        }
        if t.ops.iter().any(|op| matches!(*op, Op::Alloc { slot, .. } | Op::Free { slot } if slot >= t.slots)) {
            return Err(format!("device {device}: a slot past {}", t.slots));
        }
        let mut out = TraceWriter::new(Vec::new()).map_err(|e| e.to_string())?;
        t.write(&mut out).map_err(|e| e.to_string())?;
        let text = out.finish().map_err(|e| e.to_string())?;
        let again = Trace::from_reader(t.name.clone(), "written", &text[..]).map_err(|e| e.to_string())?;
        if again.ops != t.ops {
            return Err(format!("device {device}: the written trace reads back different ops"));
        }
    }
    Ok(())
}

fn snapshot_target(cases: u64) {
    let fixtures: Vec<Vec<u8>> =
        ["snapshot_p2.pickle", "snapshot_p4.pickle", "snapshot_p5.pickle", "unknown_free.pickle"]
            .iter()
            .map(|name| std::fs::read(fixture(name)).unwrap())
            .collect();
    let read = AtomicU64::new(0);
    run(
        "PyTorch snapshot reader",
        cases,
        |rng| {
            let random = if rng.one_in(2) { vec![random_snapshot(rng)] } else { Vec::new() };
            Bytes(match random.first() {
                Some(snapshot) if rng.one_in(2) => snapshot.clone(),
                Some(_) => mutate(rng, &random),
                None => mutate(rng, &fixtures),
            })
        },
        |Bytes(input)| match TorchSnapshot::from_bytes("fuzz", "fuzz.pickle", input) {
            Ok(snapshot) => {
                read.fetch_add(1, Ordering::Relaxed);
                check_snapshot(&snapshot)
            }
            Err(e) => {
                let text = e.to_string();
                if text.starts_with("fuzz.pickle: not a PyTorch memory snapshot: ") {
                    Ok(())
                } else {
                    Err(format!("an error that does not say what the file is not: {text}"))
                }
            }
        },
    );
    // Mutations that leave a readable snapshot exercise the conversion: they must not be rare.
    let read = read.into_inner();
    eprintln!("{read} of {cases} mutated snapshots read");
    assert!(cases < 1000 || read * 20 > cases, "only {read} of {cases} mutated snapshots read");
}

#[test]
fn mutated_snapshots_read_or_fail_cleanly() {
    snapshot_target(cases(CI_CASES));
}

#[test]
#[ignore = "100,000 cases: run with --release -- --ignored"]
fn mutated_snapshots_read_or_fail_cleanly_long() {
    snapshot_target(cases(LONG_CASES));
}
