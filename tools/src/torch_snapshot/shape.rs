//! The shape of a snapshot's dict: reading segments, blocks and events out of the parsed pickle, with errors
//! that name the field at fault.

use super::pickle;
use super::{Action, BlockState, Segment, SegmentBlock, TraceEvent};

/// Reads the snapshot's dict out of the parsed pickle, naming the field at fault. Places (`segments[3]`) are
/// closures, made into text only for an error.
pub(super) struct Shape<'a> {
    pub(super) p: &'a pickle::Pickle,
}

type Fields<'a> = &'a [(pickle::Value, pickle::Value)];
type Place<'p> = &'p dyn Fn() -> String;

impl<'a> Shape<'a> {
    pub(super) fn snapshot(&self) -> Result<(Vec<Segment>, Vec<Vec<TraceEvent>>), String> {
        let root = self.p.dict(self.p.root).ok_or_else(|| {
            format!(
                "the pickle holds {}, not the dict torch.cuda.memory._dump_snapshot writes",
                self.p.describe(self.p.root)
            )
        })?;
        let Some(traces) = self.p.get(root, "device_traces") else {
            return Err(format!(
                "the dict has no `device_traces` (its keys: {}); record with \
                 torch.cuda.memory._record_memory_history(max_entries=...) before _dump_snapshot",
                self.keys(root)
            ));
        };
        let traces = self.list(traces, &|| "device_traces".into())?;
        let mut device_traces = Vec::with_capacity(traces.len());
        for (d, &events) in traces.iter().enumerate() {
            let events = self.list(events, &|| format!("device_traces[{d}]"))?;
            let parsed: Result<Vec<_>, _> = events
                .iter()
                .enumerate()
                .map(|(i, &e)| self.event(e, &|| format!("device_traces[{d}][{i}]")))
                .collect();
            device_traces.push(parsed?);
        }
        let segments = match self.p.get(root, "segments") {
            None => Vec::new(),
            Some(segments) => {
                let segments = self.list(segments, &|| "segments".into())?;
                let parsed: Result<Vec<_>, _> =
                    segments.iter().enumerate().map(|(i, &s)| self.segment(s, &|| format!("segments[{i}]"))).collect();
                parsed?
            }
        };
        Ok((segments, device_traces))
    }

    fn keys(&self, dict: Fields<'_>) -> String {
        if dict.is_empty() {
            return "none".into();
        }
        let mut keys: Vec<String> = dict.iter().take(12).map(|&(k, _)| self.p.quote(k)).collect();
        if dict.len() > 12 {
            keys.push("...".into());
        }
        keys.join(", ")
    }

    fn list(&self, value: pickle::Value, place: Place<'_>) -> Result<&'a [pickle::Value], String> {
        self.p.list(value).ok_or_else(|| format!("`{}` is {}, expected a list", place(), self.p.describe(value)))
    }

    fn dict(&self, value: pickle::Value, place: Place<'_>) -> Result<Fields<'a>, String> {
        self.p.dict(value).ok_or_else(|| format!("`{}` is {}, expected a dict", place(), self.p.describe(value)))
    }

    fn field(&self, dict: Fields<'_>, key: &str, place: Place<'_>) -> Result<pickle::Value, String> {
        self.p.get(dict, key).ok_or_else(|| format!("`{}` has no `{key}` (its keys: {})", place(), self.keys(dict)))
    }

    /// An integer within `lo..=hi` at `place.key`, saying which bound it breaks.
    fn int(
        &self,
        value: pickle::Value,
        place: Place<'_>,
        key: &str,
        what: &str,
        (lo, hi): (i128, i128),
    ) -> Result<i128, String> {
        match self.p.int(value) {
            Some(n) if (lo..=hi).contains(&n) => Ok(n),
            Some(n) if n < lo && lo == 0 => Err(format!("`{}.{key}` is {n}: a {what} cannot be negative", place())),
            Some(n) => Err(format!("`{}.{key}` is {n}, outside the {what}s this reader takes ({lo} to {hi})", place())),
            None => Err(format!("`{}.{key}` is {}, expected an integer {what}", place(), self.p.describe(value))),
        }
    }

    /// A required field holding a `u64` (`what` names it in errors).
    fn u64_field(&self, dict: Fields<'_>, key: &str, place: Place<'_>, what: &str) -> Result<u64, String> {
        let value = self.field(dict, key, place)?;
        Ok(self.int(value, place, key, what, U64)? as u64)
    }

    /// An optional field holding a `u64`: `None` when absent.
    fn opt_u64(&self, dict: Fields<'_>, key: &str, place: Place<'_>, what: &str) -> Result<Option<u64>, String> {
        match self.p.get(dict, key) {
            None => Ok(None),
            Some(value) => Ok(Some(self.int(value, place, key, what, U64)? as u64)),
        }
    }

    /// A stream: PyTorch writes a `cudaStream_t` as an integer, which may be signed. 0 when absent.
    fn stream(&self, dict: Fields<'_>, place: Place<'_>) -> Result<i128, String> {
        match self.p.get(dict, "stream") {
            None | Some(pickle::Value::None) => Ok(0),
            Some(value) => self.int(value, place, "stream", "stream", (i64::MIN.into(), u64::MAX.into())),
        }
    }

    fn event(&self, value: pickle::Value, place: Place<'_>) -> Result<TraceEvent, String> {
        let dict = self.dict(value, place)?;
        let action = self.field(dict, "action", place)?;
        let action = Action::parse(self.p.str(action).ok_or_else(|| {
            format!("`{}.action` is {}, expected a string such as 'alloc'", place(), self.p.describe(action))
        })?);
        let in_event = |e: String| format!("{e} (in an `{}` event)", action.name());
        let (addr, size) = if action.has_range() {
            let addr = self.u64_field(dict, "addr", place, "address").map_err(in_event)?;
            (addr, self.u64_field(dict, "size", place, "size").map_err(in_event)?)
        } else if action == Action::Oom {
            (0, self.opt_u64(dict, "size", place, "size").map_err(in_event)?.unwrap_or(0))
        } else {
            (0, 0)
        };
        let stream = self.stream(dict, place).map_err(in_event)?;
        let time_us = self.p.get(dict, "time_us").and_then(|v| self.p.int(v)).and_then(|t| i64::try_from(t).ok());
        Ok(TraceEvent { action, addr, size, stream, time_us })
    }

    fn segment(&self, value: pickle::Value, place: Place<'_>) -> Result<Segment, String> {
        let dict = self.dict(value, place)?;
        let device = self.u64_field(dict, "device", place, "device index")?;
        let address = self.u64_field(dict, "address", place, "address")?;
        let total_size = self.u64_field(dict, "total_size", place, "size")?;
        let stream = self.stream(dict, place)?;
        let is_expandable = matches!(self.p.get(dict, "is_expandable"), Some(pickle::Value::Bool(true)));
        let blocks = match self.p.get(dict, "blocks") {
            None => &[][..],
            Some(blocks) => self.list(blocks, &|| format!("{}.blocks", place()))?,
        };
        let mut next = address;
        let mut parsed = Vec::with_capacity(blocks.len());
        for (i, &block) in blocks.iter().enumerate() {
            let place = || format!("{}.blocks[{i}]", place());
            let dict = self.dict(block, &place)?;
            let size = self.u64_field(dict, "size", &place, "size")?;
            let requested_size = self.opt_u64(dict, "requested_size", &place, "size")?.unwrap_or(0);
            // Older snapshots give no block addresses: blocks lie side by side from the segment's address.
            let address = self.opt_u64(dict, "address", &place, "address")?.unwrap_or(next);
            next = address.saturating_add(size);
            let state = self.field(dict, "state", &place)?;
            let state = match self.p.str(state) {
                Some("active_allocated") => BlockState::ActiveAllocated,
                Some("active_pending_free") => BlockState::ActivePendingFree,
                Some("inactive") => BlockState::Inactive,
                Some(other) => BlockState::Other(other.to_string()),
                None => {
                    return Err(format!("`{}.state` is {}, expected a string", place(), self.p.describe(state)));
                }
            };
            parsed.push(SegmentBlock { address, size, requested_size, state });
        }
        Ok(Segment { device, address, total_size, stream, is_expandable, blocks: parsed })
    }
}

/// The range of a `u64` field.
const U64: (i128, i128) = (0, u64::MAX as i128);
