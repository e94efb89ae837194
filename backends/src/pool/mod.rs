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
//! Small blocks go through per-thread caches (`thread_cache`): a thread allocates from and frees into a cache
//! slot of its own without the pool's lock, and the slots trade batches with the pool. The pool's lock guards
//! the engine and its books; what still takes it is large blocks, misses, and cleanup.
//!
//! The files, by concern:
//! - `allocate`: the allocation policy, from the thread cache to new memory, the retry and out of memory;
//! - `batch`: several blocks under one lock, and a cache warmed with them;
//! - `free`: freeing into a thread cache, the quick cache or the engine, and poisoning;
//! - `paging`: virtual reservations, mapping withheld pages and unmapping free ones;
//! - `trim`: giving memory back (cleanup rounds, `release_cached`, the slack budgets);
//! - `state`: the books behind the pool's lock (arenas, segments, byte counts);
//! - `slots`: the pool's side of the thread caches (`thread_cache`, `quick` for the arenas' own);
//! - `snapshot`: statistics and snapshots; `io`: bytes in and out of live blocks;
//! - `share`: free memory of one stream serving another's miss ([`CrossStream`]);
//! - `steps`: repeating steps served from a plan ([`Pool::mark_step`]); `stitch`: stitched blocks;
//!   `sleep`: sleep and wake; `books`: the records of those three that the state keeps;
//! - `config`, `streams`: the configuration and the stream → arena map.

mod allocate;
mod batch;
mod books;
mod borrow;
mod capture;
mod config;
mod free;
mod io;
mod paging;
mod quick;
mod recorded;
mod share;
mod sleep;
mod slots;
mod snapshot;
mod state;
mod steps;
mod stitch;
#[cfg(test)]
mod stitch_tests;
mod streams;
mod thread_cache;
mod together;
mod trim;

pub use books::sleep::SleepAction;
pub use books::steps::{StepOutcome, StepReport, MAX_STEP_EVENTS, MISSES_TO_DROP, REPEATS_TO_PLAN};
pub use config::{CrossStream, Limit, PoolConfig, SegmentMode, Strategy, MAX_ALIGNMENT};
pub use recorded::StreamPool;
pub use sleep::{check_tag, SleepReport, WakeReport, MAX_TAG_LEN};
pub use snapshot::{BlockSnapshot, PoolSnapshot, SegmentSnapshot};
pub use together::{each_at_once, sleep_all_or_none};
pub use trim::TrimReport;

use crate::backend::PoolAccess;
use crate::engine::SegmentId;
use crate::lock::LeanMutex;
use crate::{Backend, Error, PoolStats, Result};
use slots::Slot;
use state::State;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use thread_cache::{DrainOnExit, ThreadCache};

pub(crate) use thread_cache::Lent;

/// The page size of virtual reservations in a pool without a limit, unless its configuration names one. Creating
/// and mapping a physical allocation costs about the same whatever its size, so small pages make a cold pass many
/// times slower, while larger pages leave more of the pages at the ends of live blocks unused. 8 MiB is the
/// largest page at which every measured workload reserves no more than PyTorch's expandable segments (H200:
/// replays of every shared trace, ViT training, GPT-2 generation and a 4-stream server through PyTorch), with a
/// cold pass about as fast as theirs; 32 MiB was above them on ViT, generation and `bert_infer_varlen`, and 2 MiB
/// made cold passes 4-6 times slower (the figures: docs/PERFORMANCE.md, "Figures behind the code"). Under a limit
/// the device's own page stays: there pages are given back to fit, and coarse pages would fail requests that fine
/// ones serve.
pub const DEFAULT_PAGE_UNLIMITED: u64 = 8 << 20;

/// Bit of [`Pool::detour`]: steps are marked.
const STEPPING: u8 = 1;

/// The next pool's number (64 bits: never reused in a process's life).
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// Bits of a handle's arena number that index the arena inside its pool (the rest is the pool's number): two
/// arenas (small and large) per stream, so 32,768 streams per pool.
pub(crate) const ARENA_BITS: u32 = 16;

/// Byte written over freed blocks when `poison_on_free` is on: all ones is NaN in f32/f64 and -1 in integers.
pub const POISON_BYTE: u8 = 0xFF;

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
    /// Where blocks start and what their sizes round to: the backend's alignment, or the configuration's where
    /// that is larger.
    alignment: u64,
    max_reservation: u64,
    /// The largest block the pool hands out: the device's capacity on virtual reservations (every page of a
    /// block is mapped), the backend's largest segment otherwise.
    max_block: u64,
    /// The arena number of this pool's first arena: the pool's number, unique in the process, above
    /// [`ARENA_BITS`]. Handles carry `arena_base + index`, and a handle whose number is outside this pool's range
    /// (another pool's, even with the same block ids) is refused by the same bounds check that finds its arena.
    arena_base: u64,
    /// Every block is a whole segment ([`Backend::segment_per_block`]).
    whole_blocks: bool,
    /// The largest small and large blocks thread caches keep (0: none of that class).
    cached_small_max: u64,
    cached_large_max: u64,
    /// Large requests that no free range holds may be served by stitched blocks ([`stitch`]).
    stitching: bool,
    /// Why allocations leave the fast path, read with one load on each: [`STEPPING`] from the first
    /// [`Pool::mark_step`] on (allocations and frees are recorded, [`steps`]), [`sleep::ASLEEP`] while the pool
    /// sleeps (allocations are refused).
    detour: AtomicU8,
    /// Copies of device memory running without the pool's lock, which a sleep waits for ([`sleep`]).
    copies: sleep::CopiesInFlight,
    /// Captures underway on the pool's device ([`capture`]): while above 0, only capture-safe paths.
    captures: AtomicU32,
    /// The reserved bytes the pool's books hold, kept by the state under the lock and read without it.
    reserved: Arc<AtomicU64>,
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
        let align = match config.alignment {
            Some(asked) if asked > granularity => {
                return Err(Error::InvalidConfig(format!(
                    "alignment {asked} is above {}'s segment granularity ({granularity} bytes)",
                    backend.name()
                )))
            }
            asked => align.max(asked.unwrap_or(0)),
        };
        // A segment per block cannot be a reservation that blocks share.
        let backend_whole = backend.segment_per_block();
        let mut vm = backend.virtual_memory().filter(|_| !backend_whole);
        let use_virtual = match config.segment_mode {
            SegmentMode::Plain => false,
            SegmentMode::Auto => vm.is_some(),
            SegmentMode::Virtual if vm.is_none() => {
                return Err(Error::InvalidConfig(format!(
                    "segment_mode virtual asked for, but {} has no virtual memory support{}",
                    backend.name(),
                    if backend_whole { " (every block is a segment of its own)" } else { "" }
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
        let stitching = config.stitch && config.tag.is_none() && page_size.is_some() && backend.can_alias_pages();
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
        let mut state = State::new(arena_base, stats);
        state.reserved_group = config.reserved_group.clone();
        let reserved = Arc::clone(&state.reserved_gauge);
        let state = LeanMutex::new(state);
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
            alignment: align,
            max_reservation,
            max_block,
            arena_base,
            whole_blocks: backend_whole,
            cached_small_max,
            cached_large_max,
            stitching,
            detour: AtomicU8::new(0),
            copies: sleep::CopiesInFlight::default(),
            captures: AtomicU32::new(0),
            reserved,
            shared: Arc::new(Shared { state, slots }),
        })
    }

    /// The lock over the engine and the pool's books.
    #[inline(always)]
    fn state(&self) -> &LeanMutex<State<B::Segment>> {
        &self.shared.state
    }

    /// Bytes held from the device now (`stats().reserved_bytes.current`), read without the pool's lock: one
    /// atomic load of a word that changes only when the pool takes memory from the device or gives it back.
    #[inline]
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
    }

    /// Bytes held from the device that no live block uses, as the pool's books stand: free blocks and free pages
    /// of its segments, those resting in thread caches included. Blocks that thread caches lent or took back
    /// since their statistics were last folded in are not seen, so the figure is off by at most what the thread
    /// caches hold; it takes the pool's lock, not the thread caches'. O(1).
    pub fn unused_bytes(&self) -> u64 {
        let state = self.state().lock();
        state.reserved().saturating_sub(state.stats.allocated_bytes.current)
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Where blocks start and what their sizes round to (see [`PoolConfig::alignment`]).
    pub fn block_alignment(&self) -> u64 {
        self.alignment
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
}

impl<B: Backend> Drop for Pool<B> {
    fn drop(&mut self) {
        // Lent blocks are live blocks: counted below. Free blocks in thread caches are parked in the engine and
        // go with their segments.
        let mut state = self.folded_state();
        let state = &mut *state;
        // Blocks lent across streams and freed may still be used by their borrowers' work, which unmapping their
        // arena's pages would not wait for: they go home first, after their borrowers' marks.
        self.return_loans(state, true, true);
        let live = state.stats.active_blocks.current;
        if live > 0 {
            log::warn!(
                "pool {} dropped with {live} live blocks ({} bytes): their memory is released now",
                self.backend.name(),
                state.stats.allocated_bytes.current
            );
        }
        // A live block may be in use on any stream, where unmapping waits only for its arena's: wait for all.
        if live > 0 {
            if let Err(e) = self.backend.settle() {
                log::error!(
                    "pool {}: waiting for the device before releasing live blocks failed: {e}",
                    self.backend.name()
                );
            }
        }
        // The ranges a sleep unmapped are not unmapped again.
        let asleep = state.sleep.take().map(|s| s.ranges_by_segment()).unwrap_or_default();
        // Stitched ranges first: the pages they map a second time are unmapped with their reservations below.
        let mut arenas: Vec<(usize, &mut state::Arena<B::Segment>)> = state.arenas.iter_mut().enumerate().collect();
        arenas.sort_by_key(|(_, arena)| arena.class != state::ArenaClass::Stitched);
        for (a, arena) in arenas {
            if let Some(mark) = arena.mark.take() {
                self.backend.release_mark(mark.mark);
            }
            for index in 0..arena.segments.len() {
                let Some(entry) = arena.segments[index].take() else { continue };
                let id = SegmentId(index as u32);
                match asleep.get(&(a, id)) {
                    None => {
                        Self::unmap_all(&self.backend, arena.engine(), arena.stream, id, &entry);
                    }
                    Some(sleeping) => {
                        Self::unmap_awake(&self.backend, arena.engine(), arena.stream, id, &entry, sleeping)
                    }
                }
                self.backend.destroy_segment(entry.handle, PoolAccess::new());
            }
        }
        self.backend.release_spare_pages();
        // Everything went back: the group no longer counts this pool's bytes.
        let reserved = state.reserved_gauge.swap(0, Ordering::Relaxed);
        if let Some(group) = &state.reserved_group {
            group.change(reserved, 0);
        }
    }
}

impl<S: Send + 'static> DrainOnExit for Shared<S> {
    fn drain_slot(&self, slot: u32) {
        let Some(slot) = self.slots.get(slot as usize & (self.slots.len().max(1) - 1)) else { return };
        let mut cache = slot.lock();
        slot.empty_into(&mut cache, &mut self.state.lock());
    }
}

#[cfg(test)]
mod tests;
