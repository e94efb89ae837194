//! The ledger is what "no leak, no misuse" in the fault sweeps rests on: each check here plants the fault it
//! exists to find and expects it reported.
use super::*;
use crate::backend::PoolAccess;
use crate::sim::SimSegment;
use crate::SimBackend;

const MIB: u64 = 1 << 20;

fn wrapped() -> (FaultyBackend<SimBackend>, FaultHandle) {
    FaultyBackend::new(SimBackend::new("sim", 1 << 30))
}

#[test]
fn a_clean_run_passes() {
    let (backend, handle) = wrapped();
    let segment = backend.create_segment(2 * MIB).unwrap();
    let reservation = backend.reserve_virtual(64 * MIB).unwrap();
    backend.map_pages(&reservation, 0, 4 * MIB).unwrap();
    backend.unmap_pages(&reservation, 0, 4 * MIB, crate::StreamId(0), true);
    backend.destroy_segment(segment, PoolAccess::new());
    backend.destroy_segment(reservation, PoolAccess::new());
    assert_eq!(handle.check_released(), Ok(()));
}

#[test]
fn a_segment_never_destroyed_is_a_leak() {
    let (backend, handle) = wrapped();
    let _leaked = backend.create_segment(2 * MIB).unwrap();
    let err = handle.check_released().unwrap_err();
    assert!(err.contains("1 segments") && err.contains("not destroyed"), "{err}");
}

#[test]
fn pages_left_mapped_are_a_leak_and_destroying_under_them_a_violation() {
    let (backend, handle) = wrapped();
    let reservation = backend.reserve_virtual(64 * MIB).unwrap();
    backend.map_pages(&reservation, 0, 4 * MIB).unwrap();
    let err = handle.check_released().unwrap_err();
    assert!(err.contains("still mapped"), "{err}");
    backend.destroy_segment(reservation, PoolAccess::new());
    assert!(handle.violations().iter().any(|v| v.contains("destroyed with")), "{:?}", handle.violations());
}

#[test]
fn double_destroys_and_bad_page_ranges_are_violations() {
    let (backend, handle) = wrapped();
    let segment = backend.create_segment(2 * MIB).unwrap();
    backend.destroy_segment(segment.clone(), PoolAccess::new());
    // The simulated device under it counts the bytes back twice: it is not used again.
    backend.destroy_segment(segment, PoolAccess::new());
    let (backend, pages) = wrapped();
    let reservation = backend.reserve_virtual(64 * MIB).unwrap();
    backend.map_pages(&reservation, 0, 2 * MIB).unwrap();
    // The simulated device refuses both, as CUDA would; the ledger has seen the misuse all the same.
    let over = backend.map_pages(&reservation, 0, 2 * MIB); // over mapped pages
    assert!(matches!(over, Err(Error::InvalidConfig(_))), "{over:?}");
    let off = backend.map_pages(&reservation, 4096, 2 * MIB); // off the page grid
    assert!(matches!(off, Err(Error::OutOfBounds(_))), "{off:?}");
    backend.unmap_pages(&reservation, 8 * MIB, 2 * MIB, crate::StreamId(0), true); // not mapped
    let mut violations = handle.violations();
    violations.extend(pages.violations());
    for expected in ["destroyed twice", "overlaps mapped pages", "not whole pages", "not mapped"] {
        assert!(violations.iter().any(|v| v.contains(expected)), "{expected}: {violations:?}");
    }
    assert!(handle.check_released().is_err() && pages.check_released().is_err());
}

/// Asserts that the ledger recorded a violation containing `expected`, and that the release check reports it.
#[track_caller]
fn assert_reported(handle: &FaultHandle, expected: &str) {
    let violations = handle.violations();
    assert!(violations.iter().any(|v| v.contains(expected)), "{expected}: {violations:?}");
    let err = handle.check_released().expect_err("the release check passed a run with misuse");
    assert!(err.contains(expected), "{expected}: {err}");
}

/// Misuse alone, with everything destroyed and unmapped, fails the release check, which names it.
#[test]
fn misuse_alone_fails_the_release_check() {
    let (backend, handle) = wrapped();
    let segment = backend.create_segment(2 * MIB).unwrap();
    let id = segment.id;
    backend.destroy_segment(segment.clone(), PoolAccess::new());
    backend.destroy_segment(segment, PoolAccess::new());
    assert_eq!(handle.live_segments(), 0);
    assert_reported(&handle, &format!("segment {id} destroyed twice"));
}

/// The leak check names how many segments and bytes are left, and counts a reservation with nothing mapped.
#[test]
fn a_leak_names_its_segments_and_bytes() {
    let (backend, handle) = wrapped();
    let kept = backend.create_segment(2 * MIB).unwrap();
    let _leaked = backend.reserve_virtual(64 * MIB).unwrap();
    backend.destroy_segment(kept, PoolAccess::new());
    let err = handle.check_released().unwrap_err();
    assert!(
        err.contains("1 segments (67108864 bytes of address space) not destroyed (2 created, 1 destroyed)"),
        "{err}"
    );
}

/// Two reservations, the second mapping the first's first 4 MiB a second time, as a pool stitches ranges.
fn aliased() -> (FaultyBackend<SimBackend>, FaultHandle, FaultySegment<SimSegment>, FaultySegment<SimSegment>) {
    let (backend, handle) = wrapped();
    let src = backend.reserve_virtual(64 * MIB).unwrap();
    backend.map_pages(&src, 0, 8 * MIB).unwrap();
    let dst = backend.reserve_virtual(64 * MIB).unwrap();
    backend.alias_pages(&dst, 0, &src, 0, 4 * MIB).unwrap();
    assert_eq!(handle.violations(), Vec::<String>::new());
    (backend, handle, src, dst)
}

/// Torn down in order (the second mapping's reservation first, then the pages, then their reservation), a
/// stitched range passes: the checks below fail on misuse, not on every second mapping.
#[test]
fn a_second_mapping_torn_down_in_order_passes() {
    let (backend, handle, src, dst) = aliased();
    backend.destroy_segment(dst, PoolAccess::new());
    backend.unmap_pages(&src, 0, 8 * MIB, crate::StreamId(0), true);
    backend.destroy_segment(src, PoolAccess::new());
    assert_eq!(handle.check_released(), Ok(()));
}

/// Pages unmapped while another reservation maps them a second time: the other reservation's range would
/// point at freed memory.
#[test]
fn unmapping_pages_mapped_a_second_time_is_a_violation() {
    let (backend, handle, src, dst) = aliased();
    backend.unmap_pages(&src, 2 * MIB, 4 * MIB, crate::StreamId(0), true);
    let expected = format!(
        "pages 2097152..6291456 of segment {} unmapped while segment {} maps them a second time",
        src.id, dst.id
    );
    assert_reported(&handle, &expected);
    // Pages past the second mapping are not in it.
    let (backend, handle, src, _dst) = aliased();
    backend.unmap_pages(&src, 4 * MIB, 4 * MIB, crate::StreamId(0), true);
    assert_eq!(handle.violations(), Vec::<String>::new());
}

/// A reservation destroyed while another maps its pages a second time.
#[test]
fn destroying_a_reservation_mapped_a_second_time_is_a_violation() {
    let (backend, handle, src, dst) = aliased();
    backend.unmap_pages(&src, 4 * MIB, 4 * MIB, crate::StreamId(0), true);
    let src_id = src.id;
    backend.destroy_segment(src, PoolAccess::new());
    assert_reported(
        &handle,
        &format!("segment {src_id} destroyed while segment {} maps its pages a second time", dst.id),
    );
    assert_reported(&handle, &format!("segment {src_id} destroyed with 4194304 bytes still mapped"));
}

/// A second mapping into a reservation that has pages of its own (a stitched range is a reservation made for
/// it).
#[test]
fn a_second_mapping_into_a_reservation_with_pages_of_its_own_is_a_violation() {
    let (backend, handle) = wrapped();
    let src = backend.reserve_virtual(64 * MIB).unwrap();
    backend.map_pages(&src, 0, 4 * MIB).unwrap();
    let dst = backend.reserve_virtual(64 * MIB).unwrap();
    backend.map_pages(&dst, 8 * MIB, 2 * MIB).unwrap();
    backend.alias_pages(&dst, 0, &src, 0, 4 * MIB).unwrap();
    assert_reported(&handle, &format!("alias_pages into segment {}, not a reservation of its own", dst.id));
}

/// Pages mapped past a reservation's end, or in a reservation already destroyed.
#[test]
fn mapping_past_the_end_or_after_destruction_is_a_violation() {
    let (backend, handle) = wrapped();
    let reservation = backend.reserve_virtual(8 * MIB).unwrap();
    let past = backend.map_pages(&reservation, 6 * MIB, 4 * MIB);
    assert!(matches!(past, Err(Error::OutOfBounds(_))), "{past:?}");
    let id = reservation.id;
    assert_reported(&handle, &format!("map_pages of 6291456..10485760 in segment {id}: past its end"));
    let stale = reservation.clone();
    backend.destroy_segment(reservation, PoolAccess::new());
    backend.map_pages(&stale, 0, 2 * MIB).unwrap(); // the simulated device does not know it is gone
    assert_reported(&handle, &format!("map_pages on segment {id}, which is not live"));
}

/// `is_mapped` (what pool tests check live blocks against) says no for pages never mapped, for a range running
/// past mapped pages, and for a second mapping whose source pages were unmapped; yes only where every byte is
/// mapped, directly or where a second mapping's pages come from.
#[test]
fn is_mapped_is_false_wherever_a_page_is_not_mapped() {
    let (backend, handle, src, dst) = aliased();
    assert!(handle.is_mapped(&src, 0, 8 * MIB) && handle.is_mapped(&src, 2 * MIB, 2 * MIB));
    assert!(!handle.is_mapped(&src, 6 * MIB, 4 * MIB), "runs past the mapped pages");
    assert!(!handle.is_mapped(&src, 16 * MIB, 2 * MIB), "never mapped");
    assert!(handle.is_mapped(&dst, 0, 4 * MIB), "mapped a second time");
    assert!(!handle.is_mapped(&dst, 0, 6 * MIB), "runs past the second mapping");
    assert!(!handle.is_mapped(&dst, 8 * MIB, 2 * MIB), "outside the second mapping");
    backend.unmap_pages(&src, 0, 2 * MIB, crate::StreamId(0), true);
    assert!(!handle.is_mapped(&dst, 0, 4 * MIB), "half its source is unmapped");
    assert!(handle.is_mapped(&dst, 2 * MIB, 2 * MIB), "the other half is still mapped");
}

/// Resident bytes (what a pool's `reserved_bytes` is checked against): plain segments and mapped pages, each
/// physical page once however often it is mapped, and nothing once released.
#[test]
fn resident_bytes_count_each_physical_page_once() {
    let (backend, handle, src, dst) = aliased();
    let plain = backend.create_segment(2 * MIB).unwrap();
    assert_eq!((handle.resident_bytes(), handle.mapped_bytes()), (10 * MIB, 8 * MIB));
    backend.destroy_segment(dst, PoolAccess::new());
    backend.unmap_pages(&src, 0, 2 * MIB, crate::StreamId(0), true);
    assert_eq!((handle.resident_bytes(), handle.mapped_bytes()), (8 * MIB, 6 * MIB));
    backend.destroy_segment(plain, PoolAccess::new());
    assert_eq!(handle.resident_bytes(), 6 * MIB);
}

#[test]
fn unmapping_one_reservation_for_two_streams_is_a_violation() {
    let (backend, handle) = wrapped();
    let reservation = backend.reserve_virtual(64 * MIB).unwrap();
    backend.map_pages(&reservation, 0, 4 * MIB).unwrap();
    backend.unmap_pages(&reservation, 0, 2 * MIB, crate::StreamId(1), true);
    backend.unmap_pages(&reservation, 2 * MIB, 2 * MIB, crate::StreamId(2), true);
    let violations = handle.violations();
    assert!(violations.iter().any(|v| v.contains("for stream 1 and for stream 2")), "{violations:?}");
    backend.destroy_segment(reservation, PoolAccess::new());
}
