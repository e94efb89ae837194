use super::*;

#[test]
fn a_written_trace_reads_back_the_same_with_its_marks() {
    let text = "# umm-trace v1\ns\na 7 100 0\na 9 200 3\nf 7\ns\ns\na 1 50 1\nf 9\ns\n";
    let trace = Trace::parse_str("t", "t", text).unwrap();
    let mut out = TraceWriter::new(Vec::new()).unwrap();
    trace.write(&mut out).unwrap();
    let written = String::from_utf8(out.finish().unwrap()).unwrap();
    assert_eq!(written, "# umm-trace v1\ns\na 0 100 0\na 1 200 3\nf 0\ns\ns\na 2 50 1\nf 1\ns\n");
    assert_eq!(Trace::parse_str("t", "t", &written).unwrap(), trace);
}

#[test]
fn live_bytes_saturate_without_overflowing_on_free() {
    let text = format!("# umm-trace v1\na 1 {} 0\na 2 5 0\nf 1\nf 2\n", u64::MAX);
    let trace = Trace::parse_str("t", "t", &text).unwrap();
    assert_eq!(trace.peak_live_bytes, u64::MAX);
}

/// Valid lines before the line under test, so that its number is not the first one a count could give.
const PREFIX: &str = "# umm-trace v1\n# recorded by hand\n\na 10 4096 0\n  s\nf 10\n";
/// The line number of the line after [`PREFIX`].
const AT: u64 = 7;

/// The reader's answer to `line` after [`PREFIX`]: the message of a malformed-line error at [`AT`].
fn refusal(line: &str) -> String {
    match Trace::parse_str("t", "t.trace", &format!("{PREFIX}{line}\na 11 1 0\n")) {
        Err(e @ TraceError::Malformed { line: AT, .. }) => e.to_string(),
        other => panic!("{line:?}: expected an error at line {AT}, got {other:?}"),
    }
}

/// Each number field (the ID, BYTES and STREAM of `a`, the ID of `f`) refuses a sign, a fraction, hex, an
/// exponent, separators, non-ASCII digits and a value past its range; the message names the file, the line,
/// the field and the text, and says what is wrong.
#[test]
fn every_malformed_number_is_refused_naming_its_line_and_field() {
    type LineOf = fn(&str) -> String;
    let fields: [(&str, LineOf); 4] = [
        ("ID", |v| format!("a {v} 4096 0")),
        ("BYTES", |v| format!("a 1 {v} 0")),
        ("STREAM", |v| format!("a 1 4096 {v}")),
        ("ID", |v| format!("f {v}")),
    ];
    let not_integers = [
        "-1",
        "-0",
        "--1",
        "-18446744073709551616",
        "1.5",
        "5.",
        ".5",
        "0.0",
        "0x10",
        "0b1",
        "0o7",
        "1e3",
        "1E3",
        "1_000",
        "1,000",
        "NaN",
        "inf",
        "five",
        "1-",
        "5+",
        "５",
        "٣",
        "\u{a0}5",
        "5\u{a0}5",
        "\u{feff}5",
    ];
    for (field, line_of) in fields {
        for value in not_integers {
            let message = refusal(&line_of(value));
            let said = format!("t.trace:{AT}: {field} `{value}` is not a non-negative integer");
            assert!(message.starts_with(&said), "{value:?}: {message}");
        }
        for (value, unsigned) in [("+5", "5"), ("+0", "0"), ("+18446744073709551615", "18446744073709551615")] {
            let message = refusal(&line_of(value));
            let said = format!(
                "t.trace:{AT}: {field} `{value}` is not a non-negative integer (write `{unsigned}` without the sign)"
            );
            assert!(message.starts_with(&said), "{value:?}: {message}");
        }
        for value in ["+-5", "+", "-"] {
            let message = refusal(&line_of(value));
            assert!(message.contains(&format!("{field} `{value}` is not a non-negative integer")), "{message}");
            assert!(!message.contains("without the sign"), "{message}");
        }
        for value in ["18446744073709551616", "99999999999999999999999", "000018446744073709551616"] {
            let message = refusal(&line_of(value));
            let said = format!("t.trace:{AT}: {field} `{value}` is too large (at most 18446744073709551615)");
            assert!(message.starts_with(&said), "{value:?}: {message}");
        }
    }
    // A stream is a 32-bit number.
    for value in ["4294967296", "18446744073709551615"] {
        let message = refusal(&format!("a 1 4096 {value}"));
        assert!(
            message.starts_with(&format!("t.trace:{AT}: stream {value} is too large (at most 4294967295)")),
            "{message}"
        );
    }
    // Zero bytes is a number, but not a size.
    for value in ["0", "00"] {
        let message = refusal(&format!("a 1 {value} 0"));
        assert!(message.starts_with(&format!("t.trace:{AT}: allocation of block 1 has zero bytes")), "{message}");
    }
}

/// A field left out (an empty field: runs of spaces are one separator) is refused naming the line, the op
/// and the field; so is a field too many.
#[test]
fn a_missing_or_extra_field_is_refused_naming_its_line_and_field() {
    for (line, field) in [
        ("a", "ID"),
        ("a ", "ID"),
        ("a 1", "BYTES"),
        ("a 1  ", "BYTES"),
        ("a 1 4096", "STREAM"),
        ("a  1\t 4096  ", "STREAM"),
        ("f", "ID"),
        ("f\t", "ID"),
    ] {
        let message = refusal(line);
        let op = line.trim().split_ascii_whitespace().next().unwrap();
        assert!(
            message.starts_with(&format!("t.trace:{AT}: `{op}` op is missing its {field} (in {})", quote(line.trim()))),
            "{line:?}: {message}"
        );
    }
    for (line, extra) in [("a 1 4096 0 0", "0"), ("f 10 x", "x"), ("s 1", "1"), ("a 1 2 3 -4", "-4")] {
        let message = refusal(line);
        assert!(message.starts_with(&format!("t.trace:{AT}: unexpected extra field `{extra}`")), "{line:?}: {message}");
    }
}

/// SplitMix64, for the traces of the round-trip test.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// What a line of a generated trace stands for: an allocation (ID, bytes, stream), a free (ID) or a mark.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Line {
    Alloc(u64, u64, u32),
    Free(u64),
    Step,
}

/// A valid trace as people and tools write one (comments, blank lines, leading zeros, tabs, CRLF, IDs reused
/// after their free, frees in any order, marks anywhere, blocks left live), and the lines it stands for.
fn valid_trace(rng: &mut Rng) -> (String, Vec<Line>) {
    let mut text = String::from(if rng.below(4) == 0 { "# umm-trace v1\r\n" } else { "# umm-trace v1\n" });
    let mut lines = Vec::new();
    let mut live: Vec<u64> = Vec::new();
    let ids = [1 + rng.below(8), 1000, u64::MAX][rng.below(3) as usize];
    for _ in 0..rng.below(300) {
        let line = match rng.below(10) {
            0..=4 => {
                let id = match rng.below(4) {
                    0 => u64::MAX - rng.below(3),
                    _ => rng.below(ids),
                };
                if live.contains(&id) {
                    continue;
                }
                live.push(id);
                let bytes = (1 + (rng.below(1 << 20) >> rng.below(20))) << rng.below(24);
                let stream = [0, 1, 7, u32::MAX][rng.below(4) as usize];
                Line::Alloc(id, bytes, stream)
            }
            5..=7 if !live.is_empty() => Line::Free(live.swap_remove(rng.below(live.len() as u64) as usize)),
            8 => Line::Step,
            _ => {
                text.push_str(["# a comment\n", "\n", "   \n", "#\n", "\t# indented\n"][rng.below(5) as usize]);
                continue;
            }
        };
        let zeros = "0".repeat(rng.below(3) as usize);
        let sep = [" ", "\t", "  ", " \t "][rng.below(4) as usize];
        let end = ["\n", "\r\n", " \n", "\t\n"][rng.below(4) as usize];
        text.push_str(&match line {
            Line::Alloc(id, bytes, stream) => format!("a{sep}{zeros}{id}{sep}{bytes}{sep}{stream}{end}"),
            Line::Free(id) => format!("{}f{sep}{zeros}{id}{end}", if rng.below(5) == 0 { "  " } else { "" }),
            Line::Step => format!("s{end}"),
        });
        lines.push(line);
    }
    (text, lines)
}

/// A line as a parsed trace keeps it: IDs are gone, so a free names the allocation it frees by its position
/// among the allocations.
#[derive(Debug, PartialEq)]
enum Kept {
    Alloc(u64, u32),
    Free(usize),
    Step,
}

/// The lines a parsed trace stands for.
fn lines_of(trace: &Trace) -> Vec<Kept> {
    let mut holder = vec![usize::MAX; trace.slots as usize];
    let mut allocs = 0;
    let mut marks = trace.steps.iter().copied().peekable();
    let mut out = Vec::new();
    for (at, op) in trace.ops.iter().enumerate() {
        while marks.next_if(|&mark| mark <= at).is_some() {
            out.push(Kept::Step);
        }
        match *op {
            Op::Alloc { slot, bytes, stream } => {
                holder[slot as usize] = allocs;
                allocs += 1;
                out.push(Kept::Alloc(bytes, stream));
            }
            Op::Free { slot } => out.push(Kept::Free(holder[slot as usize])),
        }
    }
    out.extend(marks.map(|_| Kept::Step));
    out
}

/// Accepted traces keep every op, in order, with its bytes and stream, each free naming the block its ID
/// named, and every mark in place; writing one and reading it back (in memory, to a file, to a gzip file)
/// gives the same trace, and writing that again gives the same text.
#[test]
fn accepted_traces_round_trip_to_the_same_ops() {
    let dir = std::env::temp_dir().join(format!("umm-trace-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for seed in 0..200 {
        let (text, lines) = valid_trace(&mut Rng(seed));
        let trace = Trace::parse_str("t", "t.trace", &text).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        // The ops, from the generator's lines: a free names its allocation by the ID's latest allocation.
        let mut latest = HashMap::new();
        let mut allocs = 0;
        let expected: Vec<Kept> = lines
            .iter()
            .map(|line| match *line {
                Line::Alloc(id, bytes, stream) => {
                    latest.insert(id, allocs);
                    allocs += 1;
                    Kept::Alloc(bytes, stream)
                }
                Line::Free(id) => Kept::Free(latest[&id]),
                Line::Step => Kept::Step,
            })
            .collect();
        assert_eq!(lines_of(&trace), expected, "seed {seed}:\n{text}");

        let mut out = TraceWriter::new(Vec::new()).unwrap();
        trace.write(&mut out).unwrap();
        let written = String::from_utf8(out.finish().unwrap()).unwrap();
        let again = Trace::parse_str("t", "written", &written).unwrap();
        assert_eq!(again, trace, "seed {seed}:\n{text}\nwritten as\n{written}");
        let mut out = TraceWriter::new(Vec::new()).unwrap();
        again.write(&mut out).unwrap();
        assert_eq!(String::from_utf8(out.finish().unwrap()).unwrap(), written, "seed {seed}");

        for file in [format!("r{seed}.trace"), format!("r{seed}.trace.gz")] {
            let path = dir.join(&file);
            trace.save(&path, "saved\nby the round-trip test").unwrap();
            let loaded = Trace::load(&path).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert_eq!(loaded, Trace { name: format!("r{seed}"), ..trace.clone() }, "seed {seed}: {file}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The largest value of each field is taken, with leading zeros, tabs and surrounding spaces.
#[test]
fn the_largest_value_of_each_field_is_accepted() {
    let text = format!("{HEADER}\na {max} {max} 4294967295\n\ta\t0007\t0042\t0001 \nf {max}\nf 7\n", max = u64::MAX);
    let trace = Trace::parse_str("t", "t.trace", &text).unwrap();
    assert_eq!(
        trace.ops,
        [
            Op::Alloc { slot: 0, bytes: u64::MAX, stream: u32::MAX },
            Op::Alloc { slot: 1, bytes: 42, stream: 1 },
            Op::Free { slot: 0 },
            Op::Free { slot: 1 },
        ]
    );
}
