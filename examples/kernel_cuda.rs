//! CUDA saxpy (y = a*x + y), compiled at run time with NVRTC, on a buffer from `allocate_universal` and a
//! cudarc slice adopted by the manager, checked against the CPU. Exits 0 with a reason when no CUDA driver or
//! no NVRTC is present, 1 on a mismatch.
//!
//! `cargo run --example kernel_cuda`

use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::process::ExitCode;
use umm::backends::cuda::{self, cudarc};
use umm::{AdoptOptions, Adoptable, AllocOptions, Api, DeviceSelector, Placement, UniversalMemoryManager};

const KERNEL: &str = r#"
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mm = UniversalMemoryManager::builder().backends(true, false, false).build()?;
    let Some(device) = mm.devices().iter().find_map(|d| d.cuda()) else {
        if umm::backends::backend_required("cuda") {
            eprintln!("no CUDA device, but UMM_REQUIRE_BACKENDS requires cuda: {}", mm.skipped().join("; "));
            return Ok(ExitCode::FAILURE);
        }
        println!("skipping: no CUDA device ({})", mm.skipped().join("; "));
        return Ok(ExitCode::SUCCESS);
    };
    if !cuda::nvrtc_available() {
        if umm::backends::backend_required("cuda") {
            eprintln!("NVRTC is not available, but UMM_REQUIRE_BACKENDS requires cuda");
            return Ok(ExitCode::FAILURE);
        }
        println!("skipping: NVRTC (libnvrtc) is not available to compile the kernel");
        return Ok(ExitCode::SUCCESS);
    }
    let ctx = device.context().clone();
    let stream = ctx.default_stream();
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL)?;
    let saxpy = ctx.load_module(ptx)?.load_function("saxpy")?;

    let n = 1 << 16;
    let a = 2.5f32;
    let xs: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let ys: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let options = AllocOptions::new().placement(Placement::DeviceLocal).device(DeviceSelector::Api(Api::Cuda));
    let mut x = mm.allocate_universal_with::<f32>(n, options)?;
    x.write(&xs)?;
    // y starts as a cudarc slice, taken over by the manager (freed by cudarc when `y` is dropped).
    let mut y = mm.adopt(Adoptable::cuda(stream.clone_htod(&ys)?), AdoptOptions::new().label("y"))?;

    {
        let xv = x.cuda_view(&stream)?;
        let yv = y.cuda_view_mut(&stream)?;
        let (xp, yp, count) = (xv.device_address(), yv.device_address(), n as i32);
        let mut launch = stream.launch_builder(&saxpy);
        launch.arg(&a).arg(&xp).arg(&yp).arg(&count);
        // SAFETY: the signature is (float, const float*, float*, int); both views hold n floats and are borrowed
        // from their buffers until the stream is synchronized below.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        stream.synchronize()?;
    }

    let got = y.to_vec()?;
    let bad = (0..n).filter(|&i| got[i] != a * xs[i] + ys[i]).count();
    if bad > 0 {
        eprintln!("saxpy on {}: {bad} of {n} elements differ from the CPU", y.device().name());
        return Ok(ExitCode::FAILURE);
    }
    println!("saxpy on {} over {n} elements matches the CPU", y.device().name());
    Ok(ExitCode::SUCCESS)
}
