//! Tags, sleep and wake at the manager: allocations tagged `weights` or `kv_cache` go to pools of their own
//! (one per tag, device and pool kind), and [`UniversalMemoryManager::sleep`] offloads or discards a tag's memory
//! and gives its device pages back while every buffer keeps its address; [`UniversalMemoryManager::wake`] brings
//! it back (see [`umm_backends::Pool::sleep`] for what a pool does).
//!
//! A tag comes from [`crate::AllocOptions::tag`] or, for every allocation of a thread in a region, from
//! [`UniversalMemoryManager::tag_scope`].

use crate::error::{Error, Result};
use crate::manager::UniversalMemoryManager;
use crate::tags::TagScope;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use umm_backends::pool::{check_tag, each_at_once, sleep_all_or_none};
use umm_backends::{SleepAction, SleepReport, WakeReport};
use umm_placement::{Api, DeviceKind, PoolKind};

/// Which tags sleep, and how: [`SleepAction::Offload`] (copied to host memory, back at wake) or
/// [`SleepAction::Discard`] (the buffers come back with undefined contents). Tags not named stay awake.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SleepPolicy {
    tags: BTreeMap<String, SleepAction>,
}

impl SleepPolicy {
    /// No tag.
    pub fn new() -> Self {
        Self::default()
    }
    /// Offloads `tag`'s memory to host memory.
    pub fn offload(mut self, tag: impl Into<String>) -> Self {
        self.tags.insert(tag.into(), SleepAction::Offload);
        self
    }
    /// Discards `tag`'s memory.
    pub fn discard(mut self, tag: impl Into<String>) -> Self {
        self.tags.insert(tag.into(), SleepAction::Discard);
        self
    }
    /// The tags and their actions.
    pub fn tags(&self) -> impl Iterator<Item = (&str, SleepAction)> {
        self.tags.iter().map(|(t, a)| (t.as_str(), *a))
    }
}

/// One pool's part in a sleep or a wake.
#[derive(Debug, Clone, Serialize)]
pub struct TagPoolReport<R> {
    /// The device's index.
    pub device: usize,
    /// The tag.
    pub tag: String,
    /// The pool's API and kind.
    pub api: Api,
    /// See [`PoolKind`].
    pub kind: PoolKind,
    /// What the pool did.
    pub report: R,
}

/// What [`UniversalMemoryManager::sleep`] did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SleepSummary {
    /// Every pool put to sleep.
    pub pools: Vec<TagPoolReport<SleepReport>>,
    /// Tagged pools of host memory, left as they are: their memory is the host's already.
    pub host_pools: usize,
    /// Device bytes given back, cached ones included.
    pub bytes_released: u64,
    /// Bytes copied to host memory.
    pub bytes_offloaded: u64,
    /// Time the whole sleep took.
    pub elapsed: Duration,
}

/// What [`UniversalMemoryManager::wake`] did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WakeSummary {
    /// Every pool woken.
    pub pools: Vec<TagPoolReport<WakeReport>>,
    /// Device bytes mapped again.
    pub bytes_mapped: u64,
    /// Bytes copied back from host memory.
    pub bytes_restored: u64,
    /// Time the whole wake took.
    pub elapsed: Duration,
}

impl UniversalMemoryManager {
    /// Tags the calling thread's allocations that carry no tag of their own until the returned scope is
    /// dropped (PyTorch users know this as vLLM's `use_memory_pool(tag=...)`):
    ///
    /// ```
    /// # let mm = umm::UniversalMemoryManager::builder().backends(false, false, false).build().unwrap();
    /// let weights = {
    ///     let _tag = mm.tag_scope("weights").unwrap();
    ///     mm.allocate_universal::<f32>(1024, umm::Placement::DeviceLocal).unwrap()
    /// };
    /// # drop(weights);
    /// ```
    pub fn tag_scope(&self, tag: &str) -> Result<TagScope> {
        check_tag(tag)?;
        Ok(TagScope::enter(Arc::from(tag)))
    }

    /// Puts the tags `policy` names to sleep on every device: each tagged pool waits for its device's queued
    /// work, offloads or discards the bytes of its live buffers, and gives its device memory back, keeping
    /// every buffer's address. Until [`UniversalMemoryManager::wake`], those buffers refuse reads, writes and
    /// views, and the tags refuse allocations ([`umm_backends::Error::Asleep`]); dropping a buffer is fine.
    /// A tag's pools of host memory stay as they are (counted in [`SleepSummary::host_pools`]).
    ///
    /// # Errors
    /// All or nothing: when a pool cannot sleep (its device has no virtual memory: OpenCL, wgpu; see
    /// [`umm_backends::Pool::sleep`]), the pools already asleep wake and the error is returned. Refused before
    /// anything sleeps: a policy naming no tag ([`Error::InvalidConfig`](crate::Error::InvalidConfig)), a tag
    /// asleep already ([`Error::is_asleep`](crate::Error::is_asleep)), and a tag with
    /// nothing a sleep could give back ([`Error::NothingToSleep`](crate::Error::NothingToSleep)): nothing was
    /// allocated under it, or all of it is host memory.
    pub fn sleep(&self, policy: &SleepPolicy) -> Result<SleepSummary> {
        let start = Instant::now();
        let sleepers = &self.inner.sleepers;
        let _turn = sleepers.turn.lock();
        if policy.tags.is_empty() {
            return Err(Error::InvalidConfig(
                "sleep: the policy names no tag (SleepPolicy::offload, SleepPolicy::discard)".into(),
            ));
        }
        for (tag, _) in policy.tags() {
            check_tag(tag)?;
            if let Some(action) = sleepers.asleep.lock().get(tag) {
                return Err(Error::Backend(umm_backends::Error::Asleep {
                    pool: format!("tag {tag} ({action})"),
                    what: "a second sleep".into(),
                }));
            }
        }
        let mut summary = SleepSummary::default();
        // Marked first: an allocation racing the sleep of its pool is refused by the pool itself.
        sleepers.asleep.lock().extend(policy.tags().map(|(t, a)| (Arc::from(t), a)));
        let unmark = || {
            let mut asleep = sleepers.asleep.lock();
            for (tag, _) in policy.tags() {
                asleep.remove(tag);
            }
        };
        let mut chosen = Vec::new();
        let mut on_host: Vec<Arc<str>> = Vec::new();
        for device in &self.inner.devices {
            for (tag, api, kind, pool) in device.tagged_pools() {
                let Some(&action) = policy.tags.get(&*tag) else { continue };
                if device.kind() == DeviceKind::Host || matches!(kind, PoolKind::Host | PoolKind::HostPinned) {
                    summary.host_pools += 1;
                    on_host.push(tag);
                    continue;
                }
                chosen.push((device.index(), tag, api, kind, pool, action));
            }
        }
        // A tag that would sleep without giving anything back would still refuse allocations: refused instead.
        let idle = policy.tags().map(|(t, _)| t).find(|t| !chosen.iter().any(|c| &*c.1 == *t));
        if let Some(tag) = idle {
            unmark();
            let reason = if on_host.iter().any(|t| &**t == tag) {
                "all of its memory is host memory, which a sleep cannot give back"
            } else {
                "nothing was allocated under it on any device"
            };
            return Err(Error::NothingToSleep { tag: tag.to_string(), reason });
        }
        let reports = sleep_all_or_none(&chosen, |(.., pool, action)| pool.sleep(*action), |(.., pool, _)| pool.wake());
        let reports = match reports {
            Ok(reports) => reports,
            Err((_, e)) => {
                unmark();
                return Err(e.into());
            }
        };
        for ((device, tag, api, kind, ..), report) in chosen.into_iter().zip(reports) {
            summary.bytes_released += report.bytes_released + report.cached_released;
            summary.bytes_offloaded += report.bytes_offloaded;
            summary.pools.push(TagPoolReport { device, tag: tag.to_string(), api, kind, report });
        }
        summary.elapsed = start.elapsed();
        Ok(summary)
    }

    /// Wakes `tags` (every sleeping tag when empty) on every device: new device memory is mapped at the
    /// buffers' old addresses and offloaded bytes are copied back; discarded buffers hold undefined bytes.
    /// Every pool at once: a tag whose memory the device cannot give stays asleep, with its bytes kept, and the
    /// first error is returned after every pool was tried. A tag named that is not asleep is
    /// [`Error::NotAsleep`](crate::Error::NotAsleep), and nothing wakes.
    pub fn wake(&self, tags: &[&str]) -> Result<WakeSummary> {
        let start = Instant::now();
        let sleepers = &self.inner.sleepers;
        let _turn = sleepers.turn.lock();
        let chosen: Vec<Arc<str>> = {
            let asleep = sleepers.asleep.lock();
            // A tag named that does not sleep would be a wake that does nothing: refused, waking none.
            if let Some(awake) = tags.iter().find(|t| !asleep.contains_key(**t)) {
                let asleep: Vec<&str> = asleep.keys().map(|t| &**t).collect();
                return Err(Error::NotAsleep { tag: awake.to_string(), asleep: asleep.join(", ") });
            }
            asleep.keys().filter(|t| tags.is_empty() || tags.contains(&&***t)).cloned().collect()
        };
        let mut summary = WakeSummary::default();
        let mut pools = Vec::new();
        for device in &self.inner.devices {
            for (tag, api, kind, pool) in device.tagged_pools() {
                if chosen.contains(&tag) && pool.sleeping().is_some() {
                    pools.push((device.index(), tag, api, kind, pool));
                }
            }
        }
        let results = each_at_once(&pools, |(.., pool)| pool.wake());
        let mut failure = None;
        let mut failed = Vec::new();
        for ((device, tag, api, kind, _), result) in pools.into_iter().zip(results) {
            match result {
                Ok(report) => {
                    summary.bytes_mapped += report.bytes_mapped;
                    summary.bytes_restored += report.bytes_restored;
                    summary.pools.push(TagPoolReport { device, tag: tag.to_string(), api, kind, report });
                }
                Err(e) => {
                    failure.get_or_insert(e);
                    failed.push(tag);
                }
            }
        }
        let mut asleep = sleepers.asleep.lock();
        for tag in chosen.iter().filter(|t| !failed.contains(t)) {
            asleep.remove(tag);
        }
        drop(asleep);
        if let Some(e) = failure {
            return Err(e.into());
        }
        summary.elapsed = start.elapsed();
        Ok(summary)
    }

    /// The sleeping tags and how each went to sleep.
    pub fn sleeping_tags(&self) -> Vec<(String, SleepAction)> {
        self.inner.sleepers.asleep.lock().iter().map(|(t, a)| (t.to_string(), *a)).collect()
    }
}
