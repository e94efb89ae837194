//! Per-thread ledgers of a [`crate::UsageTracker`]: what its recording calls write, with no lock and no atomic
//! read-modify-write on the way.
//!
//! - **One writer per ledger.** A thread writes only the ledger it has claimed for the tracker (kept in a
//!   thread-local table), so an update is plain loads and stores; a thread that exits gives its ledger up, and
//!   the next new thread claims it, so the ledgers number at most the threads alive at once.
//! - **Readers never block the writer.** Each cell carries a sequence number, odd while its thread writes it: a
//!   report reads a cell's figures between two equal even numbers and tries again otherwise (a seqlock). A
//!   report sums the cells of every ledger, so a buffer registered on one thread and retired on another counts
//!   in both threads' ledgers, and the sums are exact.
//! - **Decay without writing another thread's figures.** `decay` multiplies each cell's pending factor, a word
//!   of its own that only `decay` and the owner change (both with atomic read-modify-writes, which the owner
//!   needs only when a decay is pending); the owner applies the factor to its figures on its next write of the
//!   cell, inside its sequence section, and readers scale what they read by it until then.
//! - **Threads being torn down** (whose thread-locals are gone) write a shared ledger under a mutex.

use crate::recommend::Tally;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

const ONE: u64 = 1.0f64.to_bits();

/// Cells of a ledger: one per size class (3) and declared access pattern (7), numbered by the tracker.
pub(crate) const CELLS: usize = 3 * 7;

/// A number in an atomic word, written by one thread.
#[derive(Debug, Default)]
struct Figure(AtomicU64);

impl Figure {
    #[inline(always)]
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    /// Sets the figure. Only the ledger's writer calls this (a load and a store, no read-modify-write).
    #[inline(always)]
    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    #[inline(always)]
    fn add(&self, value: f64) {
        self.set(self.get() + value);
    }
}

/// One cell's figures (a [`Tally`] in atomic words) with its sequence number and pending decay.
#[derive(Debug)]
pub(crate) struct Cell {
    /// Odd while the owner writes the cell.
    seq: AtomicU64,
    /// The factor `decay` asked for since the owner last applied it (the bits of an `f64`, 1.0 when none).
    pending: AtomicU64,
    buffers: Figure,
    /// Registered minus retired, on this ledger: may be negative where another thread registered what this one
    /// retired (the bits of an `i64`).
    live: AtomicU64,
    bytes: Figure,
    auto_buffers: Figure,
    in_pool: [Figure; 4],
    host_reads: Figure,
    host_writes: Figure,
    host_read_bytes: Figure,
    host_write_bytes: Figure,
    device_uses: Figure,
    retired: Figure,
    timed: Figure,
    lifetime_ms_sum: Figure,
}

impl Default for Cell {
    fn default() -> Self {
        Cell {
            seq: AtomicU64::new(0),
            pending: AtomicU64::new(ONE),
            buffers: Figure::default(),
            live: AtomicU64::new(0),
            bytes: Figure::default(),
            auto_buffers: Figure::default(),
            in_pool: Default::default(),
            host_reads: Figure::default(),
            host_writes: Figure::default(),
            host_read_bytes: Figure::default(),
            host_write_bytes: Figure::default(),
            device_uses: Figure::default(),
            retired: Figure::default(),
            timed: Figure::default(),
            lifetime_ms_sum: Figure::default(),
        }
    }
}

/// What a writer may do to a cell, inside its sequence section.
pub(crate) struct CellWriter<'a>(&'a Cell);

impl CellWriter<'_> {
    pub(crate) fn register(&self, bytes: u64, auto: bool, pool_slot: usize, buffer_cap: f64) {
        let c = self.0;
        c.buffers.add(1.0);
        c.live.store((c.live.load(Ordering::Relaxed) as i64 + 1) as u64, Ordering::Relaxed);
        c.bytes.add(bytes as f64);
        if auto {
            c.auto_buffers.add(1.0);
        }
        c.in_pool[pool_slot].add(1.0);
        if c.buffers.get() > buffer_cap {
            self.scale_buffers(0.5);
        }
    }

    pub(crate) fn retire(&self, lifetime_ms: Option<f64>) {
        let c = self.0;
        c.live.store((c.live.load(Ordering::Relaxed) as i64 - 1) as u64, Ordering::Relaxed);
        c.retired.add(1.0);
        if let Some(ms) = lifetime_ms {
            c.timed.add(1.0);
            c.lifetime_ms_sum.add(ms);
        }
    }

    pub(crate) fn host_read(&self, bytes: u64, access_cap: f64) {
        self.0.host_reads.add(1.0);
        self.0.host_read_bytes.add(bytes as f64);
        self.cap_accesses(access_cap);
    }

    pub(crate) fn host_write(&self, bytes: u64, access_cap: f64) {
        self.0.host_writes.add(1.0);
        self.0.host_write_bytes.add(bytes as f64);
        self.cap_accesses(access_cap);
    }

    pub(crate) fn device_use(&self, access_cap: f64) {
        self.0.device_uses.add(1.0);
        self.cap_accesses(access_cap);
    }

    fn cap_accesses(&self, access_cap: f64) {
        let c = self.0;
        if c.host_reads.get() + c.host_writes.get() + c.device_uses.get() > access_cap {
            self.scale_accesses(0.5);
        }
    }

    fn scale_buffers(&self, factor: f64) {
        let c = self.0;
        for figure in [&c.buffers, &c.bytes, &c.auto_buffers, &c.retired, &c.timed, &c.lifetime_ms_sum]
            .into_iter()
            .chain(&c.in_pool)
        {
            figure.set(figure.get() * factor);
        }
    }

    fn scale_accesses(&self, factor: f64) {
        let c = self.0;
        for figure in [&c.host_reads, &c.host_writes, &c.host_read_bytes, &c.host_write_bytes, &c.device_uses] {
            figure.set(figure.get() * factor);
        }
    }
}

impl Cell {
    /// Runs `write` on the cell as its only writer: the caller owns the ledger (or holds the shared one's lock).
    #[inline(always)]
    fn write(&self, write: impl FnOnce(&CellWriter<'_>)) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let writer = CellWriter(self);
        if self.pending.load(Ordering::Relaxed) != ONE {
            // Everything `decay` asked for before this swap is applied here; what comes after stays pending.
            let factor = f64::from_bits(self.pending.swap(ONE, Ordering::Relaxed));
            writer.scale_buffers(factor);
            writer.scale_accesses(factor);
        }
        write(&writer);
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// The cell's figures with the pending decay applied, read between two equal even sequence numbers.
    fn read(&self) -> Tally {
        let mut tries = 0u32;
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before % 2 == 1 {
                // The owner is inside a write of a few stores; one that was preempted there gets the core back.
                tries += 1;
                if tries.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let factor = f64::from_bits(self.pending.load(Ordering::Relaxed));
            let f = |figure: &Figure| figure.get() * factor;
            let tally = Tally {
                buffers: f(&self.buffers),
                // Summed over the ledgers as a signed count; the tracker clamps the sum.
                live: self.live.load(Ordering::Relaxed),
                bytes: f(&self.bytes),
                auto_buffers: f(&self.auto_buffers),
                in_pool: std::array::from_fn(|i| f(&self.in_pool[i])),
                host_reads: f(&self.host_reads),
                host_writes: f(&self.host_writes),
                host_read_bytes: f(&self.host_read_bytes),
                host_write_bytes: f(&self.host_write_bytes),
                device_uses: f(&self.device_uses),
                retired: f(&self.retired),
                timed: f(&self.timed),
                lifetime_ms_sum: f(&self.lifetime_ms_sum),
            };
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == before {
                return tally;
            }
        }
    }

    /// Multiplies the cell's pending factor by `factor` (any thread).
    fn decay(&self, factor: f64) {
        let _ = self
            .pending
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some((f64::from_bits(bits) * factor).to_bits()));
    }
}

/// One thread's cells, alone on its cache lines.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Ledger {
    cells: [Cell; CELLS],
    /// Whether a live thread writes this ledger.
    claimed: AtomicBool,
}

impl Ledger {
    fn new(claimed: bool) -> Self {
        Ledger { cells: std::array::from_fn(|_| Cell::default()), claimed: AtomicBool::new(claimed) }
    }
}

/// A tracker's ledgers, and the shared one for threads without thread-locals.
#[derive(Debug)]
pub(crate) struct Ledgers {
    /// Numbers the tracker in the thread-local tables.
    id: u64,
    all: Mutex<Vec<Arc<Ledger>>>,
    shared: Mutex<()>,
    shared_ledger: Ledger,
    /// Held only here: a thread-local entry whose tracker is gone sees no strong count and is pruned.
    alive: Arc<()>,
}

/// A thread's claim on one tracker's ledger; dropping it (at the thread's exit) gives the ledger up.
struct Claim {
    tracker: u64,
    alive: Weak<()>,
    ledger: Arc<Ledger>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.ledger.claimed.store(false, Ordering::Release);
    }
}

thread_local! {
    static CLAIMS: RefCell<Vec<Claim>> = const { RefCell::new(Vec::new()) };
}

impl Default for Ledgers {
    fn default() -> Self {
        use std::sync::atomic::AtomicU64;
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Ledgers {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            all: Mutex::new(Vec::new()),
            shared: Mutex::new(()),
            shared_ledger: Ledger::new(true),
            alive: Arc::new(()),
        }
    }
}

impl Ledgers {
    /// Writes cell `cell` of the calling thread's ledger (claimed on its first write).
    #[inline]
    pub(crate) fn write(&self, cell: usize, write: impl FnOnce(&CellWriter<'_>)) {
        let mut write = Some(write);
        let done = CLAIMS.try_with(|claims| {
            if let Some(claim) = claims.borrow().iter().find(|c| c.tracker == self.id) {
                claim.ledger.cells[cell].write(write.take().expect("once"));
                return;
            }
            let ledger = self.claim();
            ledger.cells[cell].write(write.take().expect("once"));
            let mut claims = claims.borrow_mut();
            claims.retain(|c| c.alive.strong_count() > 0);
            claims.push(Claim { tracker: self.id, alive: Arc::downgrade(&self.alive), ledger });
        });
        if let (Err(_), Some(write)) = (done, write) {
            let _only_writer = self.shared.lock();
            self.shared_ledger.cells[cell].write(write);
        }
    }

    /// A ledger for the calling thread: one a finished thread gave up, else a new one.
    #[cold]
    fn claim(&self) -> Arc<Ledger> {
        let mut all = self.all.lock();
        let free =
            all.iter().find(|l| l.claimed.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok());
        if let Some(ledger) = free {
            return Arc::clone(ledger);
        }
        let ledger = Arc::new(Ledger::new(true));
        all.push(Arc::clone(&ledger));
        ledger
    }

    /// Cell `cell` summed over every ledger. O(ledgers).
    pub(crate) fn sum(&self, cell: usize) -> Tally {
        let mut sum = Tally::default();
        let mut live = 0i64;
        let all = self.all.lock();
        for ledger in all.iter().map(AsRef::as_ref).chain([&self.shared_ledger]) {
            let mut tally = ledger.cells[cell].read();
            live = live.wrapping_add(tally.live as i64);
            tally.live = 0;
            sum.add(&tally);
        }
        // Live counts are signed per ledger; a read racing a retire on another thread may see the retire
        // without the registration.
        sum.live = live.max(0) as u64;
        sum
    }

    /// Multiplies every decayable figure by `factor`, now for readers, on the owners' next writes for the
    /// figures themselves. O(ledgers).
    pub(crate) fn decay(&self, factor: f64) {
        let all = self.all.lock();
        for ledger in all.iter().map(AsRef::as_ref).chain([&self.shared_ledger]) {
            for cell in &ledger.cells {
                cell.decay(factor);
            }
        }
    }

    /// Ledgers made so far (at most the threads that wrote at once, plus none).
    #[cfg(test)]
    pub(crate) fn count(&self) -> usize {
        self.all.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    const CAP: f64 = 1024.0;

    fn register(ledgers: &Ledgers, bytes: u64) {
        ledgers.write(0, |c| c.register(bytes, true, 1, CAP));
    }

    #[test]
    fn a_reader_never_sees_half_a_write() {
        // Every registration adds 1 buffer and 4096 bytes, and halving scales both: in any consistent state
        // bytes = 4096 × buffers exactly (halving by 0.5 is exact). A torn read breaks that.
        let ledgers = Arc::new(Ledgers::default());
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..3)
            .map(|_| {
                let (ledgers, stop) = (Arc::clone(&ledgers), Arc::clone(&stop));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        register(&ledgers, 4096);
                    }
                })
            })
            .collect();
        // Reads go on until the writers have been seen writing (on a loaded machine they may start after 20,000
        // reads are done, which tested nothing), within a bound.
        let (mut reads, mut seen_writes) = (0, false);
        let started = std::time::Instant::now();
        while (reads < 20_000 || !seen_writes) && started.elapsed() < std::time::Duration::from_secs(5) {
            let sum = ledgers.sum(0);
            assert_eq!(sum.bytes, 4096.0 * sum.buffers, "torn read after {reads} reads");
            assert_eq!(sum.auto_buffers, sum.buffers);
            seen_writes |= sum.buffers > 0.0;
            reads += 1;
        }
        stop.store(true, Ordering::Relaxed);
        writers.into_iter().for_each(|w| w.join().unwrap());
        assert!(seen_writes, "no write was seen in {reads} reads");
        assert!(ledgers.sum(0).buffers > 0.0);
    }

    #[test]
    fn counts_are_exact_across_threads_and_a_retire_on_another_thread() {
        let ledgers = Arc::new(Ledgers::default());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let ledgers = Arc::clone(&ledgers);
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        ledgers.write(3, |c| c.register(1, false, 0, f64::MAX));
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let sum = ledgers.sum(3);
        assert_eq!((sum.live, sum.buffers, sum.bytes, sum.in_pool[0]), (4000, 4000.0, 4000.0, 4000.0));
        assert_eq!(ledgers.sum(0).buffers, 0.0, "other cells untouched");
        // Retired here, registered elsewhere: the live count still comes down to what is live.
        for _ in 0..4000 {
            ledgers.write(3, |c| c.retire(Some(2.0)));
        }
        let sum = ledgers.sum(3);
        assert_eq!((sum.live, sum.retired, sum.timed, sum.lifetime_ms_sum), (0, 4000.0, 4000.0, 8000.0));
    }

    #[test]
    fn a_finished_threads_ledger_goes_to_the_next_thread() {
        let ledgers = Arc::new(Ledgers::default());
        for _ in 0..20 {
            let ledgers = Arc::clone(&ledgers);
            std::thread::spawn(move || register(&ledgers, 8)).join().unwrap();
        }
        assert_eq!(ledgers.count(), 1, "one thread at a time needs one ledger");
        assert_eq!(ledgers.sum(0).live, 20);
    }

    #[test]
    fn decay_shows_at_once_and_reaches_the_figures_on_the_next_write() {
        let ledgers = Ledgers::default();
        for _ in 0..10 {
            register(&ledgers, 100);
        }
        ledgers.write(0, |c| c.host_write(50, CAP));
        ledgers.decay(0.5);
        ledgers.decay(0.5);
        let sum = ledgers.sum(0);
        assert_eq!((sum.buffers, sum.bytes, sum.host_writes, sum.host_write_bytes), (2.5, 250.0, 0.25, 12.5));
        assert_eq!(sum.live, 10, "live counts never decay");
        register(&ledgers, 100);
        let sum = ledgers.sum(0);
        assert_eq!((sum.buffers, sum.bytes, sum.live), (3.5, 350.0, 11));
        ledgers.decay(0.0);
        let sum = ledgers.sum(0);
        assert_eq!((sum.buffers, sum.bytes, sum.live), (0.0, 0.0, 11));
    }
}
