//! CUDA graph captures through the C ABI, on simulated devices whose streams model a capture as the driver
//! does (`umm_sim_capture`): what a serving framework does around `torch.cuda.graph`. Memory allocated during a
//! capture belongs to the capture's private pool and is never handed to anything else while the graph may
//! replay; no pool makes a call that the driver refuses during a capture (each would invalidate it), under every
//! setting of cross-stream sharing, stitching and segment mode (each in a process of its own, since the library
//! reads its settings once).

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::process::Command;
use umm_capi::*;

mod common;

use common::{alloc, free, last_error, stats, stream, MIB};

const DEVICE: c_int = 0;
/// The stream the graph is captured on (a side stream, as `torch.cuda.graph` uses), and another that keeps
/// working during the capture (a second serving thread).
const CAPTURE: usize = 3;
const OTHER: usize = 5;

/// The variable that tells a child process which settings it runs under.
const CHILD: &str = "UMM_GRAPH_TEST_SETTINGS";

fn to_pool(size: isize, on: usize, pool: PoolId) -> *mut c_void {
    // SAFETY: a simulated device queues no work: any stream value is fine.
    let p = unsafe { umm_alloc_to_pool(size, DEVICE, stream(on), pool) };
    assert!(!p.is_null(), "{}", last_error());
    p
}

fn sim_capture(on: usize, capturing: bool) {
    // SAFETY: as in `to_pool`.
    assert_eq!(unsafe { umm_sim_capture(DEVICE, stream(on), c_int::from(capturing)) }, 0, "{}", last_error());
}

fn violations() -> u64 {
    stats(DEVICE)["capture_violations"].as_u64().expect("a simulated device counts capture violations")
}

/// Address ranges, to check that no block handed out overlaps a graph's memory.
#[derive(Default)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn add(&mut self, p: *mut c_void, size: isize) {
        self.0.insert(p as u64, p as u64 + size as u64);
    }
    fn overlapping(&self, p: *mut c_void, size: isize) -> Option<(u64, u64)> {
        let (start, end) = (p as u64, p as u64 + size as u64);
        self.0.range(..end).next_back().map(|(&s, &e)| (s, e)).filter(|&(_, e)| e > start)
    }
}

/// The graph check of a serving framework: weights, a warm-up on the capture stream, a capture whose
/// intermediates are freed (some during the capture, the rest after it), tensors made after the capture on
/// several streams, a second capture into the same pool, then the graphs destroyed. Checks every address
/// handed out after the capture against the graphs' memory, and that the capture cost no refused call.
fn serve_a_captured_graph() {
    let pool = PoolId { first: 0, second: 7 };
    let before = violations();
    // Weights, then a warm-up of the function on the capture stream: its intermediates freed, cached there.
    let weights: Vec<_> = (0..4).map(|_| alloc(64 * MIB, DEVICE, 0)).collect();
    for _ in 0..3 {
        let warm: Vec<_> =
            [64 * MIB, 64 * MIB, 3 * MIB, 512 << 10].iter().map(|&s| (alloc(s, DEVICE, CAPTURE), s)).collect();
        warm.into_iter().for_each(|(p, _)| free(p, DEVICE, CAPTURE));
    }
    // A tensor of the warm-up that another stream used and that the capture frees.
    let shared = alloc(8 * MIB, DEVICE, CAPTURE);
    // SAFETY: as in `to_pool`.
    assert_eq!(unsafe { umm_record_stream(shared, stream(OTHER)) }, 0);
    // A tensor of another stream that the captured work reads, freed during the capture: its free must wait
    // for the capture stream's real work, which a mark recorded during the capture does not stand for.
    let read_by_graph = alloc(4 * MIB, DEVICE, OTHER);
    // SAFETY: as in `to_pool`.
    assert_eq!(unsafe { umm_record_stream(read_by_graph, stream(CAPTURE)) }, 0);
    // The capture: the driver marks the stream, then PyTorch's allocator is told.
    sim_capture(CAPTURE, true);
    assert_eq!(umm_pool_retain(DEVICE, pool), 1);
    assert_eq!(umm_capture_begin(DEVICE), 0);
    let mut graph = Ranges::default();
    let mut intermediates = Vec::new();
    for layer in 0..4 {
        let size = if layer % 2 == 0 { 64 * MIB } else { 48 * MIB + 4096 };
        let out = to_pool(size, CAPTURE, pool);
        graph.add(out, size);
        let small = to_pool(256 << 10, CAPTURE, pool);
        graph.add(small, 256 << 10);
        // The previous layer's output dies inside the capture: its memory serves later layers of the graph.
        if let Some((p, _)) = intermediates.pop() {
            free(p, DEVICE, CAPTURE);
        }
        free(small, DEVICE, CAPTURE);
        intermediates.push((out, size));
    }
    free(shared, DEVICE, CAPTURE);
    free(read_by_graph, DEVICE, OTHER);
    // Another serving thread allocates and frees on its own stream meanwhile, growing the main pool.
    let others: Vec<_> = (0..6).map(|i| (alloc((i + 1) * 24 * MIB, DEVICE, OTHER), (i + 1) * 24 * MIB)).collect();
    for (p, size) in &others {
        assert!(graph.overlapping(*p, *size).is_none(), "a block of another stream over the graph's memory");
    }
    others.into_iter().for_each(|(p, _)| free(p, DEVICE, OTHER));
    // As PyTorch does: the driver ends the capture, then the allocator is told.
    sim_capture(CAPTURE, false);
    assert_eq!(umm_capture_end(DEVICE), 0);
    // The graph's output stays with the caller; its intermediates were freed at the end of the capture.
    let (output, output_size) = intermediates.pop().expect("one output");
    intermediates.into_iter().for_each(|(p, _)| free(p, DEVICE, CAPTURE));
    // What PyTorch's checkPoolLiveAllocations asks: the pool's live blocks are the output alone.
    let mut live = [std::ptr::null_mut(); 4];
    // SAFETY: `live` is writable for its length.
    assert_eq!(unsafe { umm_pool_live(DEVICE, pool, live.as_mut_ptr(), live.len()) }, 1);
    assert_eq!(live[0], output);
    // SAFETY: no address is written with a capacity of 0.
    assert_eq!(unsafe { umm_pool_live(DEVICE, pool, std::ptr::null_mut(), 0) }, 1, "counted without a list");
    // 64 tensors after the capture, of every size, on the default stream and the capture stream.
    let mut after = Vec::new();
    for i in 0..64isize {
        let size = [1 << 10, 300 << 10, 2 * MIB, 9 * MIB, 48 * MIB + 4096, 64 * MIB][i as usize % 6];
        let on = if i % 2 == 0 { 0 } else { CAPTURE };
        let p = alloc(size, DEVICE, on);
        assert!(!p.is_null(), "{}", last_error());
        if let Some(range) = graph.overlapping(p, size) {
            panic!("tensor {i} ({size} bytes at {p:?}) lies over the graph's memory {range:x?}: replays overwrite it");
        }
        after.push((p, on));
    }
    // A second graph captured into the same pool reuses the first one's free memory, and only that.
    sim_capture(CAPTURE, true);
    assert_eq!(umm_pool_retain(DEVICE, pool), 2);
    assert_eq!(umm_capture_begin(DEVICE), 0);
    let second = to_pool(64 * MIB, CAPTURE, pool);
    assert!(graph.overlapping(second, 64 * MIB).is_some(), "a capture into a shared pool reuses its memory");
    free(second, DEVICE, CAPTURE);
    // As PyTorch does: the driver ends the capture, then the allocator is told.
    sim_capture(CAPTURE, false);
    assert_eq!(umm_capture_end(DEVICE), 0);
    assert_eq!(violations(), before, "a call the driver refuses during a capture");
    // The graphs are destroyed: the pool goes once the output, its last block, is freed.
    assert_eq!(umm_pool_release(DEVICE, pool), 1);
    assert_eq!(umm_pool_release(DEVICE, pool), 0);
    assert_eq!(umm_pool_release(DEVICE, pool), -1, "released more often than retained");
    assert!(last_error().contains("no retained private pool"), "{}", last_error());
    assert_eq!(stats(DEVICE)["graph_pools"], 1, "the output keeps its pool");
    assert!(graph.overlapping(output, output_size).is_some());
    free(output, DEVICE, CAPTURE);
    assert_eq!(stats(DEVICE)["graph_pools"], 0, "the last block freed, the pool's memory goes back");
    after.into_iter().for_each(|(p, on)| free(p, DEVICE, on));
    weights.into_iter().for_each(|p| free(p, DEVICE, 0));
    assert_eq!(stats(DEVICE)["live_pointers"], 0);
}

#[test]
fn a_graphs_memory_is_never_handed_out_under_it() {
    let _g = common::simulated();
    serve_a_captured_graph();
}

/// The model is an oracle that can fail: a capture umm is not told of, whose stream holds free memory that
/// another stream then needs, makes umm query a mark the capture recorded.
#[test]
fn a_capture_umm_is_not_told_of_is_caught_by_the_model() {
    let _g = common::simulated();
    let before = violations();
    let cached: Vec<_> = (0..4).map(|_| alloc(256 * MIB, DEVICE, CAPTURE)).collect();
    cached.into_iter().for_each(|p| free(p, DEVICE, CAPTURE));
    sim_capture(CAPTURE, true);
    let taken: Vec<_> = (0..8).map(|_| alloc(256 * MIB, DEVICE, OTHER)).collect();
    sim_capture(CAPTURE, false);
    taken.into_iter().for_each(|p| free(p, DEVICE, OTHER));
    assert!(violations() > before, "memory moved from a capturing stream without a refused call?");
    assert!(umm_empty_cache(DEVICE) >= 0);
}

#[test]
fn private_pools_refuse_what_was_not_retained() {
    let _g = common::simulated();
    let pool = PoolId { first: 9, second: 0 };
    // SAFETY: as in `to_pool`.
    let p = unsafe { umm_alloc_to_pool(MIB, DEVICE, stream(0), pool) };
    assert!(p.is_null());
    assert!(last_error().contains("retain it first"), "{}", last_error());
    assert_eq!(umm_pool_use_count(DEVICE, pool), 0);
    assert_eq!(umm_pool_retain(DEVICE, pool), 1);
    assert_eq!(umm_pool_use_count(DEVICE, pool), 1);
    assert_eq!(umm_pool_release(DEVICE, pool), 0);
    // SAFETY: as in `to_pool`.
    assert!(unsafe { umm_alloc_to_pool(MIB, DEVICE, stream(0), pool) }.is_null());
    assert_eq!(umm_capture_end(DEVICE), -1, "no capture underway");
    assert!(last_error().contains("no capture is underway"), "{}", last_error());
    assert_eq!(umm_pool_retain(99, pool), -1, "an unknown device");
    // umm_delete frees on the allocation's stream; an address umm never handed out is refused.
    let q = alloc(MIB, DEVICE, CAPTURE);
    umm_delete(q);
    assert_eq!(stats(DEVICE)["live_pointers"], 0);
    umm_delete(q);
    assert_eq!(
        last_error(),
        format!("umm_delete: {:#x} (device -1) was not allocated by umm or was already freed; nothing done", q as u64)
    );
}

/// Every combination of the settings that change which paths a pool takes, each in a child process.
#[test]
fn captures_are_safe_under_every_setting() {
    if std::env::var_os(CHILD).is_some() {
        return; // a child runs only `settings_child`
    }
    let exe = std::env::current_exe().expect("the test binary");
    for cross in ["completed", "wait", "off"] {
        for stitch in ["on", "off"] {
            for mode in ["auto", "plain"] {
                // Thread caches on (the default bounds) and off: cached blocks take other paths.
                for cache in ["32MiB", "0"] {
                    let settings = format!(
                        "UMM_CROSS_STREAM={cross} UMM_STITCH={stitch} UMM_SEGMENT_MODE={mode} UMM_THREAD_CACHE={cache}"
                    );
                    let large = if cache == "0" { "0" } else { "1GiB" };
                    let out = Command::new(&exe)
                        .args(["--exact", "settings_child", "--ignored", "--nocapture", "--test-threads=1"])
                        .env(CHILD, &settings)
                        .env("UMM_CROSS_STREAM", cross)
                        .env("UMM_STITCH", stitch)
                        .env("UMM_SEGMENT_MODE", mode)
                        .env("UMM_THREAD_CACHE", cache)
                        .env("UMM_THREAD_CACHE_LARGE", large)
                        .output()
                        .expect("the test binary runs");
                    let text =
                        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
                    assert!(out.status.success() && text.contains("1 passed"), "under {settings}:\n{text}");
                }
            }
        }
    }
}

/// The graph check under the settings of [`CHILD`], run by `captures_are_safe_under_every_setting`.
#[test]
#[ignore = "run by captures_are_safe_under_every_setting in a process of its own"]
fn settings_child() {
    assert!(std::env::var_os(CHILD).is_some(), "run by captures_are_safe_under_every_setting");
    let _g = common::simulated();
    serve_a_captured_graph();
}

/// What the device's pools counted so far, by name.
fn count(key: &str) -> u64 {
    stats(DEVICE)[key].as_u64().expect(key)
}

fn reserved() -> u64 {
    stats(DEVICE)["reserved_bytes"]["current"].as_u64().expect("reserved bytes")
}

/// A private pool maps pages of 2 MiB (a graph's memory is kept while it lives: small pages keep it small), and
/// a request that no free range holds maps new pages rather than stitching free pages together.
#[test]
fn a_private_pool_maps_pages_of_2_mib_and_stitches_nothing() {
    let _g = common::simulated();
    let pool = PoolId { first: 21, second: 0 };
    assert_eq!(umm_pool_retain(DEVICE, pool), 1);
    let (start, stitched) = (reserved(), count("num_stitched_allocs"));
    // Four blocks of two pages each, one after the other; the first and the third freed: four free pages in
    // two ranges of two.
    let blocks: Vec<_> = (0..4).map(|_| to_pool(4 * MIB, CAPTURE, pool)).collect();
    assert_eq!(reserved(), start + (16 << 20), "4 blocks of 4 MiB map 16 MiB");
    free(blocks[0], DEVICE, CAPTURE);
    free(blocks[2], DEVICE, CAPTURE);
    // 8 MiB: no free range of four pages; new pages are mapped.
    let large = to_pool(8 * MIB, CAPTURE, pool);
    assert_eq!(count("num_stitched_allocs"), stitched);
    assert_eq!(reserved(), start + (24 << 20));
    for p in [blocks[1], blocks[3], large] {
        free(p, DEVICE, CAPTURE);
    }
    assert_eq!(umm_pool_release(DEVICE, pool), 0);
    assert_eq!(reserved(), start, "the pool's pages went back with it");
}

/// A private pool serves one stream's request from its own memory only (captures order their streams, not the
/// pool), and plans no steps: repeated steps allocate as the first did.
#[test]
fn a_private_pool_neither_moves_memory_between_streams_nor_plans_steps() {
    let _g = common::simulated();
    let pool = PoolId { first: 22, second: 0 };
    assert_eq!(umm_pool_retain(DEVICE, pool), 1);
    let start = reserved();
    let moves = || count("num_segments_shared") + count("num_pages_shared");
    let (moved, planned) = (moves(), count("num_planned_allocs"));
    // 16 MiB cached on the capture stream; the same on another stream maps 16 MiB more.
    let first = to_pool(16 * MIB, CAPTURE, pool);
    free(first, DEVICE, CAPTURE);
    let second = to_pool(16 * MIB, OTHER, pool);
    assert_eq!(moves(), moved, "nothing moved from the capture stream");
    assert_eq!(reserved(), start + (32 << 20));
    free(second, DEVICE, OTHER);
    // The same step four times.
    for _ in 0..4 {
        let a = to_pool(6 * MIB, CAPTURE, pool);
        let b = to_pool(2 * MIB, CAPTURE, pool);
        free(a, DEVICE, CAPTURE);
        free(b, DEVICE, CAPTURE);
        assert_eq!(umm_mark_step(DEVICE), 0);
    }
    assert_eq!(count("num_planned_allocs"), planned);
    assert_eq!(umm_pool_release(DEVICE, pool), 0);
}

/// A private pool that cannot be made is refused with its name: a simulated device makes 256 tagged and private
/// pools at most (each has addresses of its own). Device 1, which no other test of this file makes pools on.
#[test]
fn a_private_pool_that_cannot_be_made_is_refused_by_name() {
    let _g = common::simulated();
    for first in 1000..1300 {
        let pool = PoolId { first, second: 0 };
        if umm_pool_retain(1, pool) == 1 {
            assert_eq!(umm_pool_release(1, pool), 0);
            continue;
        }
        assert_eq!(
            last_error(),
            format!(
                "umm_pool_retain: umm: cannot create private pool ({first}, 0) on simulated device 1: invalid \
                 configuration: a simulated device has at most 256 tags"
            )
        );
        assert_eq!(first, 1256, "the 257th pool of the device");
        return;
    }
    panic!("300 private pools made on one simulated device");
}
