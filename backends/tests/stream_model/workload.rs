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
    /// Captures a graph into a private pool (where the door has them): `SIZES[sizes[k]]` allocated on
    /// [`CAPTURE_STREAM`], the first `freed` of them freed during the capture; then replays it on `replay`.
    Graph { sizes: Vec<usize>, freed: usize, replay: u64 },
    /// Replays a graph on `stream`.
    Replay { pick: usize, stream: u64 },
    /// Destroys a graph: its private pool is let go.
    DestroyGraph { pick: usize },
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
        1 => (proptest::collection::vec(0..SIZES.len(), 1..4), 0..3usize, stream())
            .prop_map(|(sizes, freed, replay)| Op::Graph { sizes, freed, replay }),
        1 => (any::<usize>(), stream()).prop_map(|(pick, stream)| Op::Replay { pick, stream }),
        1 => any::<usize>().prop_map(|pick| Op::DestroyGraph { pick }),
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

/// The simulated device behind a door, as a workload drives its streams: directly ([`SimBackend`]) or
/// through the C ABI.
pub trait Device: Streams {
    /// Queues an item of work on `stream`: its number.
    fn launch(&self, stream: Stream) -> u64;
    fn hold(&self, stream: Stream);
    /// Runs `stream`'s work up to item `item`.
    fn run(&self, stream: Stream, item: u64);
    fn finish(&self, stream: Stream);
    /// `stream` captures (or no longer), as the driver knows it.
    fn capture(&self, stream: Stream, capturing: bool);
    /// Calls a driver refuses during a capture, so far.
    fn capture_violations(&self) -> u64;
}

/// What a pool counted, for the reach.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    /// Segments and pages moved between streams.
    pub moves: u64,
    pub planned_allocs: u64,
    pub stitched_allocs: u64,
    /// Retries after releasing memory, and out-of-memory errors.
    pub retries: u64,
}

impl From<PoolStats> for Counters {
    fn from(stats: PoolStats) -> Self {
        Self {
            moves: stats.num_segments_shared + stats.num_pages_shared + stats.num_blocks_shared,
            planned_allocs: stats.num_planned_allocs,
            stitched_allocs: stats.num_stitched_allocs,
            retries: stats.num_alloc_retries + stats.num_ooms,
        }
    }
}

/// A front door under test.
pub trait Door: Send + Sync + 'static {
    type Handle: Clone + Send + 'static;
    type Device: Device;
    /// The simulated device behind the door.
    fn device(&self) -> &Self::Device;
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
    /// Begins a capture into a private pool of its own (a CUDA graph's): the pool's number, or `None` where the
    /// door has no private pools.
    fn begin_graph(&self) -> Option<u64> {
        None
    }
    /// Allocates from private pool `pool` on `stream`.
    fn allocate_in_graph(&self, _pool: u64, _bytes: u64, _stream: u64) -> Option<(Self::Handle, u64, u64)> {
        None
    }
    /// Ends the capture begun by [`Door::begin_graph`].
    fn end_graph(&self) {}
    /// The graph of private pool `pool` is destroyed: the pool is let go.
    fn release_graph(&self, _pool: u64) {}
    /// Marks the end of a step.
    fn mark_step(&self);
    fn tidy(&self, how: u8);
    /// Sleeps and wakes; false where the door does not.
    fn sleep_and_wake(&self) -> bool {
        false
    }
    /// What the pools behind the door counted.
    fn counters(&self) -> Counters;
}

/// Physical page numbers start here, so that they never meet plain segments' addresses.
const PHYSICAL: u64 = 1 << 62;

impl Streams for SimBackend {
    fn completed(&self, stream: Stream) -> u64 {
        self.stream_progress(StreamId(stream)).1
    }
    fn ordered_after(&self, stream: Stream, other: Stream) -> u64 {
        SimBackend::ordered_after(self, StreamId(stream), StreamId(other))
    }
    fn bytes(&self, address: u64, len: u64) -> Vec<Range<u64>> {
        physical_bytes(
            |a| self.physical_page(a).map(|p| PHYSICAL + p * self.page_size() + a % self.page_size()),
            address,
            len,
        )
    }
}

impl Device for SimBackend {
    fn launch(&self, stream: Stream) -> u64 {
        SimBackend::launch(self, StreamId(stream))
    }
    fn hold(&self, stream: Stream) {
        self.hold_stream(StreamId(stream));
    }
    fn run(&self, stream: Stream, item: u64) {
        self.complete_stream(StreamId(stream), item);
    }
    fn finish(&self, stream: Stream) {
        self.finish_stream(StreamId(stream));
    }
    fn capture(&self, stream: Stream, capturing: bool) {
        if capturing {
            self.begin_capture(StreamId(stream));
        } else {
            self.end_capture(StreamId(stream));
        }
    }
    fn capture_violations(&self) -> u64 {
        self.stream_log().capture_violations
    }
}

/// The bytes behind `[address, address + len)`, split where pages of [`SimBackend::PAGE`] (the smallest a
/// simulated device maps) end: `byte_of` numbers the first byte of each piece, and the piece's bytes follow it.
pub fn physical_bytes(byte_of: impl Fn(u64) -> Option<u64>, address: u64, len: u64) -> Vec<Range<u64>> {
    let page = SimBackend::PAGE;
    let mut bytes: Vec<Range<u64>> = Vec::new();
    let end = address + len;
    let mut at = address;
    while at < end {
        let to = ((at / page) + 1) * page;
        let to = to.min(end);
        let first = byte_of(at).unwrap_or(at);
        match bytes.last_mut() {
            Some(last) if last.end == first => last.end = first + (to - at),
            _ => bytes.push(first..first + (to - at)),
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

/// A graph captured into a private pool: its blocks (live or freed during or after the capture, which the
/// graph's replays still use until it is destroyed) and the pool's number.
struct Graph {
    pool: u64,
    blocks: Vec<u64>,
    /// Its blocks freed so far: held by the graph, retired when it is destroyed.
    freed: Vec<u64>,
}

/// A workload's state while it runs.
struct Run<'a, D: Door> {
    door: &'a std::sync::Arc<D>,
    workers: &'a Workers,
    oracle: Oracle,
    live: Vec<Live<D::Handle>>,
    next_id: u64,
    capturing: bool,
    graphs: Vec<Graph>,
}

impl<D: Door> Run<'_, D> {
    /// Queues work using block `id` on `stream`.
    fn launch_id(&mut self, id: u64, stream: u64) {
        let device = self.door.device();
        let item = device.launch(stream);
        let held = device.completed(stream) < item;
        self.oracle.used(id, Use { stream, item }, held);
    }

    /// Queues work using live block `i` on `stream`.
    fn launch(&mut self, i: usize, stream: u64) {
        self.launch_id(self.live[i].id, stream);
    }

    /// Checks a block just handed out and records it as live, with work queued on it.
    fn handed_out(&mut self, made: Option<(D::Handle, u64, u64)>, stream: u64) -> Result<Option<usize>, String> {
        let Some((handle, address, len)) = made else { return Ok(None) };
        let id = self.next_id;
        self.next_id += 1;
        self.oracle.note(format!("  -> block {id}: {len} bytes at {address:#x} on stream {stream}"));
        self.oracle.handed_out(self.door.device(), id, stream, address, len)?;
        self.live.push(Live { id, handle, stream, address, len });
        let i = self.live.len() - 1;
        self.launch(i, stream);
        Ok(Some(i))
    }

    fn allocate(&mut self, bytes: u64, stream: u64, thread: usize) -> Result<Option<usize>, String> {
        let door = std::sync::Arc::clone(self.door);
        let made = self.workers.run(thread, move || door.allocate(bytes, stream));
        self.handed_out(made, stream)
    }

    fn free(&mut self, i: usize, on: u64, thread: usize) {
        let on = if self.door.frees_on_streams() { on } else { self.live[i].stream };
        self.oracle.note(format!("  free block {} on stream {on}", self.live[i].id));
        if on != self.live[i].stream {
            // A free on another stream: work queued there before it may use the block.
            self.launch(i, on);
        }
        let block = self.live.swap_remove(i);
        let door = std::sync::Arc::clone(self.door);
        let handle = block.handle.clone();
        self.workers.run(thread, move || door.free(&handle, on));
        match self.graphs.iter_mut().find(|g| g.blocks.contains(&block.id)) {
            // The graph's replays may still use it: its bytes stay the graph's until the graph goes.
            Some(graph) => graph.freed.push(block.id),
            None => self.oracle.freed(block.id, on),
        }
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

    /// Captures a graph into a private pool on [`CAPTURE_STREAM`]: `sizes` allocated, the first `freed` of them
    /// freed during the capture, then the graph replayed on `replay`.
    fn graph(&mut self, sizes: &[usize], freed: usize, replay: u64) -> Result<(), String> {
        if self.capturing {
            return Ok(());
        }
        let Some(pool) = self.door.begin_graph() else { return Ok(()) };
        self.oracle.reach.captures += 1;
        self.door.device().capture(CAPTURE_STREAM, true);
        let mut graph = Graph { pool, blocks: Vec::new(), freed: Vec::new() };
        for &size in sizes {
            let made = self.door.allocate_in_graph(pool, SIZES[size], CAPTURE_STREAM);
            if let Some(i) = self.handed_out(made, CAPTURE_STREAM)? {
                graph.blocks.push(self.live[i].id);
            }
        }
        self.graphs.push(graph);
        for _ in 0..freed {
            let last = self.graphs.last().expect("pushed");
            let Some(i) = self.live.iter().position(|l| last.blocks.contains(&l.id)) else { break };
            self.free(i, CAPTURE_STREAM, 0);
        }
        self.door.device().capture(CAPTURE_STREAM, false);
        self.door.end_graph();
        self.replay(self.graphs.len() - 1, replay);
        Ok(())
    }

    /// Replays graph `g` on `stream`: work that uses every block of the graph, freed or not.
    fn replay(&mut self, g: usize, stream: u64) {
        for id in self.graphs[g].blocks.clone() {
            self.launch_id(id, stream);
        }
    }

    /// Destroys graph `g`: the blocks it held retire with their uses, and its pool is let go.
    fn destroy_graph(&mut self, g: usize) {
        let graph = self.graphs.swap_remove(g);
        for id in graph.freed {
            self.oracle.freed(id, CAPTURE_STREAM);
        }
        self.door.release_graph(graph.pool);
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
                let own = self.live[i].stream;
                // A door whose frees take no stream is told of the other stream by a record first.
                let on = if on == own || self.door.frees_on_streams() || self.door.record(&self.live[i].handle, on) {
                    on
                } else {
                    own
                };
                self.free(i, on, thread);
            }
            Op::Use { .. } | Op::Free { .. } => {}
            Op::Hold { stream } => self.door.device().hold(stream),
            Op::Run { stream, items } => {
                let device = self.door.device();
                device.run(stream, device.completed(stream) + items);
            }
            Op::Finish { stream } => self.door.device().finish(stream),
            Op::Capture => {
                if self.capturing {
                    self.door.device().capture(CAPTURE_STREAM, false);
                    self.door.end_capture();
                } else {
                    self.oracle.reach.captures += 1;
                    self.door.begin_capture();
                    self.door.device().capture(CAPTURE_STREAM, true);
                }
                self.capturing = !self.capturing;
            }
            Op::Graph { ref sizes, freed, replay } => self.graph(sizes, freed, replay)?,
            Op::Replay { pick, stream } if !self.graphs.is_empty() => self.replay(pick % self.graphs.len(), stream),
            Op::DestroyGraph { pick } if !self.graphs.is_empty() => self.destroy_graph(pick % self.graphs.len()),
            Op::Replay { .. } | Op::DestroyGraph { .. } => {}
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
        self.oracle.recheck(self.door.device(), &blocks)?;
        self.oracle.count_waiting(self.door.device());
        Ok(())
    }

    fn violation(&self, what: String) -> String {
        let tail = self.oracle.history.len().saturating_sub(40);
        format!("{what}\nlast operations:\n  {}", self.oracle.history[tail..].join("\n  "))
    }
}

/// Runs `ops` through `door`, checking every block against the oracle. Err with the first violation; the reach
/// of the run otherwise. Ends by letting every stream run, destroying the graphs, freeing what lives, and
/// checking that nothing the driver refuses during a capture was called.
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
        graphs: Vec::new(),
    };
    for op in ops {
        run.apply(op)?;
    }
    if run.capturing {
        run.apply(&Op::Capture)?;
    }
    for stream in (1..=STREAMS).chain([CAPTURE_STREAM]) {
        door.device().finish(stream);
    }
    while let Some(block) = run.live.pop() {
        door.free(&block.handle, block.stream);
        if !run.graphs.iter().any(|g| g.blocks.contains(&block.id)) {
            run.oracle.freed(block.id, block.stream);
        }
    }
    while !run.graphs.is_empty() {
        run.destroy_graph(0);
    }
    let counters = door.counters();
    let reach = &mut run.oracle.reach;
    reach.moves_between_streams = counters.moves;
    reach.planned_allocs = counters.planned_allocs;
    reach.stitched_allocs = counters.stitched_allocs;
    reach.retries = counters.retries;
    let violations = door.device().capture_violations();
    if violations != 0 {
        return Err(run.violation(format!("{violations} calls a driver refuses during a capture")));
    }
    Ok(run.oracle.reach)
}
