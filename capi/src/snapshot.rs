//! What the C ABI reports of its pools: statistics as `torch.cuda.memory_stats()` names them, and snapshots in the
//! shape of `torch.cuda.memory._snapshot()`, which PyTorch's memory visualizer draws.

use crate::history;
use crate::registry::{live_pool, registry, SharedPool};
use std::sync::Arc;

/// The device's pool statistics as one JSON object (names as in `torch.cuda.memory_stats()`).
pub(crate) fn stats_json(device: i64) -> Result<String, String> {
    let reg = registry();
    let (slot, pool) = reg.pool(device)?;
    let stats = slot.stats(pool.as_ref());
    let live_pointers = reg.live.lock().values().filter(|l| l.device == device as usize).count();
    let mut value = serde_json::to_value(&stats).map_err(|e| format!("umm_stats_json: {e}"))?;
    if let Some(map) = value.as_object_mut() {
        map.insert("device".into(), device.into());
        map.insert("device_name".into(), slot.name.clone().into());
        map.insert("device_total_bytes".into(), slot.total_bytes.into());
        map.insert("virtual_memory".into(), pool.uses_virtual_memory().into());
        map.insert("simulated".into(), reg.simulated.into());
        map.insert("live_pointers".into(), live_pointers.into());
        map.insert("pending_frees".into(), slot.pools().iter().map(|p| p.pending_frees()).sum::<usize>().into());
        map.insert("huge_pool_min_bytes".into(), slot.huge.as_ref().map(|_| reg.huge_min).into());
        if let Some(huge) = &slot.huge {
            let main_stats = serde_json::to_value(pool.stats()).map_err(|e| format!("umm_stats_json: {e}"))?;
            let huge_stats = serde_json::to_value(huge.stats()).map_err(|e| format!("umm_stats_json: {e}"))?;
            map.insert("pools".into(), serde_json::json!({"main": main_stats, "huge": huge_stats}));
        }
        map.insert("graph_pools".into(), slot.graph_pools().len().into());
        map.insert("captures_underway".into(), slot.captures.load(std::sync::atomic::Ordering::Relaxed).into());
        if reg.simulated {
            // The device's pools share its streams, and so their log: any one of them has the device's count.
            let pools = slot.pools();
            let violations = pools.iter().find_map(|p| p.simulated()).map_or(0, |s| s.stream_log().capture_violations);
            map.insert("capture_violations".into(), violations.into());
        }
        map.insert("hit_rate".into(), stats.hit_rate().into());
        map.insert("fragmentation_ratio".into(), stats.fragmentation_ratio().into());
    }
    Ok(value.to_string())
}

/// The memory of `device` (or every device for -1) in the shape of PyTorch's `torch.cuda.memory._snapshot()`:
/// `segments`, each with its `blocks`, and `device_traces` (one list per device, see [`record_history`]), so
/// that PyTorch's memory visualizer draws it. A virtual reservation shows as one expandable segment of its
/// mapped bytes: its live blocks, then its mapped free bytes as one inactive block, so that every segment's
/// size adds up to the reserved bytes of the statistics and its active blocks to the allocated bytes.
pub(crate) fn snapshot_json(device: i64) -> Result<String, String> {
    snapshot_value(device).map(|value| value.to_string())
}

/// [`snapshot_json`]'s value, before it is written out (`umm_snapshot_visit` reads it as it is).
pub(crate) fn snapshot_value(device: i64) -> Result<serde_json::Value, String> {
    let reg = registry();
    let targets = reg.targets(device).map_err(|e| format!("umm_snapshot_json: {e}"))?;
    // Requested bytes of live blocks by (pool, block key).
    let requested: std::collections::HashMap<(usize, u64), u64> = reg
        .live
        .lock()
        .values()
        .filter_map(|l| Some(((pool_id(live_pool(reg, l).ok()?), l.block.key()), l.requested)))
        .collect();
    let mut segments = Vec::new();
    for (slot, _) in &targets {
        let index = reg.devices.iter().position(|s| std::ptr::eq(s, *slot)).expect("a slot of the registry");
        for pool in slot.pools() {
            for segment in pool.snapshot().segments {
                segments.push(segment_json(index, pool_id(&pool), &segment, &requested));
            }
        }
    }
    let devices = reg.devices.len();
    let value = serde_json::json!({
        "segments": segments,
        "device_traces": history::events(devices),
        "allocator_settings": {"allocator": "umm", "simulated": reg.simulated, "huge_pool_min_bytes": reg.huge_min},
    });
    Ok(value)
}

/// What names a pool in [`snapshot_json`]'s table of requested sizes: its address.
fn pool_id(pool: &SharedPool) -> usize {
    Arc::as_ptr(pool) as *const () as usize
}

/// One segment of [`snapshot_json`].
fn segment_json(
    device: usize,
    pool: usize,
    segment: &umm_backends::SegmentSnapshot,
    requested: &std::collections::HashMap<(usize, u64), u64>,
) -> serde_json::Value {
    let base = segment.address.unwrap_or(0);
    let mut blocks = Vec::new();
    let (mut allocated, mut requested_total, mut free_mapped, mut first_free) = (0, 0, 0, None);
    for block in &segment.blocks {
        let address = base + block.offset;
        if block.free {
            first_free.get_or_insert(address);
            free_mapped += block.size;
            if !segment.virtual_reservation {
                blocks.push(serde_json::json!({
                    "address": address, "size": block.size, "requested_size": 0, "state": "inactive", "frames": [],
                }));
            }
            continue;
        }
        // A block of the pool's own (a stitched range's piece, a plan) has no live pointer: its size stands.
        let asked = block.key.and_then(|k| requested.get(&(pool, k)).copied()).unwrap_or(block.size);
        allocated += block.size;
        requested_total += asked;
        blocks.push(serde_json::json!({
            "address": address, "size": block.size, "requested_size": asked, "state": "active_allocated",
            "frames": [],
        }));
    }
    let total = if segment.virtual_reservation { segment.physical_bytes } else { segment.size };
    if segment.virtual_reservation {
        // Mapped free bytes; the rest of a free run is unmapped address space, which holds no memory.
        let mapped_free = total.saturating_sub(allocated).min(free_mapped);
        if mapped_free > 0 {
            blocks.push(serde_json::json!({
                "address": first_free.unwrap_or(base), "size": mapped_free, "requested_size": 0,
                "state": "inactive", "frames": [],
            }));
        }
    }
    serde_json::json!({
        "device": device,
        "address": base,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": requested_total,
        "stream": segment.stream.0,
        "segment_type": if segment.class == "small" { "small" } else { "large" },
        "segment_pool_id": [0, 0],
        "is_expandable": segment.virtual_reservation,
        "frames": [],
        "blocks": blocks,
    })
}
