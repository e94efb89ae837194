//! The simulated device's streams: a deterministic model of queued work, so that the rules for sharing memory
//! across streams run in CI. Each stream is a queue of work items numbered from 1; an item runs (completes) at
//! once unless the test holds the stream back ([`SimBackend::hold_stream`](super::SimBackend::hold_stream)), and
//! then only when the test says: all of it ([`SimBackend::finish_stream`](super::SimBackend::finish_stream)) or
//! up to a given item ([`SimBackend::complete_stream`](super::SimBackend::complete_stream)), so that a test can
//! let a stream's work run one item at a time and catch a reuse one mark too early. A mark stands after the
//! items queued before it and passes once they have run. A device-side wait ([`Backend::wait_for_mark`]) is an
//! item too: the stream's later work runs only after the mark's, as on a GPU. The model logs what a real device
//! would have been asked: streams made to wait for others, host waits, and pages unmapped while work that may use
//! them is still queued (what faults on a GPU).
//!
//! Streams can also capture ([`SimBackend::begin_capture`](super::SimBackend::begin_capture)), as CUDA streams do
//! while a graph is recorded. The model then counts every call that the driver refuses during a capture (and that
//! invalidates it): querying or waiting on the host for any mark while a capture is underway (the global capture
//! mode, PyTorch's, refuses every event query then), making a stream wait for a mark from outside its capture,
//! synchronizing a capturing stream before an unmap, or synchronizing the whole device while any stream captures.
//!
//! [`Backend::wait_for_mark`]: crate::Backend::wait_for_mark

use crate::{StreamId, StreamMark};
use std::collections::HashMap;

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
    /// Host waits on work not yet run: unmaps that waited for such a stream, marks waited for on the host
    /// ([`Backend::wait_mark`](crate::Backend::wait_mark)) and device synchronizations; the host would have
    /// blocked until the work ran (the model runs it).
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
    /// The last item queued on its stream when it was recorded: it passes once that item has run.
    item: u64,
    /// Recorded on a stream that was capturing: a node of the graph, not a point of real work.
    captured: bool,
}

/// One stream's queue.
#[derive(Debug, Default)]
struct Queue {
    /// Items queued so far (numbered 1..=queued).
    queued: u64,
    /// Items run so far: the first `completed` items.
    completed: u64,
    /// Whether the test holds the work back: only [`SimStreams::complete`] runs it.
    held: bool,
    /// Device-side waits queued here: (the wait's item, the stream waited for, the item waited for there).
    waits: Vec<(u64, StreamId, u64)>,
}

#[derive(Debug, Default)]
pub(super) struct SimStreams {
    queues: HashMap<StreamId, Queue>,
    /// Streams capturing now.
    capturing: Vec<StreamId>,
    /// Marks by id; freed ids are reused.
    marks: Vec<Option<SimMark>>,
    spare_ids: Vec<usize>,
    log: SimStreamLog,
}

impl SimStreams {
    fn queue(&mut self, stream: StreamId) -> &mut Queue {
        self.queues.entry(stream).or_default()
    }

    fn completed(&self, stream: StreamId) -> u64 {
        self.queues.get(&stream).map_or(0, |q| q.completed)
    }

    /// Whether `stream` has work queued that has not run.
    fn busy(&self, stream: StreamId) -> bool {
        self.queues.get(&stream).is_some_and(|q| q.completed < q.queued)
    }

    /// Holds `stream` back behind one long item (a kernel still running): nothing queued there from now on runs
    /// until the test lets it.
    pub(super) fn hold(&mut self, stream: StreamId) {
        let queue = self.queue(stream);
        if !queue.held {
            queue.held = true;
            queue.queued += 1;
        }
    }

    /// Queues one item of work on `stream` and returns its number; it runs at once unless the stream is held or
    /// waits for held work.
    pub(super) fn launch(&mut self, stream: StreamId) -> u64 {
        let queue = self.queue(stream);
        queue.queued += 1;
        let item = queue.queued;
        self.run_free_streams();
        item
    }

    /// Runs the held work of `stream` and lets it run freely from now on: its marks pass.
    pub(super) fn finish(&mut self, stream: StreamId) {
        let queued = self.queue(stream).queued;
        self.complete(stream, queued);
        self.queue(stream).held = false;
        self.run_free_streams();
    }

    /// Runs the work of `stream` up to item `item` (at most what is queued), and the work on other streams that
    /// it waits for; the stream stays held.
    pub(super) fn complete(&mut self, stream: StreamId, item: u64) {
        let queue = self.queue(stream);
        let item = item.min(queue.queued);
        if item <= queue.completed {
            return;
        }
        let from = queue.completed;
        let before: Vec<(StreamId, u64)> =
            queue.waits.iter().filter(|w| w.0 > from && w.0 <= item).map(|w| (w.1, w.2)).collect();
        // The item that ran after a wait means the work waited for ran first.
        for (other, upto) in before {
            self.complete(other, upto);
        }
        self.queue(stream).completed = item;
        self.run_free_streams();
    }

    /// Lets every stream that is not held run as far as its waits allow, until nothing moves.
    fn run_free_streams(&mut self) {
        loop {
            let mut moved = false;
            let streams: Vec<StreamId> = self.queues.iter().filter(|(_, q)| !q.held).map(|(&s, _)| s).collect();
            for stream in streams {
                let queue = &self.queues[&stream];
                let blocked = queue
                    .waits
                    .iter()
                    .find(|&&(at, other, upto)| at > queue.completed && self.completed(other) < upto)
                    .map(|w| w.0 - 1);
                let target = blocked.unwrap_or(queue.queued);
                if target > queue.completed {
                    self.queue(stream).completed = target;
                    moved = true;
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Items queued on `stream` so far, and how many have run.
    pub(super) fn progress(&self, stream: StreamId) -> (u64, u64) {
        self.queues.get(&stream).map_or((0, 0), |q| (q.queued, q.completed))
    }

    /// The last item of `other` that work queued on `stream` from now on runs after, through device-side waits
    /// queued on `stream` and, transitively, on the streams those wait for up to the item waited for (0 for
    /// none).
    pub(super) fn ordered_after(&self, stream: StreamId, other: StreamId) -> u64 {
        // The furthest item of each stream reached so far; a stream is visited again only when reached further.
        let mut reached: HashMap<StreamId, u64> = HashMap::from([(stream, u64::MAX)]);
        let mut to_visit = vec![(stream, u64::MAX)];
        while let Some((at, upto)) = to_visit.pop() {
            let Some(queue) = self.queues.get(&at) else { continue };
            for &(item, waited, waited_item) in &queue.waits {
                if item <= upto && reached.get(&waited).is_none_or(|&r| r < waited_item) {
                    reached.insert(waited, waited_item);
                    to_visit.push((waited, waited_item));
                }
            }
        }
        reached.get(&other).copied().filter(|_| other != stream).unwrap_or(0)
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

    /// The device is synchronized as a whole (`cuCtxSynchronize`): refused while any stream captures; the host
    /// waits for every stream's work.
    pub(super) fn synchronize_device(&mut self) {
        if !self.capturing.is_empty() {
            self.log.capture_violations += 1;
        }
        let busy: Vec<(StreamId, u64)> =
            self.queues.iter().filter(|(_, q)| q.completed < q.queued).map(|(&s, q)| (s, q.queued)).collect();
        if !busy.is_empty() {
            self.log.host_waits += 1;
        }
        for (stream, queued) in busy {
            self.complete(stream, queued);
        }
    }

    pub(super) fn mark(&mut self, stream: StreamId) -> StreamMark {
        let captured = self.is_capturing(stream);
        let mark = SimMark { stream, item: self.queue(stream).queued, captured };
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

    fn has_passed(&self, mark: &SimMark) -> bool {
        !mark.captured && self.completed(mark.stream) >= mark.item
    }

    /// Whether the work before `mark` has run. Querying a mark that a capture recorded is refused (and the
    /// mark never passes: no work stands behind it).
    pub(super) fn passed(&mut self, mark: &StreamMark) -> bool {
        let found = self.get(mark);
        // In the global capture mode (PyTorch's) every event query is refused while a capture is underway.
        if found.captured || !self.capturing.is_empty() {
            self.log.capture_violations += 1;
        }
        self.has_passed(&found)
    }

    /// `stream` waits on the device for `mark`: an item of its queue that runs once the mark has passed.
    pub(super) fn wait(&mut self, stream: StreamId, mark: &StreamMark) {
        let found = self.get(mark);
        // A capturing stream may wait only for points of its own capture.
        if self.is_capturing(stream) != found.captured {
            self.log.capture_violations += 1;
        }
        self.log.waits.push((stream, found.stream));
        if found.captured {
            return;
        }
        let queue = self.queue(stream);
        queue.queued += 1;
        let at = queue.queued;
        queue.waits.push((at, found.stream, found.item));
        self.run_free_streams();
    }

    /// The host waits for `mark`: the work before it runs (the model runs it), counted as a host wait.
    pub(super) fn wait_on_host(&mut self, mark: &StreamMark) {
        let found = self.get(mark);
        if found.captured || !self.capturing.is_empty() {
            self.log.capture_violations += 1;
        }
        if !found.captured && !self.has_passed(&found) {
            self.log.host_waits += 1;
            self.complete(found.stream, found.item);
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
        if !self.busy(stream) {
            return;
        }
        if wait {
            self.log.host_waits += 1;
            let queued = self.queue(stream).queued;
            self.complete(stream, queued);
        } else {
            self.log.unsafe_unmaps += 1;
        }
    }

    pub(super) fn log(&self) -> SimStreamLog {
        self.log.clone()
    }
}
