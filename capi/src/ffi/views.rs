//! Statistics, snapshots and recorded events as C structures (declared in `capi/include/umm.h`), for callers that
//! fill their own types from them (PyTorch's `DeviceStats` and `SnapshotInfo` in the `umm_torch` adapter)
//! without parsing JSON.

use super::guarded;
use crate::registry::registry;
use std::ffi::{c_int, c_void};

/// A figure now and at its peak.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UmmStat {
    /// Value now.
    pub current: u64,
    /// Highest value since the start or the last `umm_reset_peaks`.
    pub peak: u64,
}

impl From<umm_backends::Stat> for UmmStat {
    fn from(s: umm_backends::Stat) -> Self {
        UmmStat { current: s.current, peak: s.peak }
    }
}

/// One device's statistics: those of `umm_stats_json`, as a structure.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UmmStats {
    /// Bytes of live blocks (rounded as handed out).
    pub allocated_bytes: UmmStat,
    /// Bytes asked for by live allocations.
    pub requested_bytes: UmmStat,
    /// Bytes held from the device.
    pub reserved_bytes: UmmStat,
    /// Bytes of live blocks and of freed blocks not yet reusable.
    pub active_bytes: UmmStat,
    /// Free bytes inside segments that hold live blocks.
    pub inactive_split_bytes: UmmStat,
    /// Live blocks.
    pub active_blocks: UmmStat,
    /// Segments (plain segments and virtual reservations).
    pub segments: UmmStat,
    /// Allocations served so far.
    pub num_allocs: u64,
    /// Frees so far.
    pub num_frees: u64,
    /// Device allocations (segments made, pages mapped).
    pub num_device_alloc: u64,
    /// Device frees.
    pub num_device_free: u64,
    /// Allocations retried after giving cached memory back.
    pub num_alloc_retries: u64,
    /// Allocations that failed for lack of memory.
    pub num_ooms: u64,
    /// The cap on reserved bytes (0: none).
    pub limit_bytes: u64,
    /// The device's memory.
    pub device_total_bytes: u64,
}

/// Fills `*out` with the statistics of `device` (every pool of it together, as `umm_stats_json`). 0, or -1 with
/// a message (no such device, or `out` is NULL).
///
/// # Safety
/// `out` is NULL or points to writable memory for one `umm_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn umm_stats(device: c_int, out: *mut UmmStats) -> c_int {
    guarded("umm_stats", -1, || {
        let reg = registry();
        let (slot, pool) = reg.pool(i64::from(device)).map_err(|e| format!("umm_stats: {e}"))?;
        let s = slot.stats(pool.as_ref());
        let stats = UmmStats {
            allocated_bytes: s.allocated_bytes.into(),
            requested_bytes: s.requested_bytes.into(),
            reserved_bytes: s.reserved_bytes.into(),
            active_bytes: s.active_bytes.into(),
            inactive_split_bytes: s.inactive_split_bytes.into(),
            active_blocks: s.active_blocks.into(),
            segments: s.segments.into(),
            num_allocs: s.num_allocs,
            num_frees: s.num_frees,
            num_device_alloc: s.num_device_alloc,
            num_device_free: s.num_device_free,
            num_alloc_retries: s.num_alloc_retries,
            num_ooms: s.num_ooms,
            limit_bytes: s.limit_bytes.unwrap_or(0),
            device_total_bytes: slot.total_bytes,
        };
        // SAFETY: the caller's contract: NULL or writable for one structure.
        let out = unsafe { out.as_mut() }.ok_or("umm_stats: out is NULL")?;
        *out = stats;
        Ok(0)
    })
}

/// One block of a [`UmmSegmentInfo`].
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UmmBlockInfo {
    /// Device address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for (0 for free memory).
    pub requested_size: u64,
    /// 1: handed out; 0: free (cached).
    pub allocated: c_int,
}

/// One segment, as PyTorch's snapshot lists it (see `umm_snapshot_json`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct UmmSegmentInfo {
    /// Device ordinal.
    pub device: c_int,
    /// 1: a virtual reservation (PyTorch's expandable segment), its mapped bytes; 0: a plain segment.
    pub expandable: c_int,
    /// First address.
    pub address: u64,
    /// Bytes of memory it holds.
    pub total_size: u64,
    /// Bytes of its live blocks.
    pub allocated_size: u64,
    /// Bytes asked for by its live blocks.
    pub requested_size: u64,
    /// The stream of its arena.
    pub stream: u64,
    /// Its blocks, `num_blocks` of them, valid during the visit only.
    pub blocks: *const UmmBlockInfo,
    /// How many blocks.
    pub num_blocks: usize,
}

/// One recorded event (see `umm_record_history`), its action numbered as PyTorch's `TraceEntry::Action`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UmmTraceEntry {
    /// Device ordinal.
    pub device: c_int,
    /// 0 alloc, 1 free_requested, 2 free_completed, 3 segment_alloc, 4 segment_free, 5 segment_map,
    /// 6 segment_unmap, 8 oom.
    pub action: c_int,
    /// Address (for an out-of-memory: the device's free bytes, as PyTorch records it).
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
}

/// A visitor of segments: called once per segment with the caller's context.
pub type SegmentVisitor = unsafe extern "C" fn(ctx: *mut c_void, segment: *const UmmSegmentInfo);
/// A visitor of recorded events.
pub type TraceVisitor = unsafe extern "C" fn(ctx: *mut c_void, entry: *const UmmTraceEntry);

fn number(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or(0)
}

/// Calls `segment` for every segment of `device` (-1: every device), then `trace` (when not NULL) for every
/// event recorded since `umm_record_history`, oldest first: what `umm_snapshot_json` holds, without writing or reading JSON. 0, or
/// -1 with a message.
///
/// # Safety
/// `segment` and `trace` are NULL or functions that may be called with `ctx` during this call; they must not
/// call into umm.
#[no_mangle]
pub unsafe extern "C" fn umm_snapshot_visit(
    device: c_int,
    segment: Option<SegmentVisitor>,
    trace: Option<TraceVisitor>,
    ctx: *mut c_void,
) -> c_int {
    guarded("umm_snapshot_visit", -1, || {
        let value = crate::snapshot::snapshot_value(i64::from(device))?;
        if let Some(visit) = segment {
            for s in value["segments"].as_array().into_iter().flatten() {
                let blocks: Vec<UmmBlockInfo> = s["blocks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|b| UmmBlockInfo {
                        address: number(b, "address"),
                        size: number(b, "size"),
                        requested_size: number(b, "requested_size"),
                        allocated: c_int::from(b["state"] == "active_allocated"),
                    })
                    .collect();
                let info = UmmSegmentInfo {
                    device: number(s, "device") as c_int,
                    expandable: c_int::from(s["is_expandable"] == true),
                    address: number(s, "address"),
                    total_size: number(s, "total_size"),
                    allocated_size: number(s, "allocated_size"),
                    requested_size: number(s, "requested_size"),
                    stream: number(s, "stream"),
                    blocks: blocks.as_ptr(),
                    num_blocks: blocks.len(),
                };
                // SAFETY: the caller's contract; `info` and its blocks live across the call.
                unsafe { visit(ctx, &info) };
            }
        }
        if let Some(visit) = trace {
            for (d, events) in value["device_traces"].as_array().into_iter().flatten().enumerate() {
                if device >= 0 && d != device as usize {
                    continue;
                }
                for e in events.as_array().into_iter().flatten() {
                    let action = match e["action"].as_str().unwrap_or("") {
                        "alloc" => 0,
                        "free_requested" => 1,
                        "free_completed" => 2,
                        "segment_alloc" => 3,
                        "segment_free" => 4,
                        "segment_map" => 5,
                        "segment_unmap" => 6,
                        _ => 8,
                    };
                    let oom = action == 8;
                    let entry = UmmTraceEntry {
                        device: d as c_int,
                        action,
                        addr: if oom { number(e, "device_free") } else { number(e, "addr") },
                        size: number(e, "size"),
                        stream: number(e, "stream"),
                        time_us: number(e, "time_us"),
                    };
                    // SAFETY: the caller's contract; `entry` lives across the call.
                    unsafe { visit(ctx, &entry) };
                }
            }
        }
        Ok(0)
    })
}

/// The base of the memory that holds `ptr`, a live block of umm: its segment's first address (a virtual
/// reservation's for a block in one), with the segment's size in `*size` when `size` is not NULL. NULL with a
/// message for an address umm did not hand out.
///
/// # Safety
/// `size` is NULL or writable for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn umm_base_allocation(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    guarded("umm_base_allocation", std::ptr::null_mut(), || {
        let (base, bytes) = crate::registry::base_allocation(ptr as usize as u64)?;
        // SAFETY: the caller's contract.
        if let Some(out) = unsafe { size.as_mut() } {
            *out = bytes as usize;
        }
        Ok(base as usize as *mut c_void)
    })
}
