//! What callers do with a block of an OpenCL pool beyond the [`Backend`](crate::Backend) contract: its
//! sub-buffer for a kernel argument, reads, writes and fills queued without waiting, and copies on the device.

use super::raw::{self, ClEvent, PendingRead, PendingWrite};
use super::{OpenClBackend, OpenClSegment, SubBuffer};
use crate::{Backend, BlockHandle, Error, OwnedBlock, Pool, Result};
use std::sync::Arc;

/// The sub-buffer of a live block of `pool`, covering the bytes that were asked for, for use as a kernel
/// argument. Errors with [`Error::UnknownBlock`] if the block is not live.
pub fn cl_sub_buffer(pool: &Pool<OpenClBackend>, block: &BlockHandle) -> Result<SubBuffer> {
    let (segment, offset) = live(pool, block)?;
    pool.backend().sub_buffer(&segment, offset, block.requested())
}

/// The sub-buffer of an owned block of an OpenCL pool, covering the bytes that were asked for, for use as a
/// kernel argument. Errors with [`Error::Unsupported`] when the block is not of an OpenCL pool. Using the
/// sub-buffer is `unsafe` in opencl3 (kernel arguments, enqueued copies): the caller keeps such work from
/// overlapping a slice borrowed from the block ([`OwnedBlock::host_bytes`]) and from outliving the block.
pub fn block_sub_buffer(block: &OwnedBlock) -> Result<SubBuffer> {
    let pool = block.pool();
    let Some(cl) = pool.as_any().downcast_ref::<Pool<OpenClBackend>>() else {
        return Err(Error::Unsupported {
            backend: pool.name().to_string(),
            what: "an OpenCL sub-buffer of a block that is not OpenCL memory".into(),
        });
    };
    cl_sub_buffer(cl, block.handle())
}

/// The sub-buffer of the bytes `range` selects of an owned block of an OpenCL pool (offsets relative to the
/// block's first byte), for a kernel that works on part of a buffer. The start plus the block's offset must be a
/// multiple of the device's `CL_DEVICE_MEM_BASE_ADDR_ALIGN` ([`Error::Unsupported`] saying so otherwise); a range
/// past the bytes asked for, reversed or empty is [`Error::OutOfBounds`]. As [`block_sub_buffer`] otherwise.
pub fn block_sub_buffer_range(block: &OwnedBlock, range: std::ops::Range<u64>) -> Result<SubBuffer> {
    let pool = block.pool();
    let Some(cl) = pool.as_any().downcast_ref::<Pool<OpenClBackend>>() else {
        return Err(Error::Unsupported {
            backend: pool.name().to_string(),
            what: "an OpenCL sub-buffer of a block that is not OpenCL memory".into(),
        });
    };
    let requested = block.handle().requested();
    if range.start >= range.end || range.end > requested {
        return Err(Error::OutOfBounds(format!(
            "bytes {}..{} of an OpenCL buffer of {requested}: not a non-empty range inside it",
            range.start, range.end
        )));
    }
    let (segment, offset) = live(cl, block.handle())?;
    cl.backend().sub_buffer(&segment, offset + range.start, range.end - range.start)
}

/// Non-blocking [`Pool::write`]: enqueues copying `data` into the block at `offset`. Refused for host-mapped
/// memory (see `device_memory`).
pub fn write_block_async(
    pool: &Pool<OpenClBackend>,
    block: &BlockHandle,
    offset: u64,
    data: Vec<u8>,
) -> Result<PendingWrite> {
    check_in_block(block, offset, data.len() as u64)?;
    let (segment, base) = device_memory(pool, block, "an asynchronous write")?;
    pool.backend().write_async(&segment, base + offset, data)
}

/// Non-blocking write into an owned block of an OpenCL pool: enqueues copying `data` into the block at `offset`
/// (`clEnqueueWriteBuffer` without blocking) and returns the transfer, which owns `data` until the device has
/// read it; wait on it ([`PendingWrite::wait`], which hands `data` back for reuse) or order kernels after its
/// [`PendingWrite::event`]. Memory mapped into the host (pinned pools of devices that share host memory) is
/// written at once instead, under the pool's lock, and gives `None`. Errors with [`Error::Unsupported`] when
/// the block is not OpenCL memory, [`Error::OutOfBounds`] past the block's end.
pub fn write_owned_block_async(block: &mut OwnedBlock, offset: u64, data: Vec<u8>) -> Result<Option<PendingWrite>> {
    let pool = block.pool();
    let Some(cl) = pool.as_any().downcast_ref::<Pool<OpenClBackend>>() else {
        return Err(Error::Unsupported {
            backend: pool.name().to_string(),
            what: "an OpenCL write into a block that is not OpenCL memory".into(),
        });
    };
    block.check_range(offset, data.len() as u64)?;
    let (segment, _) = live(cl, block.handle())?;
    if segment.0.mapped.is_some() {
        block.write(offset, &data)?;
        return Ok(None);
    }
    write_block_async(cl, block.handle(), offset, data).map(Some)
}

/// Non-blocking [`Pool::read`]: enqueues copying `len` bytes of the block at `offset` into a new host buffer.
/// Refused for host-mapped memory (see `device_memory`).
pub fn read_block_async(pool: &Pool<OpenClBackend>, block: &BlockHandle, offset: u64, len: u64) -> Result<PendingRead> {
    check_in_block(block, offset, len)?;
    let (segment, base) = device_memory(pool, block, "an asynchronous read")?;
    pool.backend().read_async(&segment, base + offset, len)
}

/// Non-blocking [`Pool::fill`]: enqueues setting `len` bytes of the block at `offset` to `value`; the event
/// completes when the fill has. Refused for host-mapped memory (see `device_memory`).
pub fn fill_block_async(
    pool: &Pool<OpenClBackend>,
    block: &BlockHandle,
    offset: u64,
    len: u64,
    value: u8,
) -> Result<ClEvent> {
    check_in_block(block, offset, len)?;
    let (segment, base) = device_memory(pool, block, "an asynchronous fill")?;
    pool.backend().fill_async(&segment, base + offset, len, value)
}

/// The segment and offset of live `block`, refused where the segment is mapped into the host (HostPinned on
/// host-unified devices). Transfers through a plain handle that outlast the pool's lock (queued ones, or a
/// blocking copy that drops it) could otherwise land after the block was freed and its memory lent to an
/// [`OwnedBlock`] as a host slice; for mapped memory use [`Pool::write`]/[`Pool::read`], which copy under the
/// lock.
fn device_memory(pool: &Pool<OpenClBackend>, block: &BlockHandle, what: &str) -> Result<(OpenClSegment, u64)> {
    let (segment, base) = live(pool, block)?;
    if segment.0.mapped.is_some() {
        return Err(Error::Unsupported {
            backend: pool.backend().name().to_string(),
            what: format!(
                "{what} of host-mapped memory through a plain handle: use Pool::write or Pool::read, or an owned block"
            ),
        });
    }
    Ok((segment, base))
}

/// Copies `len` bytes from the start of `src_block` to the start of `dst_block` on the device
/// (clEnqueueCopyBuffer) and waits. Both pools must be of one device (one context and queue); `len` must lie
/// inside both blocks. Pools of different devices are [`Error::Unsupported`]: move the bytes through the host.
/// Host-mapped blocks are refused (see `device_memory`); owned blocks copy with
/// [`OwnedBlock::copy_on_device_from`].
pub fn copy_block(
    src_pool: &Pool<OpenClBackend>,
    src_block: &BlockHandle,
    dst_pool: &Pool<OpenClBackend>,
    dst_block: &BlockHandle,
    len: u64,
) -> Result<()> {
    let (src_segment, src_base) = device_memory(src_pool, src_block, "a device copy")?;
    let (dst_segment, dst_base) = device_memory(dst_pool, dst_block, "a device copy")?;
    let (src, dst) = (src_pool.backend(), dst_pool.backend());
    if !Arc::ptr_eq(&src.device, &dst.device) {
        return Err(Error::Unsupported {
            backend: dst.name.clone(),
            what: format!("a device copy from {}: the pools are of different devices", src.name),
        });
    }
    check_in_block(src_block, 0, len)?;
    check_in_block(dst_block, 0, len)?;
    copy_segments(src, &src_segment, src_base, dst, &dst_segment, dst_base, len)
}

/// Copies `len` bytes from `src_segment` at `src_offset` to `dst_segment` at `dst_offset` with
/// `clEnqueueCopyBuffer` on the destination's queue, and waits. Both backends are of one device (one context and
/// queue); ranges outside their segments are [`Error::OutOfBounds`].
pub(super) fn copy_segments(
    src: &OpenClBackend,
    src_segment: &OpenClSegment,
    src_offset: u64,
    dst: &OpenClBackend,
    dst_segment: &OpenClSegment,
    dst_offset: u64,
    len: u64,
) -> Result<()> {
    let (src_offset, n) = src.range(src_segment, src_offset, len)?;
    let (dst_offset, _) = dst.range(dst_segment, dst_offset, len)?;
    if n == 0 {
        return Ok(());
    }
    raw::copy(&dst.device.queue, &src_segment.0.mem, src_offset, &dst_segment.0.mem, dst_offset, n)
        .map_err(|e| dst.err(e))
}

fn live(pool: &Pool<OpenClBackend>, block: &BlockHandle) -> Result<(OpenClSegment, u64)> {
    pool.awake_segment_of(block)
}

fn check_in_block(block: &BlockHandle, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= block.size() => Ok(()),
        _ => Err(Error::OutOfBounds(format!("{len} bytes at {offset} in a block of {} bytes", block.size()))),
    }
}
