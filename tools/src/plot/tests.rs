use super::svg::{nice_byte_step, nice_ceiling, nice_decimal_step};
use super::*;
use umm::trace::Trace;

#[test]
fn ticks_are_round() {
    assert_eq!(nice_byte_step(6 << 30), 1 << 30);
    assert_eq!(nice_byte_step(100), 16);
    assert_eq!(nice_byte_step(2100 << 10), 512 << 10);
    assert_eq!(nice_ceiling(5_762_142_352), 6 << 30);
    assert_eq!(nice_decimal_step(5081), 500);
    assert_eq!(umm_placement::units::short_bytes(3 << 29), "1.5 GiB");
}

#[test]
fn peak_is_the_first_highest_step() {
    let trace = Trace::parse_str("t", "t", "# umm-trace v1\na 1 10 0\na 2 5 0\nf 2\na 3 5 0\nf 1\n").unwrap();
    let timeline = Timeline::from_trace(&trace);
    assert_eq!(timeline.panels[0].peak(), (1, 15));
}
