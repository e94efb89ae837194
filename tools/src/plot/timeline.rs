//! What a plot shows: each device's panel of allocation spans over time, from a snapshot or a trace.

#[cfg(doc)]
use super::render_svg;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use umm::observe::Snapshot;
use umm::profiler::EventKind;
use umm::trace::{Op, Trace};
use umm::{Error, Result};

/// One allocation's life on a timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// Allocation id (trace: allocation number from 0; snapshot: the event id).
    pub id: u64,
    /// Step at which it was allocated.
    pub start: u64,
    /// Step at which it was freed; `None` if still live at the end.
    pub end: Option<u64>,
    /// Bytes.
    pub bytes: u64,
    /// Label, if any.
    pub label: Option<String>,
    /// Call site, if known.
    pub call_site: Option<String>,
}

/// One device's (or one trace's) allocations.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Panel {
    /// Shown above the panel.
    pub name: String,
    /// Allocations, in allocation order.
    pub spans: Vec<Span>,
    /// Reserved bytes as steps `(step, bytes)`, when known (snapshot segment events).
    pub reserved: Vec<(u64, u64)>,
}

impl Panel {
    /// Live bytes after each step where they change: `(step, live bytes)`, in step order. O(n log n).
    pub fn live_curve(&self) -> Vec<(u64, u64)> {
        let mut deltas: BTreeMap<u64, i128> = BTreeMap::new();
        for s in &self.spans {
            *deltas.entry(s.start).or_default() += i128::from(s.bytes);
            if let Some(end) = s.end {
                *deltas.entry(end).or_default() -= i128::from(s.bytes);
            }
        }
        let mut live: i128 = 0;
        deltas
            .into_iter()
            .map(|(x, d)| {
                live += d;
                (x, u64::try_from(live).unwrap_or(0))
            })
            .collect()
    }

    /// The first step at which live bytes are highest, and those bytes (`(0, 0)` if nothing is allocated).
    pub fn peak(&self) -> (u64, u64) {
        self.live_curve().into_iter().fold((0, 0), |best, (x, live)| if live > best.1 { (x, live) } else { best })
    }
}

/// What a plot is made from: panels sharing one step axis.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Timeline {
    /// Title of the plot.
    pub title: String,
    /// What a step is (`op`, `event`).
    pub step_name: String,
    /// Steps on the x axis (`0..steps`).
    pub steps: u64,
    /// One panel per device.
    pub panels: Vec<Panel>,
}

impl Timeline {
    /// A trace's timeline: one panel; step `i` is op `i`.
    pub fn from_trace(trace: &Trace) -> Self {
        let mut spans = Vec::with_capacity(trace.allocs as usize);
        let mut slot_span: Vec<usize> = vec![usize::MAX; trace.slots as usize];
        for (i, op) in trace.ops.iter().enumerate() {
            match *op {
                Op::Alloc { slot, bytes, .. } => {
                    slot_span[slot as usize] = spans.len();
                    spans.push(Span {
                        id: spans.len() as u64,
                        start: i as u64,
                        end: None,
                        bytes,
                        label: None,
                        call_site: None,
                    });
                }
                Op::Free { slot } => {
                    if let Some(span) = spans.get_mut(slot_span[slot as usize]) {
                        span.end = Some(i as u64);
                    }
                }
            }
        }
        Timeline {
            title: format!("{}: live memory by allocation", trace.name),
            step_name: "op".into(),
            steps: trace.ops.len() as u64,
            panels: vec![Panel { name: trace.name.clone(), spans, reserved: Vec::new() }],
        }
    }

    /// A snapshot's timeline from its events: one panel per device that has any; step `i` is event `i`.
    pub fn from_snapshot(snapshot: &Snapshot, name: &str) -> Result<Self> {
        if !snapshot.events.iter().any(|e| e.kind == EventKind::Alloc) {
            return Err(Error::InvalidConfig(format!(
                "{name}: the snapshot has no allocation events; record them with the profiler on \
                 (UMM_PROFILE=1, Builder::profile(true), mm.profiler().set_enabled(true), or `umm snapshot`)"
            )));
        }
        let mut panels: BTreeMap<usize, Panel> = BTreeMap::new();
        let mut open: HashMap<u64, (usize, usize)> = HashMap::new();
        let mut reserved: BTreeMap<usize, HashMap<String, u64>> = BTreeMap::new();
        for (i, e) in snapshot.events.iter().enumerate() {
            let step = i as u64;
            let panel = panels.entry(e.device).or_insert_with(|| Panel {
                name: snapshot
                    .devices
                    .iter()
                    .find(|d| d.index == e.device)
                    .map_or_else(|| format!("device {}", e.device), |d| format!("device {}: {}", d.index, d.name)),
                ..Panel::default()
            });
            match e.kind {
                EventKind::Alloc if e.bytes > 0 => {
                    open.insert(e.id, (e.device, panel.spans.len()));
                    panel.spans.push(Span {
                        id: e.id,
                        start: step,
                        end: None,
                        bytes: e.bytes,
                        label: e.label.clone(),
                        call_site: e.call_site.as_ref().map(ToString::to_string),
                    });
                }
                EventKind::Free => {
                    if let Some((device, index)) = open.remove(&e.id) {
                        if let Some(span) = panels.get_mut(&device).and_then(|p| p.spans.get_mut(index)) {
                            span.end = Some(step);
                        }
                    }
                }
                EventKind::SegmentAlloc | EventKind::SegmentFree => {
                    let pools = reserved.entry(e.device).or_default();
                    pools.insert(e.pool_name.clone().unwrap_or_default(), e.reserved_bytes.unwrap_or(0));
                    panel.reserved.push((step, pools.values().sum()));
                }
                EventKind::Alloc => {}
            }
        }
        let dropped = if snapshot.events_dropped > 0 {
            format!(" ({} earliest events dropped)", snapshot.events_dropped)
        } else {
            String::new()
        };
        Ok(Timeline {
            title: format!("{name}: live memory by allocation{dropped}"),
            step_name: "event".into(),
            steps: snapshot.events.len() as u64,
            panels: panels.into_values().filter(|p| !p.spans.is_empty()).collect(),
        })
    }

    /// Reads a snapshot (JSON) or a trace (`umm-trace v1`, plain or gzip), telling them apart by content.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let label = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: label.clone(), source })?;
        let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
        if first == Some(&b'{') {
            let text = String::from_utf8_lossy(&bytes);
            let snapshot = Snapshot::from_json(&label, &text)?;
            let name = umm::trace::name_of(path);
            let name = name.strip_suffix(".json").unwrap_or(&name);
            Self::from_snapshot(&snapshot, name)
        } else {
            let trace = Trace::from_reader(umm::trace::name_of(path), &label, bytes.as_slice())?;
            Ok(Self::from_trace(&trace))
        }
    }
}

/// The largest width and panel height [`render_svg`] draws, in pixels; larger values are drawn at this size.
/// The band drawing keeps a column per horizontal pixel, so a width of `u32::MAX` would ask for tens of
/// gigabytes.
pub const MAX_PIXELS: u32 = 32_768;

/// Size and detail of a plot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlotOptions {
    /// Width in pixels (300 to [`MAX_PIXELS`]; values outside are drawn at the nearer end).
    pub width: u32,
    /// Height of each panel in pixels (120 to [`MAX_PIXELS`]; values outside are drawn at the nearer end).
    pub panel_height: u32,
    /// Allocations drawn as their own band, largest first; the rest share the "other" band.
    pub max_shapes: usize,
}

impl Default for PlotOptions {
    fn default() -> Self {
        Self { width: 1200, panel_height: 420, max_shapes: 800 }
    }
}
