//! The subjects, one per pool kind: how each allocator under test is made afresh for every configuration and
//! what it runs on.

use crate::allocators::{Subject, Universal};
#[cfg(feature = "cuda")]
use crate::GIB;
use crate::MIB;
use std::sync::Arc;
use umm::backends::{HostBackend, Pool, PoolConfig, SimBackend};
use umm::{AllocOptions, Placement, UniversalMemoryManager};

/// The simulated device's capacity: it holds no bytes, so it may claim far more than any run reserves.
const SIM_CAPACITY: u64 = 1 << 40;

/// The bare pools' configuration: the default, with the `UMM_*` variables applied as the manager applies them
/// (`UMM_THREAD_CACHE=0` measures a pool without thread caches, say).
fn pool_config() -> PoolConfig {
    let mut config = umm::UmmConfig::default();
    config.apply_env().unwrap_or_else(|e| panic!("{e}"));
    config.pool
}

pub(crate) fn host_subject(host_memory: u64, need: u64) -> Subject<Pool<HostBackend>> {
    // The backend's capacity caps its largest segment: the machine's memory, or the run's need if unknown.
    let capacity = host_memory.max(need);
    Subject {
        pool: "host",
        device: "host memory".into(),
        memory: (host_memory > 0).then_some(host_memory),
        make: Box::new(move || {
            Arc::new(Pool::new(HostBackend::new("host", capacity), pool_config()).expect("host pool"))
        }),
        reset: Box::new(|_| {}),
    }
}

pub(crate) fn sim_subject(need: u64) -> Subject<Pool<SimBackend>> {
    let capacity = SIM_CAPACITY.max(need.saturating_mul(4));
    Subject {
        pool: "sim",
        device: "simulated device".into(),
        memory: None,
        make: Box::new(move || Arc::new(Pool::new(SimBackend::new("sim", capacity), pool_config()).expect("sim pool"))),
        reset: Box::new(|_| {}),
    }
}

/// The CUDA device pool of the first device, or why there is none. Discovery never fails: without a driver it
/// reports the reason.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_subject() -> Result<Subject<umm::backends::cuda::CudaPool>, String> {
    use umm::backends::{cuda, PoolKind};
    let found = cuda::discover();
    let Some(device) = found.devices.into_iter().next() else {
        return Err(if found.skipped.is_empty() { "no CUDA device".into() } else { found.skipped.join("; ") });
    };
    let name = device.info().name.clone();
    println!("CUDA device: {name} ({:.1} GiB)", device.info().total_bytes as f64 / GIB);
    Ok(Subject {
        pool: "cuda",
        device: name,
        memory: Some(device.info().total_bytes),
        make: Box::new(move || {
            // `caching_pool` gives an `Arc<CudaPool>`: the pool with record-stream semantics, as users get it.
            device.caching_pool(PoolKind::DeviceLocal, pool_config()).expect("CUDA device pool")
        }),
        reset: Box::new(|_| {}),
    })
}

pub(crate) fn sim_wgpu_subject(need: u64) -> Subject<Pool<SimBackend>> {
    let capacity = SIM_CAPACITY.max(need.saturating_mul(4));
    Subject {
        pool: "sim-wgpu",
        device: "simulated device, a segment per block".into(),
        memory: None,
        make: Box::new(move || {
            Arc::new(Pool::new(SimBackend::segment_per_block("sim-wgpu", capacity), pool_config()).expect("sim pool"))
        }),
        reset: Box::new(|_| {}),
    }
}

/// The device-local pool of the first wgpu adapter, preferring one that is not a CPU (lavapipe, llvmpipe).
#[cfg(feature = "wgpu")]
pub(crate) fn wgpu_subject() -> Result<Subject<Pool<umm::backends::wgpu_backend::WgpuBackend>>, String> {
    use umm::backends::{wgpu_backend, PoolKind};
    let found = wgpu_backend::discover();
    let mut devices = found.devices;
    devices.sort_by_key(|d| d.adapter_info().device_type == wgpu_backend::wgpu::DeviceType::Cpu);
    let Some(device) = devices.into_iter().next() else {
        return Err(if found.skipped.is_empty() { "no wgpu adapter".into() } else { found.skipped.join("; ") });
    };
    let name = format!("{} ({:?})", device.info().name, device.adapter_info().backend);
    println!("wgpu device: {name}");
    Ok(Subject {
        pool: "wgpu",
        device: name,
        memory: Some(device.info().total_bytes),
        make: Box::new(move || Arc::new(device.pool(PoolKind::DeviceLocal, pool_config()).expect("wgpu pool"))),
        reset: Box::new(|_| {}),
    })
}

/// One manager for every configuration (discovery is slow); the probe allocation shows where DeviceLocal goes.
/// `wgpu`: on the wgpu device, and the manager sees only wgpu devices (and the host).
pub(crate) fn universal_subject(wgpu: bool) -> Result<Subject<Universal>, String> {
    let mm = if wgpu {
        UniversalMemoryManager::builder().backends(false, false, true).build()
    } else {
        UniversalMemoryManager::new()
    }
    .map_err(|e| format!("the manager could not be built: {e}"))?;
    let options = wgpu.then(|| {
        AllocOptions::new().placement(Placement::DeviceLocal).device(umm::DeviceSelector::Api(umm::Api::Wgpu))
    });
    let probe = match &options {
        None => mm.allocate_universal::<u8>(MIB as usize, Placement::DeviceLocal),
        Some(options) => mm.allocate_universal_with::<u8>(MIB as usize, options.clone()),
    }
    .map_err(|e| e.to_string())?;
    let device = probe.device().name().to_string();
    let memory = probe.device().total_bytes();
    let pool = if wgpu { "universal-wgpu" } else { "universal" };
    println!("{pool}: Placement::DeviceLocal lands on {device} ({} pool)", probe.placement());
    drop(probe);
    let shared = Arc::new(Universal(mm, options));
    Ok(Subject {
        pool,
        device,
        memory: Some(memory),
        make: Box::new(move || Arc::clone(&shared)),
        reset: Box::new(|u| {
            // So that each configuration warms up from an empty cache, as the fresh pools of the others do.
            u.0.release_all_cached();
        }),
    })
}
