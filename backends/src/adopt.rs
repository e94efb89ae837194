//! Adopting memory made elsewhere: a host `Vec`, a `wgpu::Buffer`, an OpenCL buffer or a cudarc `CudaSlice`
//! becomes the single block of a pool of its own, so that everything that works on pooled blocks (owned blocks,
//! statistics, snapshots, device copies, kernel views) works on it unchanged.
//!
//! An adopting pool runs the `Direct` strategy (every block is its own segment, destroyed when freed) over a
//! backend that holds the adopted memory as its one segment: the pool's first (and only) `create_segment` hands
//! it over, and any later one is refused. Freeing the block destroys the segment: memory adopted with
//! [`Ownership::Owned`] is released through its own API (the `Vec` or `CudaSlice` is dropped, the wgpu buffer
//! destroyed, the OpenCL reference released); memory adopted with [`Ownership::Borrowed`] is left alone (an
//! OpenCL reference umm retained for itself is released, which never frees a buffer its owner still holds).
//! Adopting pools never zero or poison, and carry no limit.

use crate::{Error, PoolConfig, Result, SegmentMode, Strategy};
use parking_lot::Mutex;
use std::any::Any;

/// Whether umm releases adopted memory when the buffer that wraps it is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, strum::Display)]
#[strum(serialize_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum Ownership {
    /// umm owns the memory and releases it through its own API when the buffer is dropped.
    Owned,
    /// The memory stays its owner's: umm never frees it.
    Borrowed,
}

/// What keeps owned adopted memory alive until its segment is destroyed (the `Vec`, the `CudaSlice`).
pub(crate) type Keeper = Box<dyn Any + Send + Sync>;

/// The one segment an adopting backend hands its pool, and what to release with it.
pub(crate) struct Adoption<S> {
    segment: Mutex<Option<S>>,
    keeper: Mutex<Option<Keeper>>,
    ownership: Ownership,
}

impl<S> std::fmt::Debug for Adoption<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adoption")
            .field("ownership", &self.ownership)
            .field("handed_over", &self.segment.lock().is_none())
            .finish()
    }
}

impl<S> Adoption<S> {
    /// Adopts `segment`; `keeper` (if any) is dropped when the segment is destroyed.
    pub(crate) fn new(segment: S, keeper: Option<Keeper>, ownership: Ownership) -> Self {
        Self { segment: Mutex::new(Some(segment)), keeper: Mutex::new(keeper), ownership }
    }

    /// Whether umm owns the memory (used where a backend must decide whether to destroy it).
    #[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
    pub(crate) fn owned(&self) -> bool {
        self.ownership == Ownership::Owned
    }

    /// The adopted segment, once; a second request (the pool growing) is refused.
    pub(crate) fn take(&self, backend: &str) -> Result<S> {
        self.segment.lock().take().ok_or_else(|| Error::Unsupported {
            backend: backend.to_string(),
            what: "a segment of its own: the pool of an adopted buffer holds that buffer only".into(),
        })
    }

    /// Drops the keeper: owned memory goes back through its own API.
    pub(crate) fn release(&self) {
        drop(self.keeper.lock().take());
    }
}

/// The configuration of an adopting pool: one segment per block, nothing zeroed, poisoned, cached or limited.
pub(crate) fn pool_config() -> PoolConfig {
    PoolConfig {
        reserved_group: None,
        limit: None,
        strategy: Strategy::Direct,
        segment_mode: SegmentMode::Plain,
        zero_on_alloc: false,
        poison_on_free: false,
        thread_cache_bytes: 0,
        thread_cache_large_bytes: 0,
        ..PoolConfig::default()
    }
}

/// Checks that `bytes` (what the adopted memory holds) is a whole number of `elem`-byte elements, and returns
/// the element count.
pub fn element_count(bytes: u64, elem: usize, what: &str) -> Result<usize> {
    if elem == 0 {
        return Err(Error::InvalidConfig(format!("adopting {what} as zero-sized elements")));
    }
    if !bytes.is_multiple_of(elem as u64) {
        return Err(Error::InvalidConfig(format!(
            "adopting {what} of {bytes} bytes as elements of {elem} bytes: the size is not a whole number of them"
        )));
    }
    usize::try_from(bytes / elem as u64).map_err(|_| Error::SizeOverflow { what: format!("{bytes} bytes as usize") })
}
