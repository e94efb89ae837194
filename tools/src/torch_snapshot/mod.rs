//! PyTorch memory snapshots as umm traces: the file `torch.cuda.memory._dump_snapshot("snap.pickle")` writes
//! after `torch.cuda.memory._record_memory_history(max_entries=N)`, read without Python and turned into a
//! [`Trace`] that `umm replay` and `umm plan` run like any other.
//!
//! The file is a Python pickle (protocol 2 to 5) of a dict: `segments` (what PyTorch holds from the device at
//! the moment of the dump, with its blocks) and `device_traces` (one list of events per device, the last
//! `max_entries` of them). The reader here understands only the opcodes that build dicts, lists, tuples, sets,
//! strings, bytes, numbers, booleans and None; any other (GLOBAL, REDUCE, BUILD, ... which name classes and call
//! them) is refused with its name and byte offset, so reading a file never runs or builds anything it names.
//! Memory stays within a small multiple of the file: shared objects (the `frames` lists PyTorch reuses) are
//! referenced, never copied, and lengths, nesting and counts are checked before anything is allocated.
//!
//! [`TorchSnapshot::convert`] turns one device's events into a trace:
//! - `alloc` allocates a block named by its address (an address is reused once its block is freed);
//! - `free_completed` frees it (`free_requested` only in a trace without any `free_completed`: older PyTorch);
//! - a block freed in the trace but allocated before it (the ring buffer of `max_entries` dropped its `alloc`)
//!   is allocated at the very start, in the order its free appears; so is every block the snapshot's segments
//!   show in use (allocated, or waiting for its free where frees are `free_completed`) whose address never
//!   appears in the trace (it was live throughout);
//! - stream values become umm stream numbers: 0 stays 0, the others 1, 2, ... in the order they first appear;
//! - `oom` events are counted, not replayed; `snapshot`, `user_defined` and unknown actions are skipped.
//!
//! Beside the trace come PyTorch's own figures ([`SnapshotFigures`]): its reserved bytes over the trace (the
//! segments at the dump, less the segment events' net change, give what it held when the trace starts; the
//! events then give the curve and its peak) and its peak of allocated bytes by its events.
//!
//! ```no_run
//! use umm_tools::torch_snapshot::TorchSnapshot;
//!
//! let snapshot = TorchSnapshot::read("snap.pickle")?;
//! let device = snapshot.busiest_device().unwrap_or(0);
//! let converted = snapshot.convert(device)?;
//! println!(
//!     "{} ops; PyTorch reserved at most {} bytes for {} allocated",
//!     converted.trace.len(),
//!     converted.figures.torch_peak_reserved_bytes,
//!     converted.figures.torch_peak_allocated_bytes
//! );
//! # Ok::<(), umm_tools::torch_snapshot::TorchSnapshotError>(())
//! ```
//!
//! [`Trace`]: umm::trace::Trace

use std::io;
use thiserror::Error;

/// The largest file read (4 GiB): a snapshot of a million events with their stack frames is a few hundred MiB.
pub const MAX_SNAPSHOT_BYTES: u64 = 4 << 30;

/// The first byte of a pickle of protocol 2 or later (its PROTO opcode).
pub const PICKLE_MAGIC: u8 = 0x80;

/// What can go wrong reading or converting a snapshot. Every message names the file.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TorchSnapshotError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file (or the label given to [`TorchSnapshot::from_reader`]).
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The file is larger than [`MAX_SNAPSHOT_BYTES`].
    #[error("{path}: {bytes} bytes, more than the {limit} bytes a PyTorch memory snapshot is read up to")]
    TooLarge {
        /// The file.
        path: String,
        /// Its size (at least `limit + 1` when read from a stream).
        bytes: u64,
        /// [`MAX_SNAPSHOT_BYTES`].
        limit: u64,
    },
    /// The bytes are not a pickle this reader accepts: truncated, an opcode it refuses, an absurd length.
    #[error("{path}: not a PyTorch memory snapshot: byte {offset}: {what}")]
    Pickle {
        /// The file.
        path: String,
        /// Offset of the opcode (or byte) at fault.
        offset: u64,
        /// What is wrong there.
        what: String,
    },
    /// The pickle holds something other than a memory snapshot's dict, or a field of the wrong kind.
    #[error("{path}: not a PyTorch memory snapshot: {what}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong, naming the field (`device_traces[0][12].size`).
        what: String,
    },
    /// A device the snapshot has no trace for.
    #[error("{path}: device {device} asked for, but the snapshot has {}", device_list(*devices))]
    NoDevice {
        /// The file.
        path: String,
        /// The device asked for.
        device: usize,
        /// Devices with a trace in the snapshot.
        devices: usize,
    },
}

/// The devices a snapshot has traces for, in words.
fn device_list(devices: usize) -> String {
    match devices {
        0 => "no device trace (record with torch.cuda.memory._record_memory_history)".into(),
        1 => "a trace of device 0 only".into(),
        n => format!("traces of devices 0 to {}", n - 1),
    }
}

mod convert;
mod model;
mod pickle;
mod read;
mod shape;
#[cfg(test)]
mod tests;

pub use model::{Action, BlockState, Segment, SegmentBlock, SnapshotFigures, TorchSnapshot, TorchTrace, TraceEvent};
pub use read::{is_snapshot_file, name_of};
