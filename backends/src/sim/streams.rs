//! The simulated device's streams: a deterministic model of queued work, so that the rules for sharing memory
//! across streams run in CI. A stream's work runs at once unless a test holds it back
//! ([`SimBackend::hold_stream`](super::SimBackend::hold_stream)); marks recorded on a held stream pass only when
//! the test lets it finish. The model logs what a real device would have been asked: streams made to wait for
//! others, host waits, and pages unmapped while work that may use them is still held (what faults on a GPU).
//!
//! Streams can also capture ([`SimBackend::begin_capture`](super::SimBackend::begin_capture)), as CUDA streams do
//! while a graph is recorded. The model then counts every call that the driver refuses during a capture (and that
//! invalidates it): querying or waiting on the host for any mark while a capture is underway (the global capture
//! mode, PyTorch's, refuses every event query then), making a stream wait for a mark from outside its capture,
//! synchronizing a capturing stream before an unmap, or synchronizing the whole device while any stream captures.

use crate::{StreamId, StreamMark};

/// What the simulated streams saw, for tests to check.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStreamLog {
    /// Marks recorded.
    pub marks_recorded: u64,
    /// Marks recorded and not yet given back.
    pub marks_live: u64,
    /// Every device-side wait: (the stream made to wait, the stream it waits for).
    pub waits: Vec<(StreamId, StreamId)>,
    /// Unmaps that waited for their stream (held or not): each a `cuStreamSynchronize` on a GPU.
    pub waited_unmaps: u64,
    /// Host waits on held work: unmaps that waited for a held stream, and marks waited for on the host
    /// ([`Backend::wait_mark`](crate::Backend::wait_mark)); the host would have blocked until the work ran (the
    /// model lets it finish).
    pub host_waits: u64,
    /// Unmaps, without waiting, of pages of a stream whose work was held: on a GPU a kernel still queued there
    /// could fault. Always 0 in a correct pool.
    pub unsafe_unmaps: u64,
    /// Calls a CUDA driver refuses while a stream captures (see the module's documentation): each would have
    /// invalidated the capture. Always 0 in a correct pool.
    pub capture_violations: u64,
}

#[derive(Debug, Clone, Copy)]
struct SimMark {
    stream: StreamId,
    passed: bool,
    /// Recorded on a stream that was capturing: a node of the graph, not a point of real work.
    captured: bool,
}

#[derive(Debug, Default)]
pub(super) struct SimStreams {
    held: Vec<StreamId>,
    /// Streams capturing now.
    capturing: Vec<StreamId>,
    /// Marks by id; freed ids are reused.
    marks: Vec<Option<SimMark>>,
    spare_ids: Vec<usize>,
    log: SimStreamLog,
}

impl SimStreams {
    pub(super) fn hold(&mut self, stream: StreamId) {
        if !self.held.contains(&stream) {
            self.held.push(stream);
        }
    }

    /// Runs the held work of `stream`: its marks pass.
    pub(super) fn finish(&mut self, stream: StreamId) {
        self.held.retain(|&s| s != stream);
        for mark in self.marks.iter_mut().flatten().filter(|m| m.stream == stream) {
            mark.passed = true;
        }
    }

    fn is_held(&self, stream: StreamId) -> bool {
        self.held.contains(&stream)
    }

    pub(super) fn begin_capture(&mut self, stream: StreamId) {
        if !self.capturing.contains(&stream) {
            self.capturing.push(stream);
        }
    }

    pub(super) fn end_capture(&mut self, stream: StreamId) {
        self.capturing.retain(|&s| s != stream);
    }

    fn is_capturing(&self, stream: StreamId) -> bool {
        self.capturing.contains(&stream)
    }

    /// The device is synchronized as a whole (`cuCtxSynchronize`): refused while any stream captures.
    pub(super) fn synchronize_device(&mut self) {
        if !self.capturing.is_empty() {
            self.log.capture_violations += 1;
        }
    }

    pub(super) fn mark(&mut self, stream: StreamId) -> StreamMark {
        let captured = self.is_capturing(stream);
        let mark = SimMark { stream, passed: !self.is_held(stream) && !captured, captured };
        let id = match self.spare_ids.pop() {
            Some(id) => {
                self.marks[id] = Some(mark);
                id
            }
            None => {
                self.marks.push(Some(mark));
                self.marks.len() - 1
            }
        };
        self.log.marks_recorded += 1;
        self.log.marks_live += 1;
        StreamMark { stream, id: id as u64 }
    }

    fn get(&self, mark: &StreamMark) -> SimMark {
        self.marks.get(mark.id as usize).copied().flatten().expect("a live mark of this device")
    }

    /// Whether the work before `mark` has run. Querying a mark that a capture recorded is refused (and the
    /// mark never passes: no work stands behind it).
    pub(super) fn passed(&mut self, mark: &StreamMark) -> bool {
        let found = self.get(mark);
        // In the global capture mode (PyTorch's) every event query is refused while a capture is underway.
        if found.captured || !self.capturing.is_empty() {
            self.log.capture_violations += 1;
        }
        found.passed
    }

    pub(super) fn wait(&mut self, stream: StreamId, mark: &StreamMark) {
        let found = self.get(mark);
        // A capturing stream may wait only for points of its own capture.
        if self.is_capturing(stream) != found.captured {
            self.log.capture_violations += 1;
        }
        self.log.waits.push((stream, found.stream));
    }

    /// The host waits for `mark`: held work on its stream runs (the model lets it finish), counted as a host
    /// wait.
    pub(super) fn wait_on_host(&mut self, mark: &StreamMark) {
        let found = self.get(mark);
        if found.captured || !self.capturing.is_empty() {
            self.log.capture_violations += 1;
        }
        let stream = found.stream;
        if self.is_held(stream) {
            self.log.host_waits += 1;
            self.finish(stream);
        }
    }

    pub(super) fn release(&mut self, mark: StreamMark) {
        let slot = self.marks.get_mut(mark.id as usize).expect("a mark of this device");
        assert!(slot.take().is_some(), "a mark given back twice");
        self.spare_ids.push(mark.id as usize);
        self.log.marks_live -= 1;
    }

    /// Pages of `stream`'s arena unmapped, after waiting for the stream or not.
    pub(super) fn unmapped(&mut self, stream: StreamId, wait: bool) {
        self.log.waited_unmaps += u64::from(wait);
        if wait && self.is_capturing(stream) {
            self.log.capture_violations += 1;
        }
        if !self.is_held(stream) {
            return;
        }
        if wait {
            self.log.host_waits += 1;
            self.finish(stream);
        } else {
            self.log.unsafe_unmaps += 1;
        }
    }

    pub(super) fn log(&self) -> SimStreamLog {
        self.log.clone()
    }
}
