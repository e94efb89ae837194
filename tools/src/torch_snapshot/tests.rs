//! Unit tests of the snapshot reader and its conversion.

use super::*;
use umm::trace::Op;

/// A pickle (protocol 4, no frame) of `{'device_traces': [[...events]], 'segments': []}` built by hand from
/// `(action, addr, size, stream)`.
fn snapshot_bytes(events: &[(&str, u64, i64, u64)]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.push(0x8c);
        out.push(s.len() as u8);
        out.extend_from_slice(s.as_bytes());
    }
    fn int(out: &mut Vec<u8>, n: i128) {
        let bytes = n.to_le_bytes();
        out.push(0x8a);
        out.push(9);
        out.extend_from_slice(&bytes[..9]);
    }
    let mut out = vec![0x80, 4, b'}'];
    string(&mut out, "device_traces");
    out.extend_from_slice(b"](]");
    out.push(b'(');
    for &(action, addr, size, stream) in events {
        out.extend_from_slice(b"}(");
        string(&mut out, "action");
        string(&mut out, action);
        string(&mut out, "addr");
        int(&mut out, addr.into());
        string(&mut out, "size");
        int(&mut out, size.into());
        string(&mut out, "stream");
        int(&mut out, stream.into());
        out.push(b'u');
    }
    out.extend_from_slice(b"ees");
    string(&mut out, "segments");
    out.extend_from_slice(b"]s.");
    out
}

fn read(bytes: &[u8]) -> Result<TorchSnapshot, TorchSnapshotError> {
    TorchSnapshot::from_bytes("t", "t.pickle", bytes)
}

#[test]
fn addresses_are_reused_after_their_free_and_streams_count_from_one() {
    let big = 0x7f12_3456_7800;
    let events = [
        ("alloc", big, 1024, 0x55d0_0000_0000),
        ("free_requested", big, 1024, 0x55d0_0000_0000),
        ("free_completed", big, 1024, 0x55d0_0000_0000),
        ("alloc", big, 2048, 0),
        ("alloc", big + 4096, 512, 7),
    ];
    let converted = read(&snapshot_bytes(&events)).unwrap().convert(0).unwrap();
    let ops = &converted.trace.ops;
    assert_eq!(
        ops,
        &[
            Op::Alloc { slot: 0, bytes: 1024, stream: 1 },
            Op::Free { slot: 0 },
            Op::Alloc { slot: 0, bytes: 2048, stream: 0 },
            Op::Alloc { slot: 1, bytes: 512, stream: 2 },
        ]
    );
    let f = &converted.figures;
    assert_eq!((f.allocs, f.frees, f.live_at_end, f.free_action.as_str()), (3, 1, 2, "free_completed"));
    assert_eq!(f.not_replayed.get("free_requested (frees are taken from free_completed)"), Some(&1));
    assert_eq!(f.torch_peak_allocated_bytes, 2560);
    assert_eq!(converted.trace.peak_live_bytes, 2560);
}

#[test]
fn free_requested_is_the_free_when_no_free_completed_exists() {
    let events = [("alloc", 4096, 100, 0), ("free_requested", 4096, 100, 0), ("alloc", 4096, 300, 0)];
    let converted = read(&snapshot_bytes(&events)).unwrap().convert(0).unwrap();
    assert_eq!(converted.figures.free_action, "free_requested");
    assert_eq!((converted.trace.allocs, converted.trace.frees, converted.trace.peak_live_bytes), (2, 1, 300));
}

#[test]
fn frees_of_blocks_from_before_the_trace_allocate_them_first_and_double_frees_are_skipped() {
    let events = [
        ("free_completed", 8192, 700, 0),
        ("alloc", 4096, 100, 0),
        ("free_completed", 16384, 300, 0),
        ("free_completed", 8192, 700, 0),
    ];
    let converted = read(&snapshot_bytes(&events)).unwrap().convert(0).unwrap();
    let t = &converted.trace;
    assert_eq!(
        t.ops,
        [
            Op::Alloc { slot: 0, bytes: 700, stream: 0 },
            Op::Alloc { slot: 1, bytes: 300, stream: 0 },
            Op::Free { slot: 0 },
            Op::Alloc { slot: 0, bytes: 100, stream: 0 },
            Op::Free { slot: 1 },
        ]
    );
    let f = &converted.figures;
    assert_eq!((f.live_before_from_frees, f.live_before_bytes), (2, 1000));
    assert_eq!(f.not_replayed.get("free_completed of a block not live (freed twice)"), Some(&1));
    assert_eq!(f.torch_peak_allocated_bytes, 1000);
    assert_eq!(t.peak_live_bytes, 1000);
}

#[test]
fn an_alloc_at_a_live_address_frees_the_block_there_first() {
    let events = [("alloc", 4096, 100, 0), ("alloc", 4096, 200, 0), ("free_completed", 4096, 200, 0)];
    let converted = read(&snapshot_bytes(&events)).unwrap().convert(0).unwrap();
    assert_eq!((converted.trace.allocs, converted.trace.frees, converted.trace.peak_live_bytes), (2, 2, 200));
    assert_eq!(
        converted.figures.not_replayed.get("free missing before an alloc at a live address (freed there)"),
        Some(&1)
    );
}

#[test]
fn zero_byte_allocs_are_skipped_with_their_frees() {
    let events = [("alloc", 4096, 0, 0), ("free_completed", 4096, 0, 0), ("alloc", 8192, 64, 0)];
    let converted = read(&snapshot_bytes(&events)).unwrap().convert(0).unwrap();
    assert_eq!(converted.trace.ops, [Op::Alloc { slot: 0, bytes: 64, stream: 0 }]);
    assert_eq!(converted.figures.not_replayed.get("zero-byte alloc"), Some(&1));
}

#[test]
fn negative_sizes_and_wrong_kinds_name_the_field() {
    let err = read(&snapshot_bytes(&[("alloc", 4096, -5, 0)])).unwrap_err().to_string();
    assert!(err.contains("`device_traces[0][0].size` is -5: a size cannot be negative (in an `alloc` event)"), "{err}");
    let err = read(&[0x80, 4, b'N', b'.']).unwrap_err().to_string();
    assert!(err.contains("holds None, not the dict"), "{err}");
}

#[test]
fn a_dict_without_device_traces_lists_its_keys() {
    let err = read(&[0x80, 4, b'}', 0x8c, 1, b'x', b'K', 1, b's', b'.']).unwrap_err().to_string();
    assert!(err.contains("no `device_traces`") && err.contains("'x'"), "{err}");
}

#[test]
fn class_opcodes_are_refused_by_name_and_offset() {
    let err = read(b"\x80\x02cbuiltins\nset\n)R.").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, TorchSnapshotError::Pickle { offset: 2, .. }), "{err:?}");
    assert!(text.contains("GLOBAL (0x63)") && text.contains("byte 2"), "{text}");
    for (op, name) in [(0x93u8, "STACK_GLOBAL"), (b'R', "REDUCE"), (b'b', "BUILD"), (0x81, "NEWOBJ")] {
        let text = read(&[0x80, 4, b'N', op, b'.']).unwrap_err().to_string();
        assert!(text.contains(name) && text.contains("byte 3"), "{text}");
    }
    let text = read(&[0x80, 4, b'I', b'1', b'\n', b'.']).unwrap_err().to_string();
    assert!(text.contains("INT (0x49)") && text.contains("protocols 0 and 1"), "{text}");
    let text = read(&[0x80, 4, 0xff]).unwrap_err().to_string();
    assert!(text.contains("0xff is not a pickle opcode") && text.contains("byte 2"), "{text}");
}

/// Every opcode the reader refuses, with its name and the reason given: the opcodes that name or build Python
/// objects, out-of-band buffers, and those of protocols 0 and 1 (text forms and the text memo).
const REFUSED: &[(u8, &str, &str)] = &[
    (b'c', "GLOBAL", "names or builds a Python class"),
    (0x93, "STACK_GLOBAL", "names or builds a Python class"),
    (b'R', "REDUCE", "names or builds a Python class"),
    (b'b', "BUILD", "names or builds a Python class"),
    (b'i', "INST", "names or builds a Python class"),
    (b'o', "OBJ", "names or builds a Python class"),
    (0x81, "NEWOBJ", "names or builds a Python class"),
    (0x92, "NEWOBJ_EX", "names or builds a Python class"),
    (0x82, "EXT1", "names or builds a Python class"),
    (0x83, "EXT2", "names or builds a Python class"),
    (0x84, "EXT4", "names or builds a Python class"),
    (b'P', "PERSID", "names or builds a Python class"),
    (b'Q', "BINPERSID", "names or builds a Python class"),
    (0x97, "NEXT_BUFFER", "out-of-band buffers"),
    (0x98, "READONLY_BUFFER", "out-of-band buffers"),
    (b'F', "FLOAT", "protocols 0 and 1"),
    (b'I', "INT", "protocols 0 and 1"),
    (b'L', "LONG", "protocols 0 and 1"),
    (b'S', "STRING", "protocols 0 and 1"),
    (b'T', "BINSTRING", "protocols 0 and 1"),
    (b'U', "SHORT_BINSTRING", "protocols 0 and 1"),
    (b'V', "UNICODE", "protocols 0 and 1"),
    (b'g', "GET", "protocols 0 and 1"),
    (b'p', "PUT", "protocols 0 and 1"),
];

/// Every opcode the reader runs (the rest of the 256 bytes are refused above or are no opcode).
const RUN: &[u8] = b"\x80\x95.(012NJKMGXCB)t]lae}dsu\x88\x89\x8a\x8b\x8c\x8d\x8e\x96\x85\x86\x87\x8f\x90\x91\x94qrhj";

#[test]
fn every_refused_opcode_is_refused_by_name() {
    for &(op, name, why) in REFUSED {
        let text = read(&[0x80, 4, b'N', op, b'.']).unwrap_err().to_string();
        let named = format!("{name} (0x{op:02x}): refused");
        assert!(text.contains(&named) && text.contains(why) && text.contains("byte 3"), "{name}: {text}");
    }
    // The lists are the whole byte range: a byte neither run nor refused by name is no opcode.
    for op in 0..=255u8 {
        if RUN.contains(&op) || REFUSED.iter().any(|r| r.0 == op) {
            continue;
        }
        let text = read(&[0x80, 4, b'N', op, b'.']).unwrap_err().to_string();
        assert!(text.contains(&format!("0x{op:02x} is not a pickle opcode")), "0x{op:02x}: {text}");
    }
    for &op in RUN {
        let refused = read(&[0x80, 4, b'N', op, b'.']).err().is_some_and(|e| e.to_string().contains("refused"));
        assert!(!refused, "0x{op:02x} is run, not refused");
    }
}

#[test]
fn lengths_past_the_end_are_truncation_not_allocation() {
    // A string claiming 2^64 - 1 bytes, and a frame longer than the file.
    let mut bytes = vec![0x80, 4, 0x8d];
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    let text = read(&bytes).unwrap_err().to_string();
    assert!(text.contains("BINUNICODE8") && text.contains("truncated"), "{text}");
    let mut bytes = vec![0x80, 4, 0x95];
    bytes.extend_from_slice(&1000u64.to_le_bytes());
    let text = read(&bytes).unwrap_err().to_string();
    assert!(text.contains("FRAME") && text.contains("a frame of 1000 bytes"), "{text}");
    assert!(read(&[0x80, 4, b'N']).unwrap_err().to_string().contains("before the pickle's STOP"));
}

#[test]
fn structure_beyond_the_limits_is_refused() {
    let nested = [&[0x80u8, 4][..], &[b'('; 20], b"N."].concat();
    let limits = pickle::Limits { marks: 10, values: 1000 };
    let err = TorchSnapshot::with_limits("t".into(), "t", &nested, limits).unwrap_err().to_string();
    assert!(err.contains("more than 10 MARKs"), "{err}");
    let many = [&[0x80u8, 4, b']', b'('][..], &[b'N'; 2000], b"e."].concat();
    let err = TorchSnapshot::with_limits("t".into(), "t", &many, limits).unwrap_err().to_string();
    assert!(err.contains("more than 1000 values"), "{err}");
    // A memo index far ahead of the entries stored would make a huge table: refused.
    let err = read(&[0x80, 2, b'N', b'r', 0xff, 0xff, 0xff, 0x7f, b'.']).unwrap_err().to_string();
    assert!(err.contains("LONG_BINPUT") && err.contains("in order"), "{err}");
}

#[test]
fn shared_and_self_referencing_objects_are_read_once() {
    // l = []; l.append(l); {'device_traces': [], 'segments': [], 'x': l}, protocol 2 with BINPUT/BINGET.
    let bytes = b"\x80\x02}q\x00(X\r\x00\x00\x00device_tracesq\x01]q\x02X\x08\x00\x00\x00segmentsq\x03]q\x04X\x01\x00\x00\x00xq\x05]q\x06h\x06au.";
    let snapshot = read(bytes).unwrap();
    assert_eq!((snapshot.devices(), snapshot.busiest_device(), snapshot.protocol), (0, None, 2));
    let err = snapshot.convert(0).unwrap_err().to_string();
    assert!(err.contains("device 0 asked for") && err.contains("no device trace"), "{err}");
}

#[test]
fn wide_integers_keep_their_value_and_sign() {
    for n in [0i128, -1, 255, 256, -129, i64::MAX as i128 + 1, u64::MAX as i128, -(1i128 << 100)] {
        let bytes = n.to_le_bytes();
        let mut pickle = vec![0x80, 4, 0x8a, 17];
        pickle.extend_from_slice(&bytes);
        pickle.push(if n < 0 { 0xff } else { 0 });
        pickle.push(b'.');
        let parsed = pickle::parse(&pickle, pickle::Limits::default()).unwrap();
        assert_eq!(parsed.int(parsed.root), Some(n));
    }
    let mut pickle = vec![0x80, 4, 0x8a, 17];
    pickle.extend_from_slice(&[0; 16]);
    pickle.extend_from_slice(&[1, b'.']);
    let parsed = pickle::parse(&pickle, pickle::Limits::default()).unwrap();
    assert_eq!(parsed.root, pickle::Value::Huge);
}
