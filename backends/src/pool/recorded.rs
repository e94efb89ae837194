//! `StreamPool`: a [`Pool`] with PyTorch's `record_stream` semantics on top of the pool's per-stream arenas, over
//! any backend that marks its streams ([`Backend::mark_stream`]).
//!
//! The pool alone already guarantees that a block freed on stream S is reused at once on S only. A block that
//! was also used on other streams (marked with [`StreamPool::record_stream`]) must not even go back to S's free
//! list until the work queued on those streams has passed: its free records one mark on each extra stream and
//! parks the block in a pending list; the next allocation (or [`StreamPool::process_pending`]) returns the blocks
//! whose marks have all passed. Out of memory waits for every pending mark, returns those blocks, and retries
//! once before the pool's own release-and-retry gives up.
//!
//! CUDA's pools are `StreamPool<CudaBackend>` (`crate::cuda::CudaPool`); the C ABI runs the same code over a
//! simulated device, whose streams a test can hold back ([`crate::SimBackend::hold_stream`]).

use super::Pool;
use crate::{Backend, BlockHandle, Error, Limit, PoolStats, Result, StreamId, StreamMark, TrimReport};
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A block whose free waits for marks on the streams it was used on.
struct PendingFree {
    block: BlockHandle,
    marks: Vec<StreamMark>,
}

#[derive(Default)]
struct StreamUses {
    /// Block key → extra streams the block was used on (besides the one it was allocated on).
    extra: HashMap<u64, Vec<StreamId>>,
    /// Freed blocks waiting for their marks, oldest first.
    pending: Vec<PendingFree>,
    /// Blocks freed during a capture with the extra streams they were used on: no mark can be recorded and
    /// queried then (see [`Pool::begin_capture`]), so they are held until the capture ends, then marked.
    deferred: Vec<(BlockHandle, Vec<StreamId>)>,
}

/// A stream-safe caching pool of one device and placement. `Send + Sync`; share it with `Arc`.
///
/// Lock order: this wrapper's lock, then the pool's; the pool never calls back into the wrapper.
pub struct StreamPool<B: Backend> {
    pool: Pool<B>,
    uses: Mutex<StreamUses>,
    /// Blocks with recorded streams plus pending frees, published when the lock is let go: while it is 0 (most
    /// programs never record a stream), allocations and frees skip the lock, which would otherwise serialise
    /// every thread of the pool.
    tracked: AtomicUsize,
}

/// [`StreamPool`]'s lock held; publishes the count of tracked blocks when let go.
struct UsesGuard<'a> {
    uses: MutexGuard<'a, StreamUses>,
    tracked: &'a AtomicUsize,
}

impl Deref for UsesGuard<'_> {
    type Target = StreamUses;
    fn deref(&self) -> &StreamUses {
        &self.uses
    }
}

impl DerefMut for UsesGuard<'_> {
    fn deref_mut(&mut self) -> &mut StreamUses {
        &mut self.uses
    }
}

impl Drop for UsesGuard<'_> {
    fn drop(&mut self) {
        // Release: a thread that sees 0 also sees every return to the pool made under the lock before.
        let tracked = self.uses.extra.len() + self.uses.pending.len() + self.uses.deferred.len();
        self.tracked.store(tracked, Ordering::Release);
    }
}

impl<B: Backend> StreamPool<B> {
    /// Wraps `pool`.
    pub fn new(pool: Pool<B>) -> Self {
        Self { pool, uses: Mutex::new(StreamUses::default()), tracked: AtomicUsize::new(0) }
    }

    /// The wrapped pool, for statistics and byte moves. Freeing through it directly skips the pending-free
    /// protection of blocks marked with [`StreamPool::record_stream`]: free through [`StreamPool::free`].
    pub fn pool(&self) -> &Pool<B> {
        &self.pool
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        self.pool.backend()
    }

    /// Allocates `bytes` on `stream`, first returning pending frees whose streams have passed them.
    /// O(pending) + [`Pool::allocate`].
    pub fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.allocate_with(|p| p.allocate(bytes, stream))
    }

    /// Like [`StreamPool::allocate`], with the block's bytes set to zero.
    pub fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.allocate_with(|p| p.allocate_zeroed(bytes, stream))
    }

    /// The lock over recorded streams and pending frees.
    fn uses(&self) -> UsesGuard<'_> {
        UsesGuard { uses: self.uses.lock(), tracked: &self.tracked }
    }

    /// Whether any block has recorded streams or a pending free. A block's `record_stream` happens-before its
    /// free in any correct program (the same thread, or a hand-over that synchronises), so a free that reads 0
    /// here cannot miss its own block's recorded streams.
    #[inline(always)]
    fn tracks_nothing(&self) -> bool {
        self.tracked.load(Ordering::Acquire) == 0
    }

    /// Runs `allocate` on the pool: pending frees whose marks passed go back first; out of memory waits for every
    /// pending free and tries once more.
    pub(crate) fn allocate_with<T>(&self, allocate: impl Fn(&Pool<B>) -> Result<T>) -> Result<T> {
        if self.tracks_nothing() {
            return match allocate(&self.pool) {
                Err(e @ Error::OutOfMemory { .. }) => {
                    // A free may have gone pending since: wait for those, as the locked path does.
                    let mut uses = self.uses();
                    if uses.pending.is_empty() {
                        return Err(e);
                    }
                    self.return_completed(&mut uses, true)?;
                    allocate(&self.pool)
                }
                other => other,
            };
        }
        let mut uses = self.uses();
        self.return_completed(&mut uses, false)?;
        match allocate(&self.pool) {
            Err(Error::OutOfMemory { .. }) if !uses.pending.is_empty() => {
                self.return_completed(&mut uses, true)?;
                allocate(&self.pool)
            }
            other => other,
        }
    }

    /// Marks `block` as used on `stream` (PyTorch's `record_stream`): when it is freed, it goes back to the pool
    /// only after the work queued on `stream` up to the free has completed. Marking the stream the block was
    /// allocated on is harmless. O(streams of the block).
    pub fn record_stream(&self, block: &BlockHandle, stream: StreamId) -> Result<()> {
        if self.pool.segment_of(block).is_none() {
            return Err(Error::UnknownBlock(format!("{block:?} in pool {}", self.pool.backend().name())));
        }
        // Refused now rather than at the free, where the mark would be recorded on it.
        self.pool.backend().check_stream(stream)?;
        let mut uses = self.uses();
        let streams = uses.extra.entry(block.key()).or_default();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        Ok(())
    }

    /// Frees `block`. A block marked with [`StreamPool::record_stream`] is parked until marks recorded now on its
    /// extra streams pass; any other block goes back to its stream's free list at once.
    pub fn free(&self, block: &BlockHandle) -> Result<()> {
        if self.tracks_nothing() {
            return self.pool.free(block);
        }
        let mut uses = self.uses();
        // Most blocks are used on one stream only: skip the hash lookup when nothing was recorded.
        if uses.extra.is_empty() {
            return self.pool.free(block);
        }
        // Checked before the recorded streams are taken: a stale handle's key is that of whatever block holds
        // the slot now, whose recorded streams must stay.
        if self.pool.segment_of(block).is_none() {
            return Err(Error::UnknownBlock(format!("{block:?} in pool {}", self.pool.backend().name())));
        }
        let Some(streams) = uses.extra.remove(&block.key()) else {
            return self.pool.free(block);
        };
        if self.pool.capture_underway() {
            uses.deferred.push((block.clone(), streams));
            return Ok(());
        }
        self.free_after_marks(&mut uses, block, &streams)
    }

    /// Frees `block` once marks recorded now on `streams` pass: parks it among the pending frees.
    fn free_after_marks(&self, uses: &mut UsesGuard<'_>, block: &BlockHandle, streams: &[StreamId]) -> Result<()> {
        let backend = self.pool.backend();
        let mut marks = Vec::with_capacity(streams.len());
        let mut failure = None;
        for &stream in streams {
            match backend.mark_stream(stream) {
                Ok(Some(mark)) => marks.push(mark),
                // A stream with no work behind the host's back: nothing to wait for.
                Ok(None) => {}
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failure {
            // Without marks, wait for everything instead: always safe.
            log::warn!("{}: recording a stream mark failed ({e}); synchronizing instead", backend.name());
            marks.into_iter().for_each(|m| backend.release_mark(m));
            backend.settle()?;
            return self.pool.free(block);
        }
        if marks.is_empty() {
            return self.pool.free(block);
        }
        uses.pending.push(PendingFree { block: block.clone(), marks });
        Ok(())
    }

    /// Returns the pending frees whose marks have passed to the pool. O(pending). Returns how many went back.
    pub fn process_pending(&self) -> Result<usize> {
        let mut uses = self.uses();
        self.return_completed(&mut uses, false)
    }

    /// Waits for the marks of every pending free and returns those blocks to the pool.
    pub fn synchronize_pending(&self) -> Result<usize> {
        let mut uses = self.uses();
        self.return_completed(&mut uses, true)
    }

    /// Blocks freed but still waiting for their streams.
    pub fn pending_frees(&self) -> usize {
        self.uses().pending.len()
    }

    fn return_completed(&self, uses: &mut UsesGuard<'_>, wait: bool) -> Result<usize> {
        // During a capture no mark may be queried or waited for: pending frees stay pending.
        if uses.pending.is_empty() || self.pool.capture_underway() {
            return Ok(0);
        }
        let backend = self.pool.backend();
        let mut returned = 0;
        let mut i = 0;
        while i < uses.pending.len() {
            let mut done = true;
            for mark in &uses.pending[i].marks {
                if wait {
                    backend.wait_mark(mark)?;
                } else if !backend.mark_passed(mark) {
                    done = false;
                    break;
                }
            }
            if done {
                let PendingFree { block, marks } = uses.pending.remove(i);
                marks.into_iter().for_each(|m| backend.release_mark(m));
                self.pool.free(&block)?;
                returned += 1;
            } else {
                i += 1;
            }
        }
        Ok(returned)
    }

    /// A capture began on the pool's device ([`Pool::begin_capture`]): until it ends, frees that must wait for
    /// other streams are held back unmarked, and pending frees are not queried.
    pub fn begin_capture(&self) {
        self.pool.begin_capture();
    }

    /// A capture ended ([`Pool::end_capture`]). Once none is underway, the blocks freed during captures get their
    /// marks, recorded now on the streams they were used on, and wait for them as any pending free does.
    pub fn end_capture(&self) -> Result<()> {
        self.pool.end_capture();
        if self.pool.capture_underway() {
            return Ok(());
        }
        let mut uses = self.uses();
        let deferred = std::mem::take(&mut uses.deferred);
        let mut first_error = None;
        for (block, streams) in deferred {
            if let Err(e) = self.free_after_marks(&mut uses, &block, &streams) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Blocks freed during a capture and held until it ends.
    pub fn deferred_frees(&self) -> usize {
        self.uses().deferred.len()
    }

    /// Returns completed pending frees, then gives every cached byte back to the device.
    pub fn release_cached(&self) -> TrimReport {
        if let Err(e) = self.process_pending() {
            log::warn!("{}: {e}", self.pool.backend().name());
        }
        self.pool.release_cached()
    }

    /// Waits for the pending frees' streams and returns those blocks, so that their pages are not kept, then
    /// puts the pool to sleep ([`Pool::sleep`]).
    pub fn sleep(&self, action: crate::pool::SleepAction) -> Result<crate::pool::SleepReport> {
        self.synchronize_pending()?;
        self.pool.sleep(action)
    }

    /// Returns completed pending frees, then frees segments idle for `idle_rounds` cleanup rounds.
    pub fn cleanup(&self, idle_rounds: u64) -> TrimReport {
        if let Err(e) = self.process_pending() {
            log::warn!("{}: {e}", self.pool.backend().name());
        }
        self.pool.cleanup(idle_rounds)
    }

    /// Device address of a live block's first byte, where the backend's memory has one
    /// ([`Backend::device_address`]); `None` for a backend without device addresses.
    pub fn device_address(&self, block: &BlockHandle) -> Result<Option<u64>> {
        let (segment, base) = self
            .pool
            .segment_of(block)
            .ok_or_else(|| Error::UnknownBlock(format!("{block:?} in pool {}", self.pool.backend().name())))?;
        Ok(self.pool.backend().device_address(&segment).map(|a| a + base))
    }

    /// Statistics now. O(1).
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Caps the pool's reserved bytes (`None` removes the cap).
    pub fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        self.pool.set_limit(limit)
    }
}

impl<B: Backend> Drop for StreamPool<B> {
    fn drop(&mut self) {
        // Pending blocks' streams may still use them: wait, then let the pool release everything.
        if let Err(e) = self.synchronize_pending() {
            log::error!("{}: {e}", self.pool.backend().name());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::SleepAction;
    use crate::{PoolConfig, SimBackend};

    const MIB: u64 = 1 << 20;

    fn sim_pool() -> StreamPool<SimBackend> {
        StreamPool::new(Pool::new(SimBackend::new("sim", 64 * MIB), PoolConfig::default()).unwrap())
    }

    /// A block used on a second stream that is still busy is not reused until that stream passes the free.
    #[test]
    fn a_recorded_stream_holds_the_block_until_its_work_passes() {
        let pool = sim_pool();
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = pool.allocate(MIB, s1).unwrap();
        let address = pool.device_address(&a).unwrap().unwrap();
        pool.record_stream(&a, s2).unwrap();
        pool.backend().hold_stream(s2);
        pool.free(&a).unwrap();
        assert_eq!(pool.pending_frees(), 1);
        let b = pool.allocate(MIB, s1).unwrap();
        assert_ne!(pool.device_address(&b).unwrap().unwrap(), address, "reused while s2 may still use it");
        assert_eq!(pool.pending_frees(), 1);
        pool.backend().finish_stream(s2);
        assert_eq!(pool.process_pending().unwrap(), 1);
        let c = pool.allocate(MIB, s1).unwrap();
        assert_eq!(pool.device_address(&c).unwrap().unwrap(), address, "reused once s2 passed");
        assert_eq!(pool.backend().stream_log().marks_live, 0, "every mark given back");
        for block in [b, c] {
            pool.free(&block).unwrap();
        }
        assert_eq!(pool.stats().allocated_bytes.current, 0);
    }

    /// Out of memory waits for the pending frees (a host wait on the held stream) and retries.
    #[test]
    fn out_of_memory_waits_for_pending_frees() {
        let pool = StreamPool::new(Pool::new(SimBackend::plain("sim", 8 * MIB), PoolConfig::default()).unwrap());
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = pool.allocate(6 * MIB, s1).unwrap();
        pool.record_stream(&a, s2).unwrap();
        pool.backend().hold_stream(s2);
        pool.free(&a).unwrap();
        let b = pool.allocate(6 * MIB, s1).expect("served after waiting for s2");
        assert_eq!(pool.pending_frees(), 0);
        assert_eq!(pool.backend().stream_log().host_waits, 1);
        pool.free(&b).unwrap();
    }

    /// Refusals of a stale handle; a block recorded on its own stream goes back once that stream passes.
    #[test]
    fn stale_handles_are_refused_and_the_own_stream_is_free() {
        let pool = sim_pool();
        let a = pool.allocate(MIB, StreamId(1)).unwrap();
        pool.record_stream(&a, StreamId(1)).unwrap();
        pool.free(&a).unwrap();
        assert_eq!(pool.process_pending().unwrap(), 1, "its own stream passed");
        assert_eq!(pool.pending_frees(), 0);
        let err = pool.record_stream(&a, StreamId(2)).unwrap_err();
        assert!(matches!(err, Error::UnknownBlock(_)), "{err}");
        let err = pool.free(&a).unwrap_err();
        assert!(matches!(err, Error::UnknownBlock(_)), "{err}");
        let err = pool.device_address(&a).unwrap_err();
        assert!(matches!(err, Error::UnknownBlock(_)), "{err}");
    }

    /// A pending free whose streams passed serves the next allocation of its size on its stream, with no call to
    /// `process_pending` between: the allocation returns it first.
    #[test]
    fn an_allocation_returns_the_pending_frees_whose_streams_passed() {
        let pool = sim_pool();
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = pool.allocate(MIB, s1).unwrap();
        let address = pool.device_address(&a).unwrap().unwrap();
        pool.record_stream(&a, s2).unwrap();
        pool.backend().hold_stream(s2);
        pool.free(&a).unwrap();
        pool.backend().finish_stream(s2);
        let b = pool.allocate(MIB, s1).unwrap();
        assert_eq!(pool.device_address(&b).unwrap().unwrap(), address, "the passed pending free served it");
        assert_eq!(pool.pending_frees(), 0);
        pool.free(&b).unwrap();
    }

    /// `synchronize_pending` waits for every pending free's streams on the host and returns them all.
    #[test]
    fn synchronize_pending_returns_every_pending_free_of_a_stream_pool() {
        let pool = sim_pool();
        let (s1, s2) = (StreamId(1), StreamId(2));
        let blocks: Vec<_> = (0..2).map(|_| pool.allocate(MIB, s1).unwrap()).collect();
        pool.backend().hold_stream(s2);
        for block in &blocks {
            pool.record_stream(block, s2).unwrap();
            pool.free(block).unwrap();
        }
        assert_eq!(pool.pending_frees(), 2);
        assert_eq!(pool.process_pending().unwrap(), 0, "s2 is held");
        assert_eq!(pool.synchronize_pending().unwrap(), 2);
        assert_eq!(pool.pending_frees(), 0);
        assert!(pool.backend().stream_log().host_waits > 0, "the host waited for s2");
        assert_eq!(pool.stats().allocated_bytes.current, 0);
    }

    /// During a capture pending frees are neither queried nor returned, even when their streams passed; they go
    /// back once it ends.
    #[test]
    fn pending_frees_of_a_stream_pool_stay_during_a_capture() {
        let pool = sim_pool();
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = pool.allocate(MIB, s1).unwrap();
        pool.record_stream(&a, s2).unwrap();
        pool.backend().hold_stream(s2);
        pool.free(&a).unwrap();
        pool.backend().finish_stream(s2);
        pool.backend().begin_capture(s1);
        pool.begin_capture();
        assert_eq!(pool.process_pending().unwrap(), 0, "no mark is queried during a capture");
        assert_eq!(pool.pending_frees(), 1);
        pool.backend().end_capture(s1);
        pool.end_capture().unwrap();
        assert_eq!(pool.process_pending().unwrap(), 1);
        assert_eq!(pool.backend().stream_log().capture_violations, 0);
    }

    /// Out of memory with recorded streams but no pending free fails once: nothing to wait for, no second try.
    #[test]
    fn out_of_memory_of_a_stream_pool_without_pending_frees_fails_once() {
        let pool = StreamPool::new(Pool::new(SimBackend::plain("sim", 8 * MIB), PoolConfig::default()).unwrap());
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = pool.allocate(6 * MIB, s1).unwrap();
        pool.record_stream(&a, s2).unwrap();
        let err = pool.allocate(6 * MIB, s1).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
        let stats = pool.stats();
        assert_eq!((stats.num_ooms, stats.num_alloc_retries), (1, 1), "one attempt and the pool's own retry");
        pool.free(&a).unwrap();
    }

    /// What the wrapper passes through to its pool: addresses of blocks inside a segment, zeroed allocations,
    /// statistics, the limit, trimming (after the pending frees whose streams passed go back) and sleep.
    #[test]
    fn a_stream_pool_passes_addresses_statistics_limits_trims_and_sleep_to_its_pool() {
        let pool = sim_pool();
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = pool.allocate(4096, s1).unwrap();
        let b = pool.allocate(4096, s1).unwrap();
        assert_eq!(a.segment, b.segment, "two small blocks of one segment");
        let (at_a, at_b) = (pool.device_address(&a).unwrap().unwrap(), pool.device_address(&b).unwrap().unwrap());
        assert_eq!(i128::from(at_b) - i128::from(at_a), i128::from(b.offset) - i128::from(a.offset));
        // The simulated device holds no bytes: zeroed blocks on host memory.
        let host =
            StreamPool::new(Pool::new(crate::HostBackend::new("host", 64 * MIB), PoolConfig::default()).unwrap());
        let dirty = host.allocate(4096, s1).unwrap();
        host.pool().fill(&dirty, 0, 4096, 0xAB).unwrap();
        host.free(&dirty).unwrap();
        let zeroed = host.allocate_zeroed(4096, s1).unwrap();
        let mut bytes = [1u8; 4096];
        host.pool().read(&zeroed, 0, &mut bytes).unwrap();
        assert!(bytes.iter().all(|&b| b == 0), "zeroed");
        host.free(&zeroed).unwrap();
        let stats = pool.stats();
        assert_eq!((stats.name.as_str(), stats.active_blocks.current), ("sim", 2));
        pool.set_limit(Some(Limit::Bytes(16 * MIB))).unwrap();
        assert_eq!(pool.stats().limit_bytes, Some(16 * MIB));
        assert!(matches!(pool.allocate(32 * MIB, s1), Err(Error::OutOfMemory { .. })));
        pool.set_limit(None).unwrap();
        // A block used on s2, freed while s2 runs, then s2 passes: trimming returns it first, then releases.
        let c = pool.allocate(8 * MIB, s1).unwrap();
        pool.record_stream(&c, s2).unwrap();
        pool.backend().hold_stream(s2);
        pool.free(&c).unwrap();
        pool.backend().finish_stream(s2);
        let report = pool.cleanup(0);
        assert_eq!(pool.pending_frees(), 0, "cleanup returned the pending free");
        assert!(report.bytes_released >= 8 * MIB, "{report:?}");
        let d = pool.allocate(8 * MIB, s1).unwrap();
        pool.record_stream(&d, s2).unwrap();
        pool.backend().hold_stream(s2);
        pool.free(&d).unwrap();
        pool.backend().finish_stream(s2);
        let report = pool.release_cached();
        assert_eq!(pool.pending_frees(), 0, "release_cached returned the pending free");
        assert!(report.bytes_released >= 8 * MIB, "{report:?}");
        for block in [a, b] {
            pool.free(&block).unwrap();
        }
        // Sleep waits for a held stream's pending free, then sleeps (a pool of large blocks only: small ones lie
        // in plain segments, which cannot sleep).
        let pool = sim_pool();
        let e = pool.allocate(8 * MIB, s1).unwrap();
        pool.record_stream(&e, s2).unwrap();
        pool.backend().hold_stream(s2);
        pool.free(&e).unwrap();
        pool.sleep(SleepAction::Discard).unwrap();
        assert_eq!(pool.pending_frees(), 0, "sleep waited for s2");
        assert_eq!(pool.pool().sleeping(), Some(SleepAction::Discard));
        pool.pool().wake().unwrap();
    }

    /// Dropping a stream pool waits for its pending frees' streams and returns those blocks before the pool
    /// goes: the pool then holds no live block, so it does not wait for the whole device.
    #[test]
    fn a_dropped_stream_pool_returns_its_pending_frees_first() {
        use crate::testing::fault::{FaultKind, FaultyBackend};
        let (backend, faults) = FaultyBackend::new(SimBackend::new("sim", 64 * MIB));
        let pool = StreamPool::new(Pool::new(backend, PoolConfig::default()).unwrap());
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = pool.allocate(MIB, s1).unwrap();
        pool.record_stream(&a, s2).unwrap();
        pool.backend().inner().hold_stream(s2);
        pool.free(&a).unwrap();
        assert_eq!(pool.pending_frees(), 1);
        drop(pool);
        assert_eq!(faults.calls(FaultKind::Settle), 0, "no live block left for the pool's drop to wait for");
        faults.check_released().unwrap();
    }
}
