//! Private pools of CUDA graph captures, and the capture-safe mode of a device's pools.
//!
//! A captured graph bakes in the addresses its kernels used, and every replay writes there again. So memory
//! allocated during a capture must never serve anything else while the graph may still replay, even after its
//! tensors were freed at the end of the capture. As PyTorch's caching allocator does, each capture allocates
//! from a pool of its own ([`PoolId`], PyTorch's `MempoolId_t`): a block freed there goes back to that pool,
//! where only later allocations into the same pool (the same graph, or graphs that share the pool) find it. The
//! pool lives while it is retained (`umm_pool_retain`: each capture and each `torch.cuda.MemPool` holds it once)
//! and, once released as often, until its last block is freed; then its memory goes back to the device.
//!
//! While a capture is underway on a device (`umm_capture_begin` .. `umm_capture_end`) every pool of the device
//! takes only paths the driver allows during a capture (see `umm_backends::Pool::begin_capture`), and device
//! calls that may grow a pool are made in the driver's relaxed capture mode.

use crate::registry::{Purpose, SharedPool, Slot};
use std::sync::atomic::Ordering;

/// A private pool's name: PyTorch's `MempoolId_t`, a pair of integers (`{0, n}` for pools made by graphs,
/// `{n, 0}` for pools made by users).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolId {
    /// PyTorch's `MempoolId_t.first`: non-zero for a pool a user made.
    pub first: u64,
    /// PyTorch's `MempoolId_t.second`: non-zero for a pool a graph made.
    pub second: u64,
}

impl std::fmt::Display for PoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}, {})", self.first, self.second)
    }
}

/// One private pool of a device.
pub(crate) struct GraphPool {
    pub(crate) id: PoolId,
    pub(crate) pool: SharedPool,
    /// Holders: captures begun into it and pools a user made, less releases.
    uses: u32,
}

impl Slot {
    /// Retains the private pool `id`, making it on first use. Returns its use count after the retain.
    pub(crate) fn retain_graph_pool(&self, id: PoolId) -> Result<u32, String> {
        if let Some(entry) = self.graphs.lock().iter_mut().find(|g| g.id == id) {
            entry.uses += 1;
            return Ok(entry.uses);
        }
        let make = self.make_pool.as_ref().ok_or_else(|| format!("device {} has no pools", self.name))?;
        // Made under the capture lock, so that a capture that begins meanwhile finds the pool in the list.
        let _capture = self.capture_lock.lock();
        let mut graphs = self.graphs.lock();
        if let Some(entry) = graphs.iter_mut().find(|g| g.id == id) {
            entry.uses += 1;
            return Ok(entry.uses);
        }
        let pool = make(Purpose::Graph(id), self.next_pool_number())?;
        for _ in 0..self.captures.load(Ordering::SeqCst) {
            pool.begin_capture();
        }
        graphs.push(GraphPool { id, pool, uses: 1 });
        Ok(1)
    }

    /// The private pool `id` for an allocation: it must be retained.
    pub(crate) fn graph_pool(&self, id: PoolId) -> Result<SharedPool, String> {
        match self.graphs.lock().iter().find(|g| g.id == id) {
            Some(entry) if entry.uses > 0 => Ok(SharedPool::clone(&entry.pool)),
            Some(_) => Err(format!("private pool {id} was released: retain it before allocating into it")),
            None => Err(format!("no private pool {id} on device {}: retain it first (umm_pool_retain)", self.name)),
        }
    }

    /// The private pool `id`, retained or not.
    fn graph_pool_any(&self, id: PoolId) -> Option<SharedPool> {
        self.graphs.lock().iter().find(|g| g.id == id).map(|g| SharedPool::clone(&g.pool))
    }

    /// Releases the private pool `id` once. At no use left, its memory goes back to the device as soon as no
    /// block of it is live. Returns the use count after the release.
    pub(crate) fn release_graph_pool(&self, id: PoolId) -> Result<u32, String> {
        let uses = {
            let mut graphs = self.graphs.lock();
            let entry = graphs
                .iter_mut()
                .find(|g| g.id == id && g.uses > 0)
                .ok_or_else(|| format!("no retained private pool {id} on device {}", self.name))?;
            entry.uses -= 1;
            entry.uses
        };
        if uses == 0 {
            self.drop_graph_pool_if_unused(|g| g.id == id);
        }
        Ok(uses)
    }

    /// The use count of private pool `id` (0 for a pool that does not exist or was released).
    pub(crate) fn graph_pool_uses(&self, id: PoolId) -> u32 {
        self.graphs.lock().iter().find(|g| g.id == id).map_or(0, |g| g.uses)
    }

    /// Drops the private pool `matching` picks, its memory given back, once it has no use and no live block.
    /// Called when it is released and when one of its blocks is freed.
    pub(crate) fn drop_graph_pool_if_unused(&self, matching: impl Fn(&GraphPool) -> bool) {
        let mut graphs = self.graphs.lock();
        let Some(index) = graphs.iter().position(matching) else { return };
        if graphs[index].uses > 0 || graphs[index].pool.live_blocks() > 0 {
            return;
        }
        // Memory is given back only outside captures: the driver refuses the waits it takes during one. The pool
        // then stays listed, empty, and goes with the next release or free after the capture.
        if self.captures.load(Ordering::SeqCst) > 0 {
            return;
        }
        let entry = graphs.swap_remove(index);
        drop(graphs);
        entry.pool.release_cached();
    }

    /// The private pools now.
    pub(crate) fn graph_pools(&self) -> Vec<SharedPool> {
        self.graphs.lock().iter().map(|g| SharedPool::clone(&g.pool)).collect()
    }

    /// A capture began on this device: every pool takes capture-safe paths until the matching end.
    pub(crate) fn begin_capture(&self) {
        let _capture = self.capture_lock.lock();
        self.captures.fetch_add(1, Ordering::SeqCst);
        self.pools().iter().for_each(|p| p.begin_capture());
    }

    /// A capture ended on this device. Refused without a capture underway.
    pub(crate) fn end_capture(&self) -> Result<(), String> {
        let _capture = self.capture_lock.lock();
        self.captures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map_err(|_| format!("no capture is underway on device {}", self.name))?;
        let mut first_error = None;
        for pool in self.pools() {
            if let Err(e) = pool.end_capture() {
                first_error.get_or_insert(e.to_string());
            }
        }
        if self.captures.load(Ordering::SeqCst) == 0 {
            // Pools released during the capture whose blocks are all free go now.
            let unused: Vec<PoolId> = self.graphs.lock().iter().filter(|g| g.uses == 0).map(|g| g.id).collect();
            unused.into_iter().for_each(|id| self.drop_graph_pool_if_unused(|g| g.id == id));
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Whether a capture is underway on this device: one atomic load.
    #[inline(always)]
    pub(crate) fn capturing(&self) -> bool {
        self.captures.load(Ordering::Relaxed) > 0
    }
}

/// The slot of `device`, with a message naming `what` where it has no pools.
pub(crate) fn slot(what: &str, device: i64) -> Result<&'static Slot, String> {
    crate::registry::registry().pool(device).map(|(slot, _)| slot).map_err(|e| format!("{what}: {e}"))
}

/// `umm_pool_retain`: the use count after the retain.
pub(crate) fn retain(device: i64, id: PoolId) -> Result<u32, String> {
    slot("umm_pool_retain", device)?.retain_graph_pool(id).map_err(|e| format!("umm_pool_retain: {e}"))
}

/// `umm_pool_release`: the use count after the release.
pub(crate) fn release(device: i64, id: PoolId) -> Result<u32, String> {
    slot("umm_pool_release", device)?.release_graph_pool(id).map_err(|e| format!("umm_pool_release: {e}"))
}

/// `umm_pool_use_count`.
pub(crate) fn use_count(device: i64, id: PoolId) -> Result<u32, String> {
    Ok(slot("umm_pool_use_count", device)?.graph_pool_uses(id))
}

/// `umm_capture_begin`.
pub(crate) fn capture_begin(device: i64) -> Result<(), String> {
    slot("umm_capture_begin", device)?.begin_capture();
    Ok(())
}

/// `umm_capture_end`.
pub(crate) fn capture_end(device: i64) -> Result<(), String> {
    let _scope = umm_backends::cuda::ContextScope::enter_saving();
    slot("umm_capture_end", device)?.end_capture().map_err(|e| format!("umm_capture_end: {e}"))
}

/// `umm_sim_capture`: tells every simulated pool of `device` that `stream` captures (or stopped), as the CUDA
/// driver would know it. Refused on a real device, whose driver knows.
pub(crate) fn simulate_capture(device: i64, stream: umm_backends::StreamId, capturing: bool) -> Result<(), String> {
    let slot = slot("umm_sim_capture", device)?;
    let pools = slot.pools();
    if pools.iter().any(|p| p.simulated().is_none()) {
        return Err(format!("umm_sim_capture: device {device} is not simulated (UMM_CAPI_SIM)"));
    }
    for pool in pools {
        let sim = pool.simulated().expect("checked above");
        if capturing {
            sim.begin_capture(stream);
        } else {
            sim.end_capture(stream);
        }
    }
    Ok(())
}

/// `umm_pool_live`: the addresses of the live blocks of private pool `id` on `device`, in no order.
pub(crate) fn live_blocks(device: i64, id: PoolId) -> Result<Vec<u64>, String> {
    let Some(pool) = slot("umm_pool_live", device)?.graph_pool_any(id) else { return Ok(Vec::new()) };
    let live = crate::registry::registry().live.lock();
    let ours = |l: &crate::registry::Live| l.tagged.as_ref().is_some_and(|t| std::sync::Arc::ptr_eq(t, &pool));
    Ok(live.iter().filter(|(_, l)| l.device as i64 == device && ours(l)).map(|(&p, _)| p).collect())
}
