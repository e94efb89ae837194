//! Sleep and wake: a pool gives its physical memory back to the device and takes it again later at the same
//! addresses, so that device pointers held by kernels and captured CUDA graphs stay valid (what an inference
//! server does to share a GPU between a model and something else).
//!
//! Only virtual reservations can sleep: their pages are unmapped and their addresses stay reserved. A pool made
//! for sleeping (a tagged one, [`crate::PoolConfig::tag`]) keeps every block, small ones too, in reservations.
//! Plain segments cannot: their memory and their address are one allocation (`cuMemAlloc`), and on OpenCL and
//! wgpu a new buffer is a new object (`cl_mem`, `wgpu::Buffer`) that the kernel arguments and bind groups a
//! program already made do not see.
//!
//! Sleeping, the pool waits for the device's queued work, gives back its cached memory, copies the pages under
//! live blocks into one host store when asked to offload, then unmaps them; while it sleeps it refuses
//! allocations and every access to its blocks ([`crate::Error::Asleep`]), and frees are bookkeeping only.
//! Waking maps new pages over the same ranges and copies the offloaded bytes back, all or nothing.

use super::books::sleep::{SleepAction, Sleeping, SleepingRange};
use super::state::State;
use super::Pool;
use crate::engine::SegmentId;
use crate::{Backend, Error, HostStore, Result};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest tag ([`crate::PoolConfig::tag`]), in bytes.
pub const MAX_TAG_LEN: usize = 128;

/// Checks a tag: 1 to [`MAX_TAG_LEN`] bytes, no control characters and no comma (the C ABI's list separator).
pub fn check_tag(tag: &str) -> Result<()> {
    let bad = tag.is_empty() || tag.len() > MAX_TAG_LEN || tag.chars().any(|c| c.is_control() || c == ',');
    if bad {
        return Err(Error::InvalidConfig(format!(
            "tag {tag:?}: a tag has 1 to {MAX_TAG_LEN} bytes, without control characters or commas"
        )));
    }
    Ok(())
}

/// What a [`Pool::sleep`] did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SleepReport {
    /// Device bytes given back (the pages under live blocks; the cached pages released first are in
    /// `cached_released`).
    pub bytes_released: u64,
    /// Cached device bytes given back before the live blocks' pages.
    pub cached_released: u64,
    /// Bytes copied to host memory.
    pub bytes_offloaded: u64,
    /// Live blocks asleep.
    pub blocks: u64,
    /// Page-locked host memory holds the offloaded bytes.
    pub pinned: bool,
    /// Time the copies to the host took.
    #[serde(with = "seconds")]
    pub copy_time: Duration,
    /// Time the whole sleep took.
    #[serde(with = "seconds")]
    pub elapsed: Duration,
}

/// What a [`Pool::wake`] did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WakeReport {
    /// Device bytes mapped again.
    pub bytes_mapped: u64,
    /// Bytes copied back from host memory.
    pub bytes_restored: u64,
    /// Time the copies from the host took.
    #[serde(with = "seconds")]
    pub copy_time: Duration,
    /// Time the whole wake took.
    #[serde(with = "seconds")]
    pub elapsed: Duration,
}

mod seconds {
    pub fn serialize<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

impl<S> State<S> {
    /// Host memory held for offloading: a sleeping pool's store, or the one kept after a wake.
    pub(super) fn host_store_bytes(&self) -> u64 {
        let asleep = self.sleep.as_ref().and_then(|s| s.store.as_ref());
        asleep.or(self.host_store.as_ref()).map_or(0, HostStore::len)
    }
}

/// The most bytes a wake maps before the copy back of what it mapped starts ([`Pool::wake`]): small enough that
/// mapping the first piece delays the copies little, large enough that each copy costs little more than its bytes.
const WAKE_PIECE: u64 = 64 << 20;

/// A piece of a sleeping range, as the wake maps and restores it.
struct Piece<S> {
    handle: S,
    arena: usize,
    segment: SegmentId,
    stream: crate::StreamId,
    offset: u64,
    len: u64,
    /// Where its bytes lie in the host store.
    at: usize,
}

/// Copies of live blocks' device memory that let go of the pool's lock ([`Pool::write`], [`Pool::read`],
/// [`Pool::fill`]): each is counted while it runs, having started under the lock, so that a sleep, which takes the
/// lock first, waits for those already running and no other starts before it is done.
#[derive(Debug, Default)]
pub(super) struct CopiesInFlight(AtomicU64);

/// One counted copy; uncounted when dropped.
pub(super) struct Copy<'a>(&'a AtomicU64);

impl CopiesInFlight {
    /// Counts a copy; call with the pool's lock held.
    pub(super) fn start(&self) -> Copy<'_> {
        self.0.fetch_add(1, Ordering::Acquire);
        Copy(&self.0)
    }

    /// Waits until no counted copy runs; call with the pool's lock held, so that none starts meanwhile.
    fn wait_idle(&self) {
        let mut spins = 0u32;
        while self.0.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Copy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Bit of [`Pool::detour`]: the pool sleeps, allocations are refused.
pub(super) const ASLEEP: u8 = 2;

impl<B: Backend> Pool<B> {
    /// The pool's name in errors: the backend's, with the tag.
    pub(super) fn display_name(&self) -> String {
        match &self.config.tag {
            Some(tag) => format!("{} [tag {tag}]", self.backend.name()),
            None => self.backend.name().to_string(),
        }
    }

    /// The error for `what` while the pool sleeps.
    #[cold]
    pub(super) fn asleep(&self, what: &str) -> Error {
        Error::Asleep { pool: self.display_name(), what: what.into() }
    }

    /// Whether the pool sleeps, and how its blocks' bytes went.
    pub fn sleeping(&self) -> Option<SleepAction> {
        self.state().lock().sleep.as_ref().map(|s| s.action)
    }

    /// Gives the pool's physical memory back to the device while keeping every block's address: waits for the
    /// device's queued work, releases cached memory, copies the pages under live blocks to host memory
    /// (`Offload`) or drops them (`Discard`), and unmaps them. Until [`Pool::wake`] the pool refuses allocations
    /// and every access to its blocks with [`Error::Asleep`]; frees are taken. O(segments + free blocks + bytes
    /// offloaded).
    ///
    /// Errors, changing nothing: [`Error::Unsupported`] for a pool whose live blocks lie in plain segments (see
    /// the module's documentation) or that serves planned steps or stitched blocks; [`Error::Asleep`] if it
    /// sleeps already; the device's error if the host store or a copy fails.
    pub fn sleep(&self, action: SleepAction) -> Result<SleepReport> {
        let start = Instant::now();
        if self.capture_underway() {
            return Err(Error::Unsupported {
                backend: self.display_name(),
                what: "sleep during a stream capture (a CUDA graph being recorded may use these pages)".into(),
            });
        }
        // Kernels queued on the blocks must have run before their pages are copied or unmapped.
        self.backend.settle()?;
        self.drain_thread_caches(true);
        let mut state = self.folded_state();
        if state.sleep.is_some() {
            return Err(self.asleep("sleep"));
        }
        self.check_can_sleep(&state)?;
        // Refused from here on, the thread caches' lock-free path included.
        self.detour.fetch_or(ASLEEP, Ordering::Relaxed);
        let result = self.sleep_locked(&mut state, action, start);
        // A failed sleep leaves the pool awake, unless it could not undo what it did (see `undo_sleep`).
        if result.is_err() && state.sleep.is_none() {
            self.detour.fetch_and(!ASLEEP, Ordering::Relaxed);
        }
        result
    }

    fn check_can_sleep(&self, state: &State<B::Segment>) -> Result<()> {
        let refuse =
            |why: String| Err(Error::Unsupported { backend: self.display_name(), what: format!("sleep: {why}") });
        if self.detour.load(Ordering::Relaxed) & super::STEPPING != 0 {
            return refuse("it serves planned steps (mark_step); a tagged pool plans none".into());
        }
        // A pool without live blocks in plain segments can sleep: its cached segments go back, nothing is copied.
        let plain: u64 = state
            .arenas
            .iter()
            .filter(|arena| !arena.virtual_segments)
            .map(|arena| arena.engine().stats().allocated_bytes)
            .sum();
        if plain == 0 {
            return Ok(());
        }
        let why = if self.page_size.is_none() {
            "the device has no virtual memory, or UMM_SEGMENT_MODE=plain"
        } else {
            "only a tagged pool keeps every block, small ones too, in virtual reservations"
        };
        refuse(format!(
            "{plain} bytes of live blocks lie in plain segments, whose memory cannot be given back without giving \
             up their addresses ({why}; a new OpenCL or wgpu buffer would be a new object that kernels already \
             bound do not see); sleep needs virtual reservations, as CUDA with virtual memory management has them"
        ))
    }

    fn sleep_locked(&self, state: &mut State<B::Segment>, action: SleepAction, start: Instant) -> Result<SleepReport> {
        // Copies that started before the lock was taken finish before their pages are copied or unmapped.
        self.copies.wait_idle();
        let cached = self.release_cached_locked(state, 0, u64::MAX).bytes_released;
        let mut ranges = Vec::new();
        for (a, arena) in state.arenas.iter().enumerate().filter(|(_, arena)| arena.virtual_segments) {
            for (index, entry) in arena.segments.iter().enumerate() {
                if entry.is_none() {
                    continue;
                }
                let segment = SegmentId(index as u32);
                for (offset, len) in arena.engine().backed_ranges(segment) {
                    ranges.push(SleepingRange { arena: a, segment, offset, len });
                }
            }
        }
        let bytes: u64 = ranges.iter().map(|r| r.len).sum();
        let mut report = SleepReport {
            cached_released: cached,
            blocks: state.stats.active_blocks.current,
            bytes_released: bytes,
            ..SleepReport::default()
        };
        let mut store = match action {
            // Nothing to copy: no host memory is taken.
            SleepAction::Discard => None,
            SleepAction::Offload if bytes == 0 => None,
            SleepAction::Offload => Some(match state.host_store.take() {
                Some(store) if store.len() >= bytes => store,
                _ => self.backend.host_store(bytes)?,
            }),
        };
        let pieces = self.pieces(state, &ranges);
        let (unmapped, failure, copy_time) = self.copy_and_unmap(&pieces, store.as_mut());
        state.stats.num_device_free += unmapped as u64;
        state.stats.num_device_calls += unmapped as u64;
        self.backend.release_spare_pages();
        if let Some(e) = failure {
            return self.undo_sleep(state, action, &pieces[..unmapped], store, e);
        }
        if let Some(store) = &store {
            (report.copy_time, report.bytes_offloaded, report.pinned) = (copy_time, bytes, store.is_pinned());
        }
        state.sleep = Some(Sleeping { action, ranges, store, bytes });
        state.update_reserved();
        report.elapsed = start.elapsed();
        Ok(report)
    }

    /// Unmaps every piece; with a store, copies each one's bytes into it first, and unmaps it on a second thread
    /// while the next one is copied, so that a sleep takes about as long as its copies. Returns how many pieces
    /// were unmapped (all but those from the first failed copy on), that failure, and the time spent copying.
    fn copy_and_unmap(
        &self,
        pieces: &[Piece<B::Segment>],
        store: Option<&mut HostStore>,
    ) -> (usize, Option<Error>, Duration) {
        // The device's work was waited for (`settle`) and nothing allocates meanwhile: no wait per stream.
        let unmap = |piece: &Piece<B::Segment>| {
            self.backend.unmap_pages(&piece.handle, piece.offset, piece.len, piece.stream, false);
        };
        let Some(store) = store else {
            pieces.iter().for_each(unmap);
            return (pieces.len(), None, Duration::ZERO);
        };
        let unmapped = std::sync::atomic::AtomicUsize::new(0);
        let (copied, copied_pieces) = std::sync::mpsc::channel::<usize>();
        let (failure, copying) = std::thread::scope(|scope| {
            // Owned here, so that it is dropped on every way out and the unmapping thread's loop ends.
            let copied = copied;
            scope.spawn(|| {
                for i in copied_pieces {
                    unmap(&pieces[i]);
                    // Freed here rather than after the last copy: freeing a page costs about what unmapping it
                    // does (on an H200 the pages of 8 GiB took 14 ms more after the copies than the copies did).
                    self.backend.release_spare_pages();
                    unmapped.fetch_add(1, Ordering::Release);
                }
            });
            let mut copying = Duration::ZERO;
            for (i, piece) in pieces.iter().enumerate() {
                let started = Instant::now();
                let into = &mut store.as_mut_slice()[piece.at..piece.at + piece.len as usize];
                if let Err(e) = self.backend.read(&piece.handle, piece.offset, into) {
                    return (Some(e), copying);
                }
                copying += started.elapsed();
                // The unmapping thread takes the pieces in order and never stops early.
                let _ = copied.send(i);
            }
            (None, copying)
        });
        (unmapped.load(Ordering::Acquire), failure, copying)
    }

    /// After a copy failed during a sleep: maps the pieces unmapped so far again and copies their bytes back, so
    /// that the pool is awake as before and the error is returned. Where even that fails (another process took
    /// the memory meanwhile), the pool stays asleep over those pieces, its bytes in the store, for a later wake.
    fn undo_sleep(
        &self,
        state: &mut State<B::Segment>,
        action: SleepAction,
        unmapped: &[Piece<B::Segment>],
        store: Option<HostStore>,
        error: Error,
    ) -> Result<SleepReport> {
        let (mapped, again, _) = self.map_and_restore(unmapped, store.as_ref());
        let Some(again) = again else {
            state.host_store = store;
            return Err(error);
        };
        unmapped[..mapped].iter().for_each(|p| self.backend.unmap_pages(&p.handle, p.offset, p.len, p.stream, false));
        self.backend.release_spare_pages();
        let ranges: Vec<SleepingRange> = unmapped
            .iter()
            .map(|p| SleepingRange { arena: p.arena, segment: p.segment, offset: p.offset, len: p.len })
            .collect();
        let bytes = ranges.iter().map(|r| r.len).sum();
        state.sleep = Some(Sleeping { action, ranges, store, bytes });
        state.update_reserved();
        Err(Error::Unsupported {
            backend: self.display_name(),
            what: format!(
                "sleep: a copy to the host failed ({error}), and mapping the {bytes} bytes unmapped before it \
                 failed too ({again}): the pool stays asleep over them, their bytes kept; wake it later"
            ),
        })
    }

    /// Maps new pages over every range the pool unmapped when it slept, at the same addresses, and copies the
    /// offloaded bytes back; blocks whose bytes were discarded come back with undefined contents. All or
    /// nothing: when the device cannot give the memory (or the limit forbids it) or a copy fails, what was
    /// mapped is unmapped again and the pool stays asleep, its offloaded bytes kept. A pool that is awake
    /// answers an empty report. The host store stays for the next sleep until [`Pool::release_cached`].
    pub fn wake(&self) -> Result<WakeReport> {
        let start = Instant::now();
        let mut state = self.state().lock();
        let Some(sleeping) = state.sleep.take() else { return Ok(WakeReport::default()) };
        // With the sleep taken, reserved memory counts the sleeping bytes again: what the pool holds awake.
        let awake = state.reserved();
        if let Some(limit) = state.stats.limit_bytes.filter(|&limit| awake > limit) {
            let what = format!("wake: {} bytes would pass the pool's limit of {limit}", sleeping.bytes);
            state.sleep = Some(sleeping);
            return Err(Error::Unsupported { backend: self.display_name(), what });
        }
        let mut report = WakeReport { bytes_mapped: sleeping.bytes, ..WakeReport::default() };
        let pieces = self.pieces(&state, &sleeping.ranges);
        let (mapped, failure, copy_time) = self.map_and_restore(&pieces, sleeping.store.as_ref());
        state.stats.num_device_alloc += mapped as u64;
        state.stats.num_device_calls += mapped as u64;
        report.copy_time = copy_time;
        if failure.is_none() && sleeping.store.is_some() {
            report.bytes_restored = sleeping.bytes;
        }
        if let Some(e) = failure {
            for piece in &pieces[..mapped] {
                self.backend.unmap_pages(&piece.handle, piece.offset, piece.len, piece.stream, false);
            }
            state.stats.num_device_free += mapped as u64;
            state.stats.num_device_calls += mapped as u64;
            self.backend.release_spare_pages();
            state.sleep = Some(sleeping);
            return Err(e);
        }
        state.host_store = sleeping.store;
        state.update_reserved();
        self.detour.fetch_and(!ASLEEP, Ordering::Relaxed);
        report.elapsed = start.elapsed();
        Ok(report)
    }

    /// Unmaps the mapped parts of a reservation of a pool dropped while it sleeps: its backed ranges less the
    /// `sleeping` ones (sorted), which the sleep unmapped already.
    pub(super) fn unmap_awake(
        backend: &B,
        engine: &crate::engine::Engine,
        stream: crate::StreamId,
        id: SegmentId,
        entry: &super::state::SegmentEntry<B::Segment>,
        sleeping: &[(u64, u64)],
    ) {
        for (offset, len) in engine.backed_ranges(id) {
            let mut at = offset;
            let end = offset + len;
            for &(s, l) in sleeping.iter().filter(|&&(s, l)| s < end && s + l > offset) {
                if s > at {
                    backend.unmap_pages(&entry.handle, at, s - at, stream, true);
                }
                at = at.max(s + l);
            }
            if at < end {
                backend.unmap_pages(&entry.handle, at, end - at, stream, true);
            }
        }
    }

    /// The sleeping ranges cut into pieces of at most [`WAKE_PIECE`] bytes (whole pages), each with its
    /// segment's handle and its place in the host store.
    fn pieces(&self, state: &State<B::Segment>, ranges: &[SleepingRange]) -> Vec<Piece<B::Segment>> {
        let page = self.page_size.unwrap_or(1);
        let most = (WAKE_PIECE / page).max(1) * page;
        let mut pieces = Vec::new();
        let mut at = 0;
        for r in ranges {
            let arena = &state.arenas[r.arena];
            let handle = &arena.entry(r.segment).expect("a sleeping segment stays").handle;
            let mut done = 0;
            while done < r.len {
                let len = most.min(r.len - done);
                let (offset, stream) = (r.offset + done, arena.stream);
                let (arena, segment) = (r.arena, r.segment);
                pieces.push(Piece { handle: handle.clone(), arena, segment, stream, offset, len, at });
                done += len;
                at += len as usize;
            }
        }
        pieces
    }

    /// Maps every piece in order and, with a store, copies each one's bytes back on a second thread as soon as
    /// it is mapped, so that a wake takes about as long as its copies. Returns how many pieces were mapped, the
    /// first failure (mapping stops there; the copies stop at theirs) and the time spent copying.
    fn map_and_restore(
        &self,
        pieces: &[Piece<B::Segment>],
        store: Option<&HostStore>,
    ) -> (usize, Option<Error>, Duration) {
        let map = |piece: &Piece<B::Segment>| self.backend.map_pages(&piece.handle, piece.offset, piece.len);
        let Some(store) = store else {
            for (i, piece) in pieces.iter().enumerate() {
                if let Err(e) = map(piece) {
                    return (i, Some(e), Duration::ZERO);
                }
            }
            return (pieces.len(), None, Duration::ZERO);
        };
        let (ready, mapped_pieces) = std::sync::mpsc::channel::<usize>();
        std::thread::scope(|scope| {
            let copier = scope.spawn(move || {
                let mut copying = Duration::ZERO;
                for i in mapped_pieces {
                    let piece = &pieces[i];
                    let started = Instant::now();
                    let bytes = &store.as_slice()[piece.at..piece.at + piece.len as usize];
                    if let Err(e) = self.backend.restore(&piece.handle, piece.offset, bytes) {
                        return (Some(e), copying);
                    }
                    copying += started.elapsed();
                }
                (None, copying)
            });
            let mut mapped = 0;
            let mut failure = None;
            for (i, piece) in pieces.iter().enumerate() {
                if let Err(e) = map(piece) {
                    failure = Some(e);
                    break;
                }
                mapped += 1;
                // A copier that failed has stopped listening: mapping more is of no use.
                if ready.send(i).is_err() {
                    break;
                }
            }
            drop(ready);
            let panicked =
                || Error::Unsupported { backend: self.display_name(), what: "wake: the copy thread panicked".into() };
            let (copy_failure, copying) = copier.join().unwrap_or_else(|_| (Some(panicked()), Duration::ZERO));
            (mapped, failure.or(copy_failure), copying)
        })
    }

    /// Frees the host store kept after a wake (see [`Pool::wake`]); returns its bytes.
    pub(super) fn release_host_store(state: &mut State<B::Segment>) -> u64 {
        if state.sleep.is_some() {
            return 0;
        }
        state.host_store.take().map_or(0, |store| store.len())
    }
}
