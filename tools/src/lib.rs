//! # umm-tools — what runs beside a workload, not inside it
//!
//! The offline half of umm, built on the facade (`umm`) and its trace format: a user who links `umm` into a
//! training or serving process compiles none of this.
//!
//! - [`replay`]: a recorded [`Trace`](umm::trace::Trace) through a pool, with memory and time per op (`umm replay`).
//! - [`plan`]: lifetimes to offsets in one block ([`plan::LifetimeAnalyzer`], [`plan::ReusePlan`]), and a
//!   [`plan::PlannedArena`] that serves a repeating step from it (`umm plan`).
//! - [`plot`]: timelines of live memory as SVG, from a trace, a profiler or a snapshot (`umm plot`).
//! - [`torch_snapshot`]: PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`) read as traces.
//! - [`device_table`]: every discovered device in one table (`umm devices`).
//!
//! The `umm` command line lives in `src/bin/umm.rs`.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod device_table;
pub mod plan;
pub mod plot;
pub mod replay;
pub mod torch_snapshot;

pub use device_table::{DeviceRow, DeviceTable};
