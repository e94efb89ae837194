//! umm's backends: the segment-block [`engine`], the generic [`Pool`] built on it, the device backends that
//! create segments and move bytes (host and sim always; CUDA, OpenCL and wgpu behind cargo features), and the
//! offline memory planner's solver ([`plan`]), which places allocations of known lifetimes in one block.
//!
//! Data flows one way: a pool asks the engine where a block goes (offsets only) and asks its [`Backend`] for
//! segments. Backends never see the engine; the engine never sees a device.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod adopt;
pub mod backend;
pub mod block;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod device_copy;
pub mod engine;
pub mod error;
pub mod host;
mod host_ptr;
pub mod host_store;
mod key_hash;
mod lock;
#[cfg(feature = "opencl")]
pub mod opencl;
pub mod plan;
pub mod pool;
pub mod sim;
pub mod stats;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
/// The wgpu backend. Named `wgpu_backend`, not `wgpu`, so that `wgpu::` in this crate's paths names the wgpu
/// crate without ambiguity.
#[cfg(feature = "wgpu")]
pub mod wgpu_backend;

pub use adopt::Ownership;
pub use backend::{Backend, HostPtr, PoolAccess, StreamMark, VirtualMemory};
pub use block::{BlockHandle, BlockInfo, MemoryPool, OwnedBlock, PoolLease};
pub use device::{DeviceInfo, Discovery};
pub use device_copy::DevicePath;
pub use error::{Error, Result};
pub use host::{host_memory, HostBackend};
pub use host_store::{HostStore, StoreBytes};
pub use key_hash::{KeyHasher, KeyMap};
/// The pools' lock (a release with a plain store), also behind the facade's per-thread tables.
pub use lock::{LeanGuard, LeanMutex};
pub use pool::{
    BlockSnapshot, CrossStream, Limit, Pool, PoolConfig, PoolSnapshot, SegmentMode, SegmentSnapshot, SleepAction,
    SleepReport, StepOutcome, StepReport, Strategy, TrimReport, WakeReport, DEFAULT_PAGE_UNLIMITED, MAX_STEP_EVENTS,
    MISSES_TO_DROP, REPEATS_TO_PLAN,
};
pub use sim::{SimBackend, SimDeviceStreams, SimStreamLog};
pub use stats::{PoolStats, ReservedGroup, Stat};
/// The vocabulary shared with the placement crate: which API a pool or device is reached through, and what sort
/// of device it is.
pub use umm_placement::{Api, DeviceKind, PoolKind};

/// Identifies a stream (CUDA stream, OpenCL queue, wgpu queue) that blocks are allocated and freed on.
/// `StreamId(0)` is the default stream. Blocks freed on a stream are reused at once on that stream only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize, serde::Deserialize)]
pub struct StreamId(pub u64);

/// Whether the environment variable `UMM_REQUIRE_BACKENDS` (a comma-separated list such as `opencl,wgpu`, or
/// `all`) names `backend`. Tests of a backend whose runtime is absent skip with a printed reason, unless the
/// backend is required, in which case the absence is a failure.
pub fn backend_required(backend: &str) -> bool {
    std::env::var("UMM_REQUIRE_BACKENDS").is_ok_and(|list| {
        list.split(',').map(str::trim).any(|b| b.eq_ignore_ascii_case(backend) || b.eq_ignore_ascii_case("all"))
    })
}
