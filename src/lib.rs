//! # umm — a universal memory manager
//!
//! One caching, stream-safe segment-block allocator for every accelerator in a machine: CUDA devices, OpenCL
//! devices, wgpu adapters and host memory. A [`UniversalMemoryManager`] discovers the devices, decides where each
//! buffer lives (a size/access decision table plus a usage tracker that learns), and hands out
//! [`UniversalBuffer`]s from per-device pools that all share one segment-block engine.
//!
//! ```
//! use umm::{Placement, UniversalMemoryManager};
//!
//! let mm = UniversalMemoryManager::new()?;
//! let mut x = mm.allocate_universal::<f32>(1 << 16, Placement::Auto)?;
//! x.write(&vec![1.5; 1 << 16])?;
//! assert_eq!(x.to_vec()?[42], 1.5);
//! println!("{} lives in {} on {}: {}", x.len(), x.placement(), x.device().name(), x.decision().reason());
//! # Ok::<(), umm::Error>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod adopt;
mod buffer;
mod builder;
mod cleanup;
pub mod config;
mod device;
mod discovery;
mod error;
mod figures;
mod host_info;
pub mod interop;
mod manager;
mod migrate;
mod migration_path;
mod notice;
pub mod observe;
mod options;
pub mod overlap;
mod placement_cache;
pub mod profiler;
mod sleep;
mod stats;
mod tags;
pub mod trace;
mod upkeep;

pub use adopt::{AdoptOptions, Adoptable};
pub use buffer::UniversalBuffer;
pub use builder::Builder;
pub use cleanup::{CleanupGuard, CleanupReport, DeviceCleanup};
pub use config::UmmConfig;
pub use device::Device;
pub use error::{Error, Result};
pub use host_info::HostInfo;
pub use manager::UniversalMemoryManager;
pub use migrate::{MigrateError, MigrateTo, MigrationPath};
pub use observe::Snapshot;
pub use options::AllocOptions;
pub use profiler::{CallSite, Event, EventKind, LeakReport, LiveAllocation, Profiler, ProfilerConfig};
pub use sleep::{SleepPolicy, SleepSummary, TagPoolReport, WakeSummary};
pub use stats::{DeviceStats, GlobalMemoryStats, PoolStatsEntry};
pub use tags::{check_tag, TagScope, MAX_TAG_LEN};
pub use upkeep::PoolStep;

pub use umm_backends::{
    BlockInfo, Limit, Ownership, PoolStats, SegmentMode, SleepAction, SleepReport, StepOutcome, StepReport, Strategy,
    StreamId, WakeReport,
};
pub use umm_placement::{
    AccessPattern, Api, Decision, DeviceKind, DeviceSelector, Evidence, Placement, PoolKind, Recommendation,
    Recommendations, SizeClass, Spread, Subject,
};

/// The engine, pools and backends, for users who drive pools directly.
pub use umm_backends as backends;
/// The placement logic.
pub use umm_placement as placement;
