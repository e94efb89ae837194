//! Pool statistics, named like PyTorch's `torch.cuda.memory_stats()` so its users recognise them.

use serde::Serialize;

/// A gauge with its high-water mark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    /// Value now.
    pub current: u64,
    /// Highest value seen since creation or the last [`crate::Pool::reset_peaks`].
    pub peak: u64,
}

impl Stat {
    #[inline]
    pub(crate) fn add(&mut self, n: u64) {
        self.current += n;
        self.peak = self.peak.max(self.current);
    }

    #[inline]
    pub(crate) fn sub(&mut self, n: u64) {
        self.current -= n;
    }

    #[inline]
    pub(crate) fn set(&mut self, n: u64) {
        self.current = n;
        self.peak = self.peak.max(n);
    }

    pub(crate) fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// One pool's statistics. Byte counts are of rounded block sizes unless named `requested`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PoolStats {
    /// Pool (device and placement) name.
    pub name: String,
    /// Bytes in live blocks.
    pub allocated_bytes: Stat,
    /// Bytes the callers asked for (before rounding) in live blocks.
    pub requested_bytes: Stat,
    /// Bytes held from the device: plain segments plus mapped pages of virtual segments.
    pub reserved_bytes: Stat,
    /// Bytes in live blocks plus freed blocks still waiting for their streams (not yet reusable).
    pub active_bytes: Stat,
    /// Free bytes inside segments that also hold live blocks (lost to splitting until those blocks are freed).
    pub inactive_split_bytes: Stat,
    /// Live blocks.
    pub active_blocks: Stat,
    /// Segments held (plain segments and virtual reservations).
    pub segments: Stat,
    /// Allocations served.
    pub num_allocs: u64,
    /// Frees.
    pub num_frees: u64,
    /// Allocations served from memory the pool already held.
    pub cache_hits: u64,
    /// Allocations that had to get memory from the device (a new segment or newly mapped pages).
    pub cache_misses: u64,
    /// Segments created (or page ranges mapped) through the backend.
    pub num_device_alloc: u64,
    /// Segments destroyed (or page ranges unmapped) through the backend.
    pub num_device_free: u64,
    /// Every call the pool made into the device's memory API: segments created and destroyed, address ranges
    /// reserved, page ranges mapped and unmapped (a page moved from one place to another is two calls).
    pub num_device_calls: u64,
    /// Empty segments moved from one stream's arena to another's to serve a miss ([`crate::CrossStream`]).
    pub num_segments_shared: u64,
    /// Pages unmapped in one stream's reservation so that another stream's could map their memory.
    pub num_pages_shared: u64,
    /// Free blocks of one stream's reservations lent to another stream where they lie, with no page moved.
    pub num_blocks_shared: u64,
    /// Marks (CUDA events) the pool recorded on its streams so that memory one stream freed could serve another
    /// (an event record each: not calls into the memory API, so not in `num_device_calls`).
    pub num_stream_marks: u64,
    /// Stitched blocks made: free pages of a stream's reservations mapped side by side a second time, in an
    /// address range of their own, to serve a request no free range held (see [`crate::PoolConfig::stitch`]).
    pub num_stitches: u64,
    /// Stitched address ranges held now (in use or kept for reuse): reservations of address space alone, not
    /// counted in `segments`.
    pub stitched_ranges: u64,
    /// Allocations served by a stitched block (made for them, or kept from before and reused without a device
    /// call).
    pub num_stitched_allocs: u64,
    /// Step ends marked ([`crate::MemoryPool::mark_step`]).
    pub num_steps: u64,
    /// Plans made from repeating steps.
    pub num_step_plans: u64,
    /// Steps that ran as their plan foresaw (same allocations, sizes, streams and frees, in order).
    pub num_steps_planned: u64,
    /// Allocations served at their planned offset in a step's planned segment.
    pub num_planned_allocs: u64,
    /// Allocations a plan foresaw that went to the pool instead: their range was not free (the step deviated).
    pub num_plan_fallbacks: u64,
    /// Bytes of the planned segments held now (counted in `reserved_bytes` too).
    pub planned_bytes: u64,
    /// Allocations that failed first, released cached memory and were retried.
    pub num_alloc_retries: u64,
    /// Allocations that failed for good with out of memory.
    pub num_ooms: u64,
    /// The pool's limit in bytes, if any.
    pub limit_bytes: Option<u64>,
    /// Device bytes a sleeping pool gave back ([`crate::Pool::sleep`]), whose addresses stay reserved for the
    /// wake; 0 while awake. Not in `reserved_bytes`.
    pub asleep_bytes: u64,
    /// Of `asleep_bytes`, those held in host memory for the wake (offloaded rather than discarded).
    pub offloaded_bytes: u64,
    /// Host memory held for offloading: a sleeping pool's copy of its pages, or the store kept after a wake for
    /// the next sleep (until `release_cached`).
    pub host_store_bytes: u64,
}

impl PoolStats {
    /// Share of allocations served from cache, in `[0, 1]` (0 when nothing was allocated).
    pub fn hit_rate(&self) -> f64 {
        let total = self.cache_hits + self.cache_misses;
        if total == 0 {
            0.0
        } else {
            self.cache_hits as f64 / total as f64
        }
    }

    /// Share of reserved bytes not allocated right now, in `[0, 1]`: `1 - allocated / reserved`.
    pub fn fragmentation_ratio(&self) -> f64 {
        if self.reserved_bytes.current == 0 {
            0.0
        } else {
            1.0 - self.allocated_bytes.current as f64 / self.reserved_bytes.current as f64
        }
    }

    /// Adds another pool's counts to these (peaks add too, so a sum's peak is an upper bound).
    pub fn accumulate(&mut self, other: &PoolStats) {
        for (a, b) in [
            (&mut self.allocated_bytes, &other.allocated_bytes),
            (&mut self.requested_bytes, &other.requested_bytes),
            (&mut self.reserved_bytes, &other.reserved_bytes),
            (&mut self.active_bytes, &other.active_bytes),
            (&mut self.inactive_split_bytes, &other.inactive_split_bytes),
            (&mut self.active_blocks, &other.active_blocks),
            (&mut self.segments, &other.segments),
        ] {
            a.current += b.current;
            a.peak += b.peak;
        }
        self.num_allocs += other.num_allocs;
        self.num_frees += other.num_frees;
        self.cache_hits += other.cache_hits;
        self.cache_misses += other.cache_misses;
        self.num_device_alloc += other.num_device_alloc;
        self.num_device_free += other.num_device_free;
        self.num_device_calls += other.num_device_calls;
        self.num_segments_shared += other.num_segments_shared;
        self.num_pages_shared += other.num_pages_shared;
        self.num_blocks_shared += other.num_blocks_shared;
        self.num_stream_marks += other.num_stream_marks;
        self.num_stitches += other.num_stitches;
        self.num_stitched_allocs += other.num_stitched_allocs;
        self.stitched_ranges += other.stitched_ranges;
        self.num_steps += other.num_steps;
        self.num_step_plans += other.num_step_plans;
        self.num_steps_planned += other.num_steps_planned;
        self.num_planned_allocs += other.num_planned_allocs;
        self.num_plan_fallbacks += other.num_plan_fallbacks;
        self.planned_bytes += other.planned_bytes;
        self.num_alloc_retries += other.num_alloc_retries;
        self.num_ooms += other.num_ooms;
        self.asleep_bytes += other.asleep_bytes;
        self.offloaded_bytes += other.offloaded_bytes;
        self.host_store_bytes += other.host_store_bytes;
        self.limit_bytes = match (self.limit_bytes, other.limit_bytes) {
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
            _ => None,
        };
    }
}

/// Reserved bytes of a group of pools (a manager's, or one device's in the C ABI), kept as the pools reserve and
/// release memory, so that the group's peak is the true peak of the sum rather than the sum of the pools' peaks.
/// Pools join through [`crate::PoolConfig::reserved_group`]; reserved memory changes only when a pool takes memory
/// from its device or gives it back, so the shared counter costs the allocation path nothing.
#[derive(Debug, Default)]
pub struct ReservedGroup {
    current: std::sync::atomic::AtomicU64,
    peak: std::sync::atomic::AtomicU64,
}

impl ReservedGroup {
    /// A new group with nothing reserved, to share among pools.
    pub fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::default()
    }

    /// Bytes the group's pools reserve now.
    pub fn current(&self) -> u64 {
        self.current.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most the group's pools reserved at one moment since the group began or its peak was reset.
    pub fn peak(&self) -> u64 {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts the peak afresh from what is reserved now.
    pub fn reset_peak(&self) {
        self.peak.store(self.current(), std::sync::atomic::Ordering::Relaxed);
    }

    /// A pool of the group went from `before` to `after` reserved bytes.
    pub(crate) fn change(&self, before: u64, after: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if after > before {
            let now = self.current.fetch_add(after - before, Relaxed) + (after - before);
            self.peak.fetch_max(now, Relaxed);
        } else if before > after {
            self.current.fetch_sub(before - after, Relaxed);
        }
    }
}

/// Groups compare by identity: two configurations are alike when their pools join the same group.
impl PartialEq for ReservedGroup {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}
