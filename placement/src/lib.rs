//! Placement decisions for umm: where a buffer should live, and why.
//!
//! - [`Placement`], [`AccessPattern`], [`SizeClass`], [`Thresholds`], [`PoolKind`]: the vocabulary.
//! - [`DeviceView`], [`DeviceKind`], [`Api`], [`DeviceSelector`]: what the decider knows of the machine.
//! - [`Decider`]: the decision table, with memory pressure, shared memory and usage evidence
//!   ([`Request`] in, [`Decision`] out).
//! - [`UsageTracker`]: learns from how buffers are really used and produces [`Recommendations`].
//! - [`units`]: byte counts formatted and sizes parsed, for every crate of umm.
//!
//! Pure logic: no unsafe, no device crates, no pools. The facade crate discovers devices, builds the
//! [`DeviceView`]s, calls [`Decider::decide`], and feeds the [`UsageTracker`].
//!
//! ```
//! use umm_placement::{Decider, DeviceKind, DeviceView, PoolKind, Request, Api};
//!
//! let host = DeviceView::host(0, 64 << 30, 32 << 30);
//! let gpu = DeviceView {
//!     index: 1,
//!     name: "gpu".into(),
//!     kind: DeviceKind::DiscreteGpu,
//!     apis: vec![Api::Cuda],
//!     shares_memory_with_host: false,
//!     total_bytes: 80 << 30,
//!     free_bytes: 70 << 30,
//!     cached_bytes: 0,
//!     pools: vec![PoolKind::DeviceLocal, PoolKind::HostPinned],
//!     max_allocation: 0,
//! };
//! let d = Decider::default().decide(&Request::new(1 << 20), &[host, gpu], None)?;
//! assert_eq!((d.device, d.pool), (1, PoolKind::DeviceLocal));
//! # Ok::<(), umm_placement::Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod decision;
mod device;
mod error;
mod ledger;
mod placement;
mod recommend;
mod tracker;
pub mod units;

pub use decision::{Decider, Decision, DecisionConfig, Request, Spread};
pub use device::{Api, DeviceKind, DeviceSelector, DeviceView};
pub use error::{Error, Result};
pub use placement::{AccessPattern, Placement, PoolKind, SizeClass, Thresholds};
pub use recommend::{Evidence, PoolCounts, RecommendConfig, Recommendation, Recommendations, Subject};
pub use tracker::{TrackId, TrackerConfig, UsageTracker, LIFETIME_SAMPLE};
