//! Pooled blocks as wgpu sees them: `(buffer, offset, size)` for bind groups and copies, and device-to-device
//! copies between blocks.

use super::{WgpuBackend, WgpuSegment};
use crate::{Backend, BlockHandle, Error, OwnedBlock, Pool, Result};
use std::sync::Arc;
use wgpu::BufferUsages;

/// A live block as wgpu sees it. `buffer` is the block's own (every block is a buffer of its own, so blocks bind
/// together in any mix of usages), and `offset` is 0; `size` is the requested size rounded up to 4 bytes (what a
/// binding may span, and what `arrayLength` counts), never past the block.
#[derive(Debug, Clone)]
pub struct WgpuBlock {
    /// The segment's buffer.
    pub buffer: wgpu::Buffer,
    /// Offset of the block in the buffer.
    pub offset: u64,
    /// Bytes the binding spans.
    pub size: u64,
}

impl WgpuBlock {
    /// The block as a [`wgpu::BufferBinding`].
    pub fn as_buffer_binding(&self) -> wgpu::BufferBinding<'_> {
        wgpu::BufferBinding { buffer: &self.buffer, offset: self.offset, size: wgpu::BufferSize::new(self.size) }
    }

    /// The block as a bind group resource.
    pub fn as_binding_resource(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(self.as_buffer_binding())
    }

    /// The bytes `range` selects of this binding (offsets relative to it), for a binding of part of the buffer.
    /// wgpu needs a binding's offset to be a multiple of `offset_alignment` (the device's
    /// `min_storage_buffer_offset_alignment`, or `min_uniform_buffer_offset_alignment` for uniforms) and its size
    /// a non-zero multiple of 4. [`Error::OutOfBounds`] for a range past the binding, reversed or empty;
    /// [`Error::Unsupported`] for one inside it that wgpu cannot bind (misaligned), as OpenCL's misaligned
    /// sub-buffers are; each saying which.
    pub fn range(&self, range: std::ops::Range<u64>, offset_alignment: u64) -> Result<WgpuBlock> {
        let (start, end) = (range.start, range.end);
        let place = || format!("bytes {start}..{end} of a binding of {}", self.size);
        if start >= end || end > self.size {
            return Err(Error::OutOfBounds(format!("{}: not a non-empty range inside it", place())));
        }
        let misaligned =
            |why: String| Err(Error::Unsupported { backend: "wgpu".into(), what: format!("{}: {why}", place()) });
        let offset = self.offset + start;
        if offset_alignment > 0 && !offset.is_multiple_of(offset_alignment) {
            return misaligned(format!("wgpu needs the offset to be a multiple of {offset_alignment}"));
        }
        if !(end - start).is_multiple_of(4) {
            return misaligned("wgpu needs the size to be a multiple of 4".into());
        }
        Ok(WgpuBlock { buffer: self.buffer.clone(), offset, size: end - start })
    }
}

/// The buffer holding `block` and the block's offset in it, for copies. Errors if the block is not live.
pub fn segment_and_offset(pool: &Pool<WgpuBackend>, block: &BlockHandle) -> Result<(wgpu::Buffer, u64)> {
    live_segment(pool, block).map(|(segment, offset)| (segment.buffer().clone(), offset))
}

fn live_segment(pool: &Pool<WgpuBackend>, block: &BlockHandle) -> Result<(WgpuSegment, u64)> {
    pool.awake_segment_of(block)
}

fn bind(
    pool: &Pool<WgpuBackend>,
    block: &BlockHandle,
    usage: BufferUsages,
    limit: u64,
    what: &str,
) -> Result<WgpuBlock> {
    let backend = pool.backend();
    let (buffer, offset) = segment_and_offset(pool, block)?;
    if !backend.usage().contains(usage) {
        return Err(Error::Unsupported {
            backend: backend.name().to_string(),
            what: format!("binding a block as a {what} buffer: this pool's buffers have usages {:?}", backend.usage()),
        });
    }
    let size = block.requested().next_multiple_of(4).min(block.size());
    if size > limit {
        return Err(Error::Unsupported {
            backend: backend.name().to_string(),
            what: format!(
                "binding {size} bytes as a {what} buffer: the device binds at most {limit} bytes (max_{what}_buffer_\
                 binding_size); bind sub-ranges of the block instead"
            ),
        });
    }
    Ok(WgpuBlock { buffer, offset, size })
}

/// `block` for a storage binding (`var<storage, read>` or `read_write`). Errors if the pool's buffers lack
/// `STORAGE`, the block is not live, or it spans more than `max_storage_buffer_binding_size`.
pub fn binding(pool: &Pool<WgpuBackend>, block: &BlockHandle) -> Result<WgpuBlock> {
    let limit = pool.backend().limits().max_storage_buffer_binding_size;
    bind(pool, block, BufferUsages::STORAGE, limit, "storage")
}

/// An owned block of a wgpu pool for a storage binding, as [`binding`]. Errors with [`Error::Unsupported`] when
/// the block is not of a wgpu pool.
pub fn block_binding(block: &OwnedBlock) -> Result<WgpuBlock> {
    binding(wgpu_pool_of(block)?, block.handle())
}

/// An owned block of a wgpu pool for a uniform binding, as [`uniform_binding`]. Errors with
/// [`Error::Unsupported`] when the block is not of a wgpu pool.
pub fn block_uniform_binding(block: &OwnedBlock) -> Result<WgpuBlock> {
    uniform_binding(wgpu_pool_of(block)?, block.handle())
}

fn wgpu_pool_of(block: &OwnedBlock) -> Result<&Pool<WgpuBackend>> {
    let pool = block.pool();
    pool.as_any().downcast_ref::<Pool<WgpuBackend>>().ok_or_else(|| Error::Unsupported {
        backend: pool.name().to_string(),
        what: "a wgpu binding of a block that is not wgpu memory".into(),
    })
}

/// Queues writing `data` into an owned block of a wgpu pool at `offset` with `queue.write_buffer` and returns
/// without waiting: wgpu copies `data` into its own staging at once, and the write lands before any work
/// submitted to the device's queue afterwards (kernels included), so nothing needs to wait for it. A length
/// that is not a multiple of 4 (wgpu's copy alignment) is padded with zeros up to one, inside the block's
/// allocated size: up to 3 bytes after `data` are zeroed. Where that does not fit, for an `offset` that is not a
/// multiple of 4, or when the pool's buffers are mapped for writing rather than copied into, the write is made
/// the blocking way ([`OwnedBlock::write`]). Errors with [`Error::Unsupported`]
/// when the block is not wgpu memory, [`Error::OutOfBounds`] past the block's end, and with the wgpu error a
/// failed write raises.
pub fn write_block_queued(block: &mut OwnedBlock, offset: u64, data: &[u8]) -> Result<()> {
    let pool = block.pool();
    let Some(wgpu) = pool.as_any().downcast_ref::<Pool<WgpuBackend>>() else {
        return Err(Error::Unsupported {
            backend: pool.name().to_string(),
            what: "a queued wgpu write into a block that is not wgpu memory".into(),
        });
    };
    block.check_range(offset, data.len() as u64)?;
    if data.is_empty() {
        return Ok(());
    }
    let backend = wgpu.backend();
    let (segment, base) = live_segment(wgpu, block.handle())?;
    let end = (offset + data.len() as u64).next_multiple_of(4);
    let usage = backend.usage();
    let copyable = usage.contains(BufferUsages::COPY_DST) && !usage.contains(BufferUsages::MAP_WRITE);
    if !copyable || !offset.is_multiple_of(4) || end > block.handle().size() {
        return block.write(offset, data);
    }
    let buffer = segment.buffer();
    backend.check_unsealed(buffer, base + offset, end - offset)?;
    let padded;
    let words: &[u8] = if data.len().is_multiple_of(4) {
        data
    } else {
        let mut v = vec![0u8; (end - offset) as usize];
        v[..data.len()].copy_from_slice(data);
        padded = v;
        &padded
    };
    backend.shared.scoped(backend.name(), "queue.write_buffer", || {
        backend.shared.queue.write_buffer(buffer, base + offset, words);
        backend.shared.queue.submit([]);
    })
}

/// `block` for a uniform binding (device-local and read-only pools). Errors if the pool's buffers lack `UNIFORM`, the block is
/// not live, or it spans more than `max_uniform_buffer_binding_size`.
pub fn uniform_binding(pool: &Pool<WgpuBackend>, block: &BlockHandle) -> Result<WgpuBlock> {
    let limit = pool.backend().limits().max_uniform_buffer_binding_size;
    bind(pool, block, BufferUsages::UNIFORM, limit, "uniform")
}

/// Copies `len` bytes from `src_block` at `src_offset` to `dst_block` at `dst_offset` on the device with
/// `copy_buffer_to_buffer`, and waits. Both pools must be of one device; offsets (block offset plus the given
/// offset) and `len` must be multiples of 4 (wgpu's copy alignment). A copy within one buffer (one block, or an
/// adopted buffer) goes through a temporary buffer: wgpu copies no buffer into itself. Holds the turns of mappable segments (see [`WgpuSegment`]) until the copy is done.
#[allow(clippy::too_many_arguments)]
pub fn copy_block(
    src_pool: &Pool<WgpuBackend>,
    src_block: &BlockHandle,
    src_offset: u64,
    dst_pool: &Pool<WgpuBackend>,
    dst_block: &BlockHandle,
    dst_offset: u64,
    len: u64,
) -> Result<()> {
    let (src, dst) = (src_pool.backend(), dst_pool.backend());
    let name = dst.name().to_string();
    if !Arc::ptr_eq(&src.shared, &dst.shared) {
        return Err(Error::Unsupported {
            backend: name,
            what: format!(
                "copying between devices ({} to {}): read to the host and write instead",
                src.name(),
                dst.name()
            ),
        });
    }
    for (block, offset, pool) in [(src_block, src_offset, src), (dst_block, dst_offset, dst)] {
        match offset.checked_add(len) {
            Some(end) if end <= block.size() => {}
            _ => {
                return Err(Error::OutOfBounds(format!(
                    "copy of {len} bytes at {offset} in a block of {} bytes of {}",
                    block.size(),
                    pool.name()
                )))
            }
        }
    }
    if !src.usage().contains(BufferUsages::COPY_SRC) || !dst.usage().contains(BufferUsages::COPY_DST) {
        return Err(Error::Unsupported {
            backend: name,
            what: format!(
                "copy_buffer_to_buffer from usages {:?} to usages {:?} (needs COPY_SRC and COPY_DST)",
                src.usage(),
                dst.usage()
            ),
        });
    }
    let (src_segment, src_base) = live_segment(src_pool, src_block)?;
    let (dst_segment, dst_base) = live_segment(dst_pool, dst_block)?;
    copy_segments(src, &src_segment, src_base + src_offset, dst, &dst_segment, dst_base + dst_offset, len)
}

/// Copies `len` bytes from `src_segment` at `from` to `dst_segment` at `to` with `copy_buffer_to_buffer` on the
/// destination's device, and waits: offsets and `len` multiples of 4, within one buffer through a temporary one,
/// ranges outside their buffers [`Error::OutOfBounds`]. Holds the turns of mappable segments until the copy is
/// done.
pub(super) fn copy_segments(
    src: &WgpuBackend,
    src_segment: &WgpuSegment,
    from: u64,
    dst: &WgpuBackend,
    dst_segment: &WgpuSegment,
    to: u64,
    len: u64,
) -> Result<()> {
    let name = dst.name().to_string();
    let (src_buffer, dst_buffer) = (src_segment.buffer(), dst_segment.buffer());
    for (backend, buffer, at) in [(src, src_buffer, from), (dst, dst_buffer, to)] {
        if at.checked_add(len).is_none_or(|end| end > buffer.size()) {
            return Err(Error::OutOfBounds(format!(
                "copy of {len} bytes at {at} in a buffer of {} bytes of {}",
                buffer.size(),
                backend.name()
            )));
        }
    }
    if !from.is_multiple_of(4) || !to.is_multiple_of(4) || !len.is_multiple_of(4) {
        return Err(Error::Unsupported {
            backend: name,
            what: format!(
                "copy_buffer_to_buffer of {len} bytes from offset {from} to offset {to}: offsets and size must be \
                 multiples of 4"
            ),
        });
    }
    if len == 0 {
        return Ok(());
    }
    let shared = &dst.shared;
    let _turns = WgpuSegment::both_turns(src_segment, dst_segment);
    shared.scoped(&name, "copy_buffer_to_buffer", || {
        let mut encoder = shared.device.create_command_encoder(&Default::default());
        if src_buffer == dst_buffer {
            let temp = shared.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("umm copy temporary"),
                size: len,
                usage: BufferUsages::COPY_SRC | BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            encoder.copy_buffer_to_buffer(src_buffer, from, &temp, 0, len);
            encoder.copy_buffer_to_buffer(&temp, 0, dst_buffer, to, len);
            shared.queue.submit([encoder.finish()]);
            temp.destroy();
        } else {
            encoder.copy_buffer_to_buffer(src_buffer, from, dst_buffer, to, len);
            shared.queue.submit([encoder.finish()]);
        }
    })?;
    shared.wait(&name, "copy_buffer_to_buffer")
}

/// Seals `block`: from now on this pool refuses writes and fills that touch it, with an error naming the block,
/// so that a ReadOnly block filled at allocation stays as filled. Call [`unseal`] before freeing the block (a
/// block reused while still sealed would refuse its new owner's fill). Errors if the block is not live.
pub fn seal(pool: &Pool<WgpuBackend>, block: &BlockHandle) -> Result<()> {
    let (buffer, offset) = segment_and_offset(pool, block)?;
    let mut sealed = pool.backend().sealed.lock();
    if !sealed.iter().any(|(b, s, _)| *b == buffer && *s == offset) {
        sealed.push((buffer, offset, offset + block.size()));
    }
    Ok(())
}

/// Lifts [`seal`] from `block`. Returns whether it was sealed.
pub fn unseal(pool: &Pool<WgpuBackend>, block: &BlockHandle) -> Result<bool> {
    let (buffer, offset) = segment_and_offset(pool, block)?;
    let mut sealed = pool.backend().sealed.lock();
    let before = sealed.len();
    sealed.retain(|(b, s, _)| !(*b == buffer && *s == offset));
    Ok(sealed.len() != before)
}
