//! Fuzzed inputs: the trace reader (plain and gzip), size and limit parsing, and every `UMM_*` variable. Each
//! input must give `Ok` or an error that names the problem (the file and line, the text, the variable), never a
//! panic or a hang. 10,000 cases per target here, 100,000 in the ignored `*_long` tests:
//! `cargo test --release --test fuzz_inputs -- --ignored` (see `tests/fuzz_support`).

mod fuzz_support;

use fuzz_support::{cases, run, size_text, Rng, CI_CASES, LONG_CASES};
use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use umm::backends::{Limit, PoolConfig};
use umm::config::{parse_capacity, parse_limit, parse_size, unknown_vars, UmmConfig, KNOWN_VARS};
use umm::trace::{Trace, TraceError, HEADER};

const LABEL: &str = "fuzz.trace";

/// Bytes shown escaped, so a failing input can be pasted back into a test.
struct Bytes(Vec<u8>);

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b\"{}\"", self.0.escape_ascii())
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Traces

/// A number field of a trace line: usually valid, often at an edge, sometimes not a number at all.
fn number_field(rng: &mut Rng, small: u64) -> String {
    match rng.below(12) {
        0..=3 => rng.below(small).to_string(),
        4 => format!("{}{}", rng.pick(&["-", "+", "+0", "-0", "--", "+-"]), rng.below(small)),
        5 | 6 => rng.edgy_u64().to_string(),
        7 => rng
            .pick(&["-1", "18446744073709551616", "99999999999999999999999", "1.5", "1e3", "0x10", "+1", "１", "", "0"])
            .to_string(),
        8 => (u32::MAX as u64 + rng.below(3)).to_string(),
        9 => size_text(rng),
        _ => rng.weird_text(4),
    }
}

/// One line of a near-valid trace.
fn trace_line(rng: &mut Rng, ids: u64) -> Vec<u8> {
    let line = match rng.below(20) {
        0..=6 => format!("a {} {} {}", rng.below(ids), 1 + rng.below(1 << 20), rng.below(3)),
        7..=10 => format!("f {}", rng.below(ids)),
        11 => format!("a {} {} {}", number_field(rng, ids), number_field(rng, 4096), number_field(rng, 4)),
        12 => format!("f {}", number_field(rng, ids)),
        13 => rng
            .pick(&["a", "a 1", "a 1 2", "f", "a 1 2 3 4", "f 1 2", "A 1 2 3", "F 1", "x 1", "alloc 1 2 3"])
            .to_string(),
        14 => format!("# {}", rng.weird_text(20)),
        15 => rng.pick(&["", " ", "\t", "  # indented comment", "#", "\u{feff}a 1 2 3"]).to_string(),
        16 => rng.weird_text(30),
        17 => "a 1 2 3 ".repeat(rng.range(1, 600) as usize),
        18 => {
            let n = rng.below(80) as usize;
            return rng.bytes(n);
        }
        _ => {
            format!("{}a{}{}{}{}", rng.weird_text(2), rng.pick(&[" ", "\t", "  "]), rng.below(ids), " ", rng.below(99))
        }
    };
    line.into_bytes()
}

/// A near-valid trace: a header (usually right), lines of [`trace_line`], line ends of every kind, sometimes cut
/// at a random byte (inside a line or a character).
fn trace_bytes(rng: &mut Rng) -> Vec<u8> {
    let mut out: Vec<u8> = match rng.below(20) {
        0..=13 => format!("{HEADER}\n").into_bytes(),
        14 => format!("{HEADER}\r\n").into_bytes(),
        15 => rng
            .pick(&["# umm-trace v2\n", "# umm-trace\n", "umm-trace v1\n", "\u{feff}# umm-trace v1\n", "\n"])
            .as_bytes()
            .to_vec(),
        16 => Vec::new(),
        17 => HEADER.as_bytes().to_vec(),
        18 => {
            let n = rng.below(400) as usize;
            rng.bytes(n)
        }
        _ => format!("{}\n", rng.weird_text(10)).into_bytes(),
    };
    let ids = *rng.pick(&[2, 4, 16, 1000]);
    for _ in 0..rng.below(40) {
        out.extend(trace_line(rng, ids));
        const ENDS: [&[u8]; 6] = [b"\n", b"\n", b"\n", b"\r\n", b"\r", b"\n\n"];
        out.extend_from_slice(rng.pick::<&[u8]>(&ENDS));
    }
    if rng.one_in(8) {
        out.truncate(rng.below(out.len() as u64 + 1) as usize);
    }
    out
}

/// The line `number` (1-based) of `text` as the reader splits lines (at `\n`).
fn line_of(text: &[u8], number: u64) -> Option<&[u8]> {
    text.split(|&b| b == b'\n').nth(number.checked_sub(1)? as usize)
}

/// Checks a parsed trace's own bookkeeping.
fn check_trace(trace: &Trace) -> Result<(), String> {
    let mut live = vec![false; trace.slots as usize];
    let (mut allocs, mut frees, mut max_block, mut streams) = (0, 0, 0, 0);
    for op in &trace.ops {
        match *op {
            umm::trace::Op::Alloc { slot, bytes, stream } => {
                let cell = live.get_mut(slot as usize).ok_or(format!("slot {slot} >= slots {}", trace.slots))?;
                if *cell || bytes == 0 {
                    return Err(format!("alloc into live slot {slot} or of zero bytes"));
                }
                *cell = true;
                allocs += 1;
                max_block = max_block.max(bytes);
                // Stream u32::MAX counts as u32::MAX streams: one more does not fit the field.
                streams = streams.max(stream.saturating_add(1));
            }
            umm::trace::Op::Free { slot } => {
                let cell = live.get_mut(slot as usize).ok_or(format!("slot {slot} >= slots {}", trace.slots))?;
                if !*cell {
                    return Err(format!("free of a vacant slot {slot}"));
                }
                *cell = false;
                frees += 1;
            }
        }
    }
    if (allocs, frees, max_block, streams) != (trace.allocs, trace.frees, trace.max_block_bytes, trace.streams) {
        return Err(format!("counts disagree with the ops: {trace:?}"));
    }
    Ok(())
}

/// A line of an accepted trace, read by the format's grammar alone.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Line {
    Alloc { id: u64, bytes: u64, stream: u32 },
    Free { id: u64 },
    Step,
}

/// A number field as the format allows it: ASCII digits only (no sign, point, exponent or prefix) that fit in
/// 64 bits.
fn grammar_number(field: &str) -> Option<u64> {
    if field.is_empty() || !field.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    field.bytes().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
}

/// The ops and marks of `text` by the grammar of `umm-trace v1`, independently of the reader: after the header,
/// `a ID BYTES STREAM` (BYTES above zero, STREAM below 2^32), `f ID` and `s`, fields separated by ASCII
/// whitespace, and comment and blank lines. `Err` names the first line outside the grammar.
fn grammar_lines(text: &[u8]) -> Result<Vec<Line>, String> {
    let text = std::str::from_utf8(text).map_err(|e| format!("accepted text that is not UTF-8: {e}"))?;
    let mut lines = Vec::new();
    for (number, line) in text.split('\n').enumerate().skip(1) {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let numbers: Option<Vec<u64>> = fields[1..].iter().map(|f| grammar_number(f)).collect();
        let parsed = match (fields[0], numbers.as_deref()) {
            ("a", Some(&[id, bytes, stream])) if bytes > 0 => {
                u32::try_from(stream).ok().map(|stream| Line::Alloc { id, bytes, stream })
            }
            ("f", Some(&[id])) => Some(Line::Free { id }),
            ("s", Some(&[])) => Some(Line::Step),
            _ => None,
        };
        lines.push(parsed.ok_or(format!("accepted line {} `{line}`, which the format does not allow", number + 1))?);
    }
    Ok(lines)
}

/// An accepted trace must be what its text says by the grammar: each line an op or a mark, in order, each
/// allocation with its bytes and stream, each free naming the slot of its ID's allocation.
fn check_accepted(trace: &Trace, text: &[u8]) -> Result<(), String> {
    let lines = grammar_lines(text)?;
    let mut slot_of = HashMap::new();
    let mut ops = trace.ops.iter();
    let mut marks = Vec::new();
    for line in lines {
        let op = match line {
            Line::Step => {
                marks.push(trace.ops.len() - ops.len());
                continue;
            }
            _ => ops.next().ok_or(format!("{line:?} is missing from the trace"))?,
        };
        match (line, *op) {
            (Line::Alloc { id, bytes, stream }, umm::trace::Op::Alloc { slot, bytes: b, stream: s })
                if (b, s) == (bytes, stream) && slot_of.insert(id, slot).is_none() => {}
            (Line::Free { id }, umm::trace::Op::Free { slot }) if slot_of.remove(&id) == Some(slot) => {}
            _ => return Err(format!("{line:?} read as {op:?}")),
        }
    }
    if ops.len() > 0 || marks != trace.steps {
        return Err(format!(
            "{} ops and marks {:?} beyond the text's, which has marks {marks:?}",
            ops.len(),
            trace.steps
        ));
    }
    Ok(())
}

/// Checks what the reader said about `input`, whose decompressed text is `text` when known: a trace that keeps
/// its own books and holds what the text says by the format's grammar ([`check_accepted`]), or an error of the
/// right kind whose message names the file, the line, and a token of that line.
fn check_read(result: &Result<Trace, TraceError>, input: &[u8], text: Option<&[u8]>) -> Result<(), String> {
    let gzip = input.starts_with(&[0x1f, 0x8b]);
    let err = match result {
        Ok(trace) => {
            check_trace(trace)?;
            return text.map_or(Ok(()), |text| check_accepted(trace, text));
        }
        Err(e) => e,
    };
    let message = err.to_string();
    if message.contains('\n') || message.contains('\u{1b}') {
        return Err(format!("the message has a raw line break or escape: {message:?}"));
    }
    match err {
        TraceError::Header { .. } => {
            if !message.starts_with(&format!("{LABEL}:1: not an umm trace")) || !message.contains(HEADER) {
                return Err(format!("a header error that does not say what is expected: {message}"));
            }
            if let Some(first) = text.and_then(|t| line_of(t, 1)) {
                if std::str::from_utf8(first).map(str::trim_end) == Ok(HEADER) {
                    return Err(format!("refused a right header: {message}"));
                }
            }
            Ok(())
        }
        TraceError::Gzip { .. } if gzip => {
            let named = message.starts_with(LABEL) && message.contains("gzip");
            named.then_some(()).ok_or(format!("a gzip error that does not say so: {message}"))
        }
        TraceError::Malformed { line, what, .. } => {
            if *line < 2 || !message.starts_with(&format!("{LABEL}:{line}: ")) || what.is_empty() {
                return Err(format!("a malformed-line error without the file and line: {message}"));
            }
            if what.chars().count() > 400 {
                return Err(format!("a message of {} characters", what.chars().count()));
            }
            let Some(text) = text else { return Ok(()) };
            // Every line before the refused one was taken: each must be in the format's grammar.
            let before: usize = text.split_inclusive(|&b| b == b'\n').take(*line as usize - 1).map(<[u8]>::len).sum();
            grammar_lines(&text[..before])?;
            let Some(bytes) = line_of(text, *line) else {
                return Err(format!("line {line} is past the end of the input: {message}"));
            };
            let Ok(line_text) = std::str::from_utf8(bytes) else {
                return what.contains("not UTF-8").then_some(()).ok_or(format!("binary line, message: {message}"));
            };
            // The message quotes a token of the line (cut at 60 characters, control characters escaped).
            let named = line_text.trim().split_ascii_whitespace().any(|token| {
                let shown: String = token
                    .chars()
                    .take(60)
                    .flat_map(|c| if c.is_control() { c.escape_debug().collect::<Vec<_>>() } else { vec![c] })
                    .collect();
                what.contains(&shown)
            });
            named.then_some(()).ok_or(format!("the message names nothing of line {line} {line_text:?}: {message}"))
        }
        other => Err(format!(
            "unexpected error kind for an in-memory {} input: {other:?}",
            if gzip { "gzip" } else { "plain" }
        )),
    }
}

fn read(input: &[u8]) -> Result<Trace, TraceError> {
    Trace::from_reader("fuzz", LABEL, input)
}

fn trace_text_target(cases: u64) {
    run(
        "trace reader, plain",
        cases,
        |rng| Bytes(trace_bytes(rng)),
        |Bytes(input)| {
            let result = read(input);
            check_read(&result, input, Some(input))?;
            // The in-memory text parser agrees with the reader wherever it applies.
            if let (Ok(text), false) = (std::str::from_utf8(input), input.starts_with(&[0x1f, 0x8b])) {
                let again = Trace::parse_str("fuzz", LABEL, text);
                let same = match (&result, &again) {
                    (Ok(a), Ok(b)) => a == b,
                    (Err(a), Err(b)) => a.to_string() == b.to_string(),
                    _ => false,
                };
                if !same {
                    return Err(format!("from_reader and parse_str disagree: {result:?} vs {again:?}"));
                }
            }
            Ok(())
        },
    );
}

/// A gzip input and the text it holds.
struct GzipCase {
    text: Vec<u8>,
    gz: Vec<u8>,
    mutation: &'static str,
}

impl fmt::Debug for GzipCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {:?}: {:?}", self.mutation, Bytes(self.text.clone()), Bytes(self.gz.clone()))
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

fn gzip_case(rng: &mut Rng) -> GzipCase {
    let text = trace_bytes(rng);
    let mut gz = gzip(&text);
    let mutation =
        *rng.pick(&["none", "none", "truncated", "flipped", "garbage after", "two members", "header only", "random"]);
    match mutation {
        "truncated" => gz.truncate(rng.below(gz.len() as u64) as usize),
        "flipped" => {
            for _ in 0..rng.range(1, 4) {
                let i = rng.below(gz.len() as u64) as usize;
                gz[i] ^= 1 << rng.below(8);
            }
        }
        "garbage after" => {
            let n = rng.range(1, 40) as usize;
            gz.extend(rng.bytes(n))
        }
        "two members" => gz.extend(gzip(b"a 999999 1 0\n")),
        "header only" => gz.truncate(rng.range(2, 10) as usize),
        "random" => {
            let n = rng.below(200) as usize;
            gz.splice(2.., rng.bytes(n)).for_each(drop)
        }
        _ => {}
    }
    GzipCase { text, gz, mutation }
}

fn trace_gzip_target(cases: u64) {
    run("trace reader, gzip", cases, gzip_case, |case| {
        let result = read(&case.gz);
        match case.mutation {
            // Intact: exactly what the plain text gives.
            "none" => {
                let plain = read(&case.text);
                let same = match (&result, &plain) {
                    (Ok(a), Ok(b)) => a == b,
                    (Err(a), Err(b)) => a.to_string() == b.to_string(),
                    _ => false,
                };
                if !same {
                    return Err(format!("gzip and plain disagree: {result:?} vs {plain:?}"));
                }
                check_read(&result, &case.gz, Some(&case.text))
            }
            // The bytes after a deflate stream are read as the next member: a corrupt one is a gzip error.
            "two members" => check_read(&result, &case.gz, None),
            _ => check_read(&result, &case.gz, None),
        }
    });
}

#[test]
fn trace_reader_plain() {
    trace_text_target(cases(CI_CASES));
}

#[test]
#[ignore = "100,000 cases: run with --release -- --ignored"]
fn trace_reader_plain_long() {
    trace_text_target(cases(LONG_CASES));
}

#[test]
fn trace_reader_gzip() {
    trace_gzip_target(cases(CI_CASES));
}

#[test]
#[ignore = "100,000 cases: run with --release -- --ignored"]
fn trace_reader_gzip_long() {
    trace_gzip_target(cases(LONG_CASES));
}

// ---------------------------------------------------------------------------------------------------------------
// Sizes and limits

/// The byte count `text` stands for, computed independently of the parser for the simple forms (an integer and a
/// unit), or `None` when the text is not of that form.
fn reference_size(text: &str) -> Option<Option<u64>> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return None;
    }
    let unit = match t[digits..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    Some(t[..digits].parse::<u64>().ok().and_then(|n| n.checked_mul(unit)))
}

/// An error message about `text` must quote it (trimmed), or say that nothing was given.
fn names_text(message: &str, text: &str) -> Result<(), String> {
    let t = text.trim();
    if message.contains('\n') && !t.contains('\n') {
        return Err(format!("the message has a line break: {message:?}"));
    }
    if (t.is_empty() && message.starts_with("no ")) || message.contains(&format!("`{t}`")) {
        Ok(())
    } else {
        Err(format!("the message does not quote the input: {message}"))
    }
}

fn sizes_target(cases: u64) {
    run("sizes and limits", cases, size_text, |text| {
        match (parse_size(text), reference_size(text)) {
            (Ok(bytes), Some(Some(expected))) if bytes != expected => {
                return Err(format!("parse_size gave {bytes}, expected {expected}"))
            }
            (Ok(_), Some(None)) => return Err("an overflowing size was accepted".into()),
            (Err(e), Some(Some(_))) => return Err(format!("refused a valid size: {e}")),
            (Err(e), _) => {
                names_text(&e, text)?;
                if !e.contains("expected a size") {
                    return Err(format!("the error does not list the sizes accepted: {e}"));
                }
            }
            _ => {}
        }
        match parse_limit(text) {
            Ok(limit) => {
                limit.resolve(1 << 40).map_err(|e| format!("a parsed limit {limit:?} does not resolve: {e}"))?;
                // The limit's text reads back as the same limit.
                let again = Limit::parse(&limit.to_string()).map_err(|e| format!("{limit} does not read back: {e}"))?;
                let same = match (limit, again) {
                    (Limit::Bytes(a), Limit::Bytes(b)) => a == b,
                    (Limit::Fraction(a), Limit::Fraction(b)) => (a - b).abs() < 1e-6,
                    _ => false,
                };
                if !same {
                    return Err(format!("{limit:?} reads back as {again:?}"));
                }
            }
            Err(e) => {
                names_text(&e, text)?;
                if !(e.contains("GiB") && e.contains('%')) {
                    return Err(format!("the limit error does not name both forms: {e}"));
                }
            }
        }
        match parse_capacity(text) {
            Ok(0) => return Err("a capacity of zero was accepted".into()),
            Ok(_) => {}
            Err(e) => names_text(&e, text)?,
        }
        if let Some(Some(slack)) = PoolConfig::parse_slack(text) {
            if !(slack >= 0.0 && slack.is_finite()) {
                return Err(format!("slack {slack} accepted"));
            }
        }
        Ok(())
    });
}

#[test]
fn sizes_and_limits() {
    sizes_target(cases(CI_CASES));
}

#[test]
#[ignore = "100,000 cases: run with --release -- --ignored"]
fn sizes_and_limits_long() {
    sizes_target(cases(LONG_CASES));
}

// ---------------------------------------------------------------------------------------------------------------
// UMM_* variables

/// A value for an environment variable: what each kind of variable takes, and what none takes.
fn env_value(rng: &mut Rng) -> String {
    match rng.below(10) {
        0 | 1 => size_text(rng),
        2 => rng.pick(&["0", "1", "true", "FALSE", "On", "off", " yes ", "no", "2", "y", "", "maybe"]).to_string(),
        3 => rng
            .pick(&["0.5", "1", "1.0", "1.5", "-0", "-0.1", "NaN", "inf", "1e-3", "0.03", "off", "none", "OFF"])
            .to_string(),
        4 => {
            let names = ["cuda", "opencl", "wgpu", "none", "host", "CUDA", "metal", "", " "];
            (0..rng.below(4)).map(|_| *rng.pick(&names)).collect::<Vec<_>>().join(*rng.pick(&[",", ", ", ";"]))
        }
        5 => rng.pick(&["pooled", "direct", "Direct", "auto", "plain", "virtual", "VIRTUAL", "hoard", ""]).to_string(),
        6 => rng.edgy_u64().to_string(),
        7 => format!("-{}", rng.below(10)),
        8 => rng
            .pick(&["/tmp/umm-fuzz-{pid}.trace.gz", "", " ", "relative/path", "/nonexistent/dir/x.trace"])
            .to_string(),
        _ => rng.weird_text(12),
    }
}

#[derive(Debug)]
struct EnvCase {
    vars: Vec<(&'static str, String)>,
    names: Vec<String>,
}

fn env_case(rng: &mut Rng) -> EnvCase {
    let mut vars: Vec<(&'static str, String)> = Vec::new();
    for _ in 0..rng.range(1, 4) {
        let name = *rng.pick(KNOWN_VARS);
        if !vars.iter().any(|(n, _)| *n == name) {
            vars.push((name, env_value(rng)));
        }
    }
    let mut names: Vec<String> = vars.iter().map(|(n, _)| n.to_string()).collect();
    for _ in 0..rng.below(3) {
        let known = *rng.pick(KNOWN_VARS);
        names.push(match rng.below(5) {
            0 => known.to_ascii_lowercase(),
            1 => format!("{}{}", &known[..rng.range(3, known.len() as u64) as usize], rng.weird_text(3)),
            2 => format!("UMM{}", rng.weird_text(4)),
            3 => format!("umm_{}", rng.weird_text(6)),
            _ => rng.weird_text(8),
        });
    }
    EnvCase { vars, names }
}

fn env_target(cases: u64) {
    run("UMM_* variables", cases, env_case, |case| {
        let set: HashMap<&str, &str> = case.vars.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let mut config = UmmConfig::default();
        match config.apply_vars(|name| set.get(name).map(|v| v.to_string())) {
            Ok(()) => config.validate().map_err(|e| format!("applied, but the result is invalid: {e}"))?,
            Err(e) => {
                let message = e.to_string();
                if let umm::Error::InvalidEnv { var, value, .. } = &e {
                    if set.get(var) != Some(&value.as_str()) {
                        return Err(format!("names {var}={value:?}, which was not set: {message}"));
                    }
                }
                if !set.keys().any(|name| message.contains(&format!("{name}="))) {
                    return Err(format!("the message names no variable that was set: {message}"));
                }
            }
        }
        if let Some(value) = set.get("UMM_REPLAY_DEVICE") {
            if let Err(e) = umm_tools::replay::device_index(Some(value)) {
                let message = e.to_string();
                if !message.contains("UMM_REPLAY_DEVICE") || !message.contains(&format!("{value:?}")) {
                    return Err(format!("UMM_REPLAY_DEVICE error without the variable and value: {message}"));
                }
            }
        }
        for unknown in unknown_vars(case.names.iter().map(String::as_str)) {
            let shown = unknown.to_string();
            if !unknown.name.as_bytes()[..4].eq_ignore_ascii_case(b"UMM_") || !shown.contains(&unknown.name) {
                return Err(format!("unknown variable report: {shown}"));
            }
        }
        Ok(())
    });
}

#[test]
fn umm_variables() {
    env_target(cases(CI_CASES));
}

#[test]
#[ignore = "100,000 cases: run with --release -- --ignored"]
fn umm_variables_long() {
    env_target(cases(LONG_CASES));
}

// ---------------------------------------------------------------------------------------------------------------
// Regressions: inputs the fuzzers found, each with the message it gets now.

#[test]
fn a_variable_name_with_a_multibyte_character_in_its_first_four_bytes_is_not_a_panic() {
    // `&name[..4]` panicked: byte 4 of "UMM€" is inside the euro sign.
    assert!(unknown_vars(["UMM€X", "UM€", "é"]).is_empty());
    assert_eq!(unknown_vars(["umm_€"]).len(), 1);
}

#[test]
fn negative_signed_and_exponent_sizes_say_so() {
    // Each was "unknown unit `-1MiB` in `-1MiB`" (the sign read as the start of a unit).
    for (text, says) in [
        ("-1MiB", "`-1MiB` is negative"),
        ("+5MiB", "`+5MiB` has a sign (write `5MiB`)"),
        ("1e30B", "`1e30B` has an exponent"),
        ("MiB", "`MiB` does not start with a number"),
        ("", "no size given"),
        ("99999999999999999999TiB", "`99999999999999999999TiB` is too large"),
        ("99999999999TiB", "`99999999999TiB` is too large"),
        ("1.2.3GiB", "`1.2.3GiB` is not a number followed by a unit"),
    ] {
        let message = parse_size(text).unwrap_err();
        assert!(message.contains(says) && message.contains("expected a size"), "{text}: {message}");
    }
    let message = Limit::parse("-1MiB").unwrap_err();
    assert!(message.contains("`-1MiB` is negative") && message.contains("90%"), "{message}");
}

#[test]
fn a_size_variable_says_what_is_wrong_with_its_value() {
    // Was "expected a byte count, 0 for off (8MiB, 0, 268435456)" alone: the value looks like one.
    let mut config = UmmConfig::default();
    let message =
        config.apply_vars(|k| (k == "UMM_THREAD_CACHE").then(|| "99999999999TiB".into())).unwrap_err().to_string();
    assert!(message.contains("UMM_THREAD_CACHE=\"99999999999TiB\"") && message.contains("is too large"), "{message}");
    let message = config.apply_vars(|k| (k == "UMM_LIMIT").then(|| "0.9".into())).unwrap_err().to_string();
    assert!(message.contains("UMM_LIMIT=\"0.9\"") && message.contains("write 90%"), "{message}");
    let message = config.apply_vars(|k| (k == "UMM_PAGE_SIZE").then(|| "3MiB".into())).unwrap_err().to_string();
    assert!(message.contains("power of two") && message.contains("3145728 is not one"), "{message}");
}

#[test]
fn trace_numbers_too_large_for_64_bits_say_so_and_long_lines_are_cut() {
    let text = format!("{HEADER}\na 1 18446744073709551616 0\n");
    let message = Trace::parse_str("t", "t.trace", &text).unwrap_err().to_string();
    assert!(
        message.contains("t.trace:2: BYTES `18446744073709551616` is too large (at most 18446744073709551615)"),
        "{message}"
    );
    let text = format!("{HEADER}\n{}\n", "a 1 2 3 ".repeat(500));
    let message = Trace::parse_str("t", "t.trace", &text).unwrap_err().to_string();
    assert!(message.len() < 300 && message.contains("t.trace:2: unexpected extra field `a`"), "{message}");
    let text = format!("{HEADER}\n\u{1b}[2J 1 2\n");
    let message = Trace::parse_str("t", "t.trace", &text).unwrap_err().to_string();
    assert!(message.contains("unknown op `\\u{1b}[2J`"), "{message}");
}
