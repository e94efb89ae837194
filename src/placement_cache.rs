//! The front door's fast path: what `allocate_universal` reuses from one buffer to the next, so that a buffer
//! like the last one costs a pool allocation and a few table lookups, with no placement decision, no device
//! query and no search of the device's pools.
//!
//! - **Placements** ([`Placed`]): a decision with the device and pool it chose and the shared parts a buffer
//!   needs (tracker, profiler), one `Arc` per buffer instead of four. Each thread keeps its own (a `Weak` in a
//!   thread-local table keyed by manager, placement, access pattern, selector and size class), so that the
//!   reference count a buffer takes lives on a cache line of its own thread, not one that every thread writes.
//!   The manager holds the strong references: when it is dropped, the thread tables' entries die with the last
//!   buffer that uses them, and no idle thread keeps a pool alive.
//! - **An epoch** ([`Epoch`]) that invalidates every thread's placements at once. It moves when what a decision
//!   depends on moved: a device's pressure state or its rank by free memory, or the usage evidence.
//! - **Device figures** (free memory, through driver calls) are refreshed by the thread that finds them older
//!   than [`UmmConfig::device_refresh`](crate::UmmConfig) (2 ms: a device filling up is noticed within a few
//!   milliseconds, and the driver calls cost nothing per buffer), checked every [`REFRESH_CHECK_EVERY`] allocations of a thread, by a cleanup
//!   round, after an allocation too big for a remembered placement (a sixteenth of the device's free memory
//!   or more), and after an allocation that ran out of memory; never on every allocation.

use crate::device::Device;
use crate::profiler::Profiler;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use umm_backends::MemoryPool;
use umm_placement::{AccessPattern, Api, Decision, DeviceSelector, Placement, SizeClass, UsageTracker};

/// Allocations of a thread between two looks at the clock (a look costs about as much as a cached allocation).
pub(crate) const REFRESH_CHECK_EVERY: u32 = 8;
/// Placements one thread keeps: a program allocates a handful of kinds of buffers.
const THREAD_ENTRIES: usize = 32;
/// A cached placement serves requests up to this fraction of the chosen device's free memory (when known):
/// bigger ones are decided afresh, since free memory may no longer hold them.
pub(crate) const CACHED_SHARE_OF_FREE: u64 = 16;

/// A decision and everything a buffer placed by it shares with its siblings.
pub(crate) struct Placed {
    pub(crate) decision: Decision,
    pub(crate) device: Arc<Device>,
    /// The pool the decision names (`None` only for a zero-size placement whose pool could not be made).
    pub(crate) pool: Option<Arc<dyn MemoryPool>>,
    /// The API the request's selector pinned, if any.
    pub(crate) api: Option<Api>,
    pub(crate) tracker: Arc<UsageTracker>,
    pub(crate) profiler: Arc<Profiler>,
    /// Whether the decision chose among several accelerators: then a pool's growth under it moves the figures
    /// the next choice is made on ([`crate::figures`]).
    pub(crate) balanced: bool,
}

/// What a placement is reused for: requests that differ only in size within one size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Key {
    pub(crate) manager: u64,
    pub(crate) placement: Placement,
    pub(crate) access: AccessPattern,
    pub(crate) selector: DeviceSelector,
    pub(crate) class: SizeClass,
}

/// The manager's placement generation: placements made under an older one are not reused.
#[derive(Debug, Default)]
pub(crate) struct Epoch(AtomicU64);

impl Epoch {
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    pub(crate) fn advance(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

struct Entry {
    key: Key,
    epoch: u64,
    /// The largest request this placement serves.
    max_bytes: u64,
    /// Bytes this thread may still place with it ([`crate::figures::spread_budget`]; `u64::MAX` where the
    /// decision had no other device to choose).
    budget: u64,
    placed: Weak<Placed>,
}

#[derive(Default)]
struct ThreadTable {
    entries: Vec<Entry>,
    allocations: u32,
}

thread_local! {
    static TABLE: RefCell<ThreadTable> = RefCell::new(ThreadTable::default());
}

/// The calling thread's placement for `key` made under `epoch`, if it serves `bytes` and its budget holds them
/// (which it then spends). O(entries).
#[inline]
pub(crate) fn lookup(key: &Key, epoch: u64, bytes: u64) -> Option<Arc<Placed>> {
    TABLE
        .try_with(|table| {
            let mut table = table.borrow_mut();
            let entry = table.entries.iter_mut().find(|e| e.key == *key)?;
            if entry.epoch != epoch || bytes > entry.max_bytes || bytes > entry.budget {
                return None;
            }
            let placed = entry.placed.upgrade()?;
            entry.budget -= bytes;
            Some(placed)
        })
        .ok()
        .flatten()
}

/// Remembers `placed` as the calling thread's placement for `key` under `epoch`, for requests up to
/// `max_bytes` and `budget` bytes in all. Returns the placement it replaced, if any, so that its manager can let
/// go of it.
pub(crate) fn remember(
    key: Key,
    epoch: u64,
    max_bytes: u64,
    budget: u64,
    placed: &Arc<Placed>,
) -> Option<Weak<Placed>> {
    TABLE
        .try_with(|table| {
            let mut table = table.borrow_mut();
            let entry = Entry { key, epoch, max_bytes, budget, placed: Arc::downgrade(placed) };
            if let Some(old) = table.entries.iter_mut().find(|e| e.key == key) {
                return Some(std::mem::replace(old, entry).placed);
            }
            // Entries whose manager is gone (nothing left to upgrade) go first, then the oldest.
            table.entries.retain(|e| e.placed.strong_count() > 0);
            let evicted = (table.entries.len() >= THREAD_ENTRIES).then(|| table.entries.remove(0).placed);
            table.entries.push(entry);
            evicted
        })
        .ok()
        .flatten()
}

/// Counts an allocation of the calling thread; true every [`REFRESH_CHECK_EVERY`]th, when the caller should
/// see whether the device figures are due for a refresh.
#[inline]
pub(crate) fn tick() -> bool {
    TABLE
        .try_with(|table| {
            let mut table = table.borrow_mut();
            table.allocations = table.allocations.wrapping_add(1);
            table.allocations.is_multiple_of(REFRESH_CHECK_EVERY)
        })
        .unwrap_or(false)
}
