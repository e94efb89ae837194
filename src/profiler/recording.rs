//! `UMM_TRACE` recording: every allocation and free written to an `umm-trace v1` file, one file per manager.

use crate::error::Error;
use crate::trace::{TraceFile, TraceWriter};
use parking_lot::Mutex;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Writes allocations and frees to an `umm-trace v1` file (the lines [`TraceWriter`] writes). A write error is
/// logged once and stops recording.
pub(super) struct TraceRecorder {
    pub(super) path: PathBuf,
    file: Mutex<Option<TraceFile>>,
    failed: AtomicBool,
    ops: AtomicU64,
}

/// Trace paths taken by managers of this process, so that a second manager does not overwrite the first's.
static TRACE_PATHS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

impl TraceRecorder {
    pub(super) fn create(asked: &Path) -> crate::error::Result<Self> {
        let path = unique_trace_path(asked);
        // Named as the user asked for it: the variable or the builder call is what they can change.
        let io_error = |source| Error::Io {
            path: format!("{} (the trace file asked for with UMM_TRACE or Builder::record_trace)", path.display()),
            source,
        };
        let mut writer = TraceWriter::create(&path).map_err(io_error)?;
        let program = std::env::args().next().unwrap_or_default();
        writer
            .comment(&format!(
                "recorded by umm {} (UMM_TRACE) from {program}, process {}\nsizes are requested bytes; every device \
                 and pool of one manager in one trace",
                env!("CARGO_PKG_VERSION"),
                std::process::id()
            ))
            .map_err(io_error)?;
        let file = writer.finish().map_err(io_error)?;
        log::info!("umm: recording allocations to {}", path.display());
        Ok(Self { path, file: Mutex::new(Some(file)), failed: AtomicBool::new(false), ops: AtomicU64::new(0) })
    }

    pub(super) fn alloc(&self, id: u64, bytes: u64, stream: u64) {
        self.write(format_args!("a {id} {bytes} {stream}\n"));
    }

    pub(super) fn free(&self, id: u64) {
        self.write(format_args!("f {id}\n"));
    }

    pub(super) fn write(&self, line: fmt::Arguments<'_>) {
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        let mut guard = self.file.lock();
        let Some(file) = guard.as_mut() else { return };
        match file.write_fmt(line) {
            Ok(()) => {
                self.ops.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.fail(&e),
        }
    }

    pub(super) fn flush(&self) {
        if let Some(file) = self.file.lock().as_mut() {
            if let Err(e) = file.flush() {
                self.fail(&e);
            }
        }
    }

    fn fail(&self, e: &std::io::Error) {
        if !self.failed.swap(true, Ordering::Relaxed) {
            log::error!("umm: writing the trace {} failed ({e}); recording stopped", self.path.display());
        }
    }
}

impl Drop for TraceRecorder {
    fn drop(&mut self) {
        let Some(file) = self.file.get_mut().take() else { return };
        let closed = match file {
            TraceFile::Plain(mut w) => w.flush(),
            TraceFile::Gzip(w) => w.finish().and_then(|mut w| w.flush()),
        };
        match closed {
            Ok(()) => log::info!("umm: wrote {} ops to {}", self.ops.load(Ordering::Relaxed), self.path.display()),
            Err(e) => self.fail(&e),
        }
    }
}

/// `asked` with `{pid}` replaced; if this process already writes a trace there, `.2` (`.3`, ...) goes before
/// the extension (`run.trace.gz` → `run.2.trace.gz`).
pub(super) fn unique_trace_path(asked: &Path) -> PathBuf {
    let text = asked.to_string_lossy().replace("{pid}", &std::process::id().to_string());
    let base = PathBuf::from(&text);
    let mut taken = TRACE_PATHS.lock();
    let mut candidate = base.clone();
    let mut n = 1;
    while taken.contains(&candidate) {
        n += 1;
        let file = base.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let split = ["trace.gz", "trace", "gz"]
            .iter()
            .find_map(|ext| file.strip_suffix(&format!(".{ext}")).map(|stem| (stem.to_string(), format!(".{ext}"))))
            .unwrap_or((file.clone(), String::new()));
        candidate = base.with_file_name(format!("{}.{n}{}", split.0, split.1));
    }
    taken.push(candidate.clone());
    candidate
}
