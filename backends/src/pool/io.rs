//! Bytes in and out of live blocks, and their host addresses: each checks that the block is live and the range
//! inside it, and holds the pool's lock through the copy where the memory is host-addressable.

use super::Pool;
use crate::{Backend, BlockHandle, DevicePath, Error, HostPtr, Result};

impl<B: Backend> Pool<B> {
    /// The backend segment holding `block`, and the block's offset in it; `None` if the block is not live.
    pub(crate) fn segment_of(&self, block: &BlockHandle) -> Option<(B::Segment, u64)> {
        let _cache = self.lock_lender(block)?;
        let state = self.state().lock();
        Some((state.live_entry(block)?.handle.clone(), block.offset))
    }

    /// The device address of live `block`'s first byte, where the backend's memory has addresses
    /// ([`Backend::device_address`]: CUDA, the simulated device); `None` otherwise and for a block not live.
    /// A stitched block's is its own range's, where its pages are mapped side by side.
    pub fn device_address(&self, block: &BlockHandle) -> Option<u64> {
        let (segment, offset) = self.segment_of(block)?;
        self.backend.device_address(&segment).map(|address| address + offset)
    }

    /// Copies the first `len` bytes of `src_block` (of `src`) into `block` on the device(s), where the backends
    /// join them ([`Backend::copy_on_device`]); `Ok(None)` where they do not. `len` must lie inside both blocks.
    pub(crate) fn copy_on_device_from(
        &self,
        block: &BlockHandle,
        src: &Pool<B>,
        src_block: &BlockHandle,
        len: u64,
    ) -> Result<Option<DevicePath>> {
        for (pool, block) in [(self, block), (src, src_block)] {
            if len > block.size() {
                return Err(Error::OutOfBounds(format!(
                    "a device copy of {len} bytes from a block of {} bytes of {}",
                    block.size(),
                    pool.backend().name()
                )));
            }
        }
        let (segment, offset) = self.awake_segment_of(block)?;
        let (src_segment, src_offset) = src.awake_segment_of(src_block)?;
        self.backend().copy_on_device(&segment, offset, src.backend(), &src_segment, src_offset, len)
    }

    /// [`Pool::segment_of`] for an access to the block's memory (a kernel's view): [`Error::Asleep`] while the
    /// pool sleeps, [`Error::UnknownBlock`] for a block that is not live.
    #[cfg_attr(not(any(feature = "cuda", feature = "opencl", feature = "wgpu")), allow(dead_code))]
    pub(crate) fn awake_segment_of(&self, block: &BlockHandle) -> Result<(B::Segment, u64)> {
        let unknown = || self.unknown_block(block);
        let _cache = self.lock_lender(block).ok_or_else(unknown)?;
        let state = self.state().lock();
        let handle = state.live_entry(block).ok_or_else(unknown)?.handle.clone();
        if state.sleep.is_some() {
            return Err(self.asleep("a view of a block"));
        }
        Ok((handle, block.offset))
    }

    /// Runs `op` on the segment holding live `block` once `[offset, offset + len)` is checked to lie inside it.
    /// Where the memory is host-addressable the pool's lock is held throughout: a copy that looked the block up
    /// and then let go of the lock could land after another thread (holding a clone of the handle) freed the
    /// block and the segment was destroyed (host memory read or written after it was freed), or after the
    /// memory went to another block whose host slice is borrowed. Device memory is copied without the lock, so
    /// that a blocking device copy (which waits for queued work) does not stall every allocation of the pool;
    /// there a copy racing a free of the same block is the caller's data race, as with any device pointer.
    pub(super) fn with_live_segment<R>(
        &self,
        block: &BlockHandle,
        offset: u64,
        len: u64,
        op: impl FnOnce(&B::Segment) -> Result<R>,
    ) -> Result<R> {
        let end = offset.checked_add(len).ok_or_else(|| Error::SizeOverflow { what: "offset + length".into() })?;
        if end > block.size {
            return Err(Error::OutOfBounds(format!("range {offset}..{end} outside a block of {} bytes", block.size)));
        }
        let unknown = || self.unknown_block(block);
        let cache = self.lock_lender(block).ok_or_else(unknown)?;
        let state = self.state().lock();
        let segment = state.live_entry(block).ok_or_else(unknown)?;
        if state.sleep.is_some() {
            return Err(self.asleep("access to a block's bytes"));
        }
        if self.backend.host_ptr(&segment.handle, 0).is_some() {
            return op(&segment.handle);
        }
        let segment = segment.handle.clone();
        // Counted before the lock goes: a sleep waits for the copies in flight before it unmaps their pages.
        let _copy = self.copies.start();
        drop(state);
        drop(cache);
        op(&segment)
    }

    /// Copies `src` into the block at `offset`. Errors if the range leaves the block or the block is not live.
    pub fn write(&self, block: &BlockHandle, offset: u64, src: &[u8]) -> Result<()> {
        self.with_live_segment(block, offset, src.len() as u64, |segment| {
            self.backend.write(segment, block.offset + offset, src)
        })
    }

    /// Copies the block's bytes at `offset` into `dst`. Errors if the range leaves the block or the block is not
    /// live.
    pub fn read(&self, block: &BlockHandle, offset: u64, dst: &mut [u8]) -> Result<()> {
        let len = dst.len() as u64;
        self.with_live_segment(block, offset, len, |segment| self.backend.read(segment, block.offset + offset, dst))
    }

    /// Sets `len` bytes at `offset` to `value`. Errors if the range leaves the block or the block is not live.
    pub fn fill(&self, block: &BlockHandle, offset: u64, len: u64, value: u8) -> Result<()> {
        self.with_live_segment(block, offset, len, |segment| {
            self.backend.fill(segment, block.offset + offset, len, value)
        })
    }

    /// Host address of the block's first byte when its memory is host-addressable.
    pub fn host_ptr(&self, block: &BlockHandle) -> Option<std::ptr::NonNull<u8>> {
        if !self.backend.may_be_host_addressable() {
            return None;
        }
        let (segment, offset) = self.segment_of(block)?;
        self.backend.host_ptr(&segment, offset).map(HostPtr::as_non_null)
    }
}
