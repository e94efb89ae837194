//! A simulated device: hands out address ranges up to a capacity and touches no memory, so an 8 GB trace
//! replays on a small machine. It models a CUDA device with virtual memory management (2 MiB pages, 256-byte
//! alignment) unless built with [`SimBackend::plain`] (segments only, as OpenCL) or
//! [`SimBackend::segment_per_block`] (a segment for every block, as wgpu).

mod streams;

pub use streams::SimStreamLog;

use crate::{Api, Backend, Error, Result, StreamId, StreamMark, VirtualMemory};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use streams::SimStreams;

/// A simulated segment: a range of addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimSegment {
    /// First address.
    pub base: u64,
    /// Length in bytes.
    pub size: u64,
    /// Whether this is a virtual reservation (its physical memory is its mapped pages) rather than a segment.
    pub reservation: bool,
}

/// The simulated device.
#[derive(Debug)]
pub struct SimBackend {
    name: String,
    capacity: u64,
    virtual_memory: bool,
    /// Every block is a segment of its own, at wgpu's granularity (see [`SimBackend::segment_per_block`]).
    whole_blocks: bool,
    /// Page size of virtual reservations ([`SimBackend::PAGE`] unless a pool asked for larger pages).
    page: u64,
    /// Where the next segment or reservation starts.
    next_address: Mutex<u64>,
    /// Physical bytes in use: an atomic, not a lock, because pools map and unmap on every remap and a
    /// device's bookkeeping should cost the replay no more than it must.
    physical: AtomicU64,
    /// Queued work, marks and waits (see [`streams`]): shared by the simulated backends of one device's pools
    /// ([`SimBackend::with_streams`]).
    streams: Arc<Mutex<SimStreams>>,
    /// A number no other simulated backend of this process has, so that tests can tell their physical pages
    /// apart ([`SimBackend::id`]).
    id: u64,
    /// Which physical page backs each mapped page of the reservations (see [`SimPages`]).
    pages: Mutex<SimPages>,
    /// Whether the device keeps the bytes written to it ([`SimBackend::holding_bytes`]).
    holds_bytes: bool,
}

/// The page tables of the reservations: every mapped page's physical page, and how many mappings each physical
/// page has. A page mapped twice ([`Backend::alias_pages`]) is one physical page: it counts in
/// [`SimBackend::physical_in_use`] once, until its last mapping goes. Tests read it through
/// [`SimBackend::physical_page`] to check that no two live blocks share a byte of physical memory.
#[derive(Debug, Default)]
struct SimPages {
    /// Virtual page address -> physical page number.
    mapped: BTreeMap<u64, u64>,
    /// Physical page number -> mappings.
    mappings: HashMap<u64, u32>,
    next: u64,
    /// Physical pages whose last mapping went, mapped again first (latest first), as a driver hands out memory
    /// it got back: a test that checks bytes by their physical page then sees a page move from one place to
    /// another as the same bytes.
    spare: Vec<u64>,
    /// With [`SimBackend::holding_bytes`]: the bytes of physical pages and of plain segments (by base address),
    /// made on first touch.
    page_bytes: HashMap<u64, Box<[u8]>>,
    segment_bytes: HashMap<u64, Box<[u8]>>,
}

/// The streams of one simulated device, for the simulated backends of its pools to share
/// ([`SimBackend::with_streams`]): a device's streams are one set, whichever pool marks or waits on them.
#[derive(Debug, Clone, Default)]
pub struct SimDeviceStreams(Arc<Mutex<SimStreams>>);

/// The next [`SimBackend::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Free-memory queries answered by simulated devices in this process: what a driver's `cuMemGetInfo` would
/// have been asked, so that a test can show which operations query the device.
static FREE_MEMORY_QUERIES: AtomicU64 = AtomicU64::new(0);

impl SimBackend {
    /// Free-memory queries answered by every simulated device in this process so far.
    pub fn free_bytes_queries() -> u64 {
        FREE_MEMORY_QUERIES.load(Ordering::Relaxed)
    }

    /// Block alignment, as CUDA's.
    pub const ALIGNMENT: u64 = 256;
    /// Page and segment granularity, as CUDA's.
    pub const PAGE: u64 = 2 << 20;

    /// A simulated device of `capacity` bytes with virtual memory support.
    pub fn new(name: impl Into<String>, capacity: u64) -> Self {
        Self {
            name: name.into(),
            capacity,
            virtual_memory: true,
            whole_blocks: false,
            page: Self::PAGE,
            next_address: Mutex::new(0),
            physical: AtomicU64::new(0),
            streams: Arc::default(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            pages: Mutex::new(SimPages::default()),
            holds_bytes: false,
        }
    }

    /// The byte a page or segment holds before anything is written to it: neither zero nor the poison, so that
    /// a test reading memory nobody wrote (a discarded page mapped anew, say) cannot mistake it for its data.
    pub const FRESH_BYTE: u8 = 0xA5;

    /// The same device keeping the bytes written to it, so that reads, writes and fills work: a page's bytes
    /// live with its physical page (a page mapped anew holds [`SimBackend::FRESH_BYTE`]s, whatever the address
    /// held before) and touching an address no page is mapped at fails, as a kernel's access would fault. Memory
    /// is taken on first touch.
    pub fn holding_bytes(self) -> Self {
        Self { holds_bytes: true, ..self }
    }

    /// A simulated device without virtual memory: segments only, as OpenCL devices are.
    pub fn plain(name: impl Into<String>, capacity: u64) -> Self {
        Self { virtual_memory: false, ..Self::new(name, capacity) }
    }

    /// Block alignment and segment granularity of [`SimBackend::segment_per_block`] devices, as wgpu's pools
    /// have them (`wgpu::MAP_ALIGNMENT`).
    pub const WHOLE_BLOCK_ALIGNMENT: u64 = 8;

    /// A simulated device without virtual memory whose every block is a segment of its own, sized to the
    /// request at an 8-byte granularity, as wgpu devices are (see [`Backend::segment_per_block`]).
    pub fn segment_per_block(name: impl Into<String>, capacity: u64) -> Self {
        Self { virtual_memory: false, whole_blocks: true, ..Self::new(name, capacity) }
    }

    /// The same device with its first segment or reservation at `base` (rounded up to a page) instead of 0, so
    /// that no block's address is 0 (a null pointer to C callers) and two devices' addresses never meet.
    pub fn at_address(self, base: u64) -> Self {
        *self.next_address.lock() = base;
        self
    }

    /// The same device with `streams` as its streams: every backend given them sees the same queued work, marks
    /// and captures, as the pools of one device do.
    pub fn with_streams(self, streams: &SimDeviceStreams) -> Self {
        Self { streams: Arc::clone(&streams.0), ..self }
    }

    /// A number that tells this backend from every other simulated backend of the process (each has physical
    /// pages of its own, numbered from 0).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Holds back the work queued on `stream` from now on, as a long kernel would: marks recorded on it do not
    /// pass until [`SimBackend::finish_stream`].
    pub fn hold_stream(&self, stream: StreamId) {
        self.streams.lock().hold(stream);
    }

    /// Runs the work held on `stream` and lets its later work run at once: its marks pass.
    pub fn finish_stream(&self, stream: StreamId) {
        self.streams.lock().finish(stream);
    }

    /// Queues one item of work on `stream` (a kernel that uses some memory) and returns its number, counted from
    /// 1 per stream. It runs at once unless the stream is held or waits on the device for held work; marks
    /// recorded after it pass once it has run.
    pub fn launch(&self, stream: StreamId) -> u64 {
        self.streams.lock().launch(stream)
    }

    /// Runs the work queued on held `stream` up to item `item` (and the work on other streams it waits for),
    /// keeping the rest held: a test lets a stream's work run one item at a time.
    pub fn complete_stream(&self, stream: StreamId, item: u64) {
        self.streams.lock().complete(stream, item);
    }

    /// Items queued on `stream` so far, and how many of them have run.
    pub fn stream_progress(&self, stream: StreamId) -> (u64, u64) {
        self.streams.lock().progress(stream)
    }

    /// The last item of `other` that work queued on `stream` from now on is ordered after by device-side waits
    /// ([`Backend::wait_for_mark`]); 0 where `stream` never waited for `other`.
    pub fn ordered_after(&self, stream: StreamId, other: StreamId) -> u64 {
        self.streams.lock().ordered_after(stream, other)
    }

    /// `stream` captures from now on, as a CUDA stream between `cuStreamBeginCapture` and `cuStreamEndCapture`:
    /// marks recorded on it are nodes of a graph, and the calls a driver refuses during a capture are counted in
    /// [`SimStreamLog::capture_violations`].
    pub fn begin_capture(&self, stream: StreamId) {
        self.streams.lock().begin_capture(stream);
    }

    /// Ends the capture of `stream`.
    pub fn end_capture(&self, stream: StreamId) {
        self.streams.lock().end_capture(stream);
    }

    /// What the simulated streams were asked so far.
    pub fn stream_log(&self) -> SimStreamLog {
        self.streams.lock().log()
    }

    /// Physical bytes in use (segments plus mapped pages).
    pub fn physical_in_use(&self) -> u64 {
        self.physical.load(Ordering::Relaxed)
    }

    /// The physical page behind the page holding `address` of a reservation: a number that a page unmapped for
    /// good gives to the next page mapped; `None` where nothing is mapped. Two addresses with the same physical page (and the same offset in
    /// it, `address % page`) are the same byte of device memory.
    pub fn physical_page(&self, address: u64) -> Option<u64> {
        self.pages.lock().mapped.get(&(address & !(self.page - 1))).copied()
    }

    /// The page size of reservations now.
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Drops the mappings of `[start, end)` (page addresses) from the tables; a physical page whose last mapping
    /// goes is counted back.
    fn drop_mappings(&self, start: u64, end: u64) {
        let mut pages = self.pages.lock();
        let addresses: Vec<u64> = pages.mapped.range(start..end).map(|(&a, _)| a).collect();
        for address in addresses {
            let physical = pages.mapped.remove(&address).expect("listed just now");
            let left = pages.mappings.get_mut(&physical).expect("a mapped page is counted");
            *left -= 1;
            if *left == 0 {
                pages.mappings.remove(&physical);
                pages.page_bytes.remove(&physical);
                pages.spare.push(physical);
                self.physical.fetch_sub(self.page, Ordering::Relaxed);
            }
        }
    }

    /// Checks that `[offset, offset + len)` is whole pages inside `segment`, a reservation.
    fn page_range(&self, segment: &SimSegment, offset: u64, len: u64, call: &str) -> Result<(u64, u64)> {
        let whole = offset.is_multiple_of(self.page) && len.is_multiple_of(self.page);
        match offset.checked_add(len) {
            Some(end) if whole && segment.reservation && end <= segment.size => {
                Ok((segment.base + offset, segment.base + end))
            }
            _ => Err(Error::OutOfBounds(format!(
                "{call}: {len} bytes at offset {offset} are not whole pages of a reservation of {} bytes",
                segment.size
            ))),
        }
    }

    fn take(&self, bytes: u64, call: &str) -> Result<()> {
        let capacity = self.capacity;
        self.physical
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&total| total <= capacity)
            })
            .map(|_| ())
            .map_err(|used| Error::Driver {
                backend: self.name.clone(),
                call: call.into(),
                message: format!(
                    "out of device memory: {bytes} bytes asked, {} of {capacity} free",
                    capacity.saturating_sub(used)
                ),
            })
    }

    /// Addresses for a segment or reservation of `size` bytes, after the last one handed out: a segment at a
    /// multiple of [`SimBackend::PAGE`], a reservation at a multiple of its pages (as CUDA's reservations are
    /// aligned to the page they map), so that a page's address is a multiple of the page size. A device whose
    /// capacity is near 2^64 bytes can run out of addresses before memory (reservations span twice the
    /// capacity): that is an error, not an overflow.
    fn addresses(&self, size: u64, reservation: bool, call: &str) -> Result<SimSegment> {
        let mut next_address = self.next_address.lock();
        let align = if reservation { self.page.max(Self::PAGE) } else { Self::PAGE };
        let base = next_address.div_ceil(align).checked_mul(align);
        let Some((base, end)) = base.and_then(|base| Some((base, base.checked_add(size)?))) else {
            return Err(Error::Driver {
                backend: self.name.clone(),
                call: call.into(),
                message: format!("out of address space: {size} bytes asked after {:#x}", *next_address),
            });
        };
        *next_address = end;
        Ok(SimSegment { base, size, reservation })
    }

    /// Runs `visit` over the pieces of `[offset, offset + len)` of `segment`, each with the bytes behind it and
    /// its position in the range: per page in a reservation, at once in a segment. Fails on a range outside the
    /// segment or over a page not mapped, before touching anything.
    fn touch(
        &self,
        segment: &SimSegment,
        offset: u64,
        len: u64,
        call: &str,
        mut visit: impl FnMut(&mut [u8], usize),
    ) -> Result<()> {
        if !self.holds_bytes {
            return Err(self.no_bytes(call));
        }
        if offset.checked_add(len).is_none_or(|end| end > segment.size) {
            return Err(Error::OutOfBounds(format!(
                "{call}: {len} bytes at offset {offset} of a segment of {} bytes",
                segment.size
            )));
        }
        let mut pages = self.pages.lock();
        let pages = &mut *pages;
        if !segment.reservation {
            let bytes = pages
                .segment_bytes
                .entry(segment.base)
                .or_insert_with(|| vec![Self::FRESH_BYTE; segment.size as usize].into_boxed_slice());
            visit(&mut bytes[offset as usize..(offset + len) as usize], 0);
            return Ok(());
        }
        let (start, end) = (segment.base + offset, segment.base + offset + len);
        // Pages lie at the reservation's base plus multiples of the page (see `map_pages`).
        let first = segment.base + (offset & !(self.page - 1));
        let physical: Vec<(u64, u64)> = (first..end)
            .step_by(self.page as usize)
            .map(|at| pages.mapped.get(&at).map(|&p| (at, p)).ok_or(at))
            .collect::<std::result::Result<_, u64>>()
            .map_err(|at| Error::Driver {
                backend: self.name.clone(),
                call: call.into(),
                message: format!("illegal address: no page is mapped at {:#x}", at.max(start)),
            })?;
        for (at, page) in physical {
            let bytes =
                pages.page_bytes.entry(page).or_insert_with(|| vec![Self::FRESH_BYTE; self.page as usize].into());
            let (from, to) = (start.max(at), end.min(at + self.page));
            visit(&mut bytes[(from - at) as usize..(to - at) as usize], (from - start) as usize);
        }
        Ok(())
    }

    fn no_bytes(&self, what: &str) -> Error {
        Error::Unsupported { backend: self.name.clone(), what: format!("{what}: the simulated device holds no bytes") }
    }
}

impl crate::backend::sealed::Sealed for SimBackend {}

impl Backend for SimBackend {
    type Segment = SimSegment;

    fn name(&self) -> &str {
        &self.name
    }
    fn api(&self) -> Api {
        Api::Sim
    }
    fn alignment(&self) -> u64 {
        if self.whole_blocks {
            Self::WHOLE_BLOCK_ALIGNMENT
        } else {
            Self::ALIGNMENT
        }
    }
    fn segment_granularity(&self) -> u64 {
        if self.whole_blocks {
            Self::WHOLE_BLOCK_ALIGNMENT
        } else {
            Self::PAGE
        }
    }
    fn segment_per_block(&self) -> bool {
        self.whole_blocks
    }
    fn max_segment_size(&self) -> u64 {
        self.capacity
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn free_bytes(&self) -> u64 {
        FREE_MEMORY_QUERIES.fetch_add(1, Ordering::Relaxed);
        self.capacity - self.physical.load(Ordering::Relaxed)
    }
    fn create_segment(&self, size: u64) -> Result<SimSegment> {
        self.take(size, "create_segment")?;
        self.addresses(size, false, "create_segment")
    }
    fn destroy_segment(&self, segment: SimSegment, _: crate::backend::PoolAccess) {
        if segment.reservation {
            // A pool unmaps a reservation's own pages first; what is left are second mappings.
            self.drop_mappings(segment.base, segment.base + segment.size);
        } else {
            self.pages.lock().segment_bytes.remove(&segment.base);
            self.physical.fetch_sub(segment.size, Ordering::Relaxed);
        }
    }
    fn virtual_memory(&self) -> Option<VirtualMemory> {
        self.virtual_memory.then_some(VirtualMemory {
            page_size: self.page,
            // Saturating: a simulated capacity near 2^64 bytes must not overflow.
            max_reservation: self.capacity.div_ceil(self.page).saturating_mul(self.page).saturating_mul(2),
        })
    }
    fn set_page_size(&mut self, page: u64) -> Result<()> {
        if !self.virtual_memory {
            return Err(Error::Unsupported { backend: self.name.clone(), what: "a page size of its own".into() });
        }
        self.page = page;
        Ok(())
    }
    fn reserve_virtual(&self, size: u64) -> Result<SimSegment> {
        self.addresses(size, true, "reserve")
    }
    fn map_pages(&self, segment: &SimSegment, offset: u64, len: u64) -> Result<()> {
        let (start, end) = self.page_range(segment, offset, len, "map_pages")?;
        let mut pages = self.pages.lock();
        if pages.mapped.range(start..end).next().is_some() {
            return Err(Error::InvalidConfig(format!("{}: map_pages over a mapped page", self.name)));
        }
        self.take(len, "map_pages")?;
        for address in (start..end).step_by(self.page as usize) {
            let physical = pages.spare.pop().unwrap_or_else(|| {
                pages.next += 1;
                pages.next - 1
            });
            pages.mapped.insert(address, physical);
            pages.mappings.insert(physical, 1);
        }
        Ok(())
    }
    fn unmap_pages(&self, segment: &SimSegment, offset: u64, len: u64, stream: StreamId, wait: bool) {
        self.streams.lock().unmapped(stream, wait);
        match self.page_range(segment, offset, len, "unmap_pages") {
            Ok((start, end)) => self.drop_mappings(start, end),
            Err(e) => log::error!("{}: {e}", self.name),
        }
    }
    fn can_alias_pages(&self) -> bool {
        self.virtual_memory
    }
    fn alias_pages(
        &self,
        dst: &SimSegment,
        dst_offset: u64,
        src: &SimSegment,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        let (to, to_end) = self.page_range(dst, dst_offset, len, "alias_pages")?;
        let (from, from_end) = self.page_range(src, src_offset, len, "alias_pages")?;
        let mut pages = self.pages.lock();
        if pages.mapped.range(to..to_end).next().is_some() {
            return Err(Error::InvalidConfig(format!("{}: alias_pages over a mapped page", self.name)));
        }
        let physical: Option<Vec<u64>> =
            (from..from_end).step_by(self.page as usize).map(|a| pages.mapped.get(&a).copied()).collect();
        let Some(physical) = physical else {
            return Err(Error::InvalidConfig(format!("{}: alias_pages of a page not mapped", self.name)));
        };
        for (i, page) in physical.into_iter().enumerate() {
            pages.mapped.insert(to + i as u64 * self.page, page);
            *pages.mappings.get_mut(&page).expect("a mapped page is counted") += 1;
        }
        Ok(())
    }
    fn mark_stream(&self, stream: StreamId) -> Result<Option<StreamMark>> {
        Ok(Some(self.streams.lock().mark(stream)))
    }
    fn mark_passed(&self, mark: &StreamMark) -> bool {
        self.streams.lock().passed(mark)
    }
    fn wait_for_mark(&self, stream: StreamId, mark: &StreamMark) -> Result<()> {
        self.streams.lock().wait(stream, mark);
        Ok(())
    }
    fn release_mark(&self, mark: StreamMark) {
        self.streams.lock().release(mark);
    }
    fn wait_mark(&self, mark: &StreamMark) -> Result<()> {
        self.streams.lock().wait_on_host(mark);
        Ok(())
    }
    fn settle(&self) -> Result<()> {
        self.streams.lock().synchronize_device();
        Ok(())
    }
    fn device_address(&self, segment: &SimSegment) -> Option<u64> {
        Some(segment.base)
    }
    fn write(&self, segment: &SimSegment, offset: u64, src: &[u8]) -> Result<()> {
        self.touch(segment, offset, src.len() as u64, "write", |bytes, at| {
            bytes.copy_from_slice(&src[at..at + bytes.len()]);
        })
    }
    fn read(&self, segment: &SimSegment, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.touch(segment, offset, dst.len() as u64, "read", |bytes, at| {
            dst[at..at + bytes.len()].copy_from_slice(bytes);
        })
    }
    fn fill(&self, segment: &SimSegment, offset: u64, len: u64, value: u8) -> Result<()> {
        self.touch(segment, offset, len, "fill", |bytes, _| bytes.fill(value))
    }
}
