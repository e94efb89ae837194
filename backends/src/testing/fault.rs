//! Fault injection: [`FaultyBackend`] wraps any [`Backend`] and fails the k-th call of a kind (creating a segment,
//! reserving address space, mapping pages, copying bytes, settling, querying free memory), so that tests can
//! check what a pool does when a device refuses: the error it reports, the memory it gives back, the statistics
//! it keeps and whether it serves the next request.
//!
//! ```
//! use umm_backends::testing::fault::{FaultKind, FaultyBackend};
//! use umm_backends::{Pool, PoolConfig, SegmentMode, SimBackend, StreamId};
//!
//! let (backend, faults) = FaultyBackend::new(SimBackend::plain("sim0", 1 << 30));
//! let config = PoolConfig { segment_mode: SegmentMode::Plain, ..PoolConfig::default() };
//! let pool = Pool::new(backend, config).unwrap();
//! // Every segment creation fails from the first on, until cleared.
//! faults.fail_from(FaultKind::CreateSegment, 1);
//! let err = pool.allocate(64 << 20, StreamId(0)).unwrap_err();
//! assert!(err.to_string().contains("create_segment"), "{err}");
//! faults.clear_all();
//! let block = pool.allocate(64 << 20, StreamId(0)).unwrap();
//! pool.free(&block).unwrap();
//! drop(pool);
//! faults.check_released().unwrap();
//! ```
//!
//! The wrapper works over every backend (host, sim, CUDA, OpenCL, wgpu); a pool over it is a
//! `Pool<FaultyBackend<B>>`, so helpers written for one backend's pools (`Pool<CudaBackend>`, say) do not take it.
//!
//! What each kind fails:
//! - [`FaultKind::CreateSegment`], [`FaultKind::ReserveVirtual`], [`FaultKind::MapPages`], [`FaultKind::Copy`]
//!   (`write`, `read` and `fill`, counted together) and [`FaultKind::Settle`] return an [`Error::Driver`] whose
//!   `call` is the backend call that failed and whose message says the fault was injected and which call of its
//!   kind it was ([`is_injected`] recognises it, also inside the out-of-memory error a pool reports after its
//!   retry).
//! - [`FaultKind::FreeBytes`], the device query, cannot fail ([`Backend::free_bytes`] returns a number): a
//!   faulted call reports 0 bytes free, as a device that has run out would.
//! - Unmapping pages and destroying segments cannot fail either ([`Backend::unmap_pages`] and
//!   [`Backend::destroy_segment`] return nothing); the wrapper counts them and checks them against its ledger.
//!
//! The wrapper keeps a ledger of the segments the inner backend holds (each segment's size, whether it is a
//! virtual reservation, and its mapped ranges), so that a test can ask after the pool is dropped whether every
//! segment was destroyed and every page unmapped ([`FaultHandle::check_released`]), and while it lives how much
//! physical memory the pool holds ([`FaultHandle::resident_bytes`], which should equal the pool's
//! `reserved_bytes`), and whether a range is mapped ([`FaultHandle::is_mapped`]). Misuse it sees (a segment
//! destroyed twice or while pages are mapped in it, a page mapped twice, a range unmapped that was not mapped, a
//! range off the page grid, one reservation's pages unmapped for two streams) is recorded in
//! [`FaultHandle::violations`]. [`FaultyBackend::reporting_page`] and [`FaultyBackend::with_max_reservation`]
//! change what the wrapper reports of the device's virtual memory.

use crate::backend::{sealed, PoolAccess};
use crate::{Api, Backend, Error, HostPtr, Result, StreamId, VirtualMemory};
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A kind of backend call that [`FaultyBackend`] can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// [`Backend::create_segment`].
    CreateSegment,
    /// [`Backend::reserve_virtual`].
    ReserveVirtual,
    /// [`Backend::map_pages`].
    MapPages,
    /// [`Backend::write`], [`Backend::read`] and [`Backend::fill`], counted together.
    Copy,
    /// [`Backend::settle`].
    Settle,
    /// [`Backend::free_bytes`], the device query: a faulted call reports 0 bytes free.
    FreeBytes,
    /// [`Backend::alias_pages`].
    AliasPages,
}

impl FaultKind {
    /// Every kind, in declaration order.
    pub const ALL: [FaultKind; 7] = [
        FaultKind::CreateSegment,
        FaultKind::ReserveVirtual,
        FaultKind::MapPages,
        FaultKind::Copy,
        FaultKind::Settle,
        FaultKind::FreeBytes,
        FaultKind::AliasPages,
    ];

    /// The backend call's name (`"copy"` for the three copies together).
    pub fn call(self) -> &'static str {
        match self {
            FaultKind::CreateSegment => "create_segment",
            FaultKind::ReserveVirtual => "reserve_virtual",
            FaultKind::MapPages => "map_pages",
            FaultKind::Copy => "copy",
            FaultKind::Settle => "settle",
            FaultKind::FreeBytes => "free_bytes",
            FaultKind::AliasPages => "alias_pages",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.call())
    }
}

/// The start of every injected error's message.
const INJECTED: &str = "injected fault";

/// Whether `error` is (or, for an out-of-memory error, was caused by) a fault that a [`FaultyBackend`] injected.
pub fn is_injected(error: &Error) -> bool {
    match error {
        Error::Driver { message, .. } => message.starts_with(INJECTED),
        Error::OutOfMemory { cause: Some(cause), .. } => cause.contains(INJECTED),
        _ => false,
    }
}

/// Which calls of one kind fail: those numbered `from..=to` (1-based, counted since the wrapper was made).
#[derive(Debug, Clone, Copy)]
struct Trigger {
    from: u64,
    to: u64,
}

/// A segment the inner backend holds, as the ledger sees it.
#[derive(Debug)]
struct Record {
    size: u64,
    reservation: bool,
    /// Mapped ranges, start → end, disjoint and merged.
    mapped: BTreeMap<u64, u64>,
    /// The stream its unmaps named: one arena's reservation, so one stream.
    unmapped_for: Option<StreamId>,
}

/// A second mapping: `len` bytes at `dst_offset` of the reservation it lies in map `src`'s pages at `src_offset`.
#[derive(Debug, Clone, Copy)]
struct Alias {
    dst_offset: u64,
    src: u64,
    src_offset: u64,
    len: u64,
}

#[derive(Debug, Default)]
struct Ledger {
    live: HashMap<u64, Record>,
    /// Bytes of live plain segments plus mapped pages.
    resident: u64,
    mapped: u64,
    created: u64,
    destroyed: u64,
    /// Every stream an unmap named.
    unmap_streams: BTreeSet<u64>,
    /// Second mappings ([`Backend::alias_pages`]): by the reservation they lie in, the source reservation and
    /// range of each.
    aliases: HashMap<u64, Vec<Alias>>,
    violations: Vec<String>,
}

impl Ledger {
    fn violation(&mut self, what: String) {
        log::error!("fault injection ledger: {what}");
        self.violations.push(what);
    }
}

#[derive(Debug, Default)]
struct Shared {
    calls: [AtomicU64; 7],
    injected: [AtomicU64; 7],
    unmap_calls: AtomicU64,
    next_id: AtomicU64,
    triggers: Mutex<[Option<Trigger>; 7]>,
    ledger: Mutex<Ledger>,
}

impl Shared {
    /// Counts a call of `kind` and says whether it is to fail (and its number).
    fn call(&self, kind: FaultKind) -> Option<u64> {
        let n = self.calls[kind.index()].fetch_add(1, Ordering::Relaxed) + 1;
        let trigger = self.triggers.lock()[kind.index()]?;
        (trigger.from..=trigger.to).contains(&n).then(|| {
            self.injected[kind.index()].fetch_add(1, Ordering::Relaxed);
            n
        })
    }
}

/// The test's side of a [`FaultyBackend`]: says which calls fail, and reads the counts and the ledger. Cheap to
/// clone; every clone and the backend share one state.
#[derive(Debug, Clone)]
pub struct FaultHandle(Arc<Shared>);

impl FaultHandle {
    /// Fails the `k`-th call of `kind` (1-based, counted since the wrapper was made), once. A call already made
    /// is not failed after the fact: a `k` at or below [`FaultHandle::calls`] never fires.
    pub fn fail_nth(&self, kind: FaultKind, k: u64) {
        self.0.triggers.lock()[kind.index()] = Some(Trigger { from: k, to: k });
    }

    /// Fails the `k`-th call of `kind` and every later one, until [`FaultHandle::clear`]: a fault that a retry
    /// does not cure.
    pub fn fail_from(&self, kind: FaultKind, k: u64) {
        self.0.triggers.lock()[kind.index()] = Some(Trigger { from: k, to: u64::MAX });
    }

    /// Fails the next call of `kind`, once.
    pub fn fail_next(&self, kind: FaultKind) {
        self.fail_nth(kind, self.calls(kind) + 1);
    }

    /// Stops failing calls of `kind`.
    pub fn clear(&self, kind: FaultKind) {
        self.0.triggers.lock()[kind.index()] = None;
    }

    /// Stops failing calls of every kind.
    pub fn clear_all(&self) {
        *self.0.triggers.lock() = [None; 7];
    }

    /// Calls of `kind` made so far, failed or not.
    pub fn calls(&self, kind: FaultKind) -> u64 {
        self.0.calls[kind.index()].load(Ordering::Relaxed)
    }

    /// Calls of `kind` failed so far.
    pub fn injected(&self, kind: FaultKind) -> u64 {
        self.0.injected[kind.index()].load(Ordering::Relaxed)
    }

    /// Calls of every kind failed so far.
    pub fn total_injected(&self) -> u64 {
        FaultKind::ALL.iter().map(|&k| self.injected(k)).sum()
    }

    /// Calls of [`Backend::unmap_pages`] made so far.
    pub fn unmap_calls(&self) -> u64 {
        self.0.unmap_calls.load(Ordering::Relaxed)
    }

    /// Segments and reservations the inner backend holds now (created and not yet destroyed).
    pub fn live_segments(&self) -> u64 {
        self.0.ledger.lock().live.len() as u64
    }

    /// Segments and reservations created so far.
    pub fn segments_created(&self) -> u64 {
        self.0.ledger.lock().created
    }

    /// Segments and reservations destroyed so far.
    pub fn segments_destroyed(&self) -> u64 {
        self.0.ledger.lock().destroyed
    }

    /// Bytes of pages mapped now in virtual reservations.
    pub fn mapped_bytes(&self) -> u64 {
        self.0.ledger.lock().mapped
    }

    /// Physical bytes held now: live plain segments plus mapped pages (what a pool reports as `reserved_bytes`).
    pub fn resident_bytes(&self) -> u64 {
        self.0.ledger.lock().resident
    }

    /// Whether `[offset, offset + len)` of `segment` is mapped, as the ledger sees it: by pages of its own, or,
    /// in a range of second mappings, by pages mapped where they came from.
    pub fn is_mapped<S>(&self, segment: &FaultySegment<S>, offset: u64, len: u64) -> bool {
        let ledger = self.0.ledger.lock();
        let own = |ledger: &Ledger, id: u64, offset: u64, len: u64| {
            let record = ledger.live.get(&id);
            // Adjacent mappings are merged, so a mapped range lies inside one entry.
            record.and_then(|r| r.mapped.range(..=offset).next_back()).is_some_and(|(_, &end)| end >= offset + len)
        };
        let Some(aliases) = ledger.aliases.get(&segment.id) else { return own(&ledger, segment.id, offset, len) };
        let mut covered = 0;
        for a in aliases {
            let (lo, hi) = (offset.max(a.dst_offset), (offset + len).min(a.dst_offset + a.len));
            if lo < hi {
                if !own(&ledger, a.src, a.src_offset + (lo - a.dst_offset), hi - lo) {
                    return false;
                }
                covered += hi - lo;
            }
        }
        covered == len
    }

    /// The streams that unmaps have named, each once, in the order of their numbers.
    pub fn unmap_streams(&self) -> Vec<StreamId> {
        self.0.ledger.lock().unmap_streams.iter().map(|&s| StreamId(s)).collect()
    }

    /// Misuse the ledger saw: segments destroyed twice or with pages mapped, pages mapped twice, ranges unmapped
    /// that were not mapped, ranges off the page grid, one reservation's pages unmapped for two streams, pages
    /// mapped a second time that were not mapped, and pages unmapped (or their reservation destroyed) while
    /// mapped a second time.
    pub fn violations(&self) -> Vec<String> {
        self.0.ledger.lock().violations.clone()
    }

    /// `Ok` when nothing is held (every segment destroyed, every page unmapped) and nothing was misused; else
    /// what is wrong. Call it once the pool is dropped.
    pub fn check_released(&self) -> std::result::Result<(), String> {
        let ledger = self.0.ledger.lock();
        let mut problems = ledger.violations.clone();
        if !ledger.live.is_empty() {
            let bytes: u64 = ledger.live.values().map(|r| r.size).sum();
            problems.push(format!(
                "{} segments ({bytes} bytes of address space) not destroyed ({} created, {} destroyed)",
                ledger.live.len(),
                ledger.created,
                ledger.destroyed
            ));
        }
        if ledger.mapped > 0 {
            problems.push(format!("{} bytes of pages still mapped", ledger.mapped));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// A segment of a [`FaultyBackend`]: the inner backend's, with the number the ledger knows it by.
#[derive(Debug, Clone)]
pub struct FaultySegment<S> {
    inner: S,
    id: u64,
}

impl<S> FaultySegment<S> {
    /// The inner backend's segment.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// A backend that delegates every call to `B`, fails the calls its [`FaultHandle`] names, and keeps a ledger of
/// the segments and pages `B` holds. See the [module documentation](self).
#[derive(Debug)]
pub struct FaultyBackend<B: Backend> {
    inner: B,
    shared: Arc<Shared>,
    /// Whether the inner backend's host pointers are passed on (see [`FaultyBackend::without_host_access`]).
    host_access: bool,
    /// Reported as the page size instead of the inner backend's (see [`FaultyBackend::reporting_page`]).
    reported_page: Option<u64>,
    /// Reported as the largest reservation instead of the inner backend's.
    max_reservation: Option<u64>,
}

impl<B: Backend> FaultyBackend<B> {
    /// Wraps `inner`; nothing fails until the returned handle says so.
    pub fn new(inner: B) -> (Self, FaultHandle) {
        let shared = Arc::new(Shared::default());
        let backend =
            Self { inner, shared: shared.clone(), host_access: true, reported_page: None, max_reservation: None };
        (backend, FaultHandle(shared))
    }

    /// Reports `page` as the device's page size, for tests of the page sizes a pool refuses.
    pub fn reporting_page(mut self, page: u64) -> Self {
        self.reported_page = Some(page);
        self
    }

    /// Reports reservations of at most `bytes`, so that a pool makes several where the inner backend would make
    /// one.
    pub fn with_max_reservation(mut self, bytes: u64) -> Self {
        self.max_reservation = Some(bytes);
        self
    }

    /// Whether `[offset, offset + len)` lies on the page grid (always, without virtual memory).
    fn on_page_grid(&self, offset: u64, len: u64) -> bool {
        self.virtual_memory().is_none_or(|vm| offset.is_multiple_of(vm.page_size) && len.is_multiple_of(vm.page_size))
    }

    /// Hides the inner backend's host pointers, so that a backend holding bytes in host memory (the host backend)
    /// stands in for device memory: a pool over it copies through [`Backend::write`] and [`Backend::read`], which
    /// [`FaultKind::Copy`] can fail, where it would otherwise copy through the host slice (which nothing can
    /// fail). For tests of chunked copies (migrations through the host) on a machine without an accelerator.
    pub fn without_host_access(mut self) -> Self {
        self.host_access = false;
        self
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// A handle on this wrapper's faults, counts and ledger.
    pub fn handle(&self) -> FaultHandle {
        FaultHandle(self.shared.clone())
    }

    /// The error of the `nth` call of `kind`, failed by injection; `call` is the backend call's name.
    fn injected(&self, kind: FaultKind, call: &str, nth: u64) -> Error {
        Error::Driver {
            backend: self.inner.name().to_string(),
            call: call.to_string(),
            message: format!("{INJECTED}: call {nth} of {kind} failed on purpose (umm_backends::fault)"),
        }
    }

    /// Counts a call of `kind` and returns its injected error if it is to fail.
    fn check(&self, kind: FaultKind, call: &str) -> Result<()> {
        match self.shared.call(kind) {
            Some(nth) => Err(self.injected(kind, call, nth)),
            None => Ok(()),
        }
    }

    fn track(&self, inner: B::Segment, size: u64, reservation: bool) -> FaultySegment<B::Segment> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let mut ledger = self.shared.ledger.lock();
        ledger.live.insert(id, Record { size, reservation, mapped: BTreeMap::new(), unmapped_for: None });
        ledger.created += 1;
        if !reservation {
            ledger.resident += size;
        }
        FaultySegment { inner, id }
    }
}

impl<B: Backend> sealed::Sealed for FaultyBackend<B> {}

impl<B: Backend> Backend for FaultyBackend<B> {
    type Segment = FaultySegment<B::Segment>;

    fn name(&self) -> &str {
        self.inner.name()
    }
    fn api(&self) -> Api {
        self.inner.api()
    }
    fn alignment(&self) -> u64 {
        self.inner.alignment()
    }
    fn segment_granularity(&self) -> u64 {
        self.inner.segment_granularity()
    }
    fn max_segment_size(&self) -> u64 {
        self.inner.max_segment_size()
    }
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }
    fn free_bytes(&self) -> u64 {
        let free = self.inner.free_bytes();
        match self.shared.call(FaultKind::FreeBytes) {
            Some(_) => 0,
            None => free,
        }
    }
    fn create_segment(&self, size: u64) -> Result<Self::Segment> {
        self.check(FaultKind::CreateSegment, "create_segment")?;
        let inner = self.inner.create_segment(size)?;
        Ok(self.track(inner, size, false))
    }
    fn destroy_segment(&self, segment: Self::Segment, access: PoolAccess) {
        let mut ledger = self.shared.ledger.lock();
        ledger.aliases.remove(&segment.id);
        if let Some(dst) = ledger.aliases.iter().find(|(_, v)| v.iter().any(|a| a.src == segment.id)).map(|(d, _)| *d) {
            ledger.violation(format!(
                "segment {} destroyed while segment {dst} maps its pages a second time",
                segment.id
            ));
        }
        match ledger.live.remove(&segment.id) {
            Some(record) => {
                ledger.destroyed += 1;
                if !record.reservation {
                    ledger.resident -= record.size;
                }
                let mapped: u64 = record.mapped.iter().map(|(start, end)| end - start).sum();
                if mapped > 0 {
                    ledger.mapped -= mapped;
                    ledger.resident -= mapped;
                    ledger.violation(format!("segment {} destroyed with {mapped} bytes still mapped", segment.id));
                }
            }
            None => ledger.violation(format!("segment {} destroyed twice (or never created)", segment.id)),
        }
        drop(ledger);
        self.inner.destroy_segment(segment.inner, access);
    }
    fn virtual_memory(&self) -> Option<VirtualMemory> {
        self.inner.virtual_memory().map(|vm| VirtualMemory {
            page_size: self.reported_page.unwrap_or(vm.page_size),
            max_reservation: self.max_reservation.unwrap_or(vm.max_reservation),
        })
    }
    fn set_page_size(&mut self, page: u64) -> Result<()> {
        self.inner.set_page_size(page)
    }
    fn reserve_virtual(&self, size: u64) -> Result<Self::Segment> {
        self.check(FaultKind::ReserveVirtual, "reserve_virtual")?;
        let inner = self.inner.reserve_virtual(size)?;
        Ok(self.track(inner, size, true))
    }
    fn map_pages(&self, segment: &Self::Segment, offset: u64, len: u64) -> Result<()> {
        self.check(FaultKind::MapPages, "map_pages")?;
        let end = offset + len;
        // Misuse is recorded before the inner backend is asked, which may refuse it (the simulated device does).
        let sound = {
            let mut ledger = self.shared.ledger.lock();
            if !self.on_page_grid(offset, len) {
                ledger.violation(format!("map_pages of {offset}..{end} in segment {}: not whole pages", segment.id));
            }
            match ledger.live.get(&segment.id) {
                None => {
                    ledger.violation(format!("map_pages on segment {}, which is not live", segment.id));
                    false
                }
                Some(record) => {
                    let overlaps = record.mapped.range(..end).next_back().is_some_and(|(_, &e)| e > offset);
                    let beyond = end > record.size;
                    if overlaps || beyond {
                        ledger.violation(format!(
                            "map_pages of {offset}..{end} in segment {}: {}",
                            segment.id,
                            if beyond { "past its end" } else { "overlaps mapped pages" }
                        ));
                    }
                    !overlaps && !beyond
                }
            }
        };
        self.inner.map_pages(&segment.inner, offset, len)?;
        if sound {
            let mut ledger = self.shared.ledger.lock();
            let record = ledger.live.get_mut(&segment.id).expect("checked above");
            // Merge with the neighbours it touches.
            let mut start = offset;
            let mut stop = end;
            if let Some((&s, &e)) = record.mapped.range(..=offset).next_back() {
                if e == offset {
                    start = s;
                    record.mapped.remove(&s);
                }
            }
            if let Some(e) = record.mapped.remove(&end) {
                stop = e;
            }
            record.mapped.insert(start, stop);
            ledger.mapped += len;
            ledger.resident += len;
        }
        Ok(())
    }
    fn unmap_pages(&self, segment: &Self::Segment, offset: u64, len: u64, stream: StreamId, wait: bool) {
        self.shared.unmap_calls.fetch_add(1, Ordering::Relaxed);
        let end = offset + len;
        let on_grid = self.on_page_grid(offset, len);
        let mut ledger = self.shared.ledger.lock();
        if !on_grid {
            ledger.violation(format!("unmap_pages of {offset}..{end} in segment {}: not whole pages", segment.id));
        }
        ledger.unmap_streams.insert(stream.0);
        let overlaps = |a: &Alias| a.src == segment.id && a.src_offset < end && offset < a.src_offset + a.len;
        let aliased = ledger.aliases.iter().find(|(_, v)| v.iter().any(overlaps));
        if let Some(dst) = aliased.map(|(d, _)| *d) {
            ledger.violation(format!(
                "pages {offset}..{end} of segment {} unmapped while segment {dst} maps them a second time",
                segment.id
            ));
        }
        let named = ledger.live.get_mut(&segment.id).map(|r| *r.unmapped_for.get_or_insert(stream));
        if let Some(named) = named.filter(|&named| named != stream) {
            ledger.violation(format!(
                "pages of segment {} unmapped for stream {} and for stream {}",
                segment.id, named.0, stream.0
            ));
        }
        let covering = ledger
            .live
            .get(&segment.id)
            .and_then(|r| r.mapped.range(..=offset).next_back().map(|(&s, &e)| (s, e)))
            .filter(|&(_, e)| e >= end);
        match covering {
            Some((s, e)) => {
                let record = ledger.live.get_mut(&segment.id).expect("looked up above");
                record.mapped.remove(&s);
                if s < offset {
                    record.mapped.insert(s, offset);
                }
                if end < e {
                    record.mapped.insert(end, e);
                }
                ledger.mapped -= len;
                ledger.resident -= len;
            }
            None => ledger.violation(format!("unmap_pages of {offset}..{end} in segment {}: not mapped", segment.id)),
        }
        drop(ledger);
        self.inner.unmap_pages(&segment.inner, offset, len, stream, wait);
    }
    fn mark_stream(&self, stream: StreamId) -> Result<Option<crate::StreamMark>> {
        self.inner.mark_stream(stream)
    }
    fn mark_passed(&self, mark: &crate::StreamMark) -> bool {
        self.inner.mark_passed(mark)
    }
    fn wait_for_mark(&self, stream: StreamId, mark: &crate::StreamMark) -> Result<()> {
        self.inner.wait_for_mark(stream, mark)
    }
    fn release_mark(&self, mark: crate::StreamMark) {
        self.inner.release_mark(mark)
    }
    fn release_spare_pages(&self) {
        self.inner.release_spare_pages();
    }
    fn can_alias_pages(&self) -> bool {
        self.inner.can_alias_pages()
    }
    fn alias_pages(
        &self,
        dst: &Self::Segment,
        dst_offset: u64,
        src: &Self::Segment,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        self.check(FaultKind::AliasPages, "alias_pages")?;
        self.inner.alias_pages(&dst.inner, dst_offset, &src.inner, src_offset, len)?;
        let (end, on_grid) =
            (src_offset + len, self.on_page_grid(src_offset, len) && self.on_page_grid(dst_offset, len));
        let mut ledger = self.shared.ledger.lock();
        if !on_grid {
            ledger.violation(format!("alias_pages of {src_offset}..{end} in segment {}: not whole pages", src.id));
        }
        let mapped = ledger.live.get(&src.id).and_then(|r| r.mapped.range(..=src_offset).next_back());
        if mapped.is_none_or(|(_, &e)| e < end) {
            ledger.violation(format!("alias_pages of {src_offset}..{end} in segment {}, which is not mapped", src.id));
        }
        if !ledger.live.get(&dst.id).is_some_and(|r| r.reservation && r.mapped.is_empty()) {
            ledger.violation(format!("alias_pages into segment {}, not a reservation of its own", dst.id));
        }
        ledger.aliases.entry(dst.id).or_default().push(Alias { dst_offset, src: src.id, src_offset, len });
        Ok(())
    }
    fn settle(&self) -> Result<()> {
        self.check(FaultKind::Settle, "settle")?;
        self.inner.settle()
    }
    fn write(&self, segment: &Self::Segment, offset: u64, src: &[u8]) -> Result<()> {
        self.check(FaultKind::Copy, "write")?;
        self.inner.write(&segment.inner, offset, src)
    }
    fn read(&self, segment: &Self::Segment, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(FaultKind::Copy, "read")?;
        self.inner.read(&segment.inner, offset, dst)
    }
    fn fill(&self, segment: &Self::Segment, offset: u64, len: u64, value: u8) -> Result<()> {
        self.check(FaultKind::Copy, "fill")?;
        self.inner.fill(&segment.inner, offset, len, value)
    }
    fn host_ptr(&self, segment: &Self::Segment, offset: u64) -> Option<HostPtr> {
        self.inner.host_ptr(&segment.inner, offset).filter(|_| self.host_access)
    }
    fn may_be_host_addressable(&self) -> bool {
        self.host_access && self.inner.may_be_host_addressable()
    }
    fn segment_per_block(&self) -> bool {
        self.inner.segment_per_block()
    }
}

#[cfg(test)]
mod tests {
    //! The ledger is what "no leak, no misuse" in the fault sweeps rests on: each check here plants the fault it
    //! exists to find and expects it reported.
    use super::*;
    use crate::backend::PoolAccess;
    use crate::sim::SimSegment;
    use crate::SimBackend;

    const MIB: u64 = 1 << 20;

    fn wrapped() -> (FaultyBackend<SimBackend>, FaultHandle) {
        FaultyBackend::new(SimBackend::new("sim", 1 << 30))
    }

    #[test]
    fn a_clean_run_passes() {
        let (backend, handle) = wrapped();
        let segment = backend.create_segment(2 * MIB).unwrap();
        let reservation = backend.reserve_virtual(64 * MIB).unwrap();
        backend.map_pages(&reservation, 0, 4 * MIB).unwrap();
        backend.unmap_pages(&reservation, 0, 4 * MIB, crate::StreamId(0), true);
        backend.destroy_segment(segment, PoolAccess::new());
        backend.destroy_segment(reservation, PoolAccess::new());
        assert_eq!(handle.check_released(), Ok(()));
    }

    #[test]
    fn a_segment_never_destroyed_is_a_leak() {
        let (backend, handle) = wrapped();
        let _leaked = backend.create_segment(2 * MIB).unwrap();
        let err = handle.check_released().unwrap_err();
        assert!(err.contains("1 segments") && err.contains("not destroyed"), "{err}");
    }

    #[test]
    fn pages_left_mapped_are_a_leak_and_destroying_under_them_a_violation() {
        let (backend, handle) = wrapped();
        let reservation = backend.reserve_virtual(64 * MIB).unwrap();
        backend.map_pages(&reservation, 0, 4 * MIB).unwrap();
        let err = handle.check_released().unwrap_err();
        assert!(err.contains("still mapped"), "{err}");
        backend.destroy_segment(reservation, PoolAccess::new());
        assert!(handle.violations().iter().any(|v| v.contains("destroyed with")), "{:?}", handle.violations());
    }

    #[test]
    fn double_destroys_and_bad_page_ranges_are_violations() {
        let (backend, handle) = wrapped();
        let segment = backend.create_segment(2 * MIB).unwrap();
        backend.destroy_segment(segment.clone(), PoolAccess::new());
        // The simulated device under it counts the bytes back twice: it is not used again.
        backend.destroy_segment(segment, PoolAccess::new());
        let (backend, pages) = wrapped();
        let reservation = backend.reserve_virtual(64 * MIB).unwrap();
        backend.map_pages(&reservation, 0, 2 * MIB).unwrap();
        // The simulated device refuses both, as CUDA would; the ledger has seen the misuse all the same.
        let over = backend.map_pages(&reservation, 0, 2 * MIB); // over mapped pages
        assert!(matches!(over, Err(Error::InvalidConfig(_))), "{over:?}");
        let off = backend.map_pages(&reservation, 4096, 2 * MIB); // off the page grid
        assert!(matches!(off, Err(Error::OutOfBounds(_))), "{off:?}");
        backend.unmap_pages(&reservation, 8 * MIB, 2 * MIB, crate::StreamId(0), true); // not mapped
        let mut violations = handle.violations();
        violations.extend(pages.violations());
        for expected in ["destroyed twice", "overlaps mapped pages", "not whole pages", "not mapped"] {
            assert!(violations.iter().any(|v| v.contains(expected)), "{expected}: {violations:?}");
        }
        assert!(handle.check_released().is_err() && pages.check_released().is_err());
    }

    /// Asserts that the ledger recorded a violation containing `expected`, and that the release check reports it.
    #[track_caller]
    fn assert_reported(handle: &FaultHandle, expected: &str) {
        let violations = handle.violations();
        assert!(violations.iter().any(|v| v.contains(expected)), "{expected}: {violations:?}");
        let err = handle.check_released().expect_err("the release check passed a run with misuse");
        assert!(err.contains(expected), "{expected}: {err}");
    }

    /// Misuse alone, with everything destroyed and unmapped, fails the release check, which names it.
    #[test]
    fn misuse_alone_fails_the_release_check() {
        let (backend, handle) = wrapped();
        let segment = backend.create_segment(2 * MIB).unwrap();
        let id = segment.id;
        backend.destroy_segment(segment.clone(), PoolAccess::new());
        backend.destroy_segment(segment, PoolAccess::new());
        assert_eq!(handle.live_segments(), 0);
        assert_reported(&handle, &format!("segment {id} destroyed twice"));
    }

    /// The leak check names how many segments and bytes are left, and counts a reservation with nothing mapped.
    #[test]
    fn a_leak_names_its_segments_and_bytes() {
        let (backend, handle) = wrapped();
        let kept = backend.create_segment(2 * MIB).unwrap();
        let _leaked = backend.reserve_virtual(64 * MIB).unwrap();
        backend.destroy_segment(kept, PoolAccess::new());
        let err = handle.check_released().unwrap_err();
        assert!(
            err.contains("1 segments (67108864 bytes of address space) not destroyed (2 created, 1 destroyed)"),
            "{err}"
        );
    }

    /// Two reservations, the second mapping the first's first 4 MiB a second time, as a pool stitches ranges.
    fn aliased() -> (FaultyBackend<SimBackend>, FaultHandle, FaultySegment<SimSegment>, FaultySegment<SimSegment>) {
        let (backend, handle) = wrapped();
        let src = backend.reserve_virtual(64 * MIB).unwrap();
        backend.map_pages(&src, 0, 8 * MIB).unwrap();
        let dst = backend.reserve_virtual(64 * MIB).unwrap();
        backend.alias_pages(&dst, 0, &src, 0, 4 * MIB).unwrap();
        assert_eq!(handle.violations(), Vec::<String>::new());
        (backend, handle, src, dst)
    }

    /// Torn down in order (the second mapping's reservation first, then the pages, then their reservation), a
    /// stitched range passes: the checks below fail on misuse, not on every second mapping.
    #[test]
    fn a_second_mapping_torn_down_in_order_passes() {
        let (backend, handle, src, dst) = aliased();
        backend.destroy_segment(dst, PoolAccess::new());
        backend.unmap_pages(&src, 0, 8 * MIB, crate::StreamId(0), true);
        backend.destroy_segment(src, PoolAccess::new());
        assert_eq!(handle.check_released(), Ok(()));
    }

    /// Pages unmapped while another reservation maps them a second time: the other reservation's range would
    /// point at freed memory.
    #[test]
    fn unmapping_pages_mapped_a_second_time_is_a_violation() {
        let (backend, handle, src, dst) = aliased();
        backend.unmap_pages(&src, 2 * MIB, 4 * MIB, crate::StreamId(0), true);
        let expected = format!(
            "pages 2097152..6291456 of segment {} unmapped while segment {} maps them a second time",
            src.id, dst.id
        );
        assert_reported(&handle, &expected);
        // Pages past the second mapping are not in it.
        let (backend, handle, src, _dst) = aliased();
        backend.unmap_pages(&src, 4 * MIB, 4 * MIB, crate::StreamId(0), true);
        assert_eq!(handle.violations(), Vec::<String>::new());
    }

    /// A reservation destroyed while another maps its pages a second time.
    #[test]
    fn destroying_a_reservation_mapped_a_second_time_is_a_violation() {
        let (backend, handle, src, dst) = aliased();
        backend.unmap_pages(&src, 4 * MIB, 4 * MIB, crate::StreamId(0), true);
        let src_id = src.id;
        backend.destroy_segment(src, PoolAccess::new());
        assert_reported(
            &handle,
            &format!("segment {src_id} destroyed while segment {} maps its pages a second time", dst.id),
        );
        assert_reported(&handle, &format!("segment {src_id} destroyed with 4194304 bytes still mapped"));
    }

    /// A second mapping into a reservation that has pages of its own (a stitched range is a reservation made for
    /// it).
    #[test]
    fn a_second_mapping_into_a_reservation_with_pages_of_its_own_is_a_violation() {
        let (backend, handle) = wrapped();
        let src = backend.reserve_virtual(64 * MIB).unwrap();
        backend.map_pages(&src, 0, 4 * MIB).unwrap();
        let dst = backend.reserve_virtual(64 * MIB).unwrap();
        backend.map_pages(&dst, 8 * MIB, 2 * MIB).unwrap();
        backend.alias_pages(&dst, 0, &src, 0, 4 * MIB).unwrap();
        assert_reported(&handle, &format!("alias_pages into segment {}, not a reservation of its own", dst.id));
    }

    /// Pages mapped past a reservation's end, or in a reservation already destroyed.
    #[test]
    fn mapping_past_the_end_or_after_destruction_is_a_violation() {
        let (backend, handle) = wrapped();
        let reservation = backend.reserve_virtual(8 * MIB).unwrap();
        let past = backend.map_pages(&reservation, 6 * MIB, 4 * MIB);
        assert!(matches!(past, Err(Error::OutOfBounds(_))), "{past:?}");
        let id = reservation.id;
        assert_reported(&handle, &format!("map_pages of 6291456..10485760 in segment {id}: past its end"));
        let stale = reservation.clone();
        backend.destroy_segment(reservation, PoolAccess::new());
        backend.map_pages(&stale, 0, 2 * MIB).unwrap(); // the simulated device does not know it is gone
        assert_reported(&handle, &format!("map_pages on segment {id}, which is not live"));
    }

    /// `is_mapped` (what pool tests check live blocks against) says no for pages never mapped, for a range running
    /// past mapped pages, and for a second mapping whose source pages were unmapped; yes only where every byte is
    /// mapped, directly or where a second mapping's pages come from.
    #[test]
    fn is_mapped_is_false_wherever_a_page_is_not_mapped() {
        let (backend, handle, src, dst) = aliased();
        assert!(handle.is_mapped(&src, 0, 8 * MIB) && handle.is_mapped(&src, 2 * MIB, 2 * MIB));
        assert!(!handle.is_mapped(&src, 6 * MIB, 4 * MIB), "runs past the mapped pages");
        assert!(!handle.is_mapped(&src, 16 * MIB, 2 * MIB), "never mapped");
        assert!(handle.is_mapped(&dst, 0, 4 * MIB), "mapped a second time");
        assert!(!handle.is_mapped(&dst, 0, 6 * MIB), "runs past the second mapping");
        assert!(!handle.is_mapped(&dst, 8 * MIB, 2 * MIB), "outside the second mapping");
        backend.unmap_pages(&src, 0, 2 * MIB, crate::StreamId(0), true);
        assert!(!handle.is_mapped(&dst, 0, 4 * MIB), "half its source is unmapped");
        assert!(handle.is_mapped(&dst, 2 * MIB, 2 * MIB), "the other half is still mapped");
    }

    /// Resident bytes (what a pool's `reserved_bytes` is checked against): plain segments and mapped pages, each
    /// physical page once however often it is mapped, and nothing once released.
    #[test]
    fn resident_bytes_count_each_physical_page_once() {
        let (backend, handle, src, dst) = aliased();
        let plain = backend.create_segment(2 * MIB).unwrap();
        assert_eq!((handle.resident_bytes(), handle.mapped_bytes()), (10 * MIB, 8 * MIB));
        backend.destroy_segment(dst, PoolAccess::new());
        backend.unmap_pages(&src, 0, 2 * MIB, crate::StreamId(0), true);
        assert_eq!((handle.resident_bytes(), handle.mapped_bytes()), (8 * MIB, 6 * MIB));
        backend.destroy_segment(plain, PoolAccess::new());
        assert_eq!(handle.resident_bytes(), 6 * MIB);
    }

    #[test]
    fn unmapping_one_reservation_for_two_streams_is_a_violation() {
        let (backend, handle) = wrapped();
        let reservation = backend.reserve_virtual(64 * MIB).unwrap();
        backend.map_pages(&reservation, 0, 4 * MIB).unwrap();
        backend.unmap_pages(&reservation, 0, 2 * MIB, crate::StreamId(1), true);
        backend.unmap_pages(&reservation, 2 * MIB, 2 * MIB, crate::StreamId(2), true);
        let violations = handle.violations();
        assert!(violations.iter().any(|v| v.contains("for stream 1 and for stream 2")), "{violations:?}");
        backend.destroy_segment(reservation, PoolAccess::new());
    }
}
