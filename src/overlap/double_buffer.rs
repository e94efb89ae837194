//! [`DoubleBuffer`]: a front buffer kernels read, a back buffer the next batch uploads into.

use super::{Lane, OverlapOptions};
use crate::buffer::UniversalBuffer;
use crate::error::{Error, Result};
use crate::manager::UniversalMemoryManager;

/// One of the two buffers, with its upload lane and the length of the batch it holds.
struct Slot<T: bytemuck::Pod> {
    /// Dropped first, while the lane's streams live: a free waits for an upload still writing the buffer through
    /// the pool's stream rules (CUDA marks the buffer as used on the copy stream), or the queue's order.
    buffer: UniversalBuffer<T>,
    /// Then the lane, which waits for its upload in flight before its staging goes.
    lane: Lane,
    /// Elements of the batch uploaded last (`None`: nothing uploaded yet).
    len: Option<usize>,
}

/// Two device buffers of `capacity` elements from the manager's pools (plus, on CUDA, pinned staging from the
/// device's pinned pool), so that the next batch uploads while kernels read the current one:
///
/// 1. [`DoubleBuffer::prefetch_next`] starts uploading a batch into the back buffer and returns at once (after
///    staging it, on CUDA).
/// 2. [`DoubleBuffer::swap`] makes that buffer the front.
/// 3. [`DoubleBuffer::current`] gives the front buffer once its upload has completed for the kernels that read
///    it: on CUDA the compute stream ([`OverlapOptions::cuda_stream`]) waits for the copy's event, and the host
///    does not; elsewhere the host waits if needed.
///
/// The usual loop uploads batch `i + 1` while batch `i` is computed on:
///
/// ```
/// use umm::{DeviceSelector, UniversalMemoryManager};
///
/// let mm = UniversalMemoryManager::builder().backends(false, false, false).build()?;
/// let batches: Vec<Vec<f32>> = (0..4).map(|i| vec![i as f32; 100 + i]).collect();
/// let mut db = mm.double_buffer::<f32>(128, DeviceSelector::Host)?;
/// db.prefetch_next(&batches[0])?;
/// db.swap();
/// for i in 0..batches.len() {
///     if let Some(next) = batches.get(i + 1) {
///         db.prefetch_next(next)?; // uploads while batch i is computed on
///     }
///     let front = db.current()?; // batch i, resident
///     assert_eq!(front.to_vec()?, batches[i]); // a kernel would read front.buffer() here
///     db.swap();
/// }
/// # Ok::<(), umm::Error>(())
/// ```
///
/// On CUDA, uploads run on a copy stream of their own; each waits for the kernels queued on the compute stream
/// before it, so it never overwrites a buffer a kernel still reads. On OpenCL they are non-blocking writes on
/// the device's in-order queue, on wgpu `queue.write_buffer` calls (ordered before the next submission), on
/// the host a `memcpy`. Batches may be shorter than the capacity ([`Front::len`] says how long); a longer one
/// is [`Error::BatchTooLarge`]. Dropping the double buffer waits for its uploads and returns its buffers to
/// their pools.
pub struct DoubleBuffer<T: bytemuck::Pod> {
    slots: [Slot<T>; 2],
    /// Index of the front slot.
    front: usize,
    capacity: usize,
}

/// The front buffer of a [`DoubleBuffer`] holding a batch: the whole buffer ([`Front::buffer`], `capacity`
/// elements, for kernel views) and the batch's length.
pub struct Front<'a, T: bytemuck::Pod> {
    buffer: &'a UniversalBuffer<T>,
    len: usize,
}

impl<T: bytemuck::Pod> DoubleBuffer<T> {
    pub(super) fn new(mm: &UniversalMemoryManager, capacity: usize, options: OverlapOptions) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::ZeroParameter { what: "the double buffer's capacity" });
        }
        if options.placement == Some(umm_placement::Placement::ReadOnly) {
            return Err(Error::InvalidConfig(
                "a double buffer rewrites its buffers, and ReadOnly memory takes one write: use DeviceLocal".into(),
            ));
        }
        let alloc = options.resolve(mm)?;
        let slot = || -> Result<Slot<T>> {
            let buffer = mm.allocate_universal_with::<T>(capacity, alloc.clone())?;
            let lane = Lane::for_buffer(
                mm,
                &buffer,
                #[cfg(feature = "cuda")]
                options.cuda_stream.as_ref(),
            )?;
            Ok(Slot { buffer, lane, len: None })
        };
        Ok(Self { slots: [slot()?, slot()?], front: 0, capacity })
    }

    /// Elements each buffer holds: the longest batch accepted.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Starts uploading `batch` into the back buffer and returns without waiting for the device: on CUDA after
    /// copying it into pinned staging and queueing the copy, on OpenCL and wgpu after enqueueing the write, on the
    /// host after the copy. A batch longer than [`DoubleBuffer::capacity`] is [`Error::BatchTooLarge`] (and
    /// changes nothing). Called twice without a [`DoubleBuffer::swap`], the second batch replaces the first.
    pub fn prefetch_next(&mut self, batch: &[T]) -> Result<()> {
        if batch.len() > self.capacity {
            return Err(Error::BatchTooLarge { len: batch.len(), capacity: self.capacity });
        }
        let slot = &mut self.slots[1 - self.front];
        slot.len = None;
        // Kernels queued so far may still read this buffer (it was the front two swaps ago).
        slot.lane.after_compute()?;
        slot.lane.start(&mut slot.buffer, batch)?;
        slot.len = Some(batch.len());
        Ok(())
    }

    /// Swaps the buffers: the one the last [`DoubleBuffer::prefetch_next`] uploaded into becomes the front.
    pub fn swap(&mut self) {
        self.front = 1 - self.front;
    }

    /// The front buffer, its upload completed for the kernels that read it (on CUDA, the compute stream waits for
    /// it; elsewhere the host waits if needed). [`Error::NothingPrefetched`] when no batch was uploaded into it
    /// (before the first `prefetch_next` and `swap`, or after a failed upload).
    pub fn current(&mut self) -> Result<Front<'_, T>> {
        let slot = &mut self.slots[self.front];
        let Some(len) = slot.len else { return Err(Error::NothingPrefetched) };
        slot.lane.order_before_compute()?;
        Ok(Front { buffer: &slot.buffer, len })
    }

    /// Waits (on the host) until both buffers' uploads have completed.
    pub fn synchronize(&mut self) -> Result<()> {
        for slot in &mut self.slots {
            slot.lane.finish()?;
        }
        Ok(())
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for DoubleBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DoubleBuffer")
            .field("capacity", &self.capacity)
            .field("front", &self.slots[self.front].buffer)
            .field("front_len", &self.slots[self.front].len)
            .field("back_len", &self.slots[1 - self.front].len)
            .finish()
    }
}

impl<'a, T: bytemuck::Pod> Front<'a, T> {
    /// The whole front buffer (`capacity` elements; the batch is its first [`Front::len`]), for kernel views.
    pub fn buffer(&self) -> &'a UniversalBuffer<T> {
        self.buffer
    }

    /// Elements of the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The batch, read back to the host (waits for the device).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.buffer.read_at(0, &mut out)?;
        Ok(out)
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for Front<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front").field("buffer", self.buffer).field("len", &self.len).finish()
    }
}
