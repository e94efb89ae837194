//! The kernels a user writes first, over buffers from `allocate_universal`, on every backend present, each
//! checked against the CPU: one input read and one output written, several read-only inputs (one of them a
//! read-only buffer), an update in place, a uniform (OpenCL: `__constant`) beside storage, the same buffer read
//! through two arguments, copies between buffers in the command stream of a kernel, and on wgpu indirect dispatch
//! and a draw whose vertex, index and uniform buffers are umm's.
//!
//! Small buffers are allocated first, so that every buffer of a case sits in a pool that already holds others:
//! where a pool shares one device allocation between blocks (OpenCL sub-buffers, CUDA addresses), the inputs and
//! outputs of a kernel are ranges of one allocation. wgpu gives every block a `wgpu::Buffer` of its own, since
//! wgpu refuses one buffer used read-only and read-write in one dispatch.
//!
//! wgpu errors of the caller's own work are the caller's: umm installs no uncaptured-error handler, so an invalid
//! submission panics as wgpu's default does, or lands in the caller's error scope.
//!
//! wgpu and OpenCL run on lavapipe and PoCL in CI; CUDA skips without a driver. `UMM_REQUIRE_BACKENDS` turns a
//! skip into a failure.
// Built without any accelerator backend the file has no test, and its helpers go unused.
#![cfg_attr(not(any(feature = "cuda", feature = "opencl", feature = "wgpu")), allow(dead_code, unused_imports))]

mod kernel_support;

use kernel_support::manager_with;
use umm::backends::testing::skip_or_fail;
use umm::{AllocOptions, Api, DeviceSelector, Placement, UniversalBuffer, UniversalMemoryManager};

/// Elements per buffer: odd, so no workgroup or alignment divides it.
const N: usize = 4099;

fn xs() -> Vec<f32> {
    (0..N).map(|i| i as f32 * 0.25 - 100.0).collect()
}

fn ys() -> Vec<f32> {
    (0..N).map(|i| ((i * 7) % 13) as f32 - 6.0).collect()
}

fn zs() -> Vec<f32> {
    (0..N).map(|i| 1.0 / (i as f32 + 1.0)).collect()
}

/// The indexes of `api`'s devices (a machine may have several: PoCL beside NVIDIA's OpenCL, say). Every case runs
/// on each, its buffers all placed on that one device by index, and its kernels built on the buffers' own device.
/// Runs `case` on every device of `api`, each time with a manager of its own, or skips (with a notice) when there
/// is none.
fn on_each_device(api: Api, case: impl Fn(&UniversalMemoryManager, usize)) {
    let Some(mm) = manager_with(api) else { return };
    for device in devices_of(&mm, api) {
        eprintln!("on {}", mm.devices()[device].name());
        let mm = manager_with(api).expect("the device is still there");
        case(&mm, device);
    }
}

fn devices_of(mm: &UniversalMemoryManager, api: Api) -> Vec<usize> {
    mm.devices().iter().filter(|d| d.has_api(api)).map(|d| d.index()).collect()
}

fn device_local(device: usize) -> AllocOptions {
    AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Index(device))
}

fn read_only(device: usize) -> AllocOptions {
    AllocOptions::new().placement(Placement::ReadOnly).device(DeviceSelector::Index(device))
}

/// A device-local buffer on `device` holding `data`.
fn filled(mm: &UniversalMemoryManager, device: usize, data: &[f32]) -> UniversalBuffer<f32> {
    let mut buffer = mm.allocate_universal_with::<f32>(data.len(), device_local(device)).unwrap();
    assert_eq!(buffer.device().index(), device, "placed on the device asked for");
    buffer.write(data).unwrap();
    buffer
}

/// Small buffers that stay live through a case, so that the case's buffers are not the first in their pools.
fn neighbours(mm: &UniversalMemoryManager, device: usize) -> Vec<UniversalBuffer<f32>> {
    (1..4).map(|n| mm.allocate_universal_with::<f32>(n * 5, device_local(device)).unwrap()).collect()
}

/// `got` equals `want` element by element (exactly: every kernel here computes what the CPU computes, in the
/// same order, in f32).
#[track_caller]
fn assert_matches(case: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{case}: length");
    let bad: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    assert!(
        bad.is_empty(),
        "{case}: {} of {} elements differ from the CPU, first at {}: {} (want {})",
        bad.len(),
        want.len(),
        bad[0],
        got[bad[0]],
        want[bad[0]]
    );
}

/// `got[i]` is `a[i] * b[i] + c[i]`, rounded once or twice: a compiler may contract the multiply-add into one
/// rounding or not, and either is right.
#[track_caller]
fn assert_multiply_adds(case: &str, got: &[f32], a: &[f32], b: &[f32], c: &[f32]) {
    assert_eq!(got.len(), a.len(), "{case}: length");
    let bad = (0..got.len()).filter(|&i| got[i] != a[i] * b[i] + c[i] && got[i] != a[i].mul_add(b[i], c[i])).count();
    assert_eq!(bad, 0, "{case}: {bad} of {} elements differ from the CPU", got.len());
}

// ---------------------------------------------------------------------------------------------------------- wgpu

#[cfg(feature = "wgpu")]
mod wgpu_kernels {
    use super::*;
    use umm::backends::wgpu_backend::wgpu;

    /// y = 2 x: the first kernel a wgpu user writes.
    const DOUBLE: &str = r#"
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&y)) { y[id.x] = 2.0 * x[id.x]; }
}
"#;

    /// out = a * b + c, three inputs read.
    const FMA: &str = r#"
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read> c: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i < arrayLength(&out)) { out[i] = a[i] * b[i] + c[i]; }
}
"#;

    /// x = x * x + s, in place, with s read.
    const SQUARE_ADD: &str = r#"
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> s: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i < arrayLength(&x)) { x[i] = x[i] * x[i] + s[i]; }
}
"#;

    /// out = p.scale * x + p.shift, p a uniform.
    const AFFINE: &str = r#"
struct Params { scale: f32, shift: f32, pad0: f32, pad1: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i < arrayLength(&out)) { out[i] = p.scale * x[i] + p.shift; }
}
"#;

    /// out = x + x2, where x and x2 are one buffer bound twice.
    const SUM: &str = r#"
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> x2: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i < arrayLength(&out)) { out[i] = x[i] + x2[i]; }
}
"#;

    struct Gpu {
        device: wgpu::Device,
        queue: wgpu::Queue,
    }

    impl Gpu {
        fn of(buffer: &UniversalBuffer<f32>) -> Self {
            let view = buffer.wgpu_binding().unwrap();
            Self { device: view.device().clone(), queue: view.queue().clone() }
        }

        fn pipeline(&self, source: &str) -> wgpu::ComputePipeline {
            let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: None,
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: None,
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            })
        }

        fn bind_group(
            &self,
            pipeline: &wgpu::ComputePipeline,
            resources: Vec<wgpu::BindingResource<'_>>,
        ) -> wgpu::BindGroup {
            let entries: Vec<wgpu::BindGroupEntry<'_>> = resources
                .into_iter()
                .enumerate()
                .map(|(i, resource)| wgpu::BindGroupEntry { binding: i as u32, resource })
                .collect();
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            })
        }

        /// Records one dispatch of `source` over N elements after `before` has recorded its commands, submits,
        /// and waits.
        fn dispatch(
            &self,
            source: &str,
            resources: Vec<wgpu::BindingResource<'_>>,
            before: impl FnOnce(&mut wgpu::CommandEncoder),
        ) {
            let pipeline = self.pipeline(source);
            let group = self.bind_group(&pipeline, resources);
            let mut encoder = self.device.create_command_encoder(&Default::default());
            before(&mut encoder);
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups((N as u32).div_ceil(64), 1, 1);
            }
            self.queue.submit([encoder.finish()]);
            self.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
        }
    }

    #[test]
    fn one_input_read_and_one_output_written_in_one_dispatch() {
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            // Once on small buffers, once on buffers above the small-request bound.
            for n in [N, 300_007] {
                let x_data: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 - 3.5).collect();
                let x = filled(mm, device, &x_data);
                let mut y = filled(mm, device, &vec![1.0; n]);
                let gpu = Gpu::of(&x);
                let pipeline = gpu.pipeline(DOUBLE);
                {
                    let (xv, yv) = (x.wgpu_binding().unwrap(), y.wgpu_binding_mut().unwrap());
                    let group = gpu.bind_group(&pipeline, vec![xv.binding_resource(), yv.binding_resource()]);
                    let mut encoder = gpu.device.create_command_encoder(&Default::default());
                    {
                        let mut pass = encoder.begin_compute_pass(&Default::default());
                        pass.set_pipeline(&pipeline);
                        pass.set_bind_group(0, &group, &[]);
                        pass.dispatch_workgroups((n as u32).div_ceil(64), 1, 1);
                    }
                    gpu.queue.submit([encoder.finish()]);
                    gpu.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
                }
                let want: Vec<f32> = x_data.iter().map(|v| 2.0 * v).collect();
                assert_matches(&format!("y = 2x over {n}"), &y.to_vec().unwrap(), &want);
            }
        });
    }

    #[test]
    fn several_read_only_inputs_one_of_them_a_read_only_buffer() {
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            let a = filled(mm, device, &xs());
            let b = filled(mm, device, &ys());
            let c = mm.allocate_universal_from_with(&zs(), read_only(device)).unwrap();
            let mut out = filled(mm, device, &vec![f32::NAN; N]);
            let gpu = Gpu::of(&a);
            let (av, bv, cv) = (a.wgpu_binding().unwrap(), b.wgpu_binding().unwrap(), c.wgpu_binding().unwrap());
            let ov = out.wgpu_binding_mut().unwrap();
            let resources =
                vec![av.binding_resource(), bv.binding_resource(), cv.binding_resource(), ov.binding_resource()];
            gpu.dispatch(FMA, resources, |_| {});
            drop((av, bv, cv, ov));
            assert_multiply_adds("out = a * b + c", &out.to_vec().unwrap(), &xs(), &ys(), &zs());
        });
    }

    #[test]
    fn an_update_in_place_beside_an_input_read() {
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            let mut x = filled(mm, device, &ys());
            let s = filled(mm, device, &xs());
            let gpu = Gpu::of(&s);
            let sv = s.wgpu_binding().unwrap();
            let xv = x.wgpu_binding_mut().unwrap();
            gpu.dispatch(SQUARE_ADD, vec![xv.binding_resource(), sv.binding_resource()], |_| {});
            drop((xv, sv));
            assert_multiply_adds("x = x * x + s", &x.to_vec().unwrap(), &ys(), &ys(), &xs());
        });
    }

    #[test]
    fn a_uniform_and_storage_from_read_only_buffers() {
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            let params = mm.allocate_universal_from_with(&[1.5f32, -2.0, 0.0, 0.0], read_only(device)).unwrap();
            let x = mm.allocate_universal_from_with(&xs(), read_only(device)).unwrap();
            let mut out = filled(mm, device, &vec![f32::NAN; N]);
            let gpu = Gpu::of(&x);
            let (pv, xv) = (params.wgpu_uniform_binding().unwrap(), x.wgpu_binding().unwrap());
            let ov = out.wgpu_binding_mut().unwrap();
            gpu.dispatch(AFFINE, vec![pv.binding_resource(), xv.binding_resource(), ov.binding_resource()], |_| {});
            drop((pv, xv, ov));
            assert_multiply_adds("out = 1.5 x - 2", &out.to_vec().unwrap(), &[1.5; N], &xs(), &[-2.0; N]);
        });
    }

    #[test]
    fn one_buffer_read_through_two_bindings() {
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            let x = filled(mm, device, &xs());
            let mut out = filled(mm, device, &vec![f32::NAN; N]);
            let gpu = Gpu::of(&x);
            let (first, second) = (x.wgpu_binding().unwrap(), x.wgpu_binding().unwrap());
            let ov = out.wgpu_binding_mut().unwrap();
            gpu.dispatch(SUM, vec![first.binding_resource(), second.binding_resource(), ov.binding_resource()], |_| {});
            drop((first, second, ov));
            let want: Vec<f32> = xs().iter().map(|x| x + x).collect();
            assert_matches("out = x + x", &out.to_vec().unwrap(), &want);
        });
    }

    #[test]
    fn copies_between_buffers_then_a_dispatch_in_one_command_buffer() {
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            let source = filled(mm, device, &xs());
            let x = filled(mm, device, &vec![0.0; N]);
            let mut y = filled(mm, device, &vec![f32::NAN; N]);
            let gpu = Gpu::of(&x);
            let (sv, xv) = (source.wgpu_binding().unwrap(), x.wgpu_binding().unwrap());
            let yv = y.wgpu_binding_mut().unwrap();
            let bytes = (N * 4) as u64;
            // source -> x, then y = 2 x: x is a copy destination and a read-only binding in one command buffer.
            gpu.dispatch(DOUBLE, vec![xv.binding_resource(), yv.binding_resource()], |encoder| {
                encoder.copy_buffer_to_buffer(sv.buffer(), sv.offset(), xv.buffer(), xv.offset(), bytes);
            });
            drop((sv, xv, yv));
            assert_matches("x = source", &x.to_vec().unwrap(), &xs());
            let want: Vec<f32> = xs().iter().map(|v| 2.0 * v).collect();
            assert_matches("y = 2 x after the copy", &y.to_vec().unwrap(), &want);
        });
    }

    #[test]
    fn an_indirect_dispatch_whose_arguments_are_a_umm_buffer() {
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            let x = filled(mm, device, &xs());
            let mut y = filled(mm, device, &vec![f32::NAN; N]);
            let mut args = mm.allocate_universal_with::<u32>(3, device_local(device)).unwrap();
            args.write(&[(N as u32).div_ceil(64), 1, 1]).unwrap();
            let gpu = Gpu::of(&x);
            let pipeline = gpu.pipeline(DOUBLE);
            let (xv, av) = (x.wgpu_binding().unwrap(), args.wgpu_binding().unwrap());
            let yv = y.wgpu_binding_mut().unwrap();
            let group = gpu.bind_group(&pipeline, vec![xv.binding_resource(), yv.binding_resource()]);
            let mut encoder = gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups_indirect(av.buffer(), av.offset());
            }
            gpu.queue.submit([encoder.finish()]);
            gpu.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
            drop((xv, av, yv));
            let want: Vec<f32> = xs().iter().map(|v| 2.0 * v).collect();
            assert_matches("y = 2 x, dispatched indirectly", &y.to_vec().unwrap(), &want);
        });
    }

    /// A quad over the left half of an 8 x 8 target, drawn from umm vertex and index buffers in the colour of a
    /// umm uniform buffer, copied into a umm buffer and read back.
    #[test]
    fn a_draw_from_vertex_index_and_uniform_buffers_copied_into_a_umm_buffer() {
        const DRAW: &str = r#"
@group(0) @binding(0) var<uniform> colour: vec4<f32>;
@vertex
fn vs(@location(0) position: vec2<f32>) -> @builtin(position) vec4<f32> {
    return vec4<f32>(position, 0.0, 1.0);
}
@fragment
fn fs() -> @location(0) vec4<f32> {
    return colour;
}
"#;
        const SIDE: u32 = 8;
        on_each_device(Api::Wgpu, |mm, device| {
            let _pads = neighbours(mm, device);
            let corners = [-1.0f32, -1.0, 0.0, -1.0, 0.0, 1.0, -1.0, 1.0];
            let vertices = mm.allocate_universal_from_with(&corners, read_only(device)).unwrap();
            let indices = mm.allocate_universal_from_with(&[0u32, 1, 2, 0, 2, 3], read_only(device)).unwrap();
            let colour = mm.allocate_universal_from_with(&[1.0f32, 0.0, 1.0, 1.0], read_only(device)).unwrap();
            // Rows of a texture copy are 256 bytes apart.
            let mut pixels = mm.allocate_universal_with::<u32>(64 * SIDE as usize, device_local(device)).unwrap();
            pixels.fill(0).unwrap();
            let cv = colour.wgpu_uniform_binding().unwrap();
            let (device, queue) = (cv.device().clone(), cv.queue().clone());
            let format = wgpu::TextureFormat::Rgba8Unorm;
            let target = device.create_texture(&wgpu::TextureDescriptor {
                label: None,
                size: wgpu::Extent3d { width: SIDE, height: SIDE, depth_or_array_layers: 1 },
                mip_level_count: 1,
                sample_count: 1,
                dimension: wgpu::TextureDimension::D2,
                format,
                usage: wgpu::TextureUsages::RENDER_ATTACHMENT | wgpu::TextureUsages::COPY_SRC,
                view_formats: &[],
            });
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: None,
                source: wgpu::ShaderSource::Wgsl(DRAW.into()),
            });
            let pipeline = device.create_render_pipeline(&wgpu::RenderPipelineDescriptor {
                label: None,
                layout: None,
                vertex: wgpu::VertexState {
                    module: &module,
                    entry_point: Some("vs"),
                    compilation_options: Default::default(),
                    buffers: &[Some(wgpu::VertexBufferLayout {
                        array_stride: 8,
                        step_mode: wgpu::VertexStepMode::Vertex,
                        attributes: &wgpu::vertex_attr_array![0 => Float32x2],
                    })],
                },
                primitive: Default::default(),
                depth_stencil: None,
                multisample: Default::default(),
                fragment: Some(wgpu::FragmentState {
                    module: &module,
                    entry_point: Some("fs"),
                    compilation_options: Default::default(),
                    targets: &[Some(format.into())],
                }),
                multiview_mask: None,
                cache: None,
            });
            let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &[wgpu::BindGroupEntry { binding: 0, resource: cv.binding_resource() }],
            });
            let (vv, iv) = (vertices.wgpu_binding().unwrap(), indices.wgpu_binding().unwrap());
            let pv = pixels.wgpu_binding_mut().unwrap();
            let view = target.create_view(&Default::default());
            let mut encoder = device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_render_pass(&wgpu::RenderPassDescriptor {
                    color_attachments: &[Some(wgpu::RenderPassColorAttachment {
                        view: &view,
                        depth_slice: None,
                        resolve_target: None,
                        ops: wgpu::Operations {
                            load: wgpu::LoadOp::Clear(wgpu::Color::BLACK),
                            store: wgpu::StoreOp::Store,
                        },
                    })],
                    ..Default::default()
                });
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.set_vertex_buffer(0, vv.buffer().slice(vv.offset()..vv.offset() + vv.size()));
                pass.set_index_buffer(
                    iv.buffer().slice(iv.offset()..iv.offset() + iv.size()),
                    wgpu::IndexFormat::Uint32,
                );
                pass.draw_indexed(0..6, 0, 0..1);
            }
            encoder.copy_texture_to_buffer(
                target.as_image_copy(),
                wgpu::TexelCopyBufferInfo {
                    buffer: pv.buffer(),
                    layout: wgpu::TexelCopyBufferLayout {
                        offset: pv.offset(),
                        bytes_per_row: Some(256),
                        rows_per_image: Some(SIDE),
                    },
                },
                target.size(),
            );
            queue.submit([encoder.finish()]);
            device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
            drop((cv, vv, iv, pv));
            let got = pixels.to_vec().unwrap();
            let (magenta, black) = (u32::from_le_bytes([255, 0, 255, 255]), u32::from_le_bytes([0, 0, 0, 255]));
            for row in 0..SIDE as usize {
                let texels = &got[row * 64..row * 64 + SIDE as usize];
                let want: Vec<u32> = (0..SIDE).map(|c| if c < SIDE / 2 { magenta } else { black }).collect();
                assert_eq!(texels, &want[..], "row {row} of the draw");
            }
        });
    }

    /// A dispatch of the caller's that wgpu refuses (one buffer bound read-only and read-write in one dispatch)
    /// reaches the caller: in the caller's error scope, and without one as wgpu's default handler reports it, a
    /// panic. No logger is installed here: nothing depends on one.
    #[test]
    fn an_invalid_dispatch_of_the_callers_is_not_swallowed() {
        on_each_device(Api::Wgpu, |mm, device| {
            let x = filled(mm, device, &xs());
            let gpu = Gpu::of(&x);
            let pipeline = gpu.pipeline(DOUBLE);
            let invalid_submission = || {
                let xv = x.wgpu_binding().unwrap();
                let group = gpu.bind_group(&pipeline, vec![xv.binding_resource(), xv.binding_resource()]);
                let mut encoder = gpu.device.create_command_encoder(&Default::default());
                {
                    let mut pass = encoder.begin_compute_pass(&Default::default());
                    pass.set_pipeline(&pipeline);
                    pass.set_bind_group(0, &group, &[]);
                    pass.dispatch_workgroups(1, 1, 1);
                }
                gpu.queue.submit([encoder.finish()]);
            };

            let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
            invalid_submission();
            let caught = pollster::block_on(scope.pop());
            let text = caught.map(|e| e.to_string()).unwrap_or_default();
            assert!(text.contains("conflicting usages") || text.contains("usage"), "the caller's scope got: {text:?}");

            let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(invalid_submission)).unwrap_err();
            let text = panic.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(text.contains("wgpu error") && text.contains("Validation"), "wgpu's default handler: {text:?}");

            // umm's own calls keep their errors to themselves and still work.
            let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
            assert_matches("x after the caller's errors", &x.to_vec().unwrap(), &xs());
            let err = mm.allocate_universal_with::<f32>(usize::MAX / 8, device_local(device)).unwrap_err();
            assert!(!err.to_string().is_empty());
            assert!(pollster::block_on(scope.pop()).is_none(), "umm's calls leave the caller's scope alone");
        });
    }
}

// -------------------------------------------------------------------------------------------------------- OpenCL

#[cfg(feature = "opencl")]
mod opencl_kernels {
    use super::*;
    use opencl3::kernel::{ExecuteKernel, Kernel};
    use opencl3::program::Program;
    use opencl3::types::cl_mem;
    use umm::backends::opencl::opencl3;
    use umm::interop::OpenClView;

    const KERNELS: &str = r#"
__kernel void twice(__global const float* x, __global float* y, int n) {
    int i = get_global_id(0);
    if (i < n) y[i] = 2.0f * x[i];
}
__kernel void fma3(__global const float* a, __global const float* b, __global const float* c,
                   __global float* out, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = a[i] * b[i] + c[i];
}
__kernel void square_add(__global float* x, __global const float* s, int n) {
    int i = get_global_id(0);
    if (i < n) x[i] = x[i] * x[i] + s[i];
}
__kernel void affine(__constant float* p, __global const float* x, __global float* out, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = p[0] * x[i] + p[1];
}
__kernel void sum(__global const float* x, __global const float* x2, __global float* out, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = x[i] + x2[i];
}
"#;

    /// Runs `name` over N elements with `buffers` as its first arguments and N as its last, and waits: built in the
    /// context of `on` (a view of one of the buffers, all on one device) and enqueued on its queue.
    fn run(on: &OpenClView<'_>, name: &str, buffers: &[cl_mem]) {
        let program = Program::create_and_build_from_source(on.context(), KERNELS, "").expect("kernels build");
        let kernel = Kernel::create(&program, name).unwrap();
        let n = N as i32;
        let mut launch = ExecuteKernel::new(&kernel);
        for buffer in buffers {
            // SAFETY: every argument before the last is a `__global`/`__constant` float pointer and is passed a
            // live sub-buffer of at least N floats, borrowed from its umm buffer until the event below completes.
            unsafe { launch.set_arg(buffer) };
        }
        // SAFETY: the last argument is an int.
        let event = unsafe { launch.set_arg(&n).set_global_work_size(N).enqueue_nd_range(on.queue()).unwrap() };
        event.wait().unwrap();
    }

    #[test]
    fn one_input_read_and_one_output_written_from_one_segment() {
        on_each_device(Api::OpenCl, |mm, device| {
            let _pads = neighbours(mm, device);
            let x = filled(mm, device, &xs());
            let mut y = filled(mm, device, &vec![1.0; N]);
            {
                let (xv, yv) = (x.opencl_buffer().unwrap(), y.opencl_buffer_mut().unwrap());
                run(&xv, "twice", &[xv.as_raw(), yv.as_raw()]);
            }
            let want: Vec<f32> = xs().iter().map(|v| 2.0 * v).collect();
            assert_matches("y = 2x", &y.to_vec().unwrap(), &want);
        });
    }

    #[test]
    fn several_read_only_inputs_one_of_them_a_read_only_buffer() {
        on_each_device(Api::OpenCl, |mm, device| {
            let _pads = neighbours(mm, device);
            let (a, b) = (filled(mm, device, &xs()), filled(mm, device, &ys()));
            let c = mm.allocate_universal_from_with(&zs(), read_only(device)).unwrap();
            let mut out = filled(mm, device, &vec![f32::NAN; N]);
            {
                let (av, bv, cv) = (a.opencl_buffer().unwrap(), b.opencl_buffer().unwrap(), c.opencl_buffer().unwrap());
                let ov = out.opencl_buffer_mut().unwrap();
                run(&av, "fma3", &[av.as_raw(), bv.as_raw(), cv.as_raw(), ov.as_raw()]);
            }
            assert_multiply_adds("out = a * b + c", &out.to_vec().unwrap(), &xs(), &ys(), &zs());
        });
    }

    #[test]
    fn an_update_in_place_beside_an_input_read() {
        on_each_device(Api::OpenCl, |mm, device| {
            let _pads = neighbours(mm, device);
            let mut x = filled(mm, device, &ys());
            let s = filled(mm, device, &xs());
            {
                let (sv, xv) = (s.opencl_buffer().unwrap(), x.opencl_buffer_mut().unwrap());
                run(&xv, "square_add", &[xv.as_raw(), sv.as_raw()]);
            }
            assert_multiply_adds("x = x * x + s", &x.to_vec().unwrap(), &ys(), &ys(), &xs());
        });
    }

    #[test]
    fn a_constant_argument_and_storage_from_read_only_buffers() {
        on_each_device(Api::OpenCl, |mm, device| {
            let _pads = neighbours(mm, device);
            let params = mm.allocate_universal_from_with(&[1.5f32, -2.0], read_only(device)).unwrap();
            let x = mm.allocate_universal_from_with(&xs(), read_only(device)).unwrap();
            let mut out = filled(mm, device, &vec![f32::NAN; N]);
            {
                let (pv, xv) = (params.opencl_buffer().unwrap(), x.opencl_buffer().unwrap());
                let ov = out.opencl_buffer_mut().unwrap();
                run(&pv, "affine", &[pv.as_raw(), xv.as_raw(), ov.as_raw()]);
            }
            assert_multiply_adds("out = 1.5 x - 2", &out.to_vec().unwrap(), &[1.5; N], &xs(), &[-2.0; N]);
        });
    }

    /// Two views of one buffer are two sub-buffers over the same bytes; OpenCL defines reading both in one
    /// kernel. A view that writes borrows its buffer mutably, so no other view of it can be alive meanwhile.
    #[test]
    fn one_buffer_read_through_two_sub_buffers() {
        on_each_device(Api::OpenCl, |mm, device| {
            let _pads = neighbours(mm, device);
            let x = filled(mm, device, &xs());
            let mut out = filled(mm, device, &vec![f32::NAN; N]);
            {
                let (first, second) = (x.opencl_buffer().unwrap(), x.opencl_buffer().unwrap());
                assert_eq!((first.offset(), first.size()), (second.offset(), second.size()));
                let ov = out.opencl_buffer_mut().unwrap();
                let (o, f) = (ov.offset(), first.offset());
                assert!(o + ov.size() <= f || f + first.size() <= o, "distinct buffers never overlap");
                run(&first, "sum", &[first.as_raw(), second.as_raw(), ov.as_raw()]);
            }
            let want: Vec<f32> = xs().iter().map(|x| x + x).collect();
            assert_matches("out = x + x", &out.to_vec().unwrap(), &want);
        });
    }
}

// ---------------------------------------------------------------------------------------------------------- CUDA

#[cfg(feature = "cuda")]
mod cuda_kernels {
    use super::*;
    use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
    use std::sync::Arc;
    use umm::backends::cuda::{self, cudarc};

    const KERNELS: &str = r#"
extern "C" __global__ void twice(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
extern "C" __global__ void fma3(const float* a, const float* b, const float* c, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i] + c[i];
}
extern "C" __global__ void square_add(float* x, const float* s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * x[i] + s[i];
}
extern "C" __global__ void sum(const float* x, const float* x2, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + x2[i];
}
"#;

    struct Cuda {
        stream: Arc<CudaStream>,
        module: Arc<cudarc::driver::CudaModule>,
    }

    impl Cuda {
        fn new(mm: &UniversalMemoryManager, device: usize) -> Option<Self> {
            if !cuda::nvrtc_available() {
                skip_or_fail("cuda", "NVRTC (libnvrtc) is not available to compile the kernels");
                return None;
            }
            let device = mm.devices()[device].cuda().unwrap();
            let ctx = device.context().clone();
            let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the kernels");
            Some(Self { stream: ctx.default_stream(), module: ctx.load_module(ptx).unwrap() })
        }

        fn function(&self, name: &str) -> CudaFunction {
            self.module.load_function(name).unwrap()
        }

        /// Launches `name` over N elements with `addresses` (device pointers) and N, and waits.
        fn run(&self, name: &str, addresses: &[u64]) {
            let f = self.function(name);
            let n = N as i32;
            let mut builder = self.stream.launch_builder(&f);
            for address in addresses {
                builder.arg(address);
            }
            builder.arg(&n);
            // SAFETY: each kernel takes float pointers then an int; every address is a live view of at least N
            // floats, borrowed from its umm buffer until the stream is synchronized below.
            unsafe { builder.launch(LaunchConfig::for_num_elems(N as u32)) }.unwrap();
            self.stream.synchronize().unwrap();
        }
    }

    #[test]
    fn ordinary_kernels_over_pooled_buffers_match_the_cpu() {
        on_each_device(Api::Cuda, |mm, device| {
            let Some(gpu) = Cuda::new(mm, device) else { return };
            let s = &gpu.stream;
            let _pads = neighbours(mm, device);

            let x = filled(mm, device, &xs());
            let mut y = filled(mm, device, &vec![1.0; N]);
            {
                let (xv, yv) = (x.cuda_view(s).unwrap(), y.cuda_view_mut(s).unwrap());
                gpu.run("twice", &[xv.device_address(), yv.device_address()]);
            }
            assert_matches("y = 2x", &y.to_vec().unwrap(), &xs().iter().map(|v| 2.0 * v).collect::<Vec<_>>());

            let b = filled(mm, device, &ys());
            let c = mm.allocate_universal_from_with(&zs(), read_only(device)).unwrap();
            let mut out = filled(mm, device, &vec![f32::NAN; N]);
            {
                let (av, bv, cv) = (x.cuda_view(s).unwrap(), b.cuda_view(s).unwrap(), c.cuda_view(s).unwrap());
                let ov = out.cuda_view_mut(s).unwrap();
                gpu.run("fma3", &[av.device_address(), bv.device_address(), cv.device_address(), ov.device_address()]);
            }
            assert_multiply_adds("out = a * b + c", &out.to_vec().unwrap(), &xs(), &ys(), &zs());

            let mut inplace = filled(mm, device, &ys());
            {
                let (iv, sv) = (inplace.cuda_view_mut(s).unwrap(), x.cuda_view(s).unwrap());
                gpu.run("square_add", &[iv.device_address(), sv.device_address()]);
            }
            assert_multiply_adds("x = x * x + s", &inplace.to_vec().unwrap(), &ys(), &ys(), &xs());

            {
                let (first, second) = (x.cuda_view(s).unwrap(), x.cuda_view(s).unwrap());
                let ov = out.cuda_view_mut(s).unwrap();
                gpu.run("sum", &[first.device_address(), second.device_address(), ov.device_address()]);
            }
            assert_matches("out = x + x", &out.to_vec().unwrap(), &xs().iter().map(|v| v + v).collect::<Vec<_>>());
        });
    }
}
