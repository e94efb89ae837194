//! The crate's one error type.

/// Everything that can go wrong while deciding a placement or configuring the decider and tracker.
///
/// Every message names what was asked and, where it applies, what is available.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request for zero bytes: there is nothing to place.
    #[error("cannot place a zero-byte request: ask for at least one byte")]
    ZeroSize,

    /// The selector names no device in the list given to the decider.
    #[error("no device matches {asked}; available: {available}")]
    NoDevice {
        /// The selector, in words (for instance "device index 7").
        asked: String,
        /// The devices the decider was given, in words.
        available: String,
    },

    /// The selector matched devices, but neither they nor the host fallback offer any pool that could hold the
    /// request.
    #[error("cannot place {asked}; available: {available}")]
    ImpossiblePlacement {
        /// The request, in words (placement, size, selector).
        asked: String,
        /// The devices and the pools they offer, in words.
        available: String,
    },

    /// Size-class thresholds out of order.
    #[error("invalid size-class thresholds: small_max ({small_max} B) must be less than medium_max ({medium_max} B)")]
    InvalidThresholds {
        /// The largest size (bytes, inclusive) that counts as small.
        small_max: u64,
        /// The largest size (bytes, inclusive) that counts as medium.
        medium_max: u64,
    },

    /// A configuration value outside its valid range.
    #[error("invalid {field}: {value} (expected {expected})")]
    InvalidConfig {
        /// The name of the setting.
        field: &'static str,
        /// The value that was given.
        value: String,
        /// The valid range, in words.
        expected: &'static str,
    },

    /// A device selector that could not be parsed.
    #[error("invalid device selector {value:?} (expected \"any\", \"host\", a device index such as \"1\", or an API: {expected})")]
    InvalidSelector {
        /// The text that was given.
        value: String,
        /// The API names that are accepted.
        expected: String,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
