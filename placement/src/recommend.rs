//! Recommendations: what the usage evidence says each kind of buffer should use.

use std::fmt;

use serde::{Deserialize, Serialize};
use strum::{Display, EnumIter, EnumString, IntoEnumIterator};

use crate::error::{Error, Result};
use crate::placement::{AccessPattern, Placement, PoolKind, SizeClass, Thresholds};
use crate::units;

/// What a recommendation is about.
///
/// Buffers declared [`AccessPattern::ReadOnly`] are [`Subject::ReadOnlyData`] and buffers declared
/// [`AccessPattern::HostFrequent`] are [`Subject::FrequentlyAccessedData`], whatever their size; all others
/// belong to the subject of their size class.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Display, EnumString, EnumIter,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum Subject {
    /// Small buffers not declared read-only or host-frequent.
    SmallBuffers,
    /// Medium buffers not declared read-only or host-frequent.
    MediumBuffers,
    /// Large buffers not declared read-only or host-frequent.
    LargeBuffers,
    /// Buffers declared [`AccessPattern::ReadOnly`].
    ReadOnlyData,
    /// Buffers declared [`AccessPattern::HostFrequent`].
    FrequentlyAccessedData,
}

impl Subject {
    /// The subject a buffer of this size class and declared access pattern belongs to. O(1).
    pub fn of(size_class: SizeClass, access: AccessPattern) -> Subject {
        match (access, size_class) {
            (AccessPattern::ReadOnly, _) => Subject::ReadOnlyData,
            (AccessPattern::HostFrequent, _) => Subject::FrequentlyAccessedData,
            (_, SizeClass::Small) => Subject::SmallBuffers,
            (_, SizeClass::Medium) => Subject::MediumBuffers,
            (_, SizeClass::Large) => Subject::LargeBuffers,
        }
    }

    /// What the decision table gives this subject when there is no evidence.
    pub fn table_default(self) -> Placement {
        match self {
            Subject::SmallBuffers | Subject::FrequentlyAccessedData => Placement::HostPinned,
            Subject::MediumBuffers | Subject::LargeBuffers => Placement::DeviceLocal,
            Subject::ReadOnlyData => Placement::ReadOnly,
        }
    }

    /// The subject in words, with size bounds where they apply: "medium buffers (64 KiB < size <= 16 MiB)".
    pub fn describe(self, thresholds: &Thresholds) -> String {
        match self {
            Subject::SmallBuffers => format!("{} buffers", SizeClass::Small.describe(thresholds)),
            Subject::MediumBuffers => format!("{} buffers", SizeClass::Medium.describe(thresholds)),
            Subject::LargeBuffers => format!("{} buffers", SizeClass::Large.describe(thresholds)),
            Subject::ReadOnlyData => "data declared read-only".to_owned(),
            Subject::FrequentlyAccessedData => "data declared host-frequent".to_owned(),
        }
    }
}

/// How many buffers of a subject lived in each pool kind (decayed counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolCounts {
    /// Pageable host memory.
    pub host: u64,
    /// Pinned host memory.
    pub host_pinned: u64,
    /// Device-local memory.
    pub device_local: u64,
    /// Read-only device memory.
    pub read_only: u64,
}

/// The aggregated usage behind a recommendation. Counts are decayed (see
/// [`UsageTracker::decay`](crate::UsageTracker::decay)) and rounded; `live_buffers` is exact.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// Buffers registered (decayed).
    pub buffers: u64,
    /// Buffers registered and not yet retired (exact, never decayed).
    pub live_buffers: u64,
    /// Bytes of the buffers registered (decayed).
    pub bytes: u64,
    /// Buffers whose placement was [`Placement::Auto`] (decayed).
    pub auto_buffers: u64,
    /// Where the buffers lived.
    pub in_pool: PoolCounts,
    /// Host reads (decayed).
    pub host_reads: u64,
    /// Host writes (decayed).
    pub host_writes: u64,
    /// Bytes read by the host (decayed).
    pub host_read_bytes: u64,
    /// Bytes written by the host (decayed).
    pub host_write_bytes: u64,
    /// Device uses (decayed).
    pub device_uses: u64,
    /// `(host_reads + host_writes) / (host_reads + host_writes + device_uses)`; 0 with no accesses.
    pub host_access_share: f64,
    /// `(host_reads + host_writes) / buffers`; 0 with no buffers.
    pub host_accesses_per_buffer: f64,
    /// Buffers retired (decayed).
    pub retired: u64,
    /// Mean lifetime of retired buffers in milliseconds; `None` before the first retirement.
    pub mean_lifetime_ms: Option<f64>,
}

/// Exact (unrounded, decayable) running sums for one group of buffers. Internal to the tracker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Tally {
    pub buffers: f64,
    pub live: u64,
    pub bytes: f64,
    pub auto_buffers: f64,
    pub in_pool: [f64; 4],
    pub host_reads: f64,
    pub host_writes: f64,
    pub host_read_bytes: f64,
    pub host_write_bytes: f64,
    pub device_uses: f64,
    pub retired: f64,
    /// Retired buffers whose lifetime was measured (see [`crate::UsageTracker::register_sampled`]).
    pub timed: f64,
    pub lifetime_ms_sum: f64,
}

impl Tally {
    pub fn accesses(&self) -> f64 {
        self.host_reads + self.host_writes + self.device_uses
    }

    pub fn add(&mut self, other: &Tally) {
        self.buffers += other.buffers;
        self.live += other.live;
        self.bytes += other.bytes;
        self.auto_buffers += other.auto_buffers;
        for (mine, theirs) in self.in_pool.iter_mut().zip(other.in_pool) {
            *mine += theirs;
        }
        self.host_reads += other.host_reads;
        self.host_writes += other.host_writes;
        self.host_read_bytes += other.host_read_bytes;
        self.host_write_bytes += other.host_write_bytes;
        self.device_uses += other.device_uses;
        self.retired += other.retired;
        self.timed += other.timed;
        self.lifetime_ms_sum += other.lifetime_ms_sum;
    }

    pub fn host_access_share(&self) -> f64 {
        let accesses = self.accesses();
        if accesses > 0.0 {
            (self.host_reads + self.host_writes) / accesses
        } else {
            0.0
        }
    }

    pub fn evidence(&self) -> Evidence {
        // Float-to-int `as` saturates and maps NaN to 0, so rounding can never panic.
        let round = |x: f64| x.round() as u64;
        Evidence {
            buffers: round(self.buffers),
            live_buffers: self.live,
            bytes: round(self.bytes),
            auto_buffers: round(self.auto_buffers),
            in_pool: PoolCounts {
                host: round(self.in_pool[0]),
                host_pinned: round(self.in_pool[1]),
                device_local: round(self.in_pool[2]),
                read_only: round(self.in_pool[3]),
            },
            host_reads: round(self.host_reads),
            host_writes: round(self.host_writes),
            host_read_bytes: round(self.host_read_bytes),
            host_write_bytes: round(self.host_write_bytes),
            device_uses: round(self.device_uses),
            host_access_share: self.host_access_share(),
            host_accesses_per_buffer: if self.buffers > 0.0 {
                (self.host_reads + self.host_writes) / self.buffers
            } else {
                0.0
            },
            retired: round(self.retired),
            mean_lifetime_ms: (self.timed > 0.0).then(|| self.lifetime_ms_sum / self.timed),
        }
    }
}

/// The index of a pool kind in [`Tally::in_pool`].
pub(crate) fn pool_slot(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Host => 0,
        PoolKind::HostPinned => 1,
        PoolKind::DeviceLocal => 2,
        PoolKind::ReadOnly => 3,
    }
}

/// The knobs of the recommendation rule (see [`Recommendations`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecommendConfig {
    /// Buffers of evidence needed before the evidence counts (default 8).
    pub min_buffers: f64,
    /// Host share of accesses at or above which a subject goes to pinned host memory (default 0.5).
    pub pinned_share: f64,
    /// Host share of accesses at or below which a pinned-by-default subject goes to device memory (default 0.1).
    pub device_share: f64,
    /// Host accesses per buffer needed, besides the share, before a subject goes to pinned host memory
    /// (default 1.0): buffers the host never touches say nothing about host use, whatever the share of the few
    /// accesses that were seen.
    pub min_host_accesses_per_buffer: f64,
}

impl Default for RecommendConfig {
    fn default() -> Self {
        RecommendConfig { min_buffers: 8.0, pinned_share: 0.5, device_share: 0.1, min_host_accesses_per_buffer: 1.0 }
    }
}

impl RecommendConfig {
    /// Checks `min_buffers >= 0` and `0 <= device_share < pinned_share <= 1`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        if !(self.min_buffers >= 0.0 && self.min_buffers.is_finite()) {
            return Err(Error::InvalidConfig {
                field: "min_buffers",
                value: self.min_buffers.to_string(),
                expected: "a finite number >= 0",
            });
        }
        if !(self.pinned_share > 0.0 && self.pinned_share <= 1.0) {
            return Err(Error::InvalidConfig {
                field: "pinned_share",
                value: self.pinned_share.to_string(),
                expected: "a fraction in (0, 1]",
            });
        }
        if !(self.device_share >= 0.0 && self.device_share < self.pinned_share) {
            return Err(Error::InvalidConfig {
                field: "device_share",
                value: self.device_share.to_string(),
                expected: "a fraction >= 0 and below pinned_share",
            });
        }
        if !(self.min_host_accesses_per_buffer >= 0.0 && self.min_host_accesses_per_buffer.is_finite()) {
            return Err(Error::InvalidConfig {
                field: "min_host_accesses_per_buffer",
                value: self.min_host_accesses_per_buffer.to_string(),
                expected: "a finite number >= 0",
            });
        }
        Ok(())
    }
}

/// What the evidence says one subject should use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    /// What it is about.
    pub subject: Subject,
    /// Where such buffers should go; never [`Placement::Auto`].
    pub placement: Placement,
    /// Whether enough evidence backs it (false: it is the table's default, nothing learnt yet).
    pub from_evidence: bool,
    /// Why, in a sentence that cites the evidence.
    pub reason: String,
    /// The numbers behind it.
    pub evidence: Evidence,
}

impl Recommendation {
    /// Applies the rule (see [`Recommendations`]) to `tally`. O(1).
    pub(crate) fn from_tally(subject: Subject, tally: &Tally, thresholds: &Thresholds, cfg: &RecommendConfig) -> Self {
        let default = subject.table_default();
        let what = subject.describe(thresholds);
        let evidence = tally.evidence();
        let weight = tally.buffers.max(tally.live as f64);
        let accesses = tally.accesses();
        let host = tally.host_reads + tally.host_writes;
        let share = tally.host_access_share();
        let (placement, from_evidence, reason) = if weight <= 0.0 && accesses <= 0.0 {
            (default, false, format!("{what}: no evidence yet; table default {default}"))
        } else if weight < cfg.min_buffers || accesses <= 0.0 {
            let reason = format!(
                "{what}: too little evidence yet ({weight:.0} buffers, {} needed, {accesses:.0} accesses); table default {default}",
                cfg.min_buffers
            );
            (default, false, reason)
        } else {
            let facts = format!(
                "the host made {} of {accesses:.0} accesses ({host:.0} host reads and writes, {:.0} device uses) over {weight:.0} buffers",
                units::percent(share),
                tally.device_uses
            );
            let per_buffer = host / weight;
            if share >= cfg.pinned_share && per_buffer >= cfg.min_host_accesses_per_buffer {
                let verdict =
                    if default == Placement::HostPinned { "as the table says" } else { "against the table's default" };
                let reason = format!(
                    "{what}: {facts}, at least {} and {per_buffer:.1} host accesses per buffer, so pinned host \
                     memory ({verdict} {default})",
                    units::percent(cfg.pinned_share)
                );
                (Placement::HostPinned, true, reason)
            } else if share <= cfg.device_share && default == Placement::HostPinned {
                let reason = format!(
                    "{what}: {facts}, at most {}, so device-local memory (against the table's default {default})",
                    units::percent(cfg.device_share)
                );
                (Placement::DeviceLocal, true, reason)
            } else {
                let reason = format!(
                    "{what}: {facts} ({per_buffer:.2} host accesses per buffer); the evidence agrees with the \
                     table default {default}"
                );
                (default, true, reason)
            }
        };
        Recommendation { subject, placement, from_evidence, reason, evidence }
    }
}

impl fmt::Display for Recommendation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.subject, self.placement, self.reason)
    }
}

/// One [`Recommendation`] per [`Subject`], in [`Subject::iter`](strum::IntoEnumIterator::iter) order.
///
/// # The rule
/// For each [`Subject`], let `accesses = host_reads + host_writes + device_uses` and
/// `host_access_share = (host_reads + host_writes) / accesses`.
/// 1. Too little evidence (fewer than [`RecommendConfig::min_buffers`] buffers, counting both the decayed number
///    registered and the number live now, or no accesses at all): the table's default, and the reason says
///    "no evidence yet; table default" or how much evidence there is.
/// 2. `host_access_share >= pinned_share` (0.5: the host touches these buffers at least as often as devices
///    do): [`Placement::HostPinned`].
/// 3. `host_access_share <= device_share` (0.1) for a subject whose default is pinned (small buffers, data
///    declared host-frequent): [`Placement::DeviceLocal`].
/// 4. Otherwise the table's default, backed by the evidence.
///
/// Table defaults: small buffers and host-frequent data → `HostPinned`; medium and large buffers →
/// `DeviceLocal`; read-only data → `ReadOnly`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recommendations {
    /// The size-class thresholds the evidence was classified with.
    pub thresholds: Thresholds,
    /// The rule's settings.
    pub config: RecommendConfig,
    /// One per subject.
    pub items: Vec<Recommendation>,
}

impl Recommendations {
    /// Table defaults for every subject, with no evidence.
    pub fn table_defaults(thresholds: Thresholds) -> Self {
        let cfg = RecommendConfig::default();
        Self::from_tallies(thresholds, cfg, &[Tally::default(); 5])
    }

    pub(crate) fn from_tallies(thresholds: Thresholds, config: RecommendConfig, tallies: &[Tally; 5]) -> Self {
        let items = Subject::iter()
            .zip(tallies)
            .map(|(subject, tally)| Recommendation::from_tally(subject, tally, &thresholds, &config))
            .collect();
        Recommendations { thresholds, config, items }
    }

    /// The recommendation for `subject`, if present. O(subjects).
    pub fn get(&self, subject: Subject) -> Option<&Recommendation> {
        self.items.iter().find(|r| r.subject == subject)
    }

    /// The recommendation that applies to a buffer of this size class and declared access. O(subjects).
    pub fn for_buffer(&self, size_class: SizeClass, access: AccessPattern) -> Option<&Recommendation> {
        self.get(Subject::of(size_class, access))
    }
}

impl fmt::Display for Recommendations {
    /// One line per subject.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for r in &self.items {
            writeln!(f, "{r}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_evidence_gives_table_defaults() {
        let recs = Recommendations::table_defaults(Thresholds::default());
        assert_eq!(recs.items.len(), 5);
        for r in &recs.items {
            assert_eq!(r.placement, r.subject.table_default());
            assert!(!r.from_evidence);
            assert!(r.reason.contains("no evidence yet; table default"), "{}", r.reason);
            assert_ne!(r.placement, Placement::Auto);
        }
        assert!(recs.to_string().lines().count() == 5);
    }

    #[test]
    fn rule_thresholds() {
        let cfg = RecommendConfig::default();
        let t = Thresholds::default();
        let tally = |buffers: f64, host: f64, device: f64| Tally {
            buffers,
            host_reads: host,
            device_uses: device,
            ..Tally::default()
        };
        let rec = |s, t_: Tally| Recommendation::from_tally(s, &t_, &t, &cfg);
        // Too few buffers.
        let r = rec(Subject::MediumBuffers, tally(7.0, 100.0, 0.0));
        assert_eq!((r.placement, r.from_evidence), (Placement::DeviceLocal, false));
        assert!(r.reason.contains("too little evidence"), "{}", r.reason);
        // Exactly half host: pinned.
        let r = rec(Subject::MediumBuffers, tally(8.0, 50.0, 50.0));
        assert_eq!((r.placement, r.from_evidence), (Placement::HostPinned, true));
        assert!(r.reason.contains("50% of 100 accesses"), "{}", r.reason);
        // Small buffers the host never touches: device-local.
        let r = rec(Subject::SmallBuffers, tally(8.0, 1.0, 99.0));
        assert_eq!(r.placement, Placement::DeviceLocal);
        // In between: default, backed by evidence.
        let r = rec(Subject::SmallBuffers, tally(8.0, 30.0, 70.0));
        assert_eq!((r.placement, r.from_evidence), (Placement::HostPinned, true));
        let r = rec(Subject::LargeBuffers, tally(8.0, 1.0, 99.0));
        assert_eq!(r.placement, Placement::DeviceLocal);
    }

    #[test]
    fn config_validation() {
        assert!(RecommendConfig::default().validate().is_ok());
        let bad = RecommendConfig { device_share: 0.6, ..RecommendConfig::default() };
        let msg = bad.validate().unwrap_err().to_string();
        assert!(msg.contains("device_share: 0.6"), "{msg}");
        let bad = RecommendConfig { pinned_share: f64::NAN, ..RecommendConfig::default() };
        assert!(
            matches!(bad.validate(), Err(Error::InvalidConfig { field: "pinned_share", ref value, .. }) if value == "NaN")
        );
    }
}
