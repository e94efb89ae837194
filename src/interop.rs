//! Kernels on universal buffers: what each API's kernels take, borrowed from a [`UniversalBuffer`], and the
//! backend device objects that launch them.
//!
//! | API    | view                                                    | what a kernel gets                       |
//! |--------|---------------------------------------------------------|------------------------------------------|
//! | host   | [`UniversalBuffer::as_slice`] / `as_mut_slice`          | `&[T]` / `&mut [T]`                      |
//! | wgpu   | [`UniversalBuffer::wgpu_binding`] / `wgpu_binding_mut` / `wgpu_uniform_binding` | a `wgpu::BufferBinding` (buffer, offset, size) |
//! | OpenCL | [`UniversalBuffer::opencl_buffer`] / `opencl_buffer_mut`| a sub-buffer `cl_mem` of exactly the buffer |
//! | CUDA   | [`UniversalBuffer::cuda_view`] / `cuda_view_mut`        | cudarc `DevicePtr` / `DevicePtrMut`      |
//!
//! Every view borrows the buffer, so the buffer can be neither dropped nor migrated while a view lives; the
//! `_mut` forms borrow it mutably (no host read or write meanwhile) and refuse read-only buffers
//! ([`Error::ReadOnly`]). Asking for a view of another API's buffer is [`Error::WrongApi`]; of an empty buffer,
//! [`Error::EmptyBuffer`].
//!
//! Alignment: a wgpu buffer's memory is a `wgpu::Buffer` of its own, bound at offset 0, so any umm buffers can be
//! bound together in one pass with any mix of usages (storage `read` and `read_write`, uniform, copies): wgpu
//! tracks usage per `wgpu::Buffer`. OpenCL pools place every block at a multiple of `CL_DEVICE_MEM_BASE_ADDR_ALIGN`,
//! so a block can always become a sub-buffer; sub-buffers of distinct umm buffers never overlap, which the OpenCL
//! specification requires of buffers one kernel reads and writes. An adopted buffer is its own segment, at
//! offset 0.

use crate::buffer::UniversalBuffer;
use crate::discovery::ApiHandle;
use crate::error::{Error, Result};
#[allow(unused_imports)]
use umm_backends::OwnedBlock;
use umm_placement::Api;

impl<T: bytemuck::Pod> UniversalBuffer<T> {
    /// The API whose memory holds the buffer (`None` for an empty buffer).
    pub fn api(&self) -> Option<Api> {
        self.block.as_ref().map(|b| b.pool().api())
    }

    /// The buffer's block, checked to be memory of `wanted`.
    #[allow(dead_code)]
    fn block_of(&self, op: &'static str, wanted: Api) -> Result<&OwnedBlock> {
        let Some(block) = &self.block else {
            return Err(Error::EmptyBuffer { op, label: self.meta.owned_label() });
        };
        let found = block.pool().api();
        if found != wanted {
            return Err(Error::WrongApi { op, wanted, found, label: self.meta.owned_label() });
        }
        Ok(block)
    }

    /// As [`UniversalBuffer::block_of`], mutably, refusing read-only buffers.
    #[allow(dead_code)]
    fn block_of_mut(&mut self, op: &'static str, wanted: Api) -> Result<&mut OwnedBlock> {
        self.block_of(op, wanted)?;
        if self.meta.read_only {
            return Err(Error::ReadOnly { label: self.meta.owned_label() });
        }
        Ok(self.block.as_mut().expect("checked by block_of"))
    }
}

#[cfg(feature = "wgpu")]
pub use self::wgpu_view::WgpuView;

#[cfg(feature = "wgpu")]
mod wgpu_view {
    use super::*;
    use umm_backends::wgpu_backend::{block_binding, block_uniform_binding, wgpu, WgpuBackend, WgpuBlock};
    use umm_backends::Backend;
    use umm_backends::Pool;

    /// A buffer as a wgpu storage binding, borrowing the buffer. Build bind groups with
    /// [`WgpuView::binding_resource`], on [`WgpuView::device`], and submit on [`WgpuView::queue`] (the queue
    /// umm's own copies use, so they are ordered with the kernels).
    pub struct WgpuView<'a> {
        block: WgpuBlock,
        pool: &'a Pool<WgpuBackend>,
        /// Bound as a uniform: offsets align to the uniform limit rather than the storage one.
        uniform: bool,
    }

    impl std::fmt::Debug for WgpuView<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("WgpuView").field("block", &self.block).field("pool", &self.pool.backend().name()).finish()
        }
    }

    impl WgpuView<'_> {
        /// The `(buffer, offset, size)` binding: the buffer is this umm buffer's own, `offset` is 0, `size` the
        /// buffer's bytes rounded up to 4.
        pub fn binding(&self) -> wgpu::BufferBinding<'_> {
            self.block.as_buffer_binding()
        }

        /// The binding as a bind group resource.
        pub fn binding_resource(&self) -> wgpu::BindingResource<'_> {
            self.block.as_binding_resource()
        }

        /// The segment's buffer that holds the block.
        pub fn buffer(&self) -> &wgpu::Buffer {
            &self.block.buffer
        }

        /// Offset of the buffer's first byte in [`WgpuView::buffer`]: 0 (every umm buffer on wgpu is a
        /// `wgpu::Buffer` of its own).
        pub fn offset(&self) -> u64 {
            self.block.offset
        }

        /// Bytes the binding spans.
        pub fn size(&self) -> u64 {
            self.block.size
        }

        /// The wgpu device the buffer lives on.
        pub fn device(&self) -> &wgpu::Device {
            self.pool.backend().device()
        }

        /// The device's queue.
        pub fn queue(&self) -> &wgpu::Queue {
            self.pool.backend().queue()
        }

        /// The bytes `range` selects of this view (offsets relative to it), as a view a kernel can bind to work on
        /// part of a buffer. wgpu needs the start to be a multiple of the device's
        /// `min_storage_buffer_offset_alignment` (`min_uniform_buffer_offset_alignment` for a uniform view; 256 on
        /// most devices, 16–64 on some) and the length to be a non-zero multiple of 4: anything else, or a range
        /// past the view, is an error saying which.
        pub fn slice(&self, range: std::ops::Range<u64>) -> Result<WgpuView<'_>> {
            let limits = self.device().limits();
            let alignment = u64::from(if self.uniform {
                limits.min_uniform_buffer_offset_alignment
            } else {
                limits.min_storage_buffer_offset_alignment
            });
            Ok(WgpuView { block: self.block.range(range, alignment)?, pool: self.pool, uniform: self.uniform })
        }
    }

    impl<T: bytemuck::Pod> UniversalBuffer<T> {
        /// The buffer as a wgpu storage binding for shaders that read it. [`Error::WrongApi`] for a buffer of
        /// another API, [`Error::EmptyBuffer`] for an empty one, and a backend error when the buffer's memory
        /// cannot be bound as storage (an adopted buffer without `STORAGE`, a block larger than
        /// `max_storage_buffer_binding_size`).
        pub fn wgpu_binding(&self) -> Result<WgpuView<'_>> {
            let block = self.block_of("wgpu_binding", Api::Wgpu)?;
            self.record_device_use();
            view(block)
        }

        /// The buffer as a wgpu storage binding for shaders that write it: borrows the buffer mutably and
        /// refuses read-only buffers ([`Error::ReadOnly`]); otherwise as [`UniversalBuffer::wgpu_binding`].
        pub fn wgpu_binding_mut(&mut self) -> Result<WgpuView<'_>> {
            // Checked first, so that a refused view records no use.
            self.block_of_mut("wgpu_binding_mut", Api::Wgpu)?;
            self.record_device_use();
            let block = self.block_of_mut("wgpu_binding_mut", Api::Wgpu)?;
            view(block)
        }

        /// The buffer as a wgpu uniform binding (`var<uniform>`): the same binding as
        /// [`UniversalBuffer::wgpu_binding`], checked against `max_uniform_buffer_binding_size` and the buffer's
        /// usages instead (device-local and read-only buffers have `UNIFORM`; host-pinned ones do not).
        pub fn wgpu_uniform_binding(&self) -> Result<WgpuView<'_>> {
            let block = self.block_of("wgpu_uniform_binding", Api::Wgpu)?;
            self.record_device_use();
            let pool = wgpu_pool(block);
            Ok(WgpuView { block: block_uniform_binding(block)?, pool, uniform: true })
        }
    }

    fn wgpu_pool(block: &OwnedBlock) -> &Pool<WgpuBackend> {
        block.pool().as_any().downcast_ref::<Pool<WgpuBackend>>().expect("wgpu memory lives in a wgpu pool")
    }

    fn view(block: &OwnedBlock) -> Result<WgpuView<'_>> {
        Ok(WgpuView { block: block_binding(block)?, pool: wgpu_pool(block), uniform: false })
    }
}

#[cfg(feature = "opencl")]
pub use self::opencl_view::OpenClView;

#[cfg(feature = "opencl")]
mod opencl_view {
    use super::*;
    use umm_backends::opencl::{block_sub_buffer, block_sub_buffer_range, opencl3, OpenClBackend, SubBuffer};
    use umm_backends::Backend;
    use umm_backends::Pool;

    /// A buffer as an OpenCL sub-buffer (`clCreateSubBuffer` over exactly the buffer's bytes), borrowing the
    /// buffer. Set [`OpenClView::as_raw`] as a kernel argument and enqueue on [`OpenClView::queue`] (the
    /// in-order queue umm's own copies use). The sub-buffer is released when the view is dropped.
    pub struct OpenClView<'a> {
        sub: SubBuffer,
        pool: &'a Pool<OpenClBackend>,
        block: &'a OwnedBlock,
        /// Where this view starts in the buffer (0 unless it is a [`OpenClView::slice`]).
        start: u64,
    }

    impl std::fmt::Debug for OpenClView<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("OpenClView").field("sub", &self.sub).field("pool", &self.pool.backend().name()).finish()
        }
    }

    impl OpenClView<'_> {
        /// The sub-buffer's `cl_mem`.
        pub fn as_raw(&self) -> opencl3::types::cl_mem {
            self.sub.as_raw()
        }

        /// The sub-buffer's origin in its segment (a multiple of `CL_DEVICE_MEM_BASE_ADDR_ALIGN`).
        pub fn offset(&self) -> u64 {
            self.sub.offset()
        }

        /// Bytes the sub-buffer spans.
        pub fn size(&self) -> u64 {
            self.sub.size()
        }

        /// The device's context, for building programs.
        pub fn context(&self) -> &opencl3::context::Context {
            self.pool.backend().context()
        }

        /// The device's in-order queue.
        pub fn queue(&self) -> &opencl3::command_queue::CommandQueue {
            self.pool.backend().queue()
        }

        /// The bytes `range` selects of this view (offsets relative to it), as a sub-buffer of its own for a kernel
        /// that works on part of a buffer (released when the new view is dropped). OpenCL needs the origin to be
        /// a multiple of the device's `CL_DEVICE_MEM_BASE_ADDR_ALIGN` (commonly 128 bytes or more); anything else,
        /// or a range past the view, is an error saying which.
        pub fn slice(&self, range: std::ops::Range<u64>) -> Result<OpenClView<'_>> {
            if range.end > self.size() {
                return Err(umm_backends::Error::OutOfBounds(format!(
                    "bytes {}..{} of an OpenCL view of {}",
                    range.start,
                    range.end,
                    self.size()
                ))
                .into());
            }
            let start = self.start + range.start;
            let sub = block_sub_buffer_range(self.block, start..self.start + range.end)?;
            Ok(OpenClView { sub, pool: self.pool, block: self.block, start })
        }
    }

    impl<T: bytemuck::Pod> UniversalBuffer<T> {
        /// The buffer as an OpenCL sub-buffer for kernels that read it. [`Error::WrongApi`] for a buffer of
        /// another API, [`Error::EmptyBuffer`] for an empty one.
        pub fn opencl_buffer(&self) -> Result<OpenClView<'_>> {
            let block = self.block_of("opencl_buffer", Api::OpenCl)?;
            self.record_device_use();
            view(block)
        }

        /// The buffer as an OpenCL sub-buffer for kernels that write it: borrows the buffer mutably and refuses
        /// read-only buffers ([`Error::ReadOnly`]); otherwise as [`UniversalBuffer::opencl_buffer`].
        pub fn opencl_buffer_mut(&mut self) -> Result<OpenClView<'_>> {
            // Checked first, so that a refused view records no use.
            self.block_of_mut("opencl_buffer_mut", Api::OpenCl)?;
            self.record_device_use();
            let block = self.block_of_mut("opencl_buffer_mut", Api::OpenCl)?;
            view(block)
        }
    }

    fn view(block: &OwnedBlock) -> Result<OpenClView<'_>> {
        let pool =
            block.pool().as_any().downcast_ref::<Pool<OpenClBackend>>().expect("OpenCL memory lives in an OpenCL pool");
        Ok(OpenClView { sub: block_sub_buffer(block)?, pool, block, start: 0 })
    }
}

#[cfg(feature = "cuda")]
mod cuda_view {
    use super::*;
    use std::sync::Arc;
    use umm_backends::cuda::cudarc::driver::CudaStream;
    use umm_backends::cuda::{block_view, block_view_mut, BlockView, BlockViewMut};

    impl<T: bytemuck::Pod> UniversalBuffer<T> {
        /// The buffer as a cudarc [`DevicePtr`](umm_backends::cuda::cudarc::driver::DevicePtr) for kernels on
        /// `stream` that read it (`builder.arg(&view)`), or its raw `CUdeviceptr`
        /// ([`BlockView::device_address`]). Marks the buffer as used on `stream`, so freeing it waits for that
        /// stream's work. [`Error::WrongApi`] for a buffer of another API, [`Error::EmptyBuffer`] for an empty
        /// one, a backend error for a stream of another context.
        pub fn cuda_view<'a>(&'a self, stream: &'a Arc<CudaStream>) -> Result<BlockView<'a, T>> {
            let block = self.block_of("cuda_view", Api::Cuda)?;
            self.record_device_use();
            Ok(block_view(block, stream)?)
        }

        /// The buffer as a cudarc `DevicePtrMut` for kernels on `stream` that write it: borrows the buffer
        /// mutably and refuses read-only buffers ([`Error::ReadOnly`]); otherwise as
        /// [`UniversalBuffer::cuda_view`].
        pub fn cuda_view_mut<'a>(&'a mut self, stream: &'a Arc<CudaStream>) -> Result<BlockViewMut<'a, T>> {
            self.record_device_use();
            let block = self.block_of_mut("cuda_view_mut", Api::Cuda)?;
            Ok(block_view_mut(block, stream)?)
        }
    }
}

impl crate::device::Device {
    /// The device as CUDA sees it (its context, for streams, modules and kernels), when it is a CUDA device.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<&umm_backends::cuda::CudaDevice> {
        self.handles().find_map(|h| match h {
            ApiHandle::Cuda(d) => Some(d),
            _ => None,
        })
    }

    /// The device as OpenCL sees it (its context and in-order queue), when it is an OpenCL device.
    #[cfg(feature = "opencl")]
    pub fn opencl(&self) -> Option<&umm_backends::opencl::OpenClDevice> {
        self.handles().find_map(|h| match h {
            ApiHandle::OpenCl(d) => Some(d),
            _ => None,
        })
    }

    /// The device as wgpu sees it (`device_and_queue` for pipelines), when it is a wgpu adapter.
    #[cfg(feature = "wgpu")]
    pub fn wgpu(&self) -> Option<&umm_backends::wgpu_backend::WgpuDevice> {
        self.handles().find_map(|h| match h {
            ApiHandle::Wgpu(d) => Some(&**d),
            _ => None,
        })
    }

    /// Whether the device is seen through `api`.
    pub fn has_api(&self, api: Api) -> bool {
        self.apis().contains(&api)
    }
}

#[allow(dead_code)]
fn _handles_used(h: &ApiHandle) -> bool {
    matches!(h, ApiHandle::Plain)
}
