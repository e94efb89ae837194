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
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

mod handle;

pub use handle::{is_injected, FaultHandle, FaultKind, FaultySegment};
use handle::{Alias, Record, Shared, INJECTED};

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
    fn copy_on_device(
        &self,
        segment: &Self::Segment,
        offset: u64,
        src: &Self,
        src_segment: &Self::Segment,
        src_offset: u64,
        len: u64,
    ) -> Result<Option<crate::DevicePath>> {
        self.inner.copy_on_device(&segment.inner, offset, &src.inner, &src_segment.inner, src_offset, len)
    }
}

#[cfg(test)]
mod tests;
