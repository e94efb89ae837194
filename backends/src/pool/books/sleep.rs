//! The books of a sleeping pool (`pool/sleep.rs` puts it to sleep and wakes it): what happens to its bytes, the
//! ranges it unmapped and, when offloaded, where their bytes are.

use crate::engine::SegmentId;
use crate::HostStore;
use serde::Serialize;

/// What happens to the bytes of a sleeping pool's live blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, strum::Display)]
#[strum(serialize_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum SleepAction {
    /// Copied to host memory and copied back at wake (model weights).
    Offload,
    /// Dropped: the blocks come back at wake with undefined contents (a KV cache, recomputed).
    Discard,
}

/// A sleeping pool's books: the ranges it unmapped and, when offloaded, where their bytes are.
pub(in crate::pool) struct Sleeping {
    pub(in crate::pool) action: SleepAction,
    pub(in crate::pool) ranges: Vec<SleepingRange>,
    /// The bytes of `ranges`, back to back, when offloaded.
    pub(in crate::pool) store: Option<HostStore>,
    /// Sum of the ranges' lengths.
    pub(in crate::pool) bytes: u64,
}

impl Sleeping {
    /// The sleeping ranges by (arena, segment), as (offset, length) in address order.
    pub(in crate::pool) fn ranges_by_segment(&self) -> std::collections::HashMap<(usize, SegmentId), Vec<(u64, u64)>> {
        let mut by_segment: std::collections::HashMap<_, Vec<_>> = std::collections::HashMap::new();
        for r in &self.ranges {
            by_segment.entry((r.arena, r.segment)).or_default().push((r.offset, r.len));
        }
        by_segment.values_mut().for_each(|ranges| ranges.sort_unstable());
        by_segment
    }

    /// Bytes held on the host for the wake.
    pub(in crate::pool) fn offloaded_bytes(&self) -> u64 {
        if self.store.is_some() {
            self.bytes
        } else {
            0
        }
    }
}

/// A mapped range of a reservation that was unmapped by sleep.
pub(in crate::pool) struct SleepingRange {
    pub(in crate::pool) arena: usize,
    pub(in crate::pool) segment: SegmentId,
    pub(in crate::pool) offset: u64,
    pub(in crate::pool) len: u64,
}
