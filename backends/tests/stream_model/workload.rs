//! Random workloads of stream-ordered memory and the simulated device they run on: several streams (some held
//! back and let run an item at a time), blocks used on several streams and freed on others, captures, repeating
//! steps that get a plan, cleanups and sleeps, on worker threads whose caches hold blocks. A front door
//! ([`Door`]) turns each operation into its calls; [`run`] checks every block handed out against the
//! [`Oracle`](super::oracle::Oracle) after every operation.

use super::oracle::{Oracle, Reach, Stream, Streams, Use};
use proptest::prelude::*;
use std::ops::Range;
use std::sync::mpsc;
use umm_backends::{PoolStats, SimBackend, StreamId};

/// Streams the workloads use: 1 to 4 (0, the default stream, is left to the front doors).
pub const STREAMS: u64 = 4;
/// The stream a capture records on: no workload allocates on it.
pub const CAPTURE_STREAM: u64 = 7;
/// The stream steps are made on.
pub const STEP_STREAM: u64 = 1;
/// Worker threads operations run on (each with its own thread caches).
pub const THREADS: usize = 2;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Request sizes: small blocks (below 1 MiB) of small segments, medium ones sharing large segments, and large
/// ones of several pages (a segment or reservation range of their own, stitched when pages are scattered).
pub const SIZES: [u64; 8] = [512, 48 * KIB, 700 * KIB, 2 * MIB, 3 * MIB + 300 * KIB, 9 * MIB, 16 * MIB, 26 * MIB];

/// One operation of a workload. Indices pick among the live blocks (modulo their count).
#[derive(Debug, Clone)]
pub enum Op {
    /// Allocates `SIZES[size]` on stream `stream` on worker `thread`, and queues work on it there.
    Alloc { stream: u64, size: usize, thread: usize },
    /// Queues work using a live block on `stream` (recording the stream where the door can).
    Use { pick: usize, stream: u64 },
    /// Frees a live block on worker `thread`, ordered on stream `on` where the door takes a free's stream.
    Free { pick: usize, on: u64, thread: usize },
    /// Holds `stream`'s work back (a long kernel).
    Hold { stream: u64 },
    /// Runs `items` more items of held `stream`.
    Run { stream: u64, items: u64 },
    /// Runs all of `stream`'s work and lets it run freely.
    Finish { stream: u64 },
    /// Begins a capture, or ends the one underway.
    Capture,
    /// `steps` repeating steps on [`STEP_STREAM`] (each marked), whose second allocation goes to stream
    /// `deviate` in the last step where it is `Some`.
    Steps { steps: usize, deviate: Option<u64> },
    /// Returns pending frees whose streams passed, cleans up idle segments, or releases cached memory.
    Tidy { how: u8 },
    /// Puts the pool to sleep and wakes it (where the door sleeps).
    Sleep,
}

fn stream() -> impl Strategy<Value = u64> {
    1..=STREAMS
}

/// Operations, weighted towards allocations, uses and frees; holds and runs often enough that most frees meet
/// held work.
pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (stream(), 0..SIZES.len(), 0..THREADS).prop_map(|(stream, size, thread)| Op::Alloc { stream, size, thread }),
        5 => (any::<usize>(), stream()).prop_map(|(pick, stream)| Op::Use { pick, stream }),
        7 => (any::<usize>(), stream(), 0..THREADS).prop_map(|(pick, on, thread)| Op::Free { pick, on, thread }),
        3 => stream().prop_map(|stream| Op::Hold { stream }),
        3 => (stream(), 1..3u64).prop_map(|(stream, items)| Op::Run { stream, items }),
        1 => stream().prop_map(|stream| Op::Finish { stream }),
        1 => Just(Op::Capture),
        1 => (2..6usize, proptest::option::weighted(0.5, 2..=STREAMS)).prop_map(|(steps, deviate)| Op::Steps { steps, deviate }),
        1 => (0..3u8).prop_map(|how| Op::Tidy { how }),
        1 => Just(Op::Sleep),
    ]
}

/// A live block as the workload knows it.
pub struct Live<H> {
    pub id: u64,
    pub handle: H,
    pub stream: u64,
    pub address: u64,
    pub len: u64,
}

/// A front door under test.
pub trait Door: Send + Sync + 'static {
    type Handle: Clone + Send + 'static;
    /// The simulated device behind the door.
    fn device(&self) -> &SimBackend;
    /// Allocates; `None` where the door refuses (out of memory under a limit, asleep). The address and size
    /// handed out.
    fn allocate(&self, bytes: u64, stream: u64) -> Option<(Self::Handle, u64, u64)>;
    /// Marks `block` as used on `stream` too; false where the door cannot (the block may then be used on its own
    /// stream only).
    fn record(&self, block: &Self::Handle, stream: u64) -> bool;
    /// Frees `block`, ordered on stream `on` where the door takes a free's stream (the test records work
    /// queued there first).
    fn free(&self, block: &Self::Handle, on: u64);
    /// Whether frees take a stream.
    fn frees_on_streams(&self) -> bool {
        false
    }
    fn begin_capture(&self);
    fn end_capture(&self);
    /// Marks the end of a step.
    fn mark_step(&self);
    fn tidy(&self, how: u8);
    /// Sleeps and wakes; false where the door does not.
    fn sleep_and_wake(&self) -> bool {
        false
    }
    /// The statistics of the pool behind the door, for the reach (summed where the door has several).
    fn stats(&self) -> PoolStats;
}

/// The simulated device as the oracle asks it.
pub struct Sim<'a>(pub &'a SimBackend);

/// Physical page numbers start here, so that they never meet plain segments' addresses.
const PHYSICAL: u64 = 1 << 62;

impl Streams for Sim<'_> {
    fn completed(&self, stream: Stream) -> u64 {
        self.0.stream_progress(StreamId(stream)).1
    }
    fn ordered_after(&self, stream: Stream, other: Stream) -> u64 {
        self.0.ordered_after(StreamId(stream), StreamId(other))
    }
    fn bytes(&self, address: u64, len: u64) -> Vec<Range<u64>> {
        physical_bytes(|a| self.0.physical_page(a), self.0.page_size(), address, len)
    }
}

/// The bytes behind `[address, address + len)`: per page of a reservation its physical page's bytes, the
/// addresses themselves in a plain segment (which keeps its memory while it lives).
pub fn physical_bytes(page_of: impl Fn(u64) -> Option<u64>, page: u64, address: u64, len: u64) -> Vec<Range<u64>> {
    let mut bytes = Vec::new();
    let end = address + len;
    let mut at = address;
    while at < end {
        let next = ((at / page) + 1) * page;
        let to = next.min(end);
        match page_of(at) {
            Some(p) => {
                let base = PHYSICAL + p * page;
                bytes.push(base + at % page..base + at % page + (to - at));
            }
            None => bytes.push(at..to),
        }
        at = to;
    }
    bytes
}

type Job = Box<dyn FnOnce() + Send>;

/// Threads that run operations handed to them, one at a time, so that each keeps its own thread caches.
pub struct Workers {
    senders: Vec<mpsc::Sender<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Workers {
    pub fn new(count: usize) -> Self {
        let (mut senders, mut threads) = (Vec::new(), Vec::new());
        for _ in 0..count {
            let (tx, rx) = mpsc::channel::<Job>();
            senders.push(tx);
            threads.push(std::thread::spawn(move || rx.into_iter().for_each(|job| job())));
        }
        Self { senders, threads }
    }

    /// Runs `job` on worker `thread` and waits for its answer.
    pub fn run<T: Send + 'static>(&self, thread: usize, job: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(job());
        });
        self.senders[thread % self.senders.len()].send(job).expect("worker alive");
        rx.recv().expect("the worker answers (a panic there shows above)")
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.senders.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The step every [`Op::Steps`] repeats: sizes allocated in order, then freed in this order (indices).
const STEP_SIZES: [u64; 3] = [4 * MIB, 6 * MIB, 2 * MIB + 512 * KIB];
const STEP_FREES: [usize; 3] = [1, 0, 2];

/// A workload's state while it runs.
struct Run<'a, D: Door> {
    door: &'a std::sync::Arc<D>,
    workers: &'a Workers,
    oracle: Oracle,
    live: Vec<Live<D::Handle>>,
    next_id: u64,
    capturing: bool,
}

impl<D: Door> Run<'_, D> {
    /// Queues work using live block `i` on `stream`.
    fn launch(&mut self, i: usize, stream: u64) {
        let device = self.door.device();
        let item = device.launch(StreamId(stream));
        let (queued, completed) = device.stream_progress(StreamId(stream));
        let held = completed < queued;
        self.oracle.used(self.live[i].id, Use { stream, item }, held);
    }

    fn allocate(&mut self, bytes: u64, stream: u64, thread: usize) -> Result<Option<usize>, String> {
        let door = std::sync::Arc::clone(self.door);
        let Some((handle, address, len)) = self.workers.run(thread, move || door.allocate(bytes, stream)) else {
            return Ok(None);
        };
        let id = self.next_id;
        self.next_id += 1;
        self.oracle.note(format!("  -> block {id}: {len} bytes at {address:#x} on stream {stream}"));
        let sim = Sim(self.door.device());
        self.oracle.handed_out(&sim, id, stream, address, len)?;
        self.live.push(Live { id, handle, stream, address, len });
        let i = self.live.len() - 1;
        self.launch(i, stream);
        Ok(Some(i))
    }

    fn free(&mut self, i: usize, on: u64, thread: usize) {
        let block = self.live.swap_remove(i);
        let on = if self.door.frees_on_streams() { on } else { block.stream };
        self.oracle.note(format!("  free block {} on stream {on}", block.id));
        self.live.push(block);
        let last = self.live.len() - 1;
        if on != self.live[last].stream {
            // A free on another stream: work queued there before it may use the block.
            self.launch(last, on);
        }
        let block = self.live.pop().expect("pushed just now");
        let door = std::sync::Arc::clone(self.door);
        let handle = block.handle.clone();
        self.workers.run(thread, move || door.free(&handle, on));
        self.oracle.freed(block.id, on);
    }

    fn step(&mut self, deviate: Option<u64>) -> Result<(), String> {
        let mut made = Vec::new();
        for (k, &bytes) in STEP_SIZES.iter().enumerate() {
            let stream = if k == 1 { deviate.unwrap_or(STEP_STREAM) } else { STEP_STREAM };
            made.push(self.allocate(bytes, stream, 0)?.map(|i| self.live[i].id));
        }
        for &k in &STEP_FREES {
            if let Some(id) = made[k] {
                let i = self.live.iter().position(|l| l.id == id).expect("live");
                let on = self.live[i].stream;
                self.free(i, on, 0);
            }
        }
        self.door.mark_step();
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        self.oracle.note(format!("{op:?}"));
        match *op {
            Op::Alloc { stream, size, thread } => {
                self.allocate(SIZES[size], stream, thread)?;
            }
            Op::Use { pick, stream } if !self.live.is_empty() => {
                let i = pick % self.live.len();
                let own = self.live[i].stream;
                if stream == own || self.door.record(&self.live[i].handle, stream) {
                    self.launch(i, stream);
                } else {
                    self.launch(i, own);
                }
            }
            Op::Free { pick, on, thread } if !self.live.is_empty() => {
                let i = pick % self.live.len();
                if on != self.live[i].stream && self.door.frees_on_streams() {
                    // The C ABI records the free's stream itself.
                } else if on != self.live[i].stream && !self.door.record(&self.live[i].handle, on) {
                    self.free(i, self.live[i].stream, thread);
                    return self.check();
                }
                self.free(i, on, thread);
            }
            Op::Use { .. } | Op::Free { .. } => {}
            Op::Hold { stream } => self.door.device().hold_stream(StreamId(stream)),
            Op::Run { stream, items } => {
                let device = self.door.device();
                let (_, completed) = device.stream_progress(StreamId(stream));
                device.complete_stream(StreamId(stream), completed + items);
            }
            Op::Finish { stream } => self.door.device().finish_stream(StreamId(stream)),
            Op::Capture => {
                if self.capturing {
                    self.door.device().end_capture(StreamId(CAPTURE_STREAM));
                    self.door.end_capture();
                } else {
                    self.oracle.reach.captures += 1;
                    self.door.begin_capture();
                    self.door.device().begin_capture(StreamId(CAPTURE_STREAM));
                }
                self.capturing = !self.capturing;
            }
            Op::Steps { steps, deviate } => {
                for s in 0..steps {
                    self.step(deviate.filter(|_| s + 1 == steps))?;
                }
            }
            Op::Tidy { how } => self.door.tidy(how),
            Op::Sleep if !self.capturing => {
                self.oracle.reach.sleeps += u64::from(self.door.sleep_and_wake());
            }
            Op::Sleep => {}
        }
        self.check()
    }

    /// After every operation: every live block's bytes as they are now (a sleep and wake, a page move may have
    /// changed them) against the other live blocks and the retired bytes.
    fn check(&mut self) -> Result<(), String> {
        let blocks: Vec<(u64, u64, u64, u64)> = self.live.iter().map(|l| (l.id, l.stream, l.address, l.len)).collect();
        let sim = Sim(self.door.device());
        self.oracle.recheck(&sim, &blocks)?;
        let device = self.door.device();
        self.oracle.count_waiting(&Sim(device));
        Ok(())
    }
}

/// Runs `ops` through `door`, checking every block against the oracle. Err with the first violation; the reach
/// of the run otherwise. Ends by letting every stream run, freeing what lives, and checking that nothing the
/// driver refuses during a capture was called.
pub fn run<D: Door>(door: D, ops: &[Op]) -> Result<Reach, String> {
    let door = std::sync::Arc::new(door);
    let workers = Workers::new(THREADS);
    let mut run = Run {
        door: &door,
        workers: &workers,
        oracle: Oracle::default(),
        live: Vec::new(),
        next_id: 0,
        capturing: false,
    };
    for op in ops {
        run.apply(op)?;
    }
    if run.capturing {
        run.apply(&Op::Capture)?;
    }
    for stream in 1..=STREAMS {
        door.device().finish_stream(StreamId(stream));
    }
    while let Some(block) = run.live.pop() {
        door.free(&block.handle, block.stream);
        run.oracle.freed(block.id, block.stream);
    }
    let stats = door.stats();
    let reach = &mut run.oracle.reach;
    reach.moves_between_streams = stats.num_segments_shared + stats.num_pages_shared;
    reach.planned_allocs = stats.num_planned_allocs;
    reach.stitched_allocs = stats.num_stitched_allocs;
    reach.retries = stats.num_alloc_retries + stats.num_ooms;
    let log = door.device().stream_log();
    if log.capture_violations != 0 {
        return Err(run.oracle_violation(format!("{} calls a driver refuses during a capture", log.capture_violations)));
    }
    Ok(run.oracle.reach)
}

impl<D: Door> Run<'_, D> {
    fn oracle_violation(&self, what: String) -> String {
        let tail = self.oracle.history.len().saturating_sub(40);
        format!("{what}\nlast operations:\n  {}", self.oracle.history[tail..].join("\n  "))
    }
}
