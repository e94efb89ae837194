//! A wgpu pool's segment: one `wgpu::Buffer`, the whole of one block, and, for a buffer the host can map, the lock
//! that gives its users turns.
//!
//! wgpu keeps one mapping state per buffer, not per range. While any range of a buffer is mapped, or a mapping of
//! it is pending, a submission that uses the buffer fails validation ("still mapped"), a `queue.write_buffer` to
//! it fails, and a second `map_async` fails; a `queue.write_buffer` recorded before a mapping is requested and
//! submitted after it could land while the host holds the mapping. Two threads may read one block at once (reads
//! borrow it shared), and so work on one buffer: every read, write, fill and copy of a mappable segment holds the
//! segment's turn from its first command to its last wait (or its unmap). A buffer that cannot be mapped needs no
//! turn: the queue orders the work on it.

use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;

/// One segment of a wgpu pool: a buffer, the whole of one block (or of one adopted buffer).
#[derive(Debug, Clone)]
pub struct WgpuSegment {
    buffer: wgpu::Buffer,
    /// `Some` for a mappable buffer: held around each access (see the module documentation).
    turn: Option<Arc<Mutex<()>>>,
}

impl WgpuSegment {
    pub(crate) fn new(buffer: wgpu::Buffer, mappable: bool) -> Self {
        Self { buffer, turn: mappable.then(|| Arc::new(Mutex::new(()))) }
    }

    /// The segment's buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Waits for this segment's turn; `None` at once for a buffer that is never mapped. Hold the guard over the
    /// whole access, up to the wait for the queue or the unmap.
    pub(crate) fn turn(&self) -> Option<MutexGuard<'_, ()>> {
        self.turn.as_deref().map(Mutex::lock)
    }

    /// The turns of two segments (one turn when both are the same buffer), always taken in the same order, so
    /// that two copies in opposite directions cannot each hold one and wait for the other.
    pub(crate) fn both_turns<'a>(a: &'a Self, b: &'a Self) -> [Option<MutexGuard<'a, ()>>; 2] {
        let key = |s: &Self| s.turn.as_ref().map_or(0, |t| Arc::as_ptr(t) as usize);
        if a.buffer == b.buffer {
            return [a.turn(), None];
        }
        let (first, second) = if key(a) <= key(b) { (a, b) } else { (b, a) };
        let first = first.turn();
        [first, second.turn()]
    }
}
