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

use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Read};
use std::path::Path;
use thiserror::Error;
use umm::trace::{Trace, TraceBuilder};

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
    fn parse(text: &str) -> Self {
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
    fn has_range(&self) -> bool {
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

/// Whether `path` holds a pickle: its name ends in `.pickle` or `.pkl`, or it starts with [`PICKLE_MAGIC`]
/// and a protocol from 2 to 5 (an umm trace starts with `#`, a gzip file with 0x1f; other binary data rarely
/// starts with both). False when it cannot be read.
pub fn is_snapshot_file(path: &Path) -> bool {
    let by_name = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("pickle") || e.eq_ignore_ascii_case("pkl"));
    by_name
        || std::fs::File::open(path)
            .and_then(|f| {
                let mut head = Vec::with_capacity(2);
                f.take(2).read_to_end(&mut head)?;
                Ok(matches!(head[..], [PICKLE_MAGIC, 2..=5]))
            })
            .unwrap_or(false)
}

/// A snapshot's name from its path: the file name without `.pickle` or `.pkl`.
pub fn name_of(path: &Path) -> String {
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    for suffix in [".pickle", ".pkl"] {
        if file.len() > suffix.len() && file.to_ascii_lowercase().ends_with(suffix) {
            return file[..file.len() - suffix.len()].to_string();
        }
    }
    file
}

impl TorchSnapshot {
    /// Reads a snapshot file.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, TorchSnapshotError> {
        let path = path.as_ref();
        let label = path.display().to_string();
        let io_error = |source| TorchSnapshotError::Io { path: label.clone(), source };
        let file = std::fs::File::open(path).map_err(io_error)?;
        let bytes = file.metadata().map_err(io_error)?.len();
        if bytes > MAX_SNAPSHOT_BYTES {
            return Err(TorchSnapshotError::TooLarge { path: label, bytes, limit: MAX_SNAPSHOT_BYTES });
        }
        Self::from_reader(name_of(path), &label, file)
    }

    /// Reads a snapshot from `reader`; `label` names it in errors.
    pub fn from_reader(name: impl Into<String>, label: &str, reader: impl Read) -> Result<Self, TorchSnapshotError> {
        let mut bytes = Vec::new();
        reader
            .take(MAX_SNAPSHOT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| TorchSnapshotError::Io { path: label.into(), source })?;
        if bytes.len() as u64 > MAX_SNAPSHOT_BYTES {
            return Err(TorchSnapshotError::TooLarge {
                path: label.into(),
                bytes: bytes.len() as u64,
                limit: MAX_SNAPSHOT_BYTES,
            });
        }
        Self::from_bytes(name, label, &bytes)
    }

    /// Reads a snapshot held in memory; `label` names it in errors.
    pub fn from_bytes(name: impl Into<String>, label: &str, bytes: &[u8]) -> Result<Self, TorchSnapshotError> {
        Self::with_limits(name.into(), label, bytes, pickle::Limits::default())
    }

    fn with_limits(
        name: String,
        label: &str,
        bytes: &[u8],
        limits: pickle::Limits,
    ) -> Result<Self, TorchSnapshotError> {
        let pickle = pickle::parse(bytes, limits).map_err(|e| TorchSnapshotError::Pickle {
            path: label.into(),
            offset: e.offset as u64,
            what: e.what,
        })?;
        let format = |what: String| TorchSnapshotError::Format { path: label.into(), what };
        let shape = Shape { p: &pickle };
        let (segments, device_traces) = shape.snapshot().map_err(format)?;
        Ok(Self { name, label: label.into(), protocol: pickle.protocol, segments, device_traces })
    }

    /// Devices with a trace (the length of `device_traces`).
    pub fn devices(&self) -> usize {
        self.device_traces.len()
    }

    /// The device with the most events (the lowest of those tied); `None` without any device trace.
    pub fn busiest_device(&self) -> Option<usize> {
        // Reversed so that `max_by_key`, which keeps the last of equal keys, keeps the lowest device.
        self.device_traces.iter().enumerate().rev().max_by_key(|(_, events)| events.len()).map(|(d, _)| d)
    }

    /// Converts `device`'s trace to an umm trace (see the [module](self) for the rules).
    pub fn to_trace(&self, device: usize) -> Result<Trace, TorchSnapshotError> {
        self.convert(device).map(|c| c.trace)
    }

    /// Converts `device`'s trace to an umm trace, with PyTorch's figures and what was synthesised or skipped.
    pub fn convert(&self, device: usize) -> Result<TorchTrace, TorchSnapshotError> {
        let events = self.device_traces.get(device).ok_or_else(|| TorchSnapshotError::NoDevice {
            path: self.label.clone(),
            device,
            devices: self.devices(),
        })?;
        let segments: Vec<&Segment> = self.segments.iter().filter(|s| s.device == device as u64).collect();
        let mut conversion = Conversion::new(events, device, self.devices());
        conversion.events(events);
        conversion.live_in_segments(&segments);
        conversion.reserved(events, &segments);
        conversion.finish(self.name.clone()).map_err(|what| TorchSnapshotError::Format {
            path: self.label.clone(),
            what: format!("device {device}: {what}"),
        })
    }
}

/// An op of the converted trace before blocks get slots: blocks are numbered as they are created.
enum Step {
    Alloc { id: u64, bytes: u64, stream: i128 },
    Free { id: u64 },
}

/// One device's events on their way to a trace.
struct Conversion {
    figures: SnapshotFigures,
    free_action: Action,
    /// Blocks allocated at the start, in order.
    prelude: Vec<Step>,
    /// The trace's own ops.
    steps: Vec<Step>,
    /// Live block by address: (id, bytes). Zero-byte blocks have no id: they are not replayed.
    live: HashMap<u64, (Option<u64>, u64)>,
    /// Addresses that any alloc or free event names.
    named: HashSet<u64>,
    /// Addresses allocated or freed so far: a free of one of them that is not live is a double free, not a
    /// block from before the trace.
    touched: HashSet<u64>,
    next_id: u64,
    /// Bytes live now and at most, blocks from before the trace included (wide: sizes are any `u64`).
    live_bytes: u128,
    peak: u128,
}

impl Conversion {
    fn new(events: &[TraceEvent], device: usize, devices: usize) -> Self {
        let free_action = if events.iter().any(|e| e.action == Action::FreeCompleted) {
            Action::FreeCompleted
        } else {
            Action::FreeRequested
        };
        let figures = SnapshotFigures {
            device,
            devices,
            events: events.len() as u64,
            free_action: free_action.name().to_string(),
            allocs: 0,
            frees: 0,
            live_before_from_frees: 0,
            live_before_from_segments: 0,
            live_before_bytes: 0,
            live_at_end: 0,
            ooms: 0,
            largest_oom_request_bytes: 0,
            segment_events: 0,
            not_replayed: BTreeMap::new(),
            torch_peak_reserved_bytes: 0,
            torch_peak_allocated_bytes: 0,
            reserved_at_start: 0,
            reserved_at_end: 0,
            notes: Vec::new(),
        };
        Self {
            figures,
            free_action,
            prelude: Vec::new(),
            steps: Vec::new(),
            live: HashMap::new(),
            named: HashSet::new(),
            touched: HashSet::new(),
            next_id: 0,
            live_bytes: 0,
            peak: 0,
        }
    }

    fn skip(&mut self, reason: impl Into<String>) {
        *self.figures.not_replayed.entry(reason.into()).or_default() += 1;
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    /// A block live before the trace: allocated at the start. Returns its id (`None` for zero bytes). It is
    /// live at every point so far, so it raises the peak so far as much as the bytes live now.
    fn live_before(&mut self, bytes: u64, stream: i128) -> Option<u64> {
        self.figures.live_before_bytes = self.figures.live_before_bytes.saturating_add(bytes);
        self.live_bytes += u128::from(bytes);
        self.peak += u128::from(bytes);
        if bytes == 0 {
            return None;
        }
        let id = self.new_id();
        self.prelude.push(Step::Alloc { id, bytes, stream });
        Some(id)
    }

    fn events(&mut self, events: &[TraceEvent]) {
        for event in events {
            match &event.action {
                Action::Alloc => {
                    self.named.insert(event.addr);
                    self.alloc(event);
                }
                Action::FreeRequested | Action::FreeCompleted => {
                    self.named.insert(event.addr);
                    if event.action == self.free_action {
                        self.free(event);
                    } else {
                        self.skip("free_requested (frees are taken from free_completed)");
                    }
                }
                Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap => {
                    self.figures.segment_events += 1;
                }
                Action::Oom => {
                    self.figures.ooms += 1;
                    self.figures.largest_oom_request_bytes = self.figures.largest_oom_request_bytes.max(event.size);
                }
                Action::Snapshot | Action::UserDefined => self.skip(event.action.name()),
                Action::Other(name) => self.skip(format!("unknown action `{name}`")),
            }
        }
    }

    fn alloc(&mut self, event: &TraceEvent) {
        if let Some((id, bytes)) = self.live.remove(&event.addr) {
            // PyTorch never hands out a live address; a trace that says so lost the free: free it first.
            self.skip("free missing before an alloc at a live address (freed there)");
            self.live_bytes -= u128::from(bytes);
            if let Some(id) = id {
                self.steps.push(Step::Free { id });
            }
        }
        self.touched.insert(event.addr);
        self.figures.allocs += 1;
        let id = if event.size == 0 {
            self.skip("zero-byte alloc");
            None
        } else {
            let id = self.new_id();
            self.steps.push(Step::Alloc { id, bytes: event.size, stream: event.stream });
            Some(id)
        };
        self.live.insert(event.addr, (id, event.size));
        self.live_bytes += u128::from(event.size);
        self.peak = self.peak.max(self.live_bytes);
    }

    fn free(&mut self, event: &TraceEvent) {
        let block = match self.live.remove(&event.addr) {
            Some(block) => Some(block),
            None if self.touched.contains(&event.addr) => None,
            None => {
                // Allocated before the trace: it is live from the start, so it counts in every byte total.
                self.figures.live_before_from_frees += 1;
                let id = self.live_before(event.size, event.stream);
                Some((id, event.size))
            }
        };
        self.touched.insert(event.addr);
        let Some((id, bytes)) = block else {
            self.skip(format!("{} of a block not live (freed twice)", self.free_action.name()));
            return;
        };
        self.figures.frees += 1;
        self.live_bytes -= u128::from(bytes);
        if let Some(id) = id {
            self.steps.push(Step::Free { id });
        }
    }

    /// Blocks the segments show in use whose address no event names: live throughout, allocated at the start.
    /// A block waiting for its free counts where frees are `free_completed`, which it has not reached.
    fn live_in_segments(&mut self, segments: &[&Segment]) {
        let pending_is_live = self.free_action == Action::FreeCompleted;
        for segment in segments {
            for block in &segment.blocks {
                let in_use = match block.state {
                    BlockState::ActiveAllocated => true,
                    BlockState::ActivePendingFree => pending_is_live,
                    BlockState::Inactive | BlockState::Other(_) => false,
                };
                if in_use && !self.named.contains(&block.address) {
                    self.named.insert(block.address);
                    self.figures.live_before_from_segments += 1;
                    let bytes = if block.requested_size > 0 { block.requested_size } else { block.size };
                    self.live_before(bytes, segment.stream);
                }
            }
        }
    }

    /// PyTorch's reserved bytes: what the segments hold at the dump, less the events' net change, is what it
    /// held at the start; the events give the rest of the curve.
    fn reserved(&mut self, events: &[TraceEvent], segments: &[&Segment]) {
        let (mut net, mut low, mut high) = (0i128, 0i128, 0i128);
        for event in events {
            match event.action {
                Action::SegmentAlloc | Action::SegmentMap => net += i128::from(event.size),
                Action::SegmentFree | Action::SegmentUnmap => net -= i128::from(event.size),
                _ => continue,
            }
            low = low.min(net);
            high = high.max(net);
        }
        let end: i128 = segments.iter().map(|s| i128::from(s.total_size)).sum();
        let mut start = end - net;
        if start + low < 0 {
            self.figures.notes.push(format!(
                "the segments hold {end} bytes at the snapshot, too few for the segment events before it (they \
                 would leave {} bytes reserved at their lowest); reserved bytes at the start taken as {}",
                start + low,
                -low
            ));
            start = -low;
        }
        let clamp = |v: i128| u64::try_from(v.max(0)).unwrap_or(u64::MAX);
        self.figures.reserved_at_start = clamp(start);
        self.figures.reserved_at_end = clamp(end);
        self.figures.torch_peak_reserved_bytes = clamp(start + high);
    }

    fn finish(mut self, name: String) -> Result<TorchTrace, String> {
        self.figures.torch_peak_allocated_bytes = u64::try_from(self.peak).unwrap_or(u64::MAX);
        let f = &mut self.figures;
        if f.torch_peak_reserved_bytes < f.torch_peak_allocated_bytes {
            f.notes.push(format!(
                "PyTorch's peak reserved ({} bytes) is below its peak allocated ({} bytes): the snapshot's segments \
                 and segment events do not cover its blocks, so its reserved figures are incomplete",
                f.torch_peak_reserved_bytes, f.torch_peak_allocated_bytes
            ));
        }
        // Stream values in order of first appearance: 0 stays 0, the others count up from 1.
        let mut streams: HashMap<i128, u32> = HashMap::from([(0, 0)]);
        let mut builder = TraceBuilder::new(name);
        for step in self.prelude.iter().chain(&self.steps) {
            match *step {
                Step::Alloc { id, bytes, stream } => {
                    let next = u32::try_from(streams.len()).map_err(|_| "more than 2^32 streams")?;
                    let stream = *streams.entry(stream).or_insert(next);
                    builder.alloc(id, bytes, stream)?;
                }
                Step::Free { id } => builder.free(id)?,
            }
        }
        let trace = builder.finish();
        self.figures.live_at_end = trace.allocs - trace.frees;
        Ok(TorchTrace { trace, figures: self.figures })
    }
}

/// Reads the snapshot's dict out of the parsed pickle, naming the field at fault. Places (`segments[3]`) are
/// closures, made into text only for an error.
struct Shape<'a> {
    p: &'a pickle::Pickle,
}

type Fields<'a> = &'a [(pickle::Value, pickle::Value)];
type Place<'p> = &'p dyn Fn() -> String;

impl<'a> Shape<'a> {
    fn snapshot(&self) -> Result<(Vec<Segment>, Vec<Vec<TraceEvent>>), String> {
        let root = self.p.dict(self.p.root).ok_or_else(|| {
            format!(
                "the pickle holds {}, not the dict torch.cuda.memory._dump_snapshot writes",
                self.p.describe(self.p.root)
            )
        })?;
        let Some(traces) = self.p.get(root, "device_traces") else {
            return Err(format!(
                "the dict has no `device_traces` (its keys: {}); record with \
                 torch.cuda.memory._record_memory_history(max_entries=...) before _dump_snapshot",
                self.keys(root)
            ));
        };
        let traces = self.list(traces, &|| "device_traces".into())?;
        let mut device_traces = Vec::with_capacity(traces.len());
        for (d, &events) in traces.iter().enumerate() {
            let events = self.list(events, &|| format!("device_traces[{d}]"))?;
            let parsed: Result<Vec<_>, _> = events
                .iter()
                .enumerate()
                .map(|(i, &e)| self.event(e, &|| format!("device_traces[{d}][{i}]")))
                .collect();
            device_traces.push(parsed?);
        }
        let segments = match self.p.get(root, "segments") {
            None => Vec::new(),
            Some(segments) => {
                let segments = self.list(segments, &|| "segments".into())?;
                let parsed: Result<Vec<_>, _> =
                    segments.iter().enumerate().map(|(i, &s)| self.segment(s, &|| format!("segments[{i}]"))).collect();
                parsed?
            }
        };
        Ok((segments, device_traces))
    }

    fn keys(&self, dict: Fields<'_>) -> String {
        if dict.is_empty() {
            return "none".into();
        }
        let mut keys: Vec<String> = dict.iter().take(12).map(|&(k, _)| self.p.quote(k)).collect();
        if dict.len() > 12 {
            keys.push("...".into());
        }
        keys.join(", ")
    }

    fn list(&self, value: pickle::Value, place: Place<'_>) -> Result<&'a [pickle::Value], String> {
        self.p.list(value).ok_or_else(|| format!("`{}` is {}, expected a list", place(), self.p.describe(value)))
    }

    fn dict(&self, value: pickle::Value, place: Place<'_>) -> Result<Fields<'a>, String> {
        self.p.dict(value).ok_or_else(|| format!("`{}` is {}, expected a dict", place(), self.p.describe(value)))
    }

    fn field(&self, dict: Fields<'_>, key: &str, place: Place<'_>) -> Result<pickle::Value, String> {
        self.p.get(dict, key).ok_or_else(|| format!("`{}` has no `{key}` (its keys: {})", place(), self.keys(dict)))
    }

    /// An integer within `lo..=hi` at `place.key`, saying which bound it breaks.
    fn int(
        &self,
        value: pickle::Value,
        place: Place<'_>,
        key: &str,
        what: &str,
        (lo, hi): (i128, i128),
    ) -> Result<i128, String> {
        match self.p.int(value) {
            Some(n) if (lo..=hi).contains(&n) => Ok(n),
            Some(n) if n < lo && lo == 0 => Err(format!("`{}.{key}` is {n}: a {what} cannot be negative", place())),
            Some(n) => Err(format!("`{}.{key}` is {n}, outside the {what}s this reader takes ({lo} to {hi})", place())),
            None => Err(format!("`{}.{key}` is {}, expected an integer {what}", place(), self.p.describe(value))),
        }
    }

    /// A required field holding a `u64` (`what` names it in errors).
    fn u64_field(&self, dict: Fields<'_>, key: &str, place: Place<'_>, what: &str) -> Result<u64, String> {
        let value = self.field(dict, key, place)?;
        Ok(self.int(value, place, key, what, U64)? as u64)
    }

    /// An optional field holding a `u64`: `None` when absent.
    fn opt_u64(&self, dict: Fields<'_>, key: &str, place: Place<'_>, what: &str) -> Result<Option<u64>, String> {
        match self.p.get(dict, key) {
            None => Ok(None),
            Some(value) => Ok(Some(self.int(value, place, key, what, U64)? as u64)),
        }
    }

    /// A stream: PyTorch writes a `cudaStream_t` as an integer, which may be signed. 0 when absent.
    fn stream(&self, dict: Fields<'_>, place: Place<'_>) -> Result<i128, String> {
        match self.p.get(dict, "stream") {
            None | Some(pickle::Value::None) => Ok(0),
            Some(value) => self.int(value, place, "stream", "stream", (i64::MIN.into(), u64::MAX.into())),
        }
    }

    fn event(&self, value: pickle::Value, place: Place<'_>) -> Result<TraceEvent, String> {
        let dict = self.dict(value, place)?;
        let action = self.field(dict, "action", place)?;
        let action = Action::parse(self.p.str(action).ok_or_else(|| {
            format!("`{}.action` is {}, expected a string such as 'alloc'", place(), self.p.describe(action))
        })?);
        let in_event = |e: String| format!("{e} (in an `{}` event)", action.name());
        let (addr, size) = if action.has_range() {
            let addr = self.u64_field(dict, "addr", place, "address").map_err(in_event)?;
            (addr, self.u64_field(dict, "size", place, "size").map_err(in_event)?)
        } else if action == Action::Oom {
            (0, self.opt_u64(dict, "size", place, "size").map_err(in_event)?.unwrap_or(0))
        } else {
            (0, 0)
        };
        let stream = self.stream(dict, place).map_err(in_event)?;
        let time_us = self.p.get(dict, "time_us").and_then(|v| self.p.int(v)).and_then(|t| i64::try_from(t).ok());
        Ok(TraceEvent { action, addr, size, stream, time_us })
    }

    fn segment(&self, value: pickle::Value, place: Place<'_>) -> Result<Segment, String> {
        let dict = self.dict(value, place)?;
        let device = self.u64_field(dict, "device", place, "device index")?;
        let address = self.u64_field(dict, "address", place, "address")?;
        let total_size = self.u64_field(dict, "total_size", place, "size")?;
        let stream = self.stream(dict, place)?;
        let is_expandable = matches!(self.p.get(dict, "is_expandable"), Some(pickle::Value::Bool(true)));
        let blocks = match self.p.get(dict, "blocks") {
            None => &[][..],
            Some(blocks) => self.list(blocks, &|| format!("{}.blocks", place()))?,
        };
        let mut next = address;
        let mut parsed = Vec::with_capacity(blocks.len());
        for (i, &block) in blocks.iter().enumerate() {
            let place = || format!("{}.blocks[{i}]", place());
            let dict = self.dict(block, &place)?;
            let size = self.u64_field(dict, "size", &place, "size")?;
            let requested_size = self.opt_u64(dict, "requested_size", &place, "size")?.unwrap_or(0);
            // Older snapshots give no block addresses: blocks lie side by side from the segment's address.
            let address = self.opt_u64(dict, "address", &place, "address")?.unwrap_or(next);
            next = address.saturating_add(size);
            let state = self.field(dict, "state", &place)?;
            let state = match self.p.str(state) {
                Some("active_allocated") => BlockState::ActiveAllocated,
                Some("active_pending_free") => BlockState::ActivePendingFree,
                Some("inactive") => BlockState::Inactive,
                Some(other) => BlockState::Other(other.to_string()),
                None => {
                    return Err(format!("`{}.state` is {}, expected a string", place(), self.p.describe(state)));
                }
            };
            parsed.push(SegmentBlock { address, size, requested_size, state });
        }
        Ok(Segment { device, address, total_size, stream, is_expandable, blocks: parsed })
    }
}

/// The range of a `u64` field.
const U64: (i128, i128) = (0, u64::MAX as i128);

mod pickle;
#[cfg(test)]
mod tests;
