//! Stream capture (CUDA graphs). While a stream of the pool's device records a graph, the driver refuses some
//! calls, and a refused call invalidates the capture: querying, or waiting on the host for, an event recorded on
//! a capturing stream; synchronizing a capturing stream or the whole device; making a capturing stream wait for
//! work from outside its capture. A pool told that a capture is underway ([`Pool::begin_capture`]) therefore
//! takes only paths that need none of them until [`Pool::end_capture`]:
//!
//! - no memory moves between streams (that records and queries marks, or unmaps after a stream synchronize);
//! - free pages are not unmapped to stay within `mapped_slack`, and an allocation that misses is not retried
//!   after giving cached memory back (both wait for streams): the pool grows instead, or reports out of memory;
//! - cached memory is not released ([`Pool::release_cached`] and [`Pool::cleanup`] release nothing), no step plan
//!   is installed, no block is stitched, and the pool refuses to sleep.
//!
//! Mapping new pages and creating segments stay legal (the caller relaxes the driver's capture mode around them,
//! as PyTorch does for `cudaMalloc`): a graph keeps using those addresses, and none is unmapped while it may run.
//! Where a block freed during the capture waits for marks on other streams, [`super::StreamPool`] defers it
//! until the capture ends.

use super::Pool;
use crate::Backend;
use std::sync::atomic::Ordering;

impl<B: Backend> Pool<B> {
    /// A capture began on the pool's device: from now until the matching [`Pool::end_capture`] the pool takes
    /// only capture-safe paths (see the module's documentation). Captures nest and overlap: each begin needs its
    /// own end.
    pub fn begin_capture(&self) {
        self.captures.fetch_add(1, Ordering::SeqCst);
    }

    /// A capture begun with [`Pool::begin_capture`] ended. An end without a begin changes nothing.
    pub fn end_capture(&self) {
        let _ = self.captures.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Whether a capture is underway on the pool's device (see [`Pool::begin_capture`]).
    #[inline]
    pub fn capture_underway(&self) -> bool {
        self.captures.load(Ordering::SeqCst) > 0
    }
}
