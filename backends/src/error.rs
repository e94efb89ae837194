//! The one error type of `umm-backends`.

use thiserror::Error;
use umm_placement::units::human_bytes as human;

/// Result with [`Error`](enum@Error) as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine, a pool or a backend. Messages name what was asked and what exists.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The pool could not satisfy a request even after releasing its cached segments and retrying.
    #[error(
        "out of memory on {device}: asked for {} ({requested} bytes); device free {}, cached in pool {}, \
         reserved {}, limit {}{}",
        human(*requested),
        human(*free),
        human(*cached),
        human(*reserved),
        limit.map_or_else(|| "none".to_string(), |l| format!("{} ({l} bytes)", human(l))),
        cause.as_ref().map_or_else(String::new, |c| format!("; the device refused the last attempt: {c}"))
    )]
    OutOfMemory {
        /// Device (pool) name.
        device: String,
        /// Bytes asked for (after rounding).
        requested: u64,
        /// Free memory the device reports.
        free: u64,
        /// Bytes reserved by the pool but not allocated (cached).
        cached: u64,
        /// Bytes the pool had reserved when it gave up.
        reserved: u64,
        /// The pool's limit, if any.
        limit: Option<u64>,
        /// The backend's error behind the last attempt when a device call failed (a segment it would not create,
        /// pages it would not map), naming that call; `None` when the limit stopped the request.
        cause: Option<String>,
    },
    /// A zero-byte request where the caller needs a real block.
    #[error("zero-byte allocation requested on {device}")]
    ZeroSize {
        /// Device (pool) name.
        device: String,
    },
    /// A size computation overflowed (`n * size_of::<T>()`, rounding, or an offset past the end).
    #[error("size overflow: {what}")]
    SizeOverflow {
        /// What was being computed.
        what: String,
    },
    /// A request larger than the device can ever hold in one allocation.
    #[error("request of {requested} bytes exceeds the largest single allocation of {device} ({max} bytes)")]
    TooLarge {
        /// Device (pool) name.
        device: String,
        /// Bytes asked for.
        requested: u64,
        /// Largest segment the backend can create.
        max: u64,
    },
    /// An invalid configuration value.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A block handle that this pool did not hand out, or that was already freed.
    #[error("unknown or already freed block {0}")]
    UnknownBlock(String),
    /// A read or write outside the block, or with mismatched lengths.
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// The operation is not available on this backend or placement (for example writing a ReadOnly block,
    /// or reading bytes from the simulated device, which has none).
    #[error("unsupported on {backend}: {what}")]
    Unsupported {
        /// Backend name.
        backend: String,
        /// What was asked.
        what: String,
    },
    /// The device is gone (a wgpu device lost to a driver reset, say): nothing more can be done with it, and
    /// releasing cached memory will not help. Make new pools from a fresh discovery.
    #[error("{backend}: the device is lost ({reason}); make new pools from a fresh discovery")]
    DeviceLost {
        /// Backend name.
        backend: String,
        /// What the driver said.
        reason: String,
    },
    /// A driver call failed.
    #[error("{backend} driver error in {call}: {message}")]
    Driver {
        /// Backend name.
        backend: String,
        /// The call that failed.
        call: String,
        /// The driver's message.
        message: String,
    },
    /// The pool is asleep ([`crate::Pool::sleep`]): its blocks keep their addresses but no memory lies behind
    /// them until [`crate::Pool::wake`]; nothing may allocate from it or touch its blocks meanwhile.
    #[error("{pool} is asleep: {what} refused until it wakes")]
    Asleep {
        /// Pool name (with its tag, if it has one).
        pool: String,
        /// What was asked.
        what: String,
    },
    /// The backend's runtime is not installed or no device exists.
    #[error("{backend} is not available: {reason}")]
    Unavailable {
        /// Backend name.
        backend: String,
        /// Why.
        reason: String,
    },
}

impl Error {
    /// The pool is asleep ([`Error::Asleep`]): wake it ([`crate::Pool::wake`]) first.
    pub fn is_asleep(&self) -> bool {
        matches!(self, Self::Asleep { .. })
    }

    /// The pool could not find the bytes, even after releasing its cache ([`Error::OutOfMemory`]): freeing
    /// memory, lowering the demand or waiting may help. A request larger than the device can ever hold is
    /// [`Error::is_too_large`] instead.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }

    /// A request larger than the largest single allocation of the device ([`Error::TooLarge`]): no amount of
    /// freeing makes it fit.
    pub fn is_too_large(&self) -> bool {
        matches!(self, Error::TooLarge { .. })
    }

    /// A block handle this pool did not hand out, or that was already freed ([`Error::UnknownBlock`]).
    pub fn is_unknown_block(&self) -> bool {
        matches!(self, Error::UnknownBlock(_))
    }

    /// An invalid configuration value ([`Error::InvalidConfig`]).
    pub fn is_invalid_config(&self) -> bool {
        matches!(self, Error::InvalidConfig(_))
    }

    /// A read, write or copy outside the block ([`Error::OutOfBounds`]).
    pub fn is_out_of_bounds(&self) -> bool {
        matches!(self, Error::OutOfBounds(_))
    }

    /// A zero-byte request where a real block is needed ([`Error::ZeroSize`]), or a size that overflows 64 bits
    /// ([`Error::SizeOverflow`]).
    pub fn is_invalid_size(&self) -> bool {
        matches!(self, Error::ZeroSize { .. } | Error::SizeOverflow { .. })
    }

    /// An operation this backend or placement does not offer ([`Error::Unsupported`]).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported { .. })
    }

    /// The backend's runtime is missing or has no device ([`Error::Unavailable`]).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }

    /// A driver call failed ([`Error::Driver`]).
    pub fn is_driver_error(&self) -> bool {
        matches!(self, Error::Driver { .. })
    }

    /// The device is gone ([`Error::DeviceLost`]).
    pub fn is_device_lost(&self) -> bool {
        matches!(self, Error::DeviceLost { .. })
    }
}
