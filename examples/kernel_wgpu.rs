//! WGSL saxpy (y = a*x + y) through a wgpu compute pipeline on three buffers from `allocate_universal`: x read,
//! y read and written, a a read-only buffer bound as a uniform; checked against the CPU. Every umm buffer on wgpu
//! is a `wgpu::Buffer` of its own, so buffers bind together with any mix of usages. Exits 0 with a reason when no wgpu adapter is present, 1 on
//! a mismatch.
//!
//! `cargo run --example kernel_wgpu`

use std::process::ExitCode;
use umm::backends::wgpu_backend::wgpu;
use umm::{AllocOptions, Api, DeviceSelector, Placement, UniversalMemoryManager};

const SHADER: &str = r#"
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
    let mut y = mm.allocate_universal_with::<f32>(n, options.clone())?;
    x.write(&xs)?;
    y.write(&ys)?;
    // A uniform holds at least 16 bytes: a in the first lane of a vec4.
    let params = mm.allocate_universal_from_with(&[a, 0.0, 0.0, 0.0], options.placement(Placement::ReadOnly))?;

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
    let av = params.wgpu_uniform_binding()?;
    let yv = y.wgpu_binding_mut()?;
    println!(
        "x: {} bytes bound read-only, y: {} bytes read-write, a: a uniform of {} bytes",
        xv.size(),
        yv.size(),
        av.size()
    );
    let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry { binding: 0, resource: xv.binding_resource() },
            wgpu::BindGroupEntry { binding: 1, resource: yv.binding_resource() },
            wgpu::BindGroupEntry { binding: 2, resource: av.binding_resource() },
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
    drop((group, yv, xv, av));
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
