//! The vocabulary of placement: what a caller asks for ([`Placement`], [`AccessPattern`]), how big it is
//! ([`SizeClass`], [`Thresholds`]) and where it can end up ([`PoolKind`]).
//!
//! Every enum here prints (`Display`) in snake_case and parses (`FromStr`) case-insensitively from snake_case,
//! kebab-case or the words run together: `"host_pinned"`, `"Host-Pinned"` and `"HOSTPINNED"` all give
//! [`Placement::HostPinned`]. Serde uses the same snake_case names.

use serde::{Deserialize, Serialize};
use strum::{Display, EnumIter, EnumString};

use crate::error::{Error, Result};
use crate::units;

/// Where the caller wants a buffer to live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, Display, EnumString, EnumIter)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum Placement {
    /// Let the [`Decider`](crate::Decider) choose from size, access pattern, memory pressure and usage evidence.
    #[default]
    Auto,
    /// Page-locked host memory that devices reach by DMA (zero-copy on devices that share memory with the host).
    #[strum(to_string = "host_pinned", serialize = "host-pinned", serialize = "hostpinned")]
    HostPinned,
    /// Memory on the device itself (VRAM on a discrete GPU).
    #[strum(to_string = "device_local", serialize = "device-local", serialize = "devicelocal")]
    DeviceLocal,
    /// Device memory that is filled once and only read afterwards (may use a read-only or constant pool).
    #[strum(to_string = "read_only", serialize = "read-only", serialize = "readonly")]
    ReadOnly,
}

/// How a buffer is expected to be used; a hint that steers [`Placement::Auto`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, Display, EnumString, EnumIter)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum AccessPattern {
    /// Nothing is known; the size decides.
    #[default]
    Unknown,
    /// Written once, then only read (weights, lookup tables).
    #[strum(to_string = "read_only", serialize = "read-only", serialize = "readonly")]
    ReadOnly,
    /// Written and not read back by the producer (an upload stream or an output that is consumed once).
    #[strum(to_string = "write_only", serialize = "write-only", serialize = "writeonly")]
    WriteOnly,
    /// Read and written.
    #[strum(to_string = "read_write", serialize = "read-write", serialize = "readwrite")]
    ReadWrite,
    /// Streamed front to back, typically once.
    Sequential,
    /// Accessed at scattered offsets.
    Random,
    /// Read or written by the host often (staging buffers, results read back every step).
    #[strum(to_string = "host_frequent", serialize = "host-frequent", serialize = "hostfrequent")]
    HostFrequent,
}

/// The kind of pool a decision resolves to. A pool is per (device, API, kind); this crate only names the kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Display, EnumString, EnumIter)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum PoolKind {
    /// Plain pageable host memory.
    Host,
    /// Page-locked host memory, reachable by DMA (on a host-only machine, still host memory).
    #[strum(to_string = "host_pinned", serialize = "host-pinned", serialize = "hostpinned")]
    HostPinned,
    /// Memory on the device itself.
    #[strum(to_string = "device_local", serialize = "device-local", serialize = "devicelocal")]
    DeviceLocal,
    /// Read-only device memory.
    #[strum(to_string = "read_only", serialize = "read-only", serialize = "readonly")]
    ReadOnly,
}

impl PoolKind {
    /// The pool a device API makes for this kind: a device has no pageable host memory of its own, so `Host`
    /// asks for its pinned host memory; every other kind is itself.
    pub fn on_device(self) -> PoolKind {
        match self {
            PoolKind::Host => PoolKind::HostPinned,
            kind => kind,
        }
    }

    /// The memory this pool kind holds, in words ("pinned host memory").
    pub fn describe(self) -> &'static str {
        match self {
            PoolKind::Host => "pageable host memory",
            PoolKind::HostPinned => "pinned host memory",
            PoolKind::DeviceLocal => "device-local memory",
            PoolKind::ReadOnly => "read-only device memory",
        }
    }
}

/// Size classes, split at [`Thresholds::small_max`] and [`Thresholds::medium_max`].
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Display, EnumString, EnumIter,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum SizeClass {
    /// `bytes <= small_max`.
    Small,
    /// `small_max < bytes <= medium_max`.
    Medium,
    /// `bytes > medium_max`.
    Large,
}

impl SizeClass {
    /// The class of a request of `bytes` bytes. Both maxima are inclusive: with the defaults a 64 KiB buffer is
    /// small and a 16 MiB buffer is medium. O(1).
    pub fn of(bytes: u64, thresholds: &Thresholds) -> SizeClass {
        if bytes <= thresholds.small_max {
            SizeClass::Small
        } else if bytes <= thresholds.medium_max {
            SizeClass::Medium
        } else {
            SizeClass::Large
        }
    }

    /// The position of this class in [`SizeClass::iter`](strum::IntoEnumIterator::iter) order (0, 1, 2).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The class and its bounds in words, e.g. "medium (64 KiB < size <= 16 MiB)".
    pub fn describe(self, thresholds: &Thresholds) -> String {
        let small = units::bytes(thresholds.small_max);
        let medium = units::bytes(thresholds.medium_max);
        match self {
            SizeClass::Small => format!("small (size <= {small})"),
            SizeClass::Medium => format!("medium ({small} < size <= {medium})"),
            SizeClass::Large => format!("large (size > {medium})"),
        }
    }
}

/// The boundaries between size classes, in bytes, both inclusive (see [`SizeClass::of`]).
///
/// Defaults: `small_max` = 64 KiB, `medium_max` = 16 MiB. A valid pair has `small_max < medium_max`; build one
/// with [`Thresholds::new`] or check a hand-made one with [`Thresholds::validate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Thresholds {
    /// The largest size that counts as small.
    pub small_max: u64,
    /// The largest size that counts as medium.
    pub medium_max: u64,
}

impl Thresholds {
    /// The default largest small size: 64 KiB.
    pub const DEFAULT_SMALL_MAX: u64 = 64 << 10;
    /// The default largest medium size: 16 MiB.
    pub const DEFAULT_MEDIUM_MAX: u64 = 16 << 20;

    /// Validated thresholds.
    ///
    /// # Errors
    /// [`Error::InvalidThresholds`] unless `small_max < medium_max`.
    pub fn new(small_max: u64, medium_max: u64) -> Result<Self> {
        let thresholds = Thresholds { small_max, medium_max };
        thresholds.validate()?;
        Ok(thresholds)
    }

    /// Checks that `small_max < medium_max`.
    ///
    /// # Errors
    /// [`Error::InvalidThresholds`] naming both values otherwise.
    pub fn validate(&self) -> Result<()> {
        if self.small_max < self.medium_max {
            Ok(())
        } else {
            Err(Error::InvalidThresholds { small_max: self.small_max, medium_max: self.medium_max })
        }
    }

    /// The thresholds in words: "small <= 64 KiB < medium <= 16 MiB < large".
    pub fn describe(&self) -> String {
        format!("small <= {} < medium <= {} < large", units::bytes(self.small_max), units::bytes(self.medium_max))
    }
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { small_max: Self::DEFAULT_SMALL_MAX, medium_max: Self::DEFAULT_MEDIUM_MAX }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;
    use strum::IntoEnumIterator;

    #[test]
    fn enums_parse_case_insensitively_in_three_spellings() {
        for text in ["host_pinned", "Host-Pinned", "HOSTPINNED"] {
            assert_eq!(Placement::from_str(text), Ok(Placement::HostPinned), "{text}");
        }
        assert_eq!(AccessPattern::from_str("Host-Frequent"), Ok(AccessPattern::HostFrequent));
        assert_eq!(PoolKind::from_str("device_local"), Ok(PoolKind::DeviceLocal));
        assert_eq!(SizeClass::from_str("LARGE"), Ok(SizeClass::Large));
        assert_eq!(Placement::from_str("vram"), Err(strum::ParseError::VariantNotFound));
    }

    #[test]
    fn display_round_trips_and_matches_serde() {
        for p in Placement::iter() {
            assert_eq!(Placement::from_str(&p.to_string()), Ok(p));
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{p}\""));
        }
        for a in AccessPattern::iter() {
            assert_eq!(AccessPattern::from_str(&a.to_string()), Ok(a));
            assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{a}\""));
        }
        for k in PoolKind::iter() {
            assert_eq!(PoolKind::from_str(&k.to_string()), Ok(k));
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
    }

    #[test]
    fn size_class_bounds_are_inclusive() {
        let t = Thresholds::default();
        assert_eq!(SizeClass::of(0, &t), SizeClass::Small);
        assert_eq!(SizeClass::of(64 << 10, &t), SizeClass::Small);
        assert_eq!(SizeClass::of((64 << 10) + 1, &t), SizeClass::Medium);
        assert_eq!(SizeClass::of(16 << 20, &t), SizeClass::Medium);
        assert_eq!(SizeClass::of((16 << 20) + 1, &t), SizeClass::Large);
        assert_eq!(SizeClass::of(u64::MAX, &t), SizeClass::Large);
    }

    #[test]
    fn thresholds_must_be_ordered() {
        assert!(Thresholds::new(1, 2).is_ok());
        let err = Thresholds::new(16 << 20, 64 << 10).unwrap_err();
        assert_eq!(err, Error::InvalidThresholds { small_max: 16 << 20, medium_max: 64 << 10 });
        let msg = err.to_string();
        assert!(msg.contains("small_max (16777216 B) must be less than medium_max (65536 B)"), "{msg}");
        assert_eq!(Thresholds::new(5, 5), Err(Error::InvalidThresholds { small_max: 5, medium_max: 5 }));
    }

    #[test]
    fn describe_names_bounds() {
        let t = Thresholds::default();
        assert_eq!(SizeClass::Medium.describe(&t), "medium (64 KiB < size <= 16 MiB)");
        assert_eq!(t.describe(), "small <= 64 KiB < medium <= 16 MiB < large");
    }
}
