//! One write or read of a buffer that returns before the device has finished it: [`Upload`] from
//! [`UniversalMemoryManager::write_async`] and [`Download`] from [`UniversalMemoryManager::read_async`]. Each
//! borrows its buffer until it completes, so the buffer can be neither used nor freed under a copy in flight.
//!
//! | memory | write | read |
//! |--------|-------|------|
//! | CUDA device memory | staged in pinned memory, `cuMemcpyHtoDAsync` on a copy stream | `cuMemcpyAsync` into pinned staging on a copy stream, ordered after the default stream's work |
//! | OpenCL device memory | non-blocking `clEnqueueWriteBuffer` | non-blocking `clEnqueueReadBuffer` |
//! | wgpu | `queue.write_buffer` (staged by wgpu) | a blocking read at once |
//! | host, pinned, read-only, simulated | a blocking write at once | a blocking read at once |

use super::Lane;
use crate::{Result, UniversalBuffer, UniversalMemoryManager};

/// A write in flight into a buffer ([`UniversalMemoryManager::write_async`]). [`Upload::wait`] returns once the
/// device holds the data; dropping the handle waits too (and logs a failure it cannot return).
#[must_use = "an upload completes when it is waited for or dropped"]
pub struct Upload<'a, T: bytemuck::Pod> {
    _buffer: &'a mut UniversalBuffer<T>,
    lane: Lane,
}

impl<T: bytemuck::Pod> Upload<'_, T> {
    /// Waits (on the host) until the write has completed.
    pub fn wait(mut self) -> Result<()> {
        self.lane.finish()
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for Upload<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upload").field("buffer", &self._buffer).finish_non_exhaustive()
    }
}

/// A read in flight from a buffer ([`UniversalMemoryManager::read_async`]). [`Download::wait`] returns the
/// elements; dropping the handle waits for the copy and discards them.
#[must_use = "a download's elements come from wait()"]
pub struct Download<'a, T: bytemuck::Pod> {
    buffer: &'a UniversalBuffer<T>,
    pending: Fetch,
    /// The elements of a read made at once.
    ready: Vec<T>,
}

/// How a read's bytes arrive.
enum Fetch {
    /// Read at once into `ready` (host memory, pinned memory, wgpu, simulated devices).
    Done,
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::Fetch),
    #[cfg(feature = "opencl")]
    OpenCl(umm_backends::opencl::PendingRead),
}

impl<T: bytemuck::Pod> Download<'_, T> {
    /// As [`Download::wait`], into `out` (exactly the buffer's length, [`crate::Error::LengthMismatch`]
    /// otherwise): a loop that reads batch after batch reuses one host vector instead of faulting in a new one.
    pub fn wait_into(mut self, out: &mut [T]) -> Result<()> {
        self.buffer.check("wait_into", 0, out.len(), true)?;
        let queued = !matches!(self.pending, Fetch::Done);
        match std::mem::replace(&mut self.pending, Fetch::Done) {
            Fetch::Done => out.copy_from_slice(&self.ready),
            #[cfg(feature = "cuda")]
            Fetch::Cuda(fetch) => fetch.wait_into(bytemuck::cast_slice_mut(out))?,
            #[cfg(feature = "opencl")]
            Fetch::OpenCl(read) => bytemuck::cast_slice_mut(out).copy_from_slice(&read.wait()?),
        }
        if queued {
            self.buffer.note_host_read(self.buffer.size_bytes());
        }
        Ok(())
    }

    /// Waits (on the host) until the read has completed and returns the buffer's elements.
    pub fn wait(mut self) -> Result<Vec<T>> {
        let queued = !matches!(self.pending, Fetch::Done);
        let out = match std::mem::replace(&mut self.pending, Fetch::Done) {
            Fetch::Done => std::mem::take(&mut self.ready),
            #[cfg(feature = "cuda")]
            Fetch::Cuda(fetch) => {
                let mut out = vec![T::zeroed(); self.buffer.len()];
                fetch.wait_into(bytemuck::cast_slice_mut(&mut out))?;
                out
            }
            #[cfg(feature = "opencl")]
            Fetch::OpenCl(read) => {
                let bytes = read.wait()?;
                let mut out = vec![T::zeroed(); self.buffer.len()];
                bytemuck::cast_slice_mut(&mut out).copy_from_slice(&bytes);
                out
            }
        };
        if queued {
            self.buffer.note_host_read(self.buffer.size_bytes());
        }
        Ok(out)
    }
}

impl<T: bytemuck::Pod> Drop for Download<'_, T> {
    fn drop(&mut self) {
        // The copy writes memory the handle owns: it must be done before that memory goes.
        let waited: Result<()> = match std::mem::replace(&mut self.pending, Fetch::Done) {
            #[cfg(feature = "cuda")]
            Fetch::Cuda(fetch) => fetch.wait_into(&mut []),
            #[cfg(feature = "opencl")]
            Fetch::OpenCl(read) => read.wait().map(drop).map_err(crate::Error::from),
            Fetch::Done => Ok(()),
        };
        if let Err(e) = waited {
            log::error!("a read in flight failed while its handle was dropped: {e}");
        }
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for Download<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Download").field("buffer", &self.buffer).finish_non_exhaustive()
    }
}

impl UniversalMemoryManager {
    /// Starts writing `data` into the first `data.len()` elements of `buffer` and returns before the device has
    /// them: once the data is staged (CUDA), queued (OpenCL, wgpu) or, for memory the host writes directly,
    /// written. The copy runs while the host and the device's other work go on; [`Upload::wait`] completes it.
    /// Kernels that read the buffer are queued after `wait` (CUDA copies run on a stream of their own).
    ///
    /// Errors: [`crate::Error::OutOfRange`] when `data` is longer than the buffer, [`crate::Error::ReadOnly`] for
    /// a sealed read-only buffer, and what staging or the driver raise.
    pub fn write_async<'a, T: bytemuck::Pod>(
        &self,
        buffer: &'a mut UniversalBuffer<T>,
        data: &[T],
    ) -> Result<Upload<'a, T>> {
        buffer.check("write_async", 0, data.len(), false)?;
        // A read-only buffer takes its one write through the path that seals it.
        let mut lane = if buffer.is_read_only() {
            Lane::blocking()
        } else {
            Lane::for_buffer(
                self,
                buffer,
                #[cfg(feature = "cuda")]
                None,
            )?
        };
        // The copy must not overtake kernels still reading the buffer (CUDA: on the default stream).
        lane.after_compute()?;
        lane.start(buffer, data)?;
        Ok(Upload { _buffer: buffer, lane })
    }

    /// Starts reading all of `buffer` and returns before the device has copied it: the copy runs while the host
    /// and the device's other work go on, and [`Download::wait`] returns the elements. On CUDA the copy is
    /// ordered after the work queued so far on the context's default stream; kernels on streams of your own
    /// that write the buffer must have completed first.
    ///
    /// Errors: what staging or the driver raise.
    pub fn read_async<'a, T: bytemuck::Pod>(&self, buffer: &'a UniversalBuffer<T>) -> Result<Download<'a, T>> {
        match start_read(self, buffer)? {
            Some(pending) => Ok(Download { buffer, pending, ready: Vec::new() }),
            None => Ok(Download { buffer, pending: Fetch::Done, ready: buffer.to_vec()? }),
        }
    }
}

/// Queues the read where the memory's API reads asynchronously; `None` where it is read at once.
fn start_read<T: bytemuck::Pod>(mm: &UniversalMemoryManager, buffer: &UniversalBuffer<T>) -> Result<Option<Fetch>> {
    let bytes = buffer.size_bytes();
    #[allow(unused_variables)] // Read by the arms of the enabled backends.
    let Some(block) = buffer.block.as_ref().filter(|_| bytes > 0) else {
        return Ok(None);
    };
    let _ = mm;
    match buffer.api() {
        #[cfg(feature = "cuda")]
        Some(umm_placement::Api::Cuda) if buffer.placement() != umm_placement::PoolKind::HostPinned => {
            Ok(Some(Fetch::Cuda(super::cuda::Fetch::start(mm, buffer, block, bytes)?)))
        }
        // Memory mapped into the host gives no queued read: it is read in place.
        #[cfg(feature = "opencl")]
        Some(umm_placement::Api::OpenCl) => {
            Ok(umm_backends::opencl::read_owned_block_async(block, 0, bytes)?.map(Fetch::OpenCl))
        }
        _ => Ok(None),
    }
}
