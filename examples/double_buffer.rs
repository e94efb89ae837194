//! Overlapping batch uploads with compute: a loop that uploads a batch and computes on it, run three ways —
//! serially (upload, then compute: about C + U per step), with a `DoubleBuffer` (the next batch uploads while
//! the current one is computed on) and with a `Prefetcher` (worker threads upload ahead) — and checked: every
//! step's result must match the CPU's.
//!
//! On CUDA the compute is a kernel compiled with NVRTC that sums the batch and then spins for C ms; the upload
//! of a batch (staging into pinned memory and the copy) takes U ms. The table gives each loop's time per step
//! and its ratio to max(C, U) (the target for the overlapped loops is at most 1.10 per step once the pipeline is
//! full; the whole loop's figure, first upload included, is shown beside it; C and U are measured again after
//! the loops, so that a change of clocks during the run shows), and the pinned host-to-device
//! bandwidth through umm against a raw `cuMemcpyHtoDAsync` from pinned memory in the same run (target: at least
//! 95%). Without CUDA (or NVRTC) it says so and goes on to the other devices.
//!
//! On the host, OpenCL and wgpu devices the loop has the same shape with a CPU stand-in for the kernel (it reads
//! the batch back, sums it and spins until C ms have passed), checked the same way.
//!
//! `cargo run --release --example double_buffer -- [--steps N] [--batch-mib M] [--compute-ms C]`
//! (on an H100: `cargo run --release --no-default-features --features cuda --example double_buffer`).
//! Exit status: 0 when every result matched (performance targets missed are reported, not fatal, unless
//! `--strict` is given: then 2), 1 on a wrong result.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use umm::overlap::OverlapOptions;
use umm::{Api, DeviceSelector, UniversalMemoryManager};

/// Distinct host batches the loops cycle through.
const DISTINCT: usize = 3;
/// Steps it takes an overlapped loop to fill its pipeline (the Prefetcher's lookahead of 2, plus one): the steady
/// state is timed from this step on.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FILL: usize = 3;

struct Args {
    steps: usize,
    batch_mib: Option<usize>,
    compute_ms: Option<f64>,
    strict: bool,
}

fn args() -> Result<Args, String> {
    let mut a = Args { steps: 0, batch_mib: None, compute_ms: None, strict: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--steps" => a.steps = value("--steps")?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--batch-mib" => {
                a.batch_mib = Some(value("--batch-mib")?.parse().map_err(|e| format!("--batch-mib: {e}"))?)
            }
            "--compute-ms" => {
                a.compute_ms = Some(value("--compute-ms")?.parse().map_err(|e| format!("--compute-ms: {e}"))?)
            }
            "--strict" => a.strict = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// Host batches of `elems` u32 each, distinct per batch, and their sums.
fn host_batches(elems: usize) -> (Vec<Arc<Vec<u32>>>, Vec<u64>) {
    let batches: Vec<Arc<Vec<u32>>> = (0..DISTINCT)
        .map(|b| Arc::new((0..elems).map(|i| (i as u32).wrapping_mul(2_654_435_761) >> 12 ^ b as u32).collect()))
        .collect();
    let sums = batches.iter().map(|b| b.iter().map(|&x| u64::from(x)).sum()).collect();
    (batches, sums)
}

/// A shared host batch as a prefetcher item.
struct Shared(Arc<Vec<u32>>);

impl AsRef<[u32]> for Shared {
    fn as_ref(&self) -> &[u32] {
        &self.0
    }
}

/// One row of the table.
struct Row {
    what: String,
    per_step: Duration,
    ratio: Option<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn print_table(title: &str, rows: &[Row]) {
    println!("\n{title}");
    let ratios = if rows.iter().any(|r| r.ratio.is_some()) { "/ max(C, U)" } else { "" };
    println!("  {:<34} {:>12} {:>14}", "loop", "ms per step", ratios);
    for r in rows {
        let ratio = r.ratio.map_or(String::new(), |x| format!("{x:.3}"));
        println!("  {:<34} {:>12.3} {:>14}", r.what, ms(r.per_step), ratio);
    }
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    #[cfg(feature = "cuda")]
    let (mut wrong, missed) = match cuda::run(&args) {
        Ok(outcome) => (outcome.wrong, outcome.missed),
        Err(e) => {
            eprintln!("cuda: {e}");
            return ExitCode::FAILURE;
        }
    };
    #[cfg(not(feature = "cuda"))]
    let (mut wrong, missed) = {
        println!("skipping CUDA: umm was built without the cuda feature");
        (false, false)
    };

    for (name, api) in [("host", Api::Host), ("opencl", Api::OpenCl), ("wgpu", Api::Wgpu)] {
        match stand_in(&args, name, api) {
            Ok(ok) => wrong |= !ok,
            Err(e) => {
                eprintln!("{name}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if wrong {
        eprintln!("\nsome results did not match the CPU");
        return ExitCode::FAILURE;
    }
    if missed && args.strict {
        eprintln!("\na performance target was missed (--strict)");
        return ExitCode::from(2);
    }
    println!("\nall results matched the CPU");
    ExitCode::SUCCESS
}

/// The loop on the host, OpenCL or wgpu device with a CPU stand-in for the kernel. `Ok(false)` on a wrong
/// result; `Ok(true)` also when the device is absent (after a note).
fn stand_in(args: &Args, name: &str, api: Api) -> Result<bool, Box<dyn std::error::Error>> {
    let mm = UniversalMemoryManager::builder().backends(false, api == Api::OpenCl, api == Api::Wgpu).build()?;
    let selector = if api == Api::Host { DeviceSelector::Host } else { DeviceSelector::Api(api) };
    if api != Api::Host && !mm.devices().iter().any(|d| d.has_api(api)) {
        println!("\nskipping {name}: no device ({})", mm.skipped().join("; "));
        return Ok(true);
    }
    let steps = if args.steps == 0 { 24 } else { args.steps };
    let elems = args.batch_mib.unwrap_or(4) << 18;
    let compute = Duration::from_secs_f64(args.compute_ms.unwrap_or(2.0) / 1e3);
    let (batches, sums) = host_batches(elems);
    // The stand-in kernel: reads the batch (back from the device), sums it, spins until `compute` has passed.
    let kernel = |front: &umm::UniversalBuffer<u32>, len: usize| -> umm::Result<u64> {
        let start = Instant::now();
        let sum = match front.as_slice() {
            Some(s) => s[..len].iter().map(|&x| u64::from(x)).sum(),
            None => {
                let mut v = vec![0u32; len];
                front.read_at(0, &mut v)?;
                v.iter().map(|&x| u64::from(x)).sum()
            }
        };
        while start.elapsed() < compute {
            std::hint::spin_loop();
        }
        Ok(sum)
    };
    let mut ok = true;
    let mut check = |what: &str, step: usize, got: u64| {
        if got != sums[step % DISTINCT] {
            eprintln!("{name} {what}: step {step} summed {got}, expected {}", sums[step % DISTINCT]);
            ok = false;
        }
    };
    let options = OverlapOptions::new().device(selector);
    let mut db = mm.double_buffer::<u32>(elems, options.clone())?;

    // Serial: upload, wait, compute.
    let t = Instant::now();
    for step in 0..steps {
        db.prefetch_next(&batches[step % DISTINCT])?;
        db.synchronize()?;
        db.swap();
        let front = db.current()?;
        let got = kernel(front.buffer(), front.len())?;
        check("serial", step, got);
    }
    let serial = t.elapsed() / steps as u32;

    // DoubleBuffer: batch step + 1 uploads while step is computed on.
    let t = Instant::now();
    db.prefetch_next(&batches[0])?;
    db.swap();
    for step in 0..steps {
        if step + 1 < steps {
            db.prefetch_next(&batches[(step + 1) % DISTINCT])?;
        }
        let front = db.current()?;
        let got = kernel(front.buffer(), front.len())?;
        check("double buffer", step, got);
        db.swap();
    }
    let double = t.elapsed() / steps as u32;
    let where_ = db.current().map(|f| f.buffer().device().name().to_string()).unwrap_or_default();
    drop(db);

    // Prefetcher: two workers keep two batches uploaded ahead.
    let t = Instant::now();
    let shared = batches.clone();
    let source = (0..steps).map(move |i| Shared(Arc::clone(&shared[i % DISTINCT])));
    for (step, batch) in mm.prefetcher(2, 2).options(options).wrap(source)?.enumerate() {
        let batch = batch?;
        let got = kernel(batch.buffer(), batch.len())?;
        check("prefetcher", step, got);
    }
    let prefetched = t.elapsed() / steps as u32;

    print_table(
        &format!(
            "{name} ({where_}): {steps} steps of {} MiB, CPU stand-in kernel of {:.1} ms",
            elems >> 18,
            ms(compute)
        ),
        &[
            Row { what: "serial (upload, then compute)".into(), per_step: serial, ratio: None },
            Row { what: "DoubleBuffer".into(), per_step: double, ratio: None },
            Row { what: "Prefetcher (lookahead 2, 2 workers)".into(), per_step: prefetched, ratio: None },
        ],
    );
    println!("  results: {}", if ok { "all steps match the CPU" } else { "MISMATCH" });
    Ok(ok)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA loop: an NVRTC kernel that sums the batch, then spins for C ms.

    use super::*;
    use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
    use umm::backends::cuda::{self as ucuda, cudarc, PinnedUploadBaseline};
    use umm::{AllocOptions, Placement};

    const KERNEL: &str = r#"
extern "C" __global__ void consume(const unsigned int* x, unsigned long long n, long long cycles,
                                   unsigned long long* out) {
    long long start = clock64();
    unsigned long long acc = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        acc += x[i];
    }
    atomicAdd(out, acc);
    if (threadIdx.x == 0) {
        while (clock64() - start < cycles) { }
    }
}
"#;

    /// What the CUDA run found.
    pub(super) struct Outcome {
        pub(super) wrong: bool,
        pub(super) missed: bool,
    }

    struct Gpu {
        compute: Arc<CudaStream>,
        consume: CudaFunction,
        blocks: u32,
    }

    impl Gpu {
        /// Queues the kernel on `x` (its first `n` elements), spinning `cycles`, adding into `out`.
        fn launch(&self, x: u64, n: usize, cycles: i64, out: u64) -> Result<(), Box<dyn std::error::Error>> {
            let n = n as u64;
            let mut launch = self.compute.launch_builder(&self.consume);
            launch.arg(&x).arg(&n).arg(&cycles).arg(&out);
            let config = LaunchConfig { grid_dim: (self.blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the signature is (const unsigned*, u64, i64, u64*); `x` holds at least `n` elements and
            // `out` one u64, both pool buffers kept alive (and marked as used on this stream by their views)
            // until the stream is synchronized.
            unsafe { launch.launch(config) }?;
            Ok(())
        }

        /// Milliseconds the kernel takes on `x` with `cycles`, averaged over `reps` launches.
        fn time_kernel(
            &self,
            x: u64,
            n: usize,
            cycles: i64,
            out: u64,
            reps: usize,
        ) -> Result<f64, Box<dyn std::error::Error>> {
            let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            self.launch(x, n, cycles, out)?;
            let start = self.compute.record_event(timing)?;
            for _ in 0..reps {
                self.launch(x, n, cycles, out)?;
            }
            let end = self.compute.record_event(timing)?;
            Ok(f64::from(start.elapsed_ms(&end)?) / reps as f64)
        }
    }

    pub(super) fn run(args: &Args) -> Result<Outcome, Box<dyn std::error::Error>> {
        let quiet = Outcome { wrong: false, missed: false };
        let mm = UniversalMemoryManager::builder().backends(true, false, false).build()?;
        let Some(device) = mm.devices().iter().find(|d| d.cuda().is_some()) else {
            if umm::backends::backend_required("cuda") {
                return Err(format!(
                    "no CUDA device, but UMM_REQUIRE_BACKENDS requires cuda: {}",
                    mm.skipped().join("; ")
                )
                .into());
            }
            println!("skipping CUDA: no CUDA device ({})", mm.skipped().join("; "));
            return Ok(quiet);
        };
        if !ucuda::nvrtc_available() {
            if umm::backends::backend_required("cuda") {
                return Err("NVRTC is not available, but UMM_REQUIRE_BACKENDS requires cuda".into());
            }
            println!("skipping CUDA: NVRTC (libnvrtc) is not available to compile the kernel");
            return Ok(quiet);
        }
        let cuda_device = device.cuda().expect("found above");
        let ctx = cuda_device.context().clone();
        let sms = cuda_device
            .info()
            .details
            .iter()
            .find(|(k, _)| k == "multiprocessors")
            .and_then(|(_, v)| v.parse::<u32>().ok())
            .unwrap_or(132);
        let gpu = Gpu {
            compute: ctx.new_stream()?,
            consume: ctx.load_module(cudarc::nvrtc::compile_ptx(KERNEL)?)?.load_function("consume")?,
            blocks: sms * 4,
        };
        let steps = if args.steps == 0 { 40 } else { args.steps.max(FILL + 1) };
        let elems = args.batch_mib.unwrap_or(128) << 18;
        let bytes = (elems * 4) as u64;
        let (batches, sums) = host_batches(elems);
        let on_cuda = DeviceSelector::Api(Api::Cuda);
        let options = OverlapOptions::new().device(on_cuda).cuda_stream(Arc::clone(&gpu.compute));
        let mut out = mm.allocate_universal_with::<u64>(
            steps,
            AllocOptions::new().placement(Placement::DeviceLocal).device(on_cuda),
        )?;
        let mut db = mm.double_buffer::<u32>(elems, options.clone())?;
        let options_after = options.clone();

        // U: one batch's upload through the double buffer (staging and copy), waited for.
        for b in batches.iter().take(2) {
            db.prefetch_next(b)?;
            db.synchronize()?;
        }
        let reps = 8;
        let t = Instant::now();
        for i in 0..reps {
            db.prefetch_next(&batches[i % DISTINCT])?;
            db.synchronize()?;
        }
        let upload = t.elapsed() / reps as u32;
        db.swap();

        // C: calibrate the spin to the wanted compute time (U unless --compute-ms), then measure it.
        let out_addr = |out: &umm::UniversalBuffer<u64>, step: usize| -> umm::Result<u64> {
            Ok(out.cuda_view(&gpu.compute)?.device_address() + 8 * step as u64)
        };
        let scratch = out_addr(&out, 0)?;
        let want_ms = args.compute_ms.unwrap_or(ms(upload));
        let (front_addr, front_len) = {
            let front = db.current()?;
            (front.buffer().cuda_view(&gpu.compute)?.device_address(), front.len())
        };
        // The spin counts from the kernel's start, so a kernel lasts about max(sum pass, cycles / clock).
        let probe = 4_000_000i64;
        let per_cycle = gpu.time_kernel(front_addr, front_len, probe, scratch, 4)? / probe as f64;
        let cycles = (want_ms / per_cycle) as i64;
        let compute = Duration::from_secs_f64(gpu.time_kernel(front_addr, front_len, cycles, scratch, 8)? / 1e3);
        gpu.compute.synchronize()?;
        let bound = compute.max(upload);

        let mut wrong = false;
        let mut check = |what: &str, out: &umm::UniversalBuffer<u64>| -> umm::Result<()> {
            let got = out.to_vec()?;
            for (step, &g) in got.iter().enumerate() {
                if g != sums[step % DISTINCT] {
                    eprintln!("cuda {what}: step {step} summed {g}, expected {}", sums[step % DISTINCT]);
                    wrong = true;
                    break;
                }
            }
            Ok(())
        };

        // Serial: upload and wait, then compute and wait.
        out.fill(0)?;
        let t = Instant::now();
        for step in 0..steps {
            db.prefetch_next(&batches[step % DISTINCT])?;
            db.synchronize()?;
            db.swap();
            let front = db.current()?;
            gpu.launch(
                front.buffer().cuda_view(&gpu.compute)?.device_address(),
                front.len(),
                cycles,
                out_addr(&out, step)?,
            )?;
            gpu.compute.synchronize()?;
        }
        let serial = t.elapsed() / steps as u32;
        check("serial", &out)?;

        // DoubleBuffer: batch step + 1 uploads on the copy stream while the kernel of step runs. The steady state
        // is timed from step FILL on, once the pipeline is full (the first upload has nothing to overlap with).
        out.fill(0)?;
        let t = Instant::now();
        let mut steady_from = t;
        db.prefetch_next(&batches[0])?;
        db.swap();
        for step in 0..steps {
            if step == FILL {
                steady_from = Instant::now();
            }
            if step + 1 < steps {
                db.prefetch_next(&batches[(step + 1) % DISTINCT])?;
            }
            let front = db.current()?;
            gpu.launch(
                front.buffer().cuda_view(&gpu.compute)?.device_address(),
                front.len(),
                cycles,
                out_addr(&out, step)?,
            )?;
            db.swap();
        }
        gpu.compute.synchronize()?;
        let double = t.elapsed() / steps as u32;
        let double_steady = steady_from.elapsed() / (steps - FILL) as u32;
        check("double buffer", &out)?;
        drop(db);

        // Prefetcher: two workers keep two batches resident ahead of the kernels.
        out.fill(0)?;
        let t = Instant::now();
        let mut steady_from = t;
        let shared = batches.clone();
        let source = (0..steps).map(move |i| Shared(Arc::clone(&shared[i % DISTINCT])));
        for (step, batch) in mm.prefetcher(2, 2).options(options).wrap(source)?.enumerate() {
            if step == FILL {
                steady_from = Instant::now();
            }
            let batch = batch?;
            gpu.launch(batch.cuda_view(&gpu.compute)?.device_address(), batch.len(), cycles, out_addr(&out, step)?)?;
        }
        gpu.compute.synchronize()?;
        let prefetched = t.elapsed() / steps as u32;
        let prefetched_steady = steady_from.elapsed() / (steps - FILL) as u32;
        check("prefetcher", &out)?;
        // C and U once more after the loops: a GPU whose clocks moved meanwhile shows here.
        let compute_after = Duration::from_secs_f64(gpu.time_kernel(front_addr, front_len, cycles, scratch, 8)? / 1e3);
        let mut db = mm.double_buffer::<u32>(elems, options_after)?;
        db.prefetch_next(&batches[0])?;
        db.synchronize()?;
        let t = Instant::now();
        for i in 0..reps {
            db.prefetch_next(&batches[i % DISTINCT])?;
            db.synchronize()?;
        }
        let upload_after = t.elapsed() / reps as u32;
        drop(db);

        // Pinned host-to-device bandwidth: umm (a pinned buffer written into a device buffer) against the raw
        // driver call from pinned memory, same bytes, same run.
        let pinned_opts = AllocOptions::new().placement(Placement::HostPinned).device(on_cuda);
        let mut pinned = mm.allocate_universal_with::<u8>(bytes as usize, pinned_opts)?;
        pinned.fill(7)?;
        let mut target = mm.allocate_universal_with::<u8>(
            bytes as usize,
            AllocOptions::new().placement(Placement::DeviceLocal).device(on_cuda),
        )?;
        let src = pinned.as_slice().ok_or("pinned memory without a host address")?;
        target.write(src)?;
        let reps = 10;
        let t = Instant::now();
        for _ in 0..reps {
            target.write(src)?;
        }
        let umm_gbs = (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let raw = PinnedUploadBaseline::new(cuda_device, bytes)?;
        let copy = ctx.new_stream()?;
        raw.upload(&copy)?;
        copy.synchronize()?;
        let t = Instant::now();
        for _ in 0..reps {
            raw.upload(&copy)?;
        }
        copy.synchronize()?;
        let raw_gbs = (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
        if raw.read_back()?.iter().enumerate().any(|(i, &b)| b != (i % 251) as u8) {
            eprintln!("cuda: the raw baseline's bytes did not land");
            wrong = true;
        }
        if target.to_vec()?.iter().any(|&b| b != 7) {
            eprintln!("cuda: umm's pinned upload did not land");
            wrong = true;
        }

        let ratio = |d: Duration| d.as_secs_f64() / bound.as_secs_f64();
        print_table(
            &format!(
                "cuda ({}): {steps} steps of {} MiB; C = {:.3} ms (kernel), U = {:.3} ms (upload: staging + copy, {:.1} GB/s)",
                device.name(),
                bytes >> 20,
                ms(compute),
                ms(upload),
                bytes as f64 / upload.as_secs_f64() / 1e9
            ),
            &[
                Row { what: "kernel alone (C)".into(), per_step: compute, ratio: Some(ratio(compute)) },
                Row { what: "upload alone (U)".into(), per_step: upload, ratio: Some(ratio(upload)) },
                Row { what: "serial (no overlap, ~C+U)".into(), per_step: serial, ratio: Some(ratio(serial)) },
                Row { what: "DoubleBuffer, whole loop".into(), per_step: double, ratio: Some(ratio(double)) },
                Row { what: format!("DoubleBuffer, steps {FILL}.."), per_step: double_steady, ratio: Some(ratio(double_steady)) },
                Row { what: "Prefetcher (lookahead 2, 2 workers), whole loop".into(), per_step: prefetched, ratio: Some(ratio(prefetched)) },
                Row { what: format!("Prefetcher, steps {FILL}.."), per_step: prefetched_steady, ratio: Some(ratio(prefetched_steady)) },
                Row { what: "kernel alone, after the loops".into(), per_step: compute_after, ratio: Some(ratio(compute_after)) },
                Row { what: "upload alone, after the loops".into(), per_step: upload_after, ratio: Some(ratio(upload_after)) },
            ],
        );
        let share = umm_gbs / raw_gbs;
        println!("\n  pinned host->device, {} MiB x {reps}:", bytes >> 20);
        println!(
            "    umm (a {} buffer's slice written into a {} buffer) {umm_gbs:>8.2} GB/s",
            pinned.placement(),
            target.placement()
        );
        println!("    raw cuMemcpyHtoDAsync from pinned       {raw_gbs:>8.2} GB/s");
        println!("    umm / raw                               {:>8.1} %", share * 100.0);
        let mut missed = false;
        // Judged per step once the pipeline is full; the whole loop's figure adds the first upload, which
        // nothing can overlap, spread over the steps.
        for (what, r) in [("DoubleBuffer", ratio(double_steady)), ("Prefetcher", ratio(prefetched_steady))] {
            let ok = r <= 1.10;
            missed |= !ok;
            println!(
                "  target {what} <= 1.10 x max(C, U) per step (steps {FILL}..): {r:.3} {}",
                if ok { "met" } else { "MISSED" }
            );
        }
        let ok = share >= 0.95;
        missed |= !ok;
        println!(
            "  target umm >= 95% of raw pinned bandwidth: {:.1}% {}",
            share * 100.0,
            if ok { "met" } else { "MISSED" }
        );
        println!("  results: {}", if wrong { "MISMATCH" } else { "all steps match the CPU" });
        Ok(Outcome { wrong, missed })
    }
}
