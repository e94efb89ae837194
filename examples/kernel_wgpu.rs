//! WGSL saxpy (y = a*x + y) through a wgpu compute pipeline on two buffers from `allocate_universal`, bound at
//! their blocks' offsets, checked against the CPU. Exits 0 with a reason when no wgpu adapter is present, 1 on
//! a mismatch.
//!
//! `cargo run --example kernel_wgpu`

use std::process::ExitCode;
use umm::backends::wgpu_backend::wgpu;
use umm::{AllocOptions, Api, DeviceSelector, Placement, UniversalMemoryManager};

const SHADER: &str = r#"
// x and y may be blocks of one pooled buffer: WebGPU forbids read and read-write use of one buffer in a
// dispatch, so both are bound read_write.
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
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

fn main() -> Result<ExitCode, umm::Error> {
    let mm = UniversalMemoryManager::builder().backends(false, false, true).build()?;
    if !mm.devices().iter().any(|d| d.has_api(Api::Wgpu)) {
        if umm::backends::backend_required("wgpu") {
            eprintln!("no wgpu adapter, but UMM_REQUIRE_BACKENDS requires wgpu: {}", mm.skipped().join("; "));
            return Ok(ExitCode::FAILURE);
        }
        println!("skipping: no wgpu adapter ({})", mm.skipped().join("; "));
        return Ok(ExitCode::SUCCESS);
    }
    let n = 1 << 16;
    let a = 2.5f32;
    let xs: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let ys: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let options = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Api(Api::Wgpu));
    let mut x = mm.allocate_universal_with::<f32>(n, options.clone())?;
    let mut y = mm.allocate_universal_with::<f32>(n, options)?;
    x.write(&xs)?;
    y.write(&ys)?;

    let xv = x.wgpu_binding()?;
    let (device, queue) = (xv.device().clone(), xv.queue().clone());
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("saxpy"),
        source: wgpu::ShaderSource::Wgsl(SHADER.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("saxpy"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let uniform = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("a"),
        size: 16,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    queue.write_buffer(&uniform, 0, &[a.to_le_bytes(), [0; 4], [0; 4], [0; 4]].concat());
    let yv = y.wgpu_binding_mut()?;
    println!("x bound at offset {} ({} bytes), y at offset {}", xv.offset(), xv.size(), yv.offset());
    let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry { binding: 0, resource: xv.binding_resource() },
            wgpu::BindGroupEntry { binding: 1, resource: yv.binding_resource() },
            wgpu::BindGroupEntry { binding: 2, resource: uniform.as_entire_binding() },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &group, &[]);
        pass.dispatch_workgroups((n as u32).div_ceil(64), 1, 1);
    }
    queue.submit([encoder.finish()]);
    if let Err(e) = device.poll(wgpu::PollType::wait_indefinitely()) {
        eprintln!("waiting for the device failed: {e}");
        return Ok(ExitCode::FAILURE);
    }
    drop((group, yv, xv));
    y.record_device_use();

    let got = y.to_vec()?;
    let bad = (0..n).filter(|&i| got[i] != a * xs[i] + ys[i]).count();
    if bad > 0 {
        eprintln!("saxpy on {}: {bad} of {n} elements differ from the CPU", y.device().name());
        return Ok(ExitCode::FAILURE);
    }
    println!("saxpy on {} over {n} elements matches the CPU", y.device().name());
    Ok(ExitCode::SUCCESS)
}
