//! Valid traces of thousands of ops checked against a reference model, then broken deep inside.
//!
//! A generator writes `umm-trace v1` traces shaped like real workloads (training steps with weights, activations
//! and gradients; serving requests on several streams; random churn): thousands of ops, up to thousands of
//! blocks live at once, several streams, step marks, sizes from one byte to gigabytes, frees out of order, IDs
//! reused after their free, blocks left live, comments, blank lines and odd spacing. A model that keeps its own
//! live set (and shares no code with the reader) says what each trace holds. The reader must agree with it op
//! by op, on the plain text, on gzip (one member or two) and after writing the trace back; `umm_tools::replay::replay`
//! on the three simulated devices must replay every op without an error, with the model's peak of live bytes
//! (which the pool's own count of requested bytes reaches too) and at least that much reserved. Then each valid
//! trace is broken at one line deep inside it (a bad number, a field too few or too many, an unknown op, a
//! zero size, a block allocated twice or freed when not live, bytes that are not UTF-8), and the reader must
//! refuse it at that line, naming the problem, plain and gzip, having taken every line before it. Last, the
//! `umm` binary replays and plans a few generated traces, and its figures must be the model's.
//!
//! 200 valid traces and 2,000 broken ones here, 10 times more in the ignored `*_long` tests (`cargo test --release
//! --test trace_oracle -- --ignored`); `UMM_FUZZ_CASES=N` overrides both, `UMM_FUZZ_SEED` changes the seeds
//! (see `tests/fuzz_support`).

mod fuzz_support;

use fuzz_support::{cases, run, Rng};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};
use umm::backends::{Pool, PoolConfig, PoolStats, SimBackend};
use umm::trace::{Op, Trace, TraceError, TraceWriter, HEADER};
use umm_tools::replay::{human_bytes, ReplayOptions};

const LABEL: &str = "oracle.trace";
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Capacity of the simulated devices the library replays run on: far above any generated trace's peak.
const CAPACITY: u64 = 1 << 44;

/// Valid traces per CI run (each replayed), and broken ones.
const VALID_CASES: u64 = 200;
const BROKEN_CASES: u64 = 2_000;

// ---------------------------------------------------------------------------------------------------------------
// The model

/// A line of a trace that the reader turns into an op or a step mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Alloc { id: u64, bytes: u64, stream: u32 },
    Free { id: u64 },
    Step,
}

/// What a run of events holds, computed from the events alone.
#[derive(Debug, Default)]
struct Model {
    ops: u64,
    allocs: u64,
    frees: u64,
    /// The most live bytes at once.
    peak_live_bytes: u64,
    /// The most live bytes at once with each block rounded up to 512 bytes (`umm plan`'s lower bound).
    peak_aligned_bytes: u64,
    /// The most blocks live at once.
    peak_live_blocks: u64,
    /// Live blocks (ID → bytes) at the end.
    live: HashMap<u64, u64>,
    /// IDs freed and not allocated again.
    freed: HashSet<u64>,
    /// Highest stream number + 1 (at most `u32::MAX`, as [`Trace::streams`] counts).
    streams: u32,
    max_block_bytes: u64,
    /// Ops before each mark.
    steps: Vec<usize>,
}

impl Model {
    fn of<'a>(events: impl IntoIterator<Item = &'a Event>) -> Model {
        let mut m = Model::default();
        let (mut live, mut aligned) = (0u128, 0u128);
        for event in events {
            match *event {
                Event::Alloc { id, bytes, stream } => {
                    assert!(bytes > 0 && m.live.insert(id, bytes).is_none(), "the generator wrote a bad alloc");
                    m.freed.remove(&id);
                    live += u128::from(bytes);
                    aligned += u128::from(bytes.div_ceil(512) * 512);
                    m.peak_live_bytes = m.peak_live_bytes.max(u64::try_from(live).unwrap());
                    m.peak_aligned_bytes = m.peak_aligned_bytes.max(u64::try_from(aligned).unwrap());
                    m.peak_live_blocks = m.peak_live_blocks.max(m.live.len() as u64);
                    m.streams = m.streams.max(stream.saturating_add(1));
                    m.max_block_bytes = m.max_block_bytes.max(bytes);
                    m.allocs += 1;
                    m.ops += 1;
                }
                Event::Free { id } => {
                    let bytes = m.live.remove(&id).expect("the generator freed a block that is not live");
                    live -= u128::from(bytes);
                    aligned -= u128::from(bytes.div_ceil(512) * 512);
                    m.freed.insert(id);
                    m.frees += 1;
                    m.ops += 1;
                }
                Event::Step => m.steps.push(m.ops as usize),
            }
        }
        m
    }

    fn live_bytes(&self) -> u64 {
        self.live.values().sum()
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The generator

/// A valid trace: its text and the events of its op and mark lines, each with its 1-based line number.
struct Valid {
    shape: &'static str,
    text: Vec<u8>,
    events: Vec<(u64, Event)>,
    lines: u64,
}

impl Valid {
    fn model(&self) -> Model {
        Model::of(self.events.iter().map(|(_, e)| e))
    }
}

impl fmt::Debug for Valid {
    /// A summary: the seed in the failure report makes the trace again.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.model();
        write!(
            f,
            "{} trace of {} lines: {} ops, {} streams, {} marks, peak {} live bytes in up to {} blocks",
            self.shape,
            self.lines,
            m.ops,
            m.streams,
            m.steps.len(),
            m.peak_live_bytes,
            m.peak_live_blocks
        )
    }
}

/// Writes a trace line by line, keeping the live IDs (in a vector and an index, so that freeing any of them,
/// in any order, is O(1)) and the IDs free for reuse.
struct Writer<'a> {
    rng: &'a mut Rng,
    text: Vec<u8>,
    line: u64,
    events: Vec<(u64, Event)>,
    live: Vec<u64>,
    at: HashMap<u64, usize>,
    freed: Vec<u64>,
    next_id: u64,
    max_size: u64,
    crlf: bool,
    odd_spacing: bool,
}

impl<'a> Writer<'a> {
    fn new(rng: &'a mut Rng, max_size: u64) -> Self {
        let next_id = *rng.pick(&[0, 1, 1 << 32, u64::MAX - (1 << 24)]);
        let crlf = rng.one_in(6);
        let odd_spacing = rng.one_in(4);
        let mut w = Writer {
            rng,
            text: Vec::new(),
            line: 0,
            events: Vec::new(),
            live: Vec::new(),
            at: HashMap::new(),
            freed: Vec::new(),
            next_id,
            max_size,
            crlf,
            odd_spacing,
        };
        w.push(HEADER);
        w
    }

    fn push(&mut self, line: &str) {
        self.text.extend_from_slice(line.as_bytes());
        self.text.extend_from_slice(if self.crlf { b"\r\n" } else { b"\n" });
        self.line += 1;
    }

    /// Sometimes a comment or a blank line: they must not shift the line numbers.
    fn noise(&mut self) {
        if self.rng.one_in(40) {
            let line = *self.rng.pick(&["# a comment", "", "   ", "#", "\t# indented", "# a 1 2 3"]);
            self.push(line);
        }
    }

    /// A field separator, usually one space.
    fn sep(&mut self) -> &'static str {
        if self.odd_spacing && self.rng.one_in(3) {
            ["\t", "  ", " \t "][self.rng.below(3) as usize]
        } else {
            " "
        }
    }

    fn event(&mut self, event: Event, line: String) {
        self.noise();
        self.push(&line);
        self.events.push((self.line, event));
    }

    /// A size from one byte up to `max_size`: many small ones, powers of two, some of gigabytes.
    fn size(&mut self) -> u64 {
        let rng = &mut *self.rng;
        let bytes = match rng.below(100) {
            0..=24 => rng.range(1, 512),
            25..=39 => 1 << rng.below(32),
            40..=64 => rng.range(513, 64 * KIB),
            65..=84 => rng.range(64 * KIB + 1, 16 * MIB),
            85..=97 => rng.range(16 * MIB + 1, 512 * MIB),
            _ => rng.range(512 * MIB + 1, 4 * GIB),
        };
        bytes.min(self.max_size)
    }

    /// A new block's ID: usually the next of a sequence, sometimes one freed earlier, sometimes any number.
    fn id(&mut self) -> u64 {
        if !self.freed.is_empty() && self.rng.one_in(8) {
            let i = self.rng.below(self.freed.len() as u64) as usize;
            let id = self.freed.swap_remove(i);
            if !self.at.contains_key(&id) {
                return id;
            }
        }
        if self.rng.one_in(50) {
            let id = self.rng.next_u64();
            if !self.at.contains_key(&id) {
                return id;
            }
        }
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if !self.at.contains_key(&id) {
                return id;
            }
        }
    }

    fn alloc(&mut self, bytes: u64, stream: u32) -> u64 {
        let id = self.id();
        self.at.insert(id, self.live.len());
        self.live.push(id);
        let zeros = if self.odd_spacing && self.rng.one_in(10) { "00" } else { "" };
        let (s1, s2, s3) = (self.sep(), self.sep(), self.sep());
        self.event(Event::Alloc { id, bytes, stream }, format!("a{s1}{zeros}{id}{s2}{bytes}{s3}{stream}"));
        id
    }

    fn free(&mut self, id: u64) {
        let i = self.at.remove(&id).expect("a live block");
        self.live.swap_remove(i);
        if let Some(&moved) = self.live.get(i) {
            self.at.insert(moved, i);
        }
        self.freed.push(id);
        let s = self.sep();
        let lead = if self.odd_spacing && self.rng.one_in(10) { "  " } else { "" };
        self.event(Event::Free { id }, format!("{lead}f{s}{id}"));
    }

    fn free_any(&mut self) {
        let id = self.live[self.rng.below(self.live.len() as u64) as usize];
        self.free(id);
    }

    fn step(&mut self) {
        self.event(Event::Step, "s".to_string());
    }

    fn ops(&self) -> u64 {
        self.events.iter().filter(|(_, e)| *e != Event::Step).count() as u64
    }

    fn finish(self, shape: &'static str) -> Valid {
        Valid { shape, text: self.text, events: self.events, lines: self.line }
    }
}

/// Training: weights allocated first and kept, then steps of the same shape (activations forward, gradients
/// backward, temporaries freed out of order, optimizer state made in the first step), each marked; at the end
/// some weights are freed and the rest left live.
fn training(w: &mut Writer, ops: u64) {
    let streams = w.rng.range(1, 3) as u32;
    let mut weights = Vec::new();
    for _ in 0..w.rng.range(5, 200) {
        let bytes = w.size();
        weights.push(w.alloc(bytes, 0));
    }
    let layers: Vec<u64> = (0..w.rng.range(4, 60)).map(|_| w.size()).collect();
    if w.rng.one_in(3) {
        w.step();
    }
    let mut optimizer = Vec::new();
    let mut first = true;
    while w.ops() < ops {
        let mut activations = Vec::new();
        let mut temporaries = Vec::new();
        for (i, &bytes) in layers.iter().enumerate() {
            activations.push(w.alloc(bytes, i as u32 % streams));
            if i % 3 == 1 {
                temporaries.push(w.alloc(bytes / 2 + 1, i as u32 % streams));
            }
            if temporaries.len() > 2 {
                let t = temporaries.remove(w.rng.below(temporaries.len() as u64) as usize);
                w.free(t);
            }
        }
        for t in temporaries {
            w.free(t);
        }
        let mut gradients = Vec::new();
        for (i, &bytes) in layers.iter().enumerate().rev() {
            gradients.push(w.alloc(bytes, i as u32 % streams));
            w.free(activations[i]);
            if gradients.len() > 3 {
                let g = gradients.swap_remove(w.rng.below(gradients.len() as u64) as usize);
                w.free(g);
            }
        }
        if first {
            for _ in &weights {
                let bytes = w.size();
                optimizer.push(w.alloc(bytes, 0));
            }
            first = false;
        }
        while let Some(g) = gradients.pop() {
            w.free(g);
        }
        match w.rng.below(8) {
            0 => {}
            1 => {
                w.step();
                w.step();
            }
            _ => w.step(),
        }
    }
    for id in weights.into_iter().chain(optimizer) {
        if w.rng.one_in(2) {
            w.free(id);
        }
    }
}

/// Serving: requests on several streams, each a few blocks freed together in any order when it completes
/// (requests complete out of order), a growing cache of long-lived blocks, a mark every so many requests.
fn serving(w: &mut Writer, ops: u64) {
    let streams = w.rng.range(2, 8);
    let mut requests: Vec<Vec<u64>> = Vec::new();
    let mut cache = Vec::new();
    let mut served = 0u64;
    let busy = w.rng.range(4, 400) as usize;
    while w.ops() < ops {
        if requests.len() < busy && (requests.is_empty() || w.rng.below(3) != 0) {
            let stream = w.rng.below(streams) as u32;
            let blocks = (0..w.rng.range(1, 6)).map(|_| w.size()).collect::<Vec<_>>();
            let request = blocks.into_iter().map(|b| w.alloc(b, stream)).collect();
            requests.push(request);
            if w.rng.one_in(10) {
                let bytes = w.size();
                cache.push(w.alloc(bytes, stream));
            }
        } else {
            let i = w.rng.below(requests.len() as u64) as usize;
            let mut request = requests.swap_remove(i);
            while !request.is_empty() {
                let id = request.swap_remove(w.rng.below(request.len() as u64) as usize);
                w.free(id);
            }
            served += 1;
            if served.is_multiple_of(16) {
                w.step();
            }
            if cache.len() > 50 && w.rng.one_in(4) {
                let id = cache.remove(0);
                w.free(id);
            }
        }
    }
}

/// Churn: allocations and frees of random live blocks, around a number of live blocks that drifts between
/// none and thousands, on up to 8 streams (sometimes stream `u32::MAX`), a mark now and then.
fn churn(w: &mut Writer, ops: u64) {
    let streams = w.rng.range(1, 8);
    let mut target = w.rng.range(1, 3000);
    while w.ops() < ops {
        if w.rng.one_in(500) {
            target = w.rng.range(0, 3000);
        }
        let grow = w.live.is_empty() || ((w.live.len() as u64) < target && w.rng.below(4) != 0);
        if grow || w.rng.one_in(5) {
            let stream = if w.rng.one_in(200) { u32::MAX } else { w.rng.below(streams) as u32 };
            let bytes = w.size();
            w.alloc(bytes, stream);
        } else {
            w.free_any();
        }
        if w.rng.one_in(300) {
            w.step();
        }
    }
}

/// A valid trace of `ops` ops or a few more, of a shape picked at random (or `shape`), sizes at most
/// `max_size`; sometimes churn follows the shape.
fn valid(rng: &mut Rng, ops: u64, max_size: u64, shape: Option<&'static str>) -> Valid {
    let shape = shape.unwrap_or_else(|| *rng.pick(&["training", "serving", "churn"]));
    let tail = rng.one_in(4);
    let mut w = Writer::new(rng, max_size);
    let main = if tail { ops * 3 / 4 } else { ops };
    match shape {
        "training" => training(&mut w, main),
        "serving" => serving(&mut w, main),
        _ => churn(&mut w, main),
    }
    if tail {
        churn(&mut w, ops);
    }
    w.finish(shape)
}

// ---------------------------------------------------------------------------------------------------------------
// Checks of valid traces

fn gzip(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for part in parts {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(part).unwrap();
        out.extend(encoder.finish().unwrap());
    }
    out
}

fn read(input: &[u8]) -> Result<Trace, TraceError> {
    Trace::from_reader("oracle", LABEL, input)
}

/// The reader's trace against the model: every figure, and op by op the bytes and stream of each allocation,
/// each free naming the slot its ID's allocation got, each slot free when allocated, the marks in place.
fn check_against_model(trace: &Trace, valid: &Valid, model: &Model) -> Result<(), String> {
    let figures = |t: &Trace| (t.len() as u64, t.allocs, t.frees, t.peak_live_bytes, t.streams, t.max_block_bytes);
    let expected = (model.ops, model.allocs, model.frees, model.peak_live_bytes, model.streams, model.max_block_bytes);
    if figures(trace) != expected {
        return Err(format!("(ops, allocs, frees, peak, streams, max block) {:?}, model {expected:?}", figures(trace)));
    }
    if (u64::from(trace.slots), &trace.steps) != (model.peak_live_blocks, &model.steps) {
        return Err(format!("slots {} and marks {:?}, model {:?}", trace.slots, trace.steps, model));
    }
    let mut slot_of = HashMap::new();
    let mut taken = vec![false; trace.slots as usize];
    let mut ops = trace.ops.iter();
    for &(line, event) in &valid.events {
        let op = match event {
            Event::Step => continue,
            _ => *ops.next().ok_or(format!("line {line}: no op left"))?,
        };
        match (event, op) {
            (Event::Alloc { id, bytes, stream }, Op::Alloc { slot, bytes: b, stream: s })
                if (b, s) == (bytes, stream) =>
            {
                if std::mem::replace(&mut taken[slot as usize], true) {
                    return Err(format!("line {line}: allocation into slot {slot}, which is taken"));
                }
                slot_of.insert(id, slot);
            }
            (Event::Free { id }, Op::Free { slot }) if slot_of.remove(&id) == Some(slot) => {
                taken[slot as usize] = false;
            }
            _ => return Err(format!("line {line}: {event:?} read as {op:?}")),
        }
    }
    Ok(())
}

/// A simulated device of the kind `backend` names, as `umm replay` makes them.
fn sim(backend: &str) -> SimBackend {
    match backend {
        "sim" => SimBackend::new(backend, CAPACITY),
        "sim-plain" => SimBackend::plain(backend, CAPACITY),
        _ => SimBackend::segment_per_block(backend, CAPACITY),
    }
}

/// Replays `trace` on a fresh pool of `backend` (with `repeat` warm passes and the pool's thread caches on or
/// off) and checks the report and the pool's own statistics, taken as the cold pass ends, against the model.
fn check_replay(trace: &Trace, model: &Model, backend: &str, repeat: usize, caches: bool) -> Result<(), String> {
    let config = if caches {
        PoolConfig::default()
    } else {
        PoolConfig { thread_cache_bytes: 0, thread_cache_large_bytes: 0, ..PoolConfig::default() }
    };
    let pool = Pool::new(sim(backend), config).map_err(|e| format!("pool: {e}"))?;
    let ops = trace.len() as u64;
    let mut cold: Option<PoolStats> = None;
    let mut progress = |done: u64, _total: u64| {
        if done == ops && cold.is_none() {
            cold = Some(pool.stats());
        }
    };
    let opts = ReplayOptions { repeat, progress: Some(&mut progress), ..ReplayOptions::default() };
    let report =
        umm_tools::replay::replay(trace, &pool, backend, backend, opts).map_err(|e| format!("{backend}: {e}"))?;
    let cold = cold.ok_or("no progress report at the end of the cold pass")?;
    let passes = 1 + repeat as u64;
    let got = (report.ops, report.allocs, report.frees, report.peak_live_bytes, report.ooms, report.steps);
    let want = (model.ops, model.allocs, model.frees, model.peak_live_bytes, 0, model.steps.len() as u64 * passes);
    if got != want {
        return Err(format!("{backend}: (ops, allocs, frees, peak live, ooms, steps) {got:?}, model {want:?}"));
    }
    // Every op of the cold pass reached the pool, which holds what the model has live at the end.
    let got =
        (cold.num_allocs, cold.num_frees, cold.num_ooms, cold.active_blocks.current, cold.requested_bytes.current);
    let want = (model.allocs, model.frees, 0, model.live.len() as u64, model.live_bytes());
    if got != want {
        return Err(format!("{backend}: pool (allocs, frees, ooms, live blocks, live bytes) {got:?}, model {want:?}"));
    }
    // The pool's own peaks of requested bytes and live blocks: the model's, exactly without the thread caches;
    // with them the pool folds each cache's peak onto its figures when it reads them, which may overstate the
    // high-water mark, never understate it.
    let peaks = (cold.requested_bytes.peak, cold.active_blocks.peak);
    let model_peaks = (model.peak_live_bytes, model.peak_live_blocks);
    let wrong = if caches { peaks.0 < model_peaks.0 || peaks.1 < model_peaks.1 } else { peaks != model_peaks };
    if wrong {
        return Err(format!(
            "{backend} (thread caches {caches}): pool peaks of requested bytes and live blocks {peaks:?}, model \
             {model_peaks:?}"
        ));
    }
    let reserved: Vec<u64> =
        [Some(report.peak_reserved_bytes), report.peak_reserved_bytes_warm, Some(report.peak_reserved_bytes_last)]
            .into_iter()
            .flatten()
            .collect();
    if reserved.iter().any(|&r| r < model.peak_live_bytes) || cold.reserved_bytes.peak < cold.allocated_bytes.peak {
        return Err(format!("{backend}: reserved {reserved:?} below the peak of {} live bytes", model.peak_live_bytes));
    }
    let ratio = report.peak_reserved_bytes as f64 / model.peak_live_bytes as f64;
    let expected = (model.peak_live_bytes > 0).then_some(ratio);
    if report.reserved_over_live.map(|r| (r - ratio).abs() > 1e-9) != expected.map(|_| false) {
        return Err(format!("{backend}: reserved/live {:?}, expected {expected:?}", report.reserved_over_live));
    }
    let after = pool.stats();
    if (after.active_blocks.current, after.requested_bytes.current) != (0, 0) {
        return Err(format!("{backend}: blocks left live after the replay: {after:?}"));
    }
    Ok(())
}

fn check_valid(case: &ValidCase) -> Result<(), String> {
    let valid = &case.valid;
    let model = valid.model();
    let trace = read(&valid.text).map_err(|e| format!("a valid trace refused: {e}"))?;
    check_against_model(&trace, valid, &model)?;
    // Gzip, in one member or split at a line into two: the same trace.
    let cut = valid.text.iter().take(valid.text.len() / 2).rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    for gz in [gzip(&[&valid.text]), gzip(&[&valid.text[..cut], &valid.text[cut..]])] {
        match read(&gz) {
            Ok(again) if again == trace => {}
            other => return Err(format!("gzip read differs: {:?}", other.map(|t| t.len()))),
        }
    }
    // Written back and read again: the same trace.
    let mut out = TraceWriter::new(Vec::new()).unwrap();
    trace.write(&mut out).unwrap();
    let written = out.finish().unwrap();
    if read(&written).map_err(|e| format!("the written trace is refused: {e}"))? != trace {
        return Err("the written trace reads back differently".into());
    }
    check_replay(&trace, &model, case.backend, case.repeat, true)?;
    check_replay(&trace, &model, case.backend, 0, false)
}

/// A valid trace, the simulated device it replays on and its warm passes.
struct ValidCase {
    valid: Valid,
    backend: &'static str,
    repeat: usize,
}

impl fmt::Debug for ValidCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}, on {} with {} warm passes", self.valid, self.backend, self.repeat)
    }
}

fn valid_target(cases: u64) {
    run(
        "trace oracle, valid traces",
        cases,
        |rng| {
            let ops = rng.range(2_000, 6_000);
            let valid = valid(rng, ops, 4 * GIB, None);
            ValidCase {
                valid,
                backend: ["sim", "sim-plain", "sim-wgpu"][rng.below(3) as usize],
                repeat: rng.below(2) as usize,
            }
        },
        check_valid,
    );
}

#[test]
fn valid_traces_read_and_replay_as_the_model_says() {
    valid_target(cases(VALID_CASES));
}

#[test]
#[ignore = "2,000 traces of thousands of ops: run with --release -- --ignored"]
fn valid_traces_read_and_replay_as_the_model_says_long() {
    valid_target(cases(VALID_CASES * 10));
}

// ---------------------------------------------------------------------------------------------------------------
// Traces broken deep inside

/// A valid trace with one line replaced or inserted, and what the reader must say about it.
struct Broken {
    valid: Valid,
    /// The 1-based number of the bad line.
    line: u64,
    bad: Vec<u8>,
    inserted: bool,
    /// A part of the message the reader must give.
    says: String,
}

impl fmt::Debug for Broken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = if self.inserted { "inserted" } else { "replaced" };
        write!(
            f,
            "{:?}, line {} {how} by b\"{}\", which must draw `{}`",
            self.valid,
            self.line,
            self.bad.escape_ascii(),
            self.says
        )
    }
}

impl Broken {
    fn text(&self) -> Vec<u8> {
        let mut lines: Vec<&[u8]> = self.valid.text.split_inclusive(|&b| b == b'\n').collect();
        let at = self.line as usize - 1;
        let mut bad = self.bad.clone();
        bad.push(b'\n');
        if self.inserted {
            lines.insert(at, &bad);
        } else {
            lines[at] = &bad;
        }
        lines.concat()
    }
}

/// A number that is not a valid field: negative, signed, fractional, hex, an exponent, separators, non-ASCII
/// digits. Returns the text and the start of what the reader says about it.
fn bad_number(rng: &mut Rng) -> (String, &'static str) {
    let n = rng.below(1 << 20);
    let text = match rng.below(8) {
        0 => format!("-{n}"),
        1 => return (format!("+{n}"), "is not a non-negative integer (write"),
        2 => format!("{n}.{}", rng.below(10)),
        3 => format!("0x{n:x}"),
        4 => format!("{}e{}", 1 + rng.below(9), rng.below(20)),
        5 => rng.pick(&["1_000", "1,5", "５", "٣", "NaN", "-", "+", ".", "1-"]).to_string(),
        6 => return (rng.pick(&["18446744073709551616", "99999999999999999999999"]).to_string(), "is too large"),
        _ => rng.pick(&["-0", "-18446744073709551615", "0.0", "1.", ".5", "4096.0"]).to_string(),
    };
    (text, "is not a non-negative integer")
}

/// Breaks `valid` at a line in its second half (thousands of lines in): what the line becomes follows from the
/// blocks live just before it.
fn broken(rng: &mut Rng) -> Broken {
    let ops = rng.range(2_000, 5_000);
    let valid = valid(rng, ops, 4 * GIB, None);
    let line = rng.range((valid.lines / 2).max(2), valid.lines);
    let inserted = rng.one_in(2);
    let before = Model::of(valid.events.iter().take_while(|(l, _)| *l < line).map(|(_, e)| e));
    let fresh = (0..).map(|_| rng.next_u64()).find(|id| !before.live.contains_key(id)).unwrap();
    let live = before.live.keys().copied().min();
    let dead = before.freed.iter().copied().min().unwrap_or(fresh);
    let (bad, says): (Vec<u8>, String) = match rng.below(11) {
        0..=3 => {
            let (value, problem) = bad_number(rng);
            let (text, field) = match rng.below(4) {
                0 => (format!("a {value} 4096 0"), "ID"),
                1 => (format!("a {fresh} {value} 1"), "BYTES"),
                2 => (format!("a {fresh} 4096 {value}"), "STREAM"),
                _ => (format!("f {value}"), "ID"),
            };
            (text.into_bytes(), format!("{field} `{value}` {problem}"))
        }
        4 => {
            let (text, field) = *rng.pick(&[("a", "ID"), ("a 5", "BYTES"), ("a 5 4096", "STREAM"), ("f", "ID")]);
            let op = &text[..1];
            (text.into(), format!("`{op}` op is missing its {field} (in `{text}`)"))
        }
        5 => {
            let text = match live {
                Some(id) if rng.one_in(2) => format!("f {id} {id}"),
                _ => format!("a {fresh} 1 0 {fresh}"),
            };
            let extra = text.rsplit(' ').next().unwrap().to_string();
            (text.into_bytes(), format!("unexpected extra field `{extra}`"))
        }
        6 => {
            let op = *rng.pick(&["x", "A", "F", "S", "alloc", "free", "-", "1", "\u{feff}a", "ａ"]);
            (format!("{op} 1 2 3").into_bytes(), format!("unknown op `{op}`"))
        }
        7 => (format!("a {fresh} 0 0").into_bytes(), format!("allocation of block {fresh} has zero bytes")),
        8 => match live {
            Some(id) => {
                (format!("a {id} 64 0").into_bytes(), format!("block {id} is allocated again while still live"))
            }
            None => (b"s s".to_vec(), "unexpected extra field `s`".into()),
        },
        9 => (format!("f {dead}").into_bytes(), format!("free of block {dead}, which is not live")),
        _ => {
            let mut bytes = format!("a {fresh} ").into_bytes();
            bytes.extend_from_slice(&[0xff, 0xfe, b'1', b' ', b'0']);
            (bytes, "the line is not UTF-8".into())
        }
    };
    Broken { valid, line, bad, inserted, says }
}

fn check_broken(case: &Broken) -> Result<(), String> {
    let text = case.text();
    let line = case.line;
    let plain = read(&text);
    let message = match &plain {
        Err(e @ TraceError::Malformed { line: l, .. }) if *l == line => e.to_string(),
        Err(e) => return Err(format!("refused elsewhere than line {line}: {e}")),
        Ok(t) => return Err(format!("accepted, with {} ops", t.len())),
    };
    if !message.starts_with(&format!("{LABEL}:{line}: ")) || !message.contains(&case.says) || message.contains('\n') {
        return Err(format!("the message does not say `{}` at line {line}: {message}", case.says));
    }
    match read(&gzip(&[&text])) {
        Err(e) if e.to_string() == message => {}
        other => return Err(format!("gzip gives {other:?}, plain {message}")),
    }
    // Every line before the bad one was taken: cut there, the trace is valid and holds what they hold.
    let cut: usize = text.split_inclusive(|&b| b == b'\n').take(line as usize - 1).map(<[u8]>::len).sum();
    let prefix = read(&text[..cut]).map_err(|e| format!("the lines before line {line} are refused: {e}"))?;
    let model = Model::of(case.valid.events.iter().take_while(|(l, _)| *l < line).map(|(_, e)| e));
    if (prefix.len() as u64, prefix.peak_live_bytes, &prefix.steps) != (model.ops, model.peak_live_bytes, &model.steps)
    {
        return Err(format!("the lines before line {line} read as {} ops, model {model:?}", prefix.len()));
    }
    Ok(())
}

fn broken_target(cases: u64) {
    run("trace oracle, traces broken deep inside", cases, broken, check_broken);
}

#[test]
fn traces_broken_deep_inside_are_refused_at_the_bad_line() {
    broken_target(cases(BROKEN_CASES));
}

#[test]
#[ignore = "20,000 traces of thousands of ops: run with --release -- --ignored"]
fn traces_broken_deep_inside_are_refused_at_the_bad_line_long() {
    broken_target(cases(BROKEN_CASES * 10));
}

/// A valid trace gzip-compressed and cut short.
struct CutGzip {
    valid: Valid,
    gz: Vec<u8>,
    cut: usize,
}

impl fmt::Debug for CutGzip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}, gzip of {} bytes cut at byte {}", self.valid, self.gz.len(), self.cut)
    }
}

/// A gzip trace cut short anywhere after its first half is a gzip error naming the file, not a trace and not
/// an error at some line.
#[test]
fn a_long_gzip_trace_cut_short_is_a_gzip_error() {
    run(
        "trace oracle, gzip cut short",
        cases(BROKEN_CASES / 10),
        |rng| {
            let valid = valid(rng, 3_000, 4 * GIB, None);
            let gz = gzip(&[&valid.text]);
            let cut = rng.range(gz.len() as u64 / 2, gz.len() as u64 - 1) as usize;
            CutGzip { valid, gz, cut }
        },
        |case| match read(&case.gz[..case.cut]) {
            Err(e @ TraceError::Gzip { .. }) if e.to_string().starts_with(LABEL) => Ok(()),
            other => Err(format!("{:?}", other.map(|t| t.len()))),
        },
    );
}

// ---------------------------------------------------------------------------------------------------------------
// The `umm` binary on generated traces

fn umm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_umm")).args(args).env_remove("UMM_TRACE").output().expect("the umm binary runs")
}

fn stdout(output: &Output) -> String {
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn json_lines(output: &Output) -> Vec<serde_json::Value> {
    stdout(output).lines().map(|l| serde_json::from_str(l).expect("each line is a JSON object")).collect()
}

/// Generated traces of each shape (training with marks on up to 3 streams, serving on up to 8, churn), blocks
/// of at most 64 MiB so that each fits the default 80 GiB simulated device, written to files (the last one
/// gzip-compressed) with their models. The same traces for every test, each in a directory of its own.
fn trace_files(name: &str) -> Vec<(PathBuf, Valid, Model)> {
    let dir = std::env::temp_dir().join(format!("umm-trace-oracle-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng::new(0x7ACE);
    ["training", "serving", "churn"]
        .into_iter()
        .map(|shape| {
            let valid = valid(&mut rng, 2_500, 64 * MIB, Some(shape));
            let model = valid.model();
            assert!(model.peak_live_bytes < 64 * GIB, "{valid:?}");
            let (file, bytes) = if shape == "churn" {
                (format!("{shape}.trace.gz"), gzip(&[&valid.text]))
            } else {
                (format!("{shape}.trace"), valid.text.clone())
            };
            let path = dir.join(file);
            std::fs::write(&path, bytes).unwrap();
            (path, valid, model)
        })
        .collect()
}

fn paths(files: &[(PathBuf, Valid, Model)]) -> Vec<&str> {
    files.iter().map(|(p, _, _)| p.to_str().unwrap()).collect()
}

/// `umm replay --json` on traces of several shapes reports the model's ops, allocations, frees, peak of live
/// bytes and marks (over both passes), at least the peak reserved, and no out-of-memory.
#[test]
fn umm_replay_json_gives_the_models_figures() {
    let files = trace_files("json");
    for backend in ["sim", "sim-plain", "sim-wgpu"] {
        let mut args = vec!["replay", "--json", "--repeat", "1", "--backend", backend];
        args.extend(paths(&files));
        let lines = json_lines(&umm(&args));
        assert_eq!(lines.len(), files.len());
        for (line, (path, valid, model)) in lines.iter().zip(&files) {
            let name = umm::trace::name_of(path);
            assert_eq!(line["trace"], name.as_str());
            let got = [&line["ops"], &line["allocs"], &line["frees"], &line["peak_live_bytes"], &line["steps"]];
            let steps = 2 * model.steps.len() as u64;
            let want = [model.ops, model.allocs, model.frees, model.peak_live_bytes, steps];
            assert_eq!(got.map(|v| v.as_u64().unwrap()), want, "{backend} {valid:?}: {line}");
            assert_eq!((line["ooms"].as_u64(), line["oom_retries"].as_u64()), (Some(0), Some(0)), "{line}");
            assert!(line["peak_reserved_bytes"].as_u64().unwrap() >= model.peak_live_bytes, "{backend}: {line}");
            assert!(line["peak_reserved_bytes_warm"].as_u64().unwrap() >= model.peak_live_bytes, "{line}");
            assert!(line["limit_bytes"].is_null());
        }
    }
}

/// The table of `umm replay` shows each trace's ops, peak of live bytes and marks as the model has them.
#[test]
fn umm_replay_table_gives_the_models_figures() {
    let files = trace_files("table");
    let mut args = vec!["replay", "--repeat", "1"];
    args.extend(paths(&files));
    let out = stdout(&umm(&args));
    for (path, valid, model) in &files {
        let name = umm::trace::name_of(path);
        let row = out.lines().find(|l| l.split_whitespace().next() == Some(name.as_str()));
        let row = row.unwrap_or_else(|| panic!("no row for {name} in\n{out}"));
        assert!(row.split_whitespace().nth(1) == Some(model.ops.to_string().as_str()), "{valid:?}: {row}");
        assert!(row.contains(&human_bytes(model.peak_live_bytes)), "{valid:?}: peak live in {row}");
        let steps = format!("/{}", 2 * model.steps.len());
        assert!(row.split_whitespace().any(|cell| cell.ends_with(&steps)), "{valid:?}: marks in {row}");
    }
}

/// Under a limit of half a trace's peak of live bytes the replay runs out of memory and says so in its figures,
/// failing unless `--allow-oom`; the host backend refuses a trace above its memory, naming the model's peak.
#[test]
fn umm_replay_under_a_limit_below_the_peak_runs_out_of_memory() {
    let files = trace_files("limit");
    for (path, valid, model) in &files {
        let limit = format!("{}B", model.peak_live_bytes / 2);
        let args = ["replay", "--json", "--repeat", "0", "--limit", &limit, path.to_str().unwrap()];
        let refused = umm(&args);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && stderr.contains("--allow-oom"), "{valid:?}: {stderr}");
        let lines = json_lines(&umm(&[&args[..], &["--allow-oom"]].concat()));
        let line = &lines[0];
        assert!(line["reserved_over_live"].is_null(), "the trace's peak was not reached: {line}");
        assert!(line["ns_per_op_warm"].is_null(), "no warm pass: {line}");
        assert_eq!(line["limit_bytes"].as_u64(), Some(model.peak_live_bytes / 2), "{line}");
        assert!(line["ooms"].as_u64().unwrap() > 0, "{valid:?}: {line}");
        assert!(line["peak_reserved_bytes"].as_u64().unwrap() <= model.peak_live_bytes / 2, "{line}");
        assert_eq!(line["peak_live_bytes"].as_u64(), Some(model.peak_live_bytes), "the trace's own peak: {line}");

        let capacity = format!("{}B", model.peak_live_bytes - 1);
        let output = umm(&["replay", "--backend", "host", "--capacity", &capacity, path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{stderr}");
        assert!(stderr.contains(&format!("needs {} bytes", model.peak_live_bytes)), "{stderr}");
    }
}

/// `umm plan --json` gives each trace a lower bound equal to the model's peak of live bytes rounded to the
/// alignment, a plan at or above it, and the pool's reserved peak at or above the live peak.
#[test]
fn umm_plan_gives_the_models_lower_bound() {
    let files = trace_files("plan");
    let mut args = vec!["plan", "--json"];
    args.extend(paths(&files));
    let lines = json_lines(&umm(&args));
    assert_eq!(lines.len(), files.len());
    for (line, (_, valid, model)) in lines.iter().zip(&files) {
        assert_eq!(line["lower_bound_bytes"].as_u64(), Some(model.peak_aligned_bytes), "{valid:?}: {line}");
        assert!(line["plan_peak_bytes"].as_u64().unwrap() >= model.peak_aligned_bytes, "{line}");
        assert!(line["pool_reserved_bytes"].as_u64().unwrap() >= model.peak_live_bytes, "{line}");
    }
}
