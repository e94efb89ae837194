//! Tags, sleep and wake through the manager (`AllocOptions::tag`, `tag_scope`, `sleep`, `wake`), on simulated
//! devices that keep their bytes: offloaded buffers come back with their bytes at their addresses, discarded ones
//! with fresh pages, a sleeping tag refuses allocations and accesses while untagged memory works on, and a sleep
//! that one device cannot do leaves every device awake.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use umm::backends::{MemoryPool, Pool, SimBackend};
use umm::{AllocOptions, DeviceSelector, Placement, SleepAction, SleepPolicy, UniversalMemoryManager};

const MIB: usize = 1 << 20;

/// Each simulated device's pools get address ranges of their own, far apart.
static NEXT_BASE: AtomicU64 = AtomicU64::new(1);

/// The host and one simulated GPU per entry of `virtual_memory` (whether it has virtual memory), each keeping
/// its bytes.
fn manager(virtual_memory: &[bool]) -> UniversalMemoryManager {
    let mut builder = UniversalMemoryManager::builder().backends(false, false, false);
    for &vm in virtual_memory {
        builder = builder.simulated_device_with_pools(1 << 30, move |name, _, config| {
            let base = NEXT_BASE.fetch_add(1, Ordering::Relaxed) << 40;
            let backend = if vm { SimBackend::new(name, 1 << 30) } else { SimBackend::plain(name, 1 << 30) };
            Ok(Arc::new(Pool::new(backend.holding_bytes().at_address(base), config.clone())?) as Arc<dyn MemoryPool>)
        });
    }
    let mm = builder.build().unwrap();
    assert_eq!(mm.devices().len(), 1 + virtual_memory.len());
    mm
}

fn on(device: usize) -> AllocOptions {
    AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(device))
}

fn pattern(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed)).collect()
}

/// The physical bytes of device `index`'s pools that hold any (its tagged and untagged pools).
fn reserved(mm: &UniversalMemoryManager, index: usize) -> u64 {
    mm.devices()[index].pools().iter().map(|(_, _, p)| p.reserved_bytes()).sum()
}

#[test]
fn offloaded_weights_return_with_their_bytes_and_a_discarded_cache_with_fresh_pages() {
    let mm = manager(&[true]);
    let weights: Vec<_> = (0..3)
        .map(|i| mm.allocate_universal_from_with(&pattern(i, MIB + 7 * i as usize), on(1).tag("weights")).unwrap())
        .collect();
    let small_weight = mm.allocate_universal_from_with(&pattern(9, 100), on(1).tag("weights")).unwrap();
    let cache = {
        let _tag = mm.tag_scope("kv_cache").unwrap();
        mm.allocate_universal_from_with(&pattern(7, 3 * MIB), on(1)).unwrap()
    };
    let untagged = mm.allocate_universal_from_with(&pattern(5, MIB), on(1)).unwrap();
    let tags: Vec<String> = mm.devices()[1].tagged_pools().iter().map(|(t, ..)| t.to_string()).collect();
    assert_eq!(tags, ["weights", "kv_cache"]);
    let awake = reserved(&mm, 1);
    let slept_tags = |mm: &UniversalMemoryManager| -> u64 {
        let pools = mm.devices()[1].tagged_pools();
        pools.iter().filter(|(t, ..)| ["weights", "kv_cache"].contains(&&**t)).map(|(.., p)| p.reserved_bytes()).sum()
    };
    let awake_tags = slept_tags(&mm);

    let summary = mm.sleep(&SleepPolicy::new().offload("weights").discard("kv_cache")).unwrap();
    assert_eq!(summary.pools.len(), 2);
    assert!(summary.bytes_offloaded >= 12 * MIB as u64 + 400, "{summary:?}");
    assert_eq!(slept_tags(&mm), 0, "the tagged pools hold no device memory asleep");
    assert!(reserved(&mm, 1) < awake);
    let stats = mm.global_memory_stats();
    assert_eq!(
        stats.total.asleep_bytes,
        summary.bytes_released - summary.pools.iter().map(|p| p.report.cached_released).sum::<u64>()
    );
    assert_eq!(stats.total.offloaded_bytes, summary.bytes_offloaded);
    let summary_text = mm.memory_summary();
    assert!(summary_text.contains("asleep (tags put to sleep, not in reserved)"), "{summary_text}");
    let mut tags = mm.sleeping_tags();
    tags.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(tags, [("kv_cache".to_string(), SleepAction::Discard), ("weights".to_string(), SleepAction::Offload)]);

    // Asleep: the tag refuses, its buffers refuse, untagged memory works on.
    let e = mm.allocate_universal_with::<u8>(64, on(1).tag("weights")).unwrap_err();
    assert!(e.is_asleep() && e.to_string().contains("weights"), "{e}");
    let e = weights[0].to_vec().unwrap_err();
    assert!(e.is_asleep(), "{e}");
    assert_eq!(untagged.to_vec().unwrap(), pattern(5, MIB));
    assert!(mm.allocate_universal_with::<u8>(64, on(1).tag("other")).is_ok(), "another tag is awake");
    let e = mm.sleep(&SleepPolicy::new().offload("weights")).unwrap_err();
    assert!(e.is_asleep(), "a sleeping tag cannot sleep again: {e}");

    let woken = mm.wake(&[]).unwrap();
    assert_eq!(woken.bytes_restored, summary.bytes_offloaded);
    assert!(mm.sleeping_tags().is_empty());
    for (i, w) in weights.iter().enumerate() {
        assert_eq!(w.to_vec().unwrap(), pattern(i as u32, MIB + 7 * i), "weights {i}");
    }
    assert_eq!(small_weight.to_vec().unwrap(), pattern(9, 100));
    let fresh = u32::from_ne_bytes([SimBackend::FRESH_BYTE; 4]);
    assert!(cache.to_vec().unwrap().iter().all(|&v| v == fresh), "the discarded cache holds fresh pages");
    assert_eq!(mm.global_memory_stats().total.asleep_bytes, 0);
    assert_eq!(slept_tags(&mm), awake_tags, "the same pages again");
}

#[test]
fn a_sleep_one_device_cannot_do_leaves_every_device_awake() {
    // Device 1 has virtual memory, device 2 (OpenCL-like) has not.
    let mm = manager(&[true, false]);
    let first = mm.allocate_universal_from_with(&pattern(1, MIB), on(1).tag("weights")).unwrap();
    let second = mm.allocate_universal_from_with(&pattern(2, MIB), on(2).tag("weights")).unwrap();
    let e = mm.sleep(&SleepPolicy::new().offload("weights")).unwrap_err();
    assert!(e.is_unsupported() && e.to_string().contains("plain segments"), "{e}");
    assert!(mm.sleeping_tags().is_empty());
    assert_eq!(first.to_vec().unwrap(), pattern(1, MIB), "device 1 woke again with its bytes");
    assert_eq!(second.to_vec().unwrap(), pattern(2, MIB));
    assert!(mm.allocate_universal_with::<u8>(64, on(1).tag("weights")).is_ok());
}

#[test]
fn tags_on_the_host_stay_where_they_are() {
    let mm = manager(&[true]);
    let host = AllocOptions::new().device(DeviceSelector::Host).tag("weights");
    let on_host = mm.allocate_universal_from_with(&pattern(3, 1000), host.clone()).unwrap();
    // All of the tag's memory on the host: a sleep would give nothing back, so it is refused.
    let e = mm.sleep(&SleepPolicy::new().offload("weights")).unwrap_err();
    assert!(e.to_string().contains("host memory, which a sleep cannot give back"), "{e}");
    assert!(mm.sleeping_tags().is_empty());
    // With memory on the device too, the device's pool sleeps and the host's stays as it is.
    let on_device = mm.allocate_universal_from_with(&pattern(4, 1000), on(1).tag("weights")).unwrap();
    let summary = mm.sleep(&SleepPolicy::new().offload("weights")).unwrap();
    assert_eq!((summary.pools.len(), summary.host_pools), (1, 1));
    assert_eq!(on_host.to_vec().unwrap(), pattern(3, 1000), "host memory is not put to sleep");
    mm.wake(&["weights"]).unwrap();
    assert_eq!(on_device.to_vec().unwrap(), pattern(4, 1000));
}

#[test]
fn bad_tags_are_refused_with_what_a_tag_may_be() {
    let mm = manager(&[true]);
    for tag in ["", "a,b", "new\nline", &"x".repeat(umm::MAX_TAG_LEN + 1)] {
        let e = mm.allocate_universal_with::<u8>(8, on(1).tag(tag)).unwrap_err();
        assert!(e.is_invalid_config() && e.to_string().contains("1 to 128 bytes"), "{tag:?}: {e}");
        assert!(mm.tag_scope(tag).is_err(), "{tag:?}");
        assert!(mm.sleep(&SleepPolicy::new().discard(tag)).is_err(), "{tag:?}");
    }
    assert!(umm::check_tag(&"x".repeat(umm::MAX_TAG_LEN)).is_ok());
}

#[test]
fn tag_scopes_nest_and_an_explicit_tag_wins() {
    let mm = manager(&[true]);
    let tags_of = |mm: &UniversalMemoryManager| -> Vec<String> {
        mm.devices()[1].tagged_pools().iter().map(|(t, ..)| t.to_string()).collect()
    };
    let _outer = mm.tag_scope("outer").unwrap();
    let a = mm.allocate_universal_with::<u8>(10, on(1)).unwrap();
    {
        let _inner = mm.tag_scope("inner").unwrap();
        let b = mm.allocate_universal_with::<u8>(10, on(1)).unwrap();
        let c = mm.allocate_universal_with::<u8>(10, on(1).tag("explicit")).unwrap();
        drop((b, c));
    }
    let d = mm.allocate_universal_with::<u8>(10, on(1)).unwrap();
    assert_eq!(tags_of(&mm), ["outer", "inner", "explicit"]);
    // `d` went to "outer" again: sleeping it refuses `d`.
    mm.sleep(&SleepPolicy::new().discard("outer")).unwrap();
    assert!(d.to_vec().unwrap_err().is_asleep());
    assert!(a.to_vec().unwrap_err().is_asleep());
    mm.wake(&["outer"]).unwrap();
    assert_eq!(d.to_vec().unwrap().len(), 10);
}

/// 100 sleep and wake cycles while 4 threads allocate, fill, check and drop tagged and untagged buffers: every
/// operation works or is refused as asleep, no offloaded byte is lost, and at the end no device memory is left.
#[test]
fn a_hundred_cycles_under_four_threads_leak_nothing() {
    let mm = manager(&[true]);
    // The tag has memory on the device before the first sleep, which would otherwise be refused as giving nothing
    // back when it ran before any thread allocated under the tag.
    drop(mm.allocate_universal_with::<u8>(64, on(1).tag("weights")).unwrap());
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let (mm, done) = (&mm, &done);
            scope.spawn(move || {
                let mut held = Vec::new();
                let mut n = 0u32;
                while !done.load(Ordering::Relaxed) {
                    n += 1;
                    let tag = if n.is_multiple_of(2) { Some("weights") } else { None };
                    let options = match tag {
                        Some(tag) => on(1).tag(tag),
                        None => on(1),
                    };
                    let data = pattern(t * 100_000 + n, [64, 5000, 300_000][(n % 3) as usize]);
                    match mm.allocate_universal_from_with(&data, options) {
                        Ok(buffer) => held.push((buffer, data)),
                        Err(e) => assert!(e.is_asleep(), "{e}"),
                    }
                    if held.len() > 8 {
                        let (buffer, data) = held.remove((n % 8) as usize);
                        match buffer.to_vec() {
                            Ok(now) => assert_eq!(now, data, "thread {t}"),
                            Err(e) => assert!(e.is_asleep(), "{e}"),
                        }
                    }
                }
            });
        }
        for _ in 0..100 {
            mm.sleep(&SleepPolicy::new().offload("weights")).unwrap();
            mm.wake(&["weights"]).unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let stats = mm.global_memory_stats();
    assert_eq!((stats.total.active_blocks.current, stats.total.asleep_bytes), (0, 0));
    mm.release_all_cached();
    assert_eq!(reserved(&mm, 1), 0, "every device byte went back");
    assert_eq!(mm.global_memory_stats().total.host_store_bytes, 0);
}
