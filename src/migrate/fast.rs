//! What migration needs from the device APIs beyond the pools' byte copies: waiting for a pool's queued work
//! before the host reads its memory. The device-to-device copies themselves are
//! [`OwnedBlock::copy_on_device_from`](umm_backends::OwnedBlock::copy_on_device_from), in the backends crate,
//! which alone holds the blocks' handles.

use super::MigrationPath;
use crate::Result;
#[allow(unused_imports)]
use umm_backends::{DevicePath, MemoryPool, Pool};

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

impl From<DevicePath> for MigrationPath {
    fn from(path: DevicePath) -> Self {
        match path {
            DevicePath::CudaDevice => MigrationPath::CudaDevice,
            DevicePath::CudaPeer => MigrationPath::CudaPeer,
            DevicePath::OpenClDevice => MigrationPath::OpenClDevice,
            DevicePath::WgpuDevice => MigrationPath::WgpuDevice,
        }
    }
}
