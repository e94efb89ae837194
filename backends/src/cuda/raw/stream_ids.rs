//! Which [`StreamId`]s name live CUDA streams. A `StreamId` is a plain integer that anyone can write, but the
//! CUDA backend hands it to the driver as a `CUstream` pointer: an integer that safe code made up would be a
//! dangling handle inside the driver. So the backend passes on only streams it has seen live: [`stream_id`]
//! registers a cudarc stream (weakly: once the stream is dropped its id is refused), and
//! [`foreign_stream`](super::foreign_stream) takes an `unsafe` promise for a stream made elsewhere (PyTorch's,
//! through the C ABI). Everything else, but `StreamId(0)` (the null stream), is refused with an error.

use crate::{Error, Result, StreamId};
use cudarc::driver::{sys, CudaStream};
use parking_lot::Mutex;
use std::sync::{Arc, Weak};

/// How a registered stream is known.
enum Known {
    /// A cudarc stream: live while this upgrades.
    Made(Weak<CudaStream>),
    /// A stream made outside cudarc, whose caller promised it stays live while umm uses it.
    Vouched,
}

/// Registered streams by raw handle. A handful in practice: a linear search, dead entries pruned on insert.
static KNOWN: Mutex<Vec<(u64, Known)>> = Mutex::new(Vec::new());

/// The [`StreamId`] of a cudarc stream: its raw `CUstream` as an integer (0 for the null stream). Registers the
/// stream, so that the CUDA backend accepts the id for as long as the stream lives.
pub fn stream_id(stream: &Arc<CudaStream>) -> StreamId {
    let raw = stream.cu_stream() as usize as u64;
    if raw != 0 {
        register(raw, Known::Made(Arc::downgrade(stream)));
    }
    StreamId(raw)
}

/// Registers a stream made outside cudarc: from then on [`live`] accepts its id.
///
/// # Safety
/// As for [`super::foreign_stream`]: `raw` is 0 or a live `CUstream` that stays live for as long as umm may queue
/// work or record events on it.
pub(super) unsafe fn vouch(raw: u64) -> StreamId {
    if raw != 0 {
        register(raw, Known::Vouched);
    }
    StreamId(raw)
}

fn register(raw: u64, known: Known) {
    let mut streams = KNOWN.lock();
    // The C ABI vouches for its stream on every call: once is enough.
    if matches!(known, Known::Vouched) && streams.iter().any(|(r, k)| *r == raw && matches!(k, Known::Vouched)) {
        return;
    }
    streams.retain(|(r, k)| *r != raw && !matches!(k, Known::Made(w) if w.strong_count() == 0));
    streams.push((raw, known));
}

/// A stream checked to be live and of the backend's context, kept alive (when cudarc's) while this lives: what
/// the raw layer's stream-ordered calls take.
pub(in crate::cuda) struct LiveStream {
    raw: u64,
    _keep: Option<Arc<CudaStream>>,
}

impl LiveStream {
    /// The raw `CUstream` handle as an integer (0: the null stream).
    pub(in crate::cuda) fn raw(&self) -> u64 {
        self.raw
    }
}

/// `stream` as a live stream of `context` (the context of the device named `device`), or an error saying why it
/// is not one.
pub(in crate::cuda) fn live(stream: StreamId, context: sys::CUcontext, device: &str) -> Result<LiveStream> {
    if stream.0 == 0 {
        return Ok(LiveStream { raw: 0, _keep: None });
    }
    let refused = |why: &str| Error::Unsupported {
        backend: device.to_string(),
        what: format!("stream {:#x}: {why}; make stream ids with cuda::stream_id", stream.0),
    };
    let streams = KNOWN.lock();
    match streams.iter().find(|(raw, _)| *raw == stream.0).map(|(_, known)| known) {
        None => Err(refused("not a stream umm has seen")),
        Some(Known::Vouched) => Ok(LiveStream { raw: stream.0, _keep: None }),
        Some(Known::Made(weak)) => {
            let arc = weak.upgrade().ok_or_else(|| refused("the stream has been dropped"))?;
            if arc.context().cu_ctx() != context {
                return Err(refused("a stream of another device's context"));
            }
            Ok(LiveStream { raw: stream.0, _keep: Some(arc) })
        }
    }
}
