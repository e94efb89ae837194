//! The pool's side of the thread caches ([`super::thread_cache`]): the calling thread's slot, the pool's lock as
//! a slot's thread takes it (folding the slot's statistics first, and noting contention), a slot's refill from
//! the pool, and draining slots back into the pool.
//!
//! Lock order: a slot, then the pool. Under the pool's lock a slot is only ever `try_lock`ed (see
//! [`super::trim`]). A refill holds both: its own slot, then the pool.

use super::quick::QuickBlock;
use super::state::{ArenaClass, State};
use super::thread_cache::{self, DrainOnExit, Lent, ThreadCache, ThreadSlot};
use super::{Pool, Slot, ARENA_BITS};
use crate::lock::LeanGuard;
use crate::{Backend, BlockHandle, Error, Result, StreamId};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

impl<B: Backend> Pool<B> {
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
            lent: Some(lent),
        }
    }

    /// What a thread's exit drains its slot into.
    fn exit_hook(&self) -> Weak<dyn DrainOnExit> {
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
                self.state().lock().absorb(slot, &mut cache);
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
        let slot = self.shared.slots.get(lent.slot as usize).filter(|_| arena < 1 << ARENA_BITS)?;
        let parked = QuickBlock { block: block.block, segment: block.segment, offset: block.offset, size: block.size };
        Some((slot, arena as u32, parked))
    }

    /// A miss of the thread's cache for a block of its classes (`large` or small), under the
    /// pool's lock: a block through [`Pool::allocate_locked`] (for a small one, with this slot's own blocks
    /// coalesced back into the pool before it takes new memory), lent from the slot. Folds the slot's statistics
    /// first, so that a thread working alone keeps the pool's books exact at every pool operation.
    #[cold]
    #[inline(never)]
    pub(super) fn refill(
        &self,
        mut cache: LeanGuard<'_, ThreadCache>,
        slot: u32,
        thread: ThreadSlot,
        bytes: u64,
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
            return self.allocate_locked(&mut state, bytes, stream, ());
        }
        let handle = if !large {
            // When the pool has nothing cached that fits, this slot's small blocks are coalesced before the pool
            // grows, so that thread caches never make the pool reserve more.
            let coalesce = |state: &mut State<B::Segment>, arena: usize| {
                cache.drain_arena(arena as u32, |r| state.take_back(r, true));
            };
            self.allocate_locked(&mut state, bytes, stream, coalesce)?
        } else {
            // Large blocks are cached only by threads that contend, for whom a cache emptied at every miss would
            // be no cache: the pool grows instead, by at most the cache's bound, and gets the blocks back when it
            // runs out of memory.
            match self.allocate_locked(&mut state, bytes, stream, ()) {
                Err(Error::OutOfMemory { .. }) if cache.holds_any() => {
                    // This thread's own cached blocks were out of the pool's reach (its slot is held here): give
                    // them back and try once more. The failure just counted was not the last word.
                    state.stats.num_ooms -= 1;
                    cache.drain(|r| state.take_back(r, true));
                    self.allocate_locked(&mut state, bytes, stream, ())?
                }
                other => other?,
            }
        };
        // Lent from the slot: parked in the engine, so that only the slot's ticket frees it.
        let parked = state.park(arena, handle.block).expect("allocated just now");
        let block = QuickBlock { block: parked, segment: handle.segment, offset: handle.offset, size: handle.size };
        let lent = cache.adopt(arena as u32, block, slot);
        Ok(BlockHandle { block: parked, lent: Some(lent), ..handle })
    }
}

impl<S: Send + 'static> DrainOnExit for super::Shared<S> {
    fn drain_slot(&self, slot: u32) {
        let Some(slot) = self.slots.get(slot as usize & (self.slots.len().max(1) - 1)) else { return };
        let mut cache = slot.lock();
        self.state.lock().absorb(slot, &mut cache);
    }
}
