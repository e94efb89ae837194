//! The model of stream-ordered memory the stream suites check front doors against (see [`oracle`]), and the
//! random workloads they run ([`workload`]) under drawn pool settings ([`setup`]).

#![allow(dead_code)] // Each suite uses its own part.

pub mod oracle;
pub mod setup;
pub mod workload;
