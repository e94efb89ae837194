//! A simulated device: hands out address ranges up to a capacity and touches no memory, so an 8 GB trace
//! replays on a small machine. It models a CUDA device with virtual memory management (2 MiB pages, 256-byte
//! alignment) unless built with [`SimBackend::plain`] (segments only, as OpenCL) or
//! [`SimBackend::segment_per_block`] (a segment for every block, as wgpu).

mod streams;

pub use streams::SimStreamLog;

use crate::{Api, Backend, Error, Result, StreamId, StreamMark, VirtualMemory};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Queued work, marks and waits (see [`streams`]).
    streams: Mutex<SimStreams>,
}

/// Free-memory queries answered by simulated devices in this process: what a driver's `cuMemGetInfo` would
/// have been asked, so that a test can show which operations query the device.
static FREE_MEMORY_QUERIES: AtomicU64 = AtomicU64::new(0);

impl SimBackend {
    /// Free-memory queries answered by every simulated device in this process so far.
    pub fn free_memory_queries() -> u64 {
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
            streams: Mutex::new(SimStreams::default()),
        }
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

    /// Holds back the work queued on `stream` from now on, as a long kernel would: marks recorded on it do not
    /// pass until [`SimBackend::finish_stream`].
    pub fn hold_stream(&self, stream: StreamId) {
        self.streams.lock().hold(stream);
    }

    /// Runs the work held on `stream`: its marks pass.
    pub fn finish_stream(&self, stream: StreamId) {
        self.streams.lock().finish(stream);
    }

    /// What the simulated streams were asked so far.
    pub fn stream_log(&self) -> SimStreamLog {
        self.streams.lock().log()
    }

    /// Physical bytes in use (segments plus mapped pages).
    pub fn physical_in_use(&self) -> u64 {
        self.physical.load(Ordering::Relaxed)
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

    /// Addresses for a segment or reservation of `size` bytes, after the last one handed out. A device whose
    /// capacity is near 2^64 bytes can run out of addresses before memory (reservations span twice the
    /// capacity): that is an error, not an overflow.
    fn addresses(&self, size: u64, reservation: bool, call: &str) -> Result<SimSegment> {
        let mut next_address = self.next_address.lock();
        let base = next_address.div_ceil(Self::PAGE).checked_mul(Self::PAGE);
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
    fn kind(&self) -> Api {
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
    fn free_memory(&self) -> u64 {
        FREE_MEMORY_QUERIES.fetch_add(1, Ordering::Relaxed);
        self.capacity - self.physical.load(Ordering::Relaxed)
    }
    fn create_segment(&self, size: u64) -> Result<SimSegment> {
        self.take(size, "create_segment")?;
        self.addresses(size, false, "create_segment")
    }
    fn destroy_segment(&self, segment: SimSegment, _: crate::backend::PoolAccess) {
        // A reservation's pages were unmapped (and counted back) before it is destroyed.
        if !segment.reservation {
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
    fn map_pages(&self, _segment: &SimSegment, _offset: u64, len: u64) -> Result<()> {
        self.take(len, "map_pages")
    }
    fn unmap_pages(&self, _segment: &SimSegment, _offset: u64, len: u64, stream: StreamId, wait: bool) {
        self.streams.lock().unmapped(stream, wait);
        self.physical.fetch_sub(len, Ordering::Relaxed);
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
    fn write(&self, _segment: &SimSegment, _offset: u64, _src: &[u8]) -> Result<()> {
        Err(self.no_bytes("write"))
    }
    fn read(&self, _segment: &SimSegment, _offset: u64, _dst: &mut [u8]) -> Result<()> {
        Err(self.no_bytes("read"))
    }
    fn fill(&self, _segment: &SimSegment, _offset: u64, _len: u64, _value: u8) -> Result<()> {
        Err(self.no_bytes("fill"))
    }
}
