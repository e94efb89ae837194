//! The facade's one error type.

use thiserror::Error;

/// Result with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the manager, its buffers, the configuration and the trace tools can report. Messages name what was
/// asked and what is available.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// From a pool or a backend (out of memory, driver errors, bad block handles).
    #[error(transparent)]
    Backend(#[from] umm_backends::Error),
    /// From the placement decider (no such device, impossible placement, bad thresholds).
    #[error(transparent)]
    Placement(#[from] umm_placement::Error),
    /// `n * size_of::<T>()` does not fit in 64 bits.
    #[error("{elements} elements of {type_name} ({elem_size} bytes each) overflow a 64-bit byte count")]
    SizeOverflow {
        /// Elements asked for.
        elements: usize,
        /// Size of one element.
        elem_size: usize,
        /// The element type.
        type_name: &'static str,
    },
    /// A whole-buffer read or write (`read`, `write`) given a slice whose length is not the buffer's.
    #[error(
        "{op}: the buffer holds {buffer_len} elements but {given_len} were given ({op} takes exactly the buffer's \
         length; {op}_at reads or writes part of it)"
    )]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// Elements in the buffer.
        buffer_len: usize,
        /// Elements passed.
        given_len: usize,
    },
    /// A partial read or write (`read_at`, `write_at`) that runs past the end of the buffer.
    #[error(
        "{op}: {count} element(s) at offset {offset} run past the end of a buffer of {len} elements ({})",
        room(*.len, *.offset)
    )]
    OutOfRange {
        /// The operation.
        op: &'static str,
        /// Elements in the buffer.
        len: usize,
        /// The element offset asked for.
        offset: usize,
        /// Elements asked for from the offset.
        count: usize,
    },
    /// A write to a ReadOnly buffer after its initial fill.
    #[error("buffer{} is ReadOnly: it was filled at allocation and cannot be written", label_suffix(.label))]
    ReadOnly {
        /// The buffer's label, if any.
        label: Option<String>,
    },
    /// An environment variable with a value it does not accept.
    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it accepts.
        expected: String,
    },
    /// An invalid builder or configuration value.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A malformed or unreadable trace.
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
    /// JSON that does not parse as what was expected (a snapshot).
    #[error("{what}: {source}")]
    Json {
        /// The file or text.
        what: String,
        /// The error.
        source: serde_json::Error,
    },
    /// An I/O error with the path involved.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

fn room(len: usize, offset: usize) -> String {
    match len.checked_sub(offset) {
        Some(0) => "the offset is the end: nothing fits there".into(),
        Some(room) => format!("at most {room} fit from that offset"),
        None => "the offset itself is past the end".into(),
    }
}

fn label_suffix(label: &Option<String>) -> String {
    label.as_ref().map(|l| format!(" {l:?}")).unwrap_or_default()
}
