//! One conformance suite, written once ([`suite`]) and run on every backend present ([`fixtures`]): host, the
//! simulated device (plain and virtual segments, a segment per block), CUDA (device-local in plain and virtual segments, pinned,
//! read-only), OpenCL (device-local, pinned, read-only; PoCL in CI, NVIDIA on a GPU machine) and wgpu
//! (device-local, host-pinned, read-only, upload and read-back buffers; lavapipe in CI, Vulkan on a GPU machine).
//!
//! Each backend × property is its own test, `<backend>::<property>`, e.g. `opencl_pinned::round_trips_at_odd_sizes_and_offsets`.
//! A backend whose runtime or device is absent skips with a printed reason, unless `UMM_REQUIRE_BACKENDS` names it
//! (`cuda`, `opencl`, `wgpu`, or `all`), which makes the absence a failure. Every test ends by checking every pool
//! it made: nothing allocated, nothing active, and everything reserved given back by `release_cached`.
//!
//! Tests run in parallel, on GPUs too: limits and out of memory are tested under a pool limit, never by
//! exhausting a device.
//!
//! CI: `UMM_REQUIRE_BACKENDS=opencl,wgpu cargo test -p umm-backends --features cuda,opencl,wgpu --test conformance`;
//! on the GPU machine `UMM_REQUIRE_BACKENDS=all` with NVIDIA's OpenCL and Vulkan.

mod common;
#[path = "conformance/fixtures.rs"]
mod fixtures;
#[path = "conformance/suite.rs"]
mod suite;

/// `conformance!(name, fixtures)`: a module `name` with one test per property of [`suite`], each run on every
/// fixture that `fixtures()` returns (one per device of the backend).
macro_rules! conformance {
    ($name:ident, $fixtures:path) => {
        mod $name {
            conformance!(@tests $fixtures;
                round_trips_at_odd_sizes_and_offsets,
                dirty_reuse_matches_a_fresh_buffer,
                zeroed_allocation_reads_zero_over_dirty_memory,
                poison_on_free_overwrites_freed_blocks,
                limit_releases_cached_memory_retries_then_reports_out_of_memory,
                freed_blocks_come_back_on_their_own_stream_only,
                a_stream_takes_what_another_freed_when_shared,
                eight_threads_allocate_write_read_and_free,
                statistics_count_every_block_exactly
            );
        }
    };
    (@tests $fixtures:path; $($property:ident),*) => {
        $(
            #[test]
            fn $property() {
                crate::suite::run($fixtures, crate::suite::$property);
            }
        )*
    };
}

conformance!(host, crate::fixtures::host);
conformance!(sim_plain, crate::fixtures::sim_plain);
conformance!(sim_virtual, crate::fixtures::sim_virtual);
conformance!(sim_segment_per_block, crate::fixtures::sim_segment_per_block);

#[cfg(feature = "cuda")]
conformance!(cuda_device_local_plain, crate::fixtures::cuda_device_local_plain);
#[cfg(feature = "cuda")]
conformance!(cuda_device_local_virtual, crate::fixtures::cuda_device_local_virtual);
#[cfg(feature = "cuda")]
conformance!(cuda_pinned, crate::fixtures::cuda_pinned);
#[cfg(feature = "cuda")]
conformance!(cuda_read_only, crate::fixtures::cuda_read_only);

#[cfg(feature = "opencl")]
conformance!(opencl_device_local, crate::fixtures::opencl_device_local);
#[cfg(feature = "opencl")]
conformance!(opencl_pinned, crate::fixtures::opencl_pinned);
#[cfg(feature = "opencl")]
conformance!(opencl_read_only, crate::fixtures::opencl_read_only);

#[cfg(feature = "wgpu")]
conformance!(wgpu_device_local, crate::fixtures::wgpu_device_local);
#[cfg(feature = "wgpu")]
conformance!(wgpu_pinned, crate::fixtures::wgpu_pinned);
#[cfg(feature = "wgpu")]
conformance!(wgpu_read_only, crate::fixtures::wgpu_read_only);
#[cfg(feature = "wgpu")]
conformance!(wgpu_upload, crate::fixtures::wgpu_upload);
#[cfg(feature = "wgpu")]
conformance!(wgpu_readback, crate::fixtures::wgpu_readback);
