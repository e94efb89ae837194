//! The snapshot's data model: the events of a device trace, the segments and blocks PyTorch held at the dump,
//! the snapshot itself, and a converted trace with PyTorch's figures.

use serde::Serialize;
use std::collections::BTreeMap;
use umm::trace::Trace;

/// What an event of a device trace did (its `action`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// The program freed a block; it may wait for streams that used it before it can be reused.
    FreeRequested,
    /// A freed block went back to PyTorch's cache.
    FreeCompleted,
    /// A segment was allocated from the device (`cudaMalloc`).
    SegmentAlloc,
    /// A segment went back to the device (`cudaFree`, as `empty_cache` does).
    SegmentFree,
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages were unmapped from an expandable segment.
    SegmentUnmap,
    /// A snapshot was taken here.
    Snapshot,
    /// An allocation failed for lack of memory.
    Oom,
    /// A mark the program recorded (`user_metadata`).
    UserDefined,
    /// An action this reader does not know (a newer PyTorch's): skipped.
    Other(String),
}

impl Action {
    pub(super) fn parse(text: &str) -> Self {
        match text {
            "alloc" => Self::Alloc,
            "free_requested" => Self::FreeRequested,
            "free_completed" => Self::FreeCompleted,
            "segment_alloc" => Self::SegmentAlloc,
            "segment_free" => Self::SegmentFree,
            "segment_map" => Self::SegmentMap,
            "segment_unmap" => Self::SegmentUnmap,
            "snapshot" => Self::Snapshot,
            "oom" => Self::Oom,
            "user_defined" => Self::UserDefined,
            other => Self::Other(other.to_string()),
        }
    }

    /// The action's name as PyTorch writes it.
    pub fn name(&self) -> &str {
        match self {
            Self::Alloc => "alloc",
            Self::FreeRequested => "free_requested",
            Self::FreeCompleted => "free_completed",
            Self::SegmentAlloc => "segment_alloc",
            Self::SegmentFree => "segment_free",
            Self::SegmentMap => "segment_map",
            Self::SegmentUnmap => "segment_unmap",
            Self::Snapshot => "snapshot",
            Self::Oom => "oom",
            Self::UserDefined => "user_defined",
            Self::Other(name) => name,
        }
    }

    /// Whether the event names a block or a range by `addr` and `size` (which are then required).
    pub(super) fn has_range(&self) -> bool {
        !matches!(self, Self::Snapshot | Self::Oom | Self::UserDefined | Self::Other(_))
    }
}

/// One event of a device trace. Frames, compile contexts and metadata are not kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// What happened.
    pub action: Action,
    /// The block's or range's address (0 where the event has none).
    pub addr: u64,
    /// Its size in bytes as the event gives it (PyTorch writes the size asked for; for `oom`, the request).
    pub size: u64,
    /// The stream as PyTorch gives it (a `cudaStream_t` value; 0 for the default stream).
    pub stream: i128,
    /// Microseconds since the epoch, when recorded.
    pub time_us: Option<i64>,
}

/// A block's state in a snapshot's segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out and not freed.
    ActiveAllocated,
    /// Freed by the program, waiting for the streams that used it.
    ActivePendingFree,
    /// Free in PyTorch's cache.
    Inactive,
    /// A state this reader does not know.
    Other(String),
}

/// A block of a snapshot's segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentBlock {
    /// Its address (given, or the segment's address plus the sizes of the blocks before it).
    pub address: u64,
    /// Its size in PyTorch's cache (rounded).
    pub size: u64,
    /// The size asked for (0 where the snapshot does not say).
    pub requested_size: u64,
    /// Its state.
    pub state: BlockState,
}

/// A segment PyTorch held from the device when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The device.
    pub device: u64,
    /// Its address.
    pub address: u64,
    /// Its size (for an expandable segment, the bytes mapped).
    pub total_size: u64,
    /// Its stream.
    pub stream: i128,
    /// Whether it is an expandable segment (`expandable_segments:True`).
    pub is_expandable: bool,
    /// Its blocks in address order.
    pub blocks: Vec<SegmentBlock>,
}

/// A PyTorch memory snapshot, read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchSnapshot {
    /// Name: the file name without `.pickle` or `.pkl` (`snap` for `snap.pickle`).
    pub name: String,
    /// The file, as errors name it.
    pub label: String,
    /// The pickle protocol the file was written with.
    pub protocol: u8,
    /// The segments of every device.
    pub segments: Vec<Segment>,
    /// The events of each device, oldest first (`device_traces[d]` for device `d`).
    pub device_traces: Vec<Vec<TraceEvent>>,
}

impl TorchSnapshot {
    /// Devices with a trace (the length of `device_traces`).
    pub fn devices(&self) -> usize {
        self.device_traces.len()
    }

    /// The device with the most events (the lowest of those tied); `None` without any device trace.
    pub fn busiest_device(&self) -> Option<usize> {
        // Reversed so that `max_by_key`, which keeps the last of equal keys, keeps the lowest device.
        self.device_traces.iter().enumerate().rev().max_by_key(|(_, events)| events.len()).map(|(d, _)| d)
    }
}

/// A device's trace converted, with PyTorch's own figures.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchTrace {
    /// The umm trace.
    pub trace: Trace,
    /// What PyTorch reserved and allocated, and what the conversion did.
    pub figures: SnapshotFigures,
}

/// PyTorch's figures for one device of a snapshot, and what the conversion synthesised or skipped.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SnapshotFigures {
    /// The device converted.
    pub device: usize,
    /// Devices with a trace in the snapshot.
    pub devices: usize,
    /// Events in the device's trace.
    pub events: u64,
    /// The event taken as a block's free: `free_completed`, or `free_requested` in a trace without any.
    pub free_action: String,
    /// `alloc` events replayed.
    pub allocs: u64,
    /// Free events replayed (of `free_action`).
    pub frees: u64,
    /// Blocks allocated at the start because the trace frees them without allocating them (the ring buffer
    /// dropped their `alloc`).
    pub live_before_from_frees: u64,
    /// Blocks allocated at the start because the segments show them allocated (or waiting to be freed, where
    /// frees are `free_completed`) and the trace never names their address.
    pub live_before_from_segments: u64,
    /// Bytes of the blocks allocated at the start.
    pub live_before_bytes: u64,
    /// Blocks still live at the end of the converted trace.
    pub live_at_end: u64,
    /// `oom` events (allocations PyTorch could not serve): counted, not replayed.
    pub ooms: u64,
    /// The largest request among the `oom` events.
    pub largest_oom_request_bytes: u64,
    /// `segment_alloc`, `segment_free`, `segment_map` and `segment_unmap` events: they give the reserved bytes.
    pub segment_events: u64,
    /// Events neither replayed nor used for the reserved bytes, by reason.
    pub not_replayed: BTreeMap<String, u64>,
    /// The most bytes PyTorch held from the device at once over the trace.
    pub torch_peak_reserved_bytes: u64,
    /// The most bytes live at once by PyTorch's alloc and free events (the sizes they carry, which recent
    /// PyTorch gives as asked for), blocks live before the trace included: the converted trace's peak of live
    /// bytes. `torch.cuda.max_memory_allocated` counts rounded blocks and drops a block at `free_requested`,
    /// so it can differ a little.
    pub torch_peak_allocated_bytes: u64,
    /// Bytes PyTorch held when the trace starts.
    pub reserved_at_start: u64,
    /// Bytes PyTorch held at the snapshot: the sum of the device's segments.
    pub reserved_at_end: u64,
    /// Anything else worth knowing (a snapshot whose segments disagree with its events).
    pub notes: Vec<String>,
}

impl SnapshotFigures {
    /// PyTorch's peak reserved over its peak allocated (0 when nothing was allocated).
    pub fn torch_reserved_over_allocated(&self) -> f64 {
        if self.torch_peak_allocated_bytes == 0 {
            0.0
        } else {
            self.torch_peak_reserved_bytes as f64 / self.torch_peak_allocated_bytes as f64
        }
    }
}
