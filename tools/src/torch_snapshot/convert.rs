//! The conversion of one device's events into an umm trace: blocks live before the trace, frees, streams, and
//! PyTorch's reserved and allocated figures beside it.

use super::{Action, BlockState, Segment, SnapshotFigures, TorchSnapshot, TorchSnapshotError, TorchTrace, TraceEvent};
use std::collections::{BTreeMap, HashMap, HashSet};
use umm::trace::{Trace, TraceBuilder};

impl TorchSnapshot {
    /// Converts `device`'s trace to an umm trace (see the [module](super) for the rules).
    pub fn to_trace(&self, device: usize) -> Result<Trace, TorchSnapshotError> {
        self.convert(device).map(|c| c.trace)
    }

    /// Converts `device`'s trace to an umm trace, with PyTorch's figures and what was synthesised or skipped.
    pub fn convert(&self, device: usize) -> Result<TorchTrace, TorchSnapshotError> {
        let events = self.device_traces.get(device).ok_or_else(|| TorchSnapshotError::NoDevice {
            path: self.label.clone(),
            device,
            devices: self.devices(),
        })?;
        let segments: Vec<&Segment> = self.segments.iter().filter(|s| s.device == device as u64).collect();
        let mut conversion = Conversion::new(events, device, self.devices());
        conversion.events(events);
        conversion.live_in_segments(&segments);
        conversion.reserved(events, &segments);
        conversion.finish(self.name.clone()).map_err(|what| TorchSnapshotError::Format {
            path: self.label.clone(),
            what: format!("device {device}: {what}"),
        })
    }
}

/// An op of the converted trace before blocks get slots: blocks are numbered as they are created.
enum Step {
    Alloc { id: u64, bytes: u64, stream: i128 },
    Free { id: u64 },
}

/// One device's events on their way to a trace.
struct Conversion {
    figures: SnapshotFigures,
    free_action: Action,
    /// Blocks allocated at the start, in order.
    prelude: Vec<Step>,
    /// The trace's own ops.
    steps: Vec<Step>,
    /// Live block by address: (id, bytes). Zero-byte blocks have no id: they are not replayed.
    live: HashMap<u64, (Option<u64>, u64)>,
    /// Addresses that any alloc or free event names.
    named: HashSet<u64>,
    /// Addresses allocated or freed so far: a free of one of them that is not live is a double free, not a
    /// block from before the trace.
    touched: HashSet<u64>,
    next_id: u64,
    /// Bytes live now and at most, blocks from before the trace included (wide: sizes are any `u64`).
    live_bytes: u128,
    peak: u128,
}

impl Conversion {
    fn new(events: &[TraceEvent], device: usize, devices: usize) -> Self {
        let free_action = if events.iter().any(|e| e.action == Action::FreeCompleted) {
            Action::FreeCompleted
        } else {
            Action::FreeRequested
        };
        let figures = SnapshotFigures {
            device,
            devices,
            events: events.len() as u64,
            free_action: free_action.name().to_string(),
            allocs: 0,
            frees: 0,
            live_before_from_frees: 0,
            live_before_from_segments: 0,
            live_before_bytes: 0,
            live_at_end: 0,
            ooms: 0,
            largest_oom_request_bytes: 0,
            segment_events: 0,
            not_replayed: BTreeMap::new(),
            torch_peak_reserved_bytes: 0,
            torch_peak_allocated_bytes: 0,
            reserved_at_start: 0,
            reserved_at_end: 0,
            notes: Vec::new(),
        };
        Self {
            figures,
            free_action,
            prelude: Vec::new(),
            steps: Vec::new(),
            live: HashMap::new(),
            named: HashSet::new(),
            touched: HashSet::new(),
            next_id: 0,
            live_bytes: 0,
            peak: 0,
        }
    }

    fn skip(&mut self, reason: impl Into<String>) {
        *self.figures.not_replayed.entry(reason.into()).or_default() += 1;
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    /// A block live before the trace: allocated at the start. Returns its id (`None` for zero bytes). It is
    /// live at every point so far, so it raises the peak so far as much as the bytes live now.
    fn live_before(&mut self, bytes: u64, stream: i128) -> Option<u64> {
        self.figures.live_before_bytes = self.figures.live_before_bytes.saturating_add(bytes);
        self.live_bytes += u128::from(bytes);
        self.peak += u128::from(bytes);
        if bytes == 0 {
            return None;
        }
        let id = self.new_id();
        self.prelude.push(Step::Alloc { id, bytes, stream });
        Some(id)
    }

    fn events(&mut self, events: &[TraceEvent]) {
        for event in events {
            match &event.action {
                Action::Alloc => {
                    self.named.insert(event.addr);
                    self.alloc(event);
                }
                Action::FreeRequested | Action::FreeCompleted => {
                    self.named.insert(event.addr);
                    if event.action == self.free_action {
                        self.free(event);
                    } else {
                        self.skip("free_requested (frees are taken from free_completed)");
                    }
                }
                Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap => {
                    self.figures.segment_events += 1;
                }
                Action::Oom => {
                    self.figures.ooms += 1;
                    self.figures.largest_oom_request_bytes = self.figures.largest_oom_request_bytes.max(event.size);
                }
                Action::Snapshot | Action::UserDefined => self.skip(event.action.name()),
                Action::Other(name) => self.skip(format!("unknown action `{name}`")),
            }
        }
    }

    fn alloc(&mut self, event: &TraceEvent) {
        if let Some((id, bytes)) = self.live.remove(&event.addr) {
            // PyTorch never hands out a live address; a trace that says so lost the free: free it first.
            self.skip("free missing before an alloc at a live address (freed there)");
            self.live_bytes -= u128::from(bytes);
            if let Some(id) = id {
                self.steps.push(Step::Free { id });
            }
        }
        self.touched.insert(event.addr);
        self.figures.allocs += 1;
        let id = if event.size == 0 {
            self.skip("zero-byte alloc");
            None
        } else {
            let id = self.new_id();
            self.steps.push(Step::Alloc { id, bytes: event.size, stream: event.stream });
            Some(id)
        };
        self.live.insert(event.addr, (id, event.size));
        self.live_bytes += u128::from(event.size);
        self.peak = self.peak.max(self.live_bytes);
    }

    fn free(&mut self, event: &TraceEvent) {
        let block = match self.live.remove(&event.addr) {
            Some(block) => Some(block),
            None if self.touched.contains(&event.addr) => None,
            None => {
                // Allocated before the trace: it is live from the start, so it counts in every byte total.
                self.figures.live_before_from_frees += 1;
                let id = self.live_before(event.size, event.stream);
                Some((id, event.size))
            }
        };
        self.touched.insert(event.addr);
        let Some((id, bytes)) = block else {
            self.skip(format!("{} of a block not live (freed twice)", self.free_action.name()));
            return;
        };
        self.figures.frees += 1;
        self.live_bytes -= u128::from(bytes);
        if let Some(id) = id {
            self.steps.push(Step::Free { id });
        }
    }

    /// Blocks the segments show in use whose address no event names: live throughout, allocated at the start.
    /// A block waiting for its free counts where frees are `free_completed`, which it has not reached.
    fn live_in_segments(&mut self, segments: &[&Segment]) {
        let pending_is_live = self.free_action == Action::FreeCompleted;
        for segment in segments {
            for block in &segment.blocks {
                let in_use = match block.state {
                    BlockState::ActiveAllocated => true,
                    BlockState::ActivePendingFree => pending_is_live,
                    BlockState::Inactive | BlockState::Other(_) => false,
                };
                if in_use && !self.named.contains(&block.address) {
                    self.named.insert(block.address);
                    self.figures.live_before_from_segments += 1;
                    let bytes = if block.requested_size > 0 { block.requested_size } else { block.size };
                    self.live_before(bytes, segment.stream);
                }
            }
        }
    }

    /// PyTorch's reserved bytes: what the segments hold at the dump, less the events' net change, is what it
    /// held at the start; the events give the rest of the curve.
    fn reserved(&mut self, events: &[TraceEvent], segments: &[&Segment]) {
        let (mut net, mut low, mut high) = (0i128, 0i128, 0i128);
        for event in events {
            match event.action {
                Action::SegmentAlloc | Action::SegmentMap => net += i128::from(event.size),
                Action::SegmentFree | Action::SegmentUnmap => net -= i128::from(event.size),
                _ => continue,
            }
            low = low.min(net);
            high = high.max(net);
        }
        let end: i128 = segments.iter().map(|s| i128::from(s.total_size)).sum();
        let mut start = end - net;
        if start + low < 0 {
            self.figures.notes.push(format!(
                "the segments hold {end} bytes at the snapshot, too few for the segment events before it (they \
                 would leave {} bytes reserved at their lowest); reserved bytes at the start taken as {}",
                start + low,
                -low
            ));
            start = -low;
        }
        let clamp = |v: i128| u64::try_from(v.max(0)).unwrap_or(u64::MAX);
        self.figures.reserved_at_start = clamp(start);
        self.figures.reserved_at_end = clamp(end);
        self.figures.torch_peak_reserved_bytes = clamp(start + high);
    }

    fn finish(mut self, name: String) -> Result<TorchTrace, String> {
        self.figures.torch_peak_allocated_bytes = u64::try_from(self.peak).unwrap_or(u64::MAX);
        let f = &mut self.figures;
        if f.torch_peak_reserved_bytes < f.torch_peak_allocated_bytes {
            f.notes.push(format!(
                "PyTorch's peak reserved ({} bytes) is below its peak allocated ({} bytes): the snapshot's segments \
                 and segment events do not cover its blocks, so its reserved figures are incomplete",
                f.torch_peak_reserved_bytes, f.torch_peak_allocated_bytes
            ));
        }
        // Stream values in order of first appearance: 0 stays 0, the others count up from 1.
        let mut streams: HashMap<i128, u32> = HashMap::from([(0, 0)]);
        let mut builder = TraceBuilder::new(name);
        for step in self.prelude.iter().chain(&self.steps) {
            match *step {
                Step::Alloc { id, bytes, stream } => {
                    let next = u32::try_from(streams.len()).map_err(|_| "more than 2^32 streams")?;
                    let stream = *streams.entry(stream).or_insert(next);
                    builder.alloc(id, bytes, stream)?;
                }
                Step::Free { id } => builder.free(id)?,
            }
        }
        let trace = builder.finish();
        self.figures.live_at_end = trace.allocs - trace.frees;
        Ok(TorchTrace { trace, figures: self.figures })
    }
}
