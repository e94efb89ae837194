//! Freeing: into the calling thread's cache for a block lent from one, else into the arena's quick cache or
//! engine under the pool's lock; with `poison_on_free`, the poison is written first.

use super::quick::QuickBlock;
use super::slots::Slot;
use super::state::{ArenaClass, State};
use super::thread_cache::{Lent, Returned, ThreadCache};
use super::{Pool, POISON_BYTE};
use crate::lock::LeanGuard;
use crate::{Backend, BlockHandle, Error, Result, Strategy};
use std::sync::atomic::Ordering;

impl<B: Backend> Pool<B> {
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
    pub(super) fn free_poisoned(&self, block: &BlockHandle) -> Result<()> {
        match self.fill(block, 0, block.size, POISON_BYTE) {
            Ok(()) => self.free_unpoisoned(block),
            Err(e) if e.is_unknown_block() => Err(e),
            // Memory asleep has no bytes to poison; the block is freed all the same.
            Err(e) if e.is_unsupported() || e.is_asleep() => self.free_unpoisoned(block),
            Err(e) => {
                self.free_unpoisoned(block)?;
                Err(e)
            }
        }
    }

    #[inline(always)]
    pub(super) fn free_unpoisoned(&self, block: &BlockHandle) -> Result<()> {
        if self.detour.load(Ordering::Relaxed) & super::STEPPING != 0 {
            return self.free_stepped(block);
        }
        if let Some(lent) = block.lent {
            return self.free_lent(block, lent);
        }
        self.free_through_pool(block)
    }

    /// Frees a block the pool handed out itself (not lent from a thread cache). Inlined (see
    /// [`Pool::allocate_uncached_from`]).
    #[inline(always)]
    pub(super) fn free_through_pool(&self, block: &BlockHandle) -> Result<()> {
        let mut state = match self.thread_slot() {
            Some((index, _)) => self.lock_state_folding(&self.shared.slots[index as usize]),
            None => self.state().lock(),
        };
        self.free_locked(&mut state, block)
    }

    /// A free while steps are marked: recorded, then done under the same lock (a block lent from a thread cache
    /// before steps were marked goes back to its cache).
    #[cold]
    #[inline(never)]
    pub(super) fn free_stepped(&self, block: &BlockHandle) -> Result<()> {
        if let Some(lent) = block.lent {
            self.note_stepped_free(block);
            return self.free_lent(block, lent);
        }
        let mut state = self.state().lock();
        state.steps.note_free(block.key(), block.size());
        self.free_locked(&mut state, block)
    }

    /// Frees a block the pool handed out itself, with the lock held.
    #[inline(always)]
    fn free_locked(&self, state: &mut State<B::Segment>, block: &BlockHandle) -> Result<()> {
        let unknown = || self.unknown_block(block);
        // Another pool's arena numbers wrap to far beyond this pool's arenas.
        let arena = block.arena.wrapping_sub(state.arena_base) as usize;
        if !state.loans.blocks.is_empty() {
            if let Some(result) = self.free_lent_across(state, arena, block) {
                return result;
            }
        }
        let a = state.arenas.get_mut(arena).ok_or_else(unknown)?;
        // Only small blocks go through the quick cache: they churn most, and live in 2 MiB segments where an
        // uncoalesced block cannot push a large request into new memory.
        let room = if self.config.strategy == Strategy::Pooled && a.class == ArenaClass::Small {
            a.quick.room_for(block.size)
        } else {
            None
        };
        if let Some(class) = room {
            let parked = a.park(block.block).ok_or_else(unknown)?;
            a.quick.push(
                class,
                QuickBlock { block: parked, segment: block.segment, offset: block.offset, size: block.size, host: 0 },
            );
            state.record_free(block);
            return Ok(());
        }
        // Checked after the quick cache: small blocks, the most frequent frees, never are stitched.
        if a.class == ArenaClass::Stitched {
            return self.free_stitched(state, arena, block);
        }
        let freed = state.free_block(arena, block.block).ok_or_else(unknown)?;
        state.record_free(block);
        if self.config.strategy == Strategy::Direct && freed.segment_now_empty {
            self.destroy_segment(state, arena, freed.segment);
        }
        Ok(())
    }

    /// Frees a block lent from a thread cache back into that cache (whichever thread frees it); past the
    /// cache's bounds, a batch goes back to the pool under one lock acquisition.
    #[inline(always)]
    pub(super) fn free_lent(&self, block: &BlockHandle, lent: Lent) -> Result<()> {
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
    pub(super) fn return_overflow(
        &self,
        slot: &Slot,
        mut cache: LeanGuard<'_, ThreadCache>,
        arena: u32,
        overflow: Returned,
    ) {
        let mut state = self.state().lock();
        slot.fold(&mut cache, &mut state.stats);
        state.take_back(overflow, false);
        cache.trim_arena(arena, |r| state.take_back(r, false));
        state.update_split();
    }

    /// The error for a block this pool does not know (never handed out, freed, or another pool's).
    #[cold]
    #[inline(never)]
    pub(super) fn unknown_block(&self, block: &BlockHandle) -> Error {
        Error::UnknownBlock(format!("{block:?} in pool {}", self.backend.name()))
    }
}
