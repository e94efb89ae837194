//! Repeating steps through the public API: the manager's `mark_step` plans a repeating step of
//! `allocate_universal` buffers (whose bytes stay right), a trace records step marks as `s` lines that
//! `umm replay` follows, and a replay with a step per pass serves its last pass from a plan.

use umm::trace::{Trace, TraceError};
use umm::{Placement, StepOutcome, UniversalMemoryManager};
use umm_tools::replay::{replay_on, ReplayOptions, StepMarks};

const MIB: usize = 1 << 20;

fn host_only() -> UniversalMemoryManager {
    UniversalMemoryManager::builder().backends(false, false, false).build().unwrap()
}

#[test]
fn the_manager_plans_a_repeating_step_and_its_buffers_keep_their_bytes() {
    let mm = host_only();
    mm.mark_step();
    let mut outcomes = Vec::new();
    for step in 0..6u32 {
        // A forward pass: activations of varied sizes, each filled and checked before the next is freed.
        let mut live = Vec::new();
        for (i, len) in [MIB, 3 * MIB, MIB / 2, 5 * MIB, 2 * MIB].into_iter().enumerate() {
            let mut buf = mm.allocate_universal::<u32>(len / 4, Placement::Auto).unwrap();
            buf.fill(step * 10 + i as u32).unwrap();
            live.push(buf);
        }
        for (i, buf) in live.iter().enumerate() {
            assert!(buf.as_slice().unwrap().iter().all(|&v| v == step * 10 + i as u32), "step {step} buffer {i}");
        }
        drop(live);
        let steps = mm.mark_step();
        // Host memory is the only device: one pool serves every buffer.
        assert_eq!(steps.len(), 1, "{steps:?}");
        outcomes.push(steps[0].report.outcome);
    }
    assert!(outcomes.contains(&StepOutcome::PlanMade), "{outcomes:?}");
    assert_eq!(outcomes.last(), Some(&StepOutcome::Planned), "{outcomes:?}");
    let total = mm.global_memory_stats().total;
    assert!(total.num_planned_allocs >= 5 * 3, "{total:?}");
    assert!(total.planned_bytes >= 23 * MIB as u64 / 2, "{total:?}");
    assert_eq!(total.num_plan_fallbacks, 0, "{total:?}");
}

#[test]
fn trace_step_marks_are_read_and_refused_with_extra_fields() {
    let text = "# umm-trace v1\ns\na 0 4096 0\nf 0\ns\na 1 4096 0\nf 1\ns\n";
    let trace = Trace::parse_str("steps", "steps.trace", text).unwrap();
    assert_eq!(trace.steps, [0, 2, 4]);
    let err = Trace::parse_str("bad", "bad.trace", "# umm-trace v1\ns 3\n").unwrap_err();
    assert!(matches!(err, TraceError::Malformed { line: 2, .. }), "{err}");
    assert!(err.to_string().contains("unexpected extra field `3`"), "{err}");
}

/// `steps` steps of a training loop, each ended by a mark: activations allocated on the way forward (with a
/// temporary freed at once after every third), freed in reverse on the way back.
fn marked_trace(steps: u64) -> Trace {
    let mut text = String::from("# umm-trace v1\n");
    let sizes = [3u64 << 20, 1 << 20, 12 << 20, 5 << 20, 7 << 20, 2 << 20];
    for step in 0..steps {
        let id = |local: u64| step * 100 + local;
        for (local, size) in sizes.iter().enumerate() {
            text.push_str(&format!("a {} {size} 0\n", id(local as u64)));
            if local % 3 == 2 {
                text.push_str(&format!("a {} 65536 0\nf {}\n", id(50 + local as u64), id(50 + local as u64)));
            }
        }
        for local in (0..sizes.len() as u64).rev() {
            text.push_str(&format!("f {}\n", id(local)));
        }
        text.push_str("s\n");
    }
    Trace::parse_str("marked", "marked.trace", &text).unwrap()
}

#[test]
fn a_replay_follows_the_traces_step_marks_and_serves_repeats_from_a_plan() {
    let trace = marked_trace(8);
    assert_eq!(trace.steps.len(), 8);
    let opts = ReplayOptions { repeat: 2, ..ReplayOptions::default() };
    let report = replay_on("sim", &trace, opts).unwrap();
    assert_eq!(report.steps, 24, "{report:?}");
    assert!(report.steps_planned >= 20, "{report:?}");
    assert_eq!(report.plan_fallbacks, 0, "{report:?}");
    assert!(report.planned_allocs > 0, "{report:?}");
    let off = replay_on("sim", &trace, ReplayOptions { repeat: 2, steps: StepMarks::Off, ..ReplayOptions::default() })
        .unwrap();
    assert_eq!((off.steps, off.steps_planned, off.planned_allocs), (0, 0, 0), "{off:?}");
}

#[test]
fn a_replay_with_a_step_per_pass_reaches_the_traces_peak_in_its_last_pass() {
    let trace = Trace::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/traces/resnet50_train.trace.gz"))
        .or_else(|_| Trace::load("examples/traces/resnet50_train.trace.gz"))
        .unwrap();
    let opts = ReplayOptions { repeat: 3, steps: StepMarks::Pass, ..ReplayOptions::default() };
    let report = replay_on("sim-plain", &trace, opts).unwrap();
    assert_eq!((report.steps, report.steps_planned), (5, 2), "{report:?}");
    let over = report.peak_reserved_bytes_last as f64 / report.peak_live_bytes as f64;
    assert!(over < 1.01, "last pass {over:.3} of peak live: {report:?}");
    assert!(report.reserved_over_live.unwrap() > over, "{report:?}");
}
