//! Stream-ordered uploads from pinned staging into device memory, for overlapping transfers with kernels: the
//! copy is queued on a stream of the caller's (a copy stream), and the caller records an event after it
//! (`stream.record_event`) that the compute stream waits on (`compute.wait(&event)`), or that the host waits on.
//!
//! [`PinnedUploadBaseline`] is the same driver call on raw allocations, outside any pool: what benchmarks compare
//! pooled uploads against.

use super::backend::CudaBackend;
use super::{raw, CudaDevice, CudaPool};
use crate::{Backend, Error, MemoryPool, OwnedBlock, PoolKind, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The CUDA pool of an owned block, or why it has none.
fn cuda_pool<'a>(block: &'a OwnedBlock, role: &str) -> Result<&'a CudaPool> {
    let pool = block.pool();
    pool.as_any().downcast_ref::<CudaPool>().ok_or_else(|| Error::Unsupported {
        backend: pool.name().to_string(),
        what: format!("a CUDA upload whose {role} is not CUDA memory"),
    })
}

/// Queues copying the first `len` bytes of `src` (pinned host memory of a CUDA pool) into `dst` (device memory
/// of a CUDA pool of the same context) on `stream` with `cuMemcpyHtoDAsync`, and returns at once; the copy runs
/// while the host and other streams go on. Both blocks are marked as used on `stream`
/// ([`CudaPool::record_stream`]), so freeing either waits for the copy.
///
/// Ordering is the caller's: kernels that read `dst` on another stream must wait for an event recorded on
/// `stream` after this call, and the host must not write `src` again before that event has completed (the copy
/// would then carry some of the new bytes).
///
/// Errors: a block that is not CUDA memory, a source that is not pinned or a target that is not device memory
/// ([`Error::Unsupported`]), blocks or a stream of different contexts, `len` past the end of either block
/// ([`Error::OutOfBounds`]), and driver failures.
#[allow(unsafe_code)] // Discharges `raw::copy_htod_async_pinned`'s contract.
pub fn upload_block_async(src: &OwnedBlock, dst: &mut OwnedBlock, len: u64, stream: &Arc<CudaStream>) -> Result<()> {
    let (from, to) = (cuda_pool(src, "source")?, cuda_pool(dst, "target")?);
    let backend = to.backend();
    let refuse = |what: String| Err(Error::Unsupported { backend: backend.name().to_string(), what });
    if from.backend().placement() != PoolKind::HostPinned {
        return refuse(format!("an asynchronous upload from {} (the source must be pinned memory)", from.name()));
    }
    if backend.placement() != PoolKind::DeviceLocal {
        return refuse("an asynchronous upload into memory other than device-local memory".into());
    }
    if from.backend().context().cu_ctx() != backend.context().cu_ctx() {
        return refuse(format!("an upload from pinned memory of {} (another context)", from.name()));
    }
    src.check_range(0, len)?;
    dst.check_range(0, len)?;
    if len == 0 {
        return Ok(());
    }
    let id = super::stream_id(stream);
    let live = backend.live_stream(id)?;
    from.record_stream(src.handle(), id)?;
    to.record_stream(dst.handle(), id)?;
    let (_, host) = super::interop::range(from.pool(), src.handle(), 0, len)?;
    let Some(host) = host else {
        return refuse("an upload from pinned memory without a host address".into());
    };
    let (device, _) = super::interop::range(to.pool(), dst.handle(), 0, len)?;
    backend.bind()?;
    // SAFETY: `range` checked `len` bytes against both blocks, found live in their pools: `src` is pinned memory,
    // `dst` device memory of the bound context. Both blocks were marked as used on `stream` (`record_stream`), so
    // their memory is not reused before the stream passes the copy, and a host slice of either taken later
    // waits for the device first (`settle`).
    unsafe { raw::copy_htod_async_pinned(device, host, len, &live) }.map_err(|f| backend.error(f))
}

/// `bytes` of page-locked host memory and `bytes` of device memory allocated directly with the driver
/// (`cuMemHostAlloc`, `cuMemAlloc`), outside any pool, and uploads between them with the call
/// [`upload_block_async`] makes: the reference a benchmark measures pooled uploads against. Freed on drop,
/// after the context has been synchronized.
pub struct PinnedUploadBaseline {
    backend: CudaBackend,
    host: usize,
    device: u64,
    bytes: u64,
}

impl std::fmt::Debug for PinnedUploadBaseline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedUploadBaseline")
            .field("device", &self.backend.name())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl PinnedUploadBaseline {
    /// Allocates both sides on `device` and fills the host side with a byte pattern. Refuses zero bytes.
    #[allow(unsafe_code)] // Discharges `raw::host_free`'s and `raw::host_copy_in`'s contracts.
    pub fn new(device: &CudaDevice, bytes: u64) -> Result<Self> {
        let backend = device.backend(PoolKind::DeviceLocal);
        if bytes == 0 {
            return Err(Error::ZeroSize { device: backend.name().to_string() });
        }
        backend.bind()?;
        let (host, _) = raw::host_alloc(bytes).map_err(|f| backend.error(f))?;
        let device = match raw::mem_alloc(bytes) {
            Ok(d) => d,
            Err(f) => {
                // SAFETY: `host` was just returned by `raw::host_alloc`, no work or reference uses it, and it is
                // freed once, here, on the way out.
                if let Err(g) = unsafe { raw::host_free(host) } {
                    log::error!("{}: {}", backend.name(), backend.error(g));
                }
                return Err(backend.error(f));
            }
        };
        let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        // SAFETY: `host` is a live pinned allocation of `bytes` bytes, `pattern.len()`, that nothing else reaches yet.
        unsafe { raw::host_copy_in(host, &pattern) };
        Ok(Self { backend, host, device, bytes })
    }

    /// Bytes moved by one [`PinnedUploadBaseline::upload`].
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Queues one upload of all the bytes on `stream` (`cuMemcpyHtoDAsync` from the pinned side) and returns.
    /// Errors for a stream of another context.
    #[allow(unsafe_code)] // Discharges `raw::copy_htod_async_pinned`'s contract.
    pub fn upload(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let live = self.backend.live_stream(super::stream_id(stream))?;
        self.backend.bind()?;
        // SAFETY: both sides are this baseline's own allocations of `bytes` bytes (pinned and device memory of the
        // bound context), freed only in `Drop` after synchronizing the context.
        unsafe { raw::copy_htod_async_pinned(self.device, self.host, self.bytes, &live) }
            .map_err(|f| self.backend.error(f))
    }

    /// The device bytes, read back (waits for queued work first): a check that the uploads landed.
    #[allow(unsafe_code)] // Discharges `raw::copy_dtoh`'s contract.
    pub fn read_back(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.bytes as usize];
        self.backend.synchronize()?;
        // SAFETY: `device` is this baseline's live device allocation of `bytes` bytes, `out.len()`; no host
        // reference to device memory exists.
        unsafe { raw::copy_dtoh(&mut out, self.device) }.map_err(|f| self.backend.error(f))?;
        Ok(out)
    }
}

impl Drop for PinnedUploadBaseline {
    #[allow(unsafe_code)] // Discharges `raw::mem_free`'s and `raw::host_free`'s contracts.
    fn drop(&mut self) {
        // Queued uploads read both sides: wait for them before freeing.
        if let Err(e) = self.backend.synchronize() {
            log::error!("{}: {e}; leaking the baseline's memory", self.backend.name());
            return;
        }
        // SAFETY: `device` came from `raw::mem_alloc` and is freed once (in drop); the context was just
        // synchronized, so no queued upload still uses it.
        if let Err(f) = unsafe { raw::mem_free(self.device) } {
            log::error!("{}: {}", self.backend.name(), self.backend.error(f));
        }
        // SAFETY: as for `device`; `host` came from `raw::host_alloc` and no slice of it was ever lent.
        if let Err(f) = unsafe { raw::host_free(self.host) } {
            log::error!("{}: {}", self.backend.name(), self.backend.error(f));
        }
    }
}
