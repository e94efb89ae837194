//! Kernels on universal buffers (wgpu, OpenCL, CUDA views) and adopted buffers, through the public API. wgpu
//! and OpenCL run on any machine with a driver (lavapipe, PoCL); CUDA tests skip without one. Each backend's
//! tests skip with a printed reason when it is absent, unless `UMM_REQUIRE_BACKENDS` names it.
// Built without any accelerator backend the file has no test, and its helpers go unused.
#![cfg_attr(not(any(feature = "cuda", feature = "opencl", feature = "wgpu")), allow(dead_code, unused_imports))]

mod kernel_support;

use kernel_support::manager_with;
use umm::backends::testing::skip_or_fail;
use umm::{
    AdoptOptions, Adoptable, AllocOptions, Api, DeviceSelector, Error, Ownership, Placement, UniversalMemoryManager,
};

const N: usize = 1000;
const A: f32 = 2.5;

fn xs() -> Vec<f32> {
    (0..N).map(|i| i as f32 * 0.5 - 7.0).collect()
}

fn ys() -> Vec<f32> {
    (0..N).map(|i| (i as f32).sin()).collect()
}

fn expected(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter().zip(y).map(|(x, y)| A * x + y).collect()
}

/// Bytes of the part of a buffer the range-view tests run a kernel on.
const RANGE_BYTES: u64 = 160;

/// `RANGE_BYTES` from byte `align` on (a device's binding alignment): where a kernel on part of a buffer runs.
fn range_at(align: u64) -> std::ops::Range<u64> {
    assert!(align + RANGE_BYTES <= (N * 4) as u64, "N = {N} holds the range at offset {align}");
    align..align + RANGE_BYTES
}

/// Checks that saxpy over the bytes `range` of `x` and `y` changed those elements of `y` and no other.
fn assert_only_range_changed(y: &umm::UniversalBuffer<f32>, range: &std::ops::Range<u64>) {
    let (first, end) = (range.start as usize / 4, range.end as usize / 4);
    let (mut want, full) = (ys(), expected(&xs(), &ys()));
    want[first..end].copy_from_slice(&full[first..end]);
    assert_eq!(y.to_vec().unwrap(), want, "only elements {first}..{end} change");
}

fn host_only() -> UniversalMemoryManager {
    UniversalMemoryManager::builder().backends(false, false, false).build().unwrap()
}

fn on(api: Api) -> AllocOptions {
    AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Api(api))
}

fn device_of(mm: &UniversalMemoryManager, api: Api) -> &umm::Device {
    mm.devices().iter().find(|d| d.apis().contains(&api)).unwrap()
}

#[test]
#[cfg(all(feature = "wgpu", feature = "opencl"))]
fn views_of_another_api_or_of_empty_buffers_are_refused_by_name() {
    let mm = host_only();
    let mut host = mm.allocate_universal_with::<f32>(16, AllocOptions::new().label("h")).unwrap();
    assert_eq!(host.api(), Some(Api::Host));
    match host.wgpu_binding() {
        Err(Error::WrongApi { op, wanted: Api::Wgpu, found: Api::Host, label }) => {
            assert_eq!((op, label.as_deref()), ("wgpu_binding", Some("h")));
        }
        other => panic!("expected WrongApi, got {other:?}"),
    }
    assert!(matches!(host.wgpu_binding_mut(), Err(Error::WrongApi { wanted: Api::Wgpu, found: Api::Host, .. })));
    assert!(matches!(host.opencl_buffer(), Err(Error::WrongApi { wanted: Api::OpenCl, found: Api::Host, .. })));
    assert!(matches!(host.opencl_buffer_mut(), Err(Error::WrongApi { wanted: Api::OpenCl, .. })));
    let empty = mm.allocate_universal::<f32>(0, Placement::Auto).unwrap();
    assert_eq!(empty.api(), None);
    assert!(matches!(empty.wgpu_binding(), Err(Error::EmptyBuffer { op: "wgpu_binding", .. })));
    assert!(matches!(empty.opencl_buffer(), Err(Error::EmptyBuffer { op: "opencl_buffer", .. })));
    let msg = host.opencl_buffer().unwrap_err().to_string();
    assert!(msg.contains("opencl") && msg.contains("host"), "{msg}");
}

#[test]
fn a_host_vector_adopted_is_read_written_counted_snapshotted_reported_and_migrated() {
    let mm = host_only();
    let before = mm.global_memory_stats().total.allocated_bytes.current;
    let mut buf = mm.adopt(xs(), AdoptOptions::new().label("adopted-vec")).unwrap();
    assert_eq!((buf.len(), buf.api(), buf.label()), (N, Some(Api::Host), Some("adopted-vec")));
    assert_eq!(buf.decision().reason(), "Adopted host memory (owned): it stays where it was made.");
    assert_eq!(buf.to_vec().unwrap(), xs());
    assert_eq!(buf.as_slice().unwrap(), &xs()[..]);
    buf.write_at(3, &[42.0]).unwrap();
    buf.as_mut_slice().unwrap()[4] = 43.0;
    let mut x = xs();
    (x[3], x[4]) = (42.0, 43.0);
    assert_eq!(buf.to_vec().unwrap(), x);
    let bytes = (N * 4) as u64;
    assert_eq!(mm.global_memory_stats().total.allocated_bytes.current, before + bytes);
    let snapshot = mm.snapshot();
    let block = snapshot
        .pools
        .iter()
        .flat_map(|p| &p.segments)
        .flat_map(|s| &s.blocks)
        .find(|b| b.label.as_deref() == Some("adopted-vec"));
    assert_eq!(block.map(|b| (b.requested, b.free)), Some((Some(bytes), false)), "{}", snapshot.to_json());
    let leaks = mm.leak_report();
    assert!(leaks.allocations.iter().any(|a| a.label.as_deref() == Some("adopted-vec") && a.bytes == bytes));
    let pools = mm.devices()[0].pools().len();
    let moved = buf.migrate(&mm, DeviceSelector::Host).unwrap();
    assert_eq!(moved.to_vec().unwrap(), x);
    assert_eq!(mm.devices()[0].pools().len(), pools, "the adopted pool went with its buffer; the host pool came");
    assert!(mm.devices()[0].pools().iter().all(|(_, _, p)| !p.name().contains("adopted")));
    let host_block = moved.block_info().unwrap().size;
    assert_eq!(mm.global_memory_stats().total.allocated_bytes.current, before + host_block);
    assert!(!mm.leak_report().allocations.iter().any(|a| a.bytes == bytes && a.label.is_none()));
}

#[test]
fn static_host_memory_is_adopted_borrowed_and_empty_memory_gives_an_empty_buffer() {
    let mm = host_only();
    let data: &'static mut [u32] = Box::leak(vec![7u32; 64].into_boxed_slice());
    let source = Adoptable::host_static(data);
    assert_eq!(source.ownership(), Ownership::Borrowed);
    let mut buf = mm.adopt(source, AdoptOptions::new()).unwrap();
    buf.fill(9).unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![9u32; 64]);
    assert_eq!(Adoptable::vec(vec![1u8]).ownership(), Ownership::Owned);
    // Zero-length buffers are valid elsewhere (an allocation of 0 elements): so is adopting none.
    let empty = mm.adopt(Vec::<f32>::new(), AdoptOptions::new()).unwrap();
    assert_eq!((empty.len(), empty.to_vec().unwrap()), (0, Vec::new()));
}

// ---------------------------------------------------------------------------------------------------------- wgpu

#[cfg(feature = "wgpu")]
mod wgpu_kernels {
    use super::*;
    use umm::backends::wgpu_backend::wgpu;

    pub(crate) const SAXPY: &str = r#"
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> a: vec4<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i < arrayLength(&y)) {
        y[i] = a.x * x[i] + y[i];
    }
}
"#;

    /// y = A*x + y with `x` and `y` bound at their blocks' offsets.
    pub(crate) fn saxpy(x: &umm::UniversalBuffer<f32>, y: &mut umm::UniversalBuffer<f32>) {
        saxpy_over(x, y, None)
    }

    /// y = A*x + y over the bytes `range` of both buffers (all of them for `None`), bound as range views.
    fn saxpy_over(
        x: &umm::UniversalBuffer<f32>,
        y: &mut umm::UniversalBuffer<f32>,
        range: Option<std::ops::Range<u64>>,
    ) {
        let whole = x.wgpu_binding().unwrap();
        let xv = match &range {
            Some(r) => whole.slice(r.clone()).unwrap(),
            None => x.wgpu_binding().unwrap(),
        };
        let (device, queue) = (xv.device().clone(), xv.queue().clone());
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("saxpy"),
            source: wgpu::ShaderSource::Wgsl(SAXPY.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("saxpy"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let a = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("a"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        queue.write_buffer(&a, 0, &[A.to_le_bytes(), [0; 4], [0; 4], [0; 4]].concat());
        let n = (xv.size() / 4) as u32;
        let whole_y = y.wgpu_binding_mut().unwrap();
        let yv = match &range {
            Some(r) => whole_y.slice(r.clone()).unwrap(),
            None => whole_y.slice(0..whole_y.size()).unwrap(),
        };
        let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: xv.binding_resource() },
                wgpu::BindGroupEntry { binding: 1, resource: yv.binding_resource() },
                wgpu::BindGroupEntry { binding: 2, resource: a.as_entire_binding() },
            ],
        });
        let mut encoder = device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(n.div_ceil(64), 1, 1);
        }
        queue.submit([encoder.finish()]);
        device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    }

    #[test]
    fn saxpy_on_pooled_buffers_each_a_wgpu_buffer_of_its_own_matches_the_cpu() {
        let Some(mm) = manager_with(Api::Wgpu) else { return };
        // Small neighbours first: pools that shared buffers between blocks would put x and y beside them.
        let pads: Vec<_> = (0..3).map(|_| mm.allocate_universal_with::<f32>(5, on(Api::Wgpu)).unwrap()).collect();
        let mut x = mm.allocate_universal_with::<f32>(N, on(Api::Wgpu)).unwrap();
        let mut y = mm.allocate_universal_with::<f32>(N, on(Api::Wgpu)).unwrap();
        x.write(&xs()).unwrap();
        y.write(&ys()).unwrap();
        let views: Vec<_> = pads.iter().chain([&x, &y]).map(|b| b.wgpu_binding().unwrap()).collect();
        assert!(views.iter().all(|v| v.offset() == 0), "every buffer bound at offset 0");
        for (i, a) in views.iter().enumerate() {
            assert!(views[i + 1..].iter().all(|b| a.buffer() != b.buffer()), "buffer {i} shares its wgpu::Buffer");
        }
        drop(views);
        assert_eq!(x.wgpu_binding().unwrap().size(), (N * 4) as u64);
        saxpy(&x, &mut y);
        assert_eq!(y.to_vec().unwrap(), expected(&xs(), &ys()));
        drop(pads);
    }

    #[test]
    fn a_range_view_binds_part_of_a_buffer_and_misaligned_ranges_are_refused() {
        let Some(mm) = manager_with(Api::Wgpu) else { return };
        let mut x = mm.allocate_universal_with::<f32>(N, on(Api::Wgpu)).unwrap();
        let mut y = mm.allocate_universal_with::<f32>(N, on(Api::Wgpu)).unwrap();
        x.write(&xs()).unwrap();
        y.write(&ys()).unwrap();
        let align = u64::from(x.wgpu_binding().unwrap().device().limits().min_storage_buffer_offset_alignment);
        let range = range_at(align);
        saxpy_over(&x, &mut y, Some(range.clone()));
        assert_only_range_changed(&y, &range);
        let view = x.wgpu_binding().unwrap();
        let sub = view.slice(range).unwrap();
        assert_eq!((sub.offset(), sub.size()), (align, RANGE_BYTES));
        // Past the view: out of bounds. Inside it but misaligned: unsupported, as OpenCL's misaligned origins.
        for (bad, why) in [(0..view.size() + 4, "inside it"), (8..8, "inside it")] {
            let err = view.slice(bad.clone()).unwrap_err();
            assert!(err.is_out_of_bounds() && err.to_string().contains(why), "{bad:?}: {err}");
        }
        let misaligned = (align > 4).then_some((align + 4..align + 8, "multiple of"));
        for (bad, why) in [(0..6, "multiple of 4")].into_iter().chain(misaligned) {
            let err = view.slice(bad.clone()).unwrap_err();
            assert!(err.is_unsupported() && err.to_string().contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn read_only_buffers_refuse_writable_bindings() {
        let Some(mm) = manager_with(Api::Wgpu) else { return };
        let options = AllocOptions::new().placement(Placement::ReadOnly).device(DeviceSelector::Api(Api::Wgpu));
        let mut ro = mm.allocate_universal_from_with(&xs(), options.label("weights")).unwrap();
        assert!(ro.wgpu_binding().is_ok());
        assert!(matches!(ro.wgpu_binding_mut(), Err(Error::ReadOnly { label: Some(ref l) }) if l == "weights"));
    }

    fn storage_buffer(mm: &UniversalMemoryManager, bytes: u64) -> wgpu::Buffer {
        let (device, _) = device_of(mm, Api::Wgpu).wgpu().unwrap().device_and_queue().unwrap();
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("user buffer"),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    #[test]
    fn adopted_wgpu_buffers_run_kernels_migrate_and_are_released_only_when_owned() {
        let Some(mm) = manager_with(Api::Wgpu) else { return };
        let bytes = (N * 4) as u64;
        let user_x = storage_buffer(&mm, bytes);
        let mut x =
            mm.adopt(Adoptable::wgpu(user_x.clone(), Ownership::Borrowed), AdoptOptions::new().label("x")).unwrap();
        let user_y = storage_buffer(&mm, bytes);
        let mut y =
            mm.adopt(Adoptable::wgpu(user_y.clone(), Ownership::Owned), AdoptOptions::new().label("y")).unwrap();
        assert_eq!((x.len(), y.api()), (N, Some(Api::Wgpu)));
        x.write(&xs()).unwrap();
        y.write(&ys()).unwrap();
        assert_eq!(x.wgpu_binding().unwrap().offset(), 0);
        let device = device_of(&mm, Api::Wgpu);
        assert_eq!(device.pools().iter().filter(|(_, _, p)| p.name().contains("adopted")).count(), 2);
        let stats = mm.global_memory_stats();
        let adopted: u64 = stats.devices[device.index()]
            .pools
            .iter()
            .filter(|p| p.stats.name.contains("adopted"))
            .map(|p| p.stats.allocated_bytes.current)
            .sum();
        assert_eq!(adopted, 2 * bytes);
        saxpy(&x, &mut y);
        let want = expected(&xs(), &ys());
        assert_eq!(y.to_vec().unwrap(), want);
        // A device copy into a pooled buffer, and the owned buffer destroyed with its adopter.
        let moved =
            y.migrate(&mm, umm::MigrateTo::new(Placement::DeviceLocal).device(DeviceSelector::Api(Api::Wgpu))).unwrap();
        assert_eq!(moved.to_vec().unwrap(), want);
        let again = mm.adopt(Adoptable::<f32>::wgpu(user_y, Ownership::Borrowed), AdoptOptions::new()).unwrap();
        assert!(matches!(again.to_vec(), Err(Error::Backend(umm::backends::Error::Driver { .. }))), "y was destroyed");
        // The borrowed buffer outlives its adopter.
        drop(x);
        let again = mm.adopt(Adoptable::<f32>::wgpu(user_x, Ownership::Borrowed), AdoptOptions::new()).unwrap();
        assert_eq!(again.to_vec().unwrap(), xs());
        assert_eq!(device.pools().iter().filter(|(_, _, p)| p.name().contains("adopted")).count(), 2);
    }

    #[test]
    fn wgpu_adoption_refuses_ragged_sizes_and_devices_of_another_api() {
        let Some(mm) = manager_with(Api::Wgpu) else { return };
        let err = mm.adopt(Adoptable::<[f32; 3]>::wgpu(storage_buffer(&mm, 16), Ownership::Owned), AdoptOptions::new());
        assert!(matches!(err, Err(Error::Backend(umm::backends::Error::InvalidConfig(_)))), "{err:?}");
        let err = mm.adopt(Adoptable::<u8>::wgpu(storage_buffer(&mm, 6), Ownership::Owned), AdoptOptions::new());
        assert!(matches!(err, Err(Error::Backend(umm::backends::Error::Unsupported { .. }))), "{err:?}");
        let host = AdoptOptions::new().device(DeviceSelector::Index(0));
        let err = mm.adopt(Adoptable::<f32>::wgpu(storage_buffer(&mm, 16), Ownership::Owned), host);
        assert!(matches!(err, Err(Error::Adopt { what: "a wgpu buffer", .. })), "{err:?}");
    }
}

// -------------------------------------------------------------------------------------------------------- OpenCL

#[cfg(feature = "opencl")]
mod opencl_kernels {
    use super::*;
    use opencl3::kernel::{ExecuteKernel, Kernel};
    use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_WRITE};
    use opencl3::program::Program;
    use umm::backends::opencl::opencl3;
    use umm::interop::OpenClView;

    const SAXPY: &str = "__kernel void saxpy(float a, __global const float* x, __global float* y, int n) {
        int i = get_global_id(0);
        if (i < n) y[i] = a * x[i] + y[i];
    }";

    pub(crate) fn saxpy(x: &umm::UniversalBuffer<f32>, y: &mut umm::UniversalBuffer<f32>) {
        saxpy_over(x, y, None)
    }

    /// y = A*x + y over the bytes `range` of both buffers (all of them for `None`), as range views.
    fn saxpy_over(
        x: &umm::UniversalBuffer<f32>,
        y: &mut umm::UniversalBuffer<f32>,
        range: Option<std::ops::Range<u64>>,
    ) {
        let whole_x: OpenClView<'_> = x.opencl_buffer().unwrap();
        let xv = match &range {
            Some(r) => whole_x.slice(r.clone()).unwrap(),
            None => x.opencl_buffer().unwrap(),
        };
        let n = (xv.size() / 4) as i32;
        let program = Program::create_and_build_from_source(xv.context(), SAXPY, "").expect("saxpy builds");
        let kernel = Kernel::create(&program, "saxpy").unwrap();
        let whole_y = y.opencl_buffer_mut().unwrap();
        let yv = match &range {
            Some(r) => whole_y.slice(r.clone()).unwrap(),
            None => whole_y.slice(0..whole_y.size()).unwrap(),
        };
        let (xm, ym) = (xv.as_raw(), yv.as_raw());
        // SAFETY: the arguments match the kernel's signature; both sub-buffers hold n floats and live (borrowed
        // from their buffers) until the event below has completed.
        let event = unsafe {
            ExecuteKernel::new(&kernel)
                .set_arg(&A)
                .set_arg(&xm)
                .set_arg(&ym)
                .set_arg(&n)
                .set_global_work_size(n as usize)
                .enqueue_nd_range(yv.queue())
                .unwrap()
        };
        event.wait().unwrap();
    }

    #[test]
    fn saxpy_on_pooled_sub_buffers_matches_the_cpu() {
        let Some(mm) = manager_with(Api::OpenCl) else { return };
        let pad = mm.allocate_universal_with::<f32>(3, on(Api::OpenCl)).unwrap();
        let mut x = mm.allocate_universal_with::<f32>(N, on(Api::OpenCl)).unwrap();
        let mut y = mm.allocate_universal_with::<f32>(N, on(Api::OpenCl)).unwrap();
        x.write(&xs()).unwrap();
        y.write(&ys()).unwrap();
        let align = y.device().opencl().unwrap().info().alignment;
        let view = y.opencl_buffer().unwrap();
        assert!(view.offset() % align == 0 && view.offset() > 0, "origin {} on {align}", view.offset());
        assert_eq!(view.size(), (N * 4) as u64);
        drop(view);
        saxpy(&x, &mut y);
        assert_eq!(y.to_vec().unwrap(), expected(&xs(), &ys()));
        assert!(matches!(x.wgpu_binding(), Err(Error::WrongApi { wanted: Api::Wgpu, found: Api::OpenCl, .. })));
        drop(pad);
    }

    #[test]
    fn a_range_view_is_a_sub_buffer_of_part_of_a_buffer_and_misaligned_origins_are_refused() {
        let Some(mm) = manager_with(Api::OpenCl) else { return };
        let mut x = mm.allocate_universal_with::<f32>(N, on(Api::OpenCl)).unwrap();
        let mut y = mm.allocate_universal_with::<f32>(N, on(Api::OpenCl)).unwrap();
        x.write(&xs()).unwrap();
        y.write(&ys()).unwrap();
        // The alignment of the device the buffers are on: a machine may have several OpenCL devices (the GPU
        // machine has NVIDIA's, 512 bytes, and a CPU's, 128).
        let align = x.device().opencl().unwrap().info().alignment;
        assert_eq!(y.device().opencl().unwrap().info().alignment, align);
        let range = range_at(align);
        saxpy_over(&x, &mut y, Some(range.clone()));
        assert_only_range_changed(&y, &range);
        let view = x.opencl_buffer().unwrap();
        let sub = view.slice(range).unwrap();
        assert_eq!((sub.offset(), sub.size()), (view.offset() + align, RANGE_BYTES));
        for (bad, why) in [(0..view.size() + 4, "of an OpenCL view"), (8..8, "not a non-empty range")] {
            let err = view.slice(bad.clone()).unwrap_err();
            assert!(err.is_out_of_bounds() && err.to_string().contains(why), "{bad:?}: {err}");
        }
        if align > 4 {
            let err = view.slice(4..8).unwrap_err();
            assert!(err.is_unsupported() && err.to_string().contains("CL_DEVICE_MEM_BASE_ADDR_ALIGN"), "{err}");
        }
    }

    fn user_buffer(mm: &UniversalMemoryManager, n: usize) -> Buffer<f32> {
        let cl = device_of(mm, Api::OpenCl).opencl().unwrap();
        // SAFETY: no host pointer is passed (null with flags that read none).
        unsafe { Buffer::<f32>::create(cl.context(), CL_MEM_READ_WRITE, n, std::ptr::null_mut()).unwrap() }
    }

    #[test]
    fn adopted_opencl_buffers_run_kernels_migrate_and_keep_borrowed_references() {
        let Some(mm) = manager_with(Api::OpenCl) else { return };
        let user_x = user_buffer(&mm, N);
        assert_eq!(user_x.reference_count().unwrap(), 1);
        let mut x = mm.adopt(Adoptable::opencl_borrowed(&user_x), AdoptOptions::new().label("x")).unwrap();
        assert_eq!(user_x.reference_count().unwrap(), 2, "umm holds a reference of its own");
        let mut y = mm.adopt(Adoptable::opencl(user_buffer(&mm, N)), AdoptOptions::new().label("y")).unwrap();
        x.write(&xs()).unwrap();
        y.write(&ys()).unwrap();
        saxpy(&x, &mut y);
        let want = expected(&xs(), &ys());
        assert_eq!(y.to_vec().unwrap(), want);
        assert!(mm.leak_report().allocations.iter().any(|a| a.label.as_deref() == Some("y")));
        let moved = y.migrate(&mm, DeviceSelector::Host).unwrap();
        assert_eq!(moved.to_vec().unwrap(), want);
        drop(x);
        assert_eq!(user_x.reference_count().unwrap(), 1, "only umm's reference went");
        let host = AdoptOptions::new().device(DeviceSelector::Index(0));
        let err = mm.adopt(Adoptable::opencl_borrowed(&user_x), host).unwrap_err();
        assert!(matches!(err, Error::Adopt { what: "an OpenCL buffer", .. }), "{err}");
    }
}

// ---------------------------------------------------------------------------------------------------------- CUDA

#[cfg(feature = "cuda")]
mod cuda_kernels {
    use super::*;
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    use umm::backends::cuda::{self, cudarc};

    const SAXPY: &str = r#"
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

    #[test]
    fn saxpy_on_pooled_and_adopted_cuda_buffers_matches_the_cpu() {
        let Some(mm) = manager_with(Api::Cuda) else { return };
        if !cuda::nvrtc_available() {
            return skip_or_fail("cuda", "NVRTC (libnvrtc) is not available to compile the kernel");
        }
        let device = device_of(&mm, Api::Cuda).cuda().unwrap();
        let ctx = device.context().clone();
        let stream = ctx.default_stream();
        let ptx = cudarc::nvrtc::compile_ptx(SAXPY).expect("NVRTC compiles saxpy");
        let f = ctx.load_module(ptx).unwrap().load_function("saxpy").unwrap();
        let mut x = mm.allocate_universal_with::<f32>(N, on(Api::Cuda)).unwrap();
        x.write(&xs()).unwrap();
        // y is a cudarc slice taken over by umm.
        let y_slice = stream.clone_htod(&ys()).unwrap();
        let mut y = mm.adopt(Adoptable::cuda(y_slice), AdoptOptions::new().label("y")).unwrap();
        assert_eq!((y.api(), y.len()), (Some(Api::Cuda), N));
        #[cfg(feature = "wgpu")]
        assert!(matches!(x.wgpu_binding(), Err(Error::WrongApi { wanted: Api::Wgpu, found: Api::Cuda, .. })));
        let n = N as i32;
        {
            let xv = x.cuda_view(&stream).unwrap();
            let yv = y.cuda_view_mut(&stream).unwrap();
            let (xp, yp) = (xv.device_address(), yv.device_address());
            let mut builder = stream.launch_builder(&f);
            builder.arg(&A).arg(&xp).arg(&yp).arg(&n);
            // SAFETY: the signature is (float, const float*, float*, int); both views hold n floats and live
            // until the stream is synchronized below.
            unsafe { builder.launch(LaunchConfig::for_num_elems(N as u32)) }.unwrap();
            stream.synchronize().unwrap();
        }
        assert_eq!(y.to_vec().unwrap(), expected(&xs(), &ys()));
        // Host memory proper (Auto may pick CUDA's pinned host pool here, whose buffers are CUDA's).
        let host = mm.allocate_universal_with::<f32>(4, AllocOptions::new().device(DeviceSelector::Host)).unwrap();
        assert!(matches!(host.cuda_view(&stream), Err(Error::WrongApi { wanted: Api::Cuda, found: Api::Host, .. })));
        let moved = y.migrate(&mm, DeviceSelector::Host).unwrap();
        assert_eq!(moved.to_vec().unwrap(), expected(&xs(), &ys()));
    }
}

/// Device uses the usage tracker holds for medium buffers of unknown access.
fn medium_device_uses(mm: &UniversalMemoryManager) -> u64 {
    mm.usage_tracker().evidence(umm::SizeClass::Medium, umm::AccessPattern::Unknown).device_uses
}

#[test]
#[cfg(all(feature = "wgpu", feature = "opencl"))]
fn every_kernel_view_records_a_device_use_and_a_refused_one_none() {
    for api in [Api::Wgpu, Api::OpenCl] {
        let Some(mm) = manager_with(api) else { continue };
        let mut buf = mm.allocate_universal_with::<f32>(1 << 16, on(api)).unwrap();
        let before = medium_device_uses(&mm);
        match api {
            Api::Wgpu => {
                drop(buf.wgpu_binding().unwrap());
                drop(buf.wgpu_binding_mut().unwrap());
                // A uniform binding holds at most 64 KiB: a small buffer's use is counted among small ones.
                let uniform = mm.allocate_universal_with::<f32>(256, on(api)).unwrap();
                let small = |mm: &UniversalMemoryManager| {
                    mm.usage_tracker().evidence(umm::SizeClass::Small, umm::AccessPattern::Unknown).device_uses
                };
                let small_before = small(&mm);
                drop(uniform.wgpu_uniform_binding().unwrap());
                assert_eq!(small(&mm), small_before + 1);
            }
            _ => {
                drop(buf.opencl_buffer().unwrap());
                drop(buf.opencl_buffer_mut().unwrap());
            }
        }
        let views = 2;
        assert_eq!(medium_device_uses(&mm), before + views, "{api}");
        // A view of the wrong API records nothing.
        let refused = if api == Api::Wgpu { buf.opencl_buffer_mut().is_err() } else { buf.wgpu_binding_mut().is_err() };
        assert!(refused);
        assert_eq!(medium_device_uses(&mm), before + views, "{api}: a refused view is no use");
    }
}
