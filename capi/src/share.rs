//! Blocks shared with other processes through the C ABI: `umm_ipc_handle` gives a live block's handle in umm's
//! byte format ([`cuda::IpcHandle::to_bytes`]), `umm_ipc_open` maps one in this process and `umm_ipc_close`
//! unmaps it.
//!
//! A handle of pages names file descriptors that must stay open until the receiver has copied them; they are
//! kept here with the handle until the block is freed ([`forget`], from the free path, which looks here only
//! once something was shared).

use crate::registry::{live_pool, registry, SharedPool};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::LazyLock;
use umm_backends::cuda::ContextScope;
use umm_backends::cuda::{ImportedMemory, IpcHandle};
use umm_backends::BlockHandle;

/// Handles of live blocks by address, with the block each is of (an address is handed out again once freed),
/// kept so that their descriptors stay open while the blocks live.
static EXPORTS: LazyLock<Mutex<HashMap<u64, (BlockHandle, IpcHandle)>>> = LazyLock::new(Default::default);
/// Whether anything was ever exported: until then a free does not look at [`EXPORTS`].
static EXPORTED: AtomicBool = AtomicBool::new(false);
/// Blocks of other processes mapped here, by the address `umm_ipc_open` returned.
static IMPORTS: LazyLock<Mutex<HashMap<u64, ImportedMemory>>> = LazyLock::new(Default::default);

/// The bytes of the handle of the live block at `ptr` (the same bytes each time while the block lives).
pub(crate) fn handle_bytes(ptr: u64) -> Result<Vec<u8>, String> {
    let unknown = || format!("umm_ipc_handle: {ptr:#x} is not a live block of umm");
    let reg = crate::registry::initialized().ok_or_else(unknown)?;
    let (pool, block): (SharedPool, _) = {
        let live = reg.live.lock();
        let entry = live.get(&ptr).ok_or_else(unknown)?;
        (SharedPool::clone(live_pool(reg, entry)?), entry.block.clone())
    };
    let mut exports = EXPORTS.lock();
    if let Some((_, handle)) = exports.get(&ptr).filter(|(of, _)| *of == block) {
        return Ok(handle.to_bytes());
    }
    let cuda = pool.cuda().ok_or_else(|| {
        format!("umm_ipc_handle: {ptr:#x} lies on a simulated device, whose memory no other process can reach")
    })?;
    let _scope = ContextScope::enter();
    let handle = cuda.export(&block).map_err(|e| format!("umm_ipc_handle: {e}"))?;
    let bytes = handle.to_bytes();
    if handle.is_pages() {
        EXPORTED.store(true, Ordering::Release);
        // A free that removed the block from the live map before this lock was taken found nothing to forget:
        // keep the descriptors only if the block is still live (a later free forgets them, under this lock).
        if reg.live.lock().get(&ptr).is_some_and(|entry| entry.block == block) {
            exports.insert(ptr, (block, handle));
        } else {
            return Err(unknown());
        }
    }
    Ok(bytes)
}

/// Closes the descriptors shared for `block` at `ptr`, which is being freed (not those of a later block at the
/// same address). One atomic load until a block was shared.
#[inline(always)]
pub(crate) fn forget(ptr: u64, block: &BlockHandle) {
    if EXPORTED.load(Ordering::Acquire) {
        let mut exports = EXPORTS.lock();
        if exports.get(&ptr).is_some_and(|(of, _)| of == block) {
            exports.remove(&ptr);
        }
    }
}

/// Maps the block of another process whose handle's bytes are `bytes` on `device`; returns its address here.
pub(crate) fn open(device: i64, bytes: &[u8]) -> Result<u64, String> {
    let (_, pool) = registry().pool(device).map_err(|e| format!("umm_ipc_open: {e}"))?;
    let cuda = pool
        .cuda()
        .ok_or_else(|| format!("umm_ipc_open: device {device} is simulated; it cannot map another process's memory"))?;
    let _scope = ContextScope::enter();
    let imported = cuda.import(bytes).map_err(|e| format!("umm_ipc_open: {e}"))?;
    let ptr = imported.device_ptr();
    IMPORTS.lock().insert(ptr, imported);
    Ok(ptr)
}

/// Unmaps a block `open` mapped.
pub(crate) fn close(ptr: u64) -> Result<(), String> {
    let imported = IMPORTS
        .lock()
        .remove(&ptr)
        .ok_or_else(|| format!("umm_ipc_close: {ptr:#x} is not a block umm_ipc_open mapped (or it was closed)"))?;
    let _scope = ContextScope::enter();
    drop(imported);
    Ok(())
}
