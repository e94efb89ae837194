//! Interop with kernels launched through cudarc: raw device pointers of blocks, and views that implement
//! cudarc's `DeviceSlice`/`DevicePtr`/`DevicePtrMut`, so a pooled block is passed where a `CudaSlice` would be
//! (`stream.memcpy_htod(&data, &mut view)`, or `let (ptr, _g) = view.device_ptr(&stream); builder.arg(&ptr)`).
//!
//! Views carry no events: ordering between streams is the pool's stream rule (a block is used on the stream it
//! was allocated on) plus `record_stream` for extra streams, which [`super::CudaBuffer`]'s views do by
//! themselves.

use super::backend::CudaBackend;
use super::raw;
use crate::{Backend, BlockHandle, Error, OwnedBlock, Pool, PoolPlacement, Result, StreamId};
use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use std::marker::PhantomData;
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

impl<T> BlockView<'_, T> {
    /// Device address of the first element.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }
}

impl<T> BlockViewMut<'_, T> {
    /// Device address of the first element.
    pub fn device_address(&self) -> u64 {
        self.ptr
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
    if pool.backend().placement() == PoolPlacement::HostPinned {
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
    if pool.backend().placement() == PoolPlacement::ReadOnly {
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
    let (segment, base) = pool
        .segment_of(block)
        .ok_or_else(|| Error::UnknownBlock(format!("{block:?} in pool {}", pool.backend().name())))?;
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
