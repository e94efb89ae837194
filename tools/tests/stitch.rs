//! Stitched blocks through a replay of a recorded training trace: free pages scattered over the reservation
//! serve the large requests that no free range holds, so reserved memory stays near the live peak; with
//! `UMM_STITCH=off` the same replay maps new pages and reserves more.

use umm::trace::Trace;
use umm_tools::replay::{replay_on, ReplayOptions, StepMarks};

#[test]
fn a_replay_of_gpt2_training_reserves_less_with_stitched_blocks_than_without() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/gpt2_train.trace.gz");
    let trace = Trace::load(path).unwrap();
    let opts = || ReplayOptions { repeat: 2, steps: StepMarks::Off, ..ReplayOptions::default() };
    let stitched = replay_on("sim", &trace, opts()).unwrap();
    // The one test of this file: the variable is set for the second replay alone.
    std::env::set_var("UMM_STITCH", "off");
    let plain = replay_on("sim", &trace, opts()).unwrap();
    std::env::remove_var("UMM_STITCH");
    assert!(stitched.stitches > 0 && stitched.stitched_allocs >= stitched.stitches, "{stitched:?}");
    assert_eq!((plain.stitches, plain.stitched_allocs), (0, 0), "{plain:?}");
    let ratio = |bytes: u64| bytes as f64 / stitched.peak_live_bytes as f64;
    // 1.029 against 1.073 on the simulated device with 32 MiB pages.
    assert!(ratio(stitched.peak_reserved_bytes_last) <= 1.035, "{stitched:?}");
    assert!(
        stitched.peak_reserved_bytes_last + (256 << 20) <= plain.peak_reserved_bytes_last,
        "{stitched:?} {plain:?}"
    );
}
