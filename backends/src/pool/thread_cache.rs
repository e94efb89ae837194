//! Per-thread caches of small blocks in front of a pool's shared engine (tcmalloc's and mimalloc's thread
//! caches, RMM's per-thread arenas): a thread allocates small blocks from a cache of its own and frees them back
//! into the cache they came from, without taking the pool's lock.
//!
//! Each pool holds a fixed array of cache slots, each behind its own lock; a thread uses the slot its thread
//! number picks. Thread numbers are recycled when threads exit, so live threads hold distinct small numbers and,
//! while there are no more of them than slots, distinct slots: a slot's lock is then taken by its own thread
//! alone, except when another thread frees a block the slot lent (the block goes back to the slot it came from)
//! or a cleanup drains it.
//!
//! A cached block is parked in the engine: its range stays taken, so nothing else can be handed out over it,
//! and to the pool it is free (reserved, inactive). Lending it out records it in the slot's lent table, whose
//! entries carry generations the way engine ids do: the handle names the slot, the entry and its generation,
//! so a second free, or a read or write through a handle of a block that was freed and lent again, finds the
//! generation moved on and is refused, exactly as the engine refuses stale ids.
//!
//! A slot keeps at most [`PoolConfig::thread_cache_bytes`](super::PoolConfig) of free blocks, at most 64 of one
//! size class. Past that it hands a batch (the largest blocks first, until half the bound is left) back to the
//! pool under one lock acquisition. A miss takes the block from the pool (its central quick cache, its engine,
//! or new memory) under one acquisition too. A slot is drained into the pool by `cleanup`, `release_cached`,
//! `snapshot`, an out-of-memory retry, and when its thread exits.
//!
//! Lock order: a slot, then the pool. Code holding the pool's lock only ever `try_lock`s a slot.

use super::quick::{QuickBlock, QuickCache};
use crate::stats::{PoolStats, Stat};
use crate::StreamId;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, Weak};

/// Arenas one slot caches blocks of (a small and a large one per stream): a thread works on one or two
/// streams, and the lookup is a linear search. Blocks of further streams go through the pool.
const MAX_ARENAS: usize = 16;

/// Where a lent block's record lives: the slot, the entry in its lent table, and the entry's generation when
/// the block was lent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lent {
    /// The slot's number plus one: a slot number is below 256 ([`super::slot_count`]), and a non-zero field lets
    /// `Option<Lent>` take no room of its own, which keeps a [`crate::BlockHandle`] within 64 bytes.
    slot_plus_one: std::num::NonZeroU16,
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl Lent {
    #[inline(always)]
    fn new(slot: u32, index: u32, generation: u32) -> Self {
        debug_assert!(slot < 256, "slot numbers are below 256");
        // No branch on the lending path: a slot number below 256 plus one is never zero nor saturates.
        let slot_plus_one = std::num::NonZeroU16::MIN.saturating_add(slot as u16);
        Lent { slot_plus_one, index, generation }
    }

    /// The number of the slot that lent the block.
    #[inline(always)]
    pub(crate) fn slot(self) -> u32 {
        u32::from(self.slot_plus_one.get()) - 1
    }
}

/// One block out on loan from a slot.
#[derive(Debug, Clone, Copy)]
struct LentRecord {
    block: QuickBlock,
    arena: u32,
    generation: u32,
    live: bool,
}

/// The cache of one arena (one stream and size class) in a slot.
#[derive(Debug)]
struct ArenaCache {
    arena: u32,
    stream: StreamId,
    large: bool,
    quick: QuickCache,
    /// Bytes of free blocks held, and the most it may hold.
    bytes: u64,
    max_bytes: u64,
}

/// Changes to the pool's statistics made in a slot and not yet folded into the pool's: deltas since the last
/// fold, and the highest each delta reached since then, so that the fold raises the pool's peaks to what they
/// were at that moment (exactly, when one thread runs; within the other slots' unfolded deltas otherwise).
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    allocated: i64,
    requested: i64,
    blocks: i64,
    peak_allocated: i64,
    peak_requested: i64,
    peak_blocks: i64,
    hits: u64,
    frees: u64,
}

impl Tally {
    #[inline(always)]
    fn lend(&mut self, size: u64, requested: u64) {
        self.allocated += size as i64;
        self.requested += requested as i64;
        self.blocks += 1;
        self.hits += 1;
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        self.peak_requested = self.peak_requested.max(self.requested);
        self.peak_blocks = self.peak_blocks.max(self.blocks);
    }

    #[inline(always)]
    fn give_back(&mut self, size: u64, requested: u64) {
        self.allocated -= size as i64;
        self.requested -= requested as i64;
        self.blocks -= 1;
        self.frees += 1;
    }

    fn fold_into(&mut self, stats: &mut PoolStats) {
        fn fold(stat: &mut Stat, delta: i64, peak_delta: i64) {
            let current = stat.current as i64;
            stat.peak = stat.peak.max((current + peak_delta).max(0) as u64);
            stat.current = (current + delta).max(0) as u64;
        }
        fold(&mut stats.allocated_bytes, self.allocated, self.peak_allocated);
        fold(&mut stats.requested_bytes, self.requested, self.peak_requested);
        fold(&mut stats.active_blocks, self.blocks, self.peak_blocks);
        stats.cache_hits += self.hits;
        stats.num_frees += self.frees;
        *self = Self::default();
    }
}

/// The cache of one slot.
#[derive(Debug, Default)]
pub(super) struct ThreadCache {
    /// Serial of the thread that last arranged for this slot to be drained when it exits.
    registered: u64,
    arenas: Vec<ArenaCache>,
    lent: Vec<LentRecord>,
    vacant: Vec<u32>,
    /// Bytes of free blocks held, over all arenas.
    bytes: u64,
    tally: Tally,
}

/// A block taken out of a slot, to be handed to the pool.
pub(super) struct Returned {
    pub(super) arena: u32,
    pub(super) block: QuickBlock,
}

impl ThreadCache {
    /// Bytes of free blocks held.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Caches free blocks of `arena` (which serves `stream`, small or large blocks) from now on: blocks of up
    /// to `ceiling` bytes, `max_bytes` of them in all, unless the slot already caches [`MAX_ARENAS`] others.
    /// Returns whether it caches them.
    pub(super) fn add_arena(
        &mut self,
        arena: u32,
        stream: StreamId,
        large: bool,
        ceiling: u64,
        max_bytes: u64,
    ) -> bool {
        if self.arenas.iter().any(|a| a.arena == arena) {
            return true;
        }
        if self.arenas.len() >= MAX_ARENAS {
            return false;
        }
        self.arenas.push(ArenaCache { arena, stream, large, quick: QuickCache::new(ceiling), bytes: 0, max_bytes });
        true
    }

    /// Lends a cached block of at least `size` bytes on `stream` from its small or `large` arena, recording it
    /// and the allocation. O(1).
    #[inline(always)]
    pub(super) fn take(
        &mut self,
        stream: StreamId,
        large: bool,
        size: u64,
        requested: u64,
        slot: u32,
    ) -> Option<(u32, QuickBlock, Lent)> {
        let cache = self.arenas.iter_mut().find(|a| a.stream == stream && a.large == large)?;
        let block = cache.quick.pop(size)?;
        cache.bytes -= block.size;
        let arena = cache.arena;
        self.bytes -= block.size;
        let lent = self.record_lent(arena, block, slot);
        self.tally.lend(block.size, requested);
        Some((arena, block, lent))
    }

    /// Records `block` of `arena` as lent out and returns its ticket. A block that came from the pool rather
    /// than from this cache is already counted by the pool: it adds nothing to the tally.
    #[inline(always)]
    fn record_lent(&mut self, arena: u32, block: QuickBlock, slot: u32) -> Lent {
        match self.vacant.pop() {
            Some(index) => {
                let record = &mut self.lent[index as usize];
                *record = LentRecord { block, arena, generation: record.generation, live: true };
                Lent::new(slot, index, record.generation)
            }
            None => {
                let index = self.lent.len() as u32;
                self.lent.push(LentRecord { block, arena, generation: 0, live: true });
                Lent::new(slot, index, 0)
            }
        }
    }

    /// Records a block the pool handed out (already counted in the pool's statistics, parked in its engine) as
    /// lent from this slot.
    pub(super) fn adopt(&mut self, arena: u32, block: QuickBlock, slot: u32) -> Lent {
        self.record_lent(arena, block, slot)
    }

    /// Whether `lent` names a block lent from this slot right now, the one at `segment`/`offset` of `arena`.
    #[inline]
    pub(super) fn is_lent(&self, lent: Lent, arena: u32, block: &QuickBlock) -> bool {
        self.lent.get(lent.index as usize).is_some_and(|r| {
            r.live
                && r.generation == lent.generation
                && r.arena == arena
                && r.block.block == block.block
                && r.block.offset == block.offset
                && r.block.size == block.size
                && r.block.segment == block.segment
        })
    }

    /// Takes back the block lent under `lent` (checked with [`ThreadCache::is_lent`]) and keeps it if the bounds
    /// allow. Returns `Err(())` for a handle that is not lent from here now (stale or double free): nothing
    /// changes then. `Ok(Some(_))` is a block that did not fit, for the pool.
    #[inline(always)]
    pub(super) fn give_back(
        &mut self,
        lent: Lent,
        arena: u32,
        block: QuickBlock,
        requested: u64,
    ) -> Result<Option<Returned>, ()> {
        if !self.is_lent(lent, arena, &block) {
            return Err(());
        }
        let record = &mut self.lent[lent.index as usize];
        record.live = false;
        // The host address comes from the slot's own record of the block: the freed handle is only checked
        // against it.
        let kept = QuickBlock { host: record.block.host, ..block };
        // Generations never wrap: an entry whose generation is spent is not reused, so no later handle can
        // carry an old one's ticket.
        if record.generation < u32::MAX {
            record.generation += 1;
            self.vacant.push(lent.index);
        }
        self.tally.give_back(block.size, requested);
        Ok(self.keep(arena, kept))
    }

    /// Keeps a free block if its arena's cache has room for it (bytes and its class's count); else hands it
    /// back.
    #[inline(always)]
    fn keep(&mut self, arena: u32, block: QuickBlock) -> Option<Returned> {
        let Some(cache) = self.arenas.iter_mut().find(|a| a.arena == arena) else {
            return Some(Returned { arena, block });
        };
        if cache.bytes + block.size > cache.max_bytes {
            return Some(Returned { arena, block });
        }
        let Some(class) = cache.quick.room_for(block.size) else {
            return Some(Returned { arena, block });
        };
        cache.quick.push(class, block);
        cache.bytes += block.size;
        self.bytes += block.size;
        None
    }

    /// Takes free blocks of `arena` out, largest first, until at most half its bound is left; hands each to
    /// `out`. The batch a full cache trades with the pool.
    pub(super) fn trim_arena(&mut self, arena: u32, mut out: impl FnMut(Returned)) {
        let Some(cache) = self.arenas.iter_mut().find(|a| a.arena == arena) else { return };
        while cache.bytes > cache.max_bytes / 2 {
            let Some(block) = cache.quick.pop_largest() else { break };
            cache.bytes -= block.size;
            self.bytes -= block.size;
            out(Returned { arena, block });
        }
    }

    /// Takes every free block of `arena` out (the pool needs them coalesced), handing each to `out`, and halves
    /// the largest size the arena's cache keeps: its blocks were just in the way of a request.
    pub(super) fn drain_arena(&mut self, arena: u32, mut out: impl FnMut(Returned)) {
        let Some(cache) = self.arenas.iter_mut().find(|a| a.arena == arena) else { return };
        if cache.quick.is_empty() {
            return;
        }
        cache.quick.shrink();
        cache.quick.drain(|block| out(Returned { arena, block }));
        self.bytes -= cache.bytes;
        cache.bytes = 0;
    }

    /// Takes out every free block of streams other than `keep`, handing each to `out`.
    pub(super) fn drain_other_streams(&mut self, keep: StreamId, mut out: impl FnMut(Returned)) {
        for cache in self.arenas.iter_mut().filter(|a| a.stream != keep && !a.quick.is_empty()) {
            let arena = cache.arena;
            cache.quick.shrink();
            cache.quick.drain(|block| out(Returned { arena, block }));
            self.bytes -= cache.bytes;
            cache.bytes = 0;
        }
    }

    /// Whether the slot holds any free block.
    pub(super) fn holds_any(&self) -> bool {
        self.bytes > 0
    }

    /// Takes every free block out, handing each to `out`.
    pub(super) fn drain(&mut self, mut out: impl FnMut(Returned)) {
        for cache in &mut self.arenas {
            let arena = cache.arena;
            cache.quick.drain(|block| out(Returned { arena, block }));
            cache.bytes = 0;
        }
        self.bytes = 0;
    }

    /// Folds this slot's statistics into the pool's.
    pub(super) fn fold_into(&mut self, stats: &mut PoolStats) {
        self.tally.fold_into(stats);
    }

    /// Whether the slot has unfolded statistics or free blocks.
    pub(super) fn is_idle(&self) -> bool {
        self.bytes == 0 && self.tally.hits == 0 && self.tally.frees == 0
    }

    /// Arranges, once per thread, for this slot to be drained into `pool` when the calling thread exits.
    #[inline(always)]
    pub(super) fn register(&mut self, thread: ThreadSlot, pool: impl FnOnce() -> Weak<dyn DrainOnExit>) {
        if self.registered != thread.serial {
            self.registered = thread.serial;
            register_for_exit(pool());
        }
    }
}

/// A pool whose slot a thread used: drained when the thread exits.
pub(super) trait DrainOnExit: Send + Sync {
    /// Hands slot `slot`'s free blocks and statistics to the pool.
    fn drain_slot(&self, slot: u32);
}

/// The calling thread's number (small, recycled) and serial (never reused).
#[derive(Debug, Clone, Copy)]
pub(super) struct ThreadSlot {
    pub(super) number: u32,
    pub(super) serial: u64,
}

/// Thread numbers freed by exited threads, reused before new ones.
static FREE_NUMBERS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static NEXT_NUMBER: AtomicU32 = AtomicU32::new(0);
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

struct ThreadRecord {
    slot: ThreadSlot,
    pools: RefCell<Vec<Weak<dyn DrainOnExit>>>,
}

impl ThreadRecord {
    fn claim() -> Self {
        let reused = FREE_NUMBERS.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let number = reused.unwrap_or_else(|| NEXT_NUMBER.fetch_add(1, Ordering::Relaxed));
        let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
        Self { slot: ThreadSlot { number, serial }, pools: RefCell::new(Vec::new()) }
    }
}

impl Drop for ThreadRecord {
    fn drop(&mut self) {
        for pool in self.pools.get_mut().drain(..) {
            if let Some(pool) = pool.upgrade() {
                pool.drain_slot(self.slot.number);
            }
        }
        FREE_NUMBERS.lock().unwrap_or_else(|e| e.into_inner()).push(self.slot.number);
    }
}

thread_local! {
    static THREAD: ThreadRecord = ThreadRecord::claim();
}

/// The calling thread's number and serial; `None` while the thread is exiting (its record is gone).
#[inline(always)]
pub(super) fn this_thread() -> Option<ThreadSlot> {
    THREAD.try_with(|t| t.slot).ok()
}

fn register_for_exit(pool: Weak<dyn DrainOnExit>) {
    let _ = THREAD.try_with(|t| {
        let mut pools = t.pools.borrow_mut();
        if pools.iter().any(|p| Weak::ptr_eq(p, &pool)) {
            return;
        }
        if pools.len() >= 16 {
            pools.retain(|p| p.strong_count() > 0);
        }
        pools.push(pool);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Engine;

    fn cache_with_arena() -> (Engine, ThreadCache) {
        let mut engine = Engine::new(256).expect("power of two");
        engine.add_segment(64 << 20).expect("valid size");
        let mut cache = ThreadCache::default();
        cache.add_arena(0, StreamId(0), false, 1 << 20, 3 << 20);
        (engine, cache)
    }

    fn parked(engine: &mut Engine, size: u64) -> QuickBlock {
        let alloc = engine.allocate(size).expect("room");
        let block = engine.park(alloc.block).expect("live");
        QuickBlock { block, segment: alloc.segment, offset: alloc.offset, size: alloc.size, host: 0 }
    }

    #[test]
    fn a_ticket_is_good_for_one_give_back() {
        let (mut engine, mut cache) = cache_with_arena();
        let block = parked(&mut engine, 4096);
        let lent = cache.adopt(0, block, 3);
        assert_eq!(lent.slot(), 3);
        assert!(cache.give_back(lent, 0, block, 4096).expect("lent").is_none(), "kept");
        assert!(cache.give_back(lent, 0, block, 4096).is_err(), "second give-back refused");
        // Lent again from the cache: a new generation, and the old ticket stays refused.
        let (_, again, relent) = cache.take(StreamId(0), false, 4096, 4096, 3).expect("cached");
        assert_eq!(again.offset, block.offset);
        assert_ne!(relent.generation, lent.generation);
        assert!(!cache.is_lent(lent, 0, &again));
        assert!(cache.is_lent(relent, 0, &again));
    }

    #[test]
    fn the_byte_bound_hands_blocks_back() {
        let (mut engine, mut cache) = cache_with_arena();
        let blocks: Vec<_> = (0..4).map(|_| parked(&mut engine, 1 << 20)).collect();
        let tickets: Vec<_> = blocks.iter().map(|b| cache.adopt(0, *b, 0)).collect();
        let mut handed = 0;
        for (lent, block) in tickets.into_iter().zip(&blocks) {
            if cache.give_back(lent, 0, *block, 1 << 20).expect("lent").is_some() {
                handed += 1;
            }
        }
        assert_eq!((cache.bytes(), handed), (3 << 20, 1));
        let mut out = Vec::new();
        cache.trim_arena(0, |r| out.push(r.block));
        assert_eq!((cache.bytes(), out.len()), (1 << 20, 2), "down to half the bound");
        cache.drain(|r| out.push(r.block));
        assert_eq!((cache.bytes(), out.len()), (0, 3));
    }

    #[test]
    fn folding_raises_peaks_to_the_highest_delta() {
        let mut tally = Tally::default();
        tally.lend(100, 90);
        tally.lend(50, 50);
        tally.give_back(100, 90);
        let mut stats = PoolStats::default();
        stats.allocated_bytes.current = 1000;
        stats.allocated_bytes.peak = 1000;
        tally.fold_into(&mut stats);
        assert_eq!((stats.allocated_bytes.current, stats.allocated_bytes.peak), (1050, 1150));
        assert_eq!((stats.active_blocks.current, stats.active_blocks.peak), (1, 2));
        assert_eq!((stats.cache_hits, stats.num_frees), (2, 1));
    }
}
