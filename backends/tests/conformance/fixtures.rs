//! What the suite runs on: one [`Fixture`] per backend, placement and segment mode, with what it supports.

use std::any::Any;
use std::sync::{Arc, Mutex};
use umm_backends::{BlockHandle, HostBackend, MemoryPool, Pool, PoolConfig, Result, SegmentMode, SimBackend, StreamId};

/// Makes a pool of the fixture's device and placement from a configuration.
pub type MakePool = Box<dyn Fn(PoolConfig) -> Result<Arc<dyn MemoryPool>>>;

/// Makes the fixture's kernel when a test needs one (`None`: it could not be built, said on stderr).
pub type MakeKernel = Box<dyn Fn() -> Option<Box<dyn Kernel>>>;

/// A kernel of the backend's API, where it has one: `y[i] = 3 x[i] - x[n - 1 - i]` over `n` f32s, finished when
/// it returns. It reads both ends of `x`, so a binding at the wrong offset or of the wrong size shows.
pub trait Kernel {
    fn run(&self, x: (&dyn MemoryPool, &BlockHandle), y: (&dyn MemoryPool, &BlockHandle), n: u32);
}

/// One backend, placement and segment mode, and what it supports.
pub struct Fixture {
    /// Device and placement, for messages.
    pub label: String,
    /// Pools of this device and placement.
    make: MakePool,
    /// Device-local pools of the same device: where a kernel writes its output when the fixture's memory is
    /// read-only.
    device_local: Option<MakePool>,
    /// Segment mode of every pool the fixture makes.
    pub mode: SegmentMode,
    /// Whether the host may write blocks after allocation (CUDA's read-only memory is filled once, when a block
    /// is allocated, through `allocate_filled`).
    pub host_writes: bool,
    /// Whether kernels may only read the memory.
    pub read_only: bool,
    /// Whether the pool alone uses the device (host, sim), so that its free memory is exact.
    pub exclusive: bool,
    /// Whether every block is a segment of its own (wgpu; see `Backend::segment_per_block`).
    pub segment_per_block: bool,
    /// Two streams of the API, neither the default one.
    pub streams: [StreamId; 2],
    /// The kernel, made on demand (`None`: the API has none here, or it could not be built, said on stderr).
    kernel: Option<MakeKernel>,
    /// Every pool made, checked by [`Fixture::finish`].
    pools: Mutex<Vec<Arc<dyn MemoryPool>>>,
    /// What must outlive the pools (CUDA streams).
    _keep: Box<dyn Any>,
}

impl Fixture {
    fn new(label: String, mode: SegmentMode, make: MakePool) -> Self {
        Self {
            label,
            make,
            device_local: None,
            mode,
            host_writes: true,
            read_only: false,
            exclusive: false,
            segment_per_block: false,
            streams: [StreamId(1), StreamId(2)],
            kernel: None,
            pools: Mutex::new(Vec::new()),
            _keep: Box::new(()),
        }
    }

    /// The default configuration in the fixture's segment mode.
    pub fn config(&self) -> PoolConfig {
        PoolConfig { segment_mode: self.mode, ..PoolConfig::default() }
    }

    /// A pool of the fixture's device and placement.
    pub fn pool(&self, config: PoolConfig) -> Arc<dyn MemoryPool> {
        let pool = (self.make)(config).unwrap_or_else(|e| panic!("{}: pool: {e}", self.label));
        self.pools.lock().unwrap().push(Arc::clone(&pool));
        pool
    }

    /// A pool a kernel may write: the fixture's own placement, or device-local memory of the same device for
    /// read-only memory.
    pub fn output_pool(&self, config: PoolConfig) -> Arc<dyn MemoryPool> {
        let Some(make) = self.device_local.as_ref().filter(|_| self.read_only) else {
            return self.pool(config);
        };
        let config = PoolConfig { segment_mode: SegmentMode::Auto, ..config };
        let pool = make(config).unwrap_or_else(|e| panic!("{}: device-local pool: {e}", self.label));
        self.pools.lock().unwrap().push(Arc::clone(&pool));
        pool
    }

    /// The kernel, if the API has one here.
    pub fn kernel(&self) -> Option<Box<dyn Kernel>> {
        self.kernel.as_ref().and_then(|make| make())
    }

    /// A block of one of the fixture's pools holding `data`.
    pub fn put(&self, pool: &Arc<dyn MemoryPool>, data: &[u8], stream: StreamId) -> BlockHandle {
        let len = data.len() as u64;
        if !self.host_writes {
            return pool.allocate_filled(data, stream).unwrap_or_else(|e| panic!("{}: fill {len}: {e}", self.label));
        }
        let block = pool.allocate(len, stream).unwrap_or_else(|e| panic!("{}: allocate {len}: {e}", self.label));
        pool.write(&block, 0, data).unwrap_or_else(|e| panic!("{}: write {len}: {e}", self.label));
        block
    }

    /// Checks every pool the test made: nothing live, the books consistent, and everything reserved given back.
    pub fn finish(&self) {
        for pool in self.pools.lock().unwrap().drain(..) {
            let label = format!("{} ({})", self.label, pool.name());
            let s = pool.stats();
            assert_eq!(s.allocated_bytes.current, 0, "{label}: allocated bytes left: {s:?}");
            assert_eq!(s.requested_bytes.current, 0, "{label}: requested bytes left: {s:?}");
            assert_eq!(s.active_bytes.current, 0, "{label}: active bytes left: {s:?}");
            assert_eq!(s.active_blocks.current, 0, "{label}: active blocks left: {s:?}");
            // Blocks that thread caches keep count as split until they go back to the pool.
            assert!(s.inactive_split_bytes.current <= s.reserved_bytes.current, "{label}: {s:?}");
            assert_eq!(s.num_allocs, s.num_frees, "{label}: every allocation freed: {s:?}");
            assert_eq!(s.cache_hits + s.cache_misses, s.num_allocs, "{label}: every allocation a hit or a miss: {s:?}");
            assert!(s.allocated_bytes.peak <= s.reserved_bytes.peak, "{label}: {s:?}");
            let report = pool.release_cached();
            let after = pool.stats();
            assert_eq!(report.bytes_released, s.reserved_bytes.current, "{label}: released what was reserved");
            assert_eq!(after.reserved_bytes.current, 0, "{label}: reserved after release_cached: {after:?}");
            assert_eq!(after.segments.current, 0, "{label}: segments after release_cached: {after:?}");
            assert_eq!(after.inactive_split_bytes.current, 0, "{label}: split bytes after release_cached: {after:?}");
            if self.exclusive {
                assert_eq!(pool.free_bytes(), pool.capacity(), "{label}: the device has all its memory back");
            }
        }
    }
}

const GIB: u64 = 1 << 30;

/// Host memory: one fixture.
pub fn host() -> Vec<Fixture> {
    let make: MakePool = Box::new(|config| Ok(Arc::new(Pool::new(HostBackend::new("host", 16 * GIB), config)?)));
    vec![Fixture { exclusive: true, ..Fixture::new("host".into(), SegmentMode::Plain, make) }]
}

/// The simulated device keeping its bytes ([`SimBackend::holding_bytes`]): every case that moves bytes runs on
/// it, and a byte written where no page is mapped fails as a kernel's access would.
fn sim(mode: SegmentMode) -> Vec<Fixture> {
    let make: MakePool =
        Box::new(|config| Ok(Arc::new(Pool::new(SimBackend::new("sim", 16 * GIB).holding_bytes(), config)?)));
    vec![Fixture { exclusive: true, ..Fixture::new(format!("sim {mode}"), mode, make) }]
}

/// The simulated device with a segment per block, as wgpu pools have, keeping its bytes.
pub fn sim_segment_per_block() -> Vec<Fixture> {
    let make: MakePool = Box::new(|config| {
        Ok(Arc::new(Pool::new(SimBackend::segment_per_block("sim-wgpu", 16 * GIB).holding_bytes(), config)?))
    });
    let fixture = Fixture::new("sim segment per block".into(), SegmentMode::Auto, make);
    vec![Fixture { exclusive: true, segment_per_block: true, ..fixture }]
}

/// The simulated device in plain segments.
pub fn sim_plain() -> Vec<Fixture> {
    sim(SegmentMode::Plain)
}

/// The simulated device in virtual reservations.
pub fn sim_virtual() -> Vec<Fixture> {
    sim(SegmentMode::Virtual)
}

#[cfg(feature = "cuda")]
pub use self::cuda::*;

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use umm_backends::cuda::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
    use umm_backends::cuda::{self as umm_cuda, CudaDevice, CudaPool};
    use umm_backends::testing::skip_or_fail;
    use umm_backends::PoolKind;

    const SOURCE: &str = r#"
extern "C" __global__ void three_x_minus_mirror(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * 3.0f - x[n - 1 - i];
}
"#;

    struct CudaKernel {
        function: CudaFunction,
        stream: Arc<CudaStream>,
    }

    fn address(pool: &dyn MemoryPool, block: &BlockHandle) -> u64 {
        let pool = pool.as_any().downcast_ref::<CudaPool>().expect("a CUDA pool");
        pool.device_ptr(block).expect("device address of a live block")
    }

    impl Kernel for CudaKernel {
        fn run(&self, x: (&dyn MemoryPool, &BlockHandle), y: (&dyn MemoryPool, &BlockHandle), n: u32) {
            // Host writes are complete for the device before a kernel on another stream reads them.
            x.0.settle().unwrap();
            y.0.settle().unwrap();
            let (xp, yp, count) = (address(x.0, x.1), address(y.0, y.1), n as i32);
            assert!(x.1.requested() >= u64::from(n) * 4 && y.1.requested() >= u64::from(n) * 4);
            let mut builder = self.stream.launch_builder(&self.function);
            builder.arg(&xp).arg(&yp).arg(&count);
            // SAFETY: the kernel is (const float*, float*, int); both blocks are live and hold at least n floats
            // (checked above), and stay allocated until the stream is synchronized below.
            unsafe { builder.launch(LaunchConfig::for_num_elems(n)) }.expect("kernel launches");
            self.stream.synchronize().expect("kernel finishes");
        }
    }

    fn device() -> Option<CudaDevice> {
        let found = umm_cuda::discover();
        let first = found.devices.into_iter().next();
        if first.is_none() {
            skip_or_fail("cuda", &found.skipped.join("; "));
        }
        first
    }

    fn fixture(placement: PoolKind, mode: SegmentMode) -> Vec<Fixture> {
        let Some(dev) = device() else { return Vec::new() };
        if mode == SegmentMode::Virtual && !dev.supports_virtual_memory() {
            // `UMM_REQUIRE_BACKENDS=cuda-vmm` makes a device without it a failure.
            skip_or_fail("cuda-vmm", "no virtual memory management on this device");
            return Vec::new();
        }
        let ctx = dev.context().clone();
        let (s1, s2) = (ctx.new_stream().expect("stream"), ctx.new_stream().expect("stream"));
        let maker = |dev: CudaDevice, placement: PoolKind| -> MakePool {
            Box::new(move |config| Ok(dev.caching_pool(placement, config)? as Arc<dyn MemoryPool>))
        };
        let kernel_ctx = ctx.clone();
        let kernel = move || -> Option<Box<dyn Kernel>> {
            if !umm_cuda::nvrtc_available() {
                skip_or_fail("cuda", "NVRTC (libnvrtc) is not available to compile the test kernel");
                return None;
            }
            let ptx = umm_cuda::cudarc::nvrtc::compile_ptx(SOURCE).expect("NVRTC compiles the test kernel");
            let module = kernel_ctx.load_module(ptx).expect("module loads");
            let function = module.load_function("three_x_minus_mirror").expect("kernel function");
            Some(Box::new(CudaKernel { function, stream: kernel_ctx.new_stream().expect("stream") }))
        };
        let label = format!("{} {placement} {mode}", dev.info().name);
        vec![Fixture {
            device_local: Some(maker(dev.clone(), PoolKind::DeviceLocal)),
            host_writes: placement != PoolKind::ReadOnly,
            read_only: placement == PoolKind::ReadOnly,
            streams: [umm_cuda::stream_id(&s1), umm_cuda::stream_id(&s2)],
            kernel: Some(Box::new(kernel)),
            _keep: Box::new((s1, s2)),
            ..Fixture::new(label, mode, maker(dev, placement))
        }]
    }

    /// CUDA device memory in plain segments (one cuMemAlloc each).
    pub fn cuda_device_local_plain() -> Vec<Fixture> {
        fixture(PoolKind::DeviceLocal, SegmentMode::Plain)
    }

    /// CUDA device memory in virtual reservations mapped page by page.
    pub fn cuda_device_local_virtual() -> Vec<Fixture> {
        fixture(PoolKind::DeviceLocal, SegmentMode::Virtual)
    }

    /// CUDA pinned host memory.
    pub fn cuda_pinned() -> Vec<Fixture> {
        fixture(PoolKind::HostPinned, SegmentMode::Plain)
    }

    /// CUDA read-only memory: filled once at allocation, host writes refused.
    pub fn cuda_read_only() -> Vec<Fixture> {
        fixture(PoolKind::ReadOnly, SegmentMode::Plain)
    }
}

#[cfg(feature = "opencl")]
pub use self::opencl::*;

#[cfg(feature = "opencl")]
mod opencl {
    use super::*;
    use opencl3::kernel::{ExecuteKernel, Kernel as ClKernel};
    use opencl3::program::Program;
    use opencl3::types::cl_int;
    use umm_backends::opencl::{self as umm_opencl, cl_sub_buffer, OpenClBackend, OpenClDevice};
    use umm_backends::testing::skip_or_fail;
    use umm_backends::PoolKind;

    const SOURCE: &str = r#"
__kernel void three_x_minus_mirror(__global const float* x, __global float* y, int n) {
    int i = get_global_id(0);
    if (i < n) y[i] = x[i] * 3.0f - x[n - 1 - i];
}
"#;

    struct OpenClKernel {
        device: OpenClDevice,
        kernel: ClKernel,
    }

    fn pool_of(pool: &dyn MemoryPool) -> &Pool<OpenClBackend> {
        pool.as_any().downcast_ref::<Pool<OpenClBackend>>().expect("an OpenCL pool")
    }

    impl Kernel for OpenClKernel {
        fn run(&self, x: (&dyn MemoryPool, &BlockHandle), y: (&dyn MemoryPool, &BlockHandle), n: u32) {
            let sx = cl_sub_buffer(pool_of(x.0), x.1).expect("sub-buffer of x");
            let sy = cl_sub_buffer(pool_of(y.0), y.1).expect("sub-buffer of y");
            assert!(sx.size() >= u64::from(n) * 4 && sy.size() >= u64::from(n) * 4);
            let (mx, my, count) = (sx.as_raw(), sy.as_raw(), n as cl_int);
            // SAFETY: the arguments match the kernel's signature: two live sub-buffers of at least n floats
            // (checked above), then an int; the kernel stays inside them, and the event is waited for below.
            let event = unsafe {
                ExecuteKernel::new(&self.kernel)
                    .set_arg(&mx)
                    .set_arg(&my)
                    .set_arg(&count)
                    .set_global_work_size(n as usize)
                    .enqueue_nd_range(self.device.queue())
                    .expect("kernel enqueued")
            };
            event.wait().expect("kernel finishes");
        }
    }

    fn fixtures(placement: PoolKind) -> Vec<Fixture> {
        let found = umm_opencl::discover();
        if found.devices.is_empty() {
            skip_or_fail("opencl", &format!("no OpenCL device: {}", found.skipped.join("; ")));
        }
        found
            .devices
            .into_iter()
            .map(|dev| {
                let maker = |dev: OpenClDevice, placement: PoolKind| -> MakePool {
                    Box::new(move |config| Ok(Arc::new(dev.pool(placement, config)?) as Arc<dyn MemoryPool>))
                };
                let kernel_dev = dev.clone();
                let kernel = move || -> Option<Box<dyn Kernel>> {
                    let program = Program::create_and_build_from_source(kernel_dev.context(), SOURCE, "")
                        .expect("the test kernel builds");
                    let kernel = ClKernel::create(&program, "three_x_minus_mirror").expect("kernel");
                    Some(Box::new(OpenClKernel { device: kernel_dev.clone(), kernel }))
                };
                let label = format!("{} {placement}", dev.info().name);
                Fixture {
                    device_local: Some(maker(dev.clone(), PoolKind::DeviceLocal)),
                    read_only: placement == PoolKind::ReadOnly,
                    kernel: Some(Box::new(kernel)),
                    ..Fixture::new(label, SegmentMode::Auto, maker(dev, placement))
                }
            })
            .collect()
    }

    /// OpenCL device memory (READ_WRITE buffers).
    pub fn opencl_device_local() -> Vec<Fixture> {
        fixtures(PoolKind::DeviceLocal)
    }

    /// OpenCL host-reachable memory (ALLOC_HOST_PTR; mapped on devices that share host memory).
    pub fn opencl_pinned() -> Vec<Fixture> {
        fixtures(PoolKind::HostPinned)
    }

    /// OpenCL READ_ONLY buffers (kernels only read them; the host writes them).
    pub fn opencl_read_only() -> Vec<Fixture> {
        fixtures(PoolKind::ReadOnly)
    }
}

#[cfg(feature = "wgpu")]
pub use self::wgpu_fixtures::*;

#[cfg(feature = "wgpu")]
mod wgpu_fixtures {
    use super::*;
    use umm_backends::testing::skip_or_fail;
    use umm_backends::wgpu_backend::{self, WgpuBackend, WgpuDevice, WgpuUsage};
    use umm_backends::PoolKind;

    const SOURCE: &str = r#"
// x and y may lie in one pooled buffer: WebGPU forbids read and read-write use of one buffer in a dispatch, so
// both are bound read_write.
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let n = arrayLength(&y);
    let i = id.x;
    if (i >= n) {
        return;
    }
    y[i] = x[i] * 3.0 - x[n - 1u - i];
}
"#;

    struct WgpuKernel {
        device: wgpu::Device,
        queue: wgpu::Queue,
        pipeline: wgpu::ComputePipeline,
    }

    fn pool_of(pool: &dyn MemoryPool) -> &Pool<WgpuBackend> {
        pool.as_any().downcast_ref::<Pool<WgpuBackend>>().expect("a wgpu pool")
    }

    impl Kernel for WgpuKernel {
        fn run(&self, x: (&dyn MemoryPool, &BlockHandle), y: (&dyn MemoryPool, &BlockHandle), n: u32) {
            let bx = wgpu_backend::binding(pool_of(x.0), x.1).expect("binding of x");
            let by = wgpu_backend::binding(pool_of(y.0), y.1).expect("binding of y");
            assert_eq!((bx.size, by.size), (u64::from(n) * 4, u64::from(n) * 4), "bindings of n floats");
            let layout = self.pipeline.get_bind_group_layout(0);
            let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &layout,
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: wgpu::BindingResource::Buffer(bx.as_buffer_binding()),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: wgpu::BindingResource::Buffer(by.as_buffer_binding()),
                    },
                ],
            });
            let mut encoder = self.device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_pipeline(&self.pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups(n.div_ceil(64), 1, 1);
            }
            self.queue.submit([encoder.finish()]);
            self.device.poll(wgpu::PollType::wait_indefinitely()).expect("kernel finishes");
        }
    }

    fn devices() -> Vec<WgpuDevice> {
        let discovery = wgpu_backend::discover();
        let mut devices = discovery.devices;
        devices.sort_by_key(|d| d.adapter_info().backend != wgpu::Backend::Vulkan);
        if devices.is_empty() {
            skip_or_fail("wgpu", &format!("no wgpu adapter: {}", discovery.skipped.join("; ")));
        }
        devices
    }

    fn fixtures(kind: impl Fn(&WgpuDevice) -> WgpuUsage) -> Vec<Fixture> {
        devices()
            .into_iter()
            .map(|dev| {
                let dev = Arc::new(dev);
                let kind = kind(&dev);
                let maker = |dev: Arc<WgpuDevice>, kind: WgpuUsage| -> MakePool {
                    Box::new(move |config| Ok(Arc::new(dev.pool_of(kind, config)?) as Arc<dyn MemoryPool>))
                };
                // Shaders bind storage buffers: device-local, read-only and shared (mappable and bindable) ones.
                let bindable = kind.usages().contains(wgpu::BufferUsages::STORAGE);
                let kernel_dev = Arc::clone(&dev);
                let kernel = move || -> Option<Box<dyn Kernel>> {
                    let (device, queue) = kernel_dev.device_and_queue().expect("device");
                    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                        label: Some("three_x_minus_mirror"),
                        source: wgpu::ShaderSource::Wgsl(SOURCE.into()),
                    });
                    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                        label: Some("three_x_minus_mirror"),
                        layout: None,
                        module: &module,
                        entry_point: Some("main"),
                        compilation_options: Default::default(),
                        cache: None,
                    });
                    Some(Box::new(WgpuKernel { device, queue, pipeline }))
                };
                let label = format!("{} ({:?}) {kind}", dev.info().name, dev.adapter_info().backend);
                Fixture {
                    device_local: Some(maker(Arc::clone(&dev), WgpuUsage::DeviceLocal)),
                    read_only: kind == WgpuUsage::ReadOnly,
                    segment_per_block: true,
                    kernel: bindable.then(|| Box::new(kernel) as MakeKernel),
                    ..Fixture::new(label, SegmentMode::Auto, maker(dev, kind))
                }
            })
            .collect()
    }

    /// wgpu storage buffers.
    pub fn wgpu_device_local() -> Vec<Fixture> {
        fixtures(|_| WgpuUsage::DeviceLocal)
    }

    /// wgpu host-pinned memory: shared buffers where the adapter maps and binds them, upload buffers elsewhere.
    pub fn wgpu_pinned() -> Vec<Fixture> {
        fixtures(|dev| dev.usage_for(PoolKind::HostPinned))
    }

    /// wgpu read-only storage (and uniform) buffers.
    pub fn wgpu_read_only() -> Vec<Fixture> {
        fixtures(|_| WgpuUsage::ReadOnly)
    }

    /// wgpu upload buffers (MAP_WRITE | COPY_SRC).
    pub fn wgpu_upload() -> Vec<Fixture> {
        fixtures(|_| WgpuUsage::Upload)
    }

    /// wgpu read-back buffers (MAP_READ | COPY_DST).
    pub fn wgpu_readback() -> Vec<Fixture> {
        fixtures(|_| WgpuUsage::Readback)
    }
}
