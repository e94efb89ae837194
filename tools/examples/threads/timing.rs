//! The thread loop and its timing: a xorshift generator per thread, every thread started at one barrier, and
//! each run measured from the first thread's start to the last one's finish.

use crate::allocators::Allocator;
use crate::LIVE;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Ops between two reads of the clock: often enough to stop within microseconds of the deadline, rarely enough
/// that reading the clock is a small part of an op.
const CHECK_EVERY: u64 = 16;

/// Marsaglia's xorshift64: a few instructions per number, so the generator costs little next to an op.
struct XorShift(u64);

impl XorShift {
    /// Seeded by the thread's index; the odd multiplier keeps every seed non-zero (zero is a fixed point).
    fn for_thread(index: usize) -> Self {
        Self((index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n`, from the high bits (the better-mixed ones).
    fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
}

/// What one thread did between the barrier and its deadline.
struct ThreadRun {
    pairs: u64,
    start: Instant,
    end: Instant,
}

/// One thread: fill 16 slots, wait for the others, then replace random slots until `secs` have passed, and free
/// everything (outside the timed part).
fn thread_body<A: Allocator>(
    allocator: &A,
    sizes: &[u64],
    index: usize,
    secs: Duration,
    barrier: &Barrier,
) -> ThreadRun {
    let mut rng = XorShift::for_thread(index);
    let filled: Result<Vec<Option<A::Block>>, String> =
        (0..LIVE).map(|_| allocator.allocate(sizes[rng.below(sizes.len())]).map(Some)).collect();
    // Every thread reaches the barrier, even one whose fill failed: a thread missing from it would leave the
    // others waiting for ever. The failure is reported right after.
    barrier.wait();
    let mut live = filled.unwrap_or_else(|e| panic!("thread {index}: {e}"));
    let start = Instant::now();
    let deadline = start + secs;
    let mut pairs = 0u64;
    let mut end = start;
    while end < deadline {
        for _ in 0..CHECK_EVERY {
            let slot = rng.below(LIVE);
            let bytes = black_box(sizes[rng.below(sizes.len())]);
            allocator.free(live[slot].take().expect("every slot holds a block between ops"));
            let block = allocator.allocate(bytes).unwrap_or_else(|e| panic!("thread {index}: {e}"));
            // The block is stored and freed later anyway; black_box keeps the compiler from reasoning about it.
            live[slot] = Some(black_box(block));
        }
        pairs += CHECK_EVERY;
        end = Instant::now();
    }
    for block in live.into_iter().flatten() {
        allocator.free(block);
    }
    ThreadRun { pairs, start, end }
}

/// One run of `threads` threads on `allocator`: total pairs and elapsed time.
pub(crate) struct Measurement {
    pub(crate) pairs: u64,
    pub(crate) elapsed: Duration,
}

/// Runs `threads` threads sharing `allocator` and joins them; a thread's panic is passed on.
pub(crate) fn run_threads<A: Allocator>(
    allocator: &Arc<A>,
    sizes: &'static [u64],
    threads: usize,
    secs: Duration,
) -> Measurement {
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|index| {
            let (allocator, barrier) = (Arc::clone(allocator), Arc::clone(&barrier));
            std::thread::spawn(move || thread_body(&*allocator, sizes, index, secs, &barrier))
        })
        .collect();
    let runs: Vec<ThreadRun> =
        handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect();
    // From the first thread's start to the last one's finish: a thread that was scheduled late (more threads than
    // cores) still counts its full time, and the others' time while it waited counts too.
    let first = runs.iter().map(|r| r.start).min().expect("at least one thread");
    let last = runs.iter().map(|r| r.end).max().expect("at least one thread");
    Measurement { pairs: runs.iter().map(|r| r.pairs).sum(), elapsed: last - first }
}
