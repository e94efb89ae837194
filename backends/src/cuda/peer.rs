//! Peer access between the contexts of two devices (`cuCtxEnablePeerAccess`; NVLink or PCIe P2P): enabled both
//! ways once per pair before the first peer copy between them, and on request for memory made outside umm.

use super::raw;
use crate::{Error, Result};
use cudarc::driver::CudaContext;
use parking_lot::Mutex;
use std::sync::Arc;

/// Pairs of contexts (as addresses) for which peer access has been tried, whatever the outcome.
static PEER_TRIED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Enables peer access from each of two contexts (with the names logs give them) to the other, once per pair.
/// Failures only cost speed: they are logged and the copy goes on without direct access (the driver stages it).
pub(super) fn enable_peer_access_once(a: (&str, &Arc<CudaContext>), b: (&str, &Arc<CudaContext>)) {
    let key = (a.1.cu_ctx() as usize, b.1.cu_ctx() as usize);
    let mut tried = PEER_TRIED.lock();
    if tried.contains(&key) {
        return;
    }
    tried.push(key);
    tried.push((key.1, key.0));
    for ((this, from), (peer, to)) in [(a, b), (b, a)] {
        match enable_peer_access(from, to) {
            Ok(true) => log::debug!("peer access enabled from {this} to {peer}"),
            Ok(false) => log::info!("{this} cannot access {peer} directly: peer copies are staged"),
            Err(e) => log::warn!("enabling peer access from {this} to {peer}: {e}"),
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
pub fn enable_peer_access(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<bool> {
    let driver = |call: &str, message: String| Error::Driver {
        backend: format!("cuda:{}", from.ordinal()),
        call: call.into(),
        message,
    };
    super::scope::before_bind();
    from.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e.to_string()))?;
    raw::enable_peer_access(to).map_err(|f| driver(f.call, f.message()))
}
