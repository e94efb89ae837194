//! Device-side copies for migration, one per API behind its cargo feature: each applies only when both blocks
//! belong to pools of that API that can reach each other (one CUDA process: any two CUDA pools; OpenCL: one
//! context; wgpu: one device, with copy usages on both sides). Pools are recognised by downcasting
//! ([`MemoryPool::as_any`]); anything else returns `None` and the caller stages through the host.

use super::MigrationPath;
use crate::Result;
#[allow(unused_imports)]
use umm_backends::{MemoryPool, OwnedBlock, Pool};

/// Copies the first `len` bytes of `src` to `dst` on the device(s) when one API holds both blocks; `None` when
/// no device path applies.
pub(super) fn device_copy(src: &OwnedBlock, dst: &OwnedBlock, len: u64) -> Result<Option<MigrationPath>> {
    let _ = (src, dst, len);
    #[cfg(feature = "cuda")]
    if let Some(path) = cuda(src, dst, len)? {
        return Ok(Some(path));
    }
    #[cfg(feature = "opencl")]
    if let Some(path) = opencl(src, dst, len)? {
        return Ok(Some(path));
    }
    #[cfg(feature = "wgpu")]
    if let Some(path) = wgpu(src, dst, len)? {
        return Ok(Some(path));
    }
    Ok(None)
}

/// Waits for the device work queued on `pool` (CUDA context, OpenCL queue), so that host access to its memory
/// sees what kernels wrote. Nothing for other pools, whose accesses are complete when they return.
pub(super) fn settle(pool: &std::sync::Arc<dyn MemoryPool>) -> Result<()> {
    let _ = pool;
    #[cfg(feature = "cuda")]
    if let Some(cuda) = pool.as_any().downcast_ref::<umm_backends::cuda::CudaPool>() {
        cuda.backend().context().synchronize().map_err(|e| umm_backends::Error::Driver {
            backend: pool.name().to_string(),
            call: "cuCtxSynchronize".into(),
            message: e.to_string(),
        })?;
    }
    #[cfg(feature = "opencl")]
    if let Some(cl) = pool.as_any().downcast_ref::<Pool<umm_backends::opencl::OpenClBackend>>() {
        cl.backend().finish()?;
    }
    Ok(())
}

/// The concrete pool behind `block`, if it is a `P`.
#[allow(dead_code)]
fn downcast<P: 'static>(block: &OwnedBlock) -> Option<&P> {
    block.pool().as_any().downcast_ref::<P>()
}

#[cfg(feature = "cuda")]
fn cuda(src: &OwnedBlock, dst: &OwnedBlock, len: u64) -> Result<Option<MigrationPath>> {
    use umm_backends::cuda::CudaPool;
    use umm_backends::PoolPlacement;
    let (Some(from), Some(to)) = (downcast::<CudaPool>(src), downcast::<CudaPool>(dst)) else { return Ok(None) };
    if to.backend().placement() == PoolPlacement::ReadOnly {
        return Ok(None);
    }
    umm_backends::cuda::copy_block(from.pool(), src.handle(), to.pool(), dst.handle(), len)?;
    let same_device = from.backend().context().cu_ctx() == to.backend().context().cu_ctx();
    Ok(Some(if same_device { MigrationPath::CudaDevice } else { MigrationPath::CudaPeer }))
}

#[cfg(feature = "opencl")]
fn opencl(src: &OwnedBlock, dst: &OwnedBlock, len: u64) -> Result<Option<MigrationPath>> {
    use umm_backends::opencl::OpenClBackend;
    let (Some(from), Some(to)) = (downcast::<Pool<OpenClBackend>>(src), downcast::<Pool<OpenClBackend>>(dst)) else {
        return Ok(None);
    };
    if from.backend().context().get() != to.backend().context().get() {
        return Ok(None);
    }
    umm_backends::opencl::copy_block(from, src.handle(), to, dst.handle(), len)?;
    Ok(Some(MigrationPath::OpenClDevice))
}

#[cfg(feature = "wgpu")]
fn wgpu(src: &OwnedBlock, dst: &OwnedBlock, len: u64) -> Result<Option<MigrationPath>> {
    use umm_backends::wgpu_backend::{WgpuBackend, WgpuPoolKind as K};
    let (Some(from), Some(to)) = (downcast::<Pool<WgpuBackend>>(src), downcast::<Pool<WgpuBackend>>(dst)) else {
        return Ok(None);
    };
    let (a, b) = (from.backend(), to.backend());
    // COPY_SRC on the source, COPY_DST on the target (see WgpuPoolKind::usages).
    let copy_src = matches!(a.pool_kind(), K::DeviceLocal | K::ReadOnly | K::Upload | K::Shared);
    let copy_dst = matches!(b.pool_kind(), K::DeviceLocal | K::Readback | K::Shared);
    if a.device() != b.device() || !copy_src || !copy_dst {
        return Ok(None);
    }
    // wgpu copies whole words; blocks start on the pool alignment and span whole words, so rounding up stays
    // inside both blocks.
    let words = len.next_multiple_of(4);
    umm_backends::wgpu_backend::copy_block(from, src.handle(), 0, to, dst.handle(), 0, words)?;
    Ok(Some(MigrationPath::WgpuDevice))
}
