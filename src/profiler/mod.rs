//! Allocation events: who allocated what, where (call site), on which device and pool.
//!
//! Two layers with different costs:
//! - the **live table** is on by default ([`ProfilerConfig::live_table`], `UMM_LIVE_TABLE`): every buffer has an
//!   entry (size, device, pool, stream, label, call site) from allocation to drop, in a slab behind one mutex of
//!   the allocating thread's shard. It feeds [`Profiler::leak_report`], the labels and call sites of a
//!   snapshot's blocks, and the warning logged when a manager is dropped while buffers are alive. Off, it saves
//!   one lock round trip per buffer at allocation and at drop (30–100 ns per buffer on an H200 machine, with
//!   the lock it took before), and the drop-time warning gives counts without call sites.
//! - the **event ring** is opt-in ([`Profiler::set_enabled`], [`crate::Builder::profile`], `UMM_PROFILE=1`): a
//!   bounded ring of allocation, free and segment events that [`crate::Snapshot`]s carry and `umm plot` draws.
//!   When off, recording costs one relaxed atomic load per allocation and per free.
//!
//! `UMM_TRACE=path` (or [`crate::Builder::record_trace`]) additionally writes every allocation and free as an
//! `umm-trace v1` file, so a user's own workload can be replayed with `umm replay` and compared.

use parking_lot::Mutex;
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use umm_backends::{LeanMutex, MemoryPool, StreamId};
use umm_placement::{Api, PoolKind};

mod events;
mod recording;

pub use events::{CallSite, Event, EventKind, LeakGroup, LeakReport, LiveAllocation};
use recording::TraceRecorder;

/// Events the ring keeps by default (about 100 bytes each, plus labels).
pub const DEFAULT_CAPACITY: usize = 100_000;

/// What the manager tells the profiler about one allocation.
#[derive(Clone)]
pub(crate) struct AllocEvent<'a> {
    pub(crate) device: usize,
    pub(crate) pool: PoolKind,
    pub(crate) api: Option<Api>,
    pub(crate) bytes: u64,
    pub(crate) stream: StreamId,
    pub(crate) label: Option<&'a str>,
    pub(crate) location: &'static Location<'static>,
    /// The pool block's key (`BlockHandle::key`), `None` for an empty buffer.
    pub(crate) block_key: Option<u64>,
    /// The pool the block came from, `None` for an empty buffer.
    pub(crate) pool_handle: Option<&'a Arc<dyn MemoryPool>>,
}

/// Profiler settings: part of [`crate::UmmConfig`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfilerConfig {
    /// Record events into the ring from the start (`UMM_PROFILE`).
    pub enabled: bool,
    /// Events the ring keeps; older ones are dropped and counted (`UMM_PROFILE_CAPACITY`).
    pub capacity: usize,
    /// Write every allocation and free to this `umm-trace v1` file (`UMM_TRACE`; gzip if it ends in `.gz`).
    /// `{pid}` in the name is replaced by the process id; a second manager of the same process writing to the
    /// same name gets `.2` (then `.3`, ...) before the extension.
    pub trace_path: Option<PathBuf>,
    /// Warn when the manager is dropped while buffers are alive, with the [`LeakReport`] (`UMM_LEAK_WARNING`,
    /// default on). The warning goes through `log` when a logger is installed, else to stderr, so that it is
    /// seen in a program that never set up logging; turn it off where buffers outliving their manager is
    /// intended.
    pub leak_warning: bool,
    /// Keep the table of live buffers with their labels and call sites (`UMM_LIVE_TABLE`, default on): what
    /// leak reports, the drop-time leak warning and the call sites of a snapshot's blocks read. Off, every
    /// buffer costs one lock round trip less at allocation and at drop, and those reports are empty; buffers
    /// allocated while events are recorded or a trace is written are still entered.
    pub live_table: bool,
}

impl Default for ProfilerConfig {
    fn default() -> Self {
        Self { enabled: false, capacity: DEFAULT_CAPACITY, trace_path: None, leak_warning: true, live_table: true }
    }
}

/// One live buffer in the slab.
struct LiveEntry {
    id: u64,
    device: usize,
    pool: PoolKind,
    api: Option<Api>,
    bytes: u64,
    stream: StreamId,
    label: Option<Box<str>>,
    location: &'static Location<'static>,
    /// Identity of the pool (its address) and the block's key in it: joins snapshot blocks to entries.
    block: Option<(usize, u64)>,
}

/// Shards of the live table. A thread records its allocations in a shard of its own (by a number taken at its
/// first allocation), so that threads allocating at once do not queue on one lock; a free goes to the shard that
/// recorded the buffer, whichever thread frees it.
const LIVE_SHARDS: u64 = 32;

/// What `on_alloc` returns for a buffer it did not enter (the live table off): slot numbers are `u32`, so no
/// entered buffer's handle comes near it.
const NOT_ENTERED: u64 = u64::MAX;

/// The calling thread's live-table shard.
fn live_shard() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static SHARD: u64 = NEXT.fetch_add(1, Ordering::Relaxed) % LIVE_SHARDS;
    }
    SHARD.try_with(|s| *s).unwrap_or(0)
}

/// One shard of the live table, alone on its cache lines, behind the pools' lock (released with a plain store:
/// one locked instruction per hold instead of two, on every allocation and drop).
#[repr(align(128))]
struct LiveShard(LeanMutex<LiveTable>);

impl Default for LiveShard {
    fn default() -> Self {
        LiveShard(LeanMutex::new(LiveTable::default()))
    }
}

/// The always-on table of live buffers (one shard of it): a slab whose slot numbers, with the shard's, are what
/// `on_alloc` returns.
#[derive(Default)]
struct LiveTable {
    slots: Vec<Option<LiveEntry>>,
    vacant: Vec<u32>,
    next_id: u64,
}

/// The opt-in event ring.
struct Ring {
    events: VecDeque<Event>,
    capacity: usize,
    dropped: u64,
    /// Reserved bytes last seen per pool (by address), to turn changes into segment events.
    reserved: HashMap<usize, u64>,
}

impl Ring {
    fn push(&mut self, event: Event) {
        if self.capacity == 0 {
            self.dropped += 1;
            return;
        }
        if self.events.len() == self.capacity {
            self.events.pop_front();
            self.dropped += 1;
        }
        self.events.push_back(event);
    }
}

/// Records allocations: the live table (leak report) unless turned off, optionally the event ring and a trace
/// file.
pub struct Profiler {
    enabled: AtomicBool,
    /// See [`ProfilerConfig::live_table`].
    live_table: bool,
    epoch: Instant,
    live: Box<[LiveShard]>,
    ring: Mutex<Ring>,
    trace: Option<TraceRecorder>,
}

impl Default for Profiler {
    fn default() -> Self {
        Self::with_capacity(false, DEFAULT_CAPACITY)
    }
}

impl fmt::Debug for Profiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Profiler")
            .field("enabled", &self.is_enabled())
            .field("capacity", &self.capacity())
            .field("trace", &self.trace.as_ref().map(|t| &t.path))
            .finish()
    }
}

fn pool_address(pool: &Arc<dyn MemoryPool>) -> usize {
    pool.identity()
}

impl Profiler {
    /// A profiler as `config` says; opens the trace file if one is asked for.
    pub(crate) fn new(config: &ProfilerConfig) -> crate::error::Result<Self> {
        let mut profiler = Self::with_capacity(config.enabled, config.capacity);
        profiler.live_table = config.live_table;
        if let Some(path) = &config.trace_path {
            profiler.trace = Some(TraceRecorder::create(path)?);
        }
        Ok(profiler)
    }

    fn with_capacity(enabled: bool, capacity: usize) -> Self {
        Self {
            enabled: AtomicBool::new(enabled),
            live_table: true,
            epoch: Instant::now(),
            live: (0..LIVE_SHARDS).map(|_| LiveShard::default()).collect(),
            ring: Mutex::new(Ring { events: VecDeque::new(), capacity, dropped: 0, reserved: HashMap::new() }),
            trace: None,
        }
    }

    /// Whether events are being recorded into the ring.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Starts or stops recording events (PyTorch's `_record_memory_history(enabled=...)`). Recorded events stay
    /// until [`Profiler::clear`].
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Events the ring keeps.
    pub fn capacity(&self) -> usize {
        self.ring.lock().capacity
    }

    /// Changes how many events the ring keeps, dropping the oldest if it shrinks.
    pub fn set_capacity(&self, capacity: usize) {
        let mut ring = self.ring.lock();
        ring.capacity = capacity;
        while ring.events.len() > capacity {
            ring.events.pop_front();
            ring.dropped += 1;
        }
    }

    /// The recorded events, oldest first. O(events).
    pub fn events(&self) -> Vec<Event> {
        self.ring.lock().events.iter().cloned().collect()
    }

    /// Events dropped because the ring was full (or had no room).
    pub fn dropped_events(&self) -> u64 {
        self.ring.lock().dropped
    }

    /// Forgets the recorded events and the dropped count.
    pub fn clear(&self) {
        let mut ring = self.ring.lock();
        ring.events.clear();
        ring.dropped = 0;
    }

    /// The `umm-trace v1` file being written, if any.
    pub fn trace_path(&self) -> Option<&Path> {
        self.trace.as_ref().map(|t| t.path.as_path())
    }

    /// Records the end of a step in the trace file, if any.
    pub(crate) fn trace_step(&self) {
        if let Some(trace) = &self.trace {
            trace.write(format_args!("s\n"));
        }
    }

    /// Flushes the trace file, if any, so that it holds every op so far.
    pub fn flush_trace(&self) {
        if let Some(trace) = &self.trace {
            trace.flush();
        }
    }

    /// Every live buffer with its label and call site, oldest first (exactly within a thread; across threads,
    /// by each thread's count of allocations). O(live log live).
    pub fn leak_report(&self) -> LeakReport {
        let mut allocations: Vec<LiveAllocation> = Vec::new();
        for shard in self.live.iter() {
            allocations.extend(shard.0.lock().slots.iter().flatten().map(live_allocation));
        }
        allocations.sort_by_key(|a| a.id);
        let total_bytes = allocations.iter().map(|a| a.bytes).sum();
        LeakReport { allocations, total_bytes }
    }

    /// Live buffers by (pool address, block key), for labelling a snapshot's blocks. O(live).
    pub(crate) fn live_blocks(&self) -> HashMap<(usize, u64), LiveAllocation> {
        let mut blocks = HashMap::new();
        for shard in self.live.iter() {
            let live = shard.0.lock();
            blocks.extend(live.slots.iter().flatten().filter_map(|e| Some((e.block?, live_allocation(e)))));
        }
        blocks
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Records an allocation; returns the handle its free is recorded with. O(1) (amortised), one mutex (the
    /// calling thread's shard); the
    /// ring and trace only when on.
    #[inline]
    pub(crate) fn on_alloc(&self, event: &AllocEvent<'_>) -> u64 {
        if !self.live_table && self.trace.is_none() && !self.is_enabled() {
            return NOT_ENTERED;
        }
        let entry = LiveEntry {
            id: 0,
            device: event.device,
            pool: event.pool,
            api: event.api,
            bytes: event.bytes,
            stream: event.stream,
            label: event.label.map(Box::from),
            location: event.location,
            block: event.block_key.zip(event.pool_handle.map(pool_address)).map(|(key, addr)| (addr, key)),
        };
        let shard = live_shard();
        let (slot, id) = {
            let mut live = self.live[shard as usize].0.lock();
            live.next_id += 1;
            // Unique over the shards, and in allocation order within each.
            let id = live.next_id * LIVE_SHARDS + shard;
            let entry = Some(LiveEntry { id, ..entry });
            let slot = match live.vacant.pop() {
                Some(slot) => {
                    live.slots[slot as usize] = entry;
                    slot
                }
                None => {
                    live.slots.push(entry);
                    (live.slots.len() - 1) as u32
                }
            };
            (slot, id)
        };
        if let Some(trace) = &self.trace {
            if event.bytes > 0 {
                trace.alloc(id, event.bytes, event.stream.0);
            }
        }
        if self.is_enabled() {
            self.record_alloc(id, event);
        }
        u64::from(slot) * LIVE_SHARDS + shard
    }

    #[cold]
    fn record_alloc(&self, id: u64, event: &AllocEvent<'_>) {
        let segment = event.pool_handle.map(|pool| (pool_address(pool), pool.stats().reserved_bytes.current, pool));
        let mut ring = self.ring.lock();
        let time_ns = self.now_ns();
        if let Some((addr, reserved, pool)) = segment {
            let before = ring.reserved.insert(addr, reserved).unwrap_or(0);
            if before != reserved {
                ring.push(segment_event(time_ns, event.device, event.pool, pool.name(), before, reserved));
            }
        }
        ring.push(Event {
            kind: EventKind::Alloc,
            time_ns,
            id,
            device: event.device,
            pool: event.pool,
            api: event.api,
            bytes: event.bytes,
            stream: event.stream.0,
            label: event.label.map(str::to_string),
            call_site: Some(event.location.into()),
            pool_name: None,
            reserved_bytes: None,
        });
    }

    /// Records the free of the allocation `on_alloc` returned `slot` for. O(1), one mutex.
    #[inline]
    pub(crate) fn on_free(&self, handle: u64) {
        if handle == NOT_ENTERED {
            return;
        }
        let (slot, shard) = (handle / LIVE_SHARDS, handle % LIVE_SHARDS);
        let entry = {
            let mut live = self.live[shard as usize].0.lock();
            let entry = live.slots.get_mut(slot as usize).and_then(Option::take);
            if entry.is_some() {
                live.vacant.push(slot as u32);
            }
            entry
        };
        let Some(entry) = entry else { return };
        if let Some(trace) = &self.trace {
            if entry.bytes > 0 {
                trace.free(entry.id);
            }
        }
        if self.is_enabled() {
            self.record_free(entry);
        }
    }

    #[cold]
    fn record_free(&self, entry: LiveEntry) {
        let mut ring = self.ring.lock();
        let time_ns = self.now_ns();
        ring.push(Event {
            kind: EventKind::Free,
            time_ns,
            id: entry.id,
            device: entry.device,
            pool: entry.pool,
            api: entry.api,
            bytes: entry.bytes,
            stream: entry.stream.0,
            label: entry.label.map(String::from),
            call_site: Some(entry.location.into()),
            pool_name: None,
            reserved_bytes: None,
        });
    }

    /// Records a segment event for every pool whose reserved bytes changed since last seen (segments are
    /// otherwise seen at allocations only; this catches releases by cleanup and frees). Only when recording.
    pub(crate) fn observe_pools(&self, pools: &[(usize, PoolKind, Arc<dyn MemoryPool>)]) {
        if !self.is_enabled() {
            return;
        }
        let seen: Vec<_> = pools.iter().map(|(d, k, p)| (*d, *k, p, p.stats().reserved_bytes.current)).collect();
        let mut ring = self.ring.lock();
        let time_ns = self.now_ns();
        for (device, kind, pool, reserved) in seen {
            let before = ring.reserved.insert(pool_address(pool), reserved).unwrap_or(0);
            if before != reserved {
                ring.push(segment_event(time_ns, device, kind, pool.name(), before, reserved));
            }
        }
    }
}

fn segment_event(time_ns: u64, device: usize, pool: PoolKind, name: &str, before: u64, after: u64) -> Event {
    Event {
        kind: if after > before { EventKind::SegmentAlloc } else { EventKind::SegmentFree },
        time_ns,
        id: 0,
        device,
        pool,
        api: None,
        bytes: after.abs_diff(before),
        stream: 0,
        label: None,
        call_site: None,
        pool_name: Some(name.to_string()),
        reserved_bytes: Some(after),
    }
}

fn live_allocation(e: &LiveEntry) -> LiveAllocation {
    LiveAllocation {
        id: e.id,
        device: e.device,
        pool: e.pool,
        api: e.api,
        bytes: e.bytes,
        stream: e.stream.0,
        label: e.label.as_deref().map(str::to_string),
        call_site: e.location.into(),
    }
}

#[cfg(test)]
mod tests;
