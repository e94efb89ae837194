//! A C ABI over umm's CUDA pools, so that programs in other languages use umm as their CUDA allocator. The
//! two allocation functions have the signatures that PyTorch's `torch.cuda.memory.CUDAPluggableAllocator`
//! loads:
//!
//! ```c
//! void* umm_alloc(ssize_t size, int device, cudaStream_t stream);
//! void  umm_free(void* ptr, ssize_t size, int device, cudaStream_t stream);
//! ```
//!
//! The header is `capi/include/umm.h`. Devices are discovered on the first call; each gets one stream-aware
//! caching pool of device memory (`CudaDevice::caching_pool(PoolKind::DeviceLocal, ..)`, a
//! [`umm_backends::pool::StreamPool`]), so the CUDA backend's reuse rules hold: a block freed on the stream it was allocated on is reused at once on that
//! stream and never handed to another stream while cached.
//!
//! Errors never cross the ABI as panics: a failing call returns NULL (or -1) and leaves a message that
//! `umm_last_error()` returns on the same thread. Every `unsafe` of the crate is in [`ffi`].
//!
//! Environment, read once at the first call; an invalid value makes every allocation fail with a message naming it:
//! - `UMM_SEGMENT_MODE` (`auto`, `plain`, `virtual`), `UMM_STRATEGY` (`pooled`, `direct`): the pools' segments.
//! - `UMM_MAPPED_SLACK`, `UMM_SEGMENT_SLACK` (a fraction or `off`), `UMM_PAGE_SIZE` (a power of two of bytes),
//!   `UMM_ALIGNMENT` (where blocks start), `UMM_THREAD_CACHE`, `UMM_THREAD_CACHE_LARGE` (bytes; `0` is off).
//! - `UMM_CROSS_STREAM` (`completed`, the default, `wait`, `off`): when memory freed on one stream serves another.
//! - `UMM_HUGE_MIN` (bytes; 0, the default, is off): a pool of plain segments for huge requests.
//! - `UMM_TRACE=path` (`{pid}`: the process id; `.gz`: gzip): every allocation and free as an `umm-trace v1`
//!   file for `umm replay`, written out every 16,384 lines, at exit and by `umm_trace_flush()` (`trace` module).
//! - `UMM_CAPI_SIM` (`16GiB`, `2x16GiB`): simulated devices instead of CUDA's, the same pools over the backends'
//!   simulated device, so that programs using the library (the Python package's tests) run without a GPU.

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod device_pool;
mod error;
pub mod ffi;
mod graph_pool;
mod history;
mod registry;
mod share;
mod sim_streams;
mod sleep;
mod snapshot;
mod tag;
mod trace;

pub use error::last_error_message;
pub use ffi::*;
