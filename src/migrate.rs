//! Migration: moving a buffer to another placement or device with its contents.
//!
//! [`UniversalBuffer::migrate`] (consumes the buffer) and [`UniversalBuffer::copy_to`] (keeps it) allocate the
//! target through the manager's decider, exactly as a new allocation with the buffer's label and access pattern
//! would be placed, and then move the bytes by the fastest path the two pools allow:
//!
//! 1. both blocks host-addressable (host memory, mapped pinned memory): one `memcpy`;
//! 2. a device copy where one API holds both blocks (`umm_backends::device_copy`): CUDA `cuMemcpy` within a context or
//!    `cuMemcpyPeer` between two GPUs, OpenCL `clEnqueueCopyBuffer` within one context, wgpu
//!    `copy_buffer_to_buffer` within one device;
//! 3. otherwise through the host in 8 MiB chunks: straight from or into whichever side is host-addressable, else
//!    through a staging chunk of CUDA pinned memory when either side is a CUDA pool, else a plain host buffer.
//!
//! A target in read-only memory (`Placement::ReadOnly`, or an `Auto` decision for a read-only pool) can only be
//! filled at allocation ([`umm_backends::MemoryPool::allocate_filled`]): the contents are gathered on the host
//! first (no copy when the source is host-addressable) and the new buffer is sealed afterwards.
//!
//! Failure keeps the source: [`UniversalBuffer::migrate`] hands the buffer back inside [`MigrateError`].

use crate::buffer::UniversalBuffer;
use crate::error::{Error, Result};
use crate::manager::UniversalMemoryManager;
pub use crate::migration_path::MigrationPath;
use crate::options::AllocOptions;
use std::sync::Arc;
use umm_backends::{MemoryPool, OwnedBlock, StreamId};
use umm_placement::{Api, DeviceSelector, Placement, PoolKind};

/// Bytes moved per step when a migration goes through the host.
pub(crate) const CHUNK: u64 = 8 << 20;

/// Below this size, host staging uses a plain host buffer rather than taking a pinned block.
const PINNED_STAGING_MIN: u64 = 1 << 20;

/// Where a migrated buffer goes: a placement and a device selector (and the stream the new block belongs to).
/// `Placement` and `DeviceSelector` convert into it, so `buf.migrate(&mm, Placement::HostPinned)` and
/// `buf.migrate(&mm, DeviceSelector::Index(2))` both work. A selector alone keeps what the buffer was asked for
/// ("this placement on that device"): a `ReadOnly` buffer moved to another device is read-only there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MigrateTo {
    /// `None`: the source buffer's requested placement.
    placement: Option<Placement>,
    device: DeviceSelector,
    stream: StreamId,
}

impl MigrateTo {
    /// `placement` on any device the decider picks, default stream.
    pub fn new(placement: Placement) -> Self {
        Self { placement: Some(placement), ..Self::default() }
    }

    /// The placement the buffer was asked for, on the device `selector` names, default stream.
    pub fn keeping_placement(selector: DeviceSelector) -> Self {
        Self { placement: None, device: selector, ..Self::default() }
    }

    /// Restricts the target to devices matching `selector` (an index, an API, the host).
    pub fn device(mut self, selector: DeviceSelector) -> Self {
        self.device = selector;
        self
    }

    /// The stream the new block is allocated on (and later freed on).
    pub fn stream(mut self, stream: StreamId) -> Self {
        self.stream = stream;
        self
    }

    /// The target placement; `None` for the source buffer's requested placement.
    pub fn target_placement(&self) -> Option<Placement> {
        self.placement
    }

    /// The target device selector.
    pub fn target_device(&self) -> DeviceSelector {
        self.device
    }
}

impl From<Placement> for MigrateTo {
    fn from(placement: Placement) -> Self {
        Self::new(placement)
    }
}

impl From<DeviceSelector> for MigrateTo {
    /// The buffer's requested placement on the device `selector` names ([`MigrateTo::keeping_placement`]).
    fn from(selector: DeviceSelector) -> Self {
        Self::keeping_placement(selector)
    }
}

/// A failed [`UniversalBuffer::migrate`]: why, and the source buffer, unchanged and still usable. (Boxed, so
/// that the `Result` of a migration stays small.)
pub struct MigrateError<T: bytemuck::Pod>(Box<(Error, UniversalBuffer<T>)>);

impl<T: bytemuck::Pod> MigrateError<T> {
    /// Why the migration failed.
    pub fn error(&self) -> &Error {
        &self.0 .0
    }

    /// The source buffer, back.
    pub fn into_buffer(self) -> UniversalBuffer<T> {
        self.0 .1
    }

    /// The error and the source buffer.
    pub fn into_parts(self) -> (Error, UniversalBuffer<T>) {
        *self.0
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for MigrateError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigrateError").field("error", &self.0 .0).field("buffer", &self.0 .1).finish()
    }
}

impl<T: bytemuck::Pod> std::fmt::Display for MigrateError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "migrating {:?} failed (the buffer is returned unchanged): {}", self.0 .1, self.0 .0)
    }
}

impl<T: bytemuck::Pod> std::error::Error for MigrateError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0 .0)
    }
}

/// `?` into [`crate::Error`] drops the source buffer along with the context.
impl<T: bytemuck::Pod> From<MigrateError<T>> for Error {
    fn from(e: MigrateError<T>) -> Self {
        e.0 .0
    }
}

impl<T: bytemuck::Pod> UniversalBuffer<T> {
    /// Moves the buffer to `to` (a [`Placement`], a [`DeviceSelector`] or a [`MigrateTo`]) with its contents,
    /// returning the new buffer; the old block goes back to its pool. The new buffer has the same length, label
    /// and access pattern, and, where `to` names no placement (a selector alone), the placement this one was
    /// asked for; where it lands is decided as for a new allocation with those options. A read-only target is
    /// sealed after the move.
    ///
    /// On failure (no such device, out of memory, a driver error) nothing is lost: the error carries the
    /// source buffer ([`MigrateError::into_buffer`]). Device work writing the buffer must be complete, as for
    /// [`UniversalBuffer::as_slice`] (CUDA contexts and OpenCL queues of the pools involved are synchronized).
    #[track_caller]
    pub fn migrate(
        self,
        mm: &UniversalMemoryManager,
        to: impl Into<MigrateTo>,
    ) -> std::result::Result<UniversalBuffer<T>, MigrateError<T>> {
        match self.copy_to(mm, to) {
            Ok(moved) => Ok(moved),
            Err(error) => Err(MigrateError(Box::new((error, self)))),
        }
    }

    /// Like [`UniversalBuffer::migrate`], but keeps this buffer: returns a copy placed at `to` (replicating
    /// weights to several devices, say).
    #[track_caller]
    pub fn copy_to(&self, mm: &UniversalMemoryManager, to: impl Into<MigrateTo>) -> Result<UniversalBuffer<T>> {
        let to = to.into();
        let placement = to.placement.unwrap_or(self.requested_placement());
        let mut options =
            AllocOptions::new().placement(placement).access(self.access_pattern()).device(to.device).stream(to.stream);
        if let Some(label) = self.label() {
            options = options.label(label);
        }
        let bytes = self.size_bytes();
        let read_only_target =
            placement == Placement::ReadOnly || mm.decide(bytes.max(1), &options)?.pool == PoolKind::ReadOnly;
        if read_only_target {
            let mut staged = Vec::new();
            let data = match &self.block {
                None => &[][..],
                Some(block) => gather(block, &mut staged)?,
            };
            let mut moved = mm.allocate_inner::<T>(self.len(), &options, Some(data))?;
            moved.meta.migrated_via = Some(MigrationPath::FilledAtAllocation);
            return Ok(moved);
        }
        let mut moved = mm.allocate_inner::<T>(self.len(), &options, None)?;
        let staging = Staging { mm, src_device: self.device().index(), dst_device: moved.device().index() };
        let path = match (&self.block, moved.block.as_mut()) {
            (Some(src), Some(dst)) => copy_bytes(src, dst, bytes, &staging)?,
            _ => MigrationPath::Empty,
        };
        moved.meta.migrated_via = Some(path);
        Ok(moved)
    }
}

impl<T: bytemuck::Pod> UniversalBuffer<T> {
    /// Copies every element of `src` into this buffer, which keeps its place: a device copy where both are in one
    /// API (CUDA, OpenCL, wgpu), a memcpy between host-visible memory, else chunks through the host (pinned where a
    /// CUDA side allows). Returns the path taken. `mm` is the manager both came from (for pinned staging).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; [`Error::ReadOnly`] when this buffer is read-only; a device
    /// error from the copy. Device work writing `src` and reading this buffer must be complete, as for
    /// [`UniversalBuffer::migrate`].
    pub fn copy_from(&mut self, mm: &UniversalMemoryManager, src: &UniversalBuffer<T>) -> Result<MigrationPath> {
        if src.len() != self.len() {
            return Err(Error::LengthMismatch { op: "copy_from", buffer_len: self.len(), given_len: src.len() });
        }
        // A read-only buffer takes its data at allocation or in its first write(), on the host side.
        if self.meta.read_only {
            return Err(Error::ReadOnly { label: self.meta.owned_label() });
        }
        let bytes = self.size_bytes();
        let staging = Staging { mm, src_device: src.device().index(), dst_device: self.device().index() };
        let path = match (&src.block, self.block.as_mut()) {
            (Some(from), Some(to)) => copy_bytes(from, to, bytes, &staging)?,
            _ => MigrationPath::Empty,
        };
        self.record_device_use();
        Ok(path)
    }
}

/// The whole block's bytes on the host: borrowed when host-addressable, else read into `staged`.
fn gather<'a>(block: &'a OwnedBlock, staged: &'a mut Vec<u8>) -> Result<&'a [u8]> {
    block.pool().settle()?;
    if let Some(bytes) = block.host_bytes() {
        return Ok(bytes);
    }
    *staged = vec![0; block.len() as usize];
    block.read(0, staged)?;
    Ok(staged)
}

/// What host staging needs to find a pinned staging pool: the manager and both devices.
struct Staging<'a> {
    mm: &'a UniversalMemoryManager,
    src_device: usize,
    dst_device: usize,
}

/// Copies the first `len` bytes of `src` into `dst` by the fastest path available; returns the path taken.
fn copy_bytes(src: &OwnedBlock, dst: &mut OwnedBlock, len: u64, staging: &Staging<'_>) -> Result<MigrationPath> {
    // Queued work on either side (kernels writing the source, a zeroing fill of the target) ends first.
    src.pool().settle()?;
    dst.pool().settle()?;
    if let (Some(from), Some(to)) = (src.host_bytes(), dst.host_bytes_mut()) {
        let n = len as usize;
        to[..n].copy_from_slice(&from[..n]);
        return Ok(MigrationPath::HostMemcpy);
    }
    if let Some(path) = dst.copy_on_device_from(src, len)? {
        return Ok(path.into());
    }
    if let Some(from) = src.host_bytes() {
        for (offset, n) in chunks(len) {
            dst.write(offset, &from[offset as usize..(offset + n) as usize])?;
        }
        return Ok(MigrationPath::HostDirect);
    }
    if let Some(to) = dst.host_bytes_mut() {
        for (offset, n) in chunks(len) {
            src.read(offset, &mut to[offset as usize..(offset + n) as usize])?;
        }
        return Ok(MigrationPath::HostDirect);
    }
    let mut pinned = pinned_chunk(src, dst, len, staging);
    let mut pageable;
    let (buf, path) = match pinned.as_mut().and_then(OwnedBlock::host_bytes_mut) {
        Some(bytes) => (bytes, MigrationPath::PinnedStaging),
        None => {
            pageable = vec![0; CHUNK.min(len) as usize];
            (&mut pageable[..], MigrationPath::HostStaging)
        }
    };
    for (offset, n) in chunks(len) {
        let chunk = &mut buf[..n as usize];
        src.read(offset, chunk)?;
        dst.write(offset, chunk)?;
    }
    Ok(path)
}

/// `(offset, length)` of each step of a chunked copy of `len` bytes.
fn chunks(len: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(CHUNK)).map(move |i| (i * CHUNK, CHUNK.min(len - i * CHUNK)))
}

/// A host-addressable chunk of CUDA pinned memory from the pinned pool of the source's or the target's device
/// (whichever is a CUDA pool), so that the device side of each step is a direct DMA. `None` (and a pageable
/// chunk instead) for small moves, without a CUDA side, or when no pinned memory can be had.
fn pinned_chunk(src: &OwnedBlock, dst: &OwnedBlock, len: u64, staging: &Staging<'_>) -> Option<OwnedBlock> {
    if len < PINNED_STAGING_MIN {
        return None;
    }
    let is_cuda = |pool: &Arc<dyn MemoryPool>| pool.api() == Api::Cuda;
    let device = if is_cuda(src.pool()) {
        staging.src_device
    } else if is_cuda(dst.pool()) {
        staging.dst_device
    } else {
        return None;
    };
    let inner = &staging.mm.inner;
    let pool = inner.devices[device].pool(PoolKind::HostPinned, Some(Api::Cuda), &inner.pool_config.read()).ok()?;
    let block = OwnedBlock::allocate(pool, CHUNK.min(len), StreamId::default(), false)
        .inspect_err(|e| log::debug!("no pinned staging chunk ({e}); staging through pageable memory"))
        .ok()?;
    block.host_bytes().is_some().then_some(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_exactly() {
        assert_eq!(chunks(0).count(), 0);
        assert_eq!(chunks(1).collect::<Vec<_>>(), vec![(0, 1)]);
        let c: Vec<_> = chunks(2 * CHUNK + 3).collect();
        assert_eq!(c, vec![(0, CHUNK), (CHUNK, CHUNK), (2 * CHUNK, 3)]);
    }

    #[test]
    fn targets_convert_from_placements_and_selectors() {
        let t: MigrateTo = Placement::HostPinned.into();
        assert_eq!((t.target_placement(), t.target_device()), (Some(Placement::HostPinned), DeviceSelector::Any));
        let t: MigrateTo = DeviceSelector::Index(3).into();
        assert_eq!((t.target_placement(), t.target_device()), (None, DeviceSelector::Index(3)));
        assert_eq!(MigrationPath::CudaPeer.to_string(), "cuda-peer");
    }
}
