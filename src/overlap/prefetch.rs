//! [`Prefetcher`]: worker threads that upload the batches of an iterator ahead of the loop that consumes them.

use super::{Lane, OverlapOptions};
use crate::buffer::UniversalBuffer;
use crate::error::{Error, Result};
use crate::manager::UniversalMemoryManager;
use crate::options::AllocOptions;
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Builds a [`Prefetch`]: made by [`UniversalMemoryManager::prefetcher`], which sets how many batches stay
/// uploaded ahead (`lookahead`) and how many threads upload them (`workers`).
///
/// ```
/// use umm::{DeviceSelector, UniversalMemoryManager};
///
/// let mm = UniversalMemoryManager::builder().backends(false, false, false).build()?;
/// let batches = (0..10u32).map(|i| vec![i; 1000]);
/// for (i, batch) in mm.prefetcher(2, 2).device(DeviceSelector::Host).wrap(batches)?.enumerate() {
///     let batch = batch?; // a resident device buffer; the next two are uploading meanwhile
///     assert_eq!(batch.to_vec()?, vec![i as u32; 1000]);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Prefetcher {
    mm: UniversalMemoryManager,
    lookahead: usize,
    workers: usize,
    options: OverlapOptions,
}

/// A batch uploaded by a [`Prefetch`]: a device buffer holding exactly the batch (dereferences to its
/// [`UniversalBuffer`]), and its position in the source.
pub struct DeviceBatch<T: bytemuck::Pod> {
    buffer: UniversalBuffer<T>,
    index: u64,
}

/// What a [`Prefetch`] yields instead of a batch.
#[derive(Debug)]
pub enum PrefetchError<E> {
    /// The source iterator yielded this error.
    Source(E),
    /// Allocating the device buffer or uploading the batch failed.
    Upload(Error),
    /// A worker panicked while pulling or uploading this batch (the payload's message); the source is not
    /// pulled from again, so this is the last item.
    WorkerPanicked(String),
}

impl<E: std::fmt::Display> std::fmt::Display for PrefetchError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrefetchError::Source(e) => write!(f, "the batch source failed: {e}"),
            PrefetchError::Upload(e) => write!(f, "uploading a batch failed: {e}"),
            PrefetchError::WorkerPanicked(m) => write!(f, "a prefetch worker panicked: {m}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for PrefetchError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PrefetchError::Source(e) => Some(e),
            PrefetchError::Upload(e) => Some(e),
            PrefetchError::WorkerPanicked(_) => None,
        }
    }
}

/// A batch as the source gives it, boxed so that workers need not know its type.
type Batch<T> = Box<dyn AsRef<[T]> + Send>;
type Source<T, E> = Box<dyn Iterator<Item = std::result::Result<Batch<T>, E>> + Send>;

/// How a pulled item came out.
enum Outcome<T: bytemuck::Pod, E> {
    Ready(DeviceBatch<T>),
    Failed(PrefetchError<E>),
}

/// The source and the count of items pulled from it: locked apart from [`State`], so that a slow source holds up
/// neither the consumer nor the workers handing in batches.
struct Pull<T, E> {
    /// `None` once exhausted, broken by a panic, or stopped.
    source: Option<Source<T, E>>,
    /// Sequence number of the next item pulled.
    pulled: u64,
}

struct State<T: bytemuck::Pod, E> {
    /// Sequence number of the next item the consumer gets.
    yielded: u64,
    /// Items pulled, not yet yielded, that may still be pulled: at most `lookahead` are pulled ahead.
    permits: usize,
    /// Finished items by sequence number, waiting for their turn.
    ready: BTreeMap<u64, Outcome<T, E>>,
    /// The sequence number at which the source ended (no item has it or a later one).
    end: Option<u64>,
    /// Set when the consumer goes: workers stop.
    stop: bool,
    /// Workers still running.
    running: usize,
}

/// Locks are taken in the order `pull`, then `state`, never the other way round.
struct Shared<T: bytemuck::Pod, E> {
    pull: Mutex<Pull<T, E>>,
    state: Mutex<State<T, E>>,
    /// Workers wait here for a permit.
    to_workers: Condvar,
    /// The consumer waits here for its next item.
    to_consumer: Condvar,
}

/// An iterator over the batches of a source, uploaded ahead by worker threads: yields each batch as a
/// [`DeviceBatch`] that is already resident, in the source's order, with the source's errors
/// ([`PrefetchError::Source`]) and upload failures ([`PrefetchError::Upload`]) in their places, then `None`
/// when the source ends.
///
/// At most `lookahead` batches are pulled ahead of the consumer (pulled, uploading or uploaded and waiting),
/// so device memory stays bounded by `lookahead` batches plus those the consumer holds (one or two in a loop:
/// `lookahead + 2`). Each worker copies its batch into its own staging (pinned memory on CUDA) and uploads it
/// on its own lane (a copy stream of its own on CUDA), waiting for the upload before handing the batch over.
/// Dropping the iterator stops the workers (after the batch each is uploading), joins them and returns every
/// buffer it still holds to its pool.
pub struct Prefetch<T: bytemuck::Pod + Send + Sync, E: Send + 'static = Infallible> {
    shared: Arc<Shared<T, E>>,
    workers: Vec<JoinHandle<()>>,
    done: bool,
}

impl Prefetcher {
    pub(super) fn new(mm: UniversalMemoryManager, lookahead: usize, workers: usize) -> Self {
        Self { mm, lookahead, workers, options: OverlapOptions::new() }
    }

    /// Which device (or API) the batches are uploaded to (any device unless set).
    pub fn device(mut self, selector: umm_placement::DeviceSelector) -> Self {
        self.options = self.options.device(selector);
        self
    }

    /// Full options: device, placement, label (the CUDA stream is not used: batches come resident).
    pub fn options(mut self, options: OverlapOptions) -> Self {
        self.options = options;
        self
    }

    /// Batches uploaded ahead.
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    /// Worker threads.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Prefetches the batches of an infallible source (`Vec<T>`s, or anything that is `AsRef<[T]>`). Errors:
    /// [`Error::ZeroParameter`] for a lookahead or worker count of 0, and what choosing the device raises.
    pub fn wrap<T, I, B>(self, batches: I) -> Result<Prefetch<T, Infallible>>
    where
        T: bytemuck::Pod + Send + Sync,
        I: IntoIterator<Item = B>,
        I::IntoIter: Send + 'static,
        B: AsRef<[T]> + Send + 'static,
    {
        self.start(Box::new(batches.into_iter().map(|b| Ok(Box::new(b) as Batch<T>))))
    }

    /// Prefetches the batches of a fallible source: an `Err(e)` item comes out as [`PrefetchError::Source`] in
    /// its place, and the source is pulled on after it. Errors as [`Prefetcher::wrap`].
    pub fn try_wrap<T, I, B, E>(self, batches: I) -> Result<Prefetch<T, E>>
    where
        T: bytemuck::Pod + Send + Sync,
        I: IntoIterator<Item = std::result::Result<B, E>>,
        I::IntoIter: Send + 'static,
        B: AsRef<[T]> + Send + 'static,
        E: Send + 'static,
    {
        self.start(Box::new(batches.into_iter().map(|b| b.map(|b| Box::new(b) as Batch<T>))))
    }

    fn start<T: bytemuck::Pod + Send + Sync, E: Send + 'static>(self, source: Source<T, E>) -> Result<Prefetch<T, E>> {
        if self.lookahead == 0 {
            return Err(Error::ZeroParameter { what: "the prefetcher's lookahead" });
        }
        if self.workers == 0 {
            return Err(Error::ZeroParameter { what: "the prefetcher's worker count" });
        }
        let alloc = self.options.resolve(&self.mm)?;
        let shared = Arc::new(Shared {
            pull: Mutex::new(Pull { source: Some(source), pulled: 0 }),
            state: Mutex::new(State {
                yielded: 0,
                permits: self.lookahead,
                ready: BTreeMap::new(),
                end: None,
                stop: false,
                running: self.workers,
            }),
            to_workers: Condvar::new(),
            to_consumer: Condvar::new(),
        });
        let mut prefetch = Prefetch { shared: Arc::clone(&shared), workers: Vec::new(), done: false };
        for i in 0..self.workers {
            let worker = Worker { mm: super::share(&self.mm), alloc: alloc.clone(), shared: Arc::clone(&shared) };
            let spawned = std::thread::Builder::new().name(format!("umm-prefetch-{i}")).spawn(move || worker.run());
            match spawned {
                Ok(handle) => prefetch.workers.push(handle),
                Err(e) => {
                    // `prefetch` stops and joins the workers started so far when dropped.
                    shared.state.lock().running -= self.workers - i;
                    return Err(Error::Io { path: "spawning a prefetch worker".into(), source: e });
                }
            }
        }
        Ok(prefetch)
    }
}

struct Worker<T: bytemuck::Pod, E> {
    mm: UniversalMemoryManager,
    alloc: AllocOptions,
    shared: Arc<Shared<T, E>>,
}

impl<T: bytemuck::Pod + Send + Sync, E: Send + 'static> Worker<T, E> {
    fn run(self) {
        let mut lane: Option<Lane> = None;
        loop {
            {
                let mut state = self.shared.state.lock();
                while !state.stop && state.end.is_none() && state.permits == 0 {
                    self.shared.to_workers.wait(&mut state);
                }
                if state.stop || state.end.is_some() {
                    break;
                }
                // Taken before pulling: every item pulled holds one until it is yielded, so the item the consumer
                // waits for is always on its way.
                state.permits -= 1;
            }
            let (seq, item) = {
                let mut pull = self.shared.pull.lock();
                let seq = pull.pulled;
                // Sequence numbers follow the source's order: they are taken under the source's lock.
                let pulled = match pull.source.as_mut() {
                    Some(source) => catch_unwind(AssertUnwindSafe(|| source.next())),
                    None => Ok(None),
                };
                match pulled {
                    Ok(Some(item)) => {
                        pull.pulled += 1;
                        (seq, item)
                    }
                    Ok(None) => {
                        pull.source = None;
                        let mut state = self.shared.state.lock();
                        state.end = Some(state.end.map_or(seq, |end| end.min(seq)));
                        state.permits += 1;
                        self.shared.to_workers.notify_all();
                        self.shared.to_consumer.notify_all();
                        break;
                    }
                    Err(panic) => {
                        pull.source = None;
                        pull.pulled += 1;
                        let mut state = self.shared.state.lock();
                        state.end = Some(seq + 1);
                        state.ready.insert(seq, Outcome::Failed(PrefetchError::WorkerPanicked(message(&*panic))));
                        self.shared.to_workers.notify_all();
                        self.shared.to_consumer.notify_all();
                        break;
                    }
                }
            };
            let outcome = match item {
                Err(e) => Outcome::Failed(PrefetchError::Source(e)),
                Ok(batch) => match catch_unwind(AssertUnwindSafe(|| self.upload(&mut lane, seq, (*batch).as_ref()))) {
                    Ok(Ok(batch)) => Outcome::Ready(batch),
                    Ok(Err(e)) => {
                        // A lane that failed may hold a broken upload: the next batch starts a fresh one.
                        lane = None;
                        Outcome::Failed(PrefetchError::Upload(e))
                    }
                    Err(panic) => {
                        lane = None;
                        Outcome::Failed(PrefetchError::WorkerPanicked(message(&*panic)))
                    }
                },
            };
            let mut state = self.shared.state.lock();
            if state.stop {
                break;
            }
            state.ready.insert(seq, outcome);
            self.shared.to_consumer.notify_all();
        }
        // Staging and the upload in flight go before the worker says it is done.
        drop(lane);
        let mut state = self.shared.state.lock();
        state.running -= 1;
        self.shared.to_consumer.notify_all();
    }

    /// Allocates a buffer for `batch`, uploads it and waits until it is resident.
    fn upload(&self, lane: &mut Option<Lane>, index: u64, batch: &[T]) -> Result<DeviceBatch<T>> {
        let mut buffer = self.mm.allocate_universal_with::<T>(batch.len(), self.alloc.clone())?;
        if lane.is_none() && !batch.is_empty() {
            *lane = Some(Lane::for_buffer(
                &self.mm,
                &buffer,
                #[cfg(feature = "cuda")]
                None,
            )?);
        }
        if let Some(lane) = lane.as_mut() {
            lane.start(&mut buffer, batch)?;
            lane.finish()?;
        }
        Ok(DeviceBatch { buffer, index })
    }
}

/// The message of a panic payload.
fn message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

impl<T: bytemuck::Pod + Send + Sync, E: Send + 'static> Iterator for Prefetch<T, E> {
    type Item = std::result::Result<DeviceBatch<T>, PrefetchError<E>>;

    /// The next batch in the source's order, waiting until it is resident; `None` after the source's end.
    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let shared = &self.shared;
        let mut state = shared.state.lock();
        loop {
            let turn = state.yielded;
            if let Some(outcome) = state.ready.remove(&turn) {
                state.yielded += 1;
                state.permits += 1;
                shared.to_workers.notify_one();
                return Some(match outcome {
                    Outcome::Ready(batch) => Ok(batch),
                    Outcome::Failed(e) => Err(e),
                });
            }
            if state.end.is_some_and(|end| turn >= end) {
                self.done = true;
                return None;
            }
            if state.running == 0 {
                // Every worker is gone without this item (they only leave early when stopped or when a spawn
                // failed): report it once rather than wait forever.
                self.done = true;
                return Some(Err(PrefetchError::WorkerPanicked("every prefetch worker has stopped".into())));
            }
            shared.to_consumer.wait(&mut state);
        }
    }
}

impl<T: bytemuck::Pod + Send + Sync, E: Send + 'static> Drop for Prefetch<T, E> {
    fn drop(&mut self) {
        let ready = {
            let mut state = self.shared.state.lock();
            state.stop = true;
            self.shared.to_workers.notify_all();
            std::mem::take(&mut state.ready)
        };
        // Buffers and the source go outside the state's lock (the source's waits for a pull in progress).
        drop(ready);
        let source = self.shared.pull.lock().source.take();
        drop(source);
        for worker in self.workers.drain(..) {
            if worker.join().is_err() {
                log::error!("a prefetch worker panicked outside the guarded calls");
            }
        }
    }
}

impl<T: bytemuck::Pod + Send + Sync, E: Send + 'static> std::fmt::Debug for Prefetch<T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.state.lock();
        f.debug_struct("Prefetch")
            .field("yielded", &state.yielded)
            .field("ready", &state.ready.len())
            .field("ended", &state.end.is_some())
            .finish()
    }
}

impl<T: bytemuck::Pod> DeviceBatch<T> {
    /// The device buffer, holding exactly the batch.
    pub fn buffer(&self) -> &UniversalBuffer<T> {
        &self.buffer
    }

    /// The device buffer, mutably (for kernels that write it).
    pub fn buffer_mut(&mut self) -> &mut UniversalBuffer<T> {
        &mut self.buffer
    }

    /// The device buffer, kept beyond the batch.
    pub fn into_buffer(self) -> UniversalBuffer<T> {
        self.buffer
    }

    /// The batch's position in the source (0 for the first item, errors counted).
    pub fn index(&self) -> u64 {
        self.index
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for DeviceBatch<T> {
    type Target = UniversalBuffer<T>;
    fn deref(&self) -> &UniversalBuffer<T> {
        &self.buffer
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for DeviceBatch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch").field("index", &self.index).field("buffer", &self.buffer).finish()
    }
}
