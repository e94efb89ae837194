//! Seeing the memory: snapshots, the leak report, the timeline plot, trace recording and the CLI commands that
//! expose them, through the public API and the built `umm` binary.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use umm::observe::{snapshot_trace, SnapshotAt};
use umm::trace::{Op, Trace};
use umm::{AllocOptions, DeviceSelector, EventKind, Placement, Snapshot, UniversalMemoryManager};
use umm_tools::plot::{render_svg, PlotOptions, Timeline};
use umm_tools::replay::{replay_on, ReplayOptions};

const MIB: u64 = 1 << 20;

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("umm-observability-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Host plus one simulated 1 GiB device; profiler as asked.
fn manager(profile: bool) -> UniversalMemoryManager {
    UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(1 << 30)
        .profile(profile)
        .build()
        .unwrap()
}

fn on_sim() -> AllocOptions {
    AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1))
}

/// Messages logged by the library, captured by a logger installed once for this test binary.
fn logged() -> &'static Mutex<Vec<String>> {
    static LOGGED: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    static LOGGER: Capture = Capture;
    struct Capture;
    impl log::Log for Capture {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &log::Record<'_>) {
            logged().lock().unwrap().push(format!("{} {}", record.level(), record.args()));
        }
        fn flush(&self) {}
    }
    let messages = LOGGED.get_or_init(|| Mutex::new(Vec::new()));
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    messages
}

#[test]
fn snapshot_round_trips_through_json_with_labels_call_sites_and_events() {
    let mm = manager(true);
    let weights = mm.allocate_universal_with::<f32>(MIB as usize, on_sim().label("weights")).unwrap();
    let line = line!() - 1;
    let activations = mm.allocate_universal_with::<u8>(3 * MIB as usize, on_sim().label("activations")).unwrap();
    let staging = mm.allocate_universal_with::<u8>(4096, AllocOptions::new().label("staging")).unwrap();
    drop(activations);
    let snapshot = mm.snapshot();

    let json = snapshot.to_json();
    let back = Snapshot::from_json("test", &json).unwrap();
    assert_eq!(back, snapshot);
    let path = temp_dir().join("round_trip.json");
    snapshot.save(&path).unwrap();
    assert_eq!(Snapshot::load(&path).unwrap(), snapshot);

    // Live blocks carry their label and call site; the freed one is a free (cached) block.
    let block = snapshot.blocks().find(|b| b.label.as_deref() == Some("weights")).expect("weights block");
    assert!(!block.free && block.requested == Some(4 * MIB) && block.size >= 4 * MIB);
    let site = block.call_site.as_ref().unwrap();
    assert!(site.file.ends_with("observability.rs") && site.line == line, "{site}");
    assert!(snapshot.blocks().all(|b| b.label.as_deref() != Some("activations")));
    assert!(snapshot.blocks().any(|b| b.free), "the freed block stays cached in its segment");
    assert!(snapshot.pools.iter().any(|p| p.device == 1 && !p.segments.is_empty()));
    assert!(snapshot.pools.iter().any(|p| p.device == 0));
    // The blocks' walk agrees with the pools' own counters, and covers the two live buffers.
    assert_eq!(snapshot.live_bytes(), mm.global_memory_stats().total.allocated_bytes.current);
    assert!(snapshot.live_bytes() >= 4 * MIB + 4096, "{}", snapshot.live_bytes());

    // Events: three allocations, one free, and the pools' growth as segment events.
    let kinds: Vec<EventKind> = snapshot.events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds.iter().filter(|&&k| k == EventKind::Alloc).count(), 3, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|&&k| k == EventKind::Free).count(), 1, "{kinds:?}");
    assert!(kinds.contains(&EventKind::SegmentAlloc), "{kinds:?}");
    let free = snapshot.events.iter().find(|e| e.kind == EventKind::Free).unwrap();
    assert_eq!((free.label.as_deref(), free.bytes), (Some("activations"), 3 * MIB));
    assert!(snapshot.events.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
    drop((weights, staging));
}

#[test]
fn profiler_off_records_no_events_but_still_tracks_live_buffers() {
    let mm = manager(false);
    let a = mm.allocate_universal_with::<u8>(1000, on_sim().label("a")).unwrap();
    assert!(mm.profiler().events().is_empty() && !mm.profiler().is_enabled());
    assert_eq!(mm.leak_report().total_bytes, 1000);
    mm.profiler().set_enabled(true);
    drop(a);
    let b = mm.allocate_universal_with::<u8>(2000, on_sim()).unwrap();
    // The first event of a pool seen while recording reports what it holds then (a segment event).
    let events = mm.profiler().events();
    let kinds: Vec<_> = events.iter().map(|e| (e.kind, e.bytes)).collect();
    assert_eq!(kinds, [(EventKind::Free, 1000), (EventKind::SegmentAlloc, 2 * MIB), (EventKind::Alloc, 2000)]);
    mm.profiler().clear();
    assert!(mm.profiler().events().is_empty());
    drop(b);
    assert!(mm.leak_report().is_empty());
}

#[test]
fn a_deliberate_leak_is_reported_with_its_file_and_line_and_logged_when_the_manager_drops() {
    let messages = logged();
    let mm = manager(false);
    let fine = mm.allocate_universal::<f32>(100, Placement::Auto).unwrap();
    drop(fine);
    let leak = mm.allocate_universal_with::<f64>(512, on_sim().label("leaky-cache-7f3a")).unwrap();
    let line = line!() - 1;
    let report = mm.leak_report();
    assert_eq!(report.len(), 1, "{report}");
    let live = &report.allocations[0];
    assert_eq!((live.label.as_deref(), live.bytes, live.device), (Some("leaky-cache-7f3a"), 4096, 1));
    assert!(live.call_site.file.ends_with("tests/observability.rs"), "{}", live.call_site);
    assert_eq!(live.call_site.line, line);
    let text = report.to_string();
    assert!(text.contains(&format!("observability.rs:{line}:")) && text.contains("leaky-cache-7f3a"), "{text}");

    drop(mm);
    let expected = format!("observability.rs:{line}:");
    let found = messages.lock().unwrap().iter().any(|m| {
        m.starts_with("WARN") && m.contains("leaky-cache-7f3a") && m.contains(&expected) && m.contains("4.00 KiB")
    });
    assert!(found, "no warning naming the leak: {:?}", messages.lock().unwrap());
    drop(leak);
}

#[test]
fn leak_report_lines_give_the_size_of_each_buffer_and_the_total_apart() {
    let site = |line| umm::CallSite { file: "src/main.rs".into(), line, column: 5 };
    let live = |id, bytes, line, label: Option<&str>| umm::LiveAllocation {
        id,
        device: 0,
        pool: umm::PoolKind::Host,
        api: None,
        bytes,
        stream: 0,
        label: label.map(str::to_string),
        call_site: site(line),
    };
    let mut allocations: Vec<_> = (1..=5).map(|id| live(id, 512, 10, Some("cache"))).collect();
    allocations.extend([live(6, 256, 20, None), live(7, 1024, 20, None), live(8, 4096, 30, None)]);
    let total_bytes = allocations.iter().map(|a| a.bytes).sum();
    let text = umm::LeakReport { allocations, total_bytes }.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "8 live buffer(s), 7.75 KiB (7936 bytes):", "{text}");
    assert!(lines.contains(&"  5 × 512 B (2.50 KiB in all) \"cache\" at src/main.rs:10:5"), "{text}");
    assert!(lines.contains(&"  2 × 256 B to 1.00 KiB (1.25 KiB in all) at src/main.rs:20:5"), "{text}");
    assert!(lines.contains(&"  1 × 4.00 KiB at src/main.rs:30:5"), "one buffer: no total: {text}");
}

/// The child half of the leak-warning tests: leaks five 512-byte buffers past their manager's drop, with the
/// leak warning as `LEAK_WARNING_CHILD` says (`default` or `builder-off`). Does nothing unless asked.
#[test]
fn leak_warning_child() {
    let Some(mode) = std::env::var_os("LEAK_WARNING_CHILD") else { return };
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .leak_warning(mode != "builder-off")
        .build()
        .unwrap();
    let buffers: Vec<_> =
        (0..5).map(|_| mm.allocate_universal_with::<u8>(512, AllocOptions::new().label("kept")).unwrap()).collect();
    drop(mm);
    drop(buffers);
}

/// Runs `leak_warning_child` in a fresh process (no logger installed) and returns its stderr.
fn leak_warning_stderr(mode: &str, vars: &[(&str, &str)]) -> String {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["leak_warning_child", "--exact", "--nocapture", "--test-threads=1"])
        .env("LEAK_WARNING_CHILD", mode)
        .env_remove("UMM_LEAK_WARNING")
        .envs(vars.iter().copied())
        .output()
        .unwrap();
    assert!(output.status.success(), "child failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn without_a_logger_the_leak_warning_goes_to_stderr_unless_turned_off() {
    let stderr = leak_warning_stderr("default", &[]);
    assert!(stderr.contains("umm: warning: memory manager dropped while buffers are alive"), "{stderr}");
    assert!(stderr.contains("5 × 512 B (2.50 KiB in all) \"kept\""), "{stderr}");
    assert!(stderr.contains("UMM_LEAK_WARNING=0"), "says how to silence it: {stderr}");
    for (mode, vars) in [("default", &[("UMM_LEAK_WARNING", "0")][..]), ("builder-off", &[])] {
        let stderr = leak_warning_stderr(mode, vars);
        assert!(!stderr.contains("dropped while buffers are alive"), "{mode} {vars:?}: {stderr}");
    }
    // Without the live table there is nothing to list, but the pools' counts still say buffers are alive.
    let stderr = leak_warning_stderr("default", &[("UMM_LIVE_TABLE", "0")]);
    assert!(stderr.contains("memory manager dropped while 5 buffer(s) of 2560 bytes are alive"), "{stderr}");
    assert!(stderr.contains("UMM_LIVE_TABLE=1") && !stderr.contains("\"kept\""), "{stderr}");
}

#[test]
fn without_the_live_table_leak_reports_are_empty_but_profiled_buffers_are_still_entered() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).live_table(false).build().unwrap();
    let quiet = mm.allocate_universal_with::<u8>(100, AllocOptions::new().label("unlisted")).unwrap();
    assert!(mm.leak_report().is_empty(), "{}", mm.leak_report());
    mm.profiler().set_enabled(true);
    let profiled = mm.allocate_universal_with::<u8>(200, AllocOptions::new().label("profiled")).unwrap();
    let report = mm.leak_report();
    assert_eq!(report.len(), 1, "{report}");
    assert_eq!((report.allocations[0].label.as_deref(), report.allocations[0].bytes), (Some("profiled"), 200));
    // Freed while profiling: the unentered buffer's drop finds nothing to remove; the entered one leaves.
    drop(quiet);
    drop(profiled);
    assert!(mm.leak_report().is_empty());
    let frees = mm.profiler().events().iter().filter(|e| e.kind == umm::EventKind::Free).count();
    assert_eq!(frees, 1, "only the entered buffer's free is an event");
    assert_eq!(mm.global_memory_stats().total.active_blocks.current, 0);
}

/// A deterministic trace of `n` allocations with mixed sizes and lifetimes, some left live.
fn synthetic_trace(n: u64, seed: u64) -> Trace {
    let mut text = String::from("# umm-trace v1\n");
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        state >> 33
    };
    let mut live: Vec<u64> = Vec::new();
    for id in 0..n {
        let bytes = 512 * (1 + next() % 64) * if next() % 7 == 0 { 100 } else { 1 };
        text.push_str(&format!("a {id} {bytes} {}\n", next() % 2));
        live.push(id);
        while live.len() > 3 && next() % 3 != 0 {
            let victim = live.remove((next() % live.len() as u64) as usize);
            text.push_str(&format!("f {victim}\n"));
        }
    }
    Trace::parse_str("synthetic", "synthetic", &text).unwrap()
}

/// Live bytes after each op and the first op where they are highest, computed straight from the ops.
fn trace_peak(trace: &Trace) -> (u64, u64) {
    let mut sizes = vec![0u64; trace.slots as usize];
    let (mut live, mut best) = (0u64, (0u64, 0u64));
    for (i, op) in trace.ops.iter().enumerate() {
        match *op {
            Op::Alloc { slot, bytes, .. } => {
                sizes[slot as usize] = bytes;
                live += bytes;
            }
            Op::Free { slot } => live -= sizes[slot as usize],
        }
        if live > best.1 {
            best = (i as u64, live);
        }
    }
    best
}

fn attr<T: std::str::FromStr>(node: roxmltree::Node<'_, '_>, name: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    node.attribute(name).unwrap_or_else(|| panic!("no {name}")).parse().unwrap()
}

fn points(node: roxmltree::Node<'_, '_>) -> Vec<(f64, f64)> {
    node.attribute("points")
        .unwrap()
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap();
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

#[test]
fn plot_has_one_shape_per_allocation_and_the_peak_where_the_trace_peaks() {
    let trace = synthetic_trace(300, 42);
    let timeline = Timeline::from_trace(&trace);
    let svg = render_svg(&timeline, &PlotOptions { max_shapes: 10_000, ..PlotOptions::default() });
    let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");

    let shapes: Vec<_> = doc.descendants().filter(|n| n.attribute("class") == Some("alloc")).collect();
    assert_eq!(shapes.len() as u64, trace.allocs, "one polygon per allocation");
    assert!(doc.descendants().all(|n| n.attribute("class") != Some("other")), "nothing merged");
    // A legend says what the colours and lines mean.
    let legend = doc.descendants().find(|n| n.attribute("class") == Some("legend")).expect("a legend");
    let keys: Vec<&str> = legend.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text()).collect();
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert!(keys[0].starts_with("one allocation") && keys[2] == "reserved by the pools", "{keys:?}");
    // Each shape is the allocation it says: ids in order, sizes and lifetimes as in the trace.
    let mut slot_alloc = vec![0usize; trace.slots as usize];
    let mut expected: Vec<(u64, u64, u64)> = Vec::new();
    for (i, op) in trace.ops.iter().enumerate() {
        match *op {
            Op::Alloc { slot, bytes, .. } => {
                slot_alloc[slot as usize] = expected.len();
                expected.push((bytes, i as u64, trace.ops.len() as u64));
            }
            Op::Free { slot } => expected[slot_alloc[slot as usize]].2 = i as u64,
        }
    }
    for (k, shape) in shapes.iter().enumerate() {
        assert_eq!(attr::<usize>(*shape, "data-id"), k);
        let got = (attr::<u64>(*shape, "data-bytes"), attr::<u64>(*shape, "data-start"), attr(*shape, "data-end"));
        assert_eq!(got, expected[k], "allocation {k}");
        assert!(shape.descendants().any(|n| n.has_tag_name("title")), "allocation {k} has a tooltip");
    }

    // The peak marker is at the trace's peak, and the stacked shapes reach exactly its height there.
    let (peak_op, peak_bytes) = trace_peak(&trace);
    assert_eq!(peak_bytes, trace.peak_live_bytes);
    let peak = doc.descendants().find(|n| n.attribute("class") == Some("peak")).expect("peak marker");
    assert_eq!((attr::<u64>(peak, "data-step"), attr::<u64>(peak, "data-bytes")), (peak_op, peak_bytes));
    let line = peak.descendants().find(|n| n.has_tag_name("line")).unwrap();
    let peak_y: f64 = attr(line, "y1");
    let top = shapes.iter().flat_map(|s| points(*s)).map(|p| p.1).fold(f64::INFINITY, f64::min);
    assert!((top - peak_y).abs() <= 0.11, "highest shape at y={top}, peak line at y={peak_y}");
    // Live at the peak: the shapes spanning that op, whose heights add up to the peak.
    let live_at_peak: u64 = expected.iter().filter(|(_, s, e)| *s <= peak_op && peak_op < *e).map(|x| x.0).sum();
    assert_eq!(live_at_peak, peak_bytes);
}

#[test]
fn plot_of_a_snapshot_has_a_panel_per_device_and_merges_small_allocations_when_asked() {
    let mm = manager(true);
    let mut keep = Vec::new();
    for i in 0..40u64 {
        let options = if i % 2 == 0 { on_sim() } else { AllocOptions::new().device(DeviceSelector::Host) };
        keep.push(mm.allocate_universal_with::<u8>(((i % 5 + 1) * 64 * 1024) as usize, options).unwrap());
        if i % 3 == 0 {
            keep.remove(0);
        }
    }
    let snapshot = mm.snapshot();
    let timeline = Timeline::from_snapshot(&snapshot, "two-devices").unwrap();
    assert_eq!(timeline.panels.len(), 2);
    let svg = render_svg(&timeline, &PlotOptions { max_shapes: 10, ..PlotOptions::default() });
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let panels: Vec<_> = doc.descendants().filter(|n| n.attribute("class") == Some("panel")).collect();
    assert_eq!(panels.len(), 2);
    for panel in panels {
        let shapes = panel.descendants().filter(|n| n.attribute("class") == Some("alloc")).count();
        let other = panel.descendants().find(|n| n.attribute("class") == Some("other")).expect("an other band");
        assert_eq!(shapes, 10);
        assert_eq!(shapes + attr::<usize>(other, "data-count"), 20);
    }
}

#[test]
fn a_trace_file_that_cannot_be_created_is_named_with_how_it_was_asked_for() {
    let err = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .record_trace("/nonexistent/dir/x.trace")
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/dir/x.trace") && err.contains("UMM_TRACE or Builder::record_trace"), "{err}");
}

#[test]
fn a_recorded_trace_replays_to_the_same_peak_live_bytes() {
    for name in ["recorded.trace", "recorded.trace.gz"] {
        let path = temp_dir().join(name);
        let mm = UniversalMemoryManager::builder()
            .backends(false, false, false)
            .simulated_device(1 << 30)
            .record_trace(&path)
            .build()
            .unwrap();
        let recorded = mm.profiler().trace_path().unwrap().to_path_buf();
        let (mut live, mut peak) = (0u64, 0u64);
        let mut buffers = Vec::new();
        for i in 0..500usize {
            let n = 256 * (1 + (i * 7919) % 37);
            let options = if i % 3 == 0 { AllocOptions::new() } else { on_sim().stream(umm::StreamId((i % 2) as u64)) };
            buffers.push(mm.allocate_universal_with::<u32>(n, options).unwrap());
            live += 4 * n as u64;
            peak = peak.max(live);
            if i % 4 != 0 {
                let b = buffers.swap_remove((i * 31) % buffers.len());
                live -= b.size_bytes();
            }
        }
        let _empty = mm.allocate_universal::<u8>(0, Placement::Auto).unwrap(); // not in the trace
        drop(mm); // buffers outlive the manager; the trace is complete once they are dropped too
        drop(buffers);
        drop(_empty);

        let trace = Trace::load(&recorded).unwrap();
        assert_eq!(trace.allocs, 500, "{name}");
        assert_eq!(trace.peak_live_bytes, peak, "{name}");
        assert_eq!(trace.streams, 2);
        let report = replay_on("sim", &trace, ReplayOptions::with_repeat(1)).unwrap();
        assert_eq!(report.peak_live_bytes, peak);
        assert_eq!(report.ooms, 0);
    }
}

#[test]
fn snapshot_of_a_trace_replay_holds_the_trace_live_blocks() {
    let trace = synthetic_trace(200, 7);
    let (at_end, ooms) = snapshot_trace(&trace, 8 << 30, None, SnapshotAt::End).unwrap();
    assert_eq!(ooms, 0);
    let allocs = at_end.events.iter().filter(|e| e.kind == EventKind::Alloc).count() as u64;
    assert_eq!(allocs, trace.allocs);
    let left_live: u64 = {
        let timeline = Timeline::from_trace(&trace);
        timeline.panels[0].spans.iter().filter(|s| s.end.is_none()).map(|s| s.bytes).sum()
    };
    let requested: u64 = at_end.blocks().filter_map(|b| b.requested).sum();
    assert_eq!(requested, left_live);
    let (at_peak, _) = snapshot_trace(&trace, 8 << 30, None, SnapshotAt::Peak).unwrap();
    assert_eq!(at_peak.blocks().filter_map(|b| b.requested).sum::<u64>(), trace.peak_live_bytes);
    // Its timeline peaks where the trace does.
    let timeline = Timeline::from_snapshot(&at_end, "t").unwrap();
    assert_eq!(timeline.panels[0].peak().1, trace.peak_live_bytes);
}

fn umm(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_umm")).args(args).env_remove("UMM_TRACE").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "umm {args:?} failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn cli_devices_snapshot_and_plot() {
    let dir = temp_dir();
    let json = umm(&["devices", "--json", "--sim", "2GiB"]);
    let table: serde_json::Value = serde_json::from_str(&json).unwrap();
    let devices = table["devices"].as_array().unwrap();
    assert_eq!(devices[0]["kind"], "host");
    let sim = devices.iter().find(|d| d["kind"] == "simulated").expect("the simulated device");
    assert_eq!(sim["total_bytes"], 2u64 << 30);
    assert!(sim["alignment"][0].as_u64().unwrap() > 0);
    let text = umm(&["devices", "--sim", "2GiB"]);
    assert!(text.contains("align") && text.contains("sim0") && text.contains("2.00 GiB"), "{text}");

    let trace_path = dir.join("cli.trace");
    let mut text = String::from("# umm-trace v1\n");
    for id in 0..50 {
        text.push_str(&format!("a {id} {} 0\n", (id % 4 + 1) * 1_000_000));
        if id % 2 == 1 {
            text.push_str(&format!("f {}\n", id - 1));
        }
    }
    std::fs::write(&trace_path, text).unwrap();
    let snap = dir.join("cli_snapshot.json");
    let svg = dir.join("cli_timeline.svg");
    umm(&["snapshot", trace_path.to_str().unwrap(), "-o", snap.to_str().unwrap(), "--at", "peak"]);
    let snapshot = Snapshot::load(&snap).unwrap();
    assert!(!snapshot.events.is_empty());
    let out = umm(&["plot", snap.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(out.contains("peak"), "{out}");
    roxmltree::Document::parse(&std::fs::read_to_string(&svg).unwrap()).unwrap();
    umm(&["plot", trace_path.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    let svg_text = std::fs::read_to_string(&svg).unwrap();

    // UMM_TRACE records any program's allocations, this one's too: the replay inside `umm snapshot` records a
    // trace with the same peak as the one it replays.
    let recorded = dir.join("cli_recorded.trace.gz");
    let out = Command::new(env!("CARGO_BIN_EXE_umm"))
        .args(["snapshot", trace_path.to_str().unwrap(), "-o", snap.to_str().unwrap()])
        .env("UMM_TRACE", &recorded)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let original = Trace::load(&trace_path).unwrap();
    let again = Trace::load(&recorded).unwrap();
    // The same allocations and peak; blocks the trace leaves live are freed when the replay ends.
    assert_eq!((again.allocs, again.peak_live_bytes), (original.allocs, original.peak_live_bytes));
    assert_eq!(again.frees, again.allocs);
    let doc = roxmltree::Document::parse(&svg_text).unwrap();
    assert_eq!(doc.descendants().filter(|n| n.attribute("class") == Some("alloc")).count(), 50);
}

#[test]
fn a_training_trace_plot_stays_small() {
    // The same file as ../shared/traces/resnet50_train.trace.gz, committed so that this test always runs: where
    // the test was built, else beside where it runs (a binary carried elsewhere, as `scripts/gpu_suites.sh` does).
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/resnet50_train.trace.gz");
    let path = if built.exists() { built } else { Path::new("examples/traces/resnet50_train.trace.gz").to_path_buf() };
    let timeline = Timeline::load(&path).unwrap();
    let options = PlotOptions::default();
    let svg = render_svg(&timeline, &options);
    assert!(svg.len() < 400_000, "{} bytes", svg.len());
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let shapes = doc.descendants().filter(|n| n.attribute("class") == Some("alloc")).count();
    assert_eq!(shapes, options.max_shapes.min(timeline.panels[0].spans.len()));
    let peak = doc.descendants().find(|n| n.attribute("class") == Some("peak")).unwrap();
    let trace = Trace::load(&path).unwrap();
    assert_eq!(attr::<u64>(peak, "data-bytes"), trace.peak_live_bytes);
}
