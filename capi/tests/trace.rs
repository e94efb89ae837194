//! `UMM_TRACE` through the C ABI. One test, so that the variable is set before the C ABI starts (it is read once
//! per process). Everywhere: the trace file is created with its header when the C ABI starts, failed allocations
//! are not recorded, and `umm_trace_flush` returns 0. With a GPU: eight threads allocate on streams of their own
//! and on the null stream, free on their own stream or another thread frees for them, and the trace holds every
//! allocation and free in an order a replay can follow, with the streams numbered 0..9.
//!
//! On a GPU machine: `UMM_REQUIRE_BACKENDS=cuda cargo test -p umm-capi --test trace`.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CStr};
use std::io::Read;
use std::ptr;
use std::sync::mpsc;
use umm_backends::testing::skip_or_fail;
use umm_capi::*;

fn last_error() -> String {
    let p = umm_last_error();
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string valid until the next umm call on this thread; copied at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The ops of a trace file: (`a`, id, bytes, stream) or (`f`, id, 0, 0), after checking the header and that every
/// other line is a comment or a well-formed op.
fn ops(path: &std::path::Path) -> Vec<(char, u64, u64, u64)> {
    let mut text = String::new();
    flate2::read::MultiGzDecoder::new(std::fs::File::open(path).unwrap()).read_to_string(&mut text).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("# umm-trace v1"));
    lines
        .filter(|l| !l.starts_with("# "))
        .map(|l| {
            let f: Vec<u64> = l[2..].split(' ').map(|n| n.parse().unwrap_or_else(|_| panic!("{l:?}"))).collect();
            match (l.as_bytes()[0], f.len()) {
                (b'a', 3) => ('a', f[0], f[1], f[2]),
                (b'f', 1) => ('f', f[0], 0, 0),
                _ => panic!("not an op: {l:?}"),
            }
        })
        .collect()
}

#[test]
fn trace_through_the_c_abi() {
    let path = std::env::temp_dir().join(format!("umm-capi-abi-{}.trace.gz", std::process::id()));
    std::env::set_var("UMM_TRACE", &path);
    let devices = umm_device_count();
    assert!(path.exists(), "the C ABI creates the trace when it starts");
    // A failed allocation is not recorded.
    // SAFETY: a NULL stream is the legacy default stream, valid for any device.
    assert!(unsafe { umm_alloc(1 << 20, 4096, ptr::null_mut()) }.is_null());
    assert_eq!(umm_trace_flush(), 0, "{}", last_error());
    if devices == 0 {
        assert_eq!(ops(&path), []);
        let _ = std::fs::remove_file(&path);
        return skip_or_fail("cuda", "the traced C ABI workload needs a device: no CUDA device was found");
    }

    use umm_backends::cuda;
    let ctx = cuda::discover().devices.into_iter().next().expect("a device").context().clone();
    // Pointers one thread hands the next to free.
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..8).map(|_| mpsc::channel::<usize>()).unzip();
    let mut receivers: Vec<_> = receivers.into_iter().map(Some).collect();
    let workers: Vec<_> = (0..8)
        .map(|t| {
            let ctx = ctx.clone();
            let next = senders[(t + 1) % 8].clone();
            let from_previous = receivers[t].take().unwrap();
            std::thread::spawn(move || {
                let stream = ctx.new_stream().unwrap();
                let mine = stream.cu_stream() as Stream;
                let (mut allocs, mut frees) = (0u64, 0u64);
                for i in 0..500usize {
                    let size = 256 + (i * 4096 + t * 512) % (1 << 20);
                    // Every seventh allocation on the null stream (a stream every thread shares).
                    let s = if i % 7 == 0 { ptr::null_mut() } else { mine };
                    // SAFETY: `s` is NULL or this thread's live stream, which outlives its blocks (they are freed
                    // on it, or on the null stream, and the cache is emptied before it is dropped).
                    let p = unsafe { umm_alloc(size as isize, 0, s) };
                    assert!(!p.is_null(), "{}", last_error());
                    allocs += 1;
                    if i % 3 == 0 {
                        next.send(p as usize).unwrap();
                    } else {
                        // SAFETY: as above; `p` is live and freed once.
                        unsafe { umm_free(p, size as isize, 0, s) };
                        frees += 1;
                    }
                    while let Ok(q) = from_previous.try_recv() {
                        // SAFETY: `q` came from another thread's umm_alloc and is freed once, on the null stream:
                        // the block waits for it (record_stream) before reuse.
                        unsafe { umm_free(q as *mut c_void, 0, 0, ptr::null_mut()) };
                        frees += 1;
                    }
                }
                drop(next);
                (stream, from_previous, allocs, frees)
            })
        })
        .collect();
    drop(senders);
    let mut results: Vec<_> = workers.into_iter().map(|w| w.join().expect("a worker failed")).collect();
    // Pointers sent after their receiver's last look.
    for (_, from_previous, _, frees) in &mut results {
        for q in from_previous.iter() {
            // SAFETY: as in the workers.
            unsafe { umm_free(q as *mut c_void, 0, 0, ptr::null_mut()) };
            *frees += 1;
        }
    }
    ctx.synchronize().unwrap();
    assert!(umm_empty_cache(-1) >= 0, "{}", last_error());
    let (allocs, frees) = results.iter().fold((0, 0), |(a, f), r| (a + r.2, f + r.3));
    drop(results);
    assert_eq!(umm_trace_flush(), 0, "{}", last_error());

    let ops = ops(&path);
    let _ = std::fs::remove_file(&path);
    let mut live = HashMap::new();
    let mut freed = HashSet::new();
    let mut streams = 0;
    for (i, &(op, id, bytes, stream)) in ops.iter().enumerate() {
        if op == 'a' {
            assert!(live.insert(id, bytes).is_none() && !freed.contains(&id), "line {i}: a {id} twice");
            assert!(stream <= streams, "line {i}: stream {stream} before stream {streams}");
            streams = streams.max(stream + 1);
            assert!((256..256 + (1 << 20)).contains(&bytes), "line {i}: {bytes} bytes");
        } else {
            assert!(live.remove(&id).is_some(), "line {i}: f {id} without a live a {id}");
            freed.insert(id);
        }
    }
    assert_eq!(streams, 9, "eight threads' streams and the null stream");
    assert_eq!((ops.iter().filter(|o| o.0 == 'a').count() as u64, freed.len() as u64), (allocs, frees));
    assert!(live.is_empty(), "{} allocations never freed", live.len());
}
