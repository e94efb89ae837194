//! OpenCL C saxpy (y = a*x + y) on two buffers from `allocate_universal`, passed to the kernel as sub-buffers,
//! checked against the CPU. Exits 0 with a reason when no OpenCL device is present, 1 on a mismatch.
//!
//! `cargo run --example kernel_opencl`

use std::process::ExitCode;
use umm::backends::opencl::opencl3::kernel::{ExecuteKernel, Kernel};
use umm::backends::opencl::opencl3::program::Program;
use umm::{AllocOptions, Api, DeviceSelector, Placement, UniversalMemoryManager};

const KERNEL: &str = "__kernel void saxpy(float a, __global const float* x, __global float* y, int n) {
    int i = get_global_id(0);
    if (i < n) y[i] = a * x[i] + y[i];
}";

fn main() -> Result<ExitCode, umm::Error> {
    let mm = UniversalMemoryManager::builder().backends(false, true, false).build()?;
    if !mm.devices().iter().any(|d| d.has_api(Api::OpenCl)) {
        if umm::backends::backend_required("opencl") {
            eprintln!("no OpenCL device, but UMM_REQUIRE_BACKENDS requires opencl: {}", mm.skipped().join("; "));
            return Ok(ExitCode::FAILURE);
        }
        println!("skipping: no OpenCL device ({})", mm.skipped().join("; "));
        return Ok(ExitCode::SUCCESS);
    }
    let n = 1 << 16;
    let a = 2.5f32;
    let xs: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let ys: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let options = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Api(Api::OpenCl));
    let mut x = mm.allocate_universal_with::<f32>(n, options.clone())?;
    let mut y = mm.allocate_universal_with::<f32>(n, options)?;
    x.write(&xs)?;
    y.write(&ys)?;

    let xv = x.opencl_buffer()?;
    let program = match Program::create_and_build_from_source(xv.context(), KERNEL, "") {
        Ok(program) => program,
        Err(log) => {
            eprintln!("the kernel does not build: {log}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let Ok(kernel) = Kernel::create(&program, "saxpy") else {
        eprintln!("clCreateKernel failed");
        return Ok(ExitCode::FAILURE);
    };
    let yv = y.opencl_buffer_mut()?;
    println!("x is a sub-buffer at origin {} ({} bytes), y at origin {}", xv.offset(), xv.size(), yv.offset());
    let (xm, ym, count) = (xv.as_raw(), yv.as_raw(), n as i32);
    // SAFETY: the arguments match the kernel's signature (float, two buffers of n floats, int); the sub-buffers
    // are borrowed from their buffers and live until the event below has completed.
    let run = unsafe {
        ExecuteKernel::new(&kernel)
            .set_arg(&a)
            .set_arg(&xm)
            .set_arg(&ym)
            .set_arg(&count)
            .set_global_work_size(n)
            .enqueue_nd_range(yv.queue())
    };
    if let Err(e) = run.and_then(|event| event.wait()) {
        eprintln!("the kernel failed: {e}");
        return Ok(ExitCode::FAILURE);
    }
    drop((yv, xv));
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
