//! Device-side copies between two owned blocks: the entry ([`OwnedBlock::copy_on_device_from`]) and what it
//! reports ([`DevicePath`]). The copy itself is each backend's [`crate::Backend::copy_on_device`], reached through
//! the destination's pool, which takes a source pool of its own kind; for anything else the caller stages the
//! bytes through the host.

use crate::{OwnedBlock, Result};

/// How [`OwnedBlock::copy_on_device_from`] moved the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, strum::Display)]
#[strum(serialize_all = "kebab-case")]
pub enum DevicePath {
    /// One CUDA context: a device copy (device and pinned memory share unified addressing).
    CudaDevice,
    /// Two CUDA devices: a peer copy.
    CudaPeer,
    /// One OpenCL context: `clEnqueueCopyBuffer`.
    OpenClDevice,
    /// One wgpu device: `copy_buffer_to_buffer`.
    WgpuDevice,
}

impl OwnedBlock {
    /// Copies the first `len` bytes of `src` into this block on the device(s), and waits for the copy, when one
    /// API holds both blocks and can copy between them; `Ok(None)` when no device path applies (different APIs
    /// or devices, read-only target, a wgpu pool without the copy usages), so the caller moves the bytes through
    /// the host. `len` must lie inside both blocks.
    pub fn copy_on_device_from(&mut self, src: &OwnedBlock, len: u64) -> Result<Option<DevicePath>> {
        for block in [&*self, src] {
            block.check_range(0, len)?;
        }
        self.pool().copy_on_device_from(self.handle(), &**src.pool(), src.handle(), len)
    }
}
