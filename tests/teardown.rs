//! Dropping the manager while buffers it handed out are alive. What the code does: each buffer holds its
//! placement, which holds the device and the pool, so the buffers keep working after the manager is gone (reads,
//! writes, statistics through their device), free their blocks cleanly when they drop (on any thread), and the
//! pools release every page once the last buffer and device handle are gone.
//!
//! The devices are test devices ([`umm::Builder::simulated_device_with_pools`]) under a
//! [`FaultyBackend`] whose ledger says whether every segment was destroyed and every page unmapped, and whether a
//! segment was destroyed with pages mapped: one holding bytes (host memory posing as device memory), one
//! simulated device with virtual memory (pages mapped into reservations); plus the host's own pool.

use std::sync::{Arc, Mutex};
use umm::backends::testing::fault::{FaultHandle, FaultyBackend};
use umm::backends::{HostBackend, MemoryPool, Pool, PoolConfig, SimBackend};
use umm::{AllocOptions, Device, DeviceSelector, Placement, StreamId, UniversalBuffer, UniversalMemoryManager};

const MIB: usize = 1 << 20;

/// Device 1 holds bytes; device 2 is a simulated device with virtual memory (2 MiB pages).
fn manager() -> (UniversalMemoryManager, Arc<Mutex<Vec<FaultHandle>>>) {
    let handles = Arc::new(Mutex::new(Vec::new()));
    let (bytes, sim) = (Arc::clone(&handles), Arc::clone(&handles));
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .leak_warning(false)
        .simulated_device_with_pools(1 << 30, move |name, _, config| {
            let (backend, faults) = FaultyBackend::new(HostBackend::new(name, 1 << 30));
            bytes.lock().unwrap().push(faults);
            Ok(Arc::new(Pool::new(backend.without_host_access(), config.clone())?) as Arc<dyn MemoryPool>)
        })
        .simulated_device_with_pools(8 << 30, move |name, _, config| {
            let (backend, faults) = FaultyBackend::new(SimBackend::new(name, 8 << 30));
            sim.lock().unwrap().push(faults);
            let config = PoolConfig { page_size: Some(SimBackend::PAGE), ..config.clone() };
            Ok(Arc::new(Pool::new(backend, config)?) as Arc<dyn MemoryPool>)
        })
        .build()
        .unwrap();
    assert_eq!(mm.devices().len(), 3, "{:?}", mm.devices());
    (mm, handles)
}

fn on(device: usize, stream: u64) -> AllocOptions {
    AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(device)).stream(StreamId(stream))
}

/// Allocated bytes, live blocks, allocations and frees of one device, summed over its pools.
fn books(device: &Device) -> (u64, u64, u64, u64) {
    device.pools().iter().fold((0, 0, 0, 0), |(bytes, blocks, allocs, frees), (_, _, pool)| {
        let s = pool.stats();
        (
            bytes + s.allocated_bytes.current,
            blocks + s.active_blocks.current,
            allocs + s.num_allocs,
            frees + s.num_frees,
        )
    })
}

#[test]
fn buffers_outliving_the_manager_keep_working_free_cleanly_and_release_every_page() {
    let (mm, handles) = manager();
    let data: Vec<u32> = (0..(3 * MIB / 4) as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut host = mm.allocate_universal_from_with(&data, AllocOptions::new().device(DeviceSelector::Host)).unwrap();
    let mut with_bytes = mm.allocate_universal_from_with(&data, on(1, 0)).unwrap();
    let mut sim: Vec<UniversalBuffer<u8>> = Vec::new();
    for (i, size) in [1000, 300_000, 5 * MIB, 64 * MIB + 7, 200 * MIB].into_iter().enumerate() {
        sim.push(mm.allocate_universal_with(size, on(2, i as u64 % 3)).unwrap());
        // Freed blocks next to live ones: cached memory too.
        drop(mm.allocate_universal_with::<u8>(size, on(2, i as u64 % 3)).unwrap());
    }
    let devices: Vec<Arc<Device>> = mm.devices().to_vec();
    let live_before: Vec<_> = devices.iter().map(|d| books(d)).collect();
    assert!(live_before.iter().all(|&(bytes, blocks, _, _)| bytes > 0 && blocks > 0), "{live_before:?}");
    let faults = handles.lock().unwrap().clone();
    assert_eq!(faults.len(), 2, "one DeviceLocal pool on each test device");
    assert!(faults[1].mapped_bytes() > 0, "the simulated device has pages mapped when the manager drops");

    drop(mm);

    // Nothing was released with the manager: the buffers' blocks, and the pools' books, are as they were.
    let live_after: Vec<_> = devices.iter().map(|d| books(d)).collect();
    assert_eq!(live_after, live_before, "statistics per device across the manager's drop");
    for f in &faults {
        assert_eq!(f.violations(), Vec::<String>::new());
        assert!(f.live_segments() > 0, "the pools still hold their segments");
    }
    // The buffers keep working.
    assert_eq!(host.to_vec().unwrap(), data);
    assert_eq!(with_bytes.to_vec().unwrap(), data);
    let reversed: Vec<u32> = data.iter().rev().copied().collect();
    host.write(&reversed).unwrap();
    with_bytes.write(&reversed).unwrap();
    assert_eq!((host.to_vec().unwrap(), with_bytes.to_vec().unwrap()), (reversed.clone(), reversed));
    assert_eq!(sim[3].len(), 64 * MIB + 7);
    // They free cleanly, on this thread and on another.
    let elsewhere = sim.split_off(2);
    std::thread::spawn(move || drop(elsewhere)).join().unwrap();
    drop((host, with_bytes, sim));
    for (device, before) in devices.iter().zip(&live_before) {
        let (bytes, blocks, allocs, frees) = books(device);
        assert_eq!((bytes, blocks), (0, 0), "{device}: everything freed");
        assert_eq!(allocs, frees, "{device}: every allocation freed once");
        assert_eq!(allocs, before.2, "{device}: no allocation after the manager dropped");
    }
    // The last handles on the devices go: the pools drop and give every page back.
    drop(devices);
    for (i, f) in faults.iter().enumerate() {
        if let Err(problems) = f.check_released() {
            panic!("test device {}: {problems}", i + 1);
        }
        assert_eq!(f.resident_bytes(), 0);
    }
}
