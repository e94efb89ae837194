//! Device copies between blocks of two CUDA pools, for migrating buffers without touching the host: within one
//! context a plain copy (cuMemcpy: unified addressing covers device and pinned memory), between two devices
//! `cuMemcpyPeer`, after enabling peer access both ways once per pair of contexts where the devices allow it
//! (NVLink or PCIe P2P; otherwise the driver stages the copy itself).

use super::backend::CudaBackend;
use super::{interop, raw};
use crate::{Backend, BlockHandle, DevicePath, Error, Pool, PoolKind, Result};
use parking_lot::Mutex;

/// Pairs of contexts (as addresses) for which peer access has been tried, whatever the outcome.
static PEER_TRIED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Copies the first `len` bytes of `src_block` (of `src`) to `dst_block` (of `dst`) on the device(s) and waits
/// for the copy. The pools may belong to one device or to two. Waits for all work queued in the source context
/// first, so the copy sees what kernels wrote. Read-only destinations are refused (they are filled once, at
/// allocation); `len` must lie inside both blocks. Pinned blocks are refused: the copy runs without the pools'
/// locks, so through a plain handle it could land after the block was freed and its memory lent to an owner as
/// a host slice; owned blocks copy with [`crate::OwnedBlock::copy_on_device_from`].
pub fn copy_block(
    src: &Pool<CudaBackend>,
    src_block: &BlockHandle,
    dst: &Pool<CudaBackend>,
    dst_block: &BlockHandle,
    len: u64,
) -> Result<()> {
    for pool in [src, dst] {
        if pool.backend().placement() == PoolKind::HostPinned {
            return Err(Error::Unsupported {
                backend: pool.backend().name().to_string(),
                what: "a device copy of pinned memory through a plain handle: use an owned block".into(),
            });
        }
    }
    copy_live_blocks(src, src_block, dst, dst_block, len)
}

/// [`copy_block`] without its refusal of pinned blocks.
#[allow(unsafe_code)] // Discharges `copy_between`'s contract.
fn copy_live_blocks(
    src: &Pool<CudaBackend>,
    src_block: &BlockHandle,
    dst: &Pool<CudaBackend>,
    dst_block: &BlockHandle,
    len: u64,
) -> Result<()> {
    let to = dst.backend();
    if to.placement() == PoolKind::ReadOnly {
        return Err(Error::Unsupported {
            backend: to.name().to_string(),
            what: "a device copy into read-only memory: it is filled once, when it is allocated".into(),
        });
    }
    let (src_ptr, _) = interop::range(src, src_block, 0, len)?;
    let (dst_ptr, _) = interop::range(dst, dst_block, 0, len)?;
    // SAFETY: `interop::range` put `[src_ptr, src_ptr + len)` inside the live `src_block` and
    // `[dst_ptr, dst_ptr + len)` inside the live `dst_block` (it looked them up in their pools); neither is pinned
    // memory (`copy_block` refused it), and device memory is never lent as a host slice.
    unsafe { copy_between(src.backend(), src_ptr, to, dst_ptr, len) }.map(drop)
}

/// Copies `len` bytes from `src_ptr` (memory of `from`'s context) to `dst_ptr` (memory of `to`'s) and waits:
/// within one context a plain copy, between two a peer copy after enabling peer access once per pair. Waits for
/// all work queued in the source context first, so the copy sees what kernels wrote. Returns the path taken.
///
/// # Safety
/// `[src_ptr, src_ptr + len)` lies in live memory of `from`'s context and `[dst_ptr, dst_ptr + len)` in live
/// memory of `to`'s, and no host slice of either range is in use for the call.
#[allow(unsafe_code)] // Discharges `raw::copy`'s and `raw::copy_peer`'s contracts.
pub(super) unsafe fn copy_between(
    from: &CudaBackend,
    src_ptr: u64,
    to: &CudaBackend,
    dst_ptr: u64,
    len: u64,
) -> Result<DevicePath> {
    let (src_ctx, dst_ctx) = (from.context(), to.context());
    let same_context = src_ctx.cu_ctx() == dst_ctx.cu_ctx();
    let path = if same_context { DevicePath::CudaDevice } else { DevicePath::CudaPeer };
    if len == 0 {
        return Ok(path);
    }
    from.synchronize()?;
    if same_context {
        // SAFETY: the caller's contract; both ranges are of the context that `synchronize` bound.
        unsafe { raw::copy(dst_ptr, src_ptr, len) }.map_err(|f| to.error(f))?;
        raw::ctx_synchronize().map_err(|f| to.error(f))?;
        return Ok(path);
    }
    to.synchronize()?;
    enable_peer_access_once(from, to);
    to.bind()?;
    // SAFETY: the caller's contract; the source range is of `src_ctx`, the destination's of `dst_ctx`.
    unsafe { raw::copy_peer(dst_ptr, dst_ctx, src_ptr, src_ctx, len) }.map_err(|f| to.error(f))?;
    raw::ctx_synchronize().map_err(|f| to.error(f))?;
    Ok(path)
}

/// Enables peer access from each context to the other, once per pair. Failures only cost speed: they are
/// logged and the copy goes on without direct access.
fn enable_peer_access_once(a: &CudaBackend, b: &CudaBackend) {
    let key = (a.context().cu_ctx() as usize, b.context().cu_ctx() as usize);
    let mut tried = PEER_TRIED.lock();
    if tried.contains(&key) {
        return;
    }
    tried.push(key);
    tried.push((key.1, key.0));
    for (this, peer) in [(a, b), (b, a)] {
        let outcome = this.bind().and_then(|()| raw::enable_peer_access(peer.context()).map_err(|f| this.error(f)));
        match outcome {
            Ok(true) => log::debug!("peer access enabled from {} to {}", this.name(), peer.name()),
            Ok(false) => log::info!("{} cannot access {} directly: peer copies are staged", this.name(), peer.name()),
            Err(e) => log::warn!("enabling peer access from {} to {}: {e}", this.name(), peer.name()),
        }
    }
}

/// Lets `from`'s context read and write `to`'s memory directly (`cuCtxEnablePeerAccess`; NVLink or PCIe P2P).
/// Returns whether access is enabled now: `false` where the devices cannot reach each other. Enabling access
/// that is already enabled is not an error. Pools do this themselves before their first peer copy, and grant
/// peers access to their virtual reservations' pages; this is for memory made outside umm (cudarc's own
/// allocations).
///
/// # Errors
/// [`Error::Driver`] when binding `from` or the driver call fails for another reason.
pub fn enable_peer_access(
    from: &std::sync::Arc<cudarc::driver::CudaContext>,
    to: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> Result<bool> {
    let driver = |call: &str, message: String| Error::Driver {
        backend: format!("cuda:{}", from.ordinal()),
        call: call.into(),
        message,
    };
    super::scope::before_bind();
    from.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e.to_string()))?;
    raw::enable_peer_access(to).map_err(|f| driver(f.call, f.message()))
}
