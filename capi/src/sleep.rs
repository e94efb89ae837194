//! Sleep and wake behind the C ABI (`umm_sleep`, `umm_wake`, `umm_sleeping_json`): a tag sleeps and wakes as a
//! whole, on every device, its blocks keeping their addresses (see `umm_backends::Pool::sleep`), so that CUDA graphs
//! captured before a sleep replay after the wake. The thread's tag and the set of tags asleep are [`crate::tag`]'s.

use crate::registry::{registry, SharedPool};
use crate::tag::ASLEEP;
use serde::Serialize;
use std::sync::Arc;
use umm_backends::cuda::ContextScope;
use umm_backends::pool::{check_tag, each_at_once, sleep_all_or_none};
use umm_backends::{SleepAction, SleepReport, WakeReport};

/// A comma-separated list of tags (spaces around each ignored, empty entries skipped), each checked.
pub(crate) fn parse_list(what: &str, list: &str) -> Result<Vec<String>, String> {
    let tags: Vec<String> = list.split(',').map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect();
    for tag in &tags {
        check_tag(tag).map_err(|e| format!("{what}: {e}"))?;
    }
    Ok(tags)
}

/// One pool's part in a sleep or a wake.
#[derive(Serialize)]
struct PoolPart<R> {
    device: usize,
    tag: String,
    report: R,
}

/// What `umm_sleep` did, as JSON.
#[derive(Serialize, Default)]
struct SleepSummary {
    pools: Vec<PoolPart<SleepReport>>,
    bytes_released: u64,
    bytes_offloaded: u64,
    seconds: f64,
}

/// What `umm_wake` did, as JSON.
#[derive(Serialize, Default)]
struct WakeSummary {
    pools: Vec<PoolPart<WakeReport>>,
    bytes_mapped: u64,
    bytes_restored: u64,
    seconds: f64,
}

/// Every tagged pool of every device whose tag is in `tags`, with its device and tag.
fn tagged_pools(tags: &[String]) -> Vec<(usize, Arc<str>, SharedPool)> {
    let mut pools = Vec::new();
    for (index, slot) in registry().devices.iter().enumerate() {
        for (tag, pool) in slot.tagged.read().iter() {
            if tags.iter().any(|t| **t == **tag) {
                pools.push((index, Arc::clone(tag), Arc::clone(pool)));
            }
        }
    }
    pools
}

/// Puts `offload` and `discard` tags to sleep on every device, all or nothing: a pool that cannot sleep wakes
/// the ones already asleep and its error is returned. Returns the report as JSON.
pub(crate) fn sleep(offload: &[String], discard: &[String]) -> Result<String, String> {
    let start = std::time::Instant::now();
    if let Some(both) = offload.iter().find(|t| discard.contains(t)) {
        return Err(format!("umm_sleep: tag {both} is both offloaded and discarded"));
    }
    if offload.is_empty() && discard.is_empty() {
        return Err("umm_sleep: no tag named (offload and discard are both empty)".into());
    }
    let mut asleep = ASLEEP.lock();
    if let Some(tag) = offload.iter().chain(discard).find(|t| asleep.contains_key(*t)) {
        return Err(format!("umm_sleep: tag {tag} is asleep already"));
    }
    let _scope = ContextScope::enter_saving();
    let action = |tag: &str| if offload.iter().any(|t| t == tag) { SleepAction::Offload } else { SleepAction::Discard };
    let all: Vec<String> = offload.iter().chain(discard).cloned().collect();
    let mut summary = SleepSummary::default();
    let pools = tagged_pools(&all);
    // A tag without memory would sleep giving nothing back, then refuse allocations: refused instead.
    if let Some(idle) = all.iter().find(|t| !pools.iter().any(|(_, tag, _)| **tag == ***t)) {
        return Err(format!(
            "umm_sleep: tag {idle} holds no memory on any device (nothing was allocated under it): nothing to put to \
             sleep"
        ));
    }
    let reports = sleep_all_or_none(&pools, |(_, tag, pool)| pool.sleep(action(tag)), |(_, _, pool)| pool.wake())
        .map_err(|(failed, e)| {
            let (device, tag, _) = &pools[failed];
            format!("umm_sleep: tag {tag} on device {device}: {e}")
        })?;
    for ((device, tag, _), report) in pools.iter().zip(reports) {
        summary.bytes_released += report.bytes_released + report.cached_released;
        summary.bytes_offloaded += report.bytes_offloaded;
        summary.pools.push(PoolPart { device: *device, tag: tag.to_string(), report });
    }
    asleep.extend(all.iter().map(|t| (t.clone(), action(t))));
    summary.seconds = start.elapsed().as_secs_f64();
    serde_json::to_string(&summary).map_err(|e| format!("umm_sleep: {e}"))
}

/// Wakes `tags` (every sleeping tag when empty) on every device, every pool at once; a tag whose pools cannot
/// all wake stays asleep (with its bytes kept) and the first error is returned after every pool was tried.
pub(crate) fn wake(tags: &[String]) -> Result<String, String> {
    let start = std::time::Instant::now();
    let mut asleep = ASLEEP.lock();
    // A tag named that does not sleep would be a wake that does nothing: refused, waking none.
    if let Some(awake) = tags.iter().find(|t| !asleep.contains_key(*t)) {
        let list: Vec<&str> = asleep.keys().map(String::as_str).collect();
        let list = if list.is_empty() { "none".to_string() } else { list.join(", ") };
        return Err(format!("umm_wake: tag {awake} is not asleep: nothing to wake (asleep: {list})"));
    }
    let chosen: Vec<String> = asleep.keys().filter(|t| tags.is_empty() || tags.contains(t)).cloned().collect();
    let _scope = ContextScope::enter_saving();
    let mut summary = WakeSummary::default();
    let mut failure = None;
    let pools: Vec<_> = tagged_pools(&chosen).into_iter().filter(|(_, _, p)| p.sleeping().is_some()).collect();
    let reports = each_at_once(&pools, |(_, _, pool)| pool.wake());
    let mut failed: Vec<Arc<str>> = Vec::new();
    for ((device, tag, _), result) in pools.into_iter().zip(reports) {
        match result {
            Ok(report) => {
                summary.bytes_mapped += report.bytes_mapped;
                summary.bytes_restored += report.bytes_restored;
                summary.pools.push(PoolPart { device, tag: tag.to_string(), report });
            }
            Err(e) => {
                failure.get_or_insert(format!("umm_wake: tag {tag} on device {device}: {e}"));
                failed.push(tag);
            }
        }
    }
    for tag in chosen.iter().filter(|t| !failed.iter().any(|f| **f == ***t)) {
        asleep.remove(tag);
    }
    if let Some(e) = failure {
        return Err(e);
    }
    summary.seconds = start.elapsed().as_secs_f64();
    serde_json::to_string(&summary).map_err(|e| format!("umm_wake: {e}"))
}

/// The sleeping tags and their actions, as a JSON object.
pub(crate) fn sleeping_json() -> String {
    let asleep = ASLEEP.lock();
    let map: serde_json::Map<String, serde_json::Value> =
        asleep.iter().map(|(t, a)| (t.clone(), a.to_string().into())).collect();
    serde_json::Value::Object(map).to_string()
}
