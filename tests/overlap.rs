//! DoubleBuffer and Prefetcher on every backend present: host always, OpenCL (PoCL) and wgpu (lavapipe) where a
//! driver is installed, CUDA where a GPU is. A backend without a device skips with a printed reason, unless
//! `UMM_REQUIRE_BACKENDS` names it. Every test that could hang runs under a timeout (a channel and
//! `recv_timeout`), so a lost batch or a stuck worker fails the test instead of stalling the suite.

use std::sync::mpsc;
use std::time::Duration;
use umm::backends::testing::skip_or_fail;
use umm::overlap::{OverlapOptions, PrefetchError};
use umm::{Api, DeviceSelector, Error, Limit, PoolKind, UniversalMemoryManager};

const BATCHES: usize = 1000;
const TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `f` on a thread and fails the test if it has not finished within [`TIMEOUT`].
fn within_timeout<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(TIMEOUT) {
        Ok(r) => {
            worker.join().unwrap();
            r
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The closure panicked: re-raise its panic.
            std::panic::resume_unwind(worker.join().unwrap_err())
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: no result within {TIMEOUT:?} (hung)"),
    }
}

/// A small deterministic generator (xorshift64*), so failures replay.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// Batches of random lengths in `0..=max`, each element naming its batch and position.
fn batches(count: usize, max: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = Rng(seed);
    (0..count)
        .map(|b| {
            let len = rng.below(max + 1);
            (0..len).map(|i| (b as u32) << 16 | i as u32).collect()
        })
        .collect()
}

/// Each backend present: its name, a manager that sees it, and the selector that picks it.
fn backends() -> Vec<(&'static str, UniversalMemoryManager, DeviceSelector)> {
    let mut found = vec![(
        "host",
        UniversalMemoryManager::builder().backends(false, false, false).build().unwrap(),
        DeviceSelector::Host,
    )];
    for (name, api) in [("cuda", Api::Cuda), ("opencl", Api::OpenCl), ("wgpu", Api::Wgpu)] {
        let mm = UniversalMemoryManager::builder()
            .backends(api == Api::Cuda, api == Api::OpenCl, api == Api::Wgpu)
            .build()
            .unwrap();
        if mm.devices().iter().any(|d| d.has_api(api)) {
            found.push((name, mm, DeviceSelector::Api(api)));
        } else {
            skip_or_fail(name, &format!("no {api} device ({})", mm.skipped().join("; ")));
        }
    }
    found
}

/// The API of a backend named by [`backends`].
fn api_of(name: &str) -> Api {
    match name {
        "host" => Api::Host,
        "cuda" => Api::Cuda,
        "opencl" => Api::OpenCl,
        _ => Api::Wgpu,
    }
}

/// Allocated bytes and live blocks in the manager's pools other than pinned staging.
fn device_usage(mm: &UniversalMemoryManager) -> (u64, u64) {
    let stats = mm.global_memory_stats();
    let entries = stats.devices.iter().flat_map(|d| &d.pools).filter(|p| p.kind != PoolKind::HostPinned);
    entries.fold((0, 0), |(bytes, blocks), p| {
        (bytes + p.stats.allocated_bytes.current, blocks + p.stats.active_blocks.current)
    })
}

/// Allocated bytes in every pool, pinned staging included. CUDA defers the free of a block used on a stream
/// other than its own (an upload's copy stream) until that stream's work is done, and returns such blocks at the
/// next allocation or cleanup: a cleanup round first hands back those whose work is done (it frees nothing
/// live, so elsewhere it changes nothing here).
fn allocated(mm: &UniversalMemoryManager) -> u64 {
    mm.release_all_cached();
    mm.global_memory_stats().total.allocated_bytes.current
}

#[test]
fn double_buffer_delivers_1000_random_batches_intact_and_in_order_on_every_backend() {
    for (name, mm, selector) in backends() {
        let mm = std::sync::Arc::new(mm);
        let run = std::sync::Arc::clone(&mm);
        within_timeout(name, move || {
            let data = batches(BATCHES, 300, 7);
            let mut db = run.double_buffer::<u32>(300, OverlapOptions::new().device(selector).label("db")).unwrap();
            assert_eq!(db.capacity(), 300);
            db.prefetch_next(&data[0]).unwrap();
            db.swap();
            for i in 0..data.len() {
                if let Some(next) = data.get(i + 1) {
                    db.prefetch_next(next).unwrap();
                }
                let front = db.current().unwrap();
                assert_eq!(front.buffer().api(), Some(api_of(name)), "{name}: the buffers live there");
                assert_eq!(front.len(), data[i].len(), "{name}: length of batch {i}");
                assert_eq!(front.to_vec().unwrap(), data[i], "{name}: batch {i}");
                db.swap();
            }
            db.synchronize().unwrap();
        });
        assert_eq!(allocated(&mm), 0, "{name}: the double buffer returned its memory");
    }
}

#[test]
fn double_buffer_of_bytes_handles_lengths_that_are_not_whole_words() {
    for (name, mm, selector) in backends() {
        let mut db = mm.double_buffer::<u8>(37, selector).unwrap();
        for (i, len) in [37usize, 1, 0, 5, 36, 3, 2].into_iter().enumerate() {
            let batch: Vec<u8> = (0..len).map(|j| (i * 40 + j) as u8).collect();
            db.prefetch_next(&batch).unwrap();
            db.swap();
            let front = db.current().unwrap();
            assert_eq!((front.len(), front.is_empty()), (len, len == 0), "{name}");
            assert_eq!(front.to_vec().unwrap(), batch, "{name}: batch {i} of {len} bytes");
            assert_eq!(front.buffer().len(), 37);
        }
    }
}

#[test]
fn double_buffer_in_pinned_memory_works_on_every_backend() {
    for (name, mm, selector) in backends() {
        let options = OverlapOptions::new().device(selector).placement(umm::Placement::HostPinned);
        // Pinned memory only where the host can address it: not through wgpu, nor OpenCL on a discrete device.
        let offered =
            mm.devices().iter().any(|d| selector.matches(&d.view()) && d.pool_kinds().contains(&PoolKind::HostPinned));
        if !offered {
            let Err(err) = mm.double_buffer::<u64>(64, options) else { panic!("{name}: no pinned pool to serve it") };
            assert!(err.is_no_device() && err.to_string().contains("host_pinned"), "{name}: {err}");
            continue;
        }
        let mut db = mm.double_buffer::<u64>(64, options).unwrap();
        for i in 0..20u64 {
            let batch: Vec<u64> = (0..i * 3).map(|j| i << 32 | j).collect();
            db.prefetch_next(&batch).unwrap();
            db.swap();
            assert_eq!(db.current().unwrap().to_vec().unwrap(), batch, "{name}: batch {i}");
        }
    }
}

#[test]
fn double_buffer_refuses_bad_inputs_by_name() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).build().unwrap();
    match mm.double_buffer::<f32>(0, DeviceSelector::Host) {
        Err(Error::ZeroParameter { what }) => assert!(what.contains("capacity"), "{what}"),
        other => panic!("expected ZeroParameter, got {other:?}"),
    }
    let read_only = OverlapOptions::new().device(DeviceSelector::Host).placement(umm::Placement::ReadOnly);
    match mm.double_buffer::<f32>(8, read_only) {
        Err(e @ Error::InvalidConfig(_)) => assert!(e.to_string().contains("ReadOnly"), "{e}"),
        other => panic!("expected InvalidConfig for ReadOnly memory, got {other:?}"),
    }
    let mut db = mm.double_buffer::<f32>(8, DeviceSelector::Host).unwrap();
    match db.current() {
        Err(Error::NothingPrefetched) => {}
        other => panic!("expected NothingPrefetched, got {other:?}"),
    }
    match db.prefetch_next(&[0.0; 9]) {
        Err(Error::BatchTooLarge { len: 9, capacity: 8 }) => {}
        other => panic!("expected BatchTooLarge, got {other:?}"),
    }
    // The refused batch changed nothing; a fitting one goes through.
    db.prefetch_next(&[1.0; 8]).unwrap();
    db.swap();
    assert_eq!(db.current().unwrap().to_vec().unwrap(), vec![1.0; 8]);
    // After a swap the other buffer is the front, and it holds nothing yet.
    db.swap();
    assert!(matches!(db.current(), Err(Error::NothingPrefetched)));
}

#[test]
fn prefetcher_delivers_1000_random_batches_intact_and_in_order_within_its_memory_bound_on_every_backend() {
    const LOOKAHEAD: usize = 3;
    for (name, mm, selector) in backends() {
        let mm = std::sync::Arc::new(mm);
        let run = std::sync::Arc::clone(&mm);
        within_timeout(name, move || {
            let data = batches(BATCHES, 500, 11);
            let source = data.clone();
            let prefetch = run.prefetcher(LOOKAHEAD, 3).device(selector).wrap(source).unwrap();
            let mut seen = 0;
            let mut peak_blocks = 0;
            for (i, batch) in prefetch.enumerate() {
                let batch = batch.unwrap();
                assert_eq!(batch.index(), i as u64);
                assert!(batch.is_empty() || batch.api() == Some(api_of(name)), "{name}: batch {i} lives there");
                assert_eq!(batch.to_vec().unwrap(), data[i], "{name}: batch {i}");
                peak_blocks = peak_blocks.max(device_usage(&run).1);
                seen += 1;
            }
            assert_eq!(seen, BATCHES, "{name}: every batch came through");
            // CUDA keeps the blocks of consumed batches until the next allocation returns them (see `allocated`).
            let deferred = if name == "cuda" { LOOKAHEAD } else { 0 };
            assert!(
                peak_blocks <= (LOOKAHEAD + 2 + deferred) as u64,
                "{name}: at most lookahead + 2 batches live at once, saw {peak_blocks}"
            );
        });
        assert_eq!(allocated(&mm), 0, "{name}: every buffer went back");
    }
}

#[derive(Debug, PartialEq)]
struct Broken(usize);

#[test]
fn source_errors_come_through_in_their_place_and_the_stream_goes_on() {
    for (name, mm, selector) in backends() {
        let mm = std::sync::Arc::new(mm);
        within_timeout(name, move || {
            let items: Vec<Result<Vec<u32>, Broken>> =
                (0..20).map(|i| if i % 7 == 5 { Err(Broken(i)) } else { Ok(vec![i as u32; 10 + i]) }).collect();
            let got: Vec<_> = mm.prefetcher(2, 4).device(selector).try_wrap(items).unwrap().collect();
            assert_eq!(got.len(), 20);
            for (i, item) in got.into_iter().enumerate() {
                match item {
                    Err(PrefetchError::Source(Broken(j))) => assert_eq!((i % 7, j), (5, i)),
                    Ok(batch) => assert_eq!(batch.to_vec().unwrap(), vec![i as u32; 10 + i]),
                    Err(other) => panic!("{name}: item {i}: unexpected {other:?}"),
                }
            }
        });
    }
}

#[test]
fn an_upload_failure_surfaces_as_an_error_not_a_hang() {
    let mm =
        UniversalMemoryManager::builder().backends(false, false, false).limit(Limit::Bytes(1 << 20)).build().unwrap();
    within_timeout("limit", move || {
        let items = vec![vec![1u8; 1000], vec![2u8; 4 << 20], vec![3u8; 1000]];
        let mut it = mm.prefetcher(1, 1).device(DeviceSelector::Host).wrap(items).unwrap();
        assert_eq!(it.next().unwrap().unwrap().to_vec().unwrap(), vec![1u8; 1000]);
        match it.next() {
            Some(Err(PrefetchError::Upload(e))) => assert!(e.is_out_of_memory() || e.is_too_large(), "{e}"),
            other => panic!("expected an upload error, got {other:?}"),
        }
        assert_eq!(it.next().unwrap().unwrap().to_vec().unwrap(), vec![3u8; 1000]);
        assert!(it.next().is_none());
        assert!(it.next().is_none(), "the end stays the end");
    });
}

#[test]
fn a_panicking_source_ends_the_stream_with_an_error() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).build().unwrap();
    within_timeout("panic", move || {
        let items = (0..10u32).map(|i| if i == 3 { panic!("source broke at {i}") } else { vec![i; 4] });
        let got: Vec<_> = mm.prefetcher(2, 2).device(DeviceSelector::Host).wrap(items).unwrap().collect();
        assert_eq!(got.len(), 4, "three batches, then the panic, then the end");
        for (i, item) in got.iter().take(3).enumerate() {
            assert_eq!(item.as_ref().unwrap().to_vec().unwrap(), vec![i as u32; 4]);
        }
        match &got[3] {
            Err(PrefetchError::WorkerPanicked(m)) => assert!(m.contains("source broke at 3"), "{m}"),
            other => panic!("expected WorkerPanicked, got {other:?}"),
        }
    });
}

#[test]
fn dropping_a_prefetch_midway_stops_the_workers_and_returns_every_buffer() {
    for (name, mm, selector) in backends() {
        let mm = std::sync::Arc::new(mm);
        let run = std::sync::Arc::clone(&mm);
        within_timeout(name, move || {
            // An endless source: only dropping the iterator ends the workers.
            let endless = (0u32..).map(|i| vec![i; 4096]);
            let mut it = run.prefetcher(4, 3).device(selector).wrap(endless).unwrap();
            let mut kept = Vec::new();
            for i in 0..10 {
                let batch = it.next().unwrap().unwrap();
                assert_eq!(batch.to_vec().unwrap(), vec![i; 4096]);
                kept.push(batch);
            }
            assert!(device_usage(&run).0 > 0);
            drop(it);
            drop(kept);
        });
        assert_eq!(allocated(&mm), 0, "{name}: nothing left allocated, staging included");
        assert_eq!(device_usage(&mm), (0, 0), "{name}: no live block");
    }
}

#[test]
fn prefetcher_refuses_zero_lookahead_and_zero_workers_by_name() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).build().unwrap();
    let batches = || vec![vec![1.0f32; 4]];
    match mm.prefetcher(0, 2).wrap(batches()) {
        Err(Error::ZeroParameter { what }) => assert!(what.contains("lookahead"), "{what}"),
        other => panic!("expected ZeroParameter for the lookahead, got {other:?}"),
    }
    match mm.prefetcher(2, 0).wrap(batches()) {
        Err(Error::ZeroParameter { what }) => assert!(what.contains("worker"), "{what}"),
        other => panic!("expected ZeroParameter for the workers, got {other:?}"),
    }
    let p = mm.prefetcher(3, 1);
    assert_eq!((p.lookahead(), p.workers()), (3, 1));
    let all: Vec<_> = p.wrap(batches()).unwrap().map(|b| b.unwrap().to_vec().unwrap()).collect();
    assert_eq!(all, batches());
}

#[test]
fn an_empty_source_ends_at_once_and_empty_batches_come_through() {
    let mm = UniversalMemoryManager::builder().backends(false, false, false).build().unwrap();
    within_timeout("empty", move || {
        assert!(mm.prefetcher(2, 2).wrap(Vec::<Vec<u64>>::new()).unwrap().next().is_none());
        let got: Vec<_> =
            mm.prefetcher(2, 2).wrap(vec![vec![], vec![9u64], vec![]]).unwrap().map(|b| b.unwrap().len()).collect();
        assert_eq!(got, vec![0, 1, 0]);
    });
}
