//! Page-locked host memory for the bytes of a sleeping pool's pages ([`crate::Pool::sleep`]): device-to-host and
//! host-to-device copies run at the link's full speed only from and into page-locked memory.

use super::raw;
use crate::StoreBytes;
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// `len` bytes of `cuMemHostAlloc` memory, freed when dropped.
pub(super) struct PinnedBytes {
    host: usize,
    len: usize,
    /// The context the memory was made in, bound again to free it.
    ctx: Arc<CudaContext>,
}

impl PinnedBytes {
    /// Page-locked memory for `len` bytes (at least one byte is asked of the driver). The caller bound `ctx`.
    pub(super) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, raw::Failure> {
        let (host, _) = raw::host_alloc(len.max(1) as u64)?;
        Ok(Self { host, len, ctx: Arc::clone(ctx) })
    }
}

impl StoreBytes for PinnedBytes {
    #[allow(unsafe_code)] // Discharges `raw::host_slice`'s contract.
    fn bytes(&self) -> &[u8] {
        // SAFETY: `host` is this value's live allocation of at least `len` bytes, freed only on drop; the device
        // touches it only through the pool's blocking copies (`Backend::read` and `Backend::restore`), which have
        // returned before any slice is taken.
        unsafe { raw::host_slice(self, self.host, self.len) }
    }

    #[allow(unsafe_code)] // Discharges `raw::host_slice_mut`'s contract.
    fn bytes_mut(&mut self) -> &mut [u8] {
        let (host, len) = (self.host, self.len);
        // SAFETY: as in `bytes`; `self` is borrowed mutably, so this is the only slice.
        unsafe { raw::host_slice_mut(self, host, len) }
    }
}

impl Drop for PinnedBytes {
    #[allow(unsafe_code)] // Discharges `raw::host_free`'s contract.
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            log::error!("freeing {} bytes of pinned host memory: binding the context failed: {e}", self.len);
            return;
        }
        // SAFETY: `host` came from `raw::host_alloc` and is freed once, here; the blocking copies that used it
        // have returned, and no slice of it outlives `self`.
        if let Err(f) = unsafe { raw::host_free(self.host) } {
            log::error!("freeing {} bytes of pinned host memory: {}", self.len, f.message());
        }
    }
}
