//! The opened device shared by an adapter's pools, and the byte movement every pool uses: queued writes, staged
//! and mapped reads, mapped writes, clears. Every call runs inside error scopes so that wgpu's asynchronous
//! errors come back as [`Error::Driver`] instead of panics. Errors of the caller's own work are left to wgpu's
//! error handling (the caller's scopes, its handler, or wgpu's default panic): umm installs no handler.

use crate::{Error, Result};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Largest piece moved through one staging buffer or one `write_buffer` call, so that staging memory stays
/// bounded for large transfers.
const CHUNK: u64 = 32 << 20;

/// How long one wait for a map callback lasts before the device is polled again, and how many such waits pass
/// before a mapping counts as failed.
const MAP_WAIT: Duration = Duration::from_millis(50);
const MAP_WAITS: u32 = 200;

/// One opened wgpu device and its queue, shared by the pools of an adapter.
pub(crate) struct DeviceShared {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) limits: wgpu::Limits,
    /// Total memory: the host's for adapters that share it, else the largest buffer (wgpu reports no size).
    pub(crate) capacity: u64,
    pub(crate) shares_memory_with_host: bool,
    /// Bytes of segments held by this device's pools.
    pub(crate) held: AtomicU64,
    /// Set by the device-lost callback.
    pub(crate) lost: Arc<Mutex<Option<String>>>,
}

impl DeviceShared {
    /// Wraps an opened device and installs the device-lost callback. No uncaptured-error handler: an error that
    /// none of umm's scopes caught came from the caller's own work, and goes where wgpu sends it (a scope of the
    /// caller's, a handler the caller installed, else wgpu's default, a panic), as it would without umm.
    pub(crate) fn new(
        label: &str,
        device: wgpu::Device,
        queue: wgpu::Queue,
        capacity: u64,
        shares_memory_with_host: bool,
    ) -> Self {
        let lost = Arc::new(Mutex::new(None));
        {
            let (label, lost) = (label.to_string(), Arc::clone(&lost));
            device.set_device_lost_callback(move |reason, message| {
                log::warn!("wgpu device {label} lost ({reason:?}): {message}");
                *lost.lock() =
                    Some(if message.is_empty() { format!("{reason:?}") } else { format!("{reason:?}: {message}") });
            });
        }
        let limits = device.limits();
        Self { device, queue, limits, capacity, shares_memory_with_host, held: AtomicU64::new(0), lost }
    }

    pub(crate) fn lost_reason(&self) -> Option<String> {
        self.lost.lock().clone()
    }

    pub(crate) fn free_bytes(&self) -> u64 {
        let held = self.held.load(Ordering::Relaxed);
        if self.shares_memory_with_host {
            if let Some(available) = crate::host::host_memory().map(|m| m.1) {
                return available;
            }
        }
        self.capacity.saturating_sub(held)
    }

    fn lost_error(&self, backend: &str, call: &str) -> Option<Error> {
        self.lost_reason()
            .map(|reason| Error::DeviceLost { backend: backend.to_string(), reason: format!("{reason}, in {call}") })
    }

    /// Runs `f` inside out-of-memory, validation and internal error scopes; any error caught becomes
    /// [`Error::Driver`] naming `call`. A lost device is reported before and after.
    pub(crate) fn scoped<T>(&self, backend: &str, call: &str, f: impl FnOnce() -> T) -> Result<T> {
        if let Some(e) = self.lost_error(backend, call) {
            return Err(e);
        }
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let out = super::watch::watched(call, backend, f);
        // Scopes pop innermost first.
        let caught = [internal.pop(), validation.pop(), oom.pop()].into_iter().find_map(pollster::block_on);
        if let Some(e) = self.lost_error(backend, call) {
            return Err(e);
        }
        match caught {
            None => Ok(out),
            Some(e) => {
                Err(Error::Driver { backend: backend.to_string(), call: call.to_string(), message: describe(&e) })
            }
        }
    }

    /// Waits until the queue has finished everything submitted so far (and map callbacks have run), for at most
    /// [`super::wait_limit`]: a device that has not finished by then is an error naming `call`.
    pub(crate) fn wait(&self, backend: &str, call: &str) -> Result<()> {
        let limit = super::wait_limit();
        let poll = wgpu::PollType::Wait { submission_index: None, timeout: Some(limit) };
        let status = self.scoped(backend, call, || self.device.poll(poll))?;
        status.map(drop).map_err(|e| Error::Driver {
            backend: backend.to_string(),
            call: format!("{call} (device.poll)"),
            message: match e {
                wgpu::PollError::Timeout => format!(
                    "the device did not finish the work queued before it in {limit:?} (UMM_WGPU_TIMEOUT sets the \
                     bound)"
                ),
                other => other.to_string(),
            },
        })
    }

    /// `queue.write_buffer` of 4-byte aligned `data` at aligned `offset`, in chunks, then waits for the queue.
    pub(crate) fn write_queue(&self, backend: &str, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        debug_assert!(offset.is_multiple_of(4) && data.len().is_multiple_of(4));
        self.scoped(backend, "queue.write_buffer", || {
            for (i, piece) in data.chunks(CHUNK as usize).enumerate() {
                self.queue.write_buffer(buffer, offset + i as u64 * CHUNK, piece);
            }
            self.queue.submit([]);
        })?;
        self.wait(backend, "queue.write_buffer")
    }

    /// Zeroes the aligned range `[offset, offset + len)` with `clear_buffer`, and waits.
    pub(crate) fn clear(&self, backend: &str, buffer: &wgpu::Buffer, offset: u64, len: u64) -> Result<()> {
        self.scoped(backend, "clear_buffer", || {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            encoder.clear_buffer(buffer, offset, Some(len));
            self.queue.submit([encoder.finish()]);
        })?;
        self.wait(backend, "clear_buffer")
    }

    /// Reads through a staging buffer: copy the covering aligned range, map it, copy out.
    pub(crate) fn read_staged(&self, backend: &str, buffer: &wgpu::Buffer, offset: u64, dst: &mut [u8]) -> Result<()> {
        let mut done = 0usize;
        while done < dst.len() {
            let n = (CHUNK as usize).min(dst.len() - done);
            let start = offset + done as u64;
            let (a, b) = (start & !3, (start + n as u64).next_multiple_of(4));
            let staging = self.scoped(backend, "copy_buffer_to_buffer (read-back)", || {
                let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("umm read-back staging"),
                    size: b - a,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                let mut encoder = self.device.create_command_encoder(&Default::default());
                encoder.copy_buffer_to_buffer(buffer, a, &staging, 0, b - a);
                self.queue.submit([encoder.finish()]);
                staging
            })?;
            let skip = (start - a) as usize;
            let result = self.map_and(backend, &staging, wgpu::MapMode::Read, 0, b - a, |mapped| match mapped {
                Mapped::Read(bytes) => dst[done..done + n].copy_from_slice(&bytes[skip..skip + n]),
                Mapped::Write(_) => unreachable!("mapped for reading"),
            });
            staging.destroy();
            result?;
            done += n;
        }
        Ok(())
    }

    /// Reads a `MAP_READ` buffer by mapping the covering range.
    pub(crate) fn read_mapped(&self, backend: &str, buffer: &wgpu::Buffer, offset: u64, dst: &mut [u8]) -> Result<()> {
        let end = offset + dst.len() as u64;
        let (a, b) = (offset & !(wgpu::MAP_ALIGNMENT - 1), end.next_multiple_of(4));
        let skip = (offset - a) as usize;
        self.map_and(backend, buffer, wgpu::MapMode::Read, a, b, |mapped| match mapped {
            Mapped::Read(bytes) => dst.copy_from_slice(&bytes[skip..skip + dst.len()]),
            Mapped::Write(_) => unreachable!("mapped for reading"),
        })
    }

    /// Writes a `MAP_WRITE` buffer by mapping the covering range; bytes outside `src` keep their values.
    pub(crate) fn write_mapped(&self, backend: &str, buffer: &wgpu::Buffer, offset: u64, src: &[u8]) -> Result<()> {
        let end = offset + src.len() as u64;
        let (a, b) = (offset & !(wgpu::MAP_ALIGNMENT - 1), end.next_multiple_of(4));
        let skip = (offset - a) as usize;
        self.map_and(backend, buffer, wgpu::MapMode::Write, a, b, |mapped| match mapped {
            Mapped::Write(view) => view.slice(skip..skip + src.len()).copy_from_slice(src),
            Mapped::Read(_) => unreachable!("mapped for writing"),
        })
    }

    /// Maps `[a, b)` of `buffer` (waiting for the device), hands the mapping to `f`, unmaps. The caller holds the
    /// buffer's turn when other threads could map it or submit work on it.
    fn map_and(
        &self,
        backend: &str,
        buffer: &wgpu::Buffer,
        mode: wgpu::MapMode,
        a: u64,
        b: u64,
        f: impl FnOnce(Mapped<'_>),
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.scoped(backend, "map_async", || {
            buffer.map_async(mode, a..b, move |result| {
                let _ = tx.send(result);
            })
        })?;
        let driver =
            |message: String| Error::Driver { backend: backend.to_string(), call: "map_async".into(), message };
        match self.map_outcome(backend, &rx)? {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                let lost = self.lost_reason().map(|r| format!(" (device lost: {r})")).unwrap_or_default();
                return Err(driver(format!("mapping {} bytes at {a} failed: {e}{lost}", b - a)));
            }
            None => {
                buffer.unmap();
                return Err(driver(format!(
                    "mapping {} bytes at {a} did not complete in {:?} of polling the device",
                    b - a,
                    MAP_WAIT * MAP_WAITS
                )));
            }
        }
        let result = match mode {
            wgpu::MapMode::Read => buffer.get_mapped_range(a..b).map(|view| f(Mapped::Read(&view))),
            wgpu::MapMode::Write => buffer.get_mapped_range_mut(a..b).map(|mut view| f(Mapped::Write(&mut view))),
        };
        buffer.unmap();
        result.map_err(|e| driver(format!("get_mapped_range of {} bytes at {a}: {e}", b - a)))
    }

    /// Polls the device until the map callback behind `rx` has run, and returns what it said; `None` if it does not
    /// run within [`MAP_WAITS`] waits. A poll or submit on any thread collects every finished mapping and runs
    /// their callbacks after it lets go of the device, so this thread's poll can return while another thread is
    /// about to run this callback: a finished poll is not yet a finished callback.
    fn map_outcome(&self, backend: &str, rx: &mpsc::Receiver<MapResult>) -> Result<Option<MapResult>> {
        for _ in 0..MAP_WAITS {
            self.wait(backend, "map_async")?;
            match rx.recv_timeout(MAP_WAIT) {
                Ok(outcome) => return Ok(Some(outcome)),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                // wgpu dropped the callback without running it.
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(None),
            }
        }
        Ok(None)
    }
}

/// What a map callback reports.
type MapResult = std::result::Result<(), wgpu::BufferAsyncError>;

/// A mapped range handed to a closure.
enum Mapped<'a> {
    Read(&'a [u8]),
    Write(&'a mut wgpu::BufferViewMut),
}

/// A wgpu error as one line: its description and the chain of sources.
pub(crate) fn describe(e: &wgpu::Error) -> String {
    let mut text = match e {
        wgpu::Error::OutOfMemory { .. } => "out of device memory".to_string(),
        other => other.to_string(),
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}
