//! [`UsageTracker`]: learns how buffers are really used, per (size class, access pattern).

use std::num::NonZeroU64;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use strum::IntoEnumIterator;

use crate::error::{Error, Result};
use crate::ledger::{Ledgers, CELLS};
use crate::placement::{AccessPattern, Placement, PoolKind, SizeClass, Thresholds};
use crate::recommend::{pool_slot, Evidence, RecommendConfig, Recommendations, Subject, Tally};

const ACCESS_PATTERNS: usize = 7;
const _: () = assert!(CELLS == 3 * ACCESS_PATTERNS, "a ledger holds a cell per size class and access pattern");

/// Settings of a [`UsageTracker`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrackerConfig {
    /// How buffers are sorted into size classes at registration.
    pub thresholds: Thresholds,
    /// A cell's buffer-side sums are halved when its registered-buffer count exceeds this (default 1024; >= 1).
    pub buffer_cap: u64,
    /// A cell's access-side sums are halved when its access count exceeds this (default 65536; >= 1).
    pub access_cap: u64,
    /// The recommendation rule's settings.
    pub recommend: RecommendConfig,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            thresholds: Thresholds::default(),
            buffer_cap: 1024,
            access_cap: 1 << 16,
            recommend: RecommendConfig::default(),
        }
    }
}

impl TrackerConfig {
    /// Checks the thresholds, both caps (>= 1) and the recommendation settings.
    ///
    /// # Errors
    /// [`Error::InvalidThresholds`] or [`Error::InvalidConfig`] naming the bad value.
    pub fn validate(&self) -> Result<()> {
        self.thresholds.validate()?;
        for (field, value) in [("buffer_cap", self.buffer_cap), ("access_cap", self.access_cap)] {
            if value == 0 {
                return Err(Error::InvalidConfig { field, value: "0".to_owned(), expected: "at least 1" });
            }
        }
        self.recommend.validate()
    }
}

/// The handle of one tracked buffer, returned by [`UsageTracker::register`] and consumed by
/// [`UsageTracker::retire`] (so a buffer cannot be retired twice). It is only meaningful to the tracker that
/// issued it; given to another tracker it is counted in the same cell there.
///
/// Eight bytes, and `Option<TrackId>` too: every buffer carries one, and a buffer small enough is moved without
/// a call to `memcpy`. Packed into one word:
/// - bit 0: always set (the word is never zero);
/// - bits 1–5: the cell (size class × access pattern);
/// - bits 6–63: when the buffer was registered, as nanoseconds since the process's first tracker was made,
///   plus one; 0 when its lifetime is not measured (sampled out, or registered more than 2^58 ns ≈ 9 years
///   into the process).
#[derive(Debug)]
#[must_use = "a TrackId should be retired when its buffer is freed"]
pub struct TrackId(NonZeroU64);

const CELL_SHIFT: u32 = 1;
const TIME_SHIFT: u32 = 6;
const _: () = assert!(CELLS <= 1 << (TIME_SHIFT - CELL_SHIFT));

/// What registration times are measured from: set when the first tracker is made, so that registering reads
/// it without initialising it.
static TIME_BASE: OnceLock<Instant> = OnceLock::new();

impl TrackId {
    fn new(cell: usize, registered: Option<Instant>) -> Self {
        let since_base = registered.and_then(|at| {
            let ns = u64::try_from(at.checked_duration_since(*TIME_BASE.get()?)?.as_nanos()).ok()?;
            (ns < (1 << (64 - TIME_SHIFT)) - 1).then_some(ns + 1)
        });
        let word = 1 | (cell as u64) << CELL_SHIFT;
        TrackId(NonZeroU64::new(word | since_base.unwrap_or(0) << TIME_SHIFT).expect("bit 0 is set"))
    }

    /// The buffer's size class.
    pub fn size_class(&self) -> SizeClass {
        SizeClass::iter().nth(self.cell() / ACCESS_PATTERNS).expect("cells are size classes × access patterns")
    }

    /// The buffer's declared access pattern.
    pub fn access(&self) -> AccessPattern {
        AccessPattern::iter().nth(self.cell() % ACCESS_PATTERNS).expect("cells are size classes × access patterns")
    }

    /// When the buffer was registered; `None` for a buffer registered with
    /// [`UsageTracker::register_sampled`] whose lifetime is not measured.
    pub fn registered_at(&self) -> Option<Instant> {
        let since_base = self.0.get() >> TIME_SHIFT;
        let base = TIME_BASE.get()?;
        (since_base != 0).then(|| *base + Duration::from_nanos(since_base - 1))
    }

    #[inline(always)]
    fn cell(&self) -> usize {
        ((self.0.get() >> CELL_SHIFT) & 0x1f) as usize
    }
}

fn cell_index(size_class: SizeClass, access: AccessPattern) -> usize {
    size_class.index() * ACCESS_PATTERNS + access as usize
}

/// Learns from how buffers are really used and turns that into [`Recommendations`]. `Send + Sync`; share it by
/// reference or `Arc`.
///
/// # Cost
/// The tracker holds 21 cells (3 size classes × 7 access patterns) of fixed-size tallies, once per thread that
/// records (a ledger each; a finished thread's ledger goes to the next new thread). Every recording operation
/// writes one cell of the calling thread's own ledger with plain loads and stores: O(1), no allocation, no lock
/// and no atomic read-modify-write, so threads never wait for each other nor pass cache lines between them. A
/// report reads each cell between two equal sequence numbers, without stopping the writers, and sums the
/// ledgers (O(threads) per cell). A [`TrackId`] carries its cell and registration time, so the tracker keeps no
/// per-buffer table. The automatic halving below applies to each ledger's cells on their own counts.
///
/// # Decay
/// Old evidence fades in two ways:
/// - **Automatically, per cell**: when a cell's (decayed) registered-buffer count exceeds
///   [`TrackerConfig::buffer_cap`], its buffer-side sums (buffers, bytes, pool counts, lifetimes) are halved; when
///   its access count (host reads + host writes + device uses) exceeds [`TrackerConfig::access_cap`], its
///   access-side sums are halved. Ratios (host share of accesses, mean lifetime) survive halving; the newest
///   behaviour weighs as much as all older behaviour after each halving.
/// - **On demand**: [`UsageTracker::decay`]`(factor)` multiplies every sum by `factor`; the manager's periodic
///   cleanup calls it (for example `decay(0.5)` every 30 s gives evidence a 30 s half-life).
///
/// The number of live buffers per cell is exact and never decays, so long-lived buffers keep counting as evidence.
#[derive(Debug)]
pub struct UsageTracker {
    config: TrackerConfig,
    /// The cells, once per thread: see [`crate::ledger`].
    ledgers: Ledgers,
}

/// One buffer in this many of a thread's is timed by [`UsageTracker::register_sampled`].
pub const LIFETIME_SAMPLE: u32 = 8;

impl Default for UsageTracker {
    fn default() -> Self {
        Self::with_valid_config(TrackerConfig::default())
    }
}

impl UsageTracker {
    /// A tracker with default caps that classifies sizes by `thresholds`.
    ///
    /// # Errors
    /// [`Error::InvalidThresholds`] unless `small_max < medium_max`.
    pub fn new(thresholds: Thresholds) -> Result<Self> {
        Self::with_config(TrackerConfig { thresholds, ..TrackerConfig::default() })
    }

    /// A tracker with the given settings.
    ///
    /// # Errors
    /// As [`TrackerConfig::validate`].
    pub fn with_config(config: TrackerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self::with_valid_config(config))
    }

    fn with_valid_config(config: TrackerConfig) -> Self {
        TIME_BASE.get_or_init(Instant::now);
        UsageTracker { config, ledgers: Ledgers::default() }
    }

    /// The tracker's settings.
    pub fn config(&self) -> &TrackerConfig {
        &self.config
    }

    /// Starts tracking a buffer of `bytes` bytes that was requested with `placement` and `access` and landed in a
    /// pool of kind `pool`. O(1), allocation-free.
    pub fn register(&self, bytes: u64, placement: Placement, access: AccessPattern, pool: PoolKind) -> TrackId {
        self.register_timed(bytes, placement, access, pool, true)
    }

    /// As [`register`](Self::register), measuring the buffer's lifetime only for one buffer in
    /// [`LIFETIME_SAMPLE`] of each thread's (the first of each run of them): reading the clock at registration and
    /// at retirement costs about as much as the rest of the bookkeeping, and the mean lifetime of a sample is the
    /// mean lifetime. The manager's allocation path uses this.
    pub fn register_sampled(&self, bytes: u64, placement: Placement, access: AccessPattern, pool: PoolKind) -> TrackId {
        thread_local! {
            static COUNT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
        }
        let timed = COUNT
            .try_with(|c| {
                let n = c.get();
                c.set(n.wrapping_add(1));
                n.is_multiple_of(LIFETIME_SAMPLE)
            })
            .unwrap_or(true);
        self.register_timed(bytes, placement, access, pool, timed)
    }

    fn register_timed(
        &self,
        bytes: u64,
        placement: Placement,
        access: AccessPattern,
        pool: PoolKind,
        timed: bool,
    ) -> TrackId {
        let cell = cell_index(SizeClass::of(bytes, &self.config.thresholds), access);
        let id = TrackId::new(cell, timed.then(Instant::now));
        let cap = self.config.buffer_cap as f64;
        self.ledgers.write(cell, |c| c.register(bytes, placement == Placement::Auto, pool_slot(pool), cap));
        id
    }

    /// Records that the host wrote `bytes` bytes into the buffer. O(1), allocation-free.
    pub fn record_host_write(&self, id: &TrackId, bytes: u64) {
        let cap = self.config.access_cap as f64;
        self.ledgers.write(id.cell(), |c| c.host_write(bytes, cap));
    }

    /// Records that the host read `bytes` bytes from the buffer. O(1), allocation-free.
    pub fn record_host_read(&self, id: &TrackId, bytes: u64) {
        let cap = self.config.access_cap as f64;
        self.ledgers.write(id.cell(), |c| c.host_read(bytes, cap));
    }

    /// Records that a device used the buffer (a kernel launch, a copy on the device side). O(1),
    /// allocation-free.
    pub fn record_device_use(&self, id: &TrackId) {
        let cap = self.config.access_cap as f64;
        self.ledgers.write(id.cell(), |c| c.device_use(cap));
    }

    /// Ends the buffer's lifetime now; its evidence stays in the aggregate. O(1), allocation-free; the clock is
    /// read only for a buffer whose lifetime is measured.
    pub fn retire(&self, id: TrackId) {
        self.retire_with(id, |born| born.elapsed());
    }

    /// Ends the buffer's lifetime at `at`, a time the caller read when the buffer really went (a batch of frees
    /// retired later, a replay of recorded events). A lifetime is `at` minus the registration time, zero when
    /// `at` comes first. O(1), allocation-free.
    pub fn retire_at(&self, id: TrackId, at: Instant) {
        self.retire_with(id, |born| at.saturating_duration_since(born));
    }

    /// Retires `id` with the lifetime `lifetime` gives from its registration time, called only when it was timed.
    #[inline(always)]
    fn retire_with(&self, id: TrackId, lifetime: impl FnOnce(Instant) -> Duration) {
        let lifetime_ms = id.registered_at().map(|born| lifetime(born).as_secs_f64() * 1e3);
        self.ledgers.write(id.cell(), |c| c.retire(lifetime_ms));
    }

    /// Multiplies every decayable sum in every cell by `factor` (1 keeps everything, 0 forgets everything but
    /// the live-buffer counts). O(cells × threads).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] unless `0 <= factor <= 1`.
    pub fn decay(&self, factor: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&factor) {
            return Err(Error::InvalidConfig {
                field: "decay factor",
                value: factor.to_string(),
                expected: "a fraction in [0, 1]",
            });
        }
        self.ledgers.decay(factor);
        Ok(())
    }

    /// One cell summed over the threads' ledgers.
    fn tally(&self, size_class: SizeClass, access: AccessPattern) -> Tally {
        self.ledgers.sum(cell_index(size_class, access))
    }

    /// The evidence for buffers of one size class and declared access pattern. O(threads).
    pub fn evidence(&self, size_class: SizeClass, access: AccessPattern) -> Evidence {
        self.tally(size_class, access).evidence()
    }

    /// One recommendation per [`Subject`] under the tracker's own rule settings. O(cells × threads) (allocates the
    /// result).
    pub fn recommendations(&self) -> Recommendations {
        self.recommendations_with(&self.config.recommend)
    }

    /// As [`recommendations`](Self::recommendations) with other rule settings (not validated here: see
    /// [`RecommendConfig::validate`]).
    pub fn recommendations_with(&self, config: &RecommendConfig) -> Recommendations {
        let mut tallies = [Tally::default(); 5];
        for size_class in SizeClass::iter() {
            for access in AccessPattern::iter() {
                let subject = Subject::of(size_class, access);
                tallies[subject as usize].add(&self.tally(size_class, access));
            }
        }
        Recommendations::from_tallies(self.config.thresholds, *config, &tallies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn tracker_is_send_sync() {
        assert_send_sync::<UsageTracker>();
        assert_send_sync::<TrackId>();
    }

    #[test]
    fn cells_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for s in SizeClass::iter() {
            for a in AccessPattern::iter() {
                let i = cell_index(s, a);
                assert!(i < CELLS);
                assert!(seen.insert(i));
            }
        }
    }

    #[test]
    fn a_track_id_is_one_word_that_keeps_its_cell_and_time() {
        assert_eq!(std::mem::size_of::<Option<TrackId>>(), 8);
        let tracker = UsageTracker::default();
        for (n, s) in SizeClass::iter().enumerate() {
            for a in AccessPattern::iter() {
                let before = Instant::now();
                let timed = TrackId::new(cell_index(s, a), Some(Instant::now()));
                let at = timed.registered_at().expect("timed");
                assert!(at >= before - Duration::from_nanos(1) && at <= Instant::now(), "{at:?} {before:?}");
                let untimed = TrackId::new(cell_index(s, a), None);
                for id in [timed, untimed] {
                    assert_eq!((id.size_class(), id.access()), (s, a));
                    assert_eq!(id.cell(), cell_index(s, a));
                }
                // Registration through the tracker: the lifetime of a timed buffer is measured.
                let bytes = [1, 1 << 20, 1 << 30][n];
                let id = tracker.register(bytes, Placement::Auto, a, PoolKind::HostPinned);
                assert_eq!((id.size_class(), id.access()), (s, a));
                assert!(id.registered_at().is_some());
                tracker.retire(id);
            }
        }
        // A time before the base (or too far past it) is not measured rather than wrong.
        let base = *TIME_BASE.get().expect("set by the first tracker");
        let early = base.checked_sub(Duration::from_secs(1));
        assert!(early.is_none_or(|at| TrackId::new(0, Some(at)).registered_at().is_none()));
        let late = base + Duration::from_nanos(1 << 58);
        assert!(TrackId::new(0, Some(late)).registered_at().is_none());
    }

    #[test]
    fn bad_config_is_rejected() {
        let cfg = TrackerConfig { buffer_cap: 0, ..TrackerConfig::default() };
        let msg = UsageTracker::with_config(cfg).unwrap_err().to_string();
        assert!(msg.contains("buffer_cap"), "{msg}");
        assert!(matches!(
            UsageTracker::new(Thresholds { small_max: 10, medium_max: 10 }),
            Err(Error::InvalidThresholds { small_max: 10, medium_max: 10 })
        ));
        let t = UsageTracker::default();
        for bad in [1.5, -0.1, f64::NAN] {
            assert!(
                matches!(t.decay(bad), Err(Error::InvalidConfig { field: "decay factor", ref value, .. }) if *value == bad.to_string()),
                "{bad}"
            );
        }
    }
}
