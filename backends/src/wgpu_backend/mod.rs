//! wgpu buffers (Vulkan, GL, Metal, DX12): every adapter becomes a [`WgpuDevice`] whose pools are
//! [`Pool<WgpuBackend>`](crate::Pool) on the shared engine. A segment is one `wgpu::Buffer` ([`WgpuSegment`]), and
//! every block is a whole segment ([`Backend::segment_per_block`]): wgpu tracks usage per buffer, so within one
//! dispatch or pass a buffer is either read-only (storage `read`, uniform, vertex, index, copy source) or
//! read-write (storage `read_write`, copy destination), and a buffer is never copied into itself. Blocks cut from
//! one shared buffer could not be an input and an output of one kernel; blocks of their own can, in any mix of
//! usages. A freed block's buffer stays cached and serves a later request of up to 1/4 less (see
//! [`crate::engine::WHOLE_FIT_SLACK`]); the pool's slack budget destroys buffers nobody reuses. A block is bound
//! as `(buffer, 0, size)` ([`binding`]) or copied with `copy_buffer_to_buffer` ([`copy_block`]).
//!
//! wgpu loads its drivers at run time: with none installed, [`discover`] returns no device and says why.
//!
//! Byte movement (all of it waits for the queue, so a call is complete when it returns):
//! - writes to buffers with `COPY_DST` go through `queue.write_buffer`; wgpu needs 4-byte aligned offsets and
//!   lengths there, so the partial words at either end of an unaligned range are read, patched and written back
//!   (those words lie inside the block: blocks start and end on the pool's alignment);
//! - reads copy into a staging buffer (`MAP_READ | COPY_DST`), map it, and poll the device until the map is done;
//! - mappable segments (host-pinned pools) are mapped directly instead. wgpu keeps one mapping per buffer, so
//!   every access to a mappable segment takes the segment's turn ([`WgpuSegment`]): while one thread has it
//!   mapped (two threads may read one block), another's map, copy or queued write of it would be refused.
//!
//! Work submitted by the caller on blocks of mappable pools (bind groups, copies) must likewise not overlap this
//! backend's reads and writes of the same block: wgpu refuses to submit work on a mapped buffer.
//!
//! Errors: wgpu reports validation, out-of-memory and internal errors asynchronously, to the innermost error scope
//! of the calling thread, else to the device's uncaptured-error handler (by default a panic). Every call of this
//! backend runs inside error scopes of its own, so its failures become [`Error::Driver`] naming the call; a lost
//! or destroyed device is reported the same way by every later call. umm installs no uncaptured-error handler:
//! errors of the caller's own work (its bind groups, passes, submissions) reach the caller as wgpu's default
//! handler, the caller's own error scopes or a handler the caller installs would deliver them.
//!
//! Waits: none is unbounded. A wait for the device gives up after [`wait_limit`] (`UMM_WGPU_TIMEOUT`, default 60 s)
//! with an error naming the call; creating the instance, enumerating adapters and opening a device run on a helper
//! thread waited for within the same bound, so a driver that never returns there becomes an error or a skipped
//! backend instead of a hung program. [`set_watchdog`] (`UMM_WGPU_WATCHDOG`) reports calls in flight too long.
//!
//! [`binding`]: crate::wgpu_backend::binding
//! [`copy_block`]: crate::wgpu_backend::copy_block
//! [`discover`]: crate::wgpu_backend::discover
//! [`set_watchdog`]: crate::wgpu_backend::set_watchdog
//! [`wait_limit`]: crate::wgpu_backend::wait_limit
//! [`WgpuDevice`]: crate::wgpu_backend::WgpuDevice
//! [`WgpuSegment`]: crate::wgpu_backend::WgpuSegment

mod device;
mod discover;
mod interop;
mod segment;
mod watch;

pub use discover::{discover, WgpuDevice};
pub use interop::{
    binding, block_binding, block_uniform_binding, copy_block, seal, segment_and_offset, uniform_binding, unseal,
    write_block_queued, WgpuBlock,
};
pub use segment::WgpuSegment;
pub use watch::{in_flight, parse_seconds, set_wait_limit, set_watchdog, wait_limit, InFlight};
/// The wgpu this crate was built with, so that callers build pipelines with the same version.
pub use wgpu;

use crate::adopt::{Adoption, Ownership};
use crate::{Api, Backend, DevicePath, Error, PoolKind, Result};
use device::DeviceShared;
use std::sync::Arc;
use wgpu::BufferUsages;

/// What a wgpu pool's buffers are for, which fixes their usages. [`WgpuDevice::pool`] maps each
/// [`PoolKind`] to one of these; [`WgpuDevice::pool_of`] takes one directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, strum::Display, strum::EnumIter)]
#[strum(serialize_all = "kebab-case")]
pub enum WgpuUsage {
    /// `STORAGE | UNIFORM | VERTEX | INDEX | INDIRECT | COPY_SRC | COPY_DST`: device memory a kernel or a draw
    /// may use every way a non-mapped buffer can be used.
    DeviceLocal,
    /// The same usages as [`WgpuUsage::DeviceLocal`]: filled at allocation and bound read-only (storage
    /// `read`, uniform, vertex, index, indirect, copy source); the facade refuses writes after the fill.
    ReadOnly,
    /// `MAP_WRITE | COPY_SRC`: host-written staging for uploads; written by mapping, read through a copy.
    Upload,
    /// `MAP_READ | COPY_DST`: read-back buffers; read by mapping, written through the queue.
    Readback,
    /// `MAP_READ | MAP_WRITE | STORAGE | COPY_SRC | COPY_DST` (needs `MAPPABLE_PRIMARY_BUFFERS`): host-mapped
    /// buffers that shaders can also bind, for adapters sharing memory with the host.
    Shared,
}

impl WgpuUsage {
    /// The buffer usages of this kind's segments.
    pub fn usages(self) -> BufferUsages {
        match self {
            Self::DeviceLocal | Self::ReadOnly => {
                BufferUsages::STORAGE
                    | BufferUsages::UNIFORM
                    | BufferUsages::VERTEX
                    | BufferUsages::INDEX
                    | BufferUsages::INDIRECT
                    | BufferUsages::COPY_SRC
                    | BufferUsages::COPY_DST
            }
            Self::Upload => BufferUsages::MAP_WRITE | BufferUsages::COPY_SRC,
            Self::Readback => BufferUsages::MAP_READ | BufferUsages::COPY_DST,
            Self::Shared => {
                BufferUsages::MAP_READ
                    | BufferUsages::MAP_WRITE
                    | BufferUsages::STORAGE
                    | BufferUsages::COPY_SRC
                    | BufferUsages::COPY_DST
            }
        }
    }

    /// The placement this kind serves.
    pub fn placement(self) -> PoolKind {
        match self {
            Self::DeviceLocal => PoolKind::DeviceLocal,
            Self::ReadOnly => PoolKind::ReadOnly,
            Self::Upload | Self::Readback | Self::Shared => PoolKind::HostPinned,
        }
    }
}

/// The backend of one wgpu pool: one device (shared by the device's pools) and one [`WgpuUsage`]. Every block
/// is a buffer of its own ([`Backend::segment_per_block`]).
pub struct WgpuBackend {
    name: String,
    wgpu_usage: WgpuUsage,
    usage: BufferUsages,
    alignment: u64,
    shared: Arc<DeviceShared>,
    /// Sealed block ranges `(buffer, start, end)`: writes and fills there are refused (see [`seal`]).
    sealed: parking_lot::Mutex<Vec<(wgpu::Buffer, u64, u64)>>,
    /// For the backend of an adopted buffer: that buffer (see [`crate::adopt`]).
    adoption: Option<Adoption<WgpuSegment>>,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuBackend")
            .field("name", &self.name)
            .field("wgpu_usage", &self.wgpu_usage)
            .field("usage", &self.usage)
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl WgpuBackend {
    fn new(name: String, wgpu_usage: WgpuUsage, shared: Arc<DeviceShared>) -> Self {
        // Every block starts its own buffer, so no binding offset alignment applies: sizes are kept to whole
        // mapping units (8 bytes), so that any block can be mapped or copied to its end.
        let alignment = wgpu::MAP_ALIGNMENT.max(wgpu::COPY_BUFFER_ALIGNMENT);
        let usage = wgpu_usage.usages();
        Self { name, wgpu_usage, usage, alignment, shared, sealed: parking_lot::Mutex::new(Vec::new()), adoption: None }
    }

    /// The backend of a pool holding one adopted buffer, with that buffer's own usages. Its one block starts at
    /// offset 0, so no binding alignment applies; the alignment is wgpu's copy alignment (4), so that the block
    /// spans whole words. Reported as [`WgpuUsage::DeviceLocal`]; [`WgpuBackend::usage`] tells what it allows.
    fn adopting(name: String, shared: Arc<DeviceShared>, buffer: wgpu::Buffer, ownership: Ownership) -> Self {
        let usage = buffer.usage();
        let mappable = usage.intersects(BufferUsages::MAP_READ | BufferUsages::MAP_WRITE);
        let segment = WgpuSegment::new(buffer, mappable);
        Self {
            name,
            wgpu_usage: WgpuUsage::DeviceLocal,
            usage,
            alignment: wgpu::COPY_BUFFER_ALIGNMENT,
            shared,
            sealed: parking_lot::Mutex::new(Vec::new()),
            adoption: Some(Adoption::new(segment, None, ownership)),
        }
    }

    /// Whether this backend's pool holds one adopted buffer.
    pub fn is_adopted(&self) -> bool {
        self.adoption.is_some()
    }

    /// The wgpu device (shared by every pool of the adapter), for pipelines and bind groups.
    pub fn device(&self) -> &wgpu::Device {
        &self.shared.device
    }

    /// The device's queue. Work submitted here is ordered with this backend's copies.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.shared.queue
    }

    /// The limits the device was opened with (the adapter's own).
    pub fn limits(&self) -> &wgpu::Limits {
        &self.shared.limits
    }

    /// What this pool's buffers are for.
    pub fn wgpu_usage(&self) -> WgpuUsage {
        self.wgpu_usage
    }

    /// The usages of this pool's buffers.
    pub fn usage(&self) -> BufferUsages {
        self.usage
    }

    /// Whether this is a ReadOnly pool. The pool itself lets anyone write (the initial fill is a write): callers
    /// that hand blocks out (the facade) refuse writes after the fill, or [`seal`] the block so that this backend
    /// refuses them.
    pub fn is_read_only(&self) -> bool {
        self.wgpu_usage == WgpuUsage::ReadOnly
    }

    /// Why the device was lost, once it has been (destroyed, driver reset); `None` while it works.
    pub fn lost_reason(&self) -> Option<String> {
        self.shared.lost_reason()
    }

    fn check_range(&self, segment: &wgpu::Buffer, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= segment.size() => Ok(()),
            _ => Err(Error::OutOfBounds(format!(
                "{len} bytes at {offset} in a wgpu buffer of {} bytes on {}",
                segment.size(),
                self.name
            ))),
        }
    }

    /// Refuses a write of `[offset, offset + len)` that touches a sealed block.
    fn check_unsealed(&self, segment: &wgpu::Buffer, offset: u64, len: u64) -> Result<()> {
        let sealed = self.sealed.lock();
        let end = offset + len;
        match sealed.iter().find(|(b, s, e)| b == segment && offset < *e && *s < end) {
            None => Ok(()),
            Some((_, s, e)) => Err(Error::Unsupported {
                backend: self.name.clone(),
                what: format!(
                    "writing {len} bytes at buffer offset {offset}: the block at {s}..{e} is sealed read-only \
                     (filled at allocation); unseal it before writing or freeing"
                ),
            }),
        }
    }
}

impl crate::backend::sealed::Sealed for WgpuBackend {}

impl Backend for WgpuBackend {
    type Segment = WgpuSegment;

    fn name(&self) -> &str {
        &self.name
    }
    fn api(&self) -> Api {
        Api::Wgpu
    }
    fn alignment(&self) -> u64 {
        self.alignment
    }
    fn max_segment_size(&self) -> u64 {
        // Bigger buffers than a binding may span are fine: `binding` checks each block's size. Rounded down to
        // the alignment (lavapipe reports 2^31 - 1) so that every segment size stays a multiple of it.
        self.shared.limits.max_buffer_size & !(self.alignment - 1)
    }
    fn capacity(&self) -> u64 {
        self.shared.capacity
    }
    fn free_bytes(&self) -> u64 {
        self.shared.free_bytes()
    }
    fn segment_per_block(&self) -> bool {
        true
    }
    /// Pools of one device whose buffers have the copy usages (COPY_SRC on the source, COPY_DST on a target that
    /// is not read-only; adopted buffers have their own usages) are joined by `copy_buffer_to_buffer`. wgpu
    /// copies whole words: blocks start on the pool's alignment and span whole words, so `len` rounded up to one
    /// stays inside both blocks.
    fn copy_on_device(
        &self,
        segment: &WgpuSegment,
        offset: u64,
        src: &Self,
        src_segment: &WgpuSegment,
        src_offset: u64,
        len: u64,
    ) -> Result<Option<DevicePath>> {
        let copy_src = src.usage().contains(BufferUsages::COPY_SRC);
        let copy_dst = self.usage().contains(BufferUsages::COPY_DST) && !self.is_read_only();
        if src.device() != self.device() || !copy_src || !copy_dst {
            return Ok(None);
        }
        let words = len.next_multiple_of(4);
        interop::copy_segments(src, src_segment, src_offset, self, segment, offset, words)?;
        Ok(Some(DevicePath::WgpuDevice))
    }
    fn create_segment(&self, size: u64) -> Result<WgpuSegment> {
        if let Some(adoption) = &self.adoption {
            let segment = adoption.take(&self.name)?;
            self.shared.held.fetch_add(segment.buffer().size(), std::sync::atomic::Ordering::Relaxed);
            return Ok(segment);
        }
        let max = self.max_segment_size();
        if size > max {
            return Err(Error::TooLarge { device: self.name.clone(), requested: size, max });
        }
        let buffer = self.shared.scoped(&self.name, "create_buffer", || {
            self.shared.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("umm segment"),
                size,
                usage: self.usage,
                mapped_at_creation: false,
            })
        })?;
        self.shared.held.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
        let mappable = self.usage.intersects(BufferUsages::MAP_READ | BufferUsages::MAP_WRITE);
        Ok(WgpuSegment::new(buffer, mappable))
    }
    fn destroy_segment(&self, segment: WgpuSegment, _: crate::backend::PoolAccess) {
        let buffer = segment.buffer();
        self.sealed.lock().retain(|(b, _, _)| b != buffer);
        // wgpu keeps the memory until submitted work that uses the buffer is done. On a lost device the call
        // may fail: that is logged, and the bytes are no longer counted either way.
        let size = buffer.size();
        // A borrowed buffer stays its owner's: only umm's handle on it goes.
        let owned = self.adoption.as_ref().is_none_or(Adoption::owned);
        if owned && self.shared.lost_reason().is_none() {
            if let Err(e) = self.shared.scoped(&self.name, "buffer.destroy", || buffer.destroy()) {
                log::warn!("{e}");
            }
        }
        self.shared.held.fetch_sub(size, std::sync::atomic::Ordering::Relaxed);
    }
    fn write(&self, segment: &WgpuSegment, offset: u64, src: &[u8]) -> Result<()> {
        let buffer = segment.buffer();
        self.check_range(buffer, offset, src.len() as u64)?;
        self.check_unsealed(buffer, offset, src.len() as u64)?;
        if src.is_empty() {
            return Ok(());
        }
        let _turn = segment.turn();
        self.write_bytes(buffer, offset, src)
    }
    fn read(&self, segment: &WgpuSegment, offset: u64, dst: &mut [u8]) -> Result<()> {
        let buffer = segment.buffer();
        self.check_range(buffer, offset, dst.len() as u64)?;
        if dst.is_empty() {
            return Ok(());
        }
        let _turn = segment.turn();
        self.read_bytes(buffer, offset, dst)
    }
    fn fill(&self, segment: &WgpuSegment, offset: u64, len: u64, value: u8) -> Result<()> {
        let buffer = segment.buffer();
        self.check_range(buffer, offset, len)?;
        self.check_unsealed(buffer, offset, len)?;
        let _turn = segment.turn();
        let end = offset + len;
        let (a, b) = (offset.next_multiple_of(4), end & !3);
        if value == 0 && self.usage.contains(BufferUsages::COPY_DST) && a < b {
            self.shared.clear(&self.name, buffer, a, b - a)?;
            self.fill_by_writes(buffer, offset, a - offset, 0)?;
            return self.fill_by_writes(buffer, b, end - b, 0);
        }
        self.fill_by_writes(buffer, offset, len, value)
    }
}

/// Byte movement on a checked range, with the segment's turn already held by the caller.
impl WgpuBackend {
    fn write_bytes(&self, buffer: &wgpu::Buffer, offset: u64, src: &[u8]) -> Result<()> {
        if self.usage.contains(BufferUsages::MAP_WRITE) {
            return self.shared.write_mapped(&self.name, buffer, offset, src);
        }
        if !self.usage.contains(BufferUsages::COPY_DST) {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: format!("writing a buffer with usages {:?}", self.usage),
            });
        }
        self.write_queued(buffer, offset, src)
    }

    fn read_bytes(&self, buffer: &wgpu::Buffer, offset: u64, dst: &mut [u8]) -> Result<()> {
        if self.usage.contains(BufferUsages::MAP_READ) {
            return self.shared.read_mapped(&self.name, buffer, offset, dst);
        }
        if !self.usage.contains(BufferUsages::COPY_SRC) {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: format!("reading a buffer with usages {:?}", self.usage),
            });
        }
        self.shared.read_staged(&self.name, buffer, offset, dst)
    }

    /// `queue.write_buffer` for the aligned middle; the partial words at the ends are read, patched, rewritten.
    fn write_queued(&self, buffer: &wgpu::Buffer, offset: u64, src: &[u8]) -> Result<()> {
        let end = offset + src.len() as u64;
        let (a, b) = (offset.next_multiple_of(4), end & !3);
        if a >= b {
            // The range lies within at most two words and covers none whole.
            return self.patch(buffer, offset, src);
        }
        self.shared.write_queue(&self.name, buffer, a, &src[(a - offset) as usize..(b - offset) as usize])?;
        if offset < a {
            self.patch(buffer, offset, &src[..(a - offset) as usize])?;
        }
        if end > b {
            self.patch(buffer, b, &src[(b - offset) as usize..])?;
        }
        Ok(())
    }

    /// Writes `src` (at most 8 bytes, inside the words around it) at `offset` by rewriting whole words.
    fn patch(&self, buffer: &wgpu::Buffer, offset: u64, src: &[u8]) -> Result<()> {
        let end = offset + src.len() as u64;
        let (start, stop) = (offset & !3, end.next_multiple_of(4));
        let mut words = vec![0u8; (stop - start) as usize];
        self.read_bytes(buffer, start, &mut words)?;
        words[(offset - start) as usize..(end - start) as usize].copy_from_slice(src);
        self.shared.write_queue(&self.name, buffer, start, &words)
    }

    fn fill_by_writes(&self, buffer: &wgpu::Buffer, offset: u64, len: u64, value: u8) -> Result<()> {
        const CHUNK: u64 = 4 << 20;
        let chunk = vec![value; CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = CHUNK.min(len - done);
            self.write_bytes(buffer, offset + done, &chunk[..n as usize])?;
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usages_are_valid_webgpu_combinations() {
        use strum::IntoEnumIterator;
        for kind in WgpuUsage::iter() {
            let u = kind.usages();
            // Without MAPPABLE_PRIMARY_BUFFERS, MAP_READ goes only with COPY_DST and MAP_WRITE only with COPY_SRC.
            if kind != WgpuUsage::Shared {
                if u.contains(BufferUsages::MAP_READ) {
                    assert_eq!(u, BufferUsages::MAP_READ | BufferUsages::COPY_DST);
                }
                if u.contains(BufferUsages::MAP_WRITE) {
                    assert_eq!(u, BufferUsages::MAP_WRITE | BufferUsages::COPY_SRC);
                }
            }
        }
        assert_eq!(WgpuUsage::Upload.placement(), PoolKind::HostPinned);
        assert_eq!(WgpuUsage::ReadOnly.to_string(), "read-only");
    }
}
