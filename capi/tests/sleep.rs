//! Tags, sleep and wake through the C ABI (`umm_set_tag`, `umm_sleep`, `umm_wake`) over simulated devices
//! (`UMM_CAPI_SIM`): tagged pointers come from a pool of their tag, a sleeping tag gives its device memory back
//! and refuses allocations, and the wake brings every block back at its address.

use serde_json::Value;
use std::ffi::CString;
use std::sync::MutexGuard;
use umm_capi::*;

mod common;

use common::{alloc, free, json, last_error, stats, MIB};

/// The simulated devices, one test at a time, with no tag set.
fn setup() -> MutexGuard<'static, ()> {
    let guard = common::simulated();
    set_tag(None).unwrap();
    guard
}

fn c(text: &str) -> CString {
    CString::new(text).unwrap()
}

fn set_tag(tag: Option<&str>) -> Result<(), String> {
    let text = tag.map(c);
    // SAFETY: NULL or a live NUL-terminated string.
    let rc = unsafe { umm_set_tag(text.as_ref().map_or(std::ptr::null(), |t| t.as_ptr())) };
    if rc == 0 {
        Ok(())
    } else {
        Err(last_error())
    }
}

fn sleep(offload: &str, discard: &str) -> Result<Value, String> {
    let (offload, discard) = (c(offload), c(discard));
    // SAFETY: live NUL-terminated strings.
    json(unsafe { umm_sleep(offload.as_ptr(), discard.as_ptr()) })
}

fn wake(tags: &str) -> Result<Value, String> {
    let tags = c(tags);
    // SAFETY: a live NUL-terminated string.
    json(unsafe { umm_wake(tags.as_ptr()) })
}

/// The addresses and sizes of the device's live blocks, from its snapshot.
fn live_blocks(device: i32) -> Vec<(u64, u64)> {
    let snapshot = json(umm_snapshot_json(device)).unwrap();
    let mut blocks: Vec<(u64, u64)> = snapshot["segments"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["blocks"].as_array().unwrap().clone())
        .filter(|b| b["state"] == "active_allocated")
        .map(|b| (b["address"].as_u64().unwrap(), b["requested_size"].as_u64().unwrap()))
        .collect();
    blocks.sort();
    blocks
}

#[test]
fn a_tag_sleeps_gives_its_memory_back_and_wakes_at_the_same_addresses() {
    let _serial = setup();
    let untagged = alloc(3 * MIB, 0, 0);
    set_tag(Some("weights")).unwrap();
    let weights: Vec<_> = [5 * MIB, 700_000, 40 * MIB].iter().map(|&n| alloc(n, 0, 0)).collect();
    set_tag(Some("kv_cache")).unwrap();
    let cache = alloc(64 * MIB, 0, 0);
    set_tag(None).unwrap();
    for p in weights.iter().chain([&cache, &untagged]) {
        assert!(!p.is_null(), "{}", last_error());
    }
    let before = live_blocks(0);
    let reserved_awake = stats(0)["reserved_bytes"]["current"].as_u64().unwrap();

    let report = sleep("weights", "kv_cache").unwrap();
    assert_eq!(report["pools"].as_array().unwrap().len(), 2, "{report}");
    let offloaded = report["bytes_offloaded"].as_u64().unwrap();
    assert!(offloaded >= (45 * MIB + 700_000) as u64, "{report}");
    let asleep = stats(0);
    let reserved_asleep = asleep["reserved_bytes"]["current"].as_u64().unwrap();
    assert!(reserved_asleep < reserved_awake, "{reserved_asleep} < {reserved_awake}");
    assert_eq!(asleep["offloaded_bytes"].as_u64(), Some(offloaded));
    assert!(asleep["asleep_bytes"].as_u64().unwrap() >= offloaded + 64 * MIB as u64);
    let sleeping = json(umm_sleeping_json()).unwrap();
    assert_eq!(sleeping, serde_json::json!({"kv_cache": "discard", "weights": "offload"}));

    // Asleep: the tag refuses, on either device (device 1 has no pool of the tag yet); others allocate.
    for device in [0, 1] {
        set_tag(Some("weights")).unwrap();
        assert!(alloc(MIB, device, 0).is_null());
        let message = last_error();
        assert!(message.contains("asleep") && message.contains("weights"), "{message}");
    }
    set_tag(None).unwrap();
    let other = alloc(MIB, 0, 0);
    assert!(!other.is_null(), "{}", last_error());
    let message = sleep("weights", "").unwrap_err();
    assert!(message.contains("asleep already"), "{message}");

    let report = wake("").unwrap();
    assert_eq!(report["bytes_restored"].as_u64(), Some(offloaded));
    free(other, 0, 0);
    assert_eq!(live_blocks(0), before, "every block at its address, with its size");
    assert_eq!(json(umm_sleeping_json()).unwrap(), serde_json::json!({}));
    // The tag serves again; every pointer frees.
    set_tag(Some("weights")).unwrap();
    let again = alloc(MIB, 0, 0);
    assert!(!again.is_null(), "{}", last_error());
    set_tag(None).unwrap();
    for p in weights.into_iter().chain([cache, untagged, again]) {
        free(p, 0, 0);
    }
    assert_eq!(stats(0)["allocated_bytes"]["current"].as_u64(), Some(0));
    assert!(umm_empty_cache(-1) >= 0);
    assert_eq!(stats(0)["reserved_bytes"]["current"].as_u64(), Some(0));
}

#[test]
fn a_tag_woken_by_name_leaves_the_others_asleep() {
    let _serial = setup();
    set_tag(Some("a")).unwrap();
    let a = alloc(8 * MIB, 1, 0);
    set_tag(Some("b")).unwrap();
    let b = alloc(8 * MIB, 1, 0);
    set_tag(None).unwrap();
    sleep("a,b", "").unwrap();
    wake(" a ").unwrap();
    assert_eq!(json(umm_sleeping_json()).unwrap(), serde_json::json!({"b": "offload"}));
    set_tag(Some("a")).unwrap();
    let more = alloc(MIB, 1, 0);
    assert!(!more.is_null(), "{}", last_error());
    set_tag(None).unwrap();
    wake("b").unwrap();
    for p in [a, b, more] {
        free(p, 1, 0);
    }
}

#[test]
fn bad_tags_and_lists_are_refused_with_a_reason() {
    let _serial = setup();
    for bad in ["a,b", &"x".repeat(129), "tab\there"] {
        let message = set_tag(Some(bad)).unwrap_err();
        assert!(message.contains("umm_set_tag") && message.contains("1 to 128 bytes"), "{bad:?}: {message}");
    }
    let message = sleep("w", "w").unwrap_err();
    assert!(message.contains("both offloaded and discarded"), "{message}");
    let message = sleep(&"y".repeat(200), "").unwrap_err();
    assert!(message.contains("umm_sleep"), "{message}");
    // Not UTF-8.
    let bytes = [0xFFu8, 0xFE, 0];
    // SAFETY: a NUL-terminated byte string.
    assert_eq!(unsafe { umm_set_tag(bytes.as_ptr().cast()) }, -1);
    assert!(last_error().contains("not UTF-8"));
    // Nothing asleep: waking everything does nothing.
    assert_eq!(wake("").unwrap()["pools"], serde_json::json!([]));
}

#[test]
fn a_sleep_or_wake_that_would_do_nothing_is_refused_and_changes_nothing() {
    let _serial = setup();
    // Nothing was ever allocated under this tag: a sleep would give nothing back, yet refuse its allocations.
    let message = sleep("never_used", "").unwrap_err();
    assert!(message.contains("never_used") && message.contains("nothing was allocated under it"), "{message}");
    assert_eq!(json(umm_sleeping_json()).unwrap(), serde_json::json!({}));
    let message = sleep("", " , ").unwrap_err();
    assert!(message.contains("no tag named"), "{message}");
    // With one tag used and one not, nothing sleeps.
    set_tag(Some("used")).unwrap();
    let p = alloc(MIB, 1, 0);
    set_tag(None).unwrap();
    let message = sleep("used", "never_used").unwrap_err();
    assert!(message.contains("never_used"), "{message}");
    assert_eq!(json(umm_sleeping_json()).unwrap(), serde_json::json!({}));
    // A wake naming a tag that is not asleep wakes nothing and says which tags are.
    sleep("used", "").unwrap();
    let message = wake("used,never_used").unwrap_err();
    assert!(message.contains("never_used is not asleep") && message.contains("asleep: used"), "{message}");
    assert_eq!(json(umm_sleeping_json()).unwrap(), serde_json::json!({"used": "offload"}));
    wake("used").unwrap();
    free(p, 1, 0);
}

/// A tag's pool counts in its device's reserved bytes together with the main pool, so that the reported peak is
/// the true peak of their sum: after a reset it is what all the device's pools reserve, the tag's pages with them.
#[test]
fn a_tags_pages_count_in_the_devices_reserved_peak() {
    let _serial = setup();
    let reserved = |s: &Value, key: &str| s["reserved_bytes"][key].as_u64().unwrap();
    assert_eq!(umm_reset_peaks(1), 0);
    let before = stats(1);
    assert_eq!(reserved(&before, "peak"), reserved(&before, "current"));
    set_tag(Some("counted")).unwrap();
    let p = alloc(64 * MIB, 1, 0);
    set_tag(None).unwrap();
    assert!(!p.is_null(), "{}", last_error());
    let after = stats(1);
    assert_eq!(reserved(&after, "current"), reserved(&before, "current") + (64 << 20), "{after}");
    assert_eq!(reserved(&after, "peak"), reserved(&after, "current"), "{after}");
    free(p, 1, 0);
}
