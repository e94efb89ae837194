//! The front door's costs, counted: a buffer like the last one asks no device for its free memory and takes
//! nothing from the heap. One test in this file, so that the device-query counter (process-wide) sees only its
//! work. Heap allocations are counted on the test's own thread: the test harness's main thread allocates now and
//! then while it waits for the test, and those are not the front door's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use umm::backends::SimBackend;
use umm::{AccessPattern, AllocOptions, Placement, UniversalMemoryManager};

/// Counts heap allocations made on a thread that asked to be counted, then hands every one to the system
/// allocator.
struct Counting;

static HEAP_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

std::thread_local! {
    /// Whether this thread's allocations are counted (a `const` initializer: reading it never allocates).
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

fn count_if_counted() {
    // `try_with`: a thread being torn down has no thread-locals left, and its allocations are not counted.
    if COUNTED.try_with(Cell::get).unwrap_or(false) {
        HEAP_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds `GlobalAlloc`'s contract.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_if_counted();
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_if_counted();
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn a_buffer_like_the_last_asks_no_device_and_takes_nothing_from_the_heap() {
    COUNTED.with(|counted| counted.set(true));
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(1 << 34)
        // Long enough that no periodic refresh falls inside the counted loop.
        .device_refresh(Duration::from_secs(3600))
        .build()
        .unwrap();
    let kinds = [
        AllocOptions::new().placement(Placement::Auto),
        AllocOptions::new().placement(Placement::DeviceLocal),
        AllocOptions::new().placement(Placement::HostPinned),
        AllocOptions::new().placement(Placement::Auto).access(AccessPattern::ReadWrite),
    ];
    for options in &kinds {
        // The first buffer of a kind decides, makes its pool and fills the caches.
        for _ in 0..64 {
            drop(mm.allocate_universal_with::<f32>(1024, options.clone()).unwrap());
        }
        let queries = SimBackend::free_bytes_queries();
        let heap = HEAP_ALLOCATIONS.load(Ordering::Relaxed);
        const N: u64 = 10_000;
        for _ in 0..N {
            let buffer = mm.allocate_universal_with::<f32>(1024, options.clone()).unwrap();
            assert_eq!(buffer.len(), 1024);
        }
        assert_eq!(SimBackend::free_bytes_queries() - queries, 0, "{options:?}: device queries in {N} buffers");
        assert_eq!(HEAP_ALLOCATIONS.load(Ordering::Relaxed) - heap, 0, "{options:?}: heap allocations in {N} buffers");
    }
    // A cleanup round refreshes the figures: the device is asked again.
    let queries = SimBackend::free_bytes_queries();
    mm.cleanup();
    assert!(SimBackend::free_bytes_queries() > queries);
}
