//! Allocation traces in the `umm-trace v1` format: a reader that turns a trace into a compact op list for
//! replay, and a writer that records one (used by `UMM_TRACE` recording).
//!
//! The format is text, optionally gzip-compressed (detected by the gzip magic bytes, whatever the file name):
//! ```text
//! # umm-trace v1          (the first line, exactly: trailing spaces or a CR aside, nothing else is a trace)
//! # any comment
//! a ID BYTES STREAM       allocate BYTES on STREAM (0, 1, ...) and call the block ID
//! f ID                    free block ID
//! s                       a step ends here (a training or inference loop's step, marked by its program)
//! ```
//! Blocks still live at the end are simply left live.
//!
//! At load time block IDs are remapped to dense slots (a slot is reused once its block is freed), so a replay
//! keeps its live blocks in a `Vec` indexed by slot and never hashes.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The first line every `umm-trace v1` file starts with.
pub const HEADER: &str = "# umm-trace v1";

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// What can go wrong reading a trace. Every message names the file (and the line, for malformed content).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be opened or read (or its gzip stream is corrupt).
    #[error("{path}: {source}")]
    Io {
        /// The trace file (or the label given to [`Trace::from_reader`]).
        path: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The first line is not `# umm-trace v1`: the file is not an umm trace (or not one this version reads).
    #[error(
        "{path}:1: not an umm trace: expected umm-trace v1 text (plain or gzip-compressed) whose first line is \
         `{HEADER}`, found {found}"
    )]
    Header {
        /// The trace file.
        path: String,
        /// What the file starts with, in words: the first line in backquotes (shortened), `binary data` or
        /// `an empty file`.
        found: String,
    },
    /// The file starts with the gzip magic bytes but does not decompress (corrupt, truncated, or not gzip).
    #[error(
        "{path}: not an umm trace: it starts like gzip but does not decompress ({source}); expected umm-trace v1 \
         text, plain or gzip-compressed"
    )]
    Gzip {
        /// The trace file.
        path: String,
        /// The decompressor's error.
        #[source]
        source: io::Error,
    },
    /// A line that is not a valid op.
    #[error("{path}:{line}: {what}")]
    Malformed {
        /// The trace file.
        path: String,
        /// 1-based line number.
        line: u64,
        /// What was wrong.
        what: String,
    },
}

/// One operation of a trace, with block IDs remapped to dense slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Allocate `bytes` on `stream` and keep the block in `slot`.
    Alloc {
        /// Dense slot (`0..Trace::slots`) the block is kept in until freed.
        slot: u32,
        /// Bytes asked for (never zero).
        bytes: u64,
        /// Stream number.
        stream: u32,
    },
    /// Free the block in `slot`.
    Free {
        /// Dense slot of a live block.
        slot: u32,
    },
}

/// A loaded trace: its ops and what they add up to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Trace {
    /// Name: the file name without `.gz` and `.trace` (`gpt2_train` for `gpt2_train.trace.gz`).
    pub name: String,
    /// The ops in order.
    pub ops: Vec<Op>,
    /// Number of slots: the most blocks live at once. Every slot in `ops` is below it.
    pub slots: u32,
    /// The trace's own maximum of live bytes (sum of requested sizes of live blocks).
    pub peak_live_bytes: u64,
    /// Allocation ops.
    pub allocs: u64,
    /// Free ops.
    pub frees: u64,
    /// Number of streams used (highest stream number + 1; 0 for a trace with no allocation).
    pub streams: u32,
    /// The largest single allocation in bytes.
    pub max_block_bytes: u64,
    /// Where steps end: after how many of `ops` each `s` line came (a step marked with `umm_mark_step` or
    /// [`TraceWriter::step`]), in order. Empty for a trace with no marks.
    pub steps: Vec<usize>,
}

impl Trace {
    /// Loads a trace file, plain or gzip (detected by content). O(ops).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let label = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|source| TraceError::Io { path: label.clone(), source })?;
        Self::from_reader(name_of(path), &label, file)
    }

    /// Parses a trace from `reader` (plain or gzip, detected by content). `label` names the source in errors.
    pub fn from_reader(name: impl Into<String>, label: &str, reader: impl Read) -> Result<Self, TraceError> {
        let mut buffered = BufReader::with_capacity(1 << 16, reader);
        let head = buffered.fill_buf().map_err(|source| TraceError::Io { path: label.into(), source })?;
        if head.starts_with(&GZIP_MAGIC) {
            let decoder = flate2::bufread::MultiGzDecoder::new(buffered);
            parse(name.into(), label, BufReader::with_capacity(1 << 16, decoder), true)
        } else {
            parse(name.into(), label, buffered, false)
        }
    }

    /// Parses a plain-text trace held in memory. `label` names the source in errors.
    pub fn parse_str(name: impl Into<String>, label: &str, text: &str) -> Result<Self, TraceError> {
        parse(name.into(), label, text.as_bytes(), false)
    }

    /// Number of ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the trace has no op.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Writes the trace's ops and step marks to `out` (after its header), so that reading them back gives the
    /// same ops, slots and marks. Blocks are named by the order of their allocations (0, 1, ...), since slots
    /// are reused and cannot name them.
    pub fn write<W: Write>(&self, out: &mut TraceWriter<W>) -> io::Result<()> {
        let mut ids = vec![0u64; self.slots as usize];
        let mut next_id = 0u64;
        let mut marks = self.steps.iter().copied().peekable();
        for (at, op) in self.ops.iter().enumerate() {
            while marks.next_if(|&mark| mark <= at).is_some() {
                out.step()?;
            }
            match *op {
                Op::Alloc { slot, bytes, stream } => {
                    let id = ids.get_mut(slot as usize).ok_or_else(|| bad_slot(slot, self.slots))?;
                    *id = next_id;
                    next_id += 1;
                    out.alloc(*id, bytes, u64::from(stream))?;
                }
                Op::Free { slot } => out.free(*ids.get(slot as usize).ok_or_else(|| bad_slot(slot, self.slots))?)?,
            }
        }
        for _ in marks {
            out.step()?;
        }
        Ok(())
    }

    /// Writes the trace to a file at `path` (gzip-compressed when the name ends in `.gz`), with `comment` as
    /// `#` lines after the header.
    pub fn save(&self, path: impl AsRef<Path>, comment: &str) -> io::Result<()> {
        let mut out = TraceWriter::create(path)?;
        out.comment(comment)?;
        self.write(&mut out)?;
        out.close()
    }
}

/// The error for an op whose slot is not below the trace's slot count (a `Trace` built by hand, not read).
fn bad_slot(slot: u32, slots: u32) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("op with slot {slot}, but the trace has {slots} slots"))
}

/// A trace's name from its path: the file name without `.gz` and then `.trace`.
pub fn name_of(path: &Path) -> String {
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    let file = file.strip_suffix(".gz").unwrap_or(&file);
    file.strip_suffix(".trace").unwrap_or(file).to_string()
}

/// Builds a trace op by op: block IDs to dense slots, live bytes, counts. The line reader feeds it, and so do
/// converters from other formats (`umm_tools::torch_snapshot`); its errors say what is wrong, without a place.
pub struct TraceBuilder {
    trace: Trace,
    /// Live block ID → (slot, bytes).
    live: HashMap<u64, (u32, u64)>,
    /// Slots whose blocks were freed, reused before new ones are made.
    vacant: Vec<u32>,
    live_bytes: u64,
}

impl TraceBuilder {
    /// An empty trace called `name`.
    pub fn new(name: String) -> Self {
        Self { trace: Trace { name, ..Trace::default() }, live: HashMap::new(), vacant: Vec::new(), live_bytes: 0 }
    }

    /// Allocates `bytes` (not zero) on `stream` as block `id`, which must not be live.
    pub fn alloc(&mut self, id: u64, bytes: u64, stream: u32) -> Result<(), String> {
        if bytes == 0 {
            return Err(format!("allocation of block {id} has zero bytes"));
        }
        if self.live.contains_key(&id) {
            return Err(format!("block {id} is allocated again while still live"));
        }
        let slot = match self.vacant.pop() {
            Some(slot) => slot,
            None => {
                let slot = self.trace.slots;
                self.trace.slots = slot.checked_add(1).ok_or("more than 2^32 blocks live at once")?;
                slot
            }
        };
        self.live.insert(id, (slot, bytes));
        self.live_bytes = self.live_bytes.saturating_add(bytes);
        let t = &mut self.trace;
        t.peak_live_bytes = t.peak_live_bytes.max(self.live_bytes);
        t.max_block_bytes = t.max_block_bytes.max(bytes);
        t.streams = t.streams.max(stream.saturating_add(1));
        t.allocs += 1;
        t.ops.push(Op::Alloc { slot, bytes, stream });
        Ok(())
    }

    /// Frees block `id`, which must be live.
    pub fn free(&mut self, id: u64) -> Result<(), String> {
        let Some((slot, bytes)) = self.live.remove(&id) else {
            return Err(format!("free of block {id}, which is not live (never allocated or already freed)"));
        };
        self.vacant.push(slot);
        // The sum saturates at 2^64 - 1 (the peak is then that), so the difference may not be exact.
        self.live_bytes = self.live_bytes.saturating_sub(bytes);
        self.trace.frees += 1;
        self.trace.ops.push(Op::Free { slot });
        Ok(())
    }

    /// Marks the end of a step after the ops so far.
    pub fn step(&mut self) {
        self.trace.steps.push(self.trace.ops.len());
    }

    /// The trace built.
    pub fn finish(mut self) -> Trace {
        self.trace.ops.shrink_to_fit();
        self.trace
    }
}

/// Reads a trace's lines into a [`TraceBuilder`], naming the file and line in errors.
struct Builder<'a> {
    label: &'a str,
    ops: TraceBuilder,
}

impl Builder<'_> {
    fn error(&self, line: u64, what: impl fmt::Display) -> TraceError {
        TraceError::Malformed { path: self.label.to_string(), line, what: what.to_string() }
    }

    fn line(&mut self, number: u64, text: &str) -> Result<(), TraceError> {
        let text = text.trim();
        if text.is_empty() || text.starts_with('#') {
            return Ok(());
        }
        let mut fields = text.split_ascii_whitespace();
        let op = fields.next().unwrap_or_default();
        let mut field = |name: &str| -> Result<u64, TraceError> {
            let value = fields
                .next()
                .ok_or_else(|| self.error(number, format!("`{op}` op is missing its {name} (in {})", quote(text))))?;
            // Digits only: `u64::from_str` would also take a leading `+`.
            let digits = value.bytes().all(|b| b.is_ascii_digit());
            value.parse::<u64>().ok().filter(|_| digits).ok_or_else(|| {
                let problem = match value.strip_prefix('+') {
                    _ if digits => format!("is too large (at most {})", u64::MAX),
                    Some(unsigned) if !unsigned.is_empty() && unsigned.bytes().all(|b| b.is_ascii_digit()) => {
                        format!("is not a non-negative integer (write {} without the sign)", quote(unsigned))
                    }
                    _ => "is not a non-negative integer".to_string(),
                };
                self.error(number, format!("{name} {} {problem} (in {})", quote(value), quote(text)))
            })
        };
        match op {
            "a" => {
                let id = field("ID")?;
                let bytes = field("BYTES")?;
                let stream = field("STREAM")?;
                self.no_extra(number, fields.next(), text)?;
                self.alloc(number, id, bytes, stream)
            }
            "f" => {
                let id = field("ID")?;
                self.no_extra(number, fields.next(), text)?;
                self.ops.free(id).map_err(|what| self.error(number, what))
            }
            "s" => {
                self.no_extra(number, fields.next(), text)?;
                self.ops.step();
                Ok(())
            }
            other => Err(self.error(
                number,
                format!("unknown op {} (expected `a ID BYTES STREAM`, `f ID`, `s` or a `#` comment)", quote(other)),
            )),
        }
    }

    fn no_extra(&self, number: u64, extra: Option<&str>, text: &str) -> Result<(), TraceError> {
        match extra {
            Some(extra) => {
                Err(self.error(number, format!("unexpected extra field {} in {}", quote(extra), quote(text))))
            }
            None => Ok(()),
        }
    }

    fn alloc(&mut self, number: u64, id: u64, bytes: u64, stream: u64) -> Result<(), TraceError> {
        if bytes == 0 {
            return Err(self.error(number, format!("allocation of block {id} has zero bytes")));
        }
        let stream = u32::try_from(stream)
            .map_err(|_| self.error(number, format!("stream {stream} is too large (at most {})", u32::MAX)))?;
        self.ops.alloc(id, bytes, stream).map_err(|what| self.error(number, what))
    }
}

/// Longest text of a trace line quoted in an error; longer text is cut with `...`.
const QUOTE_CHARS: usize = 60;

/// `text` in backquotes for an error message: control characters escaped (so that a line of binary data cannot
/// move the terminal's cursor) and cut after [`QUOTE_CHARS`] characters.
fn quote(text: &str) -> String {
    let mut quoted = String::from("`");
    for (i, c) in text.chars().enumerate() {
        if i == QUOTE_CHARS {
            quoted.push_str("...");
            break;
        }
        if c.is_control() {
            quoted.extend(c.escape_debug());
        } else {
            quoted.push(c);
        }
    }
    quoted.push('`');
    quoted
}

/// Longest first line read while looking for the header, so that a binary file without line breaks is not read
/// whole before being refused.
const HEADER_SCAN: u64 = 256;

/// Parses the text of a trace; `gzip` says whether `reader` decompresses, so that its read errors are reported as
/// corrupt gzip data.
fn parse(name: String, label: &str, mut reader: impl BufRead, gzip: bool) -> Result<Trace, TraceError> {
    let io_error = |source: io::Error| {
        let corrupt = matches!(
            source.kind(),
            io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof
        );
        if gzip && corrupt {
            TraceError::Gzip { path: label.to_string(), source }
        } else {
            TraceError::Io { path: label.to_string(), source }
        }
    };
    let mut line = Vec::new();
    reader.by_ref().take(HEADER_SCAN).read_until(b'\n', &mut line).map_err(io_error)?;
    let first = std::str::from_utf8(&line).ok().map(str::trim_end);
    if first != Some(HEADER) {
        let found = match first {
            _ if line.is_empty() => "an empty file".to_string(),
            Some("") => "an empty first line".to_string(),
            Some(text) if !text.chars().any(|c| c.is_control() && c != '\t') => quote(text),
            _ => "binary data".to_string(),
        };
        return Err(TraceError::Header { path: label.to_string(), found });
    }
    let mut builder = Builder { label, ops: TraceBuilder::new(name) };
    let mut number = 1;
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line).map_err(io_error)? == 0 {
            break;
        }
        number += 1;
        let text = std::str::from_utf8(&line).map_err(|_| {
            builder.error(number, "the line is not UTF-8 text (umm traces are text, plain or gzip-compressed)")
        })?;
        builder.line(number, text)?;
    }
    Ok(builder.ops.finish())
}

/// Writes a trace in `umm-trace v1` text. Writes nothing beyond what it is told: it does not check that frees
/// match allocations (the reader does).
pub struct TraceWriter<W: Write> {
    out: W,
}

impl<W: Write> TraceWriter<W> {
    /// Starts a trace on `out` by writing the header line.
    pub fn new(mut out: W) -> io::Result<Self> {
        writeln!(out, "{HEADER}")?;
        Ok(Self { out })
    }

    /// Writes a comment line (`# text`); line breaks in `text` become separate comment lines.
    pub fn comment(&mut self, text: &str) -> io::Result<()> {
        for line in text.lines() {
            writeln!(self.out, "# {line}")?;
        }
        Ok(())
    }

    /// Records an allocation of `bytes` on `stream`, naming the block `id`.
    pub fn alloc(&mut self, id: u64, bytes: u64, stream: u64) -> io::Result<()> {
        writeln!(self.out, "a {id} {bytes} {stream}")
    }

    /// Records the free of block `id`.
    pub fn free(&mut self, id: u64) -> io::Result<()> {
        writeln!(self.out, "f {id}")
    }

    /// Records the end of a step.
    pub fn step(&mut self) -> io::Result<()> {
        writeln!(self.out, "s")
    }

    /// Flushes and returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A trace file being written: gzip-compressed when its name ends in `.gz`.
pub enum TraceFile {
    /// Plain text.
    Plain(io::BufWriter<std::fs::File>),
    /// Gzip.
    Gzip(flate2::write::GzEncoder<io::BufWriter<std::fs::File>>),
}

impl Write for TraceFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            TraceFile::Plain(w) => w.write(buf),
            TraceFile::Gzip(w) => w.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            TraceFile::Plain(w) => w.flush(),
            TraceFile::Gzip(w) => w.flush(),
        }
    }
}

impl TraceWriter<TraceFile> {
    /// Creates (or truncates) the trace file at `path`, gzip-compressed when the name ends in `.gz`.
    pub fn create(path: impl AsRef<Path>) -> io::Result<Self> {
        let path: PathBuf = path.as_ref().into();
        let file = io::BufWriter::new(std::fs::File::create(&path)?);
        let out = if path.extension().is_some_and(|e| e == "gz") {
            TraceFile::Gzip(flate2::write::GzEncoder::new(file, flate2::Compression::default()))
        } else {
            TraceFile::Plain(file)
        };
        Self::new(out)
    }

    /// Finishes the file: writes the gzip trailer if compressed, and flushes.
    pub fn close(self) -> io::Result<()> {
        match self.finish()? {
            TraceFile::Plain(mut w) => w.flush(),
            TraceFile::Gzip(w) => w.finish()?.flush(),
        }
    }
}

#[cfg(test)]
mod tests;
