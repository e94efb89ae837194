//! The facade's one error type.

use thiserror::Error;

/// Result with [`Error`](enum@Error) as the default error.
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
    /// A whole-buffer read, write or copy (`read`, `write`, `copy_from`) given a slice or buffer whose length is
    /// not the buffer's.
    #[error(
        "{op}: the buffer holds {buffer_len} elements but {given_len} were given ({op} takes exactly the buffer's \
         length{})",
        partial_hint(.op)
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
    /// A host slice of a buffer whose memory the host cannot address ([`crate::UniversalBuffer::host_slice`]).
    #[error(
        "buffer{} is not host-addressable: it is {kind} memory of {pool}, {why}; read it with to_vec() or \
         read_at(), or copy it to host memory (copy_to with Placement::HostPinned and DeviceSelector::Host)",
        label_suffix(.label)
    )]
    NotHostAddressable {
        /// The buffer's label, if any.
        label: Option<String>,
        /// The pool's name.
        pool: String,
        /// The kind of pool.
        kind: umm_placement::PoolKind,
        /// Why the host cannot address it.
        why: &'static str,
    },
    /// A write to a ReadOnly buffer after its initial fill.
    #[error(
        "buffer{} is ReadOnly: it takes its data once, at allocation or in its first write(), and is sealed then; \
         copy it to a writable placement (copy_to with Placement::DeviceLocal) to change it",
        label_suffix(.label)
    )]
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
    #[error("{op} needs a buffer in {wanted} memory, but this one{} lives in {found} memory", label_suffix(.label))]
    /// A kernel view of one API asked of a buffer that lives in another API's memory (a wgpu binding of a CUDA
    /// buffer, say).
    WrongApi {
        /// The view asked for.
        op: &'static str,
        /// The API the view is for.
        wanted: umm_placement::Api,
        /// The API the buffer's memory belongs to.
        found: umm_placement::Api,
        /// The buffer's label.
        label: Option<String>,
    },

    #[error("{op} needs device memory, but the buffer{} is empty (it holds no block)", label_suffix(.label))]
    /// A kernel view asked of an empty buffer, which has no memory to point at.
    EmptyBuffer {
        /// The view asked for.
        op: &'static str,
        /// The buffer's label.
        label: Option<String>,
    },

    #[error("cannot adopt {what}: {reason}")]
    /// An adoption the manager cannot place: no device of the buffer's API, or none that made the buffer.
    Adopt {
        /// What was being adopted.
        what: &'static str,
        /// Why it cannot be.
        reason: String,
    },

    /// An overlap helper given a zero it cannot work with: a double buffer's capacity, a prefetcher's lookahead
    /// or worker count.
    #[error("{what} must be at least 1, not 0")]
    ZeroParameter {
        /// Which parameter.
        what: &'static str,
    },
    /// A batch longer than the [`crate::overlap::DoubleBuffer`] it was given to.
    #[error("a batch of {len} elements does not fit a double buffer of {capacity} elements")]
    BatchTooLarge {
        /// Elements in the batch.
        len: usize,
        /// The double buffer's capacity.
        capacity: usize,
    },
    /// [`crate::overlap::DoubleBuffer::current`] with no batch uploaded into the front buffer.
    #[error("no batch was uploaded into the front buffer: call prefetch_next, then swap, before current")]
    NothingPrefetched,

    /// [`crate::UniversalMemoryManager::wake`] naming a tag that is not asleep.
    #[error("tag {tag} is not asleep: nothing to wake (asleep: {})", or_none(.asleep))]
    NotAsleep {
        /// The tag.
        tag: String,
        /// The tags asleep, comma-separated.
        asleep: String,
    },
    /// An invalid builder or configuration value.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// [`crate::UniversalMemoryManager::sleep`] of a tag that has nothing a sleep could give back: nothing was
    /// allocated under it, or all of it is host memory.
    #[error("cannot put tag {tag} to sleep: {reason}")]
    NothingToSleep {
        /// The tag.
        tag: String,
        /// Why.
        reason: &'static str,
    },
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

fn or_none(list: &str) -> &str {
    if list.is_empty() {
        "none"
    } else {
        list
    }
}

/// Where a whole-buffer operation has a partial one beside it (`read_at`, `write_at`), its name.
fn partial_hint(op: &str) -> String {
    match op {
        "read" | "write" => format!("; {op}_at reads or writes part of it"),
        _ => String::new(),
    }
}

fn label_suffix(label: &Option<String>) -> String {
    label.as_ref().map(|l| format!(" {l:?}")).unwrap_or_default()
}

/// Predicates over the kinds of failure callers handle differently, so that they need not match the nested
/// [`umm_backends::Error`] and [`umm_placement::Error`] variants (both `non_exhaustive`).
impl Error {
    /// The pool could not find the bytes, even after releasing its cache: freeing buffers, lowering the demand or
    /// placing elsewhere may help. A request larger than the device can ever hold is [`Error::is_too_large`].
    pub fn is_out_of_memory(&self) -> bool {
        self.as_backend().is_some_and(umm_backends::Error::is_out_of_memory)
    }

    /// A request larger than the largest single allocation of its device: no amount of freeing makes it fit.
    pub fn is_too_large(&self) -> bool {
        self.as_backend().is_some_and(umm_backends::Error::is_too_large)
    }

    /// A block handle its pool did not hand out, or that was already freed.
    pub fn is_unknown_block(&self) -> bool {
        self.as_backend().is_some_and(umm_backends::Error::is_unknown_block)
    }

    /// An invalid configuration: a builder or config value ([`Error::InvalidConfig`]), an environment variable
    /// ([`Error::InvalidEnv`]), a pool setting or a placement setting (thresholds out of order, a value out of
    /// range).
    pub fn is_invalid_config(&self) -> bool {
        match self {
            Error::InvalidConfig(_) | Error::InvalidEnv { .. } => true,
            Error::Backend(e) => e.is_invalid_config(),
            Error::Placement(e) => {
                matches!(e, umm_placement::Error::InvalidConfig { .. } | umm_placement::Error::InvalidThresholds { .. })
            }
            _ => false,
        }
    }

    /// A read or write outside a buffer: a slice whose length is not the buffer's ([`Error::LengthMismatch`]),
    /// a range past the end ([`Error::OutOfRange`]), or a pool's bounds check.
    pub fn is_out_of_bounds(&self) -> bool {
        match self {
            Error::LengthMismatch { .. } | Error::OutOfRange { .. } => true,
            Error::Backend(e) => e.is_out_of_bounds(),
            _ => false,
        }
    }

    /// No device can take the request: the selector names none, or none offers a pool that could hold it.
    pub fn is_no_device(&self) -> bool {
        matches!(
            self,
            Error::Placement(umm_placement::Error::NoDevice { .. } | umm_placement::Error::ImpossiblePlacement { .. })
        )
    }

    /// A host slice of memory the host cannot address ([`Error::NotHostAddressable`]).
    pub fn is_not_host_addressable(&self) -> bool {
        matches!(self, Error::NotHostAddressable { .. })
    }

    /// A write to a buffer sealed ReadOnly.
    pub fn is_read_only(&self) -> bool {
        matches!(self, Error::ReadOnly { .. })
    }

    /// A buffer or tag whose memory is asleep ([`crate::UniversalMemoryManager::sleep`]): wake it first.
    pub fn is_asleep(&self) -> bool {
        self.as_backend().is_some_and(umm_backends::Error::is_asleep)
    }

    /// An operation the backend or placement does not offer.
    pub fn is_unsupported(&self) -> bool {
        self.as_backend().is_some_and(umm_backends::Error::is_unsupported)
    }

    /// A backend whose runtime is missing or has no device.
    pub fn is_unavailable(&self) -> bool {
        self.as_backend().is_some_and(umm_backends::Error::is_unavailable)
    }

    /// The pool's or backend's error, when that is what this is.
    pub fn as_backend(&self) -> Option<&umm_backends::Error> {
        match self {
            Error::Backend(e) => Some(e),
            _ => None,
        }
    }
}
