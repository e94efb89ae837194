//! Calls that return `Ok` do what they say, or return an error that says why not: a limit set at run time, a
//! software device made current, sleep and wake at their edges, empty memory adopted, a copy between buffers of
//! different lengths.

use umm::{AllocOptions, DeviceKind, DeviceSelector, Limit, Placement, PoolKind, SleepPolicy, UniversalMemoryManager};

const MIB: usize = 1 << 20;

fn host_only() -> UniversalMemoryManager {
    UniversalMemoryManager::builder().backends(false, false, false).build().unwrap()
}

fn one_mib() -> Option<Limit> {
    Some("1MiB".parse().unwrap())
}

#[test]
fn a_limit_set_at_run_time_caps_the_pools_made_after_it() {
    let mm = host_only();
    mm.set_limit(one_mib()).unwrap();
    let e = mm.allocate_universal::<u8>(4 * MIB, Placement::Auto).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(mm.allocate_universal::<u8>(64 << 10, Placement::Auto).is_ok(), "under the cap");
    assert_eq!(mm.global_memory_stats().total.limit_bytes, Some(MIB as u64));
    // Cleared, the same request is served.
    mm.set_limit(None).unwrap();
    assert!(mm.allocate_universal::<u8>(4 * MIB, Placement::Auto).is_ok());
}

#[test]
fn a_limit_set_at_run_time_caps_the_pools_made_before_it_and_gives_cache_above_it_back() {
    let mm = host_only();
    // A first allocation makes the pool and leaves its memory cached.
    drop(mm.allocate_universal::<u8>(8 * MIB, Placement::Auto).unwrap());
    assert!(mm.global_memory_stats().total.reserved_bytes.current >= 8 * MIB as u64);
    mm.set_limit(one_mib()).unwrap();
    let total = mm.global_memory_stats().total;
    assert_eq!(total.limit_bytes, Some(MIB as u64));
    assert!(total.reserved_bytes.current <= MIB as u64, "cache above the cap was kept: {total:?}");
    let e = mm.allocate_universal::<u8>(4 * MIB, Placement::Auto).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
}

#[test]
fn a_limit_that_allows_nothing_is_refused_and_changes_nothing() {
    let mm = host_only();
    for bad in [Limit::Bytes(0), Limit::Fraction(0.0), Limit::Fraction(1.5)] {
        let e = mm.set_limit(Some(bad)).unwrap_err();
        assert!(e.is_invalid_config(), "{bad:?}: {e}");
    }
    assert!(mm.allocate_universal::<u8>(4 * MIB, Placement::Auto).is_ok(), "no cap was set");
}

/// A software device (PoCL, lavapipe) where one is installed; `UMM_REQUIRE_BACKENDS` makes its absence a failure.
fn software_device(mm: &UniversalMemoryManager) -> Option<usize> {
    let found = mm.devices().iter().find(|d| d.kind() == DeviceKind::Cpu).map(|d| d.index());
    if found.is_none() {
        let required = std::env::var("UMM_REQUIRE_BACKENDS").unwrap_or_default();
        assert!(
            required.trim().is_empty(),
            "UMM_REQUIRE_BACKENDS={required} but no software device: {:?}",
            mm.skipped()
        );
        eprintln!("skipped: no software device (PoCL, lavapipe) on this machine");
    }
    found
}

#[test]
fn a_software_device_made_current_takes_explicit_placements_without_a_selector() {
    let mm = UniversalMemoryManager::builder().build().unwrap();
    let Some(index) = software_device(&mm) else { return };
    // Not current by default: explicit placements go to host memory.
    assert_ne!(mm.current_device(), Some(index));
    mm.set_current_device(Some(index)).unwrap();
    assert_eq!(mm.current_device(), Some(index));
    let x = mm.allocate_universal::<f32>(1024, Placement::DeviceLocal).unwrap();
    assert_eq!(x.device().index(), index, "{}", x.decision().reason());
    assert!(x.decision().reason().contains("is the current device"), "{}", x.decision().reason());
    // Auto is not bound to the current device.
    let auto = mm.allocate_universal::<f32>(1024, Placement::Auto).unwrap();
    assert_eq!(auto.device().index(), 0, "{}", auto.decision().reason());
    // Back to none: explicit placements go to host memory again.
    mm.set_current_device(None).unwrap();
    let y = mm.allocate_universal::<f32>(1024, Placement::DeviceLocal).unwrap();
    assert_eq!(y.device().index(), 0, "{}", y.decision().reason());
}

fn pattern(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect()
}

fn on_sim() -> AllocOptions {
    AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(1))
}

#[test]
fn a_simulated_device_sleeps_with_offload_and_wakes_with_its_bytes() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).simulated_device(1 << 30).build().unwrap();
    let data = pattern(3 * MIB / 4);
    let weights = mm.allocate_universal_from_with(&data, on_sim().tag("weights")).unwrap();
    let slept = mm.sleep(&SleepPolicy::new().offload("weights")).unwrap();
    assert!(slept.bytes_offloaded >= (data.len() * 4) as u64, "{slept:?}");
    assert!(weights.to_vec().unwrap_err().is_asleep());
    mm.wake(&[]).unwrap();
    assert_eq!(weights.to_vec().unwrap(), data);
}

#[test]
fn a_sleep_that_would_give_nothing_back_is_refused_and_leaves_the_tag_awake() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).simulated_device(1 << 30).build().unwrap();
    // Never used: nothing to put to sleep.
    let e = mm.sleep(&SleepPolicy::new().discard("never_used")).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("cannot put tag never_used to sleep: nothing was allocated"), "{text}");
    assert!(mm.sleeping_tags().is_empty());
    // All on host memory: a sleep would release nothing, yet refuse the tag's allocations.
    let host = AllocOptions::new().device(DeviceSelector::Host).tag("host_only");
    let kept = mm.allocate_universal_from_with(&pattern(1000), host.clone()).unwrap();
    let e = mm.sleep(&SleepPolicy::new().offload("host_only")).unwrap_err();
    assert!(e.to_string().contains("host memory, which a sleep cannot give back"), "{e}");
    assert!(mm.sleeping_tags().is_empty());
    assert!(mm.allocate_universal_with::<u8>(64, host).is_ok(), "the tag still allocates");
    assert_eq!(kept.to_vec().unwrap(), pattern(1000));
    // One tag that can sleep beside one that cannot: nothing sleeps.
    let _w = mm.allocate_universal_with::<u8>(MIB, on_sim().tag("weights")).unwrap();
    assert!(mm.sleep(&SleepPolicy::new().offload("weights").discard("never_used")).is_err());
    assert!(mm.sleeping_tags().is_empty());
    // A policy that names no tag.
    let e = mm.sleep(&SleepPolicy::new()).unwrap_err();
    assert!(e.is_invalid_config() && e.to_string().contains("names no tag"), "{e}");
}

#[test]
fn a_second_sleep_says_it_was_a_sleep_and_a_wake_of_an_awake_tag_is_refused() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).simulated_device(1 << 30).build().unwrap();
    let _w = mm.allocate_universal_with::<u8>(MIB, on_sim().tag("weights")).unwrap();
    mm.sleep(&SleepPolicy::new().offload("weights")).unwrap();
    let e = mm.sleep(&SleepPolicy::new().discard("weights")).unwrap_err();
    let text = e.to_string();
    assert!(e.is_asleep() && text.contains("a second sleep") && !text.contains("allocation"), "{text}");
    // The refused sleep left the first one as it was.
    assert_eq!(mm.sleeping_tags(), [("weights".to_string(), umm::SleepAction::Offload)]);
    let e = mm.wake(&["weights", "kv_cache"]).unwrap_err();
    assert!(e.to_string().contains("kv_cache is not asleep") && e.to_string().contains("asleep: weights"), "{e}");
    assert_eq!(mm.sleeping_tags().len(), 1, "nothing woke");
    mm.wake(&["weights"]).unwrap();
    let e = mm.wake(&["weights"]).unwrap_err();
    assert!(e.to_string().contains("asleep: none"), "{e}");
    assert!(mm.wake(&[]).is_ok(), "waking every sleeping tag when none sleeps is no error");
}

#[test]
fn empty_host_memory_is_adopted_as_an_empty_buffer() {
    let mm = host_only();
    let empty = mm.adopt(Vec::<f32>::new(), umm::AdoptOptions::new().label("empty")).unwrap();
    assert_eq!((empty.len(), empty.size_bytes()), (0, 0));
    assert_eq!(empty.to_vec().unwrap(), Vec::<f32>::new());
    assert_eq!(empty.placement(), PoolKind::Host);
    let leaked: &'static mut [u32] = Box::leak(Vec::new().into_boxed_slice());
    assert_eq!(mm.adopt(umm::Adoptable::host_static(leaked), umm::AdoptOptions::new()).unwrap().len(), 0);
}

#[test]
fn a_copy_between_buffers_of_different_lengths_names_only_methods_that_exist() {
    let mm = host_only();
    let src = mm.allocate_universal_from(&[1u32, 2, 3], Placement::Auto).unwrap();
    let mut dst = mm.allocate_universal::<u32>(2, Placement::Auto).unwrap();
    let e = dst.copy_from(&mm, &src).unwrap_err();
    let text = e.to_string();
    assert!(e.is_out_of_bounds() && text.contains("copy_from") && !text.contains("copy_from_at"), "{text}");
    let e = dst.write(&[1, 2, 3]).unwrap_err();
    assert!(e.to_string().contains("write_at reads or writes part of it"), "{e}");
}

/// The manager's other setters and upkeep calls, each seen to act in the statistics or refused with a reason.
#[test]
fn setters_and_upkeep_calls_act_or_refuse() {
    let mm = host_only();
    let x = mm.allocate_universal::<u8>(4 * MIB, Placement::Auto).unwrap();
    drop(x);
    let total = mm.global_memory_stats().total;
    assert!(total.allocated_bytes.peak > total.allocated_bytes.current);
    mm.reset_peak_stats();
    let total = mm.global_memory_stats().total;
    assert_eq!(total.allocated_bytes.peak, total.allocated_bytes.current, "peaks reset");
    assert!(total.reserved_bytes.current > 0, "the freed block's memory is cached");
    let report = mm.release_all_cached();
    assert!(report.bytes_released > 0, "{report:?}");
    assert_eq!(mm.global_memory_stats().total.reserved_bytes.current, 0);
    // A current device that does not exist, a malformed tag: refused with what exists or is expected.
    let e = mm.set_current_device(Some(7)).unwrap_err();
    assert!(e.is_no_device() && e.to_string().contains("0 (host"), "{e}");
    assert!(mm.tag_scope("a,b").is_err());
    // Builder values that could not act are refused at build.
    let builder = || UniversalMemoryManager::builder().backends(false, false, false);
    for (what, result) in [
        ("page size 3", builder().page_size(3).build()),
        ("limit of 0 bytes", builder().limit(Limit::Bytes(0)).build()),
        ("pressure above 1", builder().pressure_threshold(1.5).build()),
        ("thresholds out of order", builder().thresholds(1 << 20, 1 << 10).build()),
        ("a simulated device of 0 bytes", builder().simulated_device(0).build()),
    ] {
        let e = result.unwrap_err();
        assert!(e.is_invalid_config(), "{what}: {e}");
    }
}
