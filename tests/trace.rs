//! The `umm-trace v1` reader and writer: good traces (plain and gzip), every kind of malformed line, round trips.

use std::io::Write;
use std::path::PathBuf;
use umm::trace::{Op, Trace, TraceError, TraceWriter};

/// A fresh file path in the temp dir, unique to this process and `name`.
fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("umm-trace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn gzip(text: &str) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(text.as_bytes()).unwrap();
    encoder.finish().unwrap()
}

const GOOD: &str = "# umm-trace v1\n\
                    # a comment\n\
                    a 10 1000 0\n\
                    a 20 500 1\n\
                    \n\
                    f 10\n\
                    a 30 2000 0\n\
                    f 20\n\
                    a 10 100 2\n";

fn check_good(trace: &Trace) {
    assert_eq!(trace.allocs, 4);
    assert_eq!(trace.frees, 2);
    assert_eq!((trace.len(), trace.is_empty()), (6, false));
    assert_eq!(trace.peak_live_bytes, 2500, "500 + 2000 after the first free");
    assert_eq!(trace.slots, 2, "slots are reused: at most two blocks are live at once");
    assert_eq!(trace.streams, 3);
    assert_eq!(trace.max_block_bytes, 2000);
    assert_eq!(
        trace.ops,
        vec![
            Op::Alloc { slot: 0, bytes: 1000, stream: 0 },
            Op::Alloc { slot: 1, bytes: 500, stream: 1 },
            Op::Free { slot: 0 },
            Op::Alloc { slot: 0, bytes: 2000, stream: 0 },
            Op::Free { slot: 1 },
            Op::Alloc { slot: 1, bytes: 100, stream: 2 },
        ]
    );
}

#[test]
fn plain_and_gzip_traces_load_alike_whatever_their_name() {
    let plain = temp_path("good.trace");
    std::fs::write(&plain, GOOD).unwrap();
    let trace = Trace::load(&plain).unwrap();
    assert_eq!(trace.name, "good");
    check_good(&trace);

    let gz = temp_path("good.trace.gz");
    std::fs::write(&gz, gzip(GOOD)).unwrap();
    let trace = Trace::load(&gz).unwrap();
    assert_eq!(trace.name, "good");
    check_good(&trace);

    // Detection is by content: gzip without the extension, and plain text with it, both load.
    let gz_no_ext = temp_path("compressed.txt");
    std::fs::write(&gz_no_ext, gzip(GOOD)).unwrap();
    check_good(&Trace::load(&gz_no_ext).unwrap());
    let plain_gz_name = temp_path("plain.trace.gz");
    std::fs::write(&plain_gz_name, GOOD).unwrap();
    check_good(&Trace::load(&plain_gz_name).unwrap());
}

#[test]
fn windows_line_endings_and_blank_lines_are_accepted() {
    let text = GOOD.replace('\n', "\r\n");
    check_good(&Trace::parse_str("crlf", "crlf.trace", &text).unwrap());
}

#[test]
fn a_header_only_trace_is_empty() {
    let trace = Trace::parse_str("empty", "empty.trace", "# umm-trace v1\n# nothing else\n").unwrap();
    assert!(trace.is_empty());
    assert_eq!((trace.allocs, trace.frees, trace.peak_live_bytes, trace.slots), (0, 0, 0, 0));
}

/// Writes `body` after a good header to a file and returns the error's message.
fn error_of(file: &str, body: &str) -> String {
    let path = temp_path(file);
    std::fs::write(&path, format!("# umm-trace v1\na 1 4096 0\n{body}")).unwrap();
    let err = Trace::load(&path).unwrap_err();
    assert!(matches!(err, TraceError::Malformed { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "message names the file: {message}");
    message
}

#[test]
fn every_malformed_line_is_an_error_naming_file_line_and_problem() {
    let cases: [(&str, &str, &str); 14] = [
        ("unknown_op", "x 1 2 3\n", "unknown op `x`"),
        // Signs are not dropped: `-5` bytes is an error, not 5 bytes.
        ("negative_bytes", "a 2 -5 0\n", "BYTES `-5` is not a non-negative integer"),
        ("negative_stream", "a 2 4096 -1\n", "STREAM `-1` is not a non-negative integer"),
        ("negative_alloc_id", "a -2 4096 0\n", "ID `-2` is not a non-negative integer"),
        ("missing_bytes", "a 2\n", "missing its BYTES"),
        ("missing_stream", "a 2 4096\n", "missing its STREAM"),
        ("missing_free_id", "f\n", "missing its ID"),
        ("non_numeric_bytes", "a 2 lots 0\n", "BYTES `lots` is not a non-negative integer"),
        ("negative_id", "f -1\n", "ID `-1` is not a non-negative integer"),
        ("zero_size", "a 2 0 0\n", "zero bytes"),
        ("unknown_free", "f 7\n", "free of block 7, which is not live"),
        ("double_free", "f 1\nf 1\n", "free of block 1, which is not live"),
        ("duplicate_live", "a 1 64 0\n", "block 1 is allocated again while still live"),
        ("extra_field", "f 1 2\n", "unexpected extra field `2`"),
    ];
    for (file, body, what) in cases {
        let message = error_of(file, body);
        let line = 2 + body.lines().count();
        assert!(message.contains(&format!(":{line}: ")), "{file}: line {line} named in `{message}`");
        assert!(message.contains(what), "{file}: `{what}` in `{message}`");
    }
}

#[test]
fn comments_do_not_shift_line_numbers() {
    let message = error_of("comments", "# one\n# two\n\nq\n");
    assert!(message.contains(":6: unknown op `q`"), "{message}");
}

#[test]
fn the_header_is_required_on_the_first_line() {
    for (file, text, found) in [
        ("no_header", "a 1 4096 0\n", "a 1 4096 0"),
        ("other_version", "# umm-trace v2\n", "# umm-trace v2"),
        ("late_header", "# comment\n# umm-trace v1\n", "# comment"),
        ("empty_file", "", "an empty file"),
        ("empty_line", "\n# umm-trace v1\n", "an empty first line"),
        ("tabbed", "not\ta trace\n", "found `not\\ta trace`"),
        ("bell", "not\u{7} a trace\n", "binary data"),
    ] {
        let path = temp_path(file);
        std::fs::write(&path, text).unwrap();
        let err = Trace::load(&path).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, TraceError::Header { .. }), "{message}");
        assert!(message.contains(&format!("{}:1:", path.display())), "{message}");
        assert!(message.contains(found), "{file}: `{found}` in `{message}`");
    }
}

#[test]
fn a_missing_file_or_corrupt_gzip_names_the_file() {
    let missing = temp_path("does-not-exist.trace.gz");
    let message = Trace::load(&missing).unwrap_err().to_string();
    assert!(message.contains(&missing.display().to_string()), "{message}");

    let mut corrupt = gzip(GOOD);
    corrupt.truncate(corrupt.len() / 2);
    let path = temp_path("truncated.trace.gz");
    std::fs::write(&path, corrupt).unwrap();
    let err = Trace::load(&path).unwrap_err();
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
}

#[test]
fn random_bytes_are_not_an_umm_trace_and_the_error_says_what_is_expected() {
    // Bytes that are not UTF-8, with no line break: refused from the first line.
    let random: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 0x80).collect();
    let path = temp_path("random.bin");
    std::fs::write(&path, &random).unwrap();
    let err = Trace::load(&path).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, TraceError::Header { .. }), "{message}");
    for part in [&path.display().to_string(), "not an umm trace", "binary data", "gzip", "# umm-trace v1"] {
        assert!(message.contains(part), "`{part}` in `{message}`");
    }
    assert!(!message.contains("UTF-8"), "{message}");

    // The gzip magic bytes followed by garbage.
    let mut fake_gzip = vec![0x1f, 0x8b];
    fake_gzip.extend_from_slice(&random[..64]);
    let path = temp_path("fake.trace.gz");
    std::fs::write(&path, &fake_gzip).unwrap();
    let err = Trace::load(&path).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, TraceError::Gzip { .. }), "{message}");
    assert!(message.contains(&path.display().to_string()) && message.contains("not an umm trace"), "{message}");

    // A valid header, then a line that is not text: the line is named.
    let mut bytes = b"# umm-trace v1\na 1 64 0\n".to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
    let path = temp_path("binary_tail.trace");
    std::fs::write(&path, &bytes).unwrap();
    let message = Trace::load(&path).unwrap_err().to_string();
    assert!(message.contains(&format!("{}:3: ", path.display())) && message.contains("not UTF-8"), "{message}");
}

#[test]
fn writer_round_trips_through_the_reader() {
    let mut writer = TraceWriter::new(Vec::new()).unwrap();
    writer.comment("recorded by a test\nsecond line").unwrap();
    writer.alloc(7, 4096, 0).unwrap();
    writer.alloc(8, 1 << 30, 3).unwrap();
    writer.free(7).unwrap();
    writer.alloc(9, 512, 1).unwrap();
    let bytes = writer.finish().unwrap();
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.starts_with("# umm-trace v1\n# recorded by a test\n# second line\na 7 4096 0\n"), "{text}");
    let trace = Trace::parse_str("rt", "rt", &text).unwrap();
    assert_eq!(
        trace.ops,
        vec![
            Op::Alloc { slot: 0, bytes: 4096, stream: 0 },
            Op::Alloc { slot: 1, bytes: 1 << 30, stream: 3 },
            Op::Free { slot: 0 },
            Op::Alloc { slot: 0, bytes: 512, stream: 1 },
        ]
    );
    assert_eq!(trace.peak_live_bytes, 4096 + (1 << 30));
}

#[test]
fn writer_files_are_gzip_when_named_gz() {
    for name in ["written.trace", "written.trace.gz"] {
        let path = temp_path(name);
        let mut writer = TraceWriter::create(&path).unwrap();
        for id in 0..1000u64 {
            writer.alloc(id, 256 * (id + 1), id % 2).unwrap();
            if id % 3 == 0 {
                writer.free(id).unwrap();
            }
        }
        writer.close().unwrap();
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(raw.starts_with(&[0x1f, 0x8b]), name.ends_with(".gz"), "{name}");
        let trace = Trace::load(&path).unwrap();
        assert_eq!((trace.name.as_str(), trace.allocs, trace.frees), ("written", 1000, 334));
    }
}

#[test]
fn the_committed_gpt2_training_trace_loads() {
    // The same file as ../shared/traces/gpt2_train.trace.gz, committed so that this test always runs.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/traces/gpt2_train.trace.gz");
    let trace = Trace::load(&path).unwrap();
    assert_eq!((trace.allocs, trace.frees, trace.len()), (4746, 4743, 9489));
    assert!(trace.peak_live_bytes > 7_000_000_000, "{}", trace.peak_live_bytes);
}

/// A reader that gives `text`, then fails with `kind`.
struct FailingAfter {
    text: std::io::Cursor<Vec<u8>>,
    kind: std::io::ErrorKind,
}

impl std::io::Read for FailingAfter {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.text.read(buf)? {
            0 => Err(std::io::Error::new(self.kind, "the source failed")),
            n => Ok(n),
        }
    }
}

#[test]
fn a_failing_source_is_an_io_error_unless_gzip_data_is_corrupt() {
    use std::io::ErrorKind;
    let plain = |kind| FailingAfter { text: std::io::Cursor::new(b"# umm-trace v1\na 1 64 0\n".to_vec()), kind };
    // Plain text: whatever the kind of failure, the source's own error.
    for kind in [ErrorKind::InvalidData, ErrorKind::PermissionDenied] {
        let err = Trace::from_reader("failing", "failing.trace", plain(kind)).unwrap_err();
        assert!(matches!(err, TraceError::Io { .. }), "{kind:?}: {err}");
        assert!(err.to_string().contains("the source failed"), "{err}");
    }
    // Gzip: a truncated stream is corrupt data; a source that fails otherwise is still an I/O error.
    let whole = gzip(GOOD);
    let truncated = Trace::from_reader("cut", "cut.trace.gz", &whole[..whole.len() / 2]).unwrap_err();
    assert!(matches!(truncated, TraceError::Gzip { .. }), "{truncated}");
    let failing = FailingAfter {
        text: std::io::Cursor::new(whole[..whole.len() / 2].to_vec()),
        kind: ErrorKind::PermissionDenied,
    };
    let err = Trace::from_reader("denied", "denied.trace.gz", failing).unwrap_err();
    assert!(matches!(err, TraceError::Io { .. }), "{err}");
}

#[test]
fn a_finished_writer_has_put_every_line_in_its_file() {
    let path = temp_path("flushed.trace");
    let mut writer = TraceWriter::create(&path).unwrap();
    writer.alloc(1, 64, 0).unwrap();
    writer.free(1).unwrap();
    // The file is still open: what finish flushed is already there.
    let file = writer.finish().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text, "# umm-trace v1\na 1 64 0\nf 1\n");
    drop(file);
}

#[test]
fn a_closed_gzip_writer_leaves_a_whole_stream() {
    let path = temp_path("closed.trace.gz");
    let mut writer = TraceWriter::create(&path).unwrap();
    writer.alloc(7, 4096, 1).unwrap();
    writer.step().unwrap();
    writer.close().unwrap();
    let trace = Trace::load(&path).unwrap();
    assert_eq!((trace.allocs, trace.frees), (1, 0));
}

#[test]
fn closing_a_trace_on_a_full_disk_is_an_error() {
    // Linux's /dev/full takes the open and refuses every write: the buffered lines fail when close flushes them,
    // which dropping the writer would not report.
    if !std::path::Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this system");
        return;
    }
    let mut writer = TraceWriter::create("/dev/full").unwrap();
    writer.alloc(1, 64, 0).unwrap();
    let err = writer.close().unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::StorageFull, "{err}");
}
