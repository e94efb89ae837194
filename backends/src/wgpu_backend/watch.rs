//! Bounds on the wgpu backend's waits, and a watchdog that says what a call that has not returned was doing.
//!
//! - **Bounded waits.** Every wait for the device (`device.poll`) gives up after [`wait_limit`] (default 60 s,
//!   [`set_wait_limit`], `UMM_WGPU_TIMEOUT` through the facade) with an error naming the call; map callbacks are
//!   waited for within the same bound. Setting up (creating the instance, enumerating adapters, opening a device)
//!   runs on a helper thread that the caller waits for within the bound: a driver call that never returns there
//!   (seen on NVIDIA's Vulkan driver, gfx-rs/wgpu#10234 and the project's own runs) becomes an error or a skipped
//!   backend that names it, and the helper thread is left behind, blocked where the driver holds it.
//! - **A watchdog** ([`set_watchdog`], `UMM_WGPU_WATCHDOG`): while it is on, every call into wgpu is listed as in
//!   flight ([`in_flight`]); a thread checks once a second, and a call in flight longer than the watchdog's
//!   threshold is reported once on stderr, with every call in flight and, on Linux, where each of the process's
//!   threads is waiting in the kernel (`/proc/self/task/*`: state, wait channel, system call). Off, a call costs
//!   one atomic load.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The bound on one wait, in milliseconds.
static WAIT_LIMIT_MS: AtomicU64 = AtomicU64::new(60_000);
/// The watchdog's threshold in milliseconds; 0 when off.
static WATCHDOG_MS: AtomicU64 = AtomicU64::new(0);
static WATCHDOG_STARTED: AtomicBool = AtomicBool::new(false);
static NEXT_CALL: AtomicU64 = AtomicU64::new(1);
static IN_FLIGHT: Mutex<Vec<Call>> = Mutex::new(Vec::new());

/// How long the wgpu backend waits for the device, or for a setup call, before giving up with an error.
pub fn wait_limit() -> Duration {
    Duration::from_millis(WAIT_LIMIT_MS.load(Ordering::Relaxed))
}

/// Sets [`wait_limit`] for the process (at least 1 ms).
pub fn set_wait_limit(limit: Duration) {
    WAIT_LIMIT_MS.store((limit.as_millis() as u64).max(1), Ordering::Relaxed);
}

/// Turns the watchdog on (reporting calls in flight longer than `threshold`) or off (`None`).
pub fn set_watchdog(threshold: Option<Duration>) {
    let ms = threshold.map_or(0, |t| (t.as_millis() as u64).max(1));
    WATCHDOG_MS.store(ms, Ordering::Relaxed);
    if ms > 0 && !WATCHDOG_STARTED.swap(true, Ordering::AcqRel) {
        let spawned = std::thread::Builder::new().name("umm-wgpu-watchdog".into()).spawn(watchdog);
        if let Err(e) = spawned {
            WATCHDOG_STARTED.store(false, Ordering::Release);
            log::warn!("umm: the wgpu watchdog thread could not start: {e}");
        }
    }
}

/// A call into wgpu that has not returned, as the watchdog lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    /// What umm was doing: "device.poll for queue.write_buffer", "request_device", ...
    pub call: String,
    /// The adapter it was on ("" before one is known).
    pub device: String,
    /// The calling thread's name, or its id.
    pub thread: String,
    /// How long it has been in flight.
    pub elapsed: Duration,
}

struct Call {
    id: u64,
    call: String,
    device: String,
    thread: String,
    since: Instant,
    reported: bool,
}

/// The calls in flight now, oldest first; empty while the watchdog is off.
pub fn in_flight() -> Vec<InFlight> {
    IN_FLIGHT
        .lock()
        .iter()
        .map(|c| InFlight {
            call: c.call.clone(),
            device: c.device.clone(),
            thread: c.thread.clone(),
            elapsed: c.since.elapsed(),
        })
        .collect()
}

/// Runs `f`, listed as in flight while the watchdog is on.
pub(crate) fn watched<T>(call: &str, device: &str, f: impl FnOnce() -> T) -> T {
    if WATCHDOG_MS.load(Ordering::Relaxed) == 0 {
        return f();
    }
    let id = NEXT_CALL.fetch_add(1, Ordering::Relaxed);
    let current = std::thread::current();
    let thread = current.name().map_or_else(|| format!("{:?}", current.id()), str::to_string);
    IN_FLIGHT.lock().push(Call {
        id,
        call: call.to_string(),
        device: device.to_string(),
        thread,
        since: Instant::now(),
        reported: false,
    });
    struct Done(u64);
    impl Drop for Done {
        fn drop(&mut self) {
            IN_FLIGHT.lock().retain(|c| c.id != self.0);
        }
    }
    let _done = Done(id);
    f()
}

/// Runs `f` on a helper thread and waits for it within [`wait_limit`]: `Err` (saying what did not return) when it
/// has not returned by then, in which case the helper is left running; a panic in `f` is `Err` too.
pub(crate) fn bounded<T: Send + 'static>(
    call: &str,
    device: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::result::Result<T, String> {
    bounded_within(wait_limit(), call, device, f)
}

fn bounded_within<T: Send + 'static>(
    limit: Duration,
    call: &str,
    device: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::result::Result<T, String> {
    let (tx, rx) = mpsc::channel();
    let (what, on) = (call.to_string(), device.to_string());
    let spawned = std::thread::Builder::new().name(format!("umm-wgpu-{call}")).spawn(move || {
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| watched(&what, &on, f)));
        let _ = tx.send(out);
    });
    if let Err(e) = spawned {
        return Err(format!("{call}: no thread to run it on: {e}"));
    }
    match rx.recv_timeout(limit) {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(panic)) => Err(format!("wgpu panicked in {call}: {}", panic_text(&panic))),
        Err(_) => Err(format!(
            "{call}{} did not return in {limit:?} (UMM_WGPU_TIMEOUT sets the bound; the driver holds the thread \
             that called it, which is left waiting): seen with NVIDIA's Vulkan driver, gfx-rs/wgpu#10234; \
             UMM_BACKENDS without wgpu avoids it",
            if device.is_empty() { String::new() } else { format!(" on {device}") }
        )),
    }
}

/// Reads `UMM_WGPU_TIMEOUT` (seconds the wgpu backend waits for the device or a setup call; default 60) and
/// `UMM_WGPU_WATCHDOG` (seconds after which a call in flight is reported; `off`, the default, or `0`) once per
/// process; what is wrong with either, for discovery to report (the facade refuses such values at build).
pub(crate) fn apply_env() -> Vec<String> {
    static APPLIED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    APPLIED
        .get_or_init(|| {
            let mut problems = Vec::new();
            if let Ok(v) = std::env::var("UMM_WGPU_TIMEOUT") {
                match parse_seconds(&v) {
                    Ok(Some(limit)) => set_wait_limit(limit),
                    _ => {
                        problems.push(format!("wgpu: UMM_WGPU_TIMEOUT={v:?} is not a number of seconds above 0; 60 s"))
                    }
                }
            }
            if let Ok(v) = std::env::var("UMM_WGPU_WATCHDOG") {
                match parse_seconds(&v) {
                    Ok(threshold) => set_watchdog(threshold),
                    Err(_) => problems.push(format!("wgpu: UMM_WGPU_WATCHDOG={v:?} is not a number of seconds or off")),
                }
            }
            problems
        })
        .clone()
}

/// A number of seconds above 0 (`2.5`), or `None` for `off` or `0`; what is wrong otherwise.
///
/// # Errors
/// A value that is not a number of seconds in [0, 1e9] or `off`.
pub fn parse_seconds(value: &str) -> std::result::Result<Option<Duration>, String> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let wrong = || format!("{value:?} is not a number of seconds in [0, 1e9] or off");
    let secs: f64 = value.parse().map_err(|_| wrong())?;
    if !(0.0..=1e9).contains(&secs) {
        return Err(wrong());
    }
    Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
}

pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

fn watchdog() {
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let threshold = WATCHDOG_MS.load(Ordering::Relaxed);
        if threshold == 0 {
            continue;
        }
        let report = {
            let mut calls = IN_FLIGHT.lock();
            let mut late = false;
            for call in
                calls.iter_mut().filter(|c| !c.reported && c.since.elapsed() >= Duration::from_millis(threshold))
            {
                call.reported = true;
                late = true;
            }
            late.then(|| {
                calls
                    .iter()
                    .map(|c| {
                        format!(
                            "  {} on {:?} in thread {:?}: {:.1} s",
                            c.call,
                            c.device,
                            c.thread,
                            c.since.elapsed().as_secs_f64()
                        )
                    })
                    .collect::<Vec<_>>()
            })
        };
        if let Some(lines) = report {
            eprintln!(
                "umm wgpu watchdog: a call into wgpu has not returned in {:.1} s (UMM_WGPU_WATCHDOG); in flight:\n{}\n\
                 where each thread waits (state, kernel wait channel, system call):\n{}",
                threshold as f64 / 1e3,
                lines.join("\n"),
                thread_waits()
            );
        }
    }
}

/// Where each of the process's threads waits, from `/proc/self/task` (Linux; elsewhere a line saying so).
fn thread_waits() -> String {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return "  (no /proc/self/task here)".into();
    };
    let read = |task: &std::path::Path, file: &str| {
        std::fs::read_to_string(task.join(file)).map(|s| s.trim().to_string()).unwrap_or_default()
    };
    let mut lines: Vec<String> = tasks
        .flatten()
        .map(|task| {
            let path = task.path();
            let stat = read(&path, "stat");
            // The state follows the parenthesised name, which may itself hold spaces or parentheses.
            let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').next()).unwrap_or("?").to_string();
            let syscall = read(&path, "syscall");
            let syscall = syscall.split(' ').next().unwrap_or("").to_string();
            format!(
                "  {} {:?}: state {state}, wchan {}, syscall {}",
                task.file_name().to_string_lossy(),
                read(&path, "comm"),
                read(&path, "wchan"),
                if syscall.is_empty() { "?".into() } else { syscall }
            )
        })
        .collect();
    lines.sort();
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_listed_while_in_flight_and_one_that_does_not_return_in_time_is_an_error_naming_it() {
        set_watchdog(Some(Duration::from_millis(100)));
        let listed = |call: &str| in_flight().iter().any(|c| c.call == call && c.device == "gpu0");
        let inside = watched("listing_check", "gpu0", || listed("listing_check"));
        assert!(inside, "listed while in flight");
        assert!(!listed("listing_check"), "gone once returned");
        let (release, hold) = mpsc::channel::<()>();
        let err = bounded_within(Duration::from_millis(200), "enumerate_adapters", "gpu0", move || {
            let _ = hold.recv();
        })
        .unwrap_err();
        assert!(err.contains("enumerate_adapters on gpu0 did not return in 200ms"), "{err}");
        assert!(err.contains("UMM_WGPU_TIMEOUT"), "{err}");
        assert!(listed("enumerate_adapters"), "the call left behind is still in flight");
        release.send(()).unwrap();
        // Calls that return (a panic included) are waited for, however loaded the machine.
        let ample = Duration::from_secs(60);
        assert_eq!(bounded_within(ample, "request_device", "", || 7), Ok(7));
        let err = bounded_within(ample, "request_device", "", || -> () { panic!("driver says no") }).unwrap_err();
        assert!(err.contains("panicked in request_device: driver says no"), "{err}");
        set_watchdog(None);
    }

    #[test]
    fn seconds_parse_and_bad_values_are_refused() {
        assert_eq!(parse_seconds(" 2.5 "), Ok(Some(Duration::from_millis(2500))));
        assert_eq!(parse_seconds("OFF"), Ok(None));
        assert_eq!(parse_seconds("0"), Ok(None));
        for bad in ["", "soon", "-1", "NaN", "inf", "1e12"] {
            assert!(parse_seconds(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn thread_waits_lists_this_thread() {
        let text = thread_waits();
        if std::path::Path::new("/proc/self/task").exists() {
            assert!(text.contains("state") && text.contains("wchan"), "{text}");
        }
    }
}
