//! Seeing the memory: [`Snapshot`]s of every pool's segments and blocks with the recorded events, the leak
//! report, and a replay of a trace through a manager that produces a snapshot (`umm snapshot`).
//!
//! A snapshot is what `torch.cuda.memory._snapshot()` gives PyTorch users, for every device and API at once:
//! segments with their blocks (offset, size, free or live, label, call site) and the event history, as serde
//! JSON that `umm plot` turns into a timeline.

use crate::buffer::UniversalBuffer;
use crate::error::{Error, Result};
use crate::manager::UniversalMemoryManager;
use crate::options::AllocOptions;
use crate::profiler::{CallSite, Event, LeakReport, Profiler};
use crate::trace::{Op, Trace};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use umm_backends::{MemoryPool, StreamId};
use umm_placement::{Api, DeviceKind, PoolKind};
use umm_placement::{DeviceSelector, Placement};

/// The `format` field of every snapshot this version writes.
pub const SNAPSHOT_FORMAT: &str = "umm-snapshot v1";

/// Every pool's segments and blocks, and the recorded events, at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Always [`SNAPSHOT_FORMAT`].
    pub format: String,
    /// The manager's devices.
    pub devices: Vec<SnapshotDevice>,
    /// Every pool created so far.
    pub pools: Vec<PoolSegments>,
    /// Whether the profiler was recording events when the snapshot was taken.
    pub recording: bool,
    /// Recorded events, oldest first (empty unless the profiler was on).
    pub events: Vec<Event>,
    /// Events the ring dropped because it was full.
    pub events_dropped: u64,
}

/// A device as a snapshot names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotDevice {
    /// Index among the manager's devices.
    pub index: usize,
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: DeviceKind,
}

/// One pool: where it is, its statistics and its segments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolSegments {
    /// Device index.
    pub device: usize,
    /// The API the pool allocates through.
    pub api: Api,
    /// The kind of pool.
    pub kind: PoolKind,
    /// Pool name.
    pub name: String,
    /// Statistics as [`umm_backends::PoolStats`] serialises them (`allocated_bytes`, `reserved_bytes`, ...).
    pub stats: serde_json::Value,
    /// Segments.
    pub segments: Vec<Segment>,
}

/// One segment (a device allocation, or a virtual reservation) and its blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Stream whose arena holds it.
    pub stream: u64,
    /// `small` or `large` arena.
    pub class: String,
    /// Index inside its arena.
    pub index: u32,
    /// Size in bytes (address space for a virtual reservation).
    pub size: u64,
    /// Whether it is a virtual reservation whose pages are mapped on use.
    pub virtual_reservation: bool,
    /// Physical bytes behind it.
    pub physical_bytes: u64,
    /// Blocks in address order.
    pub blocks: Vec<Block>,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// Offset inside the segment.
    pub offset: u64,
    /// Size in bytes (rounded to the pool's alignment).
    pub size: u64,
    /// Whether it is free (cached for reuse).
    pub free: bool,
    /// The allocation id (as in events) of a live block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    /// Bytes the buffer asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested: Option<u64>,
    /// The buffer's label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Where the buffer was allocated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_site: Option<CallSite>,
}

impl Snapshot {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Parses a snapshot from JSON; `what` names the source in errors.
    pub fn from_json(what: &str, json: &str) -> Result<Self> {
        let snapshot: Snapshot =
            serde_json::from_str(json).map_err(|source| Error::Json { what: what.to_string(), source })?;
        if snapshot.format != SNAPSHOT_FORMAT {
            return Err(Error::InvalidConfig(format!(
                "{what}: snapshot format `{}` is not `{SNAPSHOT_FORMAT}`",
                snapshot.format
            )));
        }
        Ok(snapshot)
    }

    /// Writes the snapshot as JSON to `path`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json()).map_err(|source| Error::Io { path: path.display().to_string(), source })
    }

    /// Reads a snapshot written by [`Snapshot::save`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.display().to_string(), source })?;
        Self::from_json(&path.display().to_string(), &text)
    }

    /// Bytes in live blocks over every pool.
    pub fn live_bytes(&self) -> u64 {
        self.blocks().filter(|b| !b.free).map(|b| b.size).sum()
    }

    /// Every block of every segment of every pool.
    pub fn blocks(&self) -> impl Iterator<Item = &Block> {
        self.pools.iter().flat_map(|p| &p.segments).flat_map(|s| &s.blocks)
    }
}

impl UniversalMemoryManager {
    /// The profiler: turn event recording on and off, read events, the leak report.
    pub fn profiler(&self) -> &Profiler {
        &self.inner.profiler
    }

    /// Every buffer alive now with its label and call site. Always available (the live table is always on).
    pub fn leak_report(&self) -> LeakReport {
        self.inner.profiler.leak_report()
    }

    /// Every pool's segments with their blocks (labels and call sites of live ones) and the recorded events.
    /// O(segments + blocks + events); each pool is locked only while its own segments are read.
    pub fn snapshot(&self) -> Snapshot {
        let profiler = &self.inner.profiler;
        let mut pools_seen: Vec<(usize, PoolKind, Arc<dyn MemoryPool>)> = Vec::new();
        let live = profiler.live_blocks();
        let mut pools = Vec::new();
        for device in self.devices() {
            for (api, kind, pool) in device.pools() {
                let snap = pool.snapshot();
                let address = pool.identity();
                let segments = snap
                    .segments
                    .iter()
                    .map(|s| Segment {
                        stream: s.stream.0,
                        class: s.class.to_string(),
                        index: s.index,
                        size: s.size,
                        virtual_reservation: s.virtual_reservation,
                        physical_bytes: s.physical_bytes,
                        blocks: s
                            .blocks
                            .iter()
                            .map(|b| {
                                let owner = b.key.and_then(|key| live.get(&(address, key)));
                                Block {
                                    offset: b.offset,
                                    size: b.size,
                                    free: b.free,
                                    id: owner.map(|o| o.id),
                                    requested: owner.map(|o| o.bytes),
                                    label: owner.and_then(|o| o.label.clone()),
                                    call_site: owner.map(|o| o.call_site.clone()),
                                }
                            })
                            .collect(),
                    })
                    .collect();
                pools.push(PoolSegments {
                    device: device.index(),
                    api,
                    kind,
                    name: snap.name.clone(),
                    stats: serde_json::to_value(&snap.stats).unwrap_or_default(),
                    segments,
                });
                pools_seen.push((device.index(), kind, pool));
            }
        }
        profiler.observe_pools(&pools_seen);
        Snapshot {
            format: SNAPSHOT_FORMAT.to_string(),
            devices: self
                .devices()
                .iter()
                .map(|d| SnapshotDevice { index: d.index(), name: d.name().to_string(), kind: d.kind() })
                .collect(),
            pools,
            recording: profiler.is_enabled(),
            events: profiler.events(),
            events_dropped: profiler.dropped_events(),
        }
    }
}

/// When [`snapshot_trace`] takes its snapshot. Parses from `end` or `peak` (any case); an unknown name is an
/// error listing both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, strum::Display, strum::EnumIter)]
#[strum(serialize_all = "snake_case")]
pub enum SnapshotAt {
    /// After the last op (blocks the trace leaves live stay live).
    #[default]
    End,
    /// At the first op where live bytes reach the trace's peak.
    Peak,
}

impl std::str::FromStr for SnapshotAt {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        use strum::IntoEnumIterator;
        let wanted = text.trim();
        Self::iter().find(|at| at.to_string().eq_ignore_ascii_case(wanted)).ok_or_else(|| {
            let names: Vec<String> = Self::iter().map(|at| at.to_string()).collect();
            format!("unknown snapshot point `{wanted}`: expected one of {}", names.join(", "))
        })
    }
}

/// Replays `trace` through a manager with one simulated device of `capacity` bytes and the profiler on (every
/// op an allocation or a drop of a `UniversalBuffer<u8>`, on the trace's streams), and snapshots it `at` the
/// end or the peak. `limit` caps the device's pool. Allocations that run out of memory are skipped and counted
/// in the returned number.
pub fn snapshot_trace(
    trace: &Trace,
    capacity: u64,
    limit: Option<umm_backends::Limit>,
    at: SnapshotAt,
) -> Result<(Snapshot, u64)> {
    let mut builder = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(capacity)
        .profile(true)
        .profile_capacity(trace.ops.len() * 2 + 1024);
    if let Some(limit) = limit {
        builder = builder.limit(limit);
    }
    let mm = builder.build()?;
    let device = mm.devices().len() - 1;
    let mut slots: Vec<Option<UniversalBuffer<u8>>> = (0..trace.slots).map(|_| None).collect();
    let (mut live, mut ooms) = (0u64, 0u64);
    for op in &trace.ops {
        match *op {
            Op::Alloc { slot, bytes, stream } => {
                let n = usize::try_from(bytes).map_err(|_| {
                    Error::InvalidConfig(format!("a block of {bytes} bytes does not fit this machine's usize"))
                })?;
                let options = AllocOptions::new()
                    .placement(Placement::DeviceLocal)
                    .device(DeviceSelector::Index(device))
                    .stream(StreamId(u64::from(stream)));
                match mm.allocate_universal_with::<u8>(n, options) {
                    Ok(buffer) => {
                        live += bytes;
                        slots[slot as usize] = Some(buffer);
                    }
                    Err(Error::Backend(
                        umm_backends::Error::OutOfMemory { .. } | umm_backends::Error::TooLarge { .. },
                    )) => ooms += 1,
                    Err(e) => return Err(e),
                }
                if at == SnapshotAt::Peak && live == trace.peak_live_bytes {
                    return Ok((mm.snapshot(), ooms));
                }
            }
            Op::Free { slot } => {
                if let Some(buffer) = slots[slot as usize].take() {
                    live -= buffer.size_bytes();
                }
            }
        }
    }
    Ok((mm.snapshot(), ooms))
}
