//! Device-side copies between two owned blocks, one per API behind its cargo feature. Each applies only when
//! both blocks belong to pools of that API that can reach each other (one CUDA process: any two CUDA pools;
//! OpenCL: one context; wgpu: one device, with copy usages on both sides). Pools are recognised by downcasting
//! ([`MemoryPool::as_any`]); for anything else the caller stages the bytes through the host. These live here,
//! not in the facade, because they need the blocks' handles, which do not leave this crate.

#[allow(unused_imports)]
use crate::{MemoryPool, OwnedBlock, Pool, Result};

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
        #[cfg(feature = "cuda")]
        if let Some(path) = cuda(src, self, len)? {
            return Ok(Some(path));
        }
        #[cfg(feature = "opencl")]
        if let Some(path) = opencl(src, self, len)? {
            return Ok(Some(path));
        }
        #[cfg(feature = "wgpu")]
        if let Some(path) = wgpu(src, self, len)? {
            return Ok(Some(path));
        }
        Ok(None)
    }
}

/// The concrete pool behind `block`, if it is a `P`.
#[allow(dead_code)]
fn downcast<P: 'static>(block: &OwnedBlock) -> Option<&P> {
    block.pool().as_any().downcast_ref::<P>()
}

#[cfg(feature = "cuda")]
fn cuda(src: &OwnedBlock, dst: &mut OwnedBlock, len: u64) -> Result<Option<DevicePath>> {
    use crate::cuda::CudaPool;
    use crate::PoolKind;
    let (Some(from), Some(to)) = (downcast::<CudaPool>(src), downcast::<CudaPool>(dst)) else { return Ok(None) };
    if to.backend().placement() == PoolKind::ReadOnly {
        return Ok(None);
    }
    crate::cuda::peer::copy_owned_or_device(from.pool(), src.handle(), to.pool(), dst.handle(), len)?;
    let same_device = from.backend().context().cu_ctx() == to.backend().context().cu_ctx();
    Ok(Some(if same_device { DevicePath::CudaDevice } else { DevicePath::CudaPeer }))
}

#[cfg(feature = "opencl")]
fn opencl(src: &OwnedBlock, dst: &mut OwnedBlock, len: u64) -> Result<Option<DevicePath>> {
    use crate::opencl::OpenClBackend;
    let (Some(from), Some(to)) = (downcast::<Pool<OpenClBackend>>(src), downcast::<Pool<OpenClBackend>>(dst)) else {
        return Ok(None);
    };
    if from.backend().context().get() != to.backend().context().get() {
        return Ok(None);
    }
    crate::opencl::copy_owned_or_device(from, src.handle(), to, dst.handle(), len)?;
    Ok(Some(DevicePath::OpenClDevice))
}

#[cfg(feature = "wgpu")]
fn wgpu(src: &OwnedBlock, dst: &mut OwnedBlock, len: u64) -> Result<Option<DevicePath>> {
    use crate::wgpu_backend::WgpuBackend;
    use wgpu::BufferUsages;
    let (Some(from), Some(to)) = (downcast::<Pool<WgpuBackend>>(src), downcast::<Pool<WgpuBackend>>(dst)) else {
        return Ok(None);
    };
    let (a, b) = (from.backend(), to.backend());
    // COPY_SRC on the source, COPY_DST on a target that is not read-only (see WgpuUsage::usages; adopted
    // buffers have their own usages).
    let copy_src = a.usage().contains(BufferUsages::COPY_SRC);
    let copy_dst = b.usage().contains(BufferUsages::COPY_DST) && !b.is_read_only();
    if a.device() != b.device() || !copy_src || !copy_dst {
        return Ok(None);
    }
    // wgpu copies whole words; blocks start on the pool alignment and span whole words, so rounding up stays
    // inside both blocks.
    let words = len.next_multiple_of(4);
    crate::wgpu_backend::copy_block(from, src.handle(), 0, to, dst.handle(), 0, words)?;
    Ok(Some(DevicePath::WgpuDevice))
}
