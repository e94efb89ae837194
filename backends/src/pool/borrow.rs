//! Free blocks lent across streams where they lie: a stream's miss in a virtual arena that would map new pages
//! takes a free block of another stream's arena of the same class instead, at its own address, with no page
//! unmapped or mapped. The block stays in the giving arena's engine; the pool remembers which stream holds it.
//!
//! Why: streams of a server trade memory all the time (each stream's peak comes while the others are low), and
//! moving pages between their reservations ([`super::share`]) costs an unmap and a map per run of pages, and
//! destroys the stitched ranges kept over them. Borrowing in place costs a stream mark at most: the address
//! space of every stream's reservations is, in effect, one.
//!
//! Why it is safe: a block is taken from the giving arena only as its other free memory would be moved, once a
//! mark recorded on the giving stream after its latest free has passed (or, under [`crate::CrossStream::Wait`],
//! with the taking stream made to wait for it on the device). When the borrowing stream frees the block, work it
//! queued may still use it, so the block does not go back into the giving arena's free index then: it waits in
//! the pool's books until a mark on the borrowing stream, recorded after the free, has passed (or the giving
//! stream is made to wait for it), exactly as the giver's memory waited before it was lent. Until then the engine
//! holds it live, so nothing else is cut from it and no trim unmaps its pages.

use super::share::Donor;
use super::state::State;
use super::Pool;
use crate::engine::{Allocation, BlockId};
use crate::{Backend, BlockHandle, Result};
use std::collections::HashMap;

/// A block of one arena held by another arena's stream.
#[derive(Debug, Clone, Copy)]
pub(super) struct Loan {
    /// The arena of the stream that took it.
    pub(super) borrower: usize,
    /// Freed by the borrower, waiting for a mark of its stream before it goes back to the giving arena.
    pub(super) returning: bool,
}

/// The blocks lent across streams, behind the pool's lock.
#[derive(Debug, Default)]
pub(super) struct Loans {
    /// By (giving arena, block).
    pub(super) blocks: HashMap<(usize, BlockId), Loan>,
    /// How many of `blocks` are returning: none makes [`Pool::return_loans`] one compare.
    pub(super) returning: usize,
}

impl<B: Backend> Pool<B> {
    /// For a miss of `size` bytes (rounded) in virtual `arena` that would map new memory past the live peak: a
    /// free block of another stream's arena of the same class, taken where it lies once that stream's mark
    /// allows it. Returns the giving arena and the block. `None` when sharing is off, the pool would stay within
    /// its live peak, steps are marked (a plan places blocks by their stream's arenas), or no other stream holds
    /// a fitting block whose mark has passed. Arenas whose mark already covers their frees are asked first, so
    /// that a mark is recorded only where none of them serves. O(arenas) plus one engine search per arena that
    /// fits.
    pub(super) fn borrow_block(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> Option<(usize, Allocation)> {
        let stepping = self.detour.load(std::sync::atomic::Ordering::Relaxed) & super::STEPPING != 0;
        if stepping || !self.should_share(state, size) {
            return None;
        }
        let class = state.arenas[arena].class;
        for record in [false, true] {
            for giver in 0..state.arenas.len() {
                let a = &state.arenas[giver];
                if giver == arena || a.class != class || !a.virtual_segments || !a.engine().can_allocate(size) {
                    continue;
                }
                if self.donor_marking(state, giver, arena, record) == Donor::NotYet {
                    continue;
                }
                let alloc = state.allocate_from_engine(giver, size).expect("a fitting block was found just now");
                state.loans.blocks.insert((giver, alloc.block), Loan { borrower: arena, returning: false });
                state.stats.num_blocks_shared += 1;
                return Some((giver, alloc));
            }
        }
        None
    }

    /// A block this arena's stream borrowed, freed, and that has not gone home yet, of `size` bytes (rounded) up
    /// to a quarter more: its stream may use it again at once (its own work on it is ordered before the new), so
    /// a repeating request of a stream reuses its loan with no mark on either stream. Returns the giving arena
    /// and the block. O(loans) when some are returning, one compare otherwise.
    pub(super) fn reuse_loan(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        size: u64,
    ) -> Option<(usize, Allocation)> {
        if state.loans.returning == 0 {
            return None;
        }
        let most = size.saturating_add(size >> crate::engine::WHOLE_FIT_SLACK_SHIFT);
        let (giver, alloc) = state
            .loans
            .blocks
            .iter()
            .filter(|(_, loan)| loan.returning && loan.borrower == arena)
            .filter_map(|(&(giver, block), _)| Some((giver, state.arenas[giver].engine().block(block)?)))
            .filter(|(_, alloc)| (size..=most).contains(&alloc.size))
            .min_by_key(|(_, alloc)| alloc.size)?;
        state.loans.blocks.get_mut(&(giver, alloc.block)).expect("found just now").returning = false;
        state.loans.returning -= 1;
        Some((giver, alloc))
    }

    /// Frees `block` of `arena` if another stream holds it on loan: it waits for the borrower's mark (see the
    /// module's doc). `None` when it is not on loan; an error for one already freed.
    pub(super) fn free_lent_across(
        &self,
        state: &mut State<B::Segment>,
        arena: usize,
        block: &BlockHandle,
    ) -> Option<Result<()>> {
        let loan = state.loans.blocks.get_mut(&(arena, block.block))?;
        if loan.returning {
            return Some(Err(self.unknown_block(block)));
        }
        loan.returning = true;
        let borrower = loan.borrower;
        state.loans.returning += 1;
        // The borrower's next mark must come after this free for the block to go back.
        state.arenas[borrower].freed_epoch = state.mark_epoch;
        state.record_free(block);
        Some(Ok(()))
    }

    /// Puts blocks freed by their borrowers back into the arenas they came from, where a mark on the borrower's
    /// stream after the free has passed or the giving stream now waits for it. `record`: a mark is recorded on a
    /// borrower's stream where none covers its frees (else only the marks there are decide); `wait`: the host
    /// waits for the marks still pending. Not during a capture (no event may be queried). Returns whether some
    /// block went back. O(loans) when some are returning, one compare otherwise.
    pub(super) fn return_loans(&self, state: &mut State<B::Segment>, record: bool, wait: bool) -> bool {
        if state.loans.returning == 0 || self.capture_underway() {
            return false;
        }
        let mut any = false;
        let returning: Vec<((usize, BlockId), usize)> =
            state.loans.blocks.iter().filter(|(_, l)| l.returning).map(|(&key, l)| (key, l.borrower)).collect();
        for ((giver, block), borrower) in returning {
            let ready = match self.donor_marking(state, borrower, giver, record || wait) {
                Donor::Passed | Donor::Ordered => true,
                Donor::NotYet => wait && self.wait_for_arena_mark(state, borrower),
            };
            if ready {
                state.loans.blocks.remove(&(giver, block));
                state.loans.returning -= 1;
                state.free_block(giver, block).expect("a returning block is live in its arena");
                any = true;
            }
        }
        any
    }

    /// Waits on the host for the mark of `arena`'s stream that covers its latest free ([`Pool::donor`] recorded
    /// it), or for the whole device where no such mark could be recorded. Whether the arena's frees have passed.
    fn wait_for_arena_mark(&self, state: &mut State<B::Segment>, arena: usize) -> bool {
        let a = &mut state.arenas[arena];
        match &mut a.mark {
            Some(mark) if mark.epoch > a.freed_epoch => match self.backend.wait_mark(&mark.mark) {
                Ok(()) => {
                    mark.passed = true;
                    true
                }
                Err(e) => {
                    log::warn!("{}: waiting for a stream's mark failed: {e}", self.backend.name());
                    false
                }
            },
            _ => match self.backend.settle() {
                Ok(()) => true,
                Err(e) => {
                    log::warn!("{}: waiting for the device failed: {e}", self.backend.name());
                    false
                }
            },
        }
    }
}
