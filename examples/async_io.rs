//! Whether asynchronous reads and writes pay: a stream of batches moved between the host and each device, with
//! host work on every batch (making it before a write, summing it after a read), first with blocking
//! `write`/`to_vec`, then with `mm.write_async`/`mm.read_async` so that each batch's copy runs while the host works
//! on its neighbour. Prints one row per device API and direction.
//!
//! ```sh
//! cargo run --release --example async_io -- --mib 64 --batches 12 --repeat 3
//! ```
//!
//! Each figure is the best of `--repeat` passes; the sums prove both ways moved the same bytes.

use std::time::{Duration, Instant};
use umm::{AllocOptions, Api, DeviceSelector, Placement, UniversalBuffer, UniversalMemoryManager};

struct Args {
    mib: usize,
    batches: usize,
    repeat: usize,
}

fn args() -> Args {
    let mut a = Args { mib: 64, batches: 12, repeat: 3 };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{flag} takes a number"));
        match flag.as_str() {
            "--mib" => a.mib = value(),
            "--batches" => a.batches = value(),
            "--repeat" => a.repeat = value(),
            other => panic!("unknown argument {other} (--mib, --batches, --repeat)"),
        }
    }
    assert!(a.mib > 0 && a.batches > 1 && a.repeat > 0, "--mib, --batches (at least 2) and --repeat must be positive");
    a
}

/// The host work on a batch after a read: a sum the compiler cannot skip.
fn consume(batch: &[f32]) -> f64 {
    batch.iter().map(|&x| f64::from(x)).sum()
}

/// The host work before a write: a batch of values that depend on its index.
fn produce(index: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7 + index * 13) % 1024) as f32).collect()
}

fn best(repeat: usize, mut pass: impl FnMut() -> umm::Result<f64>) -> umm::Result<(Duration, f64)> {
    let mut fastest = Duration::MAX;
    let mut check = 0.0;
    for _ in 0..repeat {
        let start = Instant::now();
        check = pass()?;
        fastest = fastest.min(start.elapsed());
    }
    Ok((fastest, check))
}

fn reads(
    mm: &UniversalMemoryManager,
    buffers: &[UniversalBuffer<f32>],
    repeat: usize,
) -> umm::Result<[(Duration, f64); 2]> {
    let blocking = best(repeat, || {
        let mut total = 0.0;
        for b in buffers {
            total += consume(&b.to_vec()?);
        }
        Ok(total)
    })?;
    let overlapped = best(repeat, || {
        // The next batch's read is in flight while the host sums this one.
        let mut total = 0.0;
        let mut current = mm.read_async(&buffers[0])?;
        for next in &buffers[1..] {
            let next = mm.read_async(next)?;
            total += consume(&std::mem::replace(&mut current, next).wait()?);
        }
        Ok(total + consume(&current.wait()?))
    })?;
    Ok([blocking, overlapped])
}

fn writes(
    mm: &UniversalMemoryManager,
    buffers: &mut [UniversalBuffer<f32>],
    repeat: usize,
) -> umm::Result<[(Duration, f64); 2]> {
    let len = buffers[0].len();
    let check = |buffers: &[UniversalBuffer<f32>]| -> umm::Result<f64> {
        buffers.iter().map(|b| b.to_vec().map(|v| consume(&v))).sum()
    };
    let blocking = best(repeat, || {
        for (i, b) in buffers.iter_mut().enumerate() {
            b.write(&produce(i, len))?;
        }
        Ok(0.0)
    })?;
    let blocking = (blocking.0, check(buffers)?);
    // Different bytes in between, so that the check below sees what the asynchronous passes wrote.
    for b in buffers.iter_mut() {
        b.fill(0.0)?;
    }
    let overlapped = best(repeat, || {
        // A batch's write is in flight while the host makes the next one.
        let mut in_flight = None;
        for (i, b) in buffers.iter_mut().enumerate() {
            let batch = produce(i, len);
            if let Some(previous) = in_flight.replace(mm.write_async(b, &batch)?) {
                umm::overlap::Upload::wait(previous)?;
            }
        }
        if let Some(last) = in_flight {
            last.wait()?;
        }
        Ok(0.0)
    })?;
    Ok([blocking, (overlapped.0, check(buffers)?)])
}

fn main() -> umm::Result<()> {
    let a = args();
    let mm = UniversalMemoryManager::new()?;
    let len = a.mib << 18; // f32 elements in `mib` MiB
    let gib = (a.mib * a.batches) as f64 / 1024.0;
    println!("{} batches of {} MiB each way, best of {}", a.batches, a.mib, a.repeat);
    println!("| memory | direction | blocking | asynchronous | blocking GiB/s | asynchronous GiB/s | speed-up | sums agree |");
    println!("|---|---|---|---|---|---|---|---|");
    let targets = [
        ("host", DeviceSelector::Host),
        ("cuda", DeviceSelector::Api(Api::Cuda)),
        ("opencl", DeviceSelector::Api(Api::OpenCl)),
        ("wgpu", DeviceSelector::Api(Api::Wgpu)),
    ];
    for (name, selector) in targets {
        let options = AllocOptions::new().placement(Placement::DeviceLocal).device(selector);
        let buffers: umm::Result<Vec<UniversalBuffer<f32>>> =
            (0..a.batches).map(|_| mm.allocate_universal_with::<f32>(len, options.clone())).collect();
        let mut buffers = match buffers {
            Ok(b) => b,
            Err(e) => {
                println!("| {name} | — | skipped: {e} | | | | | |");
                continue;
            }
        };
        let device = buffers[0].device().name().to_string();
        let [w_block, w_async] = writes(&mm, &mut buffers, a.repeat)?;
        let [r_block, r_async] = reads(&mm, &buffers, a.repeat)?;
        for (direction, (block, sum_b), (asynch, sum_a)) in [("write", w_block, w_async), ("read", r_block, r_async)] {
            println!(
                "| {name} ({device}) | {direction} | {:.1} ms | {:.1} ms | {:.2} | {:.2} | {:.2} | {} |",
                block.as_secs_f64() * 1e3,
                asynch.as_secs_f64() * 1e3,
                gib / block.as_secs_f64(),
                gib / asynch.as_secs_f64(),
                block.as_secs_f64() / asynch.as_secs_f64(),
                sum_b == sum_a
            );
        }
    }
    Ok(())
}
