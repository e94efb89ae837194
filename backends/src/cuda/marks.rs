//! Stream marks of a CUDA backend ([`Backend::mark_stream`](crate::Backend::mark_stream)): events recorded on a
//! pool's streams before memory freed there goes to another stream. Events are kept for reuse, since creating
//! one is a driver call that recording an existing one spares.

use super::backend::CudaBackend;
use super::raw;
use crate::{Backend, Error, Result, StreamId, StreamMark};
use cudarc::driver::sys;

impl CudaBackend {
    /// Records a mark on `stream`: an event at the current end of its queue.
    pub(super) fn record_mark(&self, stream: StreamId) -> Result<StreamMark> {
        let live = self.live_stream(stream)?;
        self.bind()?;
        let mut marks = self.marks.lock();
        let event = match marks.spare.pop() {
            Some(event) => event,
            None => self.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(|e| {
                Error::Driver { backend: self.name().to_string(), call: "cuEventCreate".into(), message: e.to_string() }
            })?,
        };
        if let Err(f) = raw::event_record(&event, &live) {
            marks.spare.push(event);
            return Err(self.error(f));
        }
        let id = match marks.free_ids.pop() {
            Some(id) => {
                marks.recorded[id] = Some(event);
                id
            }
            None => {
                marks.recorded.push(Some(event));
                marks.recorded.len() - 1
            }
        };
        Ok(StreamMark { stream, id: id as u64 })
    }

    /// Whether the work before `mark` has run. An error of the context counts as not passed (the memory then
    /// stays where it is).
    pub(super) fn query_mark(&self, mark: &StreamMark) -> bool {
        let marks = self.marks.lock();
        let Some(Some(event)) = marks.recorded.get(mark.id as usize) else { return false };
        match event.try_is_complete() {
            Ok(passed) => passed,
            Err(e) => {
                log::warn!("{}: querying a stream mark failed: {e}", self.name());
                false
            }
        }
    }

    /// Makes `stream` wait on the device for `mark`.
    pub(super) fn order_after(&self, stream: StreamId, mark: &StreamMark) -> Result<()> {
        let live = self.live_stream(stream)?;
        self.bind()?;
        let marks = self.marks.lock();
        let Some(Some(event)) = marks.recorded.get(mark.id as usize) else {
            return Err(Error::InvalidConfig(format!("{}: stream mark {} is not live", self.name(), mark.id)));
        };
        raw::stream_wait_event(&live, event).map_err(|f| self.error(f))
    }

    /// Blocks the host until the work before `mark` has run. A mark that is not live has nothing to wait for.
    pub(super) fn wait_for_mark_on_host(&self, mark: &StreamMark) -> Result<()> {
        self.bind()?;
        let marks = self.marks.lock();
        let Some(Some(event)) = marks.recorded.get(mark.id as usize) else { return Ok(()) };
        event.synchronize().map_err(|e| Error::Driver {
            backend: self.name().to_string(),
            call: "cuEventSynchronize".into(),
            message: e.to_string(),
        })
    }

    /// Keeps a given-back mark's event for the next mark.
    pub(super) fn drop_mark(&self, mark: StreamMark) {
        let mut marks = self.marks.lock();
        if let Some(event) = marks.recorded.get_mut(mark.id as usize).and_then(Option::take) {
            marks.spare.push(event);
            marks.free_ids.push(mark.id as usize);
        }
    }
}
