//! Host memory: aligned allocations from the global allocator. Host-addressable, so buffers offer host slices.

mod raw;

use crate::{Backend, BackendKind, Error, Result};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// One host segment: an aligned allocation.
#[derive(Debug, Clone, Copy)]
pub struct HostSegment {
    addr: usize,
    size: u64,
}

/// The host backend. `capacity` is the machine's memory (the facade reads it with sysinfo); free memory is
/// capacity minus what this backend holds.
#[derive(Debug)]
pub struct HostBackend {
    name: String,
    capacity: u64,
    alignment: u64,
    held: AtomicU64,
}

impl HostBackend {
    /// Default block alignment: a cache line, and enough for any SIMD type up to AVX-512.
    pub const DEFAULT_ALIGNMENT: u64 = 64;

    /// A host backend named `name` over `capacity` bytes with 64-byte alignment.
    pub fn new(name: impl Into<String>, capacity: u64) -> Self {
        Self { name: name.into(), capacity, alignment: Self::DEFAULT_ALIGNMENT, held: AtomicU64::new(0) }
    }

    /// Sets the block alignment (a power of two, at least 64: segments are aligned to it too).
    pub fn with_alignment(mut self, alignment: u64) -> Result<Self> {
        if !alignment.is_power_of_two() || alignment < Self::DEFAULT_ALIGNMENT {
            return Err(Error::InvalidConfig(format!(
                "host alignment must be a power of two of at least 64, got {alignment}"
            )));
        }
        self.alignment = alignment;
        Ok(self)
    }

    fn check(&self, segment: &HostSegment, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= segment.size => Ok(()),
            _ => {
                Err(Error::OutOfBounds(format!("{len} bytes at {offset} in a host segment of {} bytes", segment.size)))
            }
        }
    }
}

impl Backend for HostBackend {
    type Segment = HostSegment;

    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }
    fn alignment(&self) -> u64 {
        self.alignment
    }
    fn segment_granularity(&self) -> u64 {
        self.alignment.max(4096)
    }
    fn max_segment_size(&self) -> u64 {
        // Layout sizes must fit in isize.
        (isize::MAX as u64).min(self.capacity.max(1))
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn free_memory(&self) -> u64 {
        self.capacity.saturating_sub(self.held.load(Ordering::Relaxed))
    }
    fn create_segment(&self, size: u64) -> Result<HostSegment> {
        let addr = raw::alloc(size, self.alignment).ok_or_else(|| Error::Driver {
            backend: self.name.clone(),
            call: "alloc".into(),
            message: format!("the global allocator refused {size} bytes"),
        })?;
        self.held.fetch_add(size, Ordering::Relaxed);
        Ok(HostSegment { addr, size })
    }
    fn destroy_segment(&self, segment: HostSegment) {
        raw::dealloc(segment.addr, segment.size, self.alignment);
        self.held.fetch_sub(segment.size, Ordering::Relaxed);
    }
    fn write(&self, segment: &HostSegment, offset: u64, src: &[u8]) -> Result<()> {
        self.check(segment, offset, src.len())?;
        raw::copy_in(segment.addr + offset as usize, src);
        Ok(())
    }
    fn read(&self, segment: &HostSegment, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(segment, offset, dst.len())?;
        raw::copy_out(segment.addr + offset as usize, dst);
        Ok(())
    }
    fn fill(&self, segment: &HostSegment, offset: u64, len: u64, value: u8) -> Result<()> {
        self.check(segment, offset, len as usize)?;
        raw::fill(segment.addr + offset as usize, len as usize, value);
        Ok(())
    }
    fn host_ptr(&self, segment: &HostSegment, offset: u64) -> Option<NonNull<u8>> {
        NonNull::new((segment.addr + offset as usize) as *mut u8)
    }
}
