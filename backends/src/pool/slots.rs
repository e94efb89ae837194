//! The pool's side of the per-thread caches ([`super::thread_cache`]): which slot a thread uses, the pool's
//! lock taken on a slot's behalf (with the slot's statistics folded in), and draining slots into the pool.

use super::quick::QuickBlock;
use super::state::State;
use super::thread_cache::{self, DrainOnExit, Lent, ThreadCache, ThreadSlot};
use super::{Pool, ARENA_BITS};
use crate::lock::{LeanGuard, LeanMutex};
use crate::{Backend, BlockHandle, PoolStats};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// One thread cache slot, alone on its cache lines so that threads working in their own slots do not share
/// lines.
#[repr(align(128))]
pub(super) struct Slot {
    pub(super) cache: LeanMutex<ThreadCache>,
    /// Set whenever the cache's statistics change, cleared when they are folded into the pool's: a pool
    /// operation of the slot's thread folds them first only when set, so that a thread working with blocks too
    /// large to cache does not take its slot's lock at all.
    pub(super) dirty: AtomicBool,
    /// Whether the slot caches large blocks: set once its thread found the pool's lock taken, cleared by a
    /// cleanup.
    pub(super) large: AtomicBool,
}

impl Slot {
    /// The cache, locked.
    #[inline(always)]
    pub(super) fn lock(&self) -> LeanGuard<'_, ThreadCache> {
        self.cache.lock()
    }

    #[inline(always)]
    pub(super) fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Relaxed)
    }

    /// Folds the locked `cache` into `state`'s statistics.
    #[inline(always)]
    pub(super) fn fold(&self, cache: &mut ThreadCache, stats: &mut PoolStats) {
        cache.fold_into(stats);
        self.dirty.store(false, Ordering::Relaxed);
    }

    /// Takes everything the locked `cache` of this slot holds into `state`: its statistics, folded, and its free
    /// blocks.
    pub(super) fn empty_into<S>(&self, cache: &mut ThreadCache, state: &mut State<S>) {
        self.fold(cache, &mut state.stats);
        cache.drain(|r| state.take_back(r, false));
        state.update_split();
    }
}

impl<B: Backend> Pool<B> {
    /// The calling thread's cache slot (and its thread record); `None` when thread caches are off or the
    /// thread is exiting.
    #[inline(always)]
    pub(super) fn thread_slot(&self) -> Option<(u32, ThreadSlot)> {
        let slots = self.shared.slots.len();
        if slots == 0 {
            return None;
        }
        let thread = thread_cache::this_thread()?;
        Some((thread.number & (slots as u32 - 1), thread))
    }

    /// The handle of a block lent from a thread cache.
    #[inline(always)]
    pub(super) fn lent_handle(&self, arena: u32, block: QuickBlock, requested: u64, lent: Lent) -> BlockHandle {
        BlockHandle {
            arena: self.arena_base + u64::from(arena),
            segment: block.segment,
            block: block.block,
            offset: block.offset,
            size: block.size,
            requested,
            host: block.host,
            lent: Some(lent),
        }
    }

    /// The pool's lock, taken by the thread of `slot`. A thread that finds it held starts caching large blocks
    /// too: large blocks are cached only where threads contend, since a cached large block is memory that no
    /// other request can be cut from, and a thread working alone gains nothing from it.
    #[inline(always)]
    pub(super) fn lock_state_from(&self, slot: &Slot) -> LeanGuard<'_, State<B::Segment>> {
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
    pub(super) fn lock_state_folding(&self, slot: &Slot) -> LeanGuard<'_, State<B::Segment>> {
        if !slot.is_dirty() {
            return self.lock_state_from(slot);
        }
        let mut cache = slot.lock();
        let mut state = self.lock_state_from(slot);
        slot.fold(&mut cache, &mut state.stats);
        state
    }

    /// What a thread's exit drains its slot into.
    pub(super) fn exit_hook(&self) -> Weak<dyn DrainOnExit> {
        Arc::downgrade(&self.shared) as Weak<dyn DrainOnExit>
    }

    /// Hands every slot's free blocks and statistics to the pool: one slot at a time, each under its own lock
    /// and then the pool's.
    /// `cleanup`: also stop caching large blocks until the slot's thread meets contention again (a program
    /// whose threads stopped contending keeps none cached).
    pub(super) fn drain_thread_caches(&self, cleanup: bool) {
        for slot in self.shared.slots.iter() {
            let mut cache = slot.lock();
            if cleanup {
                slot.large.store(false, Ordering::Relaxed);
            }
            if !cache.is_idle() {
                slot.empty_into(&mut cache, &mut self.state().lock());
            }
        }
    }

    /// Folds every slot's statistics into the pool's and returns the state, locked: the slots are locked in
    /// order first, then the pool.
    pub(super) fn folded_state(&self) -> LeanGuard<'_, State<B::Segment>> {
        let mut caches: Vec<_> = self.shared.slots.iter().map(|slot| slot.lock()).collect();
        let mut state = self.state().lock();
        for (slot, cache) in self.shared.slots.iter().zip(&mut caches) {
            slot.fold(cache, &mut state.stats);
        }
        state
    }

    /// For a block lent from a thread cache, that slot, locked, once it is checked that the block is lent now
    /// (`None` if not); for any other block a lock of nothing. While the guard lives the block cannot be freed.
    pub(super) fn lock_lender(&self, block: &BlockHandle) -> Option<Option<LeanGuard<'_, ThreadCache>>> {
        let Some(lent) = block.lent else { return Some(None) };
        let (slot, arena, parked) = self.lender(block, lent)?;
        let cache = slot.lock();
        cache.is_lent(lent, arena, &parked).then_some(Some(cache))
    }

    /// The slot `lent` names, the block's arena index and the block as the slot records it; `None` for a handle
    /// whose slot or arena number is not this pool's (another pool's numbers wrap far past this one's arenas).
    #[inline(always)]
    pub(super) fn lender(&self, block: &BlockHandle, lent: Lent) -> Option<(&Slot, u32, QuickBlock)> {
        let arena = block.arena.wrapping_sub(self.arena_base);
        let slot = self.shared.slots.get(lent.slot() as usize).filter(|_| arena < 1 << ARENA_BITS)?;
        let parked =
            QuickBlock { block: block.block, segment: block.segment, offset: block.offset, size: block.size, host: 0 };
        Some((slot, arena as u32, parked))
    }
}
