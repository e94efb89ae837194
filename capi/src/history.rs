//! The allocation history behind `umm_record_history` and the `device_traces` of `umm_snapshot_json`: the last N
//! events of every device in the form of PyTorch's `torch.cuda.memory._record_memory_history`, so that
//! `torch.cuda._memory_viz` and pytorch.org/memory_viz draw umm's memory over time.
//!
//! Off by default; then each allocation and free pays one relaxed load. On, each event takes one lock and a
//! `VecDeque` push; the oldest event goes when the ring is full.

use parking_lot::Mutex;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The largest ring `umm_record_history` accepts: 2^26 events (about 4 GiB of host memory at most).
pub(crate) const MAX_ENTRIES: u64 = 1 << 26;

/// What happened, named as PyTorch's trace entries are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Action {
    /// A block handed out.
    Alloc,
    /// A free asked for.
    FreeRequested,
    /// A freed block's memory may be reused (at once, unless it waits for streams it was recorded on).
    FreeCompleted,
    /// Reserved memory grew: a plain segment made.
    SegmentAlloc,
    /// Reserved memory shrank: a plain segment given back.
    SegmentFree,
    /// Reserved memory grew: pages mapped into a virtual reservation (as PyTorch's expandable segments).
    SegmentMap,
    /// Reserved memory shrank: pages unmapped.
    SegmentUnmap,
    /// An allocation that failed for lack of memory.
    Oom,
}

/// One event of one device.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Event {
    pub(crate) action: Action,
    /// The block's address; for segment events, the address of the block whose allocation or free changed the
    /// reserved memory (0 for a release of cached memory); 0 for an out-of-memory.
    pub(crate) addr: u64,
    /// Block bytes; for segment events, by how much reserved memory changed; for an out-of-memory, the request.
    pub(crate) size: u64,
    pub(crate) stream: u64,
    /// Microseconds since the Unix epoch.
    pub(crate) time_us: u64,
    /// Device free bytes (out-of-memory events only, as PyTorch's `device_free`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) device_free: Option<u64>,
    /// Always empty: umm does not capture the caller's stack. Kept so readers that expect it find it.
    pub(crate) frames: [(); 0],
}

struct Ring {
    max: usize,
    /// Events by device.
    devices: Vec<VecDeque<Event>>,
}

static ON: AtomicBool = AtomicBool::new(false);
static RING: Mutex<Ring> = Mutex::new(Ring { max: 0, devices: Vec::new() });

/// Starts recording the last `max_entries` events of each device, dropping what was recorded before; 0 stops
/// recording and keeps what was recorded for the next snapshot.
pub(crate) fn record(max_entries: u64) -> Result<(), String> {
    if max_entries > MAX_ENTRIES {
        return Err(format!("umm_record_history: {max_entries} entries is above the {MAX_ENTRIES} a ring may hold"));
    }
    let mut ring = RING.lock();
    if max_entries == 0 {
        ON.store(false, Ordering::Relaxed);
        return Ok(());
    }
    ring.max = max_entries as usize;
    ring.devices.clear();
    ON.store(true, Ordering::Relaxed);
    Ok(())
}

/// Whether events are being recorded (one relaxed load).
#[inline]
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Records an event of `device` (a no-op when not recording).
pub(crate) fn push(device: usize, action: Action, addr: u64, size: u64, stream: u64, device_free: Option<u64>) {
    if !on() {
        return;
    }
    let time_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    let event = Event { action, addr, size, stream, time_us, device_free, frames: [] };
    let mut ring = RING.lock();
    // Checked again under the lock: a stop may have come in between.
    if !on() || ring.max == 0 {
        return;
    }
    let max = ring.max;
    if ring.devices.len() <= device {
        ring.devices.resize_with(device + 1, VecDeque::new);
    }
    let events = &mut ring.devices[device];
    if events.len() == max {
        events.pop_front();
    }
    events.push_back(event);
}

/// Records the change of a device's reserved memory from `before` to `after` as a segment event.
pub(crate) fn push_reserved_change(
    device: usize,
    virtual_memory: bool,
    addr: u64,
    stream: u64,
    before: u64,
    after: u64,
) {
    if !on() || before == after {
        return;
    }
    let action = match (after > before, virtual_memory) {
        (true, true) => Action::SegmentMap,
        (true, false) => Action::SegmentAlloc,
        (false, true) => Action::SegmentUnmap,
        (false, false) => Action::SegmentFree,
    };
    push(device, action, addr, after.abs_diff(before), stream, None);
}

/// The recorded events of devices `0..devices`, oldest first (an empty list for a device without events).
pub(crate) fn events(devices: usize) -> Vec<Vec<Event>> {
    let ring = RING.lock();
    (0..devices).map(|d| ring.devices.get(d).map(|e| e.iter().cloned().collect()).unwrap_or_default()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the ring is process-wide.
    #[test]
    fn the_ring_keeps_the_last_events_and_stops_on_zero() {
        assert!(record(MAX_ENTRIES + 1).unwrap_err().contains("above"));
        record(3).unwrap();
        for addr in 1..=5 {
            push(1, Action::Alloc, addr, 512, 0, None);
        }
        push_reserved_change(0, true, 7, 0, 0, 2 << 20);
        push_reserved_change(0, false, 7, 0, 4 << 20, 2 << 20);
        push_reserved_change(0, false, 7, 0, 4 << 20, 4 << 20);
        let events = events(3);
        assert_eq!(events.len(), 3);
        assert_eq!(events[1].iter().map(|e| e.addr).collect::<Vec<_>>(), [3, 4, 5], "the oldest went");
        assert_eq!(
            events[0].iter().map(|e| (e.action, e.size)).collect::<Vec<_>>(),
            [(Action::SegmentMap, 2 << 20), (Action::SegmentFree, 2 << 20)]
        );
        assert!(events[2].is_empty());
        let json = serde_json::to_value(&events[0][0]).unwrap();
        assert_eq!(json["action"], "segment_map");
        assert!(json.get("device_free").is_none());
        record(0).unwrap();
        assert!(!on());
        push(1, Action::Alloc, 9, 512, 0, None);
        push_reserved_change(1, true, 9, 0, 0, 2 << 20);
        let kept: Vec<u64> = super::events(2)[1].iter().map(|e| e.addr).collect();
        assert_eq!(kept, [3, 4, 5], "stopped: kept, nothing added");
        record(MAX_ENTRIES).expect("the largest ring is accepted");
        record(0).unwrap();
        record(2).unwrap();
        assert!(super::events(2)[1].is_empty(), "a new start drops the old events");
        record(0).unwrap();
    }
}
