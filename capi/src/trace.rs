//! `UMM_TRACE=path`: every allocation and free through the C ABI written to an `umm-trace v1` file, the format the
//! root crate's `umm::trace` reads (`umm replay`, `umm plot`), so a PyTorch program's allocations can be replayed.
//!
//! ```text
//! # umm-trace v1
//! # recorded by umm-capi ... (comments)
//! a ID BYTES STREAM       a successful umm_alloc: ID counts allocations (0, 1, ...), BYTES is the size asked for
//! f ID                    umm_free of a pointer umm handed out
//! s                       umm_mark_step: the end of a step (of every device)
//! ```
//!
//! STREAM numbers the raw `cudaStream_t` values densely, 0, 1, 2, ... in the order each is first allocated on,
//! so a trace replays on any streams. One trace holds every device's allocations. `{pid}` in the path becomes
//! the process id; a path ending in `.gz` is written gzip-compressed.
//!
//! Lines are kept in memory and written out together, in whole lines: every [`FLUSH_EVERY`] lines, in
//! `umm_empty_cache`, in `umm_trace_flush`, and at process exit (a C `atexit` handler, registered when the trace
//! file is created). A gzip trace is a series of complete gzip members, one per write-out (what `gzip -d`,
//! `zcat`, Python's `gzip` and umm's reader read as one stream), so the file on disk is a valid trace of
//! everything up to the last write-out at every moment: after a normal exit it is complete, and after
//! `os._exit`, a kill or a crash it lacks only the lines since the last write-out. A process forked from the
//! recording one never writes to the file.
//!
//! A path that cannot be created is an error naming `UMM_TRACE`, which the registry treats like any invalid
//! variable: every allocation fails with it. A write that fails later stops the recording (the allocations go
//! on), prints one line to stderr, and `umm_trace_flush` reports it.
//!
//! The `a` line of an allocation is written before its pointer is published to frees, and the `f` line before the
//! block goes back to its pool, so a free's line follows its allocation's and the next allocation of the same
//! address follows both, whatever the threads. Without `UMM_TRACE` recording costs one check of a `OnceLock`
//! per allocation and of an `Option` per free.

use flate2::write::GzEncoder;
use flate2::Compression;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// The first line of every trace.
const HEADER: &str = "# umm-trace v1";

/// Lines recorded before they are written out to the file.
const FLUSH_EVERY: u32 = 16_384;

/// Bytes of text compressed at a time into a gzip trace: compressing line by line took 6 times as long per line.
const GZIP_CHUNK: usize = 64 << 10;

/// How long the exit handler waits for a thread still recording before it gives up on the last lines.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// The process's recording: unset without `UMM_TRACE`, or the trace file, or why it could not be created.
static TRACE: OnceLock<Result<Recorder, String>> = OnceLock::new();

/// Reads `UMM_TRACE` through `var` (the environment) and creates the trace file, once per process; the registry
/// calls this when it starts. An error names `UMM_TRACE` and its value.
pub(crate) fn start(var: impl Fn(&str) -> Option<String>) -> Result<(), String> {
    let Some(value) = var("UMM_TRACE") else { return Ok(()) };
    let started = TRACE.get_or_init(|| {
        let recorder = Recorder::create(&value)?;
        // Without the handler the last lines wait for `umm_trace_flush`; a refusal changes nothing else.
        crate::ffi::exit::at_exit(flush_on_exit);
        Ok(recorder)
    });
    started.as_ref().map(|_| ()).map_err(Clone::clone)
}

/// The recording, when `UMM_TRACE` is set and its file was created.
#[inline]
fn recorder() -> Option<&'static Recorder> {
    match TRACE.get() {
        Some(Ok(recorder)) => Some(recorder),
        _ => None,
    }
}

/// Records a successful allocation of `bytes` on the raw stream handle `stream`; returns the ID its free is
/// recorded with (`None`: not recording). Call it before the pointer is published to frees.
#[inline]
pub(crate) fn record_alloc(bytes: u64, stream: u64) -> Option<u64> {
    recorder().and_then(|r| r.alloc(bytes, stream))
}

/// Records the free of the allocation [`record_alloc`] returned `id` for. Call it before the block goes back to
/// its pool.
#[inline]
pub(crate) fn record_free(id: Option<u64>) {
    if let (Some(id), Some(recorder)) = (id, recorder()) {
        recorder.free(id);
    }
}

/// Records the end of a step (`umm_mark_step`).
pub(crate) fn record_step() {
    if let Some(recorder) = recorder() {
        let mut state = recorder.state.lock();
        recorder.record(&mut state, format_args!("s\n"));
    }
}

/// Writes the recorded lines out (`umm_trace_flush`). `Ok` when there is no recording; an error when the file
/// could not be created or a write failed.
pub(crate) fn flush() -> Result<(), String> {
    match TRACE.get() {
        None => Ok(()),
        Some(Ok(recorder)) => recorder.flush(),
        Some(Err(e)) => Err(e.clone()),
    }
}

/// The process is exiting: the last lines are written out. Never unwinds (a panic stops at `catch_unwind`).
extern "C" fn flush_on_exit() {
    let _ = std::panic::catch_unwind(flush_at_exit);
}

/// The exit handler's flush: waits at most [`EXIT_WAIT`] for a thread that is recording, so that exit never hangs.
fn flush_at_exit() {
    if let Some(recorder) = recorder() {
        if let Some(mut state) = recorder.state.try_lock_for(EXIT_WAIT) {
            let _ = recorder.write_out(&mut state);
        }
    }
}

/// A trace file being recorded.
pub(crate) struct Recorder {
    /// `UMM_TRACE` as given, for messages.
    value: String,
    /// The file (`value` with `{pid}` replaced).
    path: PathBuf,
    /// The process that created the file: only it writes (a forked child has a copy of the unwritten lines).
    pid: u32,
    state: Mutex<State>,
}

struct State {
    file: File,
    pending: Pending,
    /// Lines in `pending`.
    pending_lines: u32,
    /// The ID of the next allocation.
    next_id: u64,
    /// Raw stream handle → stream number, numbered in order of first use.
    streams: HashMap<u64, u64>,
    /// Set by a failed write: recording has stopped.
    failed: Option<String>,
}

/// Lines recorded and not yet written to the file.
struct Pending {
    /// The lines as text; for a gzip trace only those not compressed yet (less than [`GZIP_CHUNK`] bytes).
    text: Vec<u8>,
    /// For a gzip trace, the member that the next write-out ends.
    member: Option<GzEncoder<Vec<u8>>>,
}

impl Pending {
    fn line(&mut self, line: std::fmt::Arguments<'_>) -> io::Result<()> {
        self.text.write_fmt(line)?;
        match &mut self.member {
            Some(member) if self.text.len() >= GZIP_CHUNK => {
                member.write_all(&self.text)?;
                self.text.clear();
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The bytes to append to the file: the text, or a complete gzip member. Starts the next one.
    fn take(&mut self) -> io::Result<Vec<u8>> {
        match &mut self.member {
            None => {
                let capacity = self.text.capacity();
                Ok(std::mem::replace(&mut self.text, Vec::with_capacity(capacity)))
            }
            Some(member) => {
                member.write_all(&self.text)?;
                self.text.clear();
                std::mem::replace(member, gzip_member()).finish()
            }
        }
    }
}

/// A gzip member at the fastest level, since it is compressed under the recording's lock on an allocating thread:
/// on a trace of 10^6 lines its output was a third larger than the default level's, in an eighth of the time.
fn gzip_member() -> GzEncoder<Vec<u8>> {
    GzEncoder::new(Vec::new(), Compression::fast())
}

impl Recorder {
    /// Creates (or truncates) the trace file for `UMM_TRACE=value` and writes its header. An error names
    /// `UMM_TRACE`, its value and the reason.
    pub(crate) fn create(value: &str) -> Result<Self, String> {
        let asked = value.trim();
        if asked.is_empty() {
            return Err(format!("UMM_TRACE={value:?} is not a file path (unset it to record nothing)"));
        }
        let pid = std::process::id();
        let path = PathBuf::from(asked.replace("{pid}", &pid.to_string()));
        let file = File::create(&path).map_err(|e| {
            let named = if path.as_os_str() == asked { String::new() } else { format!(" ({})", path.display()) };
            format!("UMM_TRACE={value:?}: cannot create the trace file{named}: {e} (unset UMM_TRACE to record nothing)")
        })?;
        let gzip = path.extension().is_some_and(|e| e == "gz");
        let state = State {
            file,
            pending: Pending { text: Vec::new(), member: gzip.then(gzip_member) },
            pending_lines: 0,
            next_id: 0,
            streams: HashMap::new(),
            failed: None,
        };
        let recorder = Recorder { value: value.to_string(), path, pid, state: Mutex::new(state) };
        {
            let mut state = recorder.state.lock();
            let program = std::env::args().next().unwrap_or_default().replace(['\n', '\r'], " ");
            let comments = [
                HEADER.to_string(),
                format!(
                    "# recorded by umm-capi {} (UMM_TRACE) from {program}, process {pid}",
                    env!("CARGO_PKG_VERSION")
                ),
                "# sizes are requested bytes; streams are numbered in order of first use; every device in one trace"
                    .to_string(),
            ];
            for line in comments {
                recorder.record(&mut state, format_args!("{line}\n"));
            }
            recorder.write_out(&mut state)?;
        }
        Ok(recorder)
    }

    /// Records an allocation; its ID, or `None` once recording has stopped.
    fn alloc(&self, bytes: u64, stream: u64) -> Option<u64> {
        let mut state = self.state.lock();
        if state.failed.is_some() {
            return None;
        }
        let id = state.next_id;
        state.next_id += 1;
        let count = state.streams.len() as u64;
        let number = *state.streams.entry(stream).or_insert(count);
        self.record(&mut state, format_args!("a {id} {bytes} {number}\n"));
        Some(id)
    }

    fn free(&self, id: u64) {
        let mut state = self.state.lock();
        self.record(&mut state, format_args!("f {id}\n"));
    }

    /// Appends a line; writes the pending lines out every [`FLUSH_EVERY`] lines.
    fn record(&self, state: &mut State, line: std::fmt::Arguments<'_>) {
        if state.failed.is_some() {
            return;
        }
        if let Err(e) = state.pending.line(line) {
            self.fail(state, &e);
            return;
        }
        state.pending_lines += 1;
        if state.pending_lines >= FLUSH_EVERY {
            let _ = self.write_out(state);
        }
    }

    fn flush(&self) -> Result<(), String> {
        self.write_out(&mut self.state.lock())
    }

    /// Appends the pending lines to the file: whole lines, or a complete gzip member.
    fn write_out(&self, state: &mut State) -> Result<(), String> {
        if let Some(e) = &state.failed {
            return Err(e.clone());
        }
        if state.pending_lines == 0 {
            return Ok(());
        }
        state.pending_lines = 0;
        let bytes = state.pending.take();
        if std::process::id() != self.pid {
            return Ok(()); // a forked child: the file is the parent's
        }
        match bytes.and_then(|bytes| state.file.write_all(&bytes)) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(state, &e)),
        }
    }

    /// Stops recording after a failed write; the message, which is printed once.
    fn fail(&self, state: &mut State, e: &io::Error) -> String {
        let message = format!(
            "writing the trace file of UMM_TRACE={:?} ({}) failed: {e}; recording stopped, the file holds the \
             allocations up to the last write that went through",
            self.value,
            self.path.display()
        );
        eprintln!("umm: {message}");
        state.failed = Some(message.clone());
        message
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::io::Read;
    use std::path::Path;
    use std::sync::Arc;

    /// A fresh path in the temporary directory, removed when dropped.
    struct TempPath(PathBuf);

    impl TempPath {
        fn new(name: &str) -> Self {
            TempPath(std::env::temp_dir().join(format!("umm-capi-trace-{}-{name}", std::process::id())))
        }
        fn text(&self) -> String {
            read_trace(&self.0)
        }
    }

    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// The file's text; a `.gz` file is decompressed whole (all members) and must end cleanly.
    fn read_trace(path: &Path) -> String {
        let bytes = std::fs::read(path).expect("read the trace");
        if path.extension().is_some_and(|e| e == "gz") {
            assert_eq!(bytes.get(..2), Some(&[0x1f, 0x8b][..]), "gzip magic");
            let mut text = String::new();
            flate2::read::MultiGzDecoder::new(&bytes[..]).read_to_string(&mut text).expect("valid gzip");
            text
        } else {
            String::from_utf8(bytes).expect("UTF-8")
        }
    }

    #[derive(Debug, PartialEq)]
    enum Line {
        Alloc { id: u64, bytes: u64, stream: u64 },
        Free { id: u64 },
    }

    /// Checks the header and that every line is a comment or a well-formed op (the format of `umm::trace`, which
    /// this crate does not depend on); returns the ops.
    fn parse(text: &str) -> Vec<Line> {
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(HEADER), "first line");
        assert!(text.ends_with('\n'), "the last line is whole");
        let mut ops = Vec::new();
        for line in lines {
            if line.starts_with("# ") {
                continue;
            }
            let fields: Vec<&str> = line.split(' ').collect();
            let n = |i: usize| fields[i].parse::<u64>().unwrap_or_else(|_| panic!("not a number in {line:?}"));
            match (fields[0], fields.len()) {
                ("a", 4) => ops.push(Line::Alloc { id: n(1), bytes: n(2), stream: n(3) }),
                ("f", 2) => ops.push(Line::Free { id: n(1) }),
                _ => panic!("not an op: {line:?}"),
            }
        }
        ops
    }

    #[test]
    fn streams_are_numbered_in_order_of_first_use_and_ids_count_allocations() {
        let path = TempPath::new("streams.trace");
        let rec = Recorder::create(path.0.to_str().unwrap()).unwrap();
        let raw = [0x7f00_dead_0000_u64, 0, 0x7f00_dead_0000, 0x5555_beef_0000, 0, 0x1234];
        let ids: Vec<u64> = raw.iter().map(|&s| rec.alloc(4096, s).unwrap()).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5]);
        rec.free(1);
        rec.free(0);
        assert_eq!(rec.alloc(1, 0x5555_beef_0000), Some(6));
        rec.flush().unwrap();
        let text = path.text();
        assert!(text.contains("# recorded by umm-capi"), "{text}");
        let ops = parse(&text);
        let streams: Vec<u64> = ops
            .iter()
            .filter_map(|op| match op {
                Line::Alloc { stream, .. } => Some(*stream),
                Line::Free { .. } => None,
            })
            .collect();
        assert_eq!(streams, [0, 1, 0, 2, 1, 3, 2]);
        assert_eq!(ops[6], Line::Free { id: 1 });
        assert_eq!(ops[7], Line::Free { id: 0 });
        assert_eq!(ops[8], Line::Alloc { id: 6, bytes: 1, stream: 2 });
        assert!(text.ends_with("a 6 1 2\n"), "{text}");
    }

    /// Eight threads allocate and free through a model of the registry (the `a` line before the pointer is
    /// published in a shared live map; the `f` line after it leaves the map and before the address goes back to
    /// a shared free list), freeing each other's pointers, so addresses are reused across threads. Every free's
    /// line follows its allocation's, IDs are unique and in order, and every stream number is dense.
    #[test]
    fn eight_threads_keep_each_free_after_its_allocation() {
        const THREADS: u64 = 8;
        const OPS: u64 = 6_000; // per thread; more than FLUSH_EVERY in all, so periodic write-outs happen too
        let path = TempPath::new("threads.trace.gz");
        let rec = Arc::new(Recorder::create(path.0.to_str().unwrap()).unwrap());
        let live: Arc<Mutex<HashMap<u64, u64>>> = Arc::default();
        let free_list: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new((1..=64).map(|a| a << 12).collect()));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let (rec, live, free_list) = (rec.clone(), live.clone(), free_list.clone());
                std::thread::spawn(move || {
                    let mut state = 0x9E37_79B9_7F4A_7C15_u64 ^ t;
                    for i in 0..OPS {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        let address = if !state.is_multiple_of(3) { free_list.lock().pop() } else { None };
                        match address {
                            Some(address) => {
                                let stream = 0x7000_0000 + (state >> 8) % 5 * 0x100;
                                let id = rec.alloc(1 + i, stream).unwrap();
                                live.lock().insert(address, id);
                            }
                            None => {
                                // Any live address, whichever thread allocated it.
                                let taken = {
                                    let mut live = live.lock();
                                    let key = live.keys().nth((state >> 16) as usize % live.len().max(1)).copied();
                                    key.and_then(|k| live.remove(&k).map(|id| (k, id)))
                                };
                                if let Some((address, id)) = taken {
                                    rec.free(id);
                                    free_list.lock().push(address);
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        rec.flush().unwrap();
        let ops = parse(&path.text());
        let mut allocated = HashSet::new();
        let mut freed = HashSet::new();
        let mut streams_seen = 0;
        let mut next_id = 0;
        for op in &ops {
            match *op {
                Line::Alloc { id, stream, .. } => {
                    assert_eq!(id, next_id, "IDs in order");
                    next_id += 1;
                    assert!(allocated.insert(id));
                    assert!(stream <= streams_seen, "stream {stream} before {streams_seen}");
                    streams_seen = streams_seen.max(stream + 1);
                }
                Line::Free { id } => {
                    assert!(allocated.contains(&id), "f {id} before a {id}");
                    assert!(freed.insert(id), "f {id} twice");
                }
            }
        }
        assert_eq!(streams_seen, 5);
        assert_eq!(allocated.len() - freed.len(), live.lock().len());
        assert!(ops.len() as u64 > u64::from(FLUSH_EVERY), "{} ops", ops.len());
    }

    /// A gzip trace is valid on disk after each write-out, with nothing written in between: the periodic one
    /// (FLUSH_EVERY lines) and the explicit one, in one stream of gzip members.
    #[test]
    fn gzip_trace_is_valid_after_every_write_out() {
        let path = TempPath::new("members.trace.gz");
        let rec = Recorder::create(path.0.to_str().unwrap()).unwrap();
        assert_eq!(parse(&path.text()), [], "header alone, written at creation");
        let header_bytes = std::fs::metadata(&path.0).unwrap().len();
        let every = u64::from(FLUSH_EVERY);
        for i in 0..every - 1 {
            rec.alloc(256 + i, 0).unwrap();
        }
        assert_eq!(std::fs::metadata(&path.0).unwrap().len(), header_bytes, "nothing written between write-outs");
        rec.alloc(1, 0).unwrap();
        let ops = parse(&path.text());
        assert_eq!(ops.len() as u64, every, "the periodic write-out");
        rec.free(0);
        rec.alloc(7, 42).unwrap();
        rec.flush().unwrap();
        let size = std::fs::metadata(&path.0).unwrap().len();
        rec.flush().unwrap();
        assert_eq!(std::fs::metadata(&path.0).unwrap().len(), size, "nothing pending: no empty member");
        let ops = parse(&path.text());
        assert_eq!(ops[ops.len() - 2..], [Line::Free { id: 0 }, Line::Alloc { id: every, bytes: 7, stream: 1 }]);
    }

    #[test]
    fn plain_trace_is_text_with_pid_replaced() {
        let asked = std::env::temp_dir().join("umm-capi-trace-{pid}-plain.trace");
        let rec = Recorder::create(asked.to_str().unwrap()).unwrap();
        let path = TempPath(PathBuf::from(asked.to_str().unwrap().replace("{pid}", &std::process::id().to_string())));
        assert_eq!(rec.path, path.0);
        rec.alloc(100, 0).unwrap();
        rec.free(0);
        rec.flush().unwrap();
        assert_eq!(parse(&path.text()), [Line::Alloc { id: 0, bytes: 100, stream: 0 }, Line::Free { id: 0 }]);
    }

    #[test]
    fn bad_path_is_an_error_naming_the_variable() {
        let dir = std::env::temp_dir().join(format!("umm-capi-no-such-dir-{}", std::process::id()));
        let value = dir.join("run.trace.gz").to_str().unwrap().to_string();
        let e = Recorder::create(&value).err().expect("an error");
        assert!(e.starts_with(&format!("UMM_TRACE={value:?}: cannot create the trace file")), "{e}");
        assert!(e.contains("No such file or directory"), "{e}");
        for empty in ["", "  "] {
            let e = Recorder::create(empty).err().expect("an error");
            assert!(e.starts_with(&format!("UMM_TRACE={empty:?} is not a file path")), "{e}");
        }
        let dir_itself = std::env::temp_dir();
        let e = Recorder::create(dir_itself.to_str().unwrap()).err().expect("a directory is no file");
        assert!(e.contains("UMM_TRACE="), "{e}");
        if cfg!(target_os = "linux") {
            // Opens, but every write fails (ENOSPC): the header's write-out already reports it.
            let e = Recorder::create("/dev/full").err().expect("a failed write");
            assert!(e.starts_with("writing the trace file of UMM_TRACE=\"/dev/full\""), "{e}");
            assert!(e.contains("recording stopped"), "{e}");
        }
    }

    /// [`start`] sets the process's recording once: this is the only test that calls it (in this process; the
    /// exit test calls it in a child). A bad path is then what `umm_trace_flush` reports, and nothing records.
    #[test]
    fn start_with_a_bad_path_is_reported_by_flush() {
        if std::env::var_os(CHILD).is_some() {
            return;
        }
        let value = "/nonexistent-umm-dir/run.trace";
        let e = start(|name| (name == "UMM_TRACE").then(|| value.to_string())).expect_err("an error");
        assert!(e.contains(&format!("UMM_TRACE={value:?}")), "{e}");
        assert_eq!(flush(), Err(e));
        assert_eq!(record_alloc(1, 0), None);
        record_free(Some(0));
    }

    const CHILD: &str = "UMM_CAPI_TRACE_TEST_CHILD";

    /// A process that records and ends without flushing leaves a complete, valid gzip trace: the exit handler
    /// writes the last lines. Runs this test binary again as a child with the path in an environment variable.
    #[test]
    fn exit_writes_the_last_lines() {
        if let Some(path) = std::env::var_os(CHILD) {
            let path = path.into_string().unwrap();
            start(|name| (name == "UMM_TRACE").then(|| path.clone())).unwrap();
            let ids: Vec<u64> = (0..100).map(|i| record_alloc(1 << (i % 40), i % 3).unwrap()).collect();
            ids.iter().step_by(2).for_each(|&id| record_free(Some(id)));
            return; // no flush: the process exits with 150 lines unwritten
        }
        let path = TempPath::new("exit.trace.gz");
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", "trace::tests::exit_writes_the_last_lines", "--test-threads=1"])
            .env(CHILD, &path.0)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran the test");
        let ops = parse(&path.text());
        assert_eq!(ops.len(), 150);
        assert_eq!(ops[1], Line::Alloc { id: 1, bytes: 2, stream: 1 });
        assert_eq!(ops[149], Line::Free { id: 98 });
    }
}
