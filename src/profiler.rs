//! Allocation events: who allocated what, where (call site), on which device and pool. Feeds the leak report,
//! the snapshot's event list and `UMM_TRACE` recording.

use std::panic::Location;
use umm_backends::StreamId;
use umm_placement::{Api, PoolKind};

/// What the manager tells the profiler about one allocation.
#[derive(Debug, Clone)]
pub(crate) struct AllocEvent<'a> {
    pub(crate) device: usize,
    pub(crate) pool: PoolKind,
    pub(crate) api: Option<Api>,
    pub(crate) bytes: u64,
    pub(crate) stream: StreamId,
    pub(crate) label: Option<&'a str>,
    pub(crate) location: &'static Location<'static>,
    /// The pool block's key (`BlockHandle::key`), `None` for an empty buffer.
    pub(crate) block_key: Option<u64>,
}

/// Records allocation events (stub: records nothing yet).
#[derive(Debug, Default)]
pub struct Profiler {}

impl Profiler {
    /// Records an allocation; returns the id its free will be recorded with.
    #[inline]
    pub(crate) fn on_alloc(&self, event: &AllocEvent<'_>) -> u64 {
        let _ = event;
        0
    }

    /// Records the free of allocation `id`.
    #[inline]
    pub(crate) fn on_free(&self, id: u64) {
        let _ = id;
    }
}
