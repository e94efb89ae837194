//! Pool configuration: limit, strategy, segment policy, debugging aids.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// A cap on the bytes a pool reserves from its device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Limit {
    /// At most this many bytes.
    Bytes(u64),
    /// At most this fraction (in `(0, 1]`) of the device's capacity.
    Fraction(f64),
}

impl Limit {
    /// The limit in bytes for a device of `capacity` bytes.
    pub fn resolve(self, capacity: u64) -> Result<u64> {
        match self {
            Limit::Bytes(0) => Err(Error::InvalidConfig("a byte limit must be above zero".into())),
            Limit::Bytes(b) => Ok(b),
            Limit::Fraction(f) if f > 0.0 && f <= 1.0 => Ok((capacity as f64 * f) as u64),
            Limit::Fraction(f) => Err(Error::InvalidConfig(format!("a limit fraction must be in (0, 1], got {f}"))),
        }
    }
}

/// How a pool gets memory for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, strum::Display, strum::EnumString)]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Cache freed blocks in segments and reuse them (the normal mode).
    #[default]
    Pooled,
    /// Every block is its own segment, destroyed on free: no caching at all (for debugging reuse bugs).
    Direct,
}

/// Whether large blocks go into plain segments or into virtual reservations mapped page by page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, strum::Display, strum::EnumString)]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
#[serde(rename_all = "lowercase")]
pub enum SegmentMode {
    /// Virtual where the backend supports it, plain otherwise.
    #[default]
    Auto,
    /// Plain segments only.
    Plain,
    /// Virtual reservations (an error at pool creation if the backend has none).
    Virtual,
}

/// Configuration of one pool. `Default` follows PyTorch's segment policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolConfig {
    /// Cap on reserved bytes; `None` for the device's own limit.
    pub limit: Option<Limit>,
    /// Pooled or direct.
    pub strategy: Strategy,
    /// Plain or virtual segments for large blocks.
    pub segment_mode: SegmentMode,
    /// Requests up to this size are small: they share small segments, apart from large blocks.
    pub small_request_max: u64,
    /// Size of small segments.
    pub small_segment_size: u64,
    /// Size of the shared segments for medium requests (below half of it); larger requests get their own segment.
    pub large_segment_size: u64,
    /// In virtual reservations, before mapping new pages that would raise reserved memory above both its
    /// previous peak and `(1 + slack) × allocated`, unmap free pages first: the peak of reserved memory follows
    /// the peak of live memory (varying shapes stop accumulating free mapped holes), at the price of device
    /// unmaps and maps while the peak is being set. Below the previous peak nothing is trimmed, so a steady
    /// workload does not churn pages. `None` never trims early.
    pub mapped_slack: Option<f64>,
    /// Zero every block before it is handed out.
    pub zero_on_alloc: bool,
    /// Overwrite every freed block with [`crate::pool::POISON_BYTE`] so that a use after free or a read of
    /// uninitialised memory shows up (NaN in floats).
    pub poison_on_free: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            limit: None,
            strategy: Strategy::Pooled,
            segment_mode: SegmentMode::Auto,
            small_request_max: 1 << 20,
            small_segment_size: 2 << 20,
            large_segment_size: 20 << 20,
            mapped_slack: Some(0.03),
            zero_on_alloc: false,
            poison_on_free: false,
        }
    }
}

impl PoolConfig {
    /// Parses a `mapped_slack` setting as users write it (`UMM_MAPPED_SLACK`): a fraction >= 0 (`0.03`), or
    /// `off`/`none` for no early trimming. `None` when the text is neither.
    pub fn parse_mapped_slack(text: &str) -> Option<Option<f64>> {
        match text.trim().to_ascii_lowercase().as_str() {
            "off" | "none" => Some(None),
            other => other.parse::<f64>().ok().filter(|f| *f >= 0.0 && f.is_finite()).map(Some),
        }
    }

    /// Checks the values against each other.
    pub fn validate(&self) -> Result<()> {
        if self.small_request_max == 0 || self.small_segment_size == 0 || self.large_segment_size == 0 {
            return Err(Error::InvalidConfig("segment sizes and small_request_max must be above zero".into()));
        }
        if self.small_segment_size < self.small_request_max {
            return Err(Error::InvalidConfig(format!(
                "small_segment_size ({}) must be at least small_request_max ({})",
                self.small_segment_size, self.small_request_max
            )));
        }
        if let Some(slack) = self.mapped_slack {
            if !(slack >= 0.0 && slack.is_finite()) {
                return Err(Error::InvalidConfig(format!("mapped_slack must be a finite fraction >= 0, got {slack}")));
            }
        }
        if let Some(limit) = self.limit {
            limit.resolve(u64::MAX)?;
        }
        Ok(())
    }
}
