//! Discovery of the optional backends (CUDA, OpenCL, wgpu), each behind its cargo feature and its config switch.
//! A backend that finds no runtime or no device adds a reason to `skipped` and nothing else: no panic, no output.

use crate::config::UmmConfig;
use std::sync::Arc;
use umm_backends::{DeviceInfo, MemoryPool, PoolConfig, PoolKind};
use umm_placement::Api;

/// Makes a pool of one placement on one device through one API.
pub(crate) type PoolFactory =
    Box<dyn Fn(PoolKind, &PoolConfig) -> umm_backends::Result<Arc<dyn MemoryPool>> + Send + Sync>;

/// One device as one API sees it, with the means to make its pools.
pub(crate) struct ApiEntry {
    pub(crate) api: Api,
    pub(crate) info: DeviceInfo,
    pub(crate) placements: Vec<PoolKind>,
    pub(crate) factory: PoolFactory,
    /// The backend's own device object, for kernels and adoption.
    #[cfg_attr(not(any(feature = "cuda", feature = "opencl", feature = "wgpu")), allow(dead_code))]
    pub(crate) handle: ApiHandle,
}

/// A backend's device object, as discovery found it.
#[derive(Clone)]
pub(crate) enum ApiHandle {
    /// Host and simulated devices: nothing beyond the pools.
    Plain,
    #[cfg(feature = "cuda")]
    Cuda(umm_backends::cuda::CudaDevice),
    #[cfg(feature = "opencl")]
    OpenCl(umm_backends::opencl::OpenClDevice),
    #[cfg(feature = "wgpu")]
    Wgpu(Arc<umm_backends::wgpu_backend::WgpuDevice>),
}

/// Appends the devices of every enabled backend to `entries`, and why anything was skipped to `skipped`.
pub(crate) fn discover_all(config: &UmmConfig, entries: &mut Vec<ApiEntry>, skipped: &mut Vec<String>) {
    let _ = (&config, &entries, &skipped);
    #[cfg(feature = "cuda")]
    if config.cuda {
        let found = umm_backends::cuda::discover();
        skipped.extend(found.skipped.into_iter().map(|r| format!("cuda: {r}")));
        for device in found.devices {
            let handle = ApiHandle::Cuda(device.clone());
            entries.push(ApiEntry {
                api: Api::Cuda,
                handle,
                info: device.info().clone(),
                placements: vec![PoolKind::DeviceLocal, PoolKind::HostPinned, PoolKind::ReadOnly],
                factory: Box::new(move |placement, config| {
                    Ok(device.caching_pool(placement, config.clone())? as Arc<dyn MemoryPool>)
                }),
            });
        }
    }
    #[cfg(feature = "opencl")]
    if config.opencl {
        let found = umm_backends::opencl::discover();
        skipped.extend(found.skipped.into_iter().map(|r| format!("opencl: {r}")));
        for device in found.devices {
            let handle = ApiHandle::OpenCl(device.clone());
            // A pinned OpenCL buffer stays mapped into the host only on a device that shares memory with it; on
            // a discrete device it is reached through copies, which would break HostPinned's promise that the
            // host reads in place. There the device offers no pinned pool through OpenCL.
            let placements = if device.info().shares_memory_with_host {
                vec![PoolKind::DeviceLocal, PoolKind::HostPinned, PoolKind::ReadOnly]
            } else {
                vec![PoolKind::DeviceLocal, PoolKind::ReadOnly]
            };
            entries.push(ApiEntry {
                api: Api::OpenCl,
                handle,
                info: device.info().clone(),
                placements,
                factory: Box::new(move |placement, config| {
                    Ok(Arc::new(device.pool(placement, config.clone())?) as Arc<dyn MemoryPool>)
                }),
            });
        }
    }
    #[cfg(feature = "wgpu")]
    if config.wgpu {
        let found = umm_backends::wgpu_backend::discover();
        skipped.extend(found.skipped.into_iter().map(|r| format!("wgpu: {r}")));
        for device in found.devices {
            let device = Arc::new(device);
            let handle = ApiHandle::Wgpu(Arc::clone(&device));
            entries.push(ApiEntry {
                api: Api::Wgpu,
                handle,
                info: device.info().clone(),
                // No pinned pool: a wgpu buffer is mapped only for a copy and never lends the host an address, so
                // it would break HostPinned's promise that the host reads in place. HostPinned on a GPU seen only
                // through wgpu is the host's pinned memory, or an error where a selector keeps it off the host.
                placements: vec![PoolKind::DeviceLocal, PoolKind::ReadOnly],
                factory: Box::new(move |placement, config| {
                    Ok(Arc::new(device.pool(placement, config.clone())?) as Arc<dyn MemoryPool>)
                }),
            });
        }
    }
}
