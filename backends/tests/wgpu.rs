//! The wgpu backend on a real adapter (lavapipe in CI: `mesa-vulkan-drivers libvulkan1`): what only wgpu has
//! (discovery, pool kinds, sealing, copies between buffers, binding limits, lost devices). What every backend must
//! do is in the conformance suite (`tests/conformance.rs`), which runs on every adapter and pool kind. Without an
//! adapter the tests skip, unless `UMM_REQUIRE_BACKENDS` names wgpu.
#![cfg(feature = "wgpu")]

use umm_backends::testing::skip_or_fail;
use umm_backends::wgpu_backend::{self, discover, WgpuBackend, WgpuDevice, WgpuUsage};
use umm_backends::{DeviceKind, Error, Pool, PoolConfig, PoolKind, Strategy, StreamId};

const S0: StreamId = StreamId(0);

/// Every adapter (Vulkan first: lavapipe in CI), after skip_or_fail when there is none.
fn devices() -> Vec<WgpuDevice> {
    let discovery = discover();
    let mut devices = discovery.devices;
    devices.sort_by_key(|d| d.adapter_info().backend != wgpu::Backend::Vulkan);
    if devices.is_empty() {
        skip_or_fail("wgpu", &format!("no wgpu adapter: {}", discovery.skipped.join("; ")));
    }
    devices
}

/// The first adapter of [`devices`].
fn device() -> Option<WgpuDevice> {
    devices().into_iter().next()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

fn detail<'a>(device: &'a WgpuDevice, key: &str) -> Option<&'a str> {
    device.info().details.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

#[test]
fn discovery_describes_every_adapter() {
    let discovery = discover();
    for reason in &discovery.skipped {
        eprintln!("skipped: {reason}");
    }
    if discovery.devices.is_empty() {
        return skip_or_fail("wgpu", &discovery.skipped.join("; "));
    }
    for (i, d) in discovery.devices.iter().enumerate() {
        let info = d.info();
        eprintln!("{i}: {} [{}] {:?}", info.name, info.kind, info.details);
        assert_eq!(info.api, umm_backends::Api::Wgpu);
        assert_eq!(info.ordinal, i);
        assert!(info.alignment.is_power_of_two() && info.alignment >= 4);
        assert_eq!(info.max_allocation, d.limits().max_buffer_size);
        assert!(info.total_bytes > 0);
        for key in ["backend", "vendor_id", "device_id", "driver", "max_storage_buffer_binding_size"] {
            assert!(detail(d, key).is_some(), "{key} missing from {:?}", info.details);
        }
        let name = info.name.to_lowercase();
        if name.contains("llvmpipe") || name.contains("lavapipe") {
            assert_eq!(info.kind, DeviceKind::Cpu, "a software adapter is a CPU device");
            assert!(info.shares_memory_with_host);
            assert_eq!(detail(d, "identity"), Some("cpu:host"));
        }
        if let Some(other) = detail(d, "same_device_as") {
            let j: usize = other.trim_start_matches("wgpu:").parse().unwrap();
            let twin = &discovery.devices[j];
            assert!(j < i);
            assert_eq!(detail(twin, "identity"), detail(d, "identity"));
            assert_ne!(twin.adapter_info().backend, d.adapter_info().backend);
        }
    }
}

/// Every placement has a pool kind, and pools whose buffers shaders bind align blocks for storage bindings. (What
/// the pools of every kind must do with bytes is in the conformance suite, `tests/conformance.rs`.)
#[test]
fn every_placement_has_a_pool_kind_aligned_for_bindings() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        let mut kinds = vec![WgpuUsage::DeviceLocal, WgpuUsage::ReadOnly, WgpuUsage::Upload, WgpuUsage::Readback];
        if dev.has_shared_buffers() {
            kinds.push(WgpuUsage::Shared);
        }
        for placement in [PoolKind::DeviceLocal, PoolKind::HostPinned, PoolKind::ReadOnly] {
            assert!(kinds.contains(&dev.usage_for(placement)));
            assert_eq!(dev.usage_for(placement).placement(), placement);
            dev.pool(placement, PoolConfig::default()).expect("pool for every placement");
        }
        for kind in kinds {
            let pool = dev.pool_of(kind, PoolConfig::default()).unwrap();
            let backend = pool.backend();
            assert!(umm_backends::Backend::segment_per_block(backend), "{kind}: blocks share buffers");
            assert_eq!(umm_backends::Backend::alignment(backend), wgpu::MAP_ALIGNMENT, "{kind}");
        }
    }
}

/// A sealed ReadOnly block refuses writes and fills, its unsealed neighbour does not, and it is writable again
/// once unsealed.
#[test]
fn sealed_read_only_blocks_refuse_writes_until_unsealed() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        let constants = dev.pool(PoolKind::ReadOnly, PoolConfig::default()).unwrap();
        let filler = constants.allocate(40, S0).unwrap();
        let p = constants.allocate(72, S0).unwrap();
        assert_eq!(p.offset(), 0, "every block is a buffer of its own");
        constants.write(&p, 0, &pattern(72, 1)).unwrap();
        wgpu_backend::seal(&constants, &p).unwrap();
        let err = constants.write(&p, 0, &[0; 4]).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("sealed read-only"), "{err}");
        let err = constants.fill(&p, 0, 4, 0).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("sealed read-only"), "{err}");
        let mut back = vec![0u8; 72];
        constants.read(&p, 0, &mut back).unwrap();
        assert_eq!(back, pattern(72, 1), "a sealed block still reads");
        constants.write(&filler, 0, &[1; 40]).unwrap(); // another block is not sealed
        assert!(wgpu_backend::unseal(&constants, &p).unwrap());
        constants.write(&p, 0, &[0; 4]).unwrap();
        constants.free(&p).unwrap();
        constants.free(&filler).unwrap();
    }
}

#[test]
fn device_copies_between_blocks() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        device_copies_between_blocks_on(&dev);
    }
}

fn device_copies_between_blocks_on(dev: &WgpuDevice) {
    let pool = dev.pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();
    let readback = dev.pool_of(WgpuUsage::Readback, PoolConfig::default()).unwrap();
    let a = pool.allocate(4096, S0).unwrap();
    let b = pool.allocate(4096, S0).unwrap();
    let r = readback.allocate(4096, S0).unwrap();
    let data = pattern(4096, 3);
    pool.write(&a, 0, &data).unwrap();
    // Same buffer (through a temporary), then to another pool.
    wgpu_backend::copy_block(&pool, &a, 16, &pool, &b, 32, 1024).unwrap();
    wgpu_backend::copy_block(&pool, &b, 0, &readback, &r, 0, 4096).unwrap();
    let mut back = vec![0u8; 1024];
    readback.read(&r, 32, &mut back).unwrap();
    assert_eq!(back, data[16..16 + 1024]);
    // Unaligned copies and copies out of bounds are refused clearly.
    let err = wgpu_backend::copy_block(&pool, &a, 1, &pool, &b, 0, 8).unwrap_err();
    assert!(err.to_string().contains("multiples of 4"), "{err}");
    assert!(matches!(wgpu_backend::copy_block(&pool, &a, 0, &pool, &b, 4000, 1024), Err(Error::OutOfBounds(_))));
    // Read-back buffers (MAP_READ | COPY_DST) cannot be a copy source.
    let err = wgpu_backend::copy_block(&readback, &r, 0, &pool, &a, 0, 4).unwrap_err();
    assert!(err.to_string().contains("COPY_SRC"), "{err}");
}

#[test]
fn bad_requests_give_clear_errors() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        bad_requests_give_clear_errors_on(&dev);
    }
}

fn bad_requests_give_clear_errors_on(dev: &WgpuDevice) {
    let limits = dev.limits().clone();
    let pool = dev.pool(PoolKind::DeviceLocal, PoolConfig::default()).unwrap();

    // Above max_buffer_size: refused before touching the device.
    let err = pool.allocate(limits.max_buffer_size + 1, S0).unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }), "{err}");
    let max = umm_backends::Backend::max_segment_size(pool.backend());
    assert!(max <= limits.max_buffer_size && max + 256 > limits.max_buffer_size);
    assert!(err.to_string().contains(&max.to_string()), "{err}");

    // A block larger than a uniform binding may span.
    let constants = dev.pool(PoolKind::ReadOnly, PoolConfig::default()).unwrap();
    let uniform_max = limits.max_uniform_buffer_binding_size;
    let big = constants.allocate(uniform_max + 4, S0).unwrap();
    let err = wgpu_backend::uniform_binding(&constants, &big).unwrap_err();
    assert!(err.to_string().contains("max_uniform_buffer_binding_size"), "{err}");
    constants.free(&big).unwrap();

    // A block larger than a storage binding may span (where that limit is small enough to allocate here).
    let storage_max = limits.max_storage_buffer_binding_size;
    if storage_max + 4 <= limits.max_buffer_size.min(1 << 30) {
        let big = pool.allocate(storage_max + 4, S0).unwrap();
        let err = wgpu_backend::binding(&pool, &big).unwrap_err();
        assert!(err.to_string().contains("max_storage_buffer_binding_size"), "{err}");
        pool.free(&big).unwrap();
    } else {
        eprintln!("max_storage_buffer_binding_size {storage_max} too large to allocate one past it here");
    }

    // Mappable upload buffers are not bindable; freed blocks are unknown.
    let upload = dev.pool_of(WgpuUsage::Upload, PoolConfig::default()).unwrap();
    let u = upload.allocate(64, S0).unwrap();
    assert!(matches!(wgpu_backend::binding(&upload, &u), Err(Error::Unsupported { .. })));
    upload.free(&u).unwrap();
    assert!(matches!(wgpu_backend::binding(&upload, &u), Err(Error::UnknownBlock(_))));
    // Out of the block.
    let a = pool.allocate(10, S0).unwrap();
    assert!(matches!(pool.write(&a, 250, &[0; 10]), Err(Error::OutOfBounds(_))));
}

/// A destroyed device: every later call errors (no panic, no hang), naming the loss.
#[test]
fn lost_device_errors_without_panicking() {
    let Some(dev) = device() else { return };
    let pool: Pool<WgpuBackend> =
        dev.pool(PoolKind::DeviceLocal, PoolConfig { strategy: Strategy::Direct, ..PoolConfig::default() }).unwrap();
    let block = pool.allocate(1000, S0).unwrap();
    pool.write(&block, 0, &[7; 1000]).unwrap();
    pool.backend().device().destroy();
    let _ = pool.backend().device().poll(wgpu::PollType::Poll);
    let err = pool.write(&block, 0, &[1; 1000]).unwrap_err();
    eprintln!("write after loss: {err}");
    assert!(err.is_device_lost(), "{err}");
    assert!(err.to_string().contains("lost"), "{err}");
    let mut back = [0u8; 8];
    let err = pool.read(&block, 0, &mut back).unwrap_err();
    assert!(err.to_string().contains("lost"), "{err}");
    let retries = pool.stats().num_alloc_retries;
    let err = pool.allocate(1 << 20, S0).unwrap_err();
    assert!(err.is_device_lost(), "an allocation on a lost device says so, not out of memory: {err}");
    assert_eq!(pool.stats().num_alloc_retries, retries, "releasing memory cannot bring a device back");
    assert!(dev.lost_reason().is_some());
    pool.free(&block).unwrap();
}
