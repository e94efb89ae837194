//! The decision table: [`Decider::decide`] turns a [`Request`] and the [`DeviceView`]s of a machine into a
//! [`Decision`] (device, pool kind, size class, and the reason in a sentence).
//!
//! This module holds the decider's settings ([`DecisionConfig`], [`Spread`]); the request, the decision with its
//! reason, and the table itself live in the submodules.

mod outcome;
mod request;
mod table;

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use crate::device::DeviceView;
use crate::error::{Error, Result};
#[cfg(doc)]
use crate::placement::AccessPattern;
use crate::placement::Thresholds;

pub use outcome::Decision;
pub use request::Request;
pub use table::Decider;

/// How Auto chooses among several accelerators that can all take a request.
///
/// Prints and parses in snake_case, case-insensitively (`"balance"`, `"current_first"`, also `"current-first"`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, strum::Display, strum::EnumString,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", ascii_case_insensitive)]
pub enum Spread {
    /// The device with the most memory free to the caller ([`DeviceView::available_bytes`]) wins, so a burst of
    /// buffers spreads over the devices: what data-parallel workers in one process or a cache spread over GPUs
    /// want.
    #[default]
    Balance,
    /// The current device ([`Request::current`]) while it is not under pressure, then the rest by free memory:
    /// one device fills before the next is touched, as a PyTorch or cudarc user placing everything on "the"
    /// device expects.
    #[strum(to_string = "current_first", serialize = "current-first")]
    CurrentFirst,
}

/// Settings of a [`Decider`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecisionConfig {
    /// Size-class boundaries.
    pub thresholds: Thresholds,
    /// Fraction of a device's memory in use above which Auto avoids it (default 0.90; in [0, 1]).
    pub pressure_threshold: f64,
    /// Whether large buffers declared [`AccessPattern::HostFrequent`] go to pinned host memory (default true;
    /// turn off to keep huge staging buffers from locking host memory).
    pub large_host_frequent_to_pinned: bool,
    /// Whether large [`AccessPattern::Sequential`] and [`AccessPattern::WriteOnly`] buffers (streams touched
    /// about once) go to pinned host memory, read over the bus instead of copied (default false).
    pub large_streams_to_pinned: bool,
    /// How Auto chooses among accelerators (default [`Spread::Balance`]).
    #[serde(default)]
    pub spread: Spread,
}

impl Default for DecisionConfig {
    fn default() -> Self {
        DecisionConfig {
            thresholds: Thresholds::default(),
            pressure_threshold: 0.90,
            large_host_frequent_to_pinned: true,
            large_streams_to_pinned: false,
            spread: Spread::Balance,
        }
    }
}

impl DecisionConfig {
    /// Checks the thresholds and that `pressure_threshold` is in [0, 1].
    ///
    /// # Errors
    /// [`Error::InvalidThresholds`] or [`Error::InvalidConfig`].
    pub fn validate(&self) -> Result<()> {
        self.thresholds.validate()?;
        if !(0.0..=1.0).contains(&self.pressure_threshold) {
            return Err(Error::InvalidConfig {
                field: "pressure_threshold",
                value: self.pressure_threshold.to_string(),
                expected: "a fraction in [0, 1]",
            });
        }
        Ok(())
    }
}
