//! `CudaPool`: a `Pool<CudaBackend>` with PyTorch's `record_stream` semantics on top of the pool's per-stream
//! arenas.
//!
//! The pool alone already guarantees that a block freed on stream S is reused at once on S only. A block that
//! was also used on other streams (marked with [`CudaPool::record_stream`]) must not even go back to S's free
//! list until the work queued on those streams has passed: its free records one event on each extra stream and
//! parks the block in a pending list; the next allocation (or [`CudaPool::process_pending`]) returns the blocks
//! whose events have all completed. Out of memory waits for every pending event, returns those blocks, and
//! retries once before the pool's own release-and-retry gives up.

use super::backend::CudaBackend;
use super::raw;
use crate::{Api, Backend, BlockHandle, Error, Limit, MemoryPool, Pool, PoolStats, Result, StreamId, TrimReport};
use cudarc::driver::CudaEvent;
use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A block whose free waits for events on the streams it was used on.
struct PendingFree {
    block: BlockHandle,
    events: Vec<CudaEvent>,
}

#[derive(Default)]
struct StreamUses {
    /// Block key → extra streams the block was used on (besides the one it was allocated on).
    extra: HashMap<u64, Vec<StreamId>>,
    /// Freed blocks waiting for their events, oldest first.
    pending: Vec<PendingFree>,
    /// Completed events kept for reuse (creating one costs a driver call).
    spare_events: Vec<CudaEvent>,
}

/// A stream-safe caching pool of one CUDA device and placement. `Send + Sync`; share it with `Arc`.
///
/// Lock order: this wrapper's lock, then the pool's; the pool never calls back into the wrapper.
pub struct CudaPool {
    pool: Pool<CudaBackend>,
    uses: Mutex<StreamUses>,
    /// Blocks with recorded streams plus pending frees, published when the lock is let go: while it is 0 (most
    /// programs never record a stream), allocations and frees skip the lock, which would otherwise serialise
    /// every thread of the pool.
    tracked: AtomicUsize,
}

/// [`CudaPool`]'s lock held; publishes the count of tracked blocks when let go.
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
        self.tracked.store(self.uses.extra.len() + self.uses.pending.len(), Ordering::Release);
    }
}

impl CudaPool {
    /// Wraps `pool`.
    pub fn new(pool: Pool<CudaBackend>) -> Self {
        Self { pool, uses: Mutex::new(StreamUses::default()), tracked: AtomicUsize::new(0) }
    }

    /// The wrapped pool, for statistics and byte moves. Freeing through it directly skips the pending-free
    /// protection of blocks marked with [`CudaPool::record_stream`]: free through [`CudaPool::free`].
    pub fn pool(&self) -> &Pool<CudaBackend> {
        &self.pool
    }

    /// The backend.
    pub fn backend(&self) -> &CudaBackend {
        self.pool.backend()
    }

    /// Allocates `bytes` on `stream`, first returning pending frees whose streams have passed them.
    /// O(pending) + [`Pool::allocate`].
    pub fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.allocate_with(|p| p.allocate(bytes, stream))
    }

    /// Like [`CudaPool::allocate`], with the block's bytes set to zero.
    pub fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        self.allocate_with(|p| p.allocate_zeroed(bytes, stream))
    }

    /// Allocates one block per size in `sizes` on `stream` with one pass over the pending frees; on failure
    /// frees what it allocated and returns the error.
    pub fn allocate_batch(&self, sizes: &[u64], stream: StreamId) -> Result<Vec<BlockHandle>> {
        self.allocate_with(|p| super::cache::allocate_batch(p, sizes, stream))
    }

    /// Pre-populates the cache: allocates `count` blocks of each `(size, count)` on `stream`, then frees them
    /// all, so that later requests of those sizes on that stream are cache hits.
    pub fn warm_up(&self, sizes: &[(u64, usize)], stream: StreamId) -> Result<()> {
        self.allocate_with(|p| super::cache::warm_up(p, sizes, stream))
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

    fn allocate_with<T>(&self, allocate: impl Fn(&Pool<CudaBackend>) -> Result<T>) -> Result<T> {
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
        // Refused now rather than at the free, where the event would be recorded on it.
        self.pool.backend().live_stream(stream)?;
        let mut uses = self.uses();
        let streams = uses.extra.entry(block.key()).or_default();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        Ok(())
    }

    /// Frees `block`. A block marked with [`CudaPool::record_stream`] is parked until events recorded now on its
    /// extra streams complete; any other block goes back to its stream's free list at once.
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
        let backend = self.pool.backend();
        let mut events = Vec::with_capacity(streams.len());
        let recorded = backend.bind().and_then(|()| {
            for &stream in &streams {
                let event = match uses.spare_events.pop() {
                    Some(e) => e,
                    None => backend.context().new_event(None).map_err(|e| Error::Driver {
                        backend: backend.name().to_string(),
                        call: "cuEventCreate".into(),
                        message: e.to_string(),
                    })?,
                };
                let live = backend.live_stream(stream)?;
                raw::event_record(&event, &live).map_err(|f| backend.error(f))?;
                events.push(event);
            }
            Ok(())
        });
        if let Err(e) = recorded {
            // Without events, wait for everything instead: always safe.
            log::warn!("{}: recording a stream event failed ({e}); synchronizing instead", backend.name());
            backend.synchronize()?;
            return self.pool.free(block);
        }
        uses.pending.push(PendingFree { block: block.clone(), events });
        Ok(())
    }

    /// Returns the pending frees whose events have completed to the pool. O(pending). Returns how many went
    /// back.
    pub fn process_pending(&self) -> Result<usize> {
        let mut uses = self.uses();
        self.return_completed(&mut uses, false)
    }

    /// Waits for the events of every pending free and returns those blocks to the pool.
    pub fn synchronize_pending(&self) -> Result<usize> {
        let mut uses = self.uses();
        self.return_completed(&mut uses, true)
    }

    /// Blocks freed but still waiting for their streams.
    pub fn pending_frees(&self) -> usize {
        self.uses().pending.len()
    }

    fn return_completed(&self, uses: &mut UsesGuard<'_>, wait: bool) -> Result<usize> {
        if uses.pending.is_empty() {
            return Ok(0);
        }
        let backend = self.pool.backend();
        backend.bind()?;
        let mut returned = 0;
        let mut i = 0;
        while i < uses.pending.len() {
            let mut done = true;
            for event in &uses.pending[i].events {
                let complete = if wait { event.synchronize().map(|()| true) } else { event.try_is_complete() };
                match complete {
                    Ok(true) => {}
                    Ok(false) => {
                        done = false;
                        break;
                    }
                    Err(e) => {
                        return Err(Error::Driver {
                            backend: backend.name().to_string(),
                            call: "cuEventQuery".into(),
                            message: e.to_string(),
                        })
                    }
                }
            }
            if done {
                let PendingFree { block, events } = uses.pending.remove(i);
                uses.spare_events.extend(events);
                self.pool.free(&block)?;
                returned += 1;
            } else {
                i += 1;
            }
        }
        Ok(returned)
    }

    /// Returns completed pending frees, then gives every cached byte back to the device.
    pub fn release_cached(&self) -> TrimReport {
        if let Err(e) = self.process_pending() {
            log::warn!("{}: {e}", self.pool.backend().name());
        }
        self.pool.release_cached()
    }

    /// Device address of a live block's first byte (for pinned memory, its device-mapped address).
    pub fn device_ptr(&self, block: &BlockHandle) -> Result<u64> {
        super::CudaPoolExt::device_ptr(&self.pool, block)
    }

    /// Copies `src` into the block at `offset` with a copy queued on `stream`, then waits for that stream: the
    /// bytes are in place for every later use on `stream`. Refused for read-only blocks after creation.
    pub fn write_on_stream(&self, block: &BlockHandle, offset: u64, src: &[u8], stream: StreamId) -> Result<()> {
        self.refuse_read_only()?;
        super::interop::upload(&self.pool, block, offset, src, stream)
    }

    /// Sets `len` bytes at `offset` of the block to `value`, queued on `stream` (asynchronous). Pinned memory is
    /// filled at once, from the host, under the pool's lock ([`Pool::fill`]), so the fill cannot land after the
    /// block was freed and its memory lent to an owner as a host slice.
    #[allow(unsafe_code)] // Discharges `raw::memset_async`'s contract.
    pub fn fill_async(&self, block: &BlockHandle, offset: u64, len: u64, value: u8, stream: StreamId) -> Result<()> {
        self.refuse_read_only()?;
        let (ptr, host) = super::interop::range(&self.pool, block, offset, len)?;
        let backend = self.pool.backend();
        if host.is_some() {
            return self.pool.fill(block, offset, len, value);
        }
        let stream = backend.live_stream(stream)?;
        backend.bind()?;
        // SAFETY: `range` just checked the range against the block, found live in this pool; the block is device
        // memory (pinned went to the host path above), which is never lent as a host slice.
        unsafe { raw::memset_async(ptr, value, len, &stream) }.map_err(|f| backend.error(f))
    }

    fn refuse_read_only(&self) -> Result<()> {
        if self.pool.backend().placement() == crate::PoolPlacement::ReadOnly {
            return Err(Error::Unsupported {
                backend: self.pool.backend().name().to_string(),
                what: "write: read-only memory is filled once, when it is allocated".into(),
            });
        }
        Ok(())
    }
}

impl Drop for CudaPool {
    fn drop(&mut self) {
        // Pending blocks' streams may still use them: wait, then let the pool release everything.
        if let Err(e) = self.synchronize_pending() {
            log::error!("{}: {e}", self.pool.backend().name());
        }
    }
}

impl crate::block::sealed::Sealed for CudaPool {}

impl MemoryPool for CudaPool {
    fn name(&self) -> &str {
        self.pool.backend().name()
    }
    fn kind(&self) -> Api {
        Api::Cuda
    }
    fn alignment(&self) -> u64 {
        MemoryPool::alignment(&self.pool)
    }
    fn capacity(&self) -> u64 {
        MemoryPool::capacity(&self.pool)
    }
    fn free_memory(&self) -> u64 {
        MemoryPool::free_memory(&self.pool)
    }
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        CudaPool::allocate(self, bytes, stream)
    }
    fn allocate_zeroed(&self, bytes: u64, stream: StreamId) -> Result<BlockHandle> {
        CudaPool::allocate_zeroed(self, bytes, stream)
    }
    fn allocate_filled(&self, data: &[u8], stream: StreamId) -> Result<BlockHandle> {
        // Through the stream-ordered upload, which read-only pools accept.
        self.allocate_with(|p| super::CudaPoolExt::upload_read_only(p, data, stream))
    }
    fn free(&self, block: &BlockHandle) -> Result<()> {
        CudaPool::free(self, block)
    }
    fn write(&self, block: &BlockHandle, offset: u64, src: &[u8]) -> Result<()> {
        self.pool.write(block, offset, src)
    }
    fn read(&self, block: &BlockHandle, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.pool.read(block, offset, dst)
    }
    fn fill(&self, block: &BlockHandle, offset: u64, len: u64, value: u8) -> Result<()> {
        self.pool.fill(block, offset, len, value)
    }
    fn host_ptr(&self, block: &BlockHandle) -> Option<NonNull<u8>> {
        self.pool.host_ptr(block)
    }
    fn settle(&self) -> Result<()> {
        self.pool.backend().settle()
    }
    fn stats(&self) -> PoolStats {
        self.pool.stats()
    }
    fn reserved_bytes(&self) -> u64 {
        self.pool.reserved_bytes()
    }
    fn unused_bytes(&self) -> u64 {
        self.pool.unused_bytes()
    }
    fn snapshot(&self) -> crate::pool::PoolSnapshot {
        self.pool.snapshot()
    }
    fn reset_peaks(&self) {
        self.pool.reset_peaks()
    }
    fn mark_step(&self) -> crate::pool::StepReport {
        self.pool.mark_step()
    }
    fn release_cached(&self) -> TrimReport {
        CudaPool::release_cached(self)
    }
    fn cleanup(&self, idle_rounds: u64) -> TrimReport {
        if let Err(e) = self.process_pending() {
            log::warn!("{}: {e}", self.pool.backend().name());
        }
        self.pool.cleanup(idle_rounds)
    }
    fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        self.pool.set_limit(limit)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
