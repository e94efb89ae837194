//! What the profiler records and reports: call sites, events, live allocations and the leak report built from
//! them.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::panic::Location;
use umm_placement::{Api, PoolKind};

/// A source location: where an allocation was asked for (through `#[track_caller]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CallSite {
    /// Source file, as the compiler names it.
    pub file: String,
    /// 1-based line.
    pub line: u32,
    /// 1-based column.
    pub column: u32,
}

impl From<&Location<'_>> for CallSite {
    fn from(l: &Location<'_>) -> Self {
        Self { file: l.file().to_string(), line: l.line(), column: l.column() }
    }
}

impl fmt::Display for CallSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

/// What an [`Event`] records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, strum::Display)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum EventKind {
    /// A buffer was allocated.
    Alloc,
    /// A buffer was dropped.
    Free,
    /// A pool took memory from its device (new segments or mapped pages); `bytes` is the growth.
    SegmentAlloc,
    /// A pool gave memory back to its device; `bytes` is the shrink.
    SegmentFree,
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// What happened.
    pub kind: EventKind,
    /// Nanoseconds since the profiler was created.
    pub time_ns: u64,
    /// The allocation (unique for the profiler's life; an alloc and its free share it); 0 for segment events.
    pub id: u64,
    /// Device index.
    pub device: usize,
    /// Kind of pool.
    pub pool: PoolKind,
    /// The API asked for, when the allocation named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<Api>,
    /// Bytes asked for (alloc, free) or by which the pool's reserved memory changed (segment events).
    pub bytes: u64,
    /// Stream number.
    pub stream: u64,
    /// The allocation's label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Where the allocation was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_site: Option<CallSite>,
    /// Segment events: the pool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_name: Option<String>,
    /// Segment events: the pool's reserved bytes after the change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
}

/// A buffer that is alive now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveAllocation {
    /// The allocation id (as in [`Event::id`]).
    pub id: u64,
    /// Device index.
    pub device: usize,
    /// Kind of pool.
    pub pool: PoolKind,
    /// The API asked for, when the allocation named one.
    pub api: Option<Api>,
    /// Bytes asked for.
    pub bytes: u64,
    /// Stream number.
    pub stream: u64,
    /// Label.
    pub label: Option<String>,
    /// Where it was allocated.
    pub call_site: CallSite,
}

/// Live allocations that share a call site and label, for a short report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeakGroup {
    /// Where they were allocated.
    pub call_site: CallSite,
    /// Their label.
    pub label: Option<String>,
    /// How many are alive.
    pub count: usize,
    /// Their bytes in total.
    pub bytes: u64,
    /// The smallest of them, in bytes.
    pub min_bytes: u64,
    /// The largest of them, in bytes.
    pub max_bytes: u64,
}

impl fmt::Display for LeakGroup {
    /// `5 × 512 B (2.50 KiB in all) "label" at src/main.rs:10:5`: the count, then the size of each buffer (or
    /// the range, `256 B to 1.00 KiB`, when they differ), then the total where there is more than one, so that
    /// a size is never read as per buffer when it is the sum.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use umm_placement::units::human_bytes;
        write!(f, "{} × ", self.count)?;
        if self.min_bytes == self.max_bytes {
            f.write_str(&human_bytes(self.min_bytes))?;
        } else {
            write!(f, "{} to {}", human_bytes(self.min_bytes), human_bytes(self.max_bytes))?;
        }
        if self.count > 1 {
            write!(f, " ({} in all)", human_bytes(self.bytes))?;
        }
        if let Some(label) = &self.label {
            write!(f, " {label:?}")?;
        }
        write!(f, " at {}", self.call_site)
    }
}

/// Every buffer alive now, with its label and call site (PyTorch users: the live blocks of
/// `torch.cuda.memory_snapshot()`, with the allocating line).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeakReport {
    /// Live allocations, oldest first.
    pub allocations: Vec<LiveAllocation>,
    /// Their bytes in total.
    pub total_bytes: u64,
}

impl LeakReport {
    /// Whether nothing is alive.
    pub fn is_empty(&self) -> bool {
        self.allocations.is_empty()
    }

    /// Number of live allocations.
    pub fn len(&self) -> usize {
        self.allocations.len()
    }

    /// Live allocations grouped by call site and label, most bytes first. O(n log n).
    pub fn by_call_site(&self) -> Vec<LeakGroup> {
        let mut groups: HashMap<(&CallSite, &Option<String>), LeakGroup> = HashMap::new();
        for a in &self.allocations {
            let group = groups.entry((&a.call_site, &a.label)).or_insert_with(|| LeakGroup {
                call_site: a.call_site.clone(),
                label: a.label.clone(),
                count: 0,
                bytes: 0,
                min_bytes: u64::MAX,
                max_bytes: 0,
            });
            group.count += 1;
            group.bytes += a.bytes;
            group.min_bytes = group.min_bytes.min(a.bytes);
            group.max_bytes = group.max_bytes.max(a.bytes);
        }
        let mut out: Vec<LeakGroup> = groups.into_values().collect();
        out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.call_site.cmp(&b.call_site)));
        out
    }
}

/// Groups shown by the `Display` of a [`LeakReport`] (one line each, as [`LeakGroup`] displays); the rest are
/// summed in one line.
const SHOWN_GROUPS: usize = 20;

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} live buffer(s), {} ({} bytes):",
            self.len(),
            umm_placement::units::human_bytes(self.total_bytes),
            self.total_bytes
        )?;
        let groups = self.by_call_site();
        for g in groups.iter().take(SHOWN_GROUPS) {
            writeln!(f, "  {g}")?;
        }
        if groups.len() > SHOWN_GROUPS {
            let rest = &groups[SHOWN_GROUPS..];
            let count: usize = rest.iter().map(|g| g.count).sum();
            let bytes: u64 = rest.iter().map(|g| g.bytes).sum();
            writeln!(
                f,
                "  and {count} more buffer(s) from {} other call sites ({} in all)",
                rest.len(),
                umm_placement::units::human_bytes(bytes)
            )?;
        }
        Ok(())
    }
}
