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
//! caching pool of device memory (`CudaDevice::caching_pool(PoolPlacement::DeviceLocal, ..)`), so the CUDA
//! backend's reuse rules hold: a block freed on the stream it was allocated on is reused at once on that
//! stream and never handed to another stream while cached.
//!
//! Errors never cross the ABI as panics: a failing call returns NULL (or -1) and leaves a message that
//! `umm_last_error()` returns on the same thread. Every `unsafe` of the crate is in [`ffi`].

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod error;
pub mod ffi;
mod registry;

pub use error::last_error_message;
pub use ffi::*;
