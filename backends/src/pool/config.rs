//! Pool configuration: limit, strategy, segment policy, debugging aids.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
#[cfg(doc)]
use umm_placement::units::parse_size;

/// The largest [`PoolConfig::alignment`]: far below the smallest segment, so that alignment never decides how
/// many blocks a segment holds.
pub const MAX_ALIGNMENT: u64 = 64 << 10;

/// A cap on the bytes a pool reserves from its device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Limit {
    /// At most this many bytes.
    Bytes(u64),
    /// At most this fraction (in `(0, 1]`) of the device's capacity.
    Fraction(f64),
}

impl Limit {
    /// The two forms [`Limit::parse`] accepts, in words, for error messages.
    pub const ACCEPTED: &'static str =
        "a size with a unit (2GiB, 1500MB, 1048576B) or a percentage of the device's capacity (90%)";

    /// Parses a limit as users write it: a size with a unit (`2GiB`, `1.5GB`, `1048576B`, as [`parse_size`]
    /// reads it) for [`Limit::Bytes`], or a percentage in `(0, 100]` (`90%`, `12.5%`) for [`Limit::Fraction`].
    ///
    /// A bare number is refused: `1` could mean one byte or the whole device (a fraction of 1), and a limit
    /// read the wrong way either starves every allocation or removes the cap, with nothing to say so. The
    /// error names both forms, with the number rewritten in each where that makes sense (`1B`, `100%`).
    /// Zero bytes is refused too: it allows nothing.
    pub fn parse(text: &str) -> Result<Limit, String> {
        let t = text.trim();
        if t.is_empty() {
            return Err(format!("no limit given: expected {}", Self::ACCEPTED));
        }
        if let Some(number) = t.strip_suffix('%') {
            let percent = number.trim().parse::<f64>().ok().filter(|p| p.is_finite());
            return match percent {
                Some(p) if p > 0.0 && p <= 100.0 => Ok(Limit::Fraction(p / 100.0)),
                Some(_) => Err(format!("`{t}` is outside (0%, 100%]: expected {}", Self::ACCEPTED)),
                None => Err(format!("`{t}` is not a percentage: expected {}", Self::ACCEPTED)),
            };
        }
        if t.chars().all(|c| c.is_ascii_digit() || c == '.') {
            let mut readings = Vec::new();
            if t.chars().all(|c| c.is_ascii_digit()) {
                match t.trim_start_matches('0') {
                    "" => {}
                    "1" => readings.push("1B for one byte".to_string()),
                    _ => readings.push(format!("{t}B for {t} bytes")),
                }
            }
            if let Some(f) = t.parse::<f64>().ok().filter(|f| *f > 0.0 && *f <= 1.0) {
                readings.push(if f == 1.0 {
                    "100% for the whole device".to_string()
                } else {
                    format!("{} for that share of the device", percent_text(f))
                });
            }
            let write = if readings.is_empty() { String::new() } else { format!("write {}; ", readings.join(" or ")) };
            return Err(format!(
                "`{t}` has no unit, so it could be read as bytes or as a fraction of the device: {write}a limit is {}",
                Self::ACCEPTED
            ));
        }
        let bytes = umm_placement::units::read_size(t).map_err(|problem| {
            if problem.starts_with("unknown unit") {
                format!("`{t}` is neither a size with a unit nor a percentage: expected {}", Self::ACCEPTED)
            } else {
                format!("{problem}: expected {}", Self::ACCEPTED)
            }
        })?;
        match bytes {
            0 => Err(format!("`{t}` is a limit of zero bytes, which allows nothing: expected {}", Self::ACCEPTED)),
            bytes => Ok(Limit::Bytes(bytes)),
        }
    }

    /// The limit in bytes for a device of `capacity` bytes.
    pub fn resolve(self, capacity: u64) -> Result<u64> {
        match self {
            Limit::Bytes(0) => Err(Error::InvalidConfig("a byte limit must be above zero".into())),
            Limit::Bytes(b) => Ok(b),
            Limit::Fraction(f) if f > 0.0 && f <= 1.0 => Ok((capacity as f64 * f) as u64),
            Limit::Fraction(f) => Err(Error::InvalidConfig(format!("a limit fraction must be in (0, 1], got {f}"))),
        }
    }
}

impl std::str::FromStr for Limit {
    type Err = String;

    /// [`Limit::parse`].
    fn from_str(text: &str) -> Result<Self, String> {
        Limit::parse(text)
    }
}

impl std::fmt::Display for Limit {
    /// The form [`Limit::parse`] reads back: `1048576B` or `90%`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Bytes(b) => write!(f, "{b}B"),
            Limit::Fraction(x) => f.write_str(&percent_text(*x)),
        }
    }
}

/// `fraction` as a percentage with at most six decimals and no trailing zeros (`0.9` → `90%`).
fn percent_text(fraction: f64) -> String {
    let text = format!("{:.6}", fraction * 100.0);
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}%")
}

/// How a pool gets memory for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, strum::Display, strum::EnumString)]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Cache freed blocks in segments and reuse them (the normal mode).
    #[default]
    Pooled,
    /// Every block is its own segment, destroyed on free: no caching at all (for debugging reuse bugs).
    Direct,
}

/// Whether large blocks go into plain segments or into virtual reservations mapped page by page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, strum::Display, strum::EnumString)]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
#[serde(rename_all = "lowercase")]
pub enum SegmentMode {
    /// Virtual where the backend supports it, plain otherwise.
    #[default]
    Auto,
    /// Plain segments only.
    Plain,
    /// Virtual reservations (an error at pool creation if the backend has none).
    Virtual,
}

/// When memory freed on one stream may serve an allocation on another. A pool keeps each stream's free blocks
/// apart, so that a block is never reused while work queued before its free may still touch it; without
/// sharing, a program with N streams (an inference server with a stream per worker) holds up to N peaks. With
/// it, a stream that would otherwise take new memory from the device first takes memory that other streams
/// hold free: an empty segment (moved to its arena as it is) or free pages of a virtual reservation (unmapped
/// there and mapped in its own). What makes that safe is a mark ([`crate::StreamMark`], a CUDA event) recorded
/// on the giving stream after the memory was freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, strum::Display, strum::EnumString)]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
#[serde(rename_all = "lowercase")]
pub enum CrossStream {
    /// Each stream's free memory serves that stream only (until cleanup, the limit or out of memory).
    Off,
    /// Memory freed on another stream serves once a mark recorded after its free has passed: the taking stream
    /// never waits for the giving one. A stream whose mark has not passed is marked again (one event record)
    /// for a later miss; its memory is not used now.
    #[default]
    Completed,
    /// Memory freed on another stream serves at once: the taking stream is made to wait on the device for a
    /// mark on the giving stream (`cuStreamWaitEvent`, what `cudaMallocAsync` calls internal dependencies). The
    /// host never blocks for empty segments, but the taking stream's later work queues behind the giving
    /// stream's work so far. Free pages of reservations are unmapped only after the giving stream's work
    /// has run, so there the host waits for it.
    Wait,
}

/// Configuration of one pool. `Default` follows PyTorch's segment policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolConfig {
    /// Cap on reserved bytes; `None` for the device's own limit.
    pub limit: Option<Limit>,
    /// Pooled or direct.
    pub strategy: Strategy,
    /// Plain or virtual segments for large blocks.
    pub segment_mode: SegmentMode,
    /// Requests up to this size are small: they share small segments, apart from large blocks.
    pub small_request_max: u64,
    /// Size of small segments.
    pub small_segment_size: u64,
    /// Size of the shared segments for medium requests (below half of it); larger requests get their own segment.
    pub large_segment_size: u64,
    /// Opt-in trimming on the allocation path, for virtual reservations: before mapping new pages that would raise
    /// reserved memory above both its highest figure so far and `(1 + slack) × allocated`, unmap free pages
    /// elsewhere first. The peak of reserved memory then follows the peak of live memory even when shapes vary,
    /// but such a workload keeps moving pages (an unmap and a map, tens of microseconds each on a GPU) on its
    /// allocation path in every later pass (`bert_infer_varlen` with 0.03: 160 page moves a pass). `None` (the
    /// default) unmaps only where something demands it: the limit, the device running out of memory, and cleanup
    /// rounds ([`crate::Pool::cleanup`]); a workload that repeats then makes no device call once it has run once.
    pub mapped_slack: Option<f64>,
    /// For plain segments (every backend without virtual memory, and small blocks everywhere): before creating a
    /// segment that would raise reserved memory above both its highest figure so far and
    /// `(1 + slack) × allocated`, destroy empty segments first, least recently used first. A segment sized for
    /// one request is otherwise kept for ever, and a workload whose shapes vary piles them up (reserved over live
    /// 1.97 on `bert_infer_varlen`, 1.54 on `variable`; with 0.1: 1.36 and 1.19). Unlike page moves, this settles:
    /// on the shared traces a few segments are replaced in the first passes, then none. `None` keeps every
    /// segment until cleanup, the limit or out of memory.
    #[serde(default = "default_segment_slack")]
    pub segment_slack: Option<f64>,
    /// When a stream's free memory may serve another stream (see [`CrossStream`]).
    #[serde(default)]
    pub cross_stream: CrossStream,
    /// Serve repeating steps from a plan: once [`crate::MemoryPool::mark_step`] has seen two steps in a row make
    /// the same allocations and frees, the next steps' allocations that live within a step are placed at offsets
    /// planned for them in one segment (see [`crate::pool`]'s steps). Off, `mark_step` only counts steps.
    #[serde(default = "default_plan_steps")]
    pub plan_steps: bool,
    /// Serve a request of several pages that no free range of its stream's reservations holds, and that would
    /// otherwise raise reserved memory above its highest figure so far, from free pages scattered over those
    /// reservations: they are mapped a second time, side by side, in an address range of their own (a
    /// *stitched block*, as GMLake, ASPLOS'24, calls it) and held where they lie while the block lives. The
    /// stitched range is kept when the block is freed and serves later requests it holds without a device call
    /// while its pages are free, so a workload that repeats settles. Only backends that can map a page twice
    /// ([`crate::Backend::can_alias_pages`]: CUDA, the simulated device). Off, such a request maps new pages.
    #[serde(default = "default_stitch")]
    pub stitch: bool,
    /// Page size of virtual reservations: each page is one physical allocation, mapped and unmapped whole.
    /// A power of two of at least the backend's own page (2 MiB on CUDA); `None` for
    /// [`crate::pool::DEFAULT_PAGE_UNLIMITED`] (8 MiB) in a pool without a limit and the backend's own page in
    /// one with a limit. Larger pages
    /// mean fewer driver calls per mapped byte (on an H100 an 8 MiB page costs about what a 2 MiB one does to
    /// create, map and unmap), but maps and trims move whole pages, so reserved memory sits further above the
    /// live set. Ignored by pools that use no virtual reservations.
    pub page_size: Option<u64>,
    /// Blocks start at multiples of this many bytes (and their sizes are rounded to it): a power of two; the
    /// backend's own alignment (256 bytes on CUDA) when `None` or smaller. 512 places blocks as PyTorch's caching
    /// allocator does, for comparisons in which a library's choice of kernel could depend on an address's
    /// alignment. At most 64 KiB.
    #[serde(default)]
    pub alignment: Option<u64>,
    /// Zero every block before it is handed out.
    pub zero_on_alloc: bool,
    /// Overwrite every freed block with [`crate::pool::POISON_BYTE`] so that a use after free or a read of
    /// uninitialised memory shows up (NaN in floats).
    pub poison_on_free: bool,
    /// Most bytes of free small blocks (up to `small_request_max`) one thread's cache keeps per stream: they are
    /// allocated and freed without the pool's lock. Past it, half goes back to the pool. 0 turns the caching of
    /// small blocks off.
    #[serde(default = "default_thread_cache_bytes")]
    pub thread_cache_bytes: u64,
    /// Most bytes of free large blocks one thread's cache keeps per stream, once the thread has found the pool's
    /// lock taken (a thread working alone keeps none: they would be memory no other request can be cut from);
    /// blocks of up to a sixteenth of it are kept. 0 turns the caching of large blocks off.
    #[serde(default = "default_thread_cache_large_bytes")]
    pub thread_cache_large_bytes: u64,
    /// A group whose reserved bytes this pool's count in ([`crate::ReservedGroup`]): the true peak of several
    /// pools' sum. Not part of a configuration's text: set by the owner of the pools.
    #[serde(skip)]
    pub reserved_group: Option<std::sync::Arc<crate::ReservedGroup>>,
    /// The tag of a pool made to sleep and wake as a whole ([`crate::Pool::sleep`]): its blocks, small ones
    /// too, live in virtual reservations where the backend has them, and it makes no stitched blocks (pages
    /// mapped twice) and plans no steps. Shown in its errors. Not part of a configuration's text: set by the
    /// owner of the pools for requests with [`PoolConfig::tagged`].
    #[serde(skip)]
    pub tag: Option<String>,
}

fn default_segment_slack() -> Option<f64> {
    PoolConfig::default().segment_slack
}

fn default_plan_steps() -> bool {
    PoolConfig::default().plan_steps
}

fn default_stitch() -> bool {
    PoolConfig::default().stitch
}

fn default_thread_cache_bytes() -> u64 {
    PoolConfig::default().thread_cache_bytes
}

fn default_thread_cache_large_bytes() -> u64 {
    PoolConfig::default().thread_cache_large_bytes
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            limit: None,
            strategy: Strategy::Pooled,
            segment_mode: SegmentMode::Auto,
            small_request_max: 1 << 20,
            small_segment_size: 2 << 20,
            large_segment_size: 20 << 20,
            mapped_slack: None,
            segment_slack: Some(0.1),
            cross_stream: CrossStream::default(),
            plan_steps: true,
            stitch: true,
            page_size: None,
            alignment: None,
            zero_on_alloc: false,
            poison_on_free: false,
            thread_cache_bytes: 32 << 20,
            thread_cache_large_bytes: 1 << 30,
            reserved_group: None,
            tag: None,
        }
    }
}

impl PoolConfig {
    /// Parses a `mapped_slack` or `segment_slack` setting as users write it (`UMM_MAPPED_SLACK`,
    /// `UMM_SEGMENT_SLACK`): a fraction >= 0 (`0.1`), or
    /// `off`/`none` for no early trimming. `None` when the text is neither.
    pub fn parse_slack(text: &str) -> Option<Option<f64>> {
        match text.trim().to_ascii_lowercase().as_str() {
            "off" | "none" => Some(None),
            other => other.parse::<f64>().ok().filter(|f| *f >= 0.0 && f.is_finite()).map(Some),
        }
    }

    /// This configuration for the pool of tag `tag` (see [`PoolConfig::tag`]).
    pub fn tagged(&self, tag: &str) -> Self {
        Self { tag: Some(tag.to_string()), stitch: false, plan_steps: false, ..self.clone() }
    }

    /// Checks the values against each other.
    pub fn validate(&self) -> Result<()> {
        if self.small_request_max == 0 || self.small_segment_size == 0 || self.large_segment_size == 0 {
            return Err(Error::InvalidConfig("segment sizes and small_request_max must be above zero".into()));
        }
        if self.large_segment_size < 2 * self.small_request_max {
            return Err(Error::InvalidConfig(format!(
                "large_segment_size ({}) must be at least twice small_request_max ({}): large segments are shared \
                 by the requests above small_request_max that fit in half of one",
                self.large_segment_size, self.small_request_max
            )));
        }
        if self.small_segment_size < self.small_request_max {
            return Err(Error::InvalidConfig(format!(
                "small_segment_size ({}) must be at least small_request_max ({})",
                self.small_segment_size, self.small_request_max
            )));
        }
        for (name, slack) in [("mapped_slack", self.mapped_slack), ("segment_slack", self.segment_slack)] {
            if let Some(slack) = slack {
                if !(slack >= 0.0 && slack.is_finite()) {
                    return Err(Error::InvalidConfig(format!("{name} must be a finite fraction >= 0, got {slack}")));
                }
            }
        }
        if let Some(page) = self.page_size {
            if !page.is_power_of_two() {
                return Err(Error::InvalidConfig(format!("page_size must be a power of two, got {page}")));
            }
        }
        if let Some(align) = self.alignment {
            if !align.is_power_of_two() || align > MAX_ALIGNMENT {
                return Err(Error::InvalidConfig(format!(
                    "alignment must be a power of two of at most {MAX_ALIGNMENT} bytes, got {align}"
                )));
            }
        }
        if let Some(limit) = self.limit {
            limit.resolve(u64::MAX)?;
        }
        Ok(())
    }
}
