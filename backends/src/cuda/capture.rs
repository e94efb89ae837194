//! The driver's stream-capture mode around umm's own device calls. While a CUDA graph is captured in the global
//! or thread-local mode (PyTorch's `torch.cuda.graph` uses the global one), the driver refuses "potentially
//! unsafe" calls such as `cuMemAlloc`, `cuMemCreate` and `cuMemMap` from the capturing thread, and in the global
//! mode from every thread. A pool that grows during a capture makes exactly those calls; the new memory keeps its
//! address for as long as a graph may use it, so they are safe here, and, as PyTorch does around `cudaMalloc`, umm
//! makes them in the relaxed mode.

use super::raw;
use cudarc::driver::sys::CUstreamCaptureMode;
use std::marker::PhantomData;

/// While alive, the calling thread's capture mode is relaxed; the mode it had comes back on drop. Not `Send`:
/// the mode belongs to the thread.
#[must_use = "the mode is restored when the guard is dropped"]
pub struct RelaxedCaptureMode {
    previous: Option<CUstreamCaptureMode>,
    _thread_bound: PhantomData<*const ()>,
}

impl RelaxedCaptureMode {
    /// Relaxes the calling thread's capture mode. Call only where the CUDA driver was found (a discovered
    /// device); a failure leaves the mode as it was (the calls that follow may then be refused, with an error).
    pub fn enter() -> Self {
        let previous = raw::exchange_capture_mode(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|f| log::warn!("umm: relaxing the stream-capture mode failed: {}", f.message()))
            .ok();
        RelaxedCaptureMode { previous, _thread_bound: PhantomData }
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            if let Err(f) = raw::exchange_capture_mode(previous) {
                log::warn!("umm: restoring the stream-capture mode failed: {}", f.message());
            }
        }
    }
}
