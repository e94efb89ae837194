//! The C ABI over simulated devices (`UMM_CAPI_SIM`), so that what it does with live pointers runs in CI: double and
//! interior frees, frees on another stream, limits, history, snapshots, and a random workload checked after every
//! call against a model of the live allocations (no two overlap, the statistics add up, every refusal says why).

use serde_json::Value;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use umm_capi::*;

mod common;

use common::{alloc, free, json, last_error, stats, stream, MIB};

/// The simulated devices, one test at a time, with no limit and an empty cache.
fn setup() -> MutexGuard<'static, ()> {
    let guard = common::simulated();
    assert_eq!(umm_set_limit(-1, 0), 0);
    assert!(umm_empty_cache(-1) >= 0);
    guard
}

fn current(stats: &Value, key: &str) -> u64 {
    stats[key]["current"].as_u64().expect(key)
}

#[test]
fn the_simulated_devices_are_what_the_variable_says() {
    let _g = setup();
    assert_eq!(umm_device_count(), 2);
    let s = stats(1);
    assert_eq!(s["simulated"], true);
    assert_eq!(s["device_total_bytes"], 4u64 << 30);
    assert_eq!(s["virtual_memory"], true);
    let (a, b) = (alloc(MIB, 0, 0), alloc(MIB, 1, 0));
    assert!(!a.is_null() && !b.is_null());
    assert!((a as u64) >> 40 != (b as u64) >> 40, "the devices' addresses are 1 TiB apart: {a:?} {b:?}");
    free(a, 0, 0);
    free(b, 1, 0);
}

#[test]
fn double_and_interior_frees_change_nothing_and_say_why() {
    let _g = setup();
    let p = alloc(3 * MIB, 0, 0);
    let q = alloc(1000, 0, 0);
    let before = stats(0);
    free(p.wrapping_byte_add(256), 0, 0);
    assert!(last_error().contains("was not allocated by umm"), "{}", last_error());
    free(p, 0, 0);
    let after_one = stats(0);
    umm_clear_error();
    free(p, 0, 0);
    let message = last_error();
    assert!(message.contains("already freed") && message.contains(&format!("{:#x}", p as u64)), "{message}");
    let after_two = stats(0);
    assert_eq!(after_two["num_frees"], after_one["num_frees"], "the second free reached no pool");
    assert_eq!(current(&after_two, "allocated_bytes"), current(&before, "allocated_bytes") - 3 * MIB as u64);
    // The block is served again, and the live neighbour kept its place.
    let again = alloc(3 * MIB, 0, 0);
    assert_eq!(again, p, "the freed block is reused");
    assert_eq!(stats(0)["live_pointers"], 2);
    free(again, 0, 0);
    free(q, 0, 0);
    assert_eq!(current(&stats(0), "allocated_bytes"), 0);
}

#[test]
fn a_free_on_another_stream_is_recorded_there() {
    let _g = setup();
    let p = alloc(4 * MIB, 0, 1);
    free(p, 0, 2);
    // The simulated stream 2 runs its work at once: its mark has passed, so the next allocation on stream 1
    // takes the block back.
    let again = alloc(4 * MIB, 0, 1);
    assert_eq!(again, p);
    assert_eq!(stats(0)["pending_frees"], 0);
    // SAFETY: as in `alloc`.
    assert_eq!(unsafe { umm_record_stream(again, stream(3)) }, 0, "{}", last_error());
    // SAFETY: as in `alloc`.
    assert_eq!(unsafe { umm_record_stream(0x10 as *mut c_void, stream(3)) }, -1);
    assert!(last_error().contains("not allocated by umm"));
    free(again, 0, 1);
    assert_eq!(stats(0)["pending_frees"], 1, "recorded on stream 3: waits for a mark there");
    assert!(umm_empty_cache(0) >= 0, "returns the frees whose marks passed, then the cache");
    assert_eq!(current(&stats(0), "allocated_bytes"), 0);
}

#[test]
fn out_of_memory_names_the_figures_and_the_history_records_it() {
    let _g = setup();
    assert_eq!(umm_record_history(1000), 0);
    let keep = alloc(16 * MIB, 0, 0);
    assert_eq!(umm_set_limit(0, 64 << 20), 0);
    assert!(alloc(128 * MIB, 0, 0).is_null());
    let message = last_error();
    for part in [
        "umm_alloc: out of memory on device 0",
        "tried to allocate 128.00 MiB (134217728 bytes)",
        "allocated 16.00 MiB (16777216 bytes)",
        "largest free block",
        "limit 64.00 MiB (67108864 bytes)",
        "free",
    ] {
        assert!(message.contains(part), "{part:?} in {message}");
    }
    let snapshot = json(umm_snapshot_json(-1)).unwrap();
    let trace = snapshot["device_traces"][0].as_array().expect("device 0's events");
    let kinds: Vec<&str> = trace.iter().map(|e| e["action"].as_str().expect("action")).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "oom").count(), 1, "{kinds:?}");
    assert!(kinds.contains(&"alloc") && kinds.contains(&"segment_map"), "{kinds:?}");
    let oom = trace.iter().find(|e| e["action"] == "oom").expect("the oom event");
    assert_eq!(oom["size"], 128 * MIB as u64);
    assert!(oom["device_free"].as_u64().is_some());
    assert_eq!(umm_record_history(0), 0);
    assert_eq!(umm_record_history(-1), -1);
    assert!(last_error().contains("-1 entries"), "{}", last_error());
    free(keep, 0, 0);
}

#[test]
fn snapshot_totals_are_the_statistics() {
    let _g = setup();
    let live: Vec<*mut c_void> = [700, 5 * MIB, 3000, 40 * MIB, 2 * MIB].iter().map(|&s| alloc(s, 1, 0)).collect();
    free(live[1], 1, 0);
    // A stream of its own whose one block fills every page its reservation has mapped (pages of 32 MiB): no free
    // bytes to show.
    let whole = alloc(32 * MIB, 1, 5);
    let snapshot = json(umm_snapshot_json(1)).unwrap();
    let s = stats(1);
    let segments = snapshot["segments"].as_array().expect("segments");
    let sum = |key: &str| segments.iter().map(|x| x[key].as_u64().expect(key)).sum::<u64>();
    assert_eq!(sum("total_size"), current(&s, "reserved_bytes"));
    assert_eq!(sum("allocated_size"), current(&s, "allocated_bytes"));
    assert_eq!(sum("requested_size"), current(&s, "requested_bytes"));
    for segment in segments {
        assert_eq!(segment["device"], 1);
        let blocks = segment["blocks"].as_array().expect("blocks");
        assert_eq!(blocks.iter().map(|b| b["size"].as_u64().unwrap()).sum::<u64>(), segment["total_size"]);
        assert!(blocks.iter().all(|b| b["size"].as_u64().unwrap() > 0), "no empty block: {segment}");
    }
    let requested: BTreeMap<u64, u64> = segments
        .iter()
        .flat_map(|s| s["blocks"].as_array().unwrap().iter())
        .filter(|b| b["state"] == "active_allocated")
        .map(|b| (b["address"].as_u64().unwrap(), b["requested_size"].as_u64().unwrap()))
        .collect();
    for (&p, size) in live.iter().zip([700u64, 0, 3000, 40 << 20, 2 << 20]) {
        if size > 0 {
            assert_eq!(requested.get(&(p as u64)), Some(&size), "{p:?}");
        }
    }
    assert_eq!(requested.len(), 5);
    free(whole, 1, 5);
    assert!(umm_snapshot_json(7).is_null());
    assert!(last_error().contains("device 7"), "{}", last_error());
    for &p in live.iter().filter(|&&p| p != live[1]) {
        free(p, 1, 0);
    }
}

/// Random allocations, frees (on the allocation's stream or another), record_stream, limits and cache releases,
/// checked after every call against the live set: no two live allocations share a byte, each is aligned, the
/// statistics count exactly the live ones, and a refused call leaves a message.
#[test]
fn a_random_workload_never_hands_out_overlapping_memory() {
    let _g = setup();
    let cases: u64 = std::env::var("UMM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(4_000);
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    // Address -> (size asked, stream).
    let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    for step in 0..cases {
        match next() % 10 {
            0..=4 => {
                let size = match next() % 3 {
                    0 => 1 + next() % 4096,
                    1 => 1 + next() % (4 << 20),
                    _ => 1 + next() % (96 << 20),
                } as isize;
                let on = (next() % 3) as usize;
                let p = alloc(size, 0, on) as u64;
                if p == 0 {
                    let message = last_error();
                    assert!(message.contains("out of memory"), "step {step}: {message}");
                    continue;
                }
                assert_eq!(p % 256, 0, "step {step}: aligned");
                let below = live.range(..p).next_back();
                if let Some((&q, &(qs, _))) = below {
                    assert!(q + qs <= p, "step {step}: {p:#x} overlaps {q:#x}+{qs}");
                }
                if let Some((&q, _)) = live.range(p..).next() {
                    assert!(p + size as u64 <= q, "step {step}: {p:#x}+{size} overlaps {q:#x}");
                }
                live.insert(p, (size as u64, on));
            }
            5..=7 if !live.is_empty() => {
                let index = (next() % live.len() as u64) as usize;
                let (&p, &(_, on)) = live.iter().nth(index).expect("an index below the length");
                let by = if next() % 4 == 0 { (on + 1) % 3 } else { on };
                free(p as *mut c_void, 0, by);
                live.remove(&p);
            }
            8 => {
                if let Some((&p, _)) = live.iter().next() {
                    // SAFETY: as in `alloc`.
                    assert_eq!(unsafe { umm_record_stream(p as *mut c_void, stream(5)) }, 0, "{}", last_error());
                }
            }
            _ => match next() % 3 {
                0 => assert!(umm_empty_cache(0) >= 0),
                1 => assert_eq!(umm_set_limit(0, (256 + next() % 512) << 20), 0, "{}", last_error()),
                _ => assert_eq!(umm_set_limit(0, 0), 0),
            },
        }
        let s = stats(0);
        assert_eq!(s["live_pointers"].as_u64(), Some(live.len() as u64), "step {step}");
        let asked = live.values().map(|v| v.0).sum::<u64>();
        // A block freed after a record_stream waits (pending) until the next allocation sees its mark passed.
        if s["pending_frees"] == 0 {
            assert_eq!(current(&s, "requested_bytes"), asked, "step {step}");
        } else {
            assert!(current(&s, "requested_bytes") > asked, "step {step}");
        }
        assert!(current(&s, "reserved_bytes") >= current(&s, "allocated_bytes"), "step {step}");
    }
    for (&p, &(_, on)) in &live {
        free(p as *mut c_void, 0, on);
    }
    assert!(umm_empty_cache(0) >= 0, "returns the pending frees, whose marks passed");
    let s = stats(0);
    assert_eq!(current(&s, "allocated_bytes"), 0);
    assert_eq!(s["pending_frees"], 0);
}

/// Eight threads allocate, free on their own or another stream, record streams and read statistics at once, as
/// PyTorch's main and autograd threads do: every pointer is distinct while live, every free is accepted once, and
/// the statistics come back to zero.
#[test]
fn eight_threads_share_the_registry() {
    let _g = setup();
    let barrier = std::sync::Barrier::new(8);
    let handed: Mutex<BTreeMap<u64, u64>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|scope| {
        for thread in 0..8usize {
            let (barrier, handed) = (&barrier, &handed);
            scope.spawn(move || {
                let mut state = 0x51_7CC1_B727_220A_u64 ^ (thread as u64 + 1).wrapping_mul(0x9E37_79B9);
                let mut next = move || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state
                };
                barrier.wait();
                let mut mine: Vec<(u64, usize)> = Vec::new();
                for _ in 0..400 {
                    if mine.len() < 16 && next() % 3 != 0 {
                        let size = 1 + next() % (3 << 20);
                        let on = thread + 1;
                        let p = alloc(size as isize, (thread % 2) as c_int, on) as u64;
                        assert_ne!(p, 0, "{}", last_error());
                        let clash = {
                            let mut live = handed.lock().unwrap();
                            let below = live.range(..=p).next_back().map(|(&q, &s)| q + s > p).unwrap_or(false);
                            let above = live.range(p..).next().map(|(&q, _)| p + size > q).unwrap_or(false);
                            live.insert(p, size);
                            below || above
                        };
                        assert!(!clash, "thread {thread}: {p:#x}+{size} overlaps a live allocation");
                        if next() % 5 == 0 {
                            // SAFETY: as in `alloc`.
                            assert_eq!(unsafe { umm_record_stream(p as *mut c_void, stream(20 + thread)) }, 0);
                        }
                        mine.push((p, on));
                    } else if !mine.is_empty() {
                        let (p, on) = mine.swap_remove((next() % mine.len() as u64) as usize);
                        handed.lock().unwrap().remove(&p);
                        let by = if next() % 4 == 0 { on + 8 } else { on };
                        free(p as *mut c_void, (thread % 2) as c_int, by);
                    }
                    if next() % 16 == 0 {
                        let s = stats((thread % 2) as c_int);
                        assert!(current(&s, "reserved_bytes") >= current(&s, "allocated_bytes"));
                    }
                }
                for (p, on) in mine {
                    handed.lock().unwrap().remove(&p);
                    free(p as *mut c_void, (thread % 2) as c_int, on);
                }
            });
        }
    });
    assert!(umm_empty_cache(-1) >= 0, "returns the pending frees");
    for device in 0..2 {
        let s = stats(device);
        assert_eq!(current(&s, "allocated_bytes"), 0, "device {device}: {s}");
        assert_eq!(s["live_pointers"], 0);
        assert_eq!(s["pending_frees"], 0);
        assert_eq!(s["num_allocs"], s["num_frees"], "device {device}: every allocation freed once");
    }
}

/// A limit below what is cached releases the cache at once; one at or above it keeps it; 0 lifts it.
#[test]
fn a_limit_below_the_cache_releases_it() {
    let _g = setup();
    let p = alloc(100 * MIB, 0, 0);
    free(p, 0, 0);
    let cached = current(&stats(0), "reserved_bytes");
    assert!(cached >= 100 << 20);
    assert_eq!(umm_set_limit(0, cached), 0);
    assert_eq!(current(&stats(0), "reserved_bytes"), cached, "a limit at what is reserved keeps the cache");
    assert_eq!(umm_set_limit(0, 32 << 20), 0);
    assert!(current(&stats(0), "reserved_bytes") <= 32 << 20, "{}", stats(0));
    assert_eq!(stats(0)["limit_bytes"], 32u64 << 20);
    assert_eq!(umm_set_limit(0, 0), 0);
    assert_eq!(stats(0)["limit_bytes"], Value::Null);
    assert_eq!(umm_set_limit(9, 1 << 20), -1);
    assert!(last_error().contains("device 9"), "{}", last_error());
}

/// A device that does not exist is refused with the devices there are, by number and name, not as if the
/// machine had none.
#[test]
fn an_unknown_device_is_refused_with_the_devices_there_are() {
    let _g = setup();
    assert!(umm_stats_json(2).is_null());
    assert_eq!(
        last_error(),
        "umm: no CUDA pool for device 2: devices are 0..2 (umm simulated device 0, umm simulated device 1)"
    );
    assert!(alloc(MIB, 7, 0).is_null());
    assert_eq!(
        last_error(),
        "umm: no CUDA pool for device 7: devices are 0..2 (umm simulated device 0, umm simulated device 1)"
    );
}

/// The variable that tells a child process of this binary to run [`huge_pool_child`].
const HUGE_CHILD: &str = "UMM_SIM_TEST_HUGE_CHILD";

/// With a huge pool (`UMM_HUGE_MIN`, in a process of its own: the library reads its settings once), a limit
/// must leave the main pool something above what the huge blocks hold.
#[test]
fn a_limit_no_larger_than_the_huge_blocks_is_refused() {
    if std::env::var_os(HUGE_CHILD).is_some() {
        return; // a child runs only `huge_pool_child`
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(&exe)
        .args(["--exact", "huge_pool_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(HUGE_CHILD, "1")
        .env("UMM_HUGE_MIN", (64u64 << 20).to_string())
        .output()
        .expect("the test binary runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
}

#[test]
#[ignore = "run by a_limit_no_larger_than_the_huge_blocks_is_refused in a process of its own"]
fn huge_pool_child() {
    assert!(std::env::var_os(HUGE_CHILD).is_some(), "run by a_limit_no_larger_than_the_huge_blocks_is_refused");
    let _g = setup();
    let huge = alloc(64 * MIB, 0, 0);
    let s = stats(0);
    assert_eq!(s["huge_pool_min_bytes"], 64u64 << 20);
    let held = s["pools"]["huge"]["reserved_bytes"]["current"].as_u64().expect("the huge pool's figures");
    assert_eq!(held, 64 << 20, "{s}");
    assert_eq!(umm_set_limit(0, held), -1);
    assert_eq!(
        last_error(),
        format!("umm_set_limit: {held} bytes is not above the {held} bytes live in huge blocks on device 0")
    );
    assert_eq!(umm_set_limit(0, held + (32 << 20)), 0, "{}", last_error());
    assert_eq!(stats(0)["pools"]["main"]["limit_bytes"], 32u64 << 20, "the rest is the main pool's");
    assert_eq!(umm_set_limit(0, 0), 0);
    free(huge, 0, 0);
}

#[test]
fn emptying_the_cache_returns_the_bytes_it_released() {
    let _g = setup();
    let p = alloc(64 * MIB, 0, 0);
    free(p, 0, 0);
    let (before, before_other) = (current(&stats(0), "reserved_bytes"), current(&stats(1), "reserved_bytes"));
    assert!(before >= 64 << 20, "{}", stats(0));
    let released = umm_empty_cache(0);
    assert_eq!(released as u64, before - current(&stats(0), "reserved_bytes"), "what went back is what it says");
    assert_eq!(current(&stats(1), "reserved_bytes"), before_other, "another device's cache stays");
    assert_eq!(umm_empty_cache(0), 0, "nothing left to release");
}
