//! The pools' locks: one atomic read-modify-write to take a lock and a plain release store to give it back.
//!
//! A thread cache slot is taken by its own thread on every small allocation and free, for tens of nanoseconds;
//! a pool's lock by every large allocation and free, every cache miss, and cleanups. An uncontended
//! `parking_lot` or `std` mutex spends two locked instructions on each hold (a compare-exchange to take, another
//! to release, because the release must learn whether someone sleeps), and the releasing one waits for every
//! store the holder made to drain first. On an H100 machine's Xeon, one thread's small allocate+free pair on the
//! host pool cost 83 ns with `parking_lot`'s mutex as the pool's lock and 70 ns with this one (medians of four
//! runs of `examples/threads`), and 16 threads ran as fast or faster.
//! This lock releases with a plain store and keeps its sleepers' count in a separate word, which the releaser
//! reads after the store. On x86 that read may be ordered before the store, so a releaser can miss a thread
//! that was just going to sleep; sleepers therefore sleep with a timeout ([`MAX_SLEEP`]) and look again, which
//! bounds the cost of a missed wake-up instead of risking a lost one. Waiters spin briefly first, because most
//! holders leave within a few hundred nanoseconds. A waiter that has slept twice raises a `starving` flag that
//! makes newcomers queue behind it, so a thread that frees and retakes the lock at once cannot keep a sleeper
//! out.
//!
//! What keeps many threads off a pool's lock is the thread caches in front of it, not the lock: with the caches
//! off, 16 threads on one pool get about 5% of one thread's rate behind this lock and behind `parking_lot`'s
//! alike.

#![allow(unsafe_code)]

use parking_lot::lock_api::{GuardSend, RawMutex};
use parking_lot_core::{SpinWait, DEFAULT_PARK_TOKEN, DEFAULT_UNPARK_TOKEN};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Longest a sleeper waits before it looks at the lock again, in case its wake-up was missed.
const MAX_SLEEP: Duration = Duration::from_micros(50);
/// Naps after which a waiter asks the others to stop taking the lock past it (see `starving`).
const STARVING_AFTER_NAPS: u32 = 2;

/// The raw lock behind [`LeanMutex`].
pub struct RawLeanLock {
    locked: AtomicBool,
    sleepers: AtomicU32,
    /// Set by a waiter that has slept [`STARVING_AFTER_NAPS`] times without getting the lock: while set, the fast
    /// path stands aside and only starving waiters take the lock, so a thread that frees and takes again at once
    /// cannot keep a sleeper out indefinitely.
    starving: AtomicBool,
    /// Naps taken on this lock, for tests that must know a waiter slept.
    #[cfg(test)]
    naps: AtomicU32,
}

// SAFETY: `lock` returns only after this thread's compare-exchange turned `locked` from false to true with Acquire
// ordering, and `try_lock` reports success only then; `unlock` (called only by the holder, as the trait demands)
// stores false with Release ordering. So at most one thread holds the lock at a time, and everything the previous
// holder wrote happens-before what the next holder reads. The sleeper bookkeeping only decides when waiters look
// again; it never grants the lock.
unsafe impl RawMutex for RawLeanLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = Self {
        locked: AtomicBool::new(false),
        sleepers: AtomicU32::new(0),
        starving: AtomicBool::new(false),
        #[cfg(test)]
        naps: AtomicU32::new(0),
    };
    type GuardMarker = GuardSend;

    #[inline]
    fn lock(&self) {
        if self.starving.load(Ordering::Relaxed) || !self.try_lock() {
            self.lock_slow();
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        self.locked.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    #[inline]
    unsafe fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.wake_one();
        }
    }
}

impl RawLeanLock {
    fn key(&self) -> usize {
        self as *const Self as usize
    }

    #[cold]
    fn lock_slow(&self) {
        let mut spin = SpinWait::new();
        let mut naps = 0;
        loop {
            let starving = naps >= STARVING_AFTER_NAPS;
            let may_take = starving || !self.starving.load(Ordering::Relaxed);
            if may_take && !self.locked.load(Ordering::Relaxed) && self.try_lock() {
                if starving {
                    self.starving.store(false, Ordering::Relaxed);
                }
                return;
            }
            if starving {
                self.starving.store(true, Ordering::Relaxed);
            }
            if spin.spin() {
                continue;
            }
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            // SAFETY: parking_lot_core's contract: the key is this lock's address, unique while it lives; the
            // callbacks neither panic nor call into parking_lot.
            unsafe {
                parking_lot_core::park(
                    self.key(),
                    || self.locked.load(Ordering::SeqCst),
                    || {},
                    |_, _| {},
                    DEFAULT_PARK_TOKEN,
                    Some(Instant::now() + MAX_SLEEP),
                );
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            #[cfg(test)]
            self.naps.fetch_add(1, Ordering::Relaxed);
            naps += 1;
            spin.reset();
        }
    }

    #[cold]
    fn wake_one(&self) {
        // SAFETY: as in `lock_slow`: the key is this lock's address and the callback does nothing.
        unsafe {
            parking_lot_core::unpark_one(self.key(), |_| DEFAULT_UNPARK_TOKEN);
        }
    }
}

/// A mutex on `RawLeanLock`.
pub type LeanMutex<T> = parking_lot::lock_api::Mutex<RawLeanLock, T>;
/// A held [`LeanMutex`].
pub type LeanGuard<'a, T> = parking_lot::lock_api::MutexGuard<'a, RawLeanLock, T>;

#[cfg(test)]
mod tests {
    use super::LeanMutex;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn excludes_under_contention() {
        // A plain (non-atomic) read-modify-write under the lock: any overlap between holders loses increments.
        let counter = Arc::new(LeanMutex::new(0u64));
        let threads: Vec<_> = (0..6)
            .map(|_| {
                let counter = Arc::clone(&counter);
                std::thread::spawn(move || {
                    for i in 0..50_000u64 {
                        let mut guard = counter.lock();
                        let seen = *guard;
                        if i % 1000 == 0 {
                            std::thread::yield_now(); // let others pile up and go to sleep
                        }
                        *guard = seen + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*counter.lock(), 6 * 50_000);
    }

    #[test]
    fn sleepers_get_the_lock_after_a_long_hold() {
        let lock = Arc::new(LeanMutex::new(Vec::new()));
        let guard = lock.lock();
        let waiters: Vec<_> = (0..3)
            .map(|i| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || lock.lock().push(i))
            })
            .collect();
        // Hold until the waiters have stopped spinning and slept (each nap is at most `MAX_SLEEP`, so naps keep
        // coming while they wait): the release then has sleepers to wake.
        // SAFETY: the raw lock is only read, not locked or unlocked, through this reference.
        let raw = unsafe { lock.raw() };
        while raw.naps.load(std::sync::atomic::Ordering::Relaxed) < 6 {
            std::thread::yield_now();
        }
        drop(guard);
        for w in waiters {
            w.join().unwrap();
        }
        let mut got = lock.lock().clone();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2]);
    }

    #[test]
    fn a_sleeper_is_not_starved_by_a_thread_that_relocks_at_once() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::Instant;
        let lock = Arc::new(LeanMutex::new(0u64));
        let (stop, waiting) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        // The hog frees the lock and takes it again at once, holding it 20 µs each time, until the waiter got
        // in or 10 s have passed. Only a starved waiter lets it run out its time: the verdict does not hang
        // on how fast this machine schedules threads.
        let hog = {
            let (lock, stop, waiting) = (Arc::clone(&lock), Arc::clone(&stop), Arc::clone(&waiting));
            std::thread::spawn(move || {
                let mut start = None;
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return true;
                    }
                    if waiting.load(Ordering::Relaxed) {
                        let since = *start.get_or_insert_with(Instant::now);
                        if since.elapsed() > Duration::from_secs(10) {
                            return false;
                        }
                    }
                    let mut guard = lock.lock();
                    let until = Instant::now() + Duration::from_micros(20);
                    while Instant::now() < until {
                        *guard = guard.wrapping_add(1);
                    }
                }
            })
        };
        // Wait until the hog holds the lock in its loop, then ask for it.
        while *lock.lock() == 0 {
            std::hint::spin_loop();
        }
        waiting.store(true, Ordering::Relaxed);
        drop(lock.lock());
        stop.store(true, Ordering::Relaxed);
        assert!(hog.join().unwrap(), "the waiter got the lock only once the hog gave up after 10 s");
    }

    #[test]
    fn try_lock_fails_while_held() {
        let lock = LeanMutex::new(1);
        let guard = lock.lock();
        assert!(lock.try_lock().is_none());
        drop(guard);
        assert_eq!(lock.try_lock().map(|g| *g), Some(1));
    }
}
