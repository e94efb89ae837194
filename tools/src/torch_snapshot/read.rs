//! Reading a snapshot: recognising a snapshot file, naming it, and parsing its bytes into a [`TorchSnapshot`].

use super::pickle;
use super::shape::Shape;
use super::{TorchSnapshot, TorchSnapshotError, MAX_SNAPSHOT_BYTES, PICKLE_MAGIC};
use std::io::Read;
use std::path::Path;

/// Whether `path` holds a pickle: its name ends in `.pickle` or `.pkl`, or it starts with [`PICKLE_MAGIC`]
/// and a protocol from 2 to 5 (an umm trace starts with `#`, a gzip file with 0x1f; other binary data rarely
/// starts with both). False when it cannot be read.
pub fn is_snapshot_file(path: &Path) -> bool {
    let by_name = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("pickle") || e.eq_ignore_ascii_case("pkl"));
    by_name
        || std::fs::File::open(path)
            .and_then(|f| {
                let mut head = Vec::with_capacity(2);
                f.take(2).read_to_end(&mut head)?;
                Ok(matches!(head[..], [PICKLE_MAGIC, 2..=5]))
            })
            .unwrap_or(false)
}

/// A snapshot's name from its path: the file name without `.pickle` or `.pkl`.
pub fn name_of(path: &Path) -> String {
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    for suffix in [".pickle", ".pkl"] {
        if file.len() > suffix.len() && file.to_ascii_lowercase().ends_with(suffix) {
            return file[..file.len() - suffix.len()].to_string();
        }
    }
    file
}

impl TorchSnapshot {
    /// Reads a snapshot file.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, TorchSnapshotError> {
        let path = path.as_ref();
        let label = path.display().to_string();
        let io_error = |source| TorchSnapshotError::Io { path: label.clone(), source };
        let file = std::fs::File::open(path).map_err(io_error)?;
        let bytes = file.metadata().map_err(io_error)?.len();
        if bytes > MAX_SNAPSHOT_BYTES {
            return Err(TorchSnapshotError::TooLarge { path: label, bytes, limit: MAX_SNAPSHOT_BYTES });
        }
        Self::from_reader(name_of(path), &label, file)
    }

    /// Reads a snapshot from `reader`; `label` names it in errors.
    pub fn from_reader(name: impl Into<String>, label: &str, reader: impl Read) -> Result<Self, TorchSnapshotError> {
        let mut bytes = Vec::new();
        reader
            .take(MAX_SNAPSHOT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| TorchSnapshotError::Io { path: label.into(), source })?;
        if bytes.len() as u64 > MAX_SNAPSHOT_BYTES {
            return Err(TorchSnapshotError::TooLarge {
                path: label.into(),
                bytes: bytes.len() as u64,
                limit: MAX_SNAPSHOT_BYTES,
            });
        }
        Self::from_bytes(name, label, &bytes)
    }

    /// Reads a snapshot held in memory; `label` names it in errors.
    pub fn from_bytes(name: impl Into<String>, label: &str, bytes: &[u8]) -> Result<Self, TorchSnapshotError> {
        Self::with_limits(name.into(), label, bytes, pickle::Limits::default())
    }

    pub(super) fn with_limits(
        name: String,
        label: &str,
        bytes: &[u8],
        limits: pickle::Limits,
    ) -> Result<Self, TorchSnapshotError> {
        let pickle = pickle::parse(bytes, limits).map_err(|e| TorchSnapshotError::Pickle {
            path: label.into(),
            offset: e.offset as u64,
            what: e.what,
        })?;
        let format = |what: String| TorchSnapshotError::Format { path: label.into(), what };
        let shape = Shape { p: &pickle };
        let (segments, device_traces) = shape.snapshot().map_err(format)?;
        Ok(Self { name, label: label.into(), protocol: pickle.protocol, segments, device_traces })
    }
}
