//! [`UniversalBuffer<T>`]: a typed buffer in one pool, returned to it on drop. Its reads and writes feed the
//! usage tracker.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::migration_path::MigrationPath;
use crate::placement_cache::Placed;
use std::marker::PhantomData;
use std::sync::Arc;
use umm_backends::{BlockInfo, MemoryPool, OwnedBlock};
use umm_placement::{AccessPattern, Decision, Placement, PoolKind, TrackId};

pub(crate) struct BufferMeta {
    pub(crate) requested: Placement,
    pub(crate) access: AccessPattern,
    /// The decision, device, pool, tracker and profiler: shared with the buffers placed alike on this thread.
    pub(crate) placed: Arc<Placed>,
    /// Behind one thin pointer: most buffers have no label, and eight bytes instead of twenty-four keep a
    /// buffer within 128 bytes, which is moved inline rather than through a call to `memcpy`.
    #[allow(clippy::box_collection)]
    pub(crate) label: Option<Box<String>>,
    pub(crate) read_only: bool,
    /// Whether a read-only buffer got its initial fill (writes are refused from then on).
    pub(crate) filled: bool,
    /// How the bytes got here, when the buffer was made by a migration.
    pub(crate) migrated_via: Option<MigrationPath>,
}

impl BufferMeta {
    /// The label given at allocation.
    pub(crate) fn label(&self) -> Option<&str> {
        self.label.as_deref().map(String::as_str)
    }

    /// The label, for an error.
    pub(crate) fn owned_label(&self) -> Option<String> {
        self.label.as_deref().cloned()
    }
}

/// `len` elements of `T` on one device, in one pool. Dropping it returns the block to its pool.
pub struct UniversalBuffer<T: bytemuck::Pod> {
    pub(crate) block: Option<OwnedBlock>,
    len: usize,
    /// With the buffer's small fields, which share its padding: a buffer stays within 128 bytes.
    pub(crate) meta: BufferMeta,
    track: Option<TrackId>,
    /// The buffer's entry in the profiler's live table.
    profile: u64,
    _element: PhantomData<T>,
}

impl<T: bytemuck::Pod> UniversalBuffer<T> {
    pub(crate) fn new(
        filled: bool,
        block: Option<OwnedBlock>,
        len: usize,
        mut meta: BufferMeta,
        track: TrackId,
        profile: u64,
    ) -> Self {
        meta.filled = filled && meta.read_only;
        Self { block, len, meta, track: Some(track), profile, _element: PhantomData }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes (`len * size_of::<T>()`).
    pub fn size_bytes(&self) -> u64 {
        self.len as u64 * std::mem::size_of::<T>() as u64
    }

    /// The kind of pool the buffer lives in.
    pub fn placement(&self) -> PoolKind {
        self.meta.placed.decision.pool
    }

    /// The placement that was asked for (possibly `Auto`).
    pub fn requested_placement(&self) -> Placement {
        self.meta.requested
    }

    /// The declared access pattern.
    pub fn access_pattern(&self) -> AccessPattern {
        self.meta.access
    }

    /// The decision that placed the buffer, with its reason.
    pub fn decision(&self) -> &Decision {
        &self.meta.placed.decision
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.meta.placed.device
    }

    /// The label given at allocation.
    pub fn label(&self) -> Option<&str> {
        self.meta.label()
    }

    /// How the bytes of a buffer made by [`UniversalBuffer::migrate`] or [`UniversalBuffer::copy_to`] were moved
    /// (`None` for a buffer allocated directly).
    pub fn migrated_via(&self) -> Option<MigrationPath> {
        self.meta.migrated_via
    }

    /// Whether writes are refused (ReadOnly buffers after their initial fill).
    pub fn is_read_only(&self) -> bool {
        self.meta.read_only
    }

    /// The device address of the buffer's first byte, where its memory has one: CUDA (a `CUdeviceptr`) and the
    /// simulated device; `None` for host, OpenCL and wgpu memory and for an empty buffer. A number to identify the
    /// memory by (in logs, beside a profiler's trace, in tests): kernels reach the buffer through the views of
    /// [`crate::interop`], which order their work on the buffer's stream.
    pub fn device_address(&self) -> Option<u64> {
        self.block.as_ref().and_then(OwnedBlock::device_address)
    }

    /// Where the buffer's block lies in its pool (`None` for an empty buffer): key, segment, offset, sizes. Plain
    /// numbers: the block's handle stays with the buffer, which alone may free it or touch its bytes.
    pub fn block_info(&self) -> Option<BlockInfo> {
        self.block.as_ref().map(OwnedBlock::info)
    }

    /// The pool the buffer came from (`None` for an empty buffer), for backend interop
    /// (`pool.as_any().downcast_ref::<Pool<...>>()`).
    pub fn pool(&self) -> Option<&Arc<dyn MemoryPool>> {
        self.block.as_ref().map(OwnedBlock::pool)
    }

    /// Writes `data` (exactly `len` elements, [`Error::LengthMismatch`] otherwise) into the buffer.
    pub fn write(&mut self, data: &[T]) -> Result<()> {
        self.write_range(0, data, true)
    }

    /// Writes `data` starting at element `offset`; `offset + data.len()` must not pass the end
    /// ([`Error::OutOfRange`] otherwise).
    pub fn write_at(&mut self, offset: usize, data: &[T]) -> Result<()> {
        self.write_range(offset, data, false)
    }

    fn write_range(&mut self, offset: usize, data: &[T], whole: bool) -> Result<()> {
        if self.meta.read_only && self.meta.filled {
            return Err(Error::ReadOnly { label: self.meta.owned_label() });
        }
        self.check(if whole { "write" } else { "write_at" }, offset, data.len(), whole)?;
        self.raw_write(offset, data)?;
        // A ReadOnly buffer takes one write (its fill) and is sealed after it.
        self.meta.filled = self.meta.read_only;
        Ok(())
    }

    fn raw_write(&mut self, offset: usize, data: &[T]) -> Result<()> {
        let Some(block) = &mut self.block else { return Ok(()) };
        let bytes: &[u8] = bytemuck::cast_slice(data);
        block.write((offset * std::mem::size_of::<T>()) as u64, bytes)?;
        if let Some(track) = &self.track {
            self.meta.placed.tracker.record_host_write(track, bytes.len() as u64);
        }
        Ok(())
    }

    /// Reads the whole buffer into `out` (exactly `len` elements, [`Error::LengthMismatch`] otherwise).
    pub fn read(&self, out: &mut [T]) -> Result<()> {
        self.read_range(0, out, true)
    }

    /// Reads `out.len()` elements starting at element `offset`; `offset + out.len()` must not pass the end
    /// ([`Error::OutOfRange`] otherwise).
    pub fn read_at(&self, offset: usize, out: &mut [T]) -> Result<()> {
        self.read_range(offset, out, false)
    }

    fn read_range(&self, offset: usize, out: &mut [T], whole: bool) -> Result<()> {
        self.check(if whole { "read" } else { "read_at" }, offset, out.len(), whole)?;
        let Some(block) = &self.block else { return Ok(()) };
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        block.read((offset * std::mem::size_of::<T>()) as u64, bytes)?;
        if let Some(track) = &self.track {
            self.meta.placed.tracker.record_host_read(track, bytes.len() as u64);
        }
        Ok(())
    }

    /// Copies the buffer into a new vector.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.read(&mut out)?;
        Ok(out)
    }

    /// Sets every element to `value`.
    pub fn fill(&mut self, value: T) -> Result<()> {
        if self.meta.read_only && self.meta.filled {
            return Err(Error::ReadOnly { label: self.meta.owned_label() });
        }
        let size_bytes = self.size_bytes();
        let Some(block) = &mut self.block else { return Ok(()) };
        let pattern: &[u8] = bytemuck::bytes_of(&value);
        if pattern.iter().all(|&b| b == pattern[0]) {
            block.fill(0, size_bytes, pattern[0])?;
        } else {
            // Write the pattern in chunks of at most 1 MiB.
            let per_chunk = ((1 << 20) / std::mem::size_of::<T>()).clamp(1, self.len);
            let chunk = vec![value; per_chunk];
            let mut done = 0;
            while done < self.len {
                let n = per_chunk.min(self.len - done);
                self.raw_write(done, &chunk[..n])?;
                done += n;
            }
            self.meta.filled = self.meta.read_only;
            return Ok(());
        }
        self.meta.filled = self.meta.read_only;
        if let Some(track) = &self.track {
            self.meta.placed.tracker.record_host_write(track, self.size_bytes());
        }
        Ok(())
    }

    /// The elements as a host slice, when the memory is host-addressable (host memory, pinned or mapped
    /// memory); `None` otherwise ([`UniversalBuffer::host_slice`] says why).
    pub fn as_slice(&self) -> Option<&[T]> {
        if self.len == 0 {
            return Some(&[]);
        }
        let bytes = self.block.as_ref()?.host_bytes()?;
        if let Some(track) = &self.track {
            self.meta.placed.tracker.record_host_read(track, bytes.len() as u64);
        }
        bytemuck::try_cast_slice(bytes).ok()
    }

    /// The elements as a host slice, or why not: [`Error::NotHostAddressable`] names the pool and the reason
    /// (device memory, a wgpu buffer mapped only for copies, a simulated device).
    pub fn host_slice(&self) -> Result<&[T]> {
        self.as_slice().ok_or_else(|| self.not_host_addressable())
    }

    /// The elements as a mutable host slice, or why not: [`Error::ReadOnly`] for a sealed read-only buffer,
    /// [`Error::NotHostAddressable`] as in [`UniversalBuffer::host_slice`].
    pub fn host_slice_mut(&mut self) -> Result<&mut [T]> {
        if self.meta.read_only && self.meta.filled {
            return Err(Error::ReadOnly { label: self.meta.owned_label() });
        }
        let castable = |bytes: &[u8]| bytemuck::try_cast_slice::<u8, T>(bytes).is_ok();
        if self.len != 0 && !self.block.as_ref().and_then(OwnedBlock::host_bytes).is_some_and(castable) {
            return Err(self.not_host_addressable());
        }
        Ok(self.as_mut_slice().expect("host-addressable, castable and writable: checked above"))
    }

    #[cold]
    fn not_host_addressable(&self) -> Error {
        let pool = self.block.as_ref().map(|b| b.pool());
        let why = match pool.map(|p| p.api()) {
            Some(umm_placement::Api::Cuda) => {
                "device memory of a CUDA device, which the host reaches only through copies"
            }
            Some(umm_placement::Api::Wgpu) => "a wgpu buffer, which the host reaches only through a mapped copy",
            Some(umm_placement::Api::OpenCl) => "an OpenCL buffer this device does not keep mapped into the host",
            Some(umm_placement::Api::Sim) => "on a simulated device, which the host reaches only through copies",
            _ => "memory the host cannot address",
        };
        Error::NotHostAddressable {
            label: self.meta.owned_label(),
            pool: pool.map_or_else(|| "no pool".to_string(), |p| p.name().to_string()),
            kind: self.placement(),
            why,
        }
    }

    /// The elements as a mutable host slice, when host-addressable and not read-only.
    pub fn as_mut_slice(&mut self) -> Option<&mut [T]> {
        if self.meta.read_only && self.meta.filled {
            return None;
        }
        if self.len == 0 {
            return Some(&mut []);
        }
        if let Some(track) = &self.track {
            self.meta.placed.tracker.record_host_write(track, self.size_bytes());
        }
        let bytes = self.block.as_mut()?.host_bytes_mut()?;
        bytemuck::try_cast_slice_mut(bytes).ok()
    }

    /// Records that a device kernel used the buffer (feeds the recommendations).
    pub fn record_device_use(&self) {
        if let Some(track) = &self.track {
            self.meta.placed.tracker.record_device_use(track);
        }
    }

    fn check(&self, op: &'static str, offset: usize, given: usize, whole: bool) -> Result<()> {
        if whole {
            if given == self.len {
                return Ok(());
            }
            return Err(Error::LengthMismatch { op, buffer_len: self.len, given_len: given });
        }
        match offset.checked_add(given) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange { op, len: self.len, offset, count: given }),
        }
    }
}

impl<T: bytemuck::Pod> Drop for UniversalBuffer<T> {
    fn drop(&mut self) {
        if let Some(track) = self.track.take() {
            self.meta.placed.tracker.retire(track);
        }
        self.meta.placed.profiler.on_free(self.profile);
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for UniversalBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniversalBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("placement", &self.meta.placed.decision.pool)
            .field("device", &self.meta.placed.device.name())
            .field("label", &self.meta.label())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_fits_in_128_bytes() {
        // x86-64 moves a value of up to 128 bytes with a few vector moves, a larger one through a call to
        // `memcpy`: every buffer returned, stored in a `Vec` or dropped is moved at least once.
        assert!(std::mem::size_of::<UniversalBuffer<f32>>() <= 128, "{}", std::mem::size_of::<UniversalBuffer<f32>>());
        assert!(std::mem::size_of::<UniversalBuffer<u8>>() <= 128);
    }
}
