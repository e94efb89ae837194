//! The workload of the sleep suites' thread tests (`tests/sleep.rs` on the simulated device, `tests/cuda_sleep.rs`
//! on CUDA), shared so that both check the same thing: threads allocate, write, check and free blocks while the
//! calling thread puts the pool to sleep and wakes it, and every operation works or is refused as asleep.

use umm_backends::{BlockHandle, MemoryPool, SleepAction, StreamId};

/// Bytes of a block: different for every seed and position.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8).collect()
}

/// `threads` threads each allocate blocks of `sizes` in turn (on stream `thread % streams`), fill them, keep up
/// to 6, and check and free the oldest, while this thread runs `cycles` offload sleeps and wakes; then every
/// thread frees what it holds. Panics at a lost byte or an error other than [`umm_backends::Error::Asleep`].
pub fn work_through_cycles(pool: &dyn MemoryPool, threads: u64, streams: u64, sizes: [u64; 3], cycles: usize) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let stop = &stop;
            scope.spawn(move || {
                let mut held: Vec<(BlockHandle, Vec<u8>)> = Vec::new();
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n += 1;
                    let size = sizes[(n % 3) as usize];
                    match pool.allocate(size, StreamId(t % streams)) {
                        Ok(block) => {
                            let bytes = pattern(t << 32 | n, size as usize);
                            match pool.write(&block, 0, &bytes) {
                                Ok(()) => held.push((block, bytes)),
                                Err(e) => {
                                    assert!(e.is_asleep(), "{e}");
                                    pool.free(&block).unwrap();
                                }
                            }
                        }
                        Err(e) => assert!(e.is_asleep(), "{e}"),
                    }
                    if held.len() > 6 {
                        let (block, bytes) = held.remove((n % 6) as usize);
                        let mut now = vec![0; bytes.len()];
                        match pool.read(&block, 0, &mut now) {
                            Ok(()) => assert!(now == bytes, "thread {t} lost bytes"),
                            Err(e) => assert!(e.is_asleep(), "{e}"),
                        }
                        pool.free(&block).unwrap();
                    }
                }
                for (block, _) in held {
                    pool.free(&block).unwrap();
                }
            });
        }
        // Offload only: the threads check that their bytes survive every cycle.
        for _ in 0..cycles {
            std::thread::yield_now();
            pool.sleep(SleepAction::Offload).unwrap();
            std::thread::yield_now();
            pool.wake().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
}
