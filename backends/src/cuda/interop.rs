//! Interop with kernels launched through cudarc: raw device pointers of blocks, and views that implement
//! cudarc's `DeviceSlice`/`DevicePtr`/`DevicePtrMut`, so a pooled block is passed where a `CudaSlice` would be
//! (`stream.memcpy_htod(&data, &mut view)`, or `let (ptr, _g) = view.device_ptr(&stream); builder.arg(&ptr)`).
//!
//! Plain handles of two pools are also copied between here ([`copy_block`]: within one context or to a peer).
//!
//! Views carry no events: ordering between streams is the pool's stream rule (a block is used on the stream it
//! was allocated on) plus `record_stream` for extra streams, which [`super::CudaBuffer`]'s views do by
//! themselves.

use super::backend::CudaBackend;
use super::raw;
use crate::{Backend, BlockHandle, Error, OwnedBlock, Pool, PoolKind, Result, StreamId};
use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

/// A typed, read-only view of a pooled block for cudarc.
#[derive(Debug)]
pub struct BlockView<'a, T> {
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _elements: PhantomData<&'a [T]>,
}

/// A typed, writable view of a pooled block for cudarc.
#[derive(Debug)]
pub struct BlockViewMut<'a, T> {
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _elements: PhantomData<&'a mut [T]>,
}

/// The elements `range` selects of a view of `len` elements, as `(first, count)`; [`Error::OutOfBounds`] for a
/// range that is reversed or ends past the view.
fn sub_range(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1).ok_or_else(|| Error::OutOfBounds("range start overflows".into()))?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1).ok_or_else(|| Error::OutOfBounds("range end overflows".into()))?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::OutOfBounds(format!("elements {start}..{end} of a view of {len}")));
    }
    Ok((start, end - start))
}

/// The device address of element `first` of a view starting at `ptr`.
fn element_address<T>(ptr: u64, first: usize) -> u64 {
    ptr + (first * std::mem::size_of::<T>()) as u64
}

impl<'a, T> BlockView<'a, T> {
    /// Device address of the first element.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The elements `range` selects, as a view on the same stream (cudarc's `CudaSlice::slice`): a kernel that
    /// takes part of a buffer. [`Error::OutOfBounds`] for a range past the view's end or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<BlockView<'_, T>> {
        let (first, len) = sub_range(range, self.len)?;
        Ok(BlockView { ptr: element_address::<T>(self.ptr, first), len, stream: self.stream, _elements: PhantomData })
    }
}

impl<'a, T> BlockViewMut<'a, T> {
    /// Device address of the first element.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The elements `range` selects, read-only, as [`BlockView::slice`].
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<BlockView<'_, T>> {
        let (first, len) = sub_range(range, self.len)?;
        Ok(BlockView { ptr: element_address::<T>(self.ptr, first), len, stream: self.stream, _elements: PhantomData })
    }

    /// The elements `range` selects, writable (cudarc's `CudaSlice::slice_mut`); borrows this view mutably.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<BlockViewMut<'_, T>> {
        let (first, len) = sub_range(range, self.len)?;
        Ok(BlockViewMut {
            ptr: element_address::<T>(self.ptr, first),
            len,
            stream: self.stream,
            _elements: PhantomData,
        })
    }

    /// Two writable views, of the elements before `mid` and from `mid` on, for a kernel that writes both halves
    /// (cudarc's `split_at_mut`). [`Error::OutOfBounds`] when `mid` is past the end.
    pub fn split_at_mut(&mut self, mid: usize) -> Result<(BlockViewMut<'_, T>, BlockViewMut<'_, T>)> {
        sub_range(..mid, self.len)?;
        let (ptr, stream) = (self.ptr, self.stream);
        Ok((
            BlockViewMut { ptr, len: mid, stream, _elements: PhantomData },
            BlockViewMut { ptr: element_address::<T>(ptr, mid), len: self.len - mid, stream, _elements: PhantomData },
        ))
    }
}

impl<T> DeviceSlice<T> for BlockView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DeviceSlice<T> for BlockViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for BlockView<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtr<T> for BlockViewMut<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for BlockViewMut<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// A read-only view of an owned block of a CUDA pool for kernels on `stream`, borrowing the block (which can
/// then be neither freed nor written through its owner while the view lives). Marks the block as used on
/// `stream` ([`super::CudaPool::record_stream`]), so that freeing it later waits for that stream's work. Errors
/// with [`Error::Unsupported`] for a block of another API, and when `stream` belongs to another context.
pub fn block_view<'a, T>(block: &'a OwnedBlock, stream: &'a Arc<CudaStream>) -> Result<BlockView<'a, T>> {
    let pool = cuda_pool_of(block)?;
    pool.record_stream(block.handle(), super::stream_id(stream))?;
    view(pool.pool(), block.handle(), stream)
}

/// A writable view of an owned block of a CUDA pool, as [`block_view`]; the block is borrowed mutably, so no
/// host slice of it lives meanwhile. Refused for read-only pools.
pub fn block_view_mut<'a, T>(block: &'a mut OwnedBlock, stream: &'a Arc<CudaStream>) -> Result<BlockViewMut<'a, T>> {
    let block: &'a OwnedBlock = block;
    let pool = cuda_pool_of(block)?;
    pool.record_stream(block.handle(), super::stream_id(stream))?;
    view_mut(pool.pool(), block.handle(), stream)
}

fn cuda_pool_of(block: &OwnedBlock) -> Result<&super::CudaPool> {
    let pool = block.pool();
    pool.as_any().downcast_ref::<super::CudaPool>().ok_or_else(|| Error::Unsupported {
        backend: pool.name().to_string(),
        what: "a CUDA view of a block that is not CUDA memory".into(),
    })
}

/// CUDA-specific operations on a `Pool<CudaBackend>`.
pub trait CudaPoolExt {
    /// Device address of a live block's first byte (for pinned memory, its device-mapped address).
    fn device_ptr(&self, block: &BlockHandle) -> Result<u64>;

    /// A view of the block's requested bytes as `T`s for kernels on `stream`. Errors if the block is not live or
    /// `T` is zero-sized, and for pinned (host-addressable) memory, whose views come from
    /// [`super::CudaBuffer::view`] (which borrows the buffer, so no host slice of it is lent meanwhile).
    ///
    /// # Safety
    /// A view of a plain handle is bound to neither the handle nor the pool, and cudarc's copies through it are
    /// safe calls. The caller keeps the block allocated (does not free it through the pool) while the view, or
    /// work queued through it, is in use: otherwise that work lands in whatever block reuses the memory. Owned
    /// buffers have safe views: [`super::CudaBuffer::view`].
    #[allow(unsafe_code)] // A contract only: the bodies have no unsafe operation.
    unsafe fn view<'a, T>(&self, block: &BlockHandle, stream: &'a Arc<CudaStream>) -> Result<BlockView<'a, T>>;

    /// A writable view; refused for read-only pools and, as [`CudaPoolExt::view`] is, for pinned memory.
    ///
    /// # Safety
    /// As for [`CudaPoolExt::view`]: the block stays allocated while the view, or work queued through it, is in
    /// use. [`super::CudaBuffer::view_mut`] is the safe form.
    #[allow(unsafe_code)] // A contract only, as for `view`.
    unsafe fn view_mut<'a, T>(&self, block: &BlockHandle, stream: &'a Arc<CudaStream>) -> Result<BlockViewMut<'a, T>>;

    /// Allocates a block on `stream` holding `data` (copied on `stream`, which is synchronized before return).
    /// The way to create blocks of a read-only pool; works on every pool.
    fn upload_read_only(&self, data: &[u8], stream: StreamId) -> Result<BlockHandle>;
}

impl CudaPoolExt for Pool<CudaBackend> {
    fn device_ptr(&self, block: &BlockHandle) -> Result<u64> {
        range(self, block, 0, 0).map(|(ptr, _)| ptr)
    }

    #[allow(unsafe_code)] // The trait's contract; nothing unsafe is done here.
    unsafe fn view<'a, T>(&self, block: &BlockHandle, stream: &'a Arc<CudaStream>) -> Result<BlockView<'a, T>> {
        refuse_pinned(self)?;
        view(self, block, stream)
    }

    #[allow(unsafe_code)] // The trait's contract; nothing unsafe is done here.
    unsafe fn view_mut<'a, T>(&self, block: &BlockHandle, stream: &'a Arc<CudaStream>) -> Result<BlockViewMut<'a, T>> {
        refuse_pinned(self)?;
        view_mut(self, block, stream)
    }

    fn upload_read_only(&self, data: &[u8], stream: StreamId) -> Result<BlockHandle> {
        let block = self.allocate(data.len() as u64, stream)?;
        if let Err(e) = upload(self, &block, 0, data, stream) {
            let _ = self.free(&block);
            return Err(e);
        }
        Ok(block)
    }
}

/// Refuses views of a plain handle on pinned memory (see [`CudaPoolExt::view`]).
fn refuse_pinned(pool: &Pool<CudaBackend>) -> Result<()> {
    if pool.backend().placement() == PoolKind::HostPinned {
        return Err(Error::Unsupported {
            backend: pool.backend().name().to_string(),
            what: "a view of pinned memory through a plain handle (it could outlive the block): use CudaBuffer::view"
                .into(),
        });
    }
    Ok(())
}

/// A view of a live block, for [`CudaPoolExt::view`] and for [`super::CudaBuffer::view`], whose borrow of the
/// buffer bounds the view's life.
pub(super) fn view<'a, T>(
    pool: &Pool<CudaBackend>,
    block: &BlockHandle,
    stream: &'a Arc<CudaStream>,
) -> Result<BlockView<'a, T>> {
    let (ptr, len) = typed(pool, block, std::mem::size_of::<T>())?;
    Ok(BlockView { ptr, len, stream, _elements: PhantomData })
}

/// A writable view of a live block (refused for read-only pools), as [`view`].
pub(super) fn view_mut<'a, T>(
    pool: &Pool<CudaBackend>,
    block: &BlockHandle,
    stream: &'a Arc<CudaStream>,
) -> Result<BlockViewMut<'a, T>> {
    if pool.backend().placement() == PoolKind::ReadOnly {
        return Err(Error::Unsupported {
            backend: pool.backend().name().to_string(),
            what: "a writable view of read-only memory".into(),
        });
    }
    let (ptr, len) = typed(pool, block, std::mem::size_of::<T>())?;
    Ok(BlockViewMut { ptr, len, stream, _elements: PhantomData })
}

/// (device address, element count) of the block's requested bytes as elements of `size` bytes.
fn typed(pool: &Pool<CudaBackend>, block: &BlockHandle, size: usize) -> Result<(u64, usize)> {
    if size == 0 {
        return Err(Error::InvalidConfig("a view of zero-sized elements".into()));
    }
    let (ptr, _) = range(pool, block, 0, 0)?;
    Ok((ptr, (block.requested() / size as u64) as usize))
}

/// Device address (and host address for pinned memory) of `[offset, offset + len)` of a live block.
pub(super) fn range(
    pool: &Pool<CudaBackend>,
    block: &BlockHandle,
    offset: u64,
    len: u64,
) -> Result<(u64, Option<usize>)> {
    let (segment, base) = pool.awake_segment_of(block)?;
    match offset.checked_add(len) {
        Some(end) if end <= block.size() => {}
        _ => {
            return Err(Error::OutOfBounds(format!(
                "{len} bytes at offset {offset} in a block of {} bytes",
                block.size()
            )))
        }
    }
    let at = base + offset;
    Ok((segment.device_ptr + at, segment.host_addr.map(|h| h + at as usize)))
}

/// Copies `src` into the block at `offset` on `stream` and waits for the stream (pinned memory: a host copy under
/// the pool's lock after waiting for the stream).
#[allow(unsafe_code)] // Discharges `raw::copy_htod_async`'s contract.
pub(super) fn upload(
    pool: &Pool<CudaBackend>,
    block: &BlockHandle,
    offset: u64,
    src: &[u8],
    stream: StreamId,
) -> Result<()> {
    let (ptr, host) = range(pool, block, offset, src.len() as u64)?;
    let backend = pool.backend();
    let stream = &backend.live_stream(stream)?;
    backend.bind()?;
    if host.is_some() {
        // A host copy under the pool's lock (`Pool::write`), so that it cannot land after the block was freed
        // and its memory lent to an owner as a host slice.
        raw::stream_synchronize(stream).map_err(|f| backend.error(f))?;
        return pool.write(block, offset, src);
    }
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: `range` checked the range against the block, found live in this pool; it is device memory (pinned
    // went to the host path above), never lent as a host slice; the stream is synchronized right after, before
    // `src` can go away.
    unsafe { raw::copy_htod_async(ptr, src, stream) }.map_err(|f| backend.error(f))?;
    raw::stream_synchronize(stream).map_err(|f| backend.error(f))
}

/// Copies the first `len` bytes of `src_block` (of `src`) to `dst_block` (of `dst`) on the device(s) and waits
/// for the copy. The pools may belong to one device or to two. Waits for all work queued in the source context
/// first, so the copy sees what kernels wrote. Read-only destinations are refused (they are filled once, at
/// allocation); `len` must lie inside both blocks. Pinned blocks are refused: the copy runs without the pools'
/// locks, so through a plain handle it could land after the block was freed and its memory lent to an owner as
/// a host slice; owned blocks copy with [`crate::OwnedBlock::copy_on_device_from`].
#[allow(unsafe_code)] // Discharges `CudaBackend::copy_from`'s contract.
pub fn copy_block(
    src: &Pool<CudaBackend>,
    src_block: &BlockHandle,
    dst: &Pool<CudaBackend>,
    dst_block: &BlockHandle,
    len: u64,
) -> Result<()> {
    for pool in [src, dst] {
        if pool.backend().placement() == PoolKind::HostPinned {
            return Err(Error::Unsupported {
                backend: pool.backend().name().to_string(),
                what: "a device copy of pinned memory through a plain handle: use an owned block".into(),
            });
        }
    }
    let to = dst.backend();
    if to.placement() == PoolKind::ReadOnly {
        return Err(Error::Unsupported {
            backend: to.name().to_string(),
            what: "a device copy into read-only memory: it is filled once, when it is allocated".into(),
        });
    }
    let (src_ptr, _) = range(src, src_block, 0, len)?;
    let (dst_ptr, _) = range(dst, dst_block, 0, len)?;
    // SAFETY: `interop::range` put `[src_ptr, src_ptr + len)` inside the live `src_block` and
    // `[dst_ptr, dst_ptr + len)` inside the live `dst_block` (it looked them up in their pools); neither is pinned
    // memory (refused above), and device memory is never lent as a host slice.
    unsafe { to.copy_from(src.backend(), src_ptr, dst_ptr, len) }.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_ranges_select_elements_and_refuse_what_is_outside() {
        assert_eq!(sub_range(.., 10).unwrap(), (0, 10));
        assert_eq!(sub_range(2..5, 10).unwrap(), (2, 3));
        assert_eq!(sub_range(2..=5, 10).unwrap(), (2, 4));
        assert_eq!(sub_range(7.., 10).unwrap(), (7, 3));
        assert_eq!(sub_range(..0, 10).unwrap(), (0, 0));
        assert_eq!(sub_range(10..10, 10).unwrap(), (10, 0), "an empty range at the end");
        for (bad, what) in
            [(sub_range(5..11, 10), "5..11"), (sub_range(11.., 10), "11..10"), (sub_range(..=10, 10), "0..11")]
        {
            let err = bad.unwrap_err().to_string();
            assert!(err.contains(what) && err.contains("of a view of 10"), "{err}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = sub_range(6..3, 10);
        assert!(reversed.is_err());
        assert!(sub_range(..=usize::MAX, 10).is_err(), "an end that overflows");
        assert_eq!(element_address::<f32>(0x1000, 3), 0x100c);
    }
}
