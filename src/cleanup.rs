//! Cleanup reports and the periodic cleaner.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// What one device gave back in a cleanup round.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeviceCleanup {
    /// Device index.
    pub index: usize,
    /// Device name.
    pub name: String,
    /// Bytes of physical memory released.
    pub bytes_released: u64,
    /// Segments released.
    pub segments_released: u64,
    /// Pages unmapped in virtual reservations.
    pub pages_unmapped: u64,
}

/// What a cleanup round released, per device and in total, and how long it took.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CleanupReport {
    /// Per device.
    pub devices: Vec<DeviceCleanup>,
    /// Total bytes released.
    pub bytes_released: u64,
    /// Total segments released.
    pub segments_released: u64,
    /// Time the round took.
    #[serde(serialize_with = "micros")]
    pub elapsed: Duration,
}

fn micros<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_micros() as u64)
}

/// Runs cleanup rounds on a background thread; dropping the guard stops the thread and waits for it.
pub struct CleanupGuard {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<u64>>,
    interval: Duration,
    /// Rounds finished so far, for [`CleanupGuard::rounds`].
    rounds: Arc<AtomicU64>,
}

impl CleanupGuard {
    /// The shortest interval between two rounds; a shorter one asked of
    /// [`crate::UniversalMemoryManager::start_periodic_cleanup`] is raised to it (with a warning).
    ///
    /// An interval of zero would run rounds back to back: a core spinning on the pools' locks, contending with
    /// every allocation. Nor would faster rounds release memory sooner in any useful way: a cached segment is
    /// released once it has sat idle for `cleanup_idle_rounds` rounds, so rounds a few microseconds apart would
    /// empty the caches between two allocations and turn caching off. A millisecond keeps the cleaner's cost
    /// below a thousand rounds a second whatever is asked. Starting a cleaner cannot fail: an interval computed
    /// as zero gives a busy but bounded cleaner, not a panic or an error for callers to handle.
    pub const MIN_INTERVAL: Duration = Duration::from_millis(1);

    pub(crate) fn start(round: impl Fn() -> Option<CleanupReport> + Send + 'static, asked: Duration) -> Self {
        let interval = asked.max(Self::MIN_INTERVAL);
        if interval != asked {
            crate::notice::warn(format_args!(
                "periodic cleanup every {asked:?} raised to the minimum interval of {interval:?}"
            ));
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let rounds = Arc::new(AtomicU64::new(0));
        let finished = Arc::clone(&rounds);
        let thread = std::thread::Builder::new()
            .name("umm-cleanup".into())
            .spawn(move || {
                let mut rounds = 0;
                loop {
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return rounds,
                    }
                    // The manager may be gone: then there is nothing left to clean.
                    let Some(report) = round() else { return rounds };
                    rounds += 1;
                    finished.store(rounds, Ordering::Release);
                    if report.bytes_released > 0 {
                        log::debug!("periodic cleanup released {} bytes", report.bytes_released);
                    }
                }
            })
            .ok();
        Self { stop: Some(stop), thread, interval, rounds }
    }

    /// How many rounds the cleaner has finished so far.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Acquire)
    }

    /// The interval between rounds: the one asked for, or [`CleanupGuard::MIN_INTERVAL`] if that was shorter.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Stops the cleaner and returns how many rounds it ran.
    pub fn stop(mut self) -> u64 {
        self.shutdown()
    }

    fn shutdown(&mut self) -> u64 {
        drop(self.stop.take());
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or(0)
    }
}

impl Drop for CleanupGuard {
    fn drop(&mut self) {
        self.shutdown();
    }
}
