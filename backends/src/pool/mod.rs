//! `Pool<B>`: the segment-block engine plus segments from a backend, caching, limits and statistics. Every
//! backend's pools are this type; a backend only creates and destroys segments and moves bytes.
//!
//! Segment policy (PyTorch's, which its users know): requests up to 1 MiB share 2 MiB small segments; larger
//! requests share 20 MiB segments when under 10 MiB and get a segment of their own (rounded to the backend's
//! granularity) above that. Where the backend supports virtual memory, large blocks instead go into one big
//! address reservation whose pages are mapped on first use and unmapped under pressure, so free holes between
//! live blocks cost no physical memory once trimmed. Unmapped pages are withheld from the engine's free index
//! (see [`crate::engine`]), so a block from the index is always backed and allocation never checks pages; only
//! a miss maps, choosing the withheld range that needs the fewest new pages.
//!
//! Blocks freed on a stream go back to that stream's free index and are reused at once on it; each stream has
//! its own arenas, so a block is never handed to another stream while work queued before its free may still
//! touch it.
//!
//! Small blocks go through per-thread caches ([`thread_cache`]): a thread allocates from and frees into a cache
//! slot of its own without the pool's lock, and the slots trade batches with the pool. The pool's lock guards
//! the engine and its books; what still takes it is large blocks, misses, and cleanup.

mod config;
mod quick;
mod streams;
mod thread_cache;

pub use config::{parse_size, Limit, PoolConfig, SegmentMode, Strategy};

use crate::backend::PoolAccess;
use crate::engine::{Allocation, Engine, Restore, SegmentId};
use crate::lock::{LeanGuard, LeanMutex};
use crate::{Backend, BlockHandle, Error, HostPtr, PoolStats, Result, StreamId};
use quick::{QuickBlock, QuickCache};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};
use streams::StreamArenas;
use thread_cache::{DrainOnExit, Returned, ThreadCache, ThreadSlot};

pub(crate) use thread_cache::Lent;

/// The page size of virtual reservations in a pool without a limit, unless its configuration names one. Creating
/// and mapping a physical allocation costs about the same whatever its size (on an H100, 2 MiB and 32 MiB pages
/// both about 20 µs: a cold pass of a GPT-2 training step's trace took 21-33 µs per op with 2 MiB pages and
/// 1.4-1.6 with 32 MiB), while larger pages leave more of the pages at the ends of live blocks unused (reserved
/// over live +0-5% on the shared traces). Under a limit the device's own page stays: there pages are given back to
/// fit, and coarse pages would fail requests that fine ones serve.
pub const DEFAULT_PAGE_UNLIMITED: u64 = 32 << 20;

/// The next pool's number (64 bits: never reused in a process's life).
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// Bits of a handle's arena number that index the arena inside its pool (the rest is the pool's number): two
/// arenas (small and large) per stream, so 32,768 streams per pool.
pub(crate) const ARENA_BITS: u32 = 16;

/// Byte written over freed blocks when `poison_on_free` is on: all ones is NaN in f32/f64 and -1 in integers.
pub const POISON_BYTE: u8 = 0xFF;

/// One block in a [`PoolSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockSnapshot {
    /// Offset inside the segment.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// Whether the block is free (cached).
    pub free: bool,
    /// [`BlockHandle::key`] of a live block, to join with side tables (labels, call sites).
    pub key: Option<u64>,
}

/// One segment in a [`PoolSnapshot`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SegmentSnapshot {
    /// The stream whose arena holds it.
    pub stream: StreamId,
    /// `"small"` or `"large"` arena.
    pub class: &'static str,
    /// Segment index inside its arena.
    pub index: u32,
    /// Size in bytes (address space for a virtual reservation).
    pub size: u64,
    /// Whether it is a virtual reservation.
    pub virtual_reservation: bool,
    /// Physical bytes behind it (the size for a plain segment; mapped pages for a reservation).
    pub physical_bytes: u64,
    /// Its blocks in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// Every segment of a pool with its blocks, and the pool's statistics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolSnapshot {
    /// Pool name.
    pub name: String,
    /// Segments.
    pub segments: Vec<SegmentSnapshot>,
    /// Statistics at the same moment.
    pub stats: PoolStats,
}

/// What a release of cached memory gave back to the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TrimReport {
    /// Bytes of physical memory given back.
    pub bytes_released: u64,
    /// Plain segments destroyed (and empty virtual reservations released).
    pub segments_released: u64,
    /// Pages unmapped inside virtual reservations.
    pub pages_unmapped: u64,
    /// Time the release took.
    #[serde(with = "duration_us")]
    pub elapsed: Duration,
}

mod duration_us {
    pub fn serialize<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros() as u64)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArenaClass {
    Small,
    Large,
}

struct SegmentEntry<S> {
    handle: S,
    /// `Some` for a virtual reservation: its mapped bytes (everything its engine segment does not withhold).
    mapped: Option<u64>,
    /// Cleanup round in which a block was last taken from this segment.
    last_used_round: u64,
    /// The pool's allocation count (hits and misses) when a block was last taken from this segment.
    last_used_alloc: u64,
}

/// One free index: the blocks of one stream and one size class.
struct Arena<S> {
    /// The stream it serves.
    stream: StreamId,
    engine: Engine,
    class: ArenaClass,
    virtual_segments: bool,
    segments: Vec<Option<SegmentEntry<S>>>,
    quick: QuickCache,
}

impl<S> Arena<S> {
    fn entry(&self, id: SegmentId) -> Option<&SegmentEntry<S>> {
        self.segments.get(id.0 as usize).and_then(Option::as_ref)
    }
}

struct State<S> {
    /// See [`Pool::arena_base`].
    arena_base: u64,
    arenas: Vec<Arena<S>>,
    /// Stream → arena indices `[small, large]`.
    streams: StreamArenas,
    stats: PoolStats,
    plain_bytes: u64,
    mapped_bytes: u64,
    /// Bytes of entirely free plain segments (cached, not split).
    empty_plain_bytes: u64,
    cleanup_round: u64,
    /// The highest reserved figure since the last full release: up to it the allocation path takes memory
    /// without trimming for `mapped_slack` or `segment_slack` (see [`Pool::trim_budget`]).
    reserved_high_water: u64,
}

/// Why an attempt to allocate needs more memory than the pool may take.
enum Shortfall {
    Limit,
    Device(Error),
}

impl Shortfall {
    /// Whether releasing cached memory may cure it: not a request too large for the device, a configuration the
    /// backend refuses, or a lost device, which are reported as they are.
    fn memory_may_cure(&self) -> bool {
        !matches!(self, Shortfall::Device(Error::TooLarge { .. } | Error::InvalidConfig(_) | Error::DeviceLost { .. }))
    }
}

/// One thread cache slot, alone on its cache lines so that threads working in their own slots do not share
/// lines.
#[repr(align(128))]
struct Slot {
    cache: LeanMutex<ThreadCache>,
    /// Set whenever the cache's statistics change, cleared when they are folded into the pool's: a pool
    /// operation of the slot's thread folds them first only when set, so that a thread working with blocks too
    /// large to cache does not take its slot's lock at all.
    dirty: AtomicBool,
    /// Whether the slot caches large blocks: set once its thread found the pool's lock taken, cleared by a
    /// cleanup.
    large: AtomicBool,
}

impl Slot {
    /// The cache, locked.
    #[inline(always)]
    fn lock(&self) -> LeanGuard<'_, ThreadCache> {
        self.cache.lock()
    }

    #[inline(always)]
    fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Relaxed)
    }

    /// Folds the locked `cache` into `state`'s statistics.
    #[inline(always)]
    fn fold(&self, cache: &mut ThreadCache, stats: &mut PoolStats) {
        cache.fold_into(stats);
        self.dirty.store(false, Ordering::Relaxed);
    }
}

/// What the pool's threads share: the engine's state behind the pool's lock, and the thread cache slots, each
/// behind its own (see [`thread_cache`] for the lock order). Held in an `Arc` so that a thread's exit can
/// drain its slot into a pool that still lives.
struct Shared<S> {
    state: LeanMutex<State<S>>,
    /// A power of two in number (a mask picks a thread's slot); empty when thread caches are off.
    slots: Box<[Slot]>,
}

/// A pool of blocks of one backend. `Send + Sync`: one lock guards the engine, small blocks go through
/// per-thread caches with locks of their own, and backend copies of device memory run outside both.
pub struct Pool<B: Backend> {
    backend: B,
    config: PoolConfig,
    page_size: Option<u64>,
    max_reservation: u64,
    /// The largest block the pool hands out: the device's capacity on virtual reservations (every page of a
    /// block is mapped), the backend's largest segment otherwise.
    max_block: u64,
    /// The arena number of this pool's first arena: the pool's number, unique in the process, above
    /// [`ARENA_BITS`]. Handles carry `arena_base + index`, and a handle whose number is outside this pool's range
    /// (another pool's, even with the same block ids) is refused by the same bounds check that finds its arena.
    arena_base: u64,
    /// The largest small and large blocks thread caches keep (0: none of that class).
    cached_small_max: u64,
    cached_large_max: u64,
    shared: Arc<Shared<B::Segment>>,
}

/// Thread cache slots per pool: twice the cores (at least 4, at most 256), a power of two, so that the live
/// threads of a process that runs about one per core each get a slot of their own.
fn slot_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(4, usize::from);
        (2 * cores).clamp(4, 256).next_power_of_two()
    })
}

impl<B: Backend> Pool<B> {
    /// A pool over `backend`. O(1).
    ///
    /// Errors on an invalid configuration, or `SegmentMode::Virtual` on a backend without virtual memory.
    pub fn new(mut backend: B, config: PoolConfig) -> Result<Self> {
        config.validate()?;
        let align = backend.alignment();
        let granularity = backend.segment_granularity();
        if !align.is_power_of_two() || !granularity.is_power_of_two() || granularity < align {
            return Err(Error::InvalidConfig(format!(
                "backend {} reports alignment {align} and granularity {granularity}: both must be powers of two \
                 and granularity at least the alignment",
                backend.name()
            )));
        }
        let mut vm = backend.virtual_memory();
        let use_virtual = match config.segment_mode {
            SegmentMode::Plain => false,
            SegmentMode::Auto => vm.is_some(),
            SegmentMode::Virtual if vm.is_none() => {
                return Err(Error::InvalidConfig(format!(
                    "segment_mode virtual asked for, but {} has no virtual memory support",
                    backend.name()
                )))
            }
            SegmentMode::Virtual => true,
        } && config.strategy == Strategy::Pooled;
        // Without a limit, pages of DEFAULT_PAGE_UNLIMITED unless asked otherwise (see there).
        let page = config.page_size.or(match (vm, config.limit) {
            (Some(native), None) if native.page_size < DEFAULT_PAGE_UNLIMITED => Some(DEFAULT_PAGE_UNLIMITED),
            _ => None,
        });
        if let (Some(native), Some(page), true) = (vm, page, use_virtual) {
            if page < native.page_size {
                return Err(Error::InvalidConfig(format!(
                    "page_size {page} is below the {}-byte pages {} maps",
                    native.page_size,
                    backend.name()
                )));
            }
            if page != native.page_size {
                backend.set_page_size(page)?;
                vm = backend.virtual_memory();
            }
        }
        let (page_size, max_reservation) = match vm {
            Some(vm) if use_virtual && !vm.page_size.is_power_of_two() => {
                return Err(Error::InvalidConfig(format!(
                    "{} maps pages of {} bytes: virtual memory needs a power of two",
                    backend.name(),
                    vm.page_size
                )))
            }
            Some(vm) if use_virtual => (Some(vm.page_size), vm.max_reservation),
            _ => (None, 0),
        };
        let max_block = if page_size.is_some() { backend.capacity() } else { backend.max_segment_size() };
        let limit = config.limit.map(|l| l.resolve(backend.capacity())).transpose()?;
        let stats = PoolStats { name: backend.name().to_string(), limit_bytes: limit, ..PoolStats::default() };
        let number = NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed);
        if number >= 1 << (64 - ARENA_BITS) {
            return Err(Error::InvalidConfig("this process has created 2^48 pools; no pool numbers are left".into()));
        }
        let arena_base = number << ARENA_BITS;
        let pooled = config.strategy == Strategy::Pooled;
        let cached_small_max = if pooled && config.thread_cache_bytes > 0 { config.small_request_max } else { 0 };
        let cached_large_max = if pooled { config.thread_cache_large_bytes / 16 } else { 0 };
        let slots = if cached_small_max > 0 || cached_large_max > 0 { slot_count() } else { 0 };
        let state = LeanMutex::new(State {
            arena_base,
            arenas: Vec::new(),
            streams: StreamArenas::default(),
            stats,
            plain_bytes: 0,
            mapped_bytes: 0,
            empty_plain_bytes: 0,
            cleanup_round: 0,
            reserved_high_water: 0,
        });
        let slots = (0..slots)
            .map(|_| Slot {
                cache: LeanMutex::new(ThreadCache::default()),
                dirty: AtomicBool::new(false),
                large: AtomicBool::new(false),
            })
            .collect();
        Ok(Self {
            backend,
            config,
            page_size,
            max_reservation,
            max_block,
            arena_base,
            cached_small_max,
            cached_large_max,
            shared: Arc::new(Shared { state, slots }),
        })
    }

    /// The lock over the engine and the pool's books.
    #[inline(always)]
    fn state(&self) -> &LeanMutex<State<B::Segment>> {
        &self.shared.state
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Whether large blocks live in virtual reservations.
    pub fn uses_virtual_memory(&self) -> bool {
        self.page_size.is_some()
    }

    /// Sets or clears the cap on reserved bytes. Takes effect at the next allocation that needs memory.
    pub fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        let bytes = limit.map(|l| l.resolve(self.backend.capacity())).transpose()?;
        // Read under the state lock wherever it is enforced, so it lives in the statistics only.
        self.state().lock().stats.limit_bytes = bytes;
        Ok(())
    }

    /// Allocates a block of at least `bytes` bytes on `stream`, reusing cached memory first. O(1) when served
    /// from cache; otherwise one backend call (plus a release of cached memory and a retry when the limit or the
    /// device is exhausted).
    #[inline(always)]
    pub fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        if self.config.zero_on_alloc {
            return self.allocate_inner(bytes, stream, true);
        }
        self.allocate_any(bytes, stream)
    }

    /// The allocation itself: a small block from the calling thread's cache when it holds one (no pool lock),
    /// else through the pool.
    #[inline(always)]
    fn allocate_any(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let Some((index, thread)) = self.thread_slot() else {
            return self.allocate_uncached(bytes, stream);
        };
        let slot = &self.shared.slots[index as usize];
        let size = self.rounded(bytes);
        let Some(large) = self.cached_class(slot, bytes, size) else {
            return self.allocate_uncached_from(slot, bytes, stream);
        };
        let mut cache = slot.lock();
        if let Some((arena, block, lent)) = cache.take(stream, large, size, bytes, index) {
            slot.dirty.store(true, Ordering::Relaxed);
            return Ok(self.lent_handle(arena, block, bytes, lent));
        }
        self.allocate_through_pool(cache, index, thread, bytes, size, large, stream)
    }

    /// An allocation the calling thread's cache (`slot`) does not serve: straight to the pool. Inlined, as
    /// [`Pool::free_through_pool`] is: one call fewer on every large allocate+free pair.
    #[inline(always)]
    fn allocate_uncached_from(&self, slot: &Slot, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let mut state = self.lock_state_folding(slot);
        self.allocate_locked(&mut state, bytes, stream)
    }

    /// `bytes` rounded up to the backend's alignment (wrapping: an overflow is caught where it matters, as a size
    /// below the request).
    #[inline(always)]
    fn rounded(&self, bytes: u64) -> u64 {
        let align = self.backend.alignment();
        bytes.wrapping_add(align - 1) & !(align - 1)
    }

    /// For a request of `bytes` (`size` rounded) that `cache` serves, whether it is large; `None` for one it
    /// does not (too large to keep, a large one while the thread has not met contention, or invalid).
    #[inline(always)]
    fn cached_class(&self, slot: &Slot, bytes: u64, size: u64) -> Option<bool> {
        if bytes == 0 || size < bytes || size > self.max_block {
            None
        } else if size <= self.config.small_request_max {
            (size <= self.cached_small_max).then_some(false)
        } else {
            (size <= self.cached_large_max && slot.large.load(Ordering::Relaxed)).then_some(true)
        }
    }

    /// The pool's lock, taken by the thread of `slot`. A thread that finds it held starts caching large blocks
    /// too: large blocks are cached only where threads contend, since a cached large block is memory that no
    /// other request can be cut from, and a thread working alone gains nothing from it.
    #[inline(always)]
    fn lock_state_from(&self, slot: &Slot) -> LeanGuard<'_, State<B::Segment>> {
        if let Some(state) = self.state().try_lock() {
            return state;
        }
        if self.cached_large_max > 0 {
            slot.large.store(true, Ordering::Relaxed);
        }
        self.state().lock()
    }

    /// The pool's lock for an operation of `slot`'s thread that does not go through its cache, with the slot's
    /// statistics folded first when they changed, so that a thread working alone keeps the books exact; a slot
    /// with nothing to fold is not locked at all.
    #[inline(always)]
    fn lock_state_folding(&self, slot: &Slot) -> LeanGuard<'_, State<B::Segment>> {
        if !slot.is_dirty() {
            return self.lock_state_from(slot);
        }
        let mut cache = slot.lock();
        let mut state = self.lock_state_from(slot);
        slot.fold(&mut cache, &mut state.stats);
        state
    }

    /// An allocation without thread caches (off, or the thread is exiting): straight through the pool. Kept out
    /// of line so that the cached path stays small.
    #[inline(never)]
    fn allocate_uncached(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let mut state = self.state().lock();
        self.allocate_locked(&mut state, bytes, stream)
    }

    /// The calling thread's cache slot (and its thread record); `None` when thread caches are off or the
    /// thread is exiting.
    #[inline(always)]
    fn thread_slot(&self) -> Option<(u32, ThreadSlot)> {
        let slots = self.shared.slots.len();
        if slots == 0 {
            return None;
        }
        let thread = thread_cache::this_thread()?;
        Some((thread.number & (slots as u32 - 1), thread))
    }

    /// The handle of a block lent from a thread cache.
    #[inline(always)]
    fn lent_handle(&self, arena: u32, block: QuickBlock, requested: u64, lent: Lent) -> BlockHandle {
        BlockHandle {
            arena: self.arena_base + u64::from(arena),
            segment: block.segment,
            block: block.block,
            offset: block.offset,
            size: block.size,
            requested,
            lent: Some(lent),
        }
    }

    /// A miss of the thread's cache for a block of its classes (`size` rounded, `large` or small), under the
    /// pool's lock: a block from the pool's cached blocks (for a small one, then from this slot's own,
    /// coalesced), else new memory, lent from the slot. Folds the slot's statistics first, so that a thread
    /// working alone keeps the pool's books exact at every pool operation.
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn allocate_through_pool(
        &self,
        mut cache: LeanGuard<'_, ThreadCache>,
        slot: u32,
        thread: ThreadSlot,
        bytes: u64,
        size: u64,
        large: bool,
        stream: StreamId,
    ) -> Result<BlockHandle> {
        cache.register(thread, || self.exit_hook());
        let lender = &self.shared.slots[slot as usize];
        let mut state = self.lock_state_from(lender);
        lender.fold(&mut cache, &mut state.stats);
        let class = if large { ArenaClass::Large } else { ArenaClass::Small };
        let arena = self.arena_for(&mut state, stream, class)?;
        let (ceiling, max_bytes) = if large {
            (self.cached_large_max, self.config.thread_cache_large_bytes)
        } else {
            (self.cached_small_max, self.config.thread_cache_bytes)
        };
        if !cache.add_arena(arena as u32, stream, large, ceiling, max_bytes) {
            drop(cache);
            return self.allocate_locked(&mut state, bytes, stream);
        }
        let handle = match state.take_cached(arena, size) {
            Some(alloc) => state.record_alloc(arena, &alloc, bytes, true),
            None if !large => {
                // The pool has nothing cached that fits: coalesce this slot's small blocks before the pool grows,
                // so that thread caches never make the pool reserve more.
                cache.drain_arena(arena as u32, |r| state.take_back(r, true));
                self.allocate_locked(&mut state, bytes, stream)?
            }
            // Large blocks are cached only by threads that contend, for whom a cache emptied at every miss would
            // be no cache: the pool grows instead, by at most the cache's bound, and gets the blocks back when it
            // runs out of memory.
            None => match self.allocate_locked(&mut state, bytes, stream) {
                Err(Error::OutOfMemory { .. }) if cache.holds_any() => {
                    // This thread's own cached blocks were out of the pool's reach (its slot is held here): give
                    // them back and try once more. The failure just counted was not the last word.
                    state.stats.num_ooms -= 1;
                    cache.drain(|r| state.take_back(r, true));
                    self.allocate_locked(&mut state, bytes, stream)?
                }
                other => other?,
            },
        };
        // Lent from the slot: parked in the engine, so that only the slot's ticket frees it.
        let parked = state.arenas[arena].engine.park(handle.block).expect("allocated just now");
        let block = QuickBlock { block: parked, segment: handle.segment, offset: handle.offset, size: handle.size };
        let lent = cache.adopt(arena as u32, block, slot);
        Ok(BlockHandle { block: parked, lent: Some(lent), ..handle })
    }

    /// What a thread's exit drains its slot into.
    fn exit_hook(&self) -> Weak<dyn DrainOnExit> {
        Arc::downgrade(&self.shared) as Weak<dyn DrainOnExit>
    }

    /// Hands every slot's free blocks and statistics to the pool: one slot at a time, each under its own lock
    /// and then the pool's.
    /// `cleanup`: also stop caching large blocks until the slot's thread meets contention again (a program
    /// whose threads stopped contending keeps none cached).
    fn drain_thread_caches(&self, cleanup: bool) {
        for slot in self.shared.slots.iter() {
            let mut cache = slot.lock();
            if cleanup {
                slot.large.store(false, Ordering::Relaxed);
            }
            if !cache.is_idle() {
                self.state().lock().absorb(slot, &mut cache);
            }
        }
    }

    /// Folds every slot's statistics into the pool's and returns the state, locked: the slots are locked in
    /// order first, then the pool.
    fn folded_state(&self) -> LeanGuard<'_, State<B::Segment>> {
        let mut caches: Vec<_> = self.shared.slots.iter().map(|slot| slot.lock()).collect();
        let mut state = self.state().lock();
        for (slot, cache) in self.shared.slots.iter().zip(&mut caches) {
            slot.fold(cache, &mut state.stats);
        }
        state
    }

    /// Like [`Pool::allocate`], with every byte of the block set to zero before it is returned.
    pub fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.allocate_inner(bytes, stream, true)
    }

    fn allocate_inner(&self, bytes: u64, stream: StreamId, zeroed: bool) -> Result<BlockHandle> {
        let handle = self.allocate_any(bytes, stream)?;
        if zeroed {
            if let Err(e) = self.fill(&handle, 0, handle.size, 0) {
                let _ = self.free(&handle);
                return Err(e);
            }
        }
        Ok(handle)
    }

    /// Allocates one block per entry of `sizes` on `stream` under a single lock: all of them, or none (on an
    /// error the blocks already taken go back). Zeroed when the pool zeroes every allocation. O(len) when served
    /// from cache.
    pub fn allocate_batch(&self, sizes: &[u64], stream: StreamId) -> Result<Vec<BlockHandle>> {
        let mut blocks = Vec::with_capacity(sizes.len());
        {
            let mut state = self.state().lock();
            for &bytes in sizes {
                match self.allocate_locked(&mut state, bytes, stream) {
                    Ok(block) => blocks.push(block),
                    Err(e) => {
                        drop(state);
                        for block in &blocks {
                            let _ = self.free(block);
                        }
                        return Err(e);
                    }
                }
            }
        }
        if self.config.zero_on_alloc {
            for block in &blocks {
                if let Err(e) = self.fill(block, 0, block.size, 0) {
                    for block in &blocks {
                        let _ = self.free(block);
                    }
                    return Err(e);
                }
            }
        }
        Ok(blocks)
    }

    /// The allocation itself, with the lock held: validate, pick the arena, take a cached block (inline: the
    /// common case), else go the slow way (new memory, retry, errors). O(1) on a hit.
    #[inline(always)]
    fn allocate_locked(&self, state: &mut State<B::Segment>, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        let size = self.rounded(bytes);
        // Zero, overflow while rounding, and sizes past the backend's maximum all land in the slow path.
        if bytes == 0 || size < bytes || size > self.max_block || self.config.strategy != Strategy::Pooled {
            return self.allocate_slow(state, bytes, stream, false);
        }
        let Some(arena) = state.arena_of(stream, self.class_of(size)) else {
            return self.allocate_slow(state, bytes, stream, false);
        };
        let alloc = match state.take_cached(arena, size) {
            Some(alloc) => alloc,
            None if state.arenas[arena].virtual_segments => return self.remap(state, arena, bytes, size),
            None => return self.allocate_slow(state, bytes, stream, true),
        };
        Ok(state.record_alloc(arena, &alloc, bytes, true))
    }

    /// A miss in a virtual arena, straight to mapping withheld pages: the common miss under memory pressure,
    /// spared the slow path's validation and cache checks (a large arena has no quick blocks). When no withheld
    /// range fits it grows, and on a shortfall (the limit, a device error) it releases cached memory and tries
    /// again, as the slow path does after the same steps.
    #[cold]
    #[inline(never)]
    fn remap(&self, state: &mut State<B::Segment>, arena: usize, bytes: u64, size: u64) -> Result<BlockHandle> {
        debug_assert!(state.arenas[arena].quick.is_empty(), "virtual arenas cache no quick blocks");
        let result = match self.map_withheld(state, arena, size) {
            Ok(Some(alloc)) => return Ok(state.record_alloc(arena, &alloc, bytes, false)),
            Ok(None) => self.grow(state, arena, size).map(|alloc| (alloc, false)),
            Err(shortfall) => Err(shortfall),
        };
        self.retry_on_shortfall(state, arena, bytes, size, result)
    }

    /// The arena class of a request of `size` (rounded) bytes: small requests share small segments, except in the
    /// `direct` strategy, which caches nothing.
    #[inline(always)]
    fn class_of(&self, size: u64) -> ArenaClass {
        if size <= self.config.small_request_max && self.config.strategy == Strategy::Pooled {
            ArenaClass::Small
        } else {
            ArenaClass::Large
        }
    }

    /// Everything [`Pool::allocate_locked`] does not do inline: validation errors, the first use of a stream,
    /// draining the quick cache, mapping or growing, releasing cached memory and retrying once on a shortfall.
    /// `cache_missed`: the inline path already looked for a quick block and a free block, and found none.
    #[cold]
    #[inline(never)]
    fn allocate_slow(
        &self,
        state: &mut State<B::Segment>,
        bytes: u64,
        stream: StreamId,
        cache_missed: bool,
    ) -> Result<BlockHandle> {
        if bytes == 0 {
            return Err(Error::ZeroSize { device: self.backend.name().to_string() });
        }
        let align = self.backend.alignment();
        let size = bytes
            .checked_add(align - 1)
            .map(|s| s & !(align - 1))
            .ok_or_else(|| Error::SizeOverflow { what: format!("{bytes} bytes rounded up to {align}") })?;
        let max = self.max_block;
        if size > max {
            return Err(Error::TooLarge { device: self.backend.name().to_string(), requested: size, max });
        }
        let arena = self.arena_for(state, stream, self.class_of(size))?;
        let result = self.try_allocate(state, arena, size, cache_missed);
        self.retry_on_shortfall(state, arena, bytes, size, result)
    }

    /// Records the outcome of a first attempt, or, on a shortfall, releases cached memory and tries once more
    /// (then reports out of memory).
    fn retry_on_shortfall(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        bytes: u64,
        size: u64,
        mut result: std::result::Result<(Allocation, bool), Shortfall>,
    ) -> Result<BlockHandle> {
        if matches!(&result, Err(shortfall) if shortfall.memory_may_cure()) {
            state.stats.num_alloc_retries += 1;
            self.release_cached_locked(state, 0, size);
            result = self.try_allocate(state, arena, size, false);
        }
        match result {
            Ok((alloc, hit)) => Ok(state.record_alloc(arena, &alloc, bytes, hit)),
            Err(shortfall) => Err(self.out_of_memory(state, size, shortfall)),
        }
    }

    /// The arena of `stream` for `class`, created on the stream's first use. O(1). Errors when
    /// the pool already serves 32,768 streams (see [`ARENA_BITS`]).
    fn arena_for(&self, state: &mut State<B::Segment>, stream: StreamId, class: ArenaClass) -> Result<usize> {
        if let Some(arena) = state.arena_of(stream, class) {
            return Ok(arena);
        }
        if state.arenas.len() + 2 > 1 << ARENA_BITS {
            return Err(Error::InvalidConfig(format!(
                "pool {} serves {} streams already, the most one pool can",
                self.backend.name(),
                state.streams.len()
            )));
        }
        let slot = usize::from(class == ArenaClass::Large);
        let first = state.arenas.len() as u32;
        for class in [ArenaClass::Small, ArenaClass::Large] {
            state.arenas.push(Arena {
                stream,
                engine: Engine::new(self.backend.alignment()).expect("alignment checked in Pool::new"),
                class,
                virtual_segments: class == ArenaClass::Large && self.page_size.is_some(),
                segments: Vec::new(),
                quick: match class {
                    ArenaClass::Small => QuickCache::new(self.config.small_request_max),
                    ArenaClass::Large => QuickCache::disabled(),
                },
            });
        }
        state.streams.insert(stream, [first, first + 1]);
        Ok(first as usize + slot)
    }

    /// One attempt: a cached block, else new memory within the limit. Returns the block and whether it was a
    /// cache hit. `cache_missed`: the caller just found no quick block of the request's class and no free block
    /// in the engine (with the lock held since), so those two lookups are not repeated.
    fn try_allocate(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
        cache_missed: bool,
    ) -> std::result::Result<(Allocation, bool), Shortfall> {
        if self.config.strategy == Strategy::Pooled {
            let a = &mut state.arenas[arena];
            if !cache_missed {
                if let Some(q) = a.quick.pop(size) {
                    // Its pages stayed mapped: the cache is drained before any trim.
                    let block = a.engine.unpark(q.block).expect("quick blocks are parked");
                    let alloc = Allocation {
                        block,
                        segment: q.segment,
                        offset: q.offset,
                        size: q.size,
                        segment_was_empty: false,
                    };
                    return Ok((alloc, true));
                }
            }
            let a = &mut state.arenas[arena];
            let mut found = if cache_missed { None } else { a.engine.allocate(size) };
            if found.is_none() {
                // A larger quick block serves the request once it is back in the engine; failing that, coalesce
                // all of them before asking the device for more.
                if let Some(q) = a.quick.pop_larger(size) {
                    let freed = a.engine.free(q.block).expect("quick blocks are parked");
                    state.note_engine_free(arena, freed.segment, freed.segment_now_empty);
                    found = state.arenas[arena].engine.allocate(size);
                }
                if found.is_none() && !state.arenas[arena].quick.is_empty() {
                    state.arenas[arena].quick.shrink();
                    state.drain_quick(arena);
                    found = state.arenas[arena].engine.allocate(size);
                }
            }
            if let Some(alloc) = found {
                return Ok((alloc, true));
            }
            if state.arenas[arena].virtual_segments {
                if let Some(alloc) = self.map_withheld(state, arena, size)? {
                    return Ok((alloc, false));
                }
            }
        }
        let alloc = self.grow(state, arena, size)?;
        Ok((alloc, false))
    }

    /// Adds a segment (or a virtual reservation) that fits `size` and allocates from it.
    fn grow(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> std::result::Result<Allocation, Shortfall> {
        let granularity = self.backend.segment_granularity();
        let round = |s: u64| s.div_ceil(granularity) * granularity;
        if state.arenas[arena].virtual_segments {
            let page = self.page_size.unwrap_or(granularity);
            let reservation = self.max_reservation.max(size.div_ceil(page) * page);
            state.stats.num_device_calls += 1;
            let handle = self.backend.reserve_virtual(reservation).map_err(Shortfall::Device)?;
            let entry =
                SegmentEntry { handle, mapped: Some(0), last_used_round: state.cleanup_round, last_used_alloc: 0 };
            state.add_segment(arena, reservation, entry, true);
            state.stats.segments.add(1);
            let alloc = self.map_withheld(state, arena, size)?.expect("a fresh reservation holds the request");
            return Ok(alloc);
        }
        let preferred = match state.arenas[arena].class {
            _ if self.config.strategy == Strategy::Direct => round(size),
            ArenaClass::Small => round(self.config.small_segment_size.max(size)),
            ArenaClass::Large if size < self.config.large_segment_size / 2 => round(self.config.large_segment_size),
            ArenaClass::Large => round(size),
        }
        // The largest segment the backend makes, rounded down to the granularity: a segment size must be one
        // the engine keeps as it is, or the pool would count other bytes than the engine hands out.
        .min(self.backend.max_segment_size() / granularity * granularity)
        .max(size);
        // Empty segments that would leave reserved memory above its `segment_slack` budget go first.
        let excess =
            (state.reserved() + preferred).saturating_sub(Self::trim_budget(state, self.config.segment_slack, size));
        if excess > 0 && state.empty_plain_bytes > 0 {
            self.release_least_recent_empty_segments(state, excess);
        }
        // Under a limit, fall back to a segment of just the request's size rather than fail.
        let limit = state.stats.limit_bytes;
        let fits = |s: u64| limit.is_none_or(|l| state.reserved() + s <= l);
        let seg_size = if fits(preferred) {
            preferred
        } else if fits(round(size)) {
            round(size)
        } else {
            return Err(Shortfall::Limit);
        };
        state.stats.num_device_calls += 1;
        let handle = self.backend.create_segment(seg_size).map_err(Shortfall::Device)?;
        state.stats.num_device_alloc += 1;
        let entry = SegmentEntry { handle, mapped: None, last_used_round: state.cleanup_round, last_used_alloc: 0 };
        let seg = state.add_segment(arena, seg_size, entry, false);
        state.plain_bytes += seg_size;
        state.empty_plain_bytes += seg_size;
        state.stats.segments.add(1);
        state.update_reserved();
        Ok(state.arenas[arena].engine.allocate_in(seg, size).expect("fresh segment fits"))
    }

    /// Destroys empty plain segments, least recently used first, until `want` bytes are released (or none is
    /// left). O(segments log segments): runs only on a miss that creates a segment, which costs a device call.
    fn release_least_recent_empty_segments(&self, state: &mut State<B::Segment>, want: u64) {
        let mut empty: Vec<(u64, usize, SegmentId)> = Vec::new();
        for (a, arena) in state.arenas.iter().enumerate().filter(|(_, arena)| !arena.virtual_segments) {
            for id in arena.engine.empty_segments() {
                empty.push((arena.entry(id).expect("segment exists").last_used_alloc, a, id));
            }
        }
        empty.sort_unstable_by_key(|&(last_used, _, _)| last_used);
        let mut released = 0;
        for (_, arena, id) in empty {
            if released >= want {
                break;
            }
            released += self.destroy_segment(state, arena, id);
        }
    }

    /// Serves `size` bytes from withheld (unmapped) space of the arena's reservations: restores the range that
    /// needs the fewest new pages, takes the block, gives back free mapped pages elsewhere when the mapping would
    /// push reserved memory past its budget, then maps. `Ok(None)` when no reservation has room.
    fn map_withheld(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> std::result::Result<Option<Allocation>, Shortfall> {
        let page = self.page_size.expect("virtual arenas exist only with virtual memory");
        let engine = &mut state.arenas[arena].engine;
        let Some(restore) = engine.find_withheld(size, page) else { return Ok(None) };
        // The block is taken before its pages are mapped, so the trim below cannot give them back.
        let alloc = engine.restore_and_allocate(&restore, size).expect("found just now");
        let missing = restore.len;
        // Give back free mapped pages elsewhere first when the mapping would pass the budget: the limit, and with
        // `mapped_slack` the live set's share. Trimming just the excess here, rather than failing and letting the
        // retry release cached memory the size of the whole request, keeps the other cached pages mapped.
        let limit = state.stats.limit_bytes;
        let budget = Self::trim_budget(state, self.config.mapped_slack, alloc.size).min(limit.unwrap_or(u64::MAX));
        let excess = (state.reserved() + missing).saturating_sub(budget).min(missing);
        if excess > 0 {
            let (round, mut trimmed) = (state.cleanup_round, 0);
            for a in 0..state.arenas.len() {
                if state.arenas[a].virtual_segments && trimmed < excess {
                    trimmed += self.unmap_free_pages(state, a, round, 0, excess - trimmed).1;
                }
            }
        }
        let result = if limit.is_some_and(|l| state.reserved() + missing > l) {
            Err(Shortfall::Limit)
        } else {
            state.stats.num_device_calls += 1;
            let entry = state.arenas[arena].segments[restore.segment.0 as usize].as_mut().expect("segment exists");
            self.backend.map_pages(&entry.handle, restore.offset, restore.len).map_err(Shortfall::Device).map(|()| {
                *entry.mapped.as_mut().expect("virtual segment") += restore.len;
                state.mapped_bytes += restore.len;
                state.stats.num_device_alloc += 1;
            })
        };
        state.update_reserved();
        // Pages the trim above unmapped and the mapping did not take back are freed now.
        self.backend.release_spare_pages();
        match result {
            Ok(()) => Ok(Some(alloc)),
            Err(shortfall) => {
                Self::undo_restore(&mut state.arenas[arena].engine, &alloc, &restore, page);
                Err(shortfall)
            }
        }
    }

    /// The reserved bytes above which the allocation path gives cached memory back before taking more from the
    /// device ([`Pool::map_withheld`] unmaps free pages with `mapped_slack`, [`Pool::grow`] destroys empty
    /// segments with `segment_slack`), for an allocation of `size` bytes being added: the larger of
    /// `(1 + slack) × allocated` and the pool's own high water mark of reserved memory (below it, a steady
    /// workload reuses memory it held before, and trimming there would only churn); without a slack, no budget.
    #[inline(always)]
    fn trim_budget(state: &State<B::Segment>, slack: Option<f64>, size: u64) -> u64 {
        let Some(slack) = slack else { return u64::MAX };
        let allocated_after = state.stats.allocated_bytes.current + size;
        ((allocated_after as f64 * (1.0 + slack)) as u64).max(state.reserved_high_water)
    }

    /// Gives back a block taken on withheld pages that could not be mapped, and withholds the pages again.
    fn undo_restore(engine: &mut Engine, alloc: &Allocation, restore: &Restore, page: u64) {
        engine.free(alloc.block).expect("the block was just taken");
        let withheld = engine.withhold_range(restore.segment, restore.offset, restore.len, page);
        debug_assert!(withheld, "the restored range is free again");
    }

    fn out_of_memory(&self, state: &mut State<B::Segment>, size: u64, shortfall: Shortfall) -> Error {
        state.stats.num_ooms += 1;
        if !shortfall.memory_may_cure() {
            let Shortfall::Device(e) = shortfall else { unreachable!("a limit is cured by memory") };
            return e;
        }
        let reserved = state.reserved();
        let allocated = state.stats.allocated_bytes.current;
        let cause = match shortfall {
            Shortfall::Device(e) => Some(e.to_string()),
            Shortfall::Limit => None,
        };
        Error::OutOfMemory {
            device: self.backend.name().to_string(),
            requested: size,
            free: self.backend.free_memory(),
            cached: reserved - allocated,
            reserved,
            limit: state.stats.limit_bytes,
            cause,
        }
    }

    /// Returns a block to the pool. O(1) (plus a backend call in `Direct` mode, and a device write when
    /// `poison_on_free` is on).
    ///
    /// Errors with [`Error::UnknownBlock`] for a block that this pool did not hand out (handles carry their pool's
    /// number) or that was already freed;
    /// nothing changes then. With `poison_on_free`, a device that fails to write the poison does not keep the
    /// block: it is freed all the same and its error returned (a backend that holds no bytes, such as the
    /// simulated device, is not poisoned at all).
    #[inline(always)]
    pub fn free(&self, block: &BlockHandle) -> Result<()> {
        if self.config.poison_on_free {
            return self.free_poisoned(block);
        }
        self.free_unpoisoned(block)
    }

    /// [`Pool::free`] with `poison_on_free`: the block is freed whether or not the poison could be written (an
    /// owned block's drop, which cannot try again, would otherwise leave it live for the pool's life).
    #[cold]
    #[inline(never)]
    fn free_poisoned(&self, block: &BlockHandle) -> Result<()> {
        match self.fill(block, 0, block.size, POISON_BYTE) {
            Ok(()) => self.free_unpoisoned(block),
            Err(e) if e.is_unknown_block() => Err(e),
            Err(e) if e.is_unsupported() => self.free_unpoisoned(block),
            Err(e) => {
                self.free_unpoisoned(block)?;
                Err(e)
            }
        }
    }

    #[inline(always)]
    fn free_unpoisoned(&self, block: &BlockHandle) -> Result<()> {
        if let Some(lent) = block.lent {
            return self.free_lent(block, lent);
        }
        self.free_through_pool(block)
    }

    /// Frees a block the pool handed out itself (not lent from a thread cache). Inlined (see
    /// [`Pool::allocate_uncached_from`]).
    #[inline(always)]
    fn free_through_pool(&self, block: &BlockHandle) -> Result<()> {
        let unknown = || self.unknown_block(block);
        let mut state = match self.thread_slot() {
            Some((index, _)) => self.lock_state_folding(&self.shared.slots[index as usize]),
            None => self.state().lock(),
        };
        // Another pool's arena numbers wrap to far beyond this pool's arenas.
        let arena = block.arena.wrapping_sub(state.arena_base) as usize;
        let a = state.arenas.get_mut(arena).ok_or_else(unknown)?;
        // Only small blocks go through the quick cache: they churn most, and live in 2 MiB segments where an
        // uncoalesced block cannot push a large request into new memory.
        let room = if self.config.strategy == Strategy::Pooled && a.class == ArenaClass::Small {
            a.quick.room_for(block.size)
        } else {
            None
        };
        if let Some(class) = room {
            let parked = a.engine.park(block.block).ok_or_else(unknown)?;
            a.quick.push(
                class,
                QuickBlock { block: parked, segment: block.segment, offset: block.offset, size: block.size },
            );
            state.record_free(block);
            return Ok(());
        }
        let freed = a.engine.free(block.block).ok_or_else(unknown)?;
        state.note_engine_free(arena, freed.segment, freed.segment_now_empty);
        state.record_free(block);
        if self.config.strategy == Strategy::Direct && freed.segment_now_empty {
            self.destroy_segment(&mut state, arena, freed.segment);
        }
        Ok(())
    }

    /// Frees a block lent from a thread cache back into that cache (whichever thread frees it); past the
    /// cache's bounds, a batch goes back to the pool under one lock acquisition.
    #[inline(always)]
    fn free_lent(&self, block: &BlockHandle, lent: Lent) -> Result<()> {
        let Some((slot, arena, freed)) = self.lender(block, lent) else {
            return Err(self.unknown_block(block));
        };
        let mut cache = slot.lock();
        match cache.give_back(lent, arena, freed, block.requested) {
            Ok(None) => {
                slot.dirty.store(true, Ordering::Relaxed);
                Ok(())
            }
            Ok(Some(overflow)) => {
                self.return_overflow(slot, cache, arena, overflow);
                Ok(())
            }
            Err(()) => Err(self.unknown_block(block)),
        }
    }

    /// A block that did not fit its thread cache goes back to the pool, with a batch of the cache's blocks.
    #[cold]
    #[inline(never)]
    fn return_overflow(&self, slot: &Slot, mut cache: LeanGuard<'_, ThreadCache>, arena: u32, overflow: Returned) {
        let mut state = self.state().lock();
        slot.fold(&mut cache, &mut state.stats);
        state.take_back(overflow, false);
        cache.trim_arena(arena, |r| state.take_back(r, false));
        state.update_split();
    }

    /// The error for a block this pool does not know (never handed out, freed, or another pool's).
    #[cold]
    #[inline(never)]
    fn unknown_block(&self, block: &BlockHandle) -> Error {
        Error::UnknownBlock(format!("{block:?} in pool {}", self.backend.name()))
    }

    /// Gives every cached byte back to the device: destroys empty plain segments and unmaps the free pages of
    /// virtual reservations. O(segments + free blocks in virtual reservations).
    pub fn release_cached(&self) -> TrimReport {
        self.drain_thread_caches(true);
        let mut state = self.state().lock();
        let report = self.release_cached_locked(&mut state, 0, u64::MAX);
        // The user asked for everything back: what the workload held before no longer says what it needs.
        state.reserved_high_water = state.reserved();
        report
    }

    /// A periodic cleanup round: releases cached memory that has not been used for at least `idle_rounds`
    /// rounds (0 releases everything cached, like [`Pool::release_cached`]). O(segments + free blocks in
    /// virtual reservations).
    pub fn cleanup(&self, idle_rounds: u64) -> TrimReport {
        self.drain_thread_caches(true);
        let mut state = self.state().lock();
        state.cleanup_round += 1;
        self.release_cached_locked(&mut state, idle_rounds, u64::MAX)
    }

    /// Releases cached memory idle for `idle_rounds` rounds until `want` bytes are released (`u64::MAX`: all):
    /// empty plain segments first, then free pages of virtual reservations, smallest free blocks first (the large
    /// ones are what later requests fit in).
    fn release_cached_locked(&self, state: &mut State<B::Segment>, idle_rounds: u64, want: u64) -> TrimReport {
        let start = Instant::now();
        let mut report = TrimReport::default();
        let round = state.cleanup_round;
        // Thread caches first; a slot whose lock is taken (its thread waits for this one, say) keeps its blocks:
        // waiting for it here, under the pool's lock, would break the lock order.
        for slot in self.shared.slots.iter() {
            if let Some(mut cache) = slot.cache.try_lock() {
                state.absorb(slot, &mut cache);
            }
        }
        for arena in 0..state.arenas.len() {
            state.drain_quick(arena);
        }
        for arena in 0..state.arenas.len() {
            let idle: Vec<SegmentId> = state.arenas[arena]
                .engine
                .empty_segments()
                .filter(|&id| {
                    let entry = state.arenas[arena].entry(id).expect("segment exists");
                    round.saturating_sub(entry.last_used_round) >= idle_rounds
                })
                .collect();
            for id in idle {
                if report.bytes_released >= want {
                    break;
                }
                report.bytes_released += self.destroy_segment(state, arena, id);
                report.segments_released += 1;
            }
        }
        for arena in 0..state.arenas.len() {
            if state.arenas[arena].virtual_segments && report.bytes_released < want {
                let (pages, bytes) =
                    self.unmap_free_pages(state, arena, round, idle_rounds, want - report.bytes_released);
                report.pages_unmapped += pages;
                report.bytes_released += bytes;
            }
        }
        state.update_reserved();
        self.backend.release_spare_pages();
        report.elapsed = start.elapsed();
        report
    }

    /// Unmaps pages lying wholly inside free blocks of the arena's reservations (those idle for `idle_rounds`
    /// cleanup rounds), smallest free blocks first, until `want` bytes are unmapped, and withholds them from the
    /// engine. Returns (pages, bytes). O(free blocks of a page or more visited).
    fn unmap_free_pages(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        round: u64,
        idle_rounds: u64,
        want: u64,
    ) -> (u64, u64) {
        let page = self.page_size.expect("virtual arenas exist only with virtual memory");
        let a = &mut state.arenas[arena];
        let idle: Vec<bool> = if idle_rounds == 0 {
            Vec::new()
        } else {
            let idle = |e: &SegmentEntry<_>| round.saturating_sub(e.last_used_round) >= idle_rounds;
            a.segments.iter().map(|slot| slot.as_ref().is_some_and(idle)).collect()
        };
        let eligible = |id: SegmentId| idle_rounds == 0 || idle[id.0 as usize];
        let segments = &mut a.segments;
        let mut calls = 0;
        let bytes = a.engine.withhold_free(page, want, eligible, |id, offset, len| {
            let entry = segments[id.0 as usize].as_mut().expect("segment exists");
            self.backend.unmap_pages(&entry.handle, offset, len);
            *entry.mapped.as_mut().expect("virtual segment") -= len;
            calls += 1;
        });
        state.mapped_bytes -= bytes;
        state.stats.num_device_free += calls;
        state.stats.num_device_calls += calls;
        // A shift, not a division (pages are powers of two, checked in `Pool::new`): this runs on every remap.
        (bytes >> page.trailing_zeros(), bytes)
    }

    /// Unmaps every mapped range of a reservation (before it is destroyed or dropped); returns the bytes and the
    /// calls made.
    fn unmap_all(backend: &B, engine: &Engine, id: SegmentId, entry: &SegmentEntry<B::Segment>) -> (u64, u64) {
        if entry.mapped.is_none() {
            return (0, 0);
        }
        let (mut released, mut calls) = (0, 0);
        for (offset, len) in engine.backed_ranges(id) {
            backend.unmap_pages(&entry.handle, offset, len);
            released += len;
            calls += 1;
        }
        debug_assert_eq!(Some(released), entry.mapped, "mapped bytes follow the engine's backed ranges");
        (released, calls)
    }

    /// Destroys an empty segment; returns the physical bytes it held.
    fn destroy_segment(&self, state: &mut State<B::Segment>, arena: usize, id: SegmentId) -> u64 {
        let entry = state.arenas[arena].segments[id.0 as usize].take().expect("segment exists");
        let (unmapped, calls) = Self::unmap_all(&self.backend, &state.arenas[arena].engine, id, &entry);
        state.stats.num_device_calls += calls + 1;
        let size = state.arenas[arena].engine.remove_segment(id).expect("segment is empty");
        let released = if entry.mapped.is_some() {
            state.mapped_bytes -= unmapped;
            unmapped
        } else {
            state.plain_bytes -= size;
            state.empty_plain_bytes -= size;
            size
        };
        self.backend.destroy_segment(entry.handle, PoolAccess::new());
        self.backend.release_spare_pages();
        state.stats.num_device_free += 1;
        state.stats.segments.sub(1);
        state.update_reserved();
        released
    }

    /// Statistics now. O(1).
    pub fn stats(&self) -> PoolStats {
        self.folded_state().stats_now()
    }

    /// Every segment with its blocks, and the statistics, taken under one lock. O(segments + blocks).
    pub fn snapshot(&self) -> PoolSnapshot {
        self.drain_thread_caches(false);
        let mut state = self.folded_state();
        for arena in 0..state.arenas.len() {
            state.drain_quick(arena);
        }
        let mut segments = Vec::new();
        // Arenas come in the order their streams were first used, a stream's small one first.
        for (arena_index, arena) in state.arenas.iter().enumerate() {
            let (stream, arena_index) = (arena.stream, arena_index as u32);
            for id in arena.engine.segment_ids() {
                let entry = arena.entry(id).expect("segment exists");
                let size = arena.engine.segment_size(id).expect("segment exists");
                // Withheld (unmapped) ranges are free address space: shown joined with free neighbours.
                let mut blocks: Vec<BlockSnapshot> = Vec::new();
                for b in arena.engine.blocks_in(id) {
                    let free = b.free || b.withheld;
                    match blocks.last_mut() {
                        Some(last) if free && last.free => last.size += b.size,
                        _ => blocks.push(BlockSnapshot {
                            offset: b.offset,
                            size: b.size,
                            free,
                            key: b.block.map(|blk| (u64::from(arena_index) << 32) | u64::from(blk.index())),
                        }),
                    }
                }
                segments.push(SegmentSnapshot {
                    stream,
                    class: if arena.class == ArenaClass::Small { "small" } else { "large" },
                    index: id.0,
                    size,
                    virtual_reservation: entry.mapped.is_some(),
                    physical_bytes: entry.mapped.unwrap_or(size),
                    blocks,
                });
            }
        }
        PoolSnapshot { name: self.backend.name().to_string(), segments, stats: state.stats_now() }
    }

    /// Sets every peak to its current value (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peaks(&self) {
        let mut state = self.folded_state();
        state.update_split();
        let s = &mut state.stats;
        for stat in [
            &mut s.allocated_bytes,
            &mut s.requested_bytes,
            &mut s.reserved_bytes,
            &mut s.inactive_split_bytes,
            &mut s.active_blocks,
            &mut s.segments,
        ] {
            stat.reset_peak();
        }
    }

    /// The backend segment holding `block`, and the block's offset in it; `None` if the block is not live.
    pub(crate) fn segment_of(&self, block: &BlockHandle) -> Option<(B::Segment, u64)> {
        let _cache = self.lock_lender(block)?;
        let state = self.state().lock();
        Some((state.live_entry(block)?.handle.clone(), block.offset))
    }

    /// For a block lent from a thread cache, that slot, locked, once it is checked that the block is lent now
    /// (`None` if not); for any other block a lock of nothing. While the guard lives the block cannot be freed.
    fn lock_lender(&self, block: &BlockHandle) -> Option<Option<LeanGuard<'_, ThreadCache>>> {
        let Some(lent) = block.lent else { return Some(None) };
        let (slot, arena, parked) = self.lender(block, lent)?;
        let cache = slot.lock();
        cache.is_lent(lent, arena, &parked).then_some(Some(cache))
    }

    /// The slot `lent` names, the block's arena index and the block as the slot records it; `None` for a handle
    /// whose slot or arena number is not this pool's (another pool's numbers wrap far past this one's arenas).
    #[inline(always)]
    fn lender(&self, block: &BlockHandle, lent: Lent) -> Option<(&Slot, u32, QuickBlock)> {
        let arena = block.arena.wrapping_sub(self.arena_base);
        let slot = self.shared.slots.get(lent.slot as usize).filter(|_| arena < 1 << ARENA_BITS)?;
        let parked = QuickBlock { block: block.block, segment: block.segment, offset: block.offset, size: block.size };
        Some((slot, arena as u32, parked))
    }

    /// Runs `op` on the segment holding live `block` once `[offset, offset + len)` is checked to lie inside it.
    /// Where the memory is host-addressable the pool's lock is held throughout: a copy that looked the block up
    /// and then let go of the lock could land after another thread (holding a clone of the handle) freed the
    /// block and the segment was destroyed (host memory read or written after it was freed), or after the
    /// memory went to another block whose host slice is borrowed. Device memory is copied without the lock, so
    /// that a blocking device copy (which waits for queued work) does not stall every allocation of the pool;
    /// there a copy racing a free of the same block is the caller's data race, as with any device pointer.
    fn with_live_segment<R>(
        &self,
        block: &BlockHandle,
        offset: u64,
        len: u64,
        op: impl FnOnce(&B::Segment) -> Result<R>,
    ) -> Result<R> {
        let end = offset.checked_add(len).ok_or_else(|| Error::SizeOverflow { what: "offset + length".into() })?;
        if end > block.size {
            return Err(Error::OutOfBounds(format!("range {offset}..{end} outside a block of {} bytes", block.size)));
        }
        let unknown = || self.unknown_block(block);
        let cache = self.lock_lender(block).ok_or_else(unknown)?;
        let state = self.state().lock();
        let segment = state.live_entry(block).ok_or_else(unknown)?;
        if self.backend.host_ptr(&segment.handle, 0).is_some() {
            return op(&segment.handle);
        }
        let segment = segment.handle.clone();
        drop(state);
        drop(cache);
        op(&segment)
    }

    /// Copies `src` into the block at `offset`. Errors if the range leaves the block or the block is not live.
    pub fn write(&self, block: &BlockHandle, offset: u64, src: &[u8]) -> Result<()> {
        self.with_live_segment(block, offset, src.len() as u64, |segment| {
            self.backend.write(segment, block.offset + offset, src)
        })
    }

    /// Copies the block's bytes at `offset` into `dst`. Errors if the range leaves the block or the block is not
    /// live.
    pub fn read(&self, block: &BlockHandle, offset: u64, dst: &mut [u8]) -> Result<()> {
        let len = dst.len() as u64;
        self.with_live_segment(block, offset, len, |segment| self.backend.read(segment, block.offset + offset, dst))
    }

    /// Sets `len` bytes at `offset` to `value`. Errors if the range leaves the block or the block is not live.
    pub fn fill(&self, block: &BlockHandle, offset: u64, len: u64, value: u8) -> Result<()> {
        self.with_live_segment(block, offset, len, |segment| {
            self.backend.fill(segment, block.offset + offset, len, value)
        })
    }

    /// Host address of the block's first byte when its memory is host-addressable.
    pub fn host_ptr(&self, block: &BlockHandle) -> Option<std::ptr::NonNull<u8>> {
        if !self.backend.may_be_host_addressable() {
            return None;
        }
        let (segment, offset) = self.segment_of(block)?;
        self.backend.host_ptr(&segment, offset).map(HostPtr::as_non_null)
    }
}

impl<B: Backend> Drop for Pool<B> {
    fn drop(&mut self) {
        // Lent blocks are live blocks: counted below. Free blocks in thread caches are parked in the engine and
        // go with their segments.
        let mut state = self.folded_state();
        let state = &mut *state;
        let live = state.stats.active_blocks.current;
        if live > 0 {
            log::warn!(
                "pool {} dropped with {live} live blocks ({} bytes): their memory is released now",
                self.backend.name(),
                state.stats.allocated_bytes.current
            );
        }
        for arena in &mut state.arenas {
            for (index, slot) in arena.segments.iter_mut().enumerate() {
                let Some(entry) = slot.take() else { continue };
                Self::unmap_all(&self.backend, &arena.engine, SegmentId(index as u32), &entry);
                self.backend.destroy_segment(entry.handle, PoolAccess::new());
            }
        }
        self.backend.release_spare_pages();
    }
}

impl<S: Send + 'static> DrainOnExit for Shared<S> {
    fn drain_slot(&self, slot: u32) {
        let Some(slot) = self.slots.get(slot as usize & (self.slots.len().max(1) - 1)) else { return };
        let mut cache = slot.lock();
        self.state.lock().absorb(slot, &mut cache);
    }
}

impl<S> State<S> {
    /// The entry of the segment holding `block`, if the block is live (for a block lent from a thread cache,
    /// which is parked in the engine, the caller has checked with the slot that it is lent).
    fn live_entry(&self, block: &BlockHandle) -> Option<&SegmentEntry<S>> {
        let arena = self.arenas.get(block.arena.wrapping_sub(self.arena_base) as usize)?;
        if block.lent.is_none() {
            arena.engine.block(block.block)?;
        }
        arena.entry(block.segment)
    }

    /// A block of `size` bytes from what the arena holds, without new memory: a quick block of the size's class,
    /// else the engine's free index. O(1).
    #[inline(always)]
    fn take_cached(&mut self, arena: usize, size: u64) -> Option<Allocation> {
        let a = &mut self.arenas[arena];
        match a.quick.pop(size) {
            // Its pages stayed mapped: the cache is drained before any trim.
            Some(q) => Some(Allocation {
                block: a.engine.unpark(q.block).expect("quick blocks are parked"),
                segment: q.segment,
                offset: q.offset,
                size: q.size,
                segment_was_empty: false,
            }),
            None => a.engine.allocate(size),
        }
    }

    /// Takes everything `slot`'s cache holds: its statistics, folded, and its free blocks.
    fn absorb(&mut self, slot: &Slot, cache: &mut ThreadCache) {
        slot.fold(cache, &mut self.stats);
        cache.drain(|r| self.take_back(r, false));
        self.update_split();
    }

    /// Takes a free block back from a thread cache: into the arena's quick cache if it has room and
    /// `coalesce` is off, else into the engine.
    fn take_back(&mut self, returned: Returned, coalesce: bool) {
        let arena = returned.arena as usize;
        let a = &mut self.arenas[arena];
        if !coalesce {
            if let Some(class) = a.quick.room_for(returned.block.size) {
                a.quick.push(class, returned.block);
                return;
            }
        }
        let freed = a.engine.free(returned.block.block).expect("cached blocks are parked");
        self.note_engine_free(arena, freed.segment, freed.segment_now_empty);
    }

    /// The arena of `stream` for `class`, if the stream has been used. O(1).
    #[inline(always)]
    fn arena_of(&self, stream: StreamId, class: ArenaClass) -> Option<usize> {
        let slot = usize::from(class == ArenaClass::Large);
        self.streams.get(stream).map(|arenas| arenas[slot] as usize)
    }

    /// The statistics, with the ones derived from others filled in rather than counted on every operation:
    /// `active_bytes` is `allocated_bytes` in a pool (a freed block is reusable at once on its stream),
    /// `num_allocs` is hits plus misses, and the current split bytes follow from reserved, allocated and cached.
    fn stats_now(&self) -> PoolStats {
        let mut stats = self.stats.clone();
        stats.active_bytes = stats.allocated_bytes;
        stats.num_allocs = stats.cache_hits + stats.cache_misses;
        stats.inactive_split_bytes.current = self.split_bytes();
        stats
    }

    /// Free bytes in segments that also hold live blocks (plus free mapped pages of reservations).
    fn split_bytes(&self) -> u64 {
        self.reserved() - self.stats.allocated_bytes.current - self.empty_plain_bytes
    }

    fn reserved(&self) -> u64 {
        self.plain_bytes + self.mapped_bytes
    }

    fn update_reserved(&mut self) {
        let reserved = self.reserved();
        self.stats.reserved_bytes.set(reserved);
        self.reserved_high_water = self.reserved_high_water.max(reserved);
        self.update_split();
    }

    fn update_split(&mut self) {
        let split = self.split_bytes();
        self.stats.inactive_split_bytes.set(split);
    }

    /// Registers a new segment; a virtual reservation (`withheld`) starts with nothing mapped.
    fn add_segment(&mut self, arena: usize, size: u64, entry: SegmentEntry<S>, withheld: bool) -> SegmentId {
        let arena = &mut self.arenas[arena];
        let id = if withheld { arena.engine.add_withheld_segment(size) } else { arena.engine.add_segment(size) }
            .expect("segment size is non-zero and rounded");
        let slot = id.0 as usize;
        if arena.segments.len() <= slot {
            arena.segments.resize_with(slot + 1, || None);
        }
        arena.segments[slot] = Some(entry);
        id
    }

    #[inline(always)]
    fn record_alloc(&mut self, arena: usize, alloc: &Allocation, requested: u64, hit: bool) -> BlockHandle {
        let round = self.cleanup_round;
        let a = &mut self.arenas[arena];
        let entry = a.segments[alloc.segment.0 as usize].as_mut().expect("segment exists");
        entry.last_used_round = round;
        entry.last_used_alloc = self.stats.cache_hits + self.stats.cache_misses;
        if alloc.segment_was_empty && entry.mapped.is_none() {
            self.empty_plain_bytes -= a.engine.segment_size(alloc.segment).expect("segment exists");
        }
        let s = &mut self.stats;
        if hit {
            s.cache_hits += 1;
        } else {
            s.cache_misses += 1;
        }
        s.allocated_bytes.add(alloc.size);
        s.requested_bytes.add(requested);
        s.active_blocks.add(1);
        // Taking bytes lowers the split bytes (read off at stats time), unless the block came out of an empty
        // plain segment, which stops counting as cached: only then can their peak move.
        if alloc.segment_was_empty {
            self.update_split();
        }
        BlockHandle {
            arena: self.arena_base + arena as u64,
            segment: alloc.segment,
            block: alloc.block,
            offset: alloc.offset,
            size: alloc.size,
            requested,
            lent: None,
        }
    }

    /// Accounts for a block the engine has just freed: an emptied plain segment becomes cached, not split.
    fn note_engine_free(&mut self, arena: usize, segment: SegmentId, segment_now_empty: bool) {
        let a = &self.arenas[arena];
        if segment_now_empty && a.entry(segment).is_some_and(|e| e.mapped.is_none()) {
            self.empty_plain_bytes += a.engine.segment_size(segment).expect("segment exists");
        }
    }

    /// Frees the arena's quick blocks into its engine, coalescing them. O(quick blocks).
    fn drain_quick(&mut self, arena: usize) {
        if self.arenas[arena].quick.is_empty() {
            return;
        }
        let a = &mut self.arenas[arena];
        let mut emptied = 0;
        a.quick.drain(|q| {
            let freed = a.engine.free(q.block).expect("quick blocks are parked");
            // Quick blocks live in plain segments (small arenas only); an emptied one becomes cached.
            if freed.segment_now_empty
                && a.segments[freed.segment.0 as usize].as_ref().is_some_and(|e| e.mapped.is_none())
            {
                emptied += a.engine.segment_size(freed.segment).expect("segment exists");
            }
        });
        self.empty_plain_bytes += emptied;
        self.update_split();
    }

    #[inline(always)]
    fn record_free(&mut self, block: &BlockHandle) {
        let s = &mut self.stats;
        s.num_frees += 1;
        s.allocated_bytes.sub(block.size);
        s.requested_bytes.sub(block.requested);
        s.active_blocks.sub(1);
        self.update_split();
    }
}

#[cfg(test)]
mod tests;
