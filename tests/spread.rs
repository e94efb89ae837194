//! How Auto spreads buffers over several accelerators, on four simulated 80 GiB GPUs: a burst of large buffers
//! lands evenly without waiting for a device refresh, with reasons whose figures are those of the moment; memory a
//! pool holds unused is reused where it is rather than spread again; `Spread::CurrentFirst` fills one device
//! first.

use std::time::Duration;
use umm::{AllocOptions, Placement, Spread, UniversalMemoryManager};

const GIB: u64 = 1 << 30;
const GPUS: usize = 4;
/// f32 elements in 1 GiB.
const ONE_GIB_OF_F32: usize = (GIB / 4) as usize;

/// The host and four simulated 80 GiB GPUs (indices 1 to 4). The devices are asked for their figures once, at
/// build: whatever moves the figures afterwards comes from the pools' own books.
fn four_gpus(spread: Spread) -> UniversalMemoryManager {
    let mut builder = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .device_refresh(Duration::from_secs(3600))
        .spread(spread);
    for _ in 0..GPUS {
        builder = builder.simulated_device(80 * GIB);
    }
    builder.build().unwrap()
}

fn reserved_on(mm: &UniversalMemoryManager, device: usize) -> u64 {
    mm.global_memory_stats().devices[device].total.reserved_bytes.current
}

#[test]
fn a_burst_of_large_buffers_spreads_evenly_with_reasons_true_when_made() {
    let mm = four_gpus(Spread::Balance);
    let mut per_gpu = [0usize; GPUS + 1];
    let mut buffers = Vec::new();
    for i in 0..4 * GPUS {
        let b = mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap();
        let device = b.device().index();
        per_gpu[device] += 1;
        // Every device had i / 4 GiB taken when this one was chosen: the reason says so.
        let reason = b.decision().reason();
        let free = format!("{} GiB free of 80 GiB", 80 - i / GPUS);
        assert!(reason.contains(&free) && reason.contains("spread balance"), "buffer {i}: {reason}");
        assert_eq!(device, 1 + i % GPUS, "buffer {i}: ties go to the lower index: {reason}");
        buffers.push(b);
    }
    assert_eq!(&per_gpu[1..], &[4, 4, 4, 4], "16 x 1 GiB over 4 GPUs");
    for device in 1..=GPUS {
        assert_eq!(reserved_on(&mm, device), 4 * GIB, "device {device}");
    }
}

#[test]
fn memory_a_pool_holds_unused_is_reused_where_it_is() {
    let mm = four_gpus(Spread::Balance);
    let mut devices = Vec::new();
    for _ in 0..20 {
        let b = mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap();
        devices.push(b.device().index());
    }
    let reserved: u64 = (1..=GPUS).map(|d| reserved_on(&mm, d)).sum();
    assert_eq!(reserved, GIB, "one buffer alive at a time needs one GiB, not one per GPU: devices {devices:?}");
    assert!(devices.iter().all(|&d| d == 1), "{devices:?}");
    // With one buffer held on device 1, the next goes where nothing is held.
    let held = mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap();
    let next = mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap();
    assert_ne!(held.device().index(), next.device().index(), "{}", next.decision().reason());
}

#[test]
fn current_first_fills_the_current_device_before_the_others() {
    let mm = four_gpus(Spread::CurrentFirst);
    assert_eq!(mm.current_device(), Some(1), "the first of equal GPUs");
    let buffers: Vec<_> =
        (0..8).map(|_| mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap()).collect();
    for b in &buffers {
        assert_eq!(b.device().index(), 1, "{}", b.decision().reason());
        assert!(b.decision().reason().contains("spread current_first"), "{}", b.decision().reason());
    }
    mm.set_current_device(Some(3)).unwrap();
    let b = mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap();
    assert_eq!(b.device().index(), 3, "{}", b.decision().reason());
}

#[test]
fn a_selector_naming_one_device_is_not_spread() {
    let mm = four_gpus(Spread::Balance);
    let on_two = AllocOptions::new().device(umm::DeviceSelector::Index(2));
    let buffers: Vec<_> =
        (0..6).map(|_| mm.allocate_universal_with::<f32>(ONE_GIB_OF_F32, on_two.clone()).unwrap()).collect();
    assert!(buffers.iter().all(|b| b.device().index() == 2));
    // Auto then goes around the device that holds them.
    let b = mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap();
    assert_eq!(b.device().index(), 1, "{}", b.decision().reason());
    let b2 = mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap();
    assert_eq!(b2.device().index(), 3, "{}", b2.decision().reason());
}

#[test]
fn threads_allocating_at_once_spread_over_every_device() {
    let mm = four_gpus(Spread::Balance);
    let per_thread = 4;
    let devices: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..GPUS)
            .map(|_| {
                s.spawn(|| {
                    (0..per_thread)
                        .map(|_| mm.allocate_universal::<f32>(ONE_GIB_OF_F32, Placement::Auto).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let buffers: Vec<_> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
        buffers.iter().map(|b| b.device().index()).collect()
    });
    let mut per_gpu = [0usize; GPUS + 1];
    for d in devices {
        per_gpu[d] += 1;
    }
    // Threads choosing at the same moment may pick the same device; none is left out, none takes twice its share.
    assert!(per_gpu[1..].iter().all(|&n| (1..=2 * per_thread).contains(&n)), "{per_gpu:?}");
}
