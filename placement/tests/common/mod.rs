//! Device fixtures shared by the integration tests.
#![allow(dead_code)]

use umm_placement::{Api, DeviceKind, DeviceView, PoolKind};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// The host with 64 GiB, half free.
pub fn host(index: usize) -> DeviceView {
    DeviceView::host(index, 64 * GIB, 32 * GIB)
}

/// A discrete CUDA GPU offering every device pool and a pinned pool.
pub fn gpu(index: usize, total: u64, free: u64) -> DeviceView {
    DeviceView {
        index,
        name: format!("gpu{index}"),
        kind: DeviceKind::DiscreteGpu,
        apis: vec![Api::Cuda, Api::OpenCl],
        shares_memory_with_host: false,
        total_bytes: total,
        free_bytes: free,
        cached_bytes: 0,
        pools: vec![PoolKind::DeviceLocal, PoolKind::ReadOnly, PoolKind::HostPinned],
        max_allocation: 0,
    }
}

/// An integrated GPU (OpenCL) that shares memory with the host.
pub fn igpu(index: usize) -> DeviceView {
    DeviceView {
        index,
        name: format!("igpu{index}"),
        kind: DeviceKind::IntegratedGpu,
        apis: vec![Api::OpenCl],
        shares_memory_with_host: true,
        total_bytes: 16 * GIB,
        free_bytes: 12 * GIB,
        cached_bytes: 0,
        pools: vec![PoolKind::DeviceLocal, PoolKind::HostPinned],
        max_allocation: 0,
    }
}

/// The usual machine: host 0, an 80 GiB GPU 1 with 70 GiB free.
pub fn machine() -> Vec<DeviceView> {
    vec![host(0), gpu(1, 80 * GIB, 70 * GIB)]
}
