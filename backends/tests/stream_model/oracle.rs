//! The oracle of stream-ordered reuse: a model of which bytes of device memory the work queued on streams may
//! still touch, checked against every block a front door hands out.
//!
//! Each block a test is handed is recorded with the bytes behind it (physical bytes, as the simulated device's
//! page tables tell them, so that a page unmapped in one place and mapped in another is seen as the same memory)
//! and every use the test queues on a stream (the stream and the number of the item of work, as the simulated
//! device counts them). When the block is freed its bytes and uses are retired: those bytes may be handed out
//! again on stream `T` once every use `(S, item)` is safe for `T` — `S` is `T` (stream order), or `S`'s work has
//! run through `item`, or `T` was made to wait on the device for `S` through `item`. That is the earliest moment
//! the model allows; a block handed out over a retired byte before it, or over a byte of another live block, is
//! a violation, reported with the operations that led to it.

use std::collections::HashMap;
use std::ops::Range;

/// A stream, as the simulated device numbers them.
pub type Stream = u64;

/// What the oracle asks of the device under test.
pub trait Streams {
    /// Items of work run so far on `stream`.
    fn completed(&self, stream: Stream) -> u64;
    /// The last item of `other` that work queued on `stream` from now on is ordered after on the device.
    fn ordered_after(&self, stream: Stream, other: Stream) -> u64;
    /// The bytes behind `[address, address + len)`, as ranges of one numbering of the device's memory in which
    /// two ranges that meet are the same bytes.
    fn bytes(&self, address: u64, len: u64) -> Vec<Range<u64>>;
}

/// One use of a block: item `item` of `stream`'s work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Use {
    pub stream: Stream,
    pub item: u64,
}

#[derive(Debug)]
struct Block {
    stream: Stream,
    bytes: Vec<Range<u64>>,
    uses: Vec<Use>,
}

/// Bytes freed whose last owner's work may still run.
#[derive(Debug)]
struct Retired {
    bytes: Vec<Range<u64>>,
    uses: Vec<Use>,
}

/// How far a workload reached: what the oracle saw happen, summed over runs by [`Reach::add`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reach {
    /// Blocks handed out.
    pub handed_out: u64,
    /// Blocks handed out over bytes last used on another stream.
    pub cross_stream_reuses: u64,
    /// Blocks handed out over bytes whose last use was held back at some point (work that ran late).
    pub reuses_after_held_work: u64,
    /// Blocks freed with uses on three streams or more.
    pub multi_stream_frees: u64,
    /// Frees made on a stream other than the block's own.
    pub frees_on_other_streams: u64,
    /// Captures begun.
    pub captures: u64,
    /// Retired blocks found still waiting for work after an operation, summed over operations (how much the
    /// oracle had to hold back).
    pub held_back_bytes: u64,
    /// Moves of free memory between streams (segments and pages shared, from the pool's statistics).
    pub moves_between_streams: u64,
    /// Allocations placed by a step plan.
    pub planned_allocs: u64,
    /// Allocations served by stitched blocks.
    pub stitched_allocs: u64,
    /// Allocations that met the limit and waited or released memory (retries and out-of-memory errors).
    pub retries: u64,
    /// Sleeps and wakes.
    pub sleeps: u64,
}

impl Reach {
    pub fn add(&mut self, other: &Reach) {
        self.handed_out += other.handed_out;
        self.cross_stream_reuses += other.cross_stream_reuses;
        self.reuses_after_held_work += other.reuses_after_held_work;
        self.multi_stream_frees += other.multi_stream_frees;
        self.frees_on_other_streams += other.frees_on_other_streams;
        self.captures += other.captures;
        self.held_back_bytes += other.held_back_bytes;
        self.moves_between_streams += other.moves_between_streams;
        self.planned_allocs += other.planned_allocs;
        self.stitched_allocs += other.stitched_allocs;
        self.retries += other.retries;
        self.sleeps += other.sleeps;
    }
}

/// The model. Blocks are named by the test (any id unique among live blocks).
#[derive(Debug, Default)]
pub struct Oracle {
    live: HashMap<u64, Block>,
    retired: Vec<Retired>,
    /// Uses queued while their stream was held: reuse over them is counted in [`Reach::reuses_after_held_work`].
    late: Vec<Use>,
    pub reach: Reach,
    /// The operations so far, for a violation's message.
    pub history: Vec<String>,
}

fn meet(a: &[Range<u64>], b: &[Range<u64>]) -> bool {
    a.iter().any(|x| b.iter().any(|y| x.start < y.end && y.start < x.end))
}

impl Oracle {
    /// Notes an operation for the history shown with a violation.
    pub fn note(&mut self, op: impl Into<String>) {
        self.history.push(op.into());
    }

    /// Whether use `u` no longer stands in the way of work queued on `stream` now.
    fn safe_for(device: &impl Streams, u: Use, stream: Stream) -> bool {
        u.stream == stream || device.completed(u.stream) >= u.item || device.ordered_after(stream, u.stream) >= u.item
    }

    /// Block `id` was handed out on `stream` at `[address, address + len)`: checks it against every live block
    /// and every retired byte. Err with the violation.
    pub fn handed_out(
        &mut self,
        device: &impl Streams,
        id: u64,
        stream: Stream,
        address: u64,
        len: u64,
    ) -> Result<(), String> {
        let bytes = device.bytes(address, len);
        self.reach.handed_out += 1;
        if let Some((other, _)) = self.live.iter().find(|(_, b)| meet(&b.bytes, &bytes)) {
            return Err(self.violation(format!(
                "block {id} ({len} bytes at {address:#x} on stream {stream}) shares bytes with live block {other}"
            )));
        }
        let (mut across, mut late) = (false, false);
        for retired in self.retired.iter().filter(|r| meet(&r.bytes, &bytes)) {
            if let Some(u) = retired.uses.iter().find(|&&u| !Self::safe_for(device, u, stream)) {
                let message = format!(
                    "block {id} ({len} bytes at {address:#x}) handed out on stream {stream} over bytes whose use \
                     on stream {} (item {}) has not run (it has run {}) and that stream {stream} does not wait for",
                    u.stream,
                    u.item,
                    device.completed(u.stream)
                );
                return Err(self.violation(message));
            }
            across |= retired.uses.iter().any(|u| u.stream != stream);
            late |= retired.uses.iter().any(|u| self.late.contains(u));
        }
        // Retired bytes met again whose work has all run are the new block's now (their reuse was counted);
        // those still waiting for work (safe for this stream only) stay for the bytes the block did not take.
        self.retired.retain(|r| !meet(&r.bytes, &bytes) || r.uses.iter().any(|&u| device.completed(u.stream) < u.item));
        self.reach.cross_stream_reuses += u64::from(across);
        self.reach.reuses_after_held_work += u64::from(late);
        self.live.insert(id, Block { stream, bytes, uses: Vec::new() });
        Ok(())
    }

    /// Work queued on `stream` as item `item` uses block `id`; `held` when the stream's work is held back.
    pub fn used(&mut self, id: u64, u: Use, held: bool) {
        self.live.get_mut(&id).expect("a live block").uses.push(u);
        if held {
            self.late.push(u);
        }
    }

    /// The stream block `id` was handed out on.
    pub fn stream_of(&self, id: u64) -> Stream {
        self.live[&id].stream
    }

    /// The streams block `id` was used on.
    pub fn streams_of(&self, id: u64) -> Vec<Stream> {
        let mut streams: Vec<Stream> = self.live[&id].uses.iter().map(|u| u.stream).collect();
        streams.sort_unstable();
        streams.dedup();
        streams
    }

    /// Block `id` was freed (on `stream`): its bytes are retired with its uses.
    pub fn freed(&mut self, id: u64, stream: Stream) {
        let block = self.live.remove(&id).expect("a live block");
        self.reach.frees_on_other_streams += u64::from(stream != block.stream);
        let mut streams: Vec<Stream> = block.uses.iter().map(|u| u.stream).collect();
        streams.sort_unstable();
        streams.dedup();
        self.reach.multi_stream_frees += u64::from(streams.len() >= 3);
        if block.uses.is_empty() {
            return;
        }
        self.retired.push(Retired { bytes: block.bytes, uses: block.uses });
    }

    /// After an operation: the bytes of each live block `(id, stream, address, len)` as they are now. Blocks
    /// whose bytes changed (pages mapped anew by a wake) are checked again, once every live block's bytes are
    /// up to date, against the others and the retired bytes, as if handed out now.
    pub fn recheck(&mut self, device: &impl Streams, blocks: &[(u64, Stream, u64, u64)]) -> Result<(), String> {
        let mut changed = Vec::new();
        for &(id, stream, address, len) in blocks {
            let bytes = device.bytes(address, len);
            let block = self.live.get_mut(&id).expect("a live block");
            if block.bytes != bytes {
                block.bytes = bytes;
                changed.push((id, stream, address, len));
            }
        }
        for (id, stream, address, len) in changed {
            let block = self.live.remove(&id).expect("a live block");
            self.reach.handed_out -= 1;
            self.handed_out(device, id, stream, address, len)?;
            self.live.get_mut(&id).expect("just checked").uses = block.uses;
        }
        Ok(())
    }

    /// Counts the retired bytes still waiting for work (the model's "not yet"), for the reach.
    pub fn count_waiting(&mut self, device: &impl Streams) {
        let waiting = self.retired.iter().filter(|r| r.uses.iter().any(|&u| device.completed(u.stream) < u.item));
        self.reach.held_back_bytes += waiting.count() as u64;
    }

    /// Live blocks.
    pub fn live(&self) -> impl Iterator<Item = u64> + '_ {
        self.live.keys().copied()
    }

    fn violation(&self, what: String) -> String {
        let tail = self.history.len().saturating_sub(40);
        format!("{what}\nlast operations:\n  {}", self.history[tail..].join("\n  "))
    }
}
