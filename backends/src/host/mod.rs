//! Host memory: aligned allocations from the global allocator. Host-addressable, so buffers offer host slices.

mod memory;
mod raw;

pub use memory::host_memory;

use crate::adopt::{Adoption, Keeper, Ownership};
use crate::{Api, Backend, Error, HostPtr, MemoryPool, OwnedBlock, Pool, Result, StreamId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One host segment: an aligned allocation.
#[derive(Debug, Clone, Copy)]
pub struct HostSegment {
    /// Address of the first byte.
    addr: usize,
    /// What the allocator returned (the first byte, rounded up to the alignment, is `addr`).
    base: usize,
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
    /// For the backend of an adopted buffer: the memory it wraps (see [`crate::adopt`]).
    adoption: Option<Adoption<HostSegment>>,
}

impl HostBackend {
    /// Default block alignment: a cache line, and enough for any SIMD type up to AVX-512.
    pub const DEFAULT_ALIGNMENT: u64 = 64;

    /// A host backend named `name` over `capacity` bytes with 64-byte alignment.
    pub fn new(name: impl Into<String>, capacity: u64) -> Self {
        Self {
            name: name.into(),
            capacity,
            alignment: Self::DEFAULT_ALIGNMENT,
            held: AtomicU64::new(0),
            adoption: None,
        }
    }

    /// The backend of a pool holding one adopted host allocation of `size` bytes at `addr` (alignment 1: the
    /// block is the whole allocation, so its byte count is exact).
    fn adopting(
        name: String,
        capacity: u64,
        addr: usize,
        size: u64,
        keeper: Option<Keeper>,
        ownership: Ownership,
    ) -> Self {
        let segment = HostSegment { addr, base: addr, size };
        Self {
            name,
            capacity,
            alignment: 1,
            held: AtomicU64::new(0),
            adoption: Some(Adoption::new(segment, keeper, ownership)),
        }
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

impl crate::backend::sealed::Sealed for HostBackend {}

impl Backend for HostBackend {
    type Segment = HostSegment;

    fn name(&self) -> &str {
        &self.name
    }
    fn api(&self) -> Api {
        Api::Host
    }
    fn alignment(&self) -> u64 {
        self.alignment
    }
    fn segment_granularity(&self) -> u64 {
        if self.adoption.is_some() {
            return self.alignment;
        }
        self.alignment.max(4096)
    }
    fn max_segment_size(&self) -> u64 {
        // Layout sizes must fit in isize.
        (isize::MAX as u64).min(self.capacity.max(1))
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn free_bytes(&self) -> u64 {
        self.capacity.saturating_sub(self.held.load(Ordering::Relaxed))
    }
    fn create_segment(&self, size: u64) -> Result<HostSegment> {
        if let Some(adoption) = &self.adoption {
            let segment = adoption.take(&self.name)?;
            self.held.fetch_add(segment.size, Ordering::Relaxed);
            return Ok(segment);
        }
        let allocation = raw::alloc(size, self.alignment).ok_or_else(|| Error::Driver {
            backend: self.name.clone(),
            call: "alloc".into(),
            message: format!("the global allocator refused {size} bytes"),
        })?;
        self.held.fetch_add(size, Ordering::Relaxed);
        Ok(HostSegment { addr: allocation.addr, base: allocation.base, size })
    }
    #[allow(unsafe_code)] // Discharges `raw::dealloc`'s contract.
    fn destroy_segment(&self, segment: HostSegment, _: crate::backend::PoolAccess) {
        if let Some(adoption) = &self.adoption {
            // Not this backend's allocation: the keeper (an owned `Vec`) frees it; borrowed memory stays.
            adoption.release();
            self.held.fetch_sub(segment.size, Ordering::Relaxed);
            return;
        }
        // SAFETY: not adopted, so `segment` came from `raw::alloc` in `create_segment` with `segment.size` and
        // `self.alignment` (which never changes once segments exist: `with_alignment` takes the backend by value).
        // It is destroyed once and then never touched: only a pool destroys segments (this takes a `PoolAccess`),
        // each once, and never one that holds a live block.
        unsafe {
            raw::dealloc(raw::Allocation { addr: segment.addr, base: segment.base }, segment.size, self.alignment)
        };
        self.held.fetch_sub(segment.size, Ordering::Relaxed);
    }
    #[allow(unsafe_code)] // Discharges `raw::copy_in`'s contract.
    fn write(&self, segment: &HostSegment, offset: u64, src: &[u8]) -> Result<()> {
        self.check(segment, offset, src.len())?;
        // SAFETY: `check` just put the range inside `segment`, which is live: it came from `create_segment` and
        // only its pool destroys it (`PoolAccess`), after its last block; no slice of those bytes is in use (see
        // `crate::host_ptr::bytes`: writes through an owned block borrow it mutably).
        unsafe { raw::copy_in(segment.addr + offset as usize, src) };
        Ok(())
    }
    #[allow(unsafe_code)] // Discharges `raw::copy_out`'s contract.
    fn read(&self, segment: &HostSegment, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(segment, offset, dst.len())?;
        // SAFETY: as in `write`: the range was just checked against the live `segment`; nothing writes it
        // meanwhile (mutable slices of it borrow their owner mutably, and no device writes host memory).
        unsafe { raw::copy_out(segment.addr + offset as usize, dst) };
        Ok(())
    }
    #[allow(unsafe_code)] // Discharges `raw::fill`'s contract.
    fn fill(&self, segment: &HostSegment, offset: u64, len: u64, value: u8) -> Result<()> {
        self.check(segment, offset, len as usize)?;
        // SAFETY: as in `write`.
        unsafe { raw::fill(segment.addr + offset as usize, len as usize, value) };
        Ok(())
    }
    #[allow(unsafe_code)] // Discharges `raw::host_ptr`'s contract.
    fn host_ptr(&self, segment: &HostSegment, offset: u64) -> Option<HostPtr> {
        // SAFETY: `segment` is live (as in `write`) and starts at `addr`, an allocation from `raw::alloc` or adopted
        // memory kept until the pool destroys it; `offset` is checked against its size here; the backend touches
        // its bytes only in `write`, `read` and `fill`, when asked through the segment.
        (offset < segment.size).then(|| unsafe { raw::host_ptr(segment.addr, offset as usize) })
    }
    fn may_be_host_addressable(&self) -> bool {
        true
    }
}

/// Adopts a host vector as the one block of a pool of its own, named `name`, on a host of `capacity` bytes:
/// the vector is dropped (its memory freed) when the block is. An empty vector is refused
/// ([`Error::ZeroSize`]): a block holds at least one byte.
pub fn adopt_vec<T: bytemuck::Pod + Send + Sync>(name: &str, capacity: u64, data: Vec<T>) -> Result<OwnedBlock> {
    let size = std::mem::size_of_val(data.as_slice()) as u64;
    // The heap buffer does not move when the vector moves into its keeper.
    let addr = data.as_ptr() as usize;
    adopt(HostBackend::adopting(adopted_name(name), capacity, addr, size, Some(Box::new(data)), Ownership::Owned), size)
}

/// Adopts host memory that lives for the rest of the program (a leaked `Box`, a static) as the one block of a
/// pool of its own: never freed by umm. Borrowed mutably for good, so nothing else reaches it meanwhile.
pub fn adopt_static<T: bytemuck::Pod + Send + Sync>(
    name: &str,
    capacity: u64,
    data: &'static mut [T],
) -> Result<OwnedBlock> {
    let size = std::mem::size_of_val(data) as u64;
    let addr = data.as_mut_ptr() as usize;
    adopt(HostBackend::adopting(adopted_name(name), capacity, addr, size, None, Ownership::Borrowed), size)
}

fn adopted_name(name: &str) -> String {
    format!("{name} adopted")
}

fn adopt(backend: HostBackend, size: u64) -> Result<OwnedBlock> {
    if size == 0 {
        return Err(Error::ZeroSize { device: backend.name.clone() });
    }
    let pool: Arc<dyn MemoryPool> = Arc::new(Pool::new(backend, crate::adopt::pool_config())?);
    OwnedBlock::allocate(pool, size, StreamId(0), false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Segments start on the backend's alignment, read as zeros before any write (owned blocks lend them as
    /// `&[u8]`), reach their last byte and not one further, and their bytes are given back on destroy.
    #[test]
    fn segments_are_aligned_zeroed_and_bounded() {
        const CAPACITY: u64 = 1 << 30;
        for alignment in [64, 4096, 1 << 21] {
            let backend = HostBackend::new("host", CAPACITY).with_alignment(alignment).unwrap();
            for size in [alignment, 3 * alignment, 8 << 20] {
                let segment = backend.create_segment(size).unwrap();
                assert_eq!(segment.addr % alignment as usize, 0, "alignment {alignment}, size {size}");
                assert_eq!(backend.free_bytes(), CAPACITY - size);
                let mut bytes = vec![0xFF; size as usize];
                backend.read(&segment, 0, &mut bytes).unwrap();
                assert!(bytes.iter().all(|&b| b == 0), "a fresh segment of {size} bytes reads as zeros");
                backend.write(&segment, size - 1, &[7]).unwrap();
                let mut last = [0];
                backend.read(&segment, size - 1, &mut last).unwrap();
                assert_eq!(last, [7]);
                assert!(backend.host_ptr(&segment, size - 1).is_some());
                assert!(backend.host_ptr(&segment, size).is_none(), "no host pointer past the end");
                assert!(matches!(backend.write(&segment, size, &[7]), Err(Error::OutOfBounds(_))));
                assert!(matches!(backend.fill(&segment, 1, size, 0), Err(Error::OutOfBounds(_))));
                backend.destroy_segment(segment, crate::backend::PoolAccess::new());
                assert_eq!(backend.free_bytes(), CAPACITY);
            }
        }
    }

    #[test]
    fn alignments_below_a_cache_line_or_not_powers_of_two_are_refused() {
        for bad in [0, 32, 100, 4097] {
            let err = HostBackend::new("host", 1 << 20).with_alignment(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig(ref m) if m.contains(&bad.to_string())), "{bad}: {err}");
        }
    }
}
