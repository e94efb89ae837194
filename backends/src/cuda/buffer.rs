//! `CudaBuffer`: an [`OwnedBlock`] of a [`CudaPool`] with what only CUDA memory has: its device address, the
//! stream it belongs to, blocking and stream-ordered copies, and cudarc views that mark the stream they are used
//! on. The block goes back to its pool (stream-safely) when the owned block drops, as every owned block does.

use super::interop::{self, BlockView, BlockViewMut};
use super::{raw, stream_id, CudaPool};
use crate::{Backend, BlockHandle, BlockInfo, Error, MemoryPool, OwnedBlock, PoolKind, Result, StreamId};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// An [`OwnedBlock`] of a [`CudaPool`], returned to the pool when dropped; its handle does not leave this crate
/// (see [`CudaBuffer::info`]). The block belongs to the stream it was allocated on; using it on another stream (a
/// view or an async copy on that stream) marks that stream with [`CudaPool::record_stream`], so the block is
/// not reused before that stream's work is done.
pub struct CudaBuffer {
    block: OwnedBlock,
    ptr: u64,
    host: Option<usize>,
    stream: StreamId,
}

impl CudaBuffer {
    /// Wraps `block`, just allocated from `pool` on `stream`; on an error the block goes back as it drops.
    fn wrap(pool: &Arc<CudaPool>, block: OwnedBlock, stream: StreamId) -> Result<Self> {
        let (ptr, host) = interop::range(pool.pool(), block.handle(), 0, 0)?;
        Ok(Self { block, ptr, host, stream })
    }

    fn owned(pool: &Arc<CudaPool>, bytes: u64, stream: StreamId, zeroed: bool) -> Result<Self> {
        let block = OwnedBlock::allocate(Arc::clone(pool) as Arc<dyn MemoryPool>, bytes, stream, zeroed)?;
        Self::wrap(pool, block, stream)
    }

    fn handle(&self) -> &BlockHandle {
        self.block.handle()
    }

    /// `bytes` bytes on `stream`; the contents are whatever the memory held.
    pub fn allocate(pool: &Arc<CudaPool>, bytes: u64, stream: StreamId) -> Result<Self> {
        Self::owned(pool, bytes, stream, false)
    }

    /// `bytes` zero bytes on `stream`.
    pub fn zeroed(pool: &Arc<CudaPool>, bytes: u64, stream: StreamId) -> Result<Self> {
        Self::owned(pool, bytes, stream, true)
    }

    /// A buffer on `stream` holding `data` (copied on `stream`, synchronized before return). The only way to
    /// fill a read-only buffer.
    pub fn from_bytes(pool: &Arc<CudaPool>, data: &[u8], stream: StreamId) -> Result<Self> {
        let buffer = Self::owned(pool, data.len() as u64, stream, false)?;
        interop::upload(pool.pool(), buffer.handle(), 0, data, stream)?;
        Ok(buffer)
    }

    /// Where the block lies in its pool (key, segment, offset, sizes). The handle itself stays in this crate, as
    /// an [`crate::OwnedBlock`]'s does: with it, safe code could free or write the block through the pool while a
    /// slice from [`CudaBuffer::host_bytes`] lives.
    pub fn info(&self) -> BlockInfo {
        self.block.info()
    }

    /// The pool: the owned block's, which the constructors made of a [`CudaPool`].
    pub fn pool(&self) -> &CudaPool {
        self.block.pool().as_any().downcast_ref().expect("a CudaBuffer's block comes from a CudaPool")
    }

    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.block.len()
    }

    /// Always false: pools refuse zero-byte blocks.
    pub fn is_empty(&self) -> bool {
        self.block.is_empty()
    }

    /// The stream the block was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Device address of the first byte (for pinned memory, the device-mapped address).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Whether this is read-only memory.
    pub fn is_read_only(&self) -> bool {
        self.pool().backend().placement() == PoolKind::ReadOnly
    }

    /// Marks the buffer as used on `stream` (see [`CudaPool::record_stream`]); nothing for its own stream.
    pub fn record_stream(&self, stream: StreamId) -> Result<()> {
        if stream == self.stream {
            return Ok(());
        }
        self.pool().record_stream(self.handle(), stream)
    }

    fn refuse_read_only(&self) -> Result<()> {
        if self.is_read_only() {
            return Err(Error::Unsupported {
                backend: self.pool().backend().name().to_string(),
                what: "write: read-only memory is filled once, when it is allocated".into(),
            });
        }
        Ok(())
    }

    /// Blocking copy from the host (ordered after all queued work of the context).
    pub fn write(&mut self, offset: u64, src: &[u8]) -> Result<()> {
        self.block.check_range(offset, src.len() as u64)?;
        self.pool().pool().write(self.handle(), offset, src)
    }

    /// Blocking copy to the host (ordered after all queued work of the context).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.block.check_range(offset, dst.len() as u64)?;
        self.pool().pool().read(self.handle(), offset, dst)
    }

    /// The whole buffer, read back to the host.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut out = vec![0; self.len() as usize];
        self.read(0, &mut out)?;
        Ok(out)
    }

    /// Copy from the host queued on the buffer's stream, which is then synchronized.
    pub fn write_on_stream(&mut self, offset: u64, src: &[u8]) -> Result<()> {
        self.block.check_range(offset, src.len() as u64)?;
        self.refuse_read_only()?;
        interop::upload(self.pool().pool(), self.handle(), offset, src, self.stream)
    }

    /// Blocking copy of `len` bytes from `src` at `src_offset` to this buffer at `dst_offset` (device↔device,
    /// pinned↔device, across pools of the same device), ordered after all queued work of the context.
    #[allow(unsafe_code)] // Discharges `raw::copy`'s contract.
    pub fn copy_from(&mut self, dst_offset: u64, src: &CudaBuffer, src_offset: u64, len: u64) -> Result<()> {
        self.block.check_range(dst_offset, len)?;
        src.block.check_range(src_offset, len)?;
        self.refuse_read_only()?;
        let backend = self.pool().backend();
        backend.synchronize()?;
        // SAFETY: both ranges were just checked against the buffers, whose blocks live as long as they do (freed
        // on drop; the handles never leave this crate); `self` is borrowed mutably and `src` shared, so no host
        // slice of the destination is in use and none of the source writes it.
        unsafe { raw::copy(self.ptr + dst_offset, src.ptr + src_offset, len) }.map_err(|f| backend.error(f))?;
        raw::ctx_synchronize().map_err(|f| backend.error(f))
    }

    /// Copy of `len` bytes from `src` queued on `stream` (asynchronous; both are device or pinned memory).
    /// Marks both buffers as used on `stream` when it is not their own.
    #[allow(unsafe_code)] // Discharges `raw::copy_async`'s contract.
    pub fn copy_from_async(
        &mut self,
        dst_offset: u64,
        src: &CudaBuffer,
        src_offset: u64,
        len: u64,
        stream: StreamId,
    ) -> Result<()> {
        self.block.check_range(dst_offset, len)?;
        src.block.check_range(src_offset, len)?;
        self.refuse_read_only()?;
        self.record_stream(stream)?;
        src.record_stream(stream)?;
        let backend = self.pool().backend();
        let stream = backend.live_stream(stream)?;
        backend.bind()?;
        // SAFETY: both ranges were just checked against the buffers' live blocks, which `record_stream` keeps from
        // reuse until `stream` has passed the copy; a host slice taken later (`host_bytes`) synchronizes the
        // context first.
        unsafe { raw::copy_async(self.ptr + dst_offset, src.ptr + src_offset, len, &stream) }
            .map_err(|f| backend.error(f))
    }

    /// A view of the buffer as `T`s for kernels on `stream`; marks `stream` as a user of the buffer.
    pub fn view<'a, T>(&'a self, stream: &'a Arc<CudaStream>) -> Result<BlockView<'a, T>> {
        self.record_stream(stream_id(stream))?;
        interop::view(self.pool().pool(), self.handle(), stream)
    }

    /// A writable view for kernels on `stream`; marks `stream` as a user. Refused for read-only buffers.
    pub fn view_mut<'a, T>(&'a mut self, stream: &'a Arc<CudaStream>) -> Result<BlockViewMut<'a, T>> {
        self.record_stream(stream_id(stream))?;
        interop::view_mut(self.pool().pool(), self.handle(), stream)
    }

    /// The bytes as a host slice, for pinned memory; `None` for device memory and when the context cannot be
    /// synchronized. Synchronizes the context first, so no copy or kernel queued before is still writing the
    /// bytes; while the slice lives nothing new can be (writes and writable views take `&mut self`).
    #[allow(unsafe_code)] // Discharges `raw::host_slice`'s contract.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let host = self.host?;
        self.pool().backend().synchronize().ok()?;
        // SAFETY: `host` is the host address of this buffer's pinned block (from `interop::range`), of at least
        // `len()` bytes, freed only when the buffer drops; the context was just synchronized.
        Some(unsafe { raw::host_slice(self, host, self.len() as usize) })
    }

    /// The bytes as a mutable host slice, for pinned memory (not for read-only pools, which are device memory);
    /// synchronizes the context first, as [`CudaBuffer::host_bytes`] does.
    #[allow(unsafe_code)] // Discharges `raw::host_slice_mut`'s contract.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let host = self.host?;
        self.pool().backend().synchronize().ok()?;
        let len = self.len() as usize;
        // SAFETY: as in `host_bytes`.
        Some(unsafe { raw::host_slice_mut(self, host, len) })
    }
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("pool", &self.pool().backend().name())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len())
            .field("stream", &self.stream)
            .finish()
    }
}
