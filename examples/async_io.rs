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

/// The host work on a batch after a read: a sum the compiler cannot skip, at memory speed (about as long as a
/// copy of the batch, so that overlapping the two could at best halve the time).
fn consume(batch: &[u32]) -> u64 {
    batch.iter().fold(0u64, |sum, &x| sum.wrapping_add(u64::from(x)))
}

/// The host work before a write: a batch that depends on its index, made at memory speed.
fn produce(index: usize, batch: &mut [u32]) {
    batch.fill(index as u32);
    let middle = batch.len() / 2;
    batch[middle] = 7;
}

fn best(repeat: usize, mut pass: impl FnMut() -> umm::Result<u64>) -> umm::Result<(Duration, u64)> {
    let mut fastest = Duration::MAX;
    let mut check = 0;
    for _ in 0..repeat {
        let start = Instant::now();
        check = pass()?;
        fastest = fastest.min(start.elapsed());
    }
    Ok((fastest, check))
}

fn reads(
    mm: &UniversalMemoryManager,
    buffers: &[UniversalBuffer<u32>],
    repeat: usize,
) -> umm::Result<[(Duration, u64); 2]> {
    // One host vector, touched once before timing: the passes measure copies, not page faults.
    let mut host = vec![0u32; buffers[0].len()];
    let blocking = best(repeat, || {
        let mut total = 0u64;
        for b in buffers {
            b.read(&mut host)?;
            total = total.wrapping_add(consume(&host));
        }
        Ok(total)
    })?;
    let overlapped = best(repeat, || {
        // The next batch's read is in flight while the host sums this one.
        let mut total = 0u64;
        let mut current = mm.read_async(&buffers[0])?;
        for next in &buffers[1..] {
            let next = mm.read_async(next)?;
            std::mem::replace(&mut current, next).wait_into(&mut host)?;
            total = total.wrapping_add(consume(&host));
        }
        current.wait_into(&mut host)?;
        Ok(total.wrapping_add(consume(&host)))
    })?;
    Ok([blocking, overlapped])
}

fn writes(
    mm: &UniversalMemoryManager,
    buffers: &mut [UniversalBuffer<u32>],
    repeat: usize,
) -> umm::Result<[(Duration, u64); 2]> {
    let check = |buffers: &[UniversalBuffer<u32>]| -> umm::Result<u64> {
        buffers.iter().try_fold(0u64, |sum, b| Ok(sum.wrapping_add(consume(&b.to_vec()?))))
    };
    // Two host vectors, touched once before timing: one is written from while the next batch is made in the other.
    let mut host = [vec![0u32; buffers[0].len()], vec![0u32; buffers[0].len()]];
    let blocking = best(repeat, || {
        for (i, b) in buffers.iter_mut().enumerate() {
            produce(i, &mut host[0]);
            b.write(&host[0])?;
        }
        Ok(0)
    })?;
    let blocking = (blocking.0, check(buffers)?);
    // Different bytes in between, so that the check below sees what the asynchronous passes wrote.
    for b in buffers.iter_mut() {
        b.fill(0)?;
    }
    let overlapped = best(repeat, || {
        // A batch's write is in flight while the host makes the next one; staging copies the batch, so its host
        // vector is free again once the write has started.
        let mut in_flight = None;
        for (i, b) in buffers.iter_mut().enumerate() {
            let batch = &mut host[i % 2];
            produce(i, batch);
            if let Some(previous) = in_flight.replace(mm.write_async(b, batch)?) {
                umm::overlap::Upload::wait(previous)?;
            }
        }
        if let Some(last) = in_flight {
            last.wait()?;
        }
        Ok(0)
    })?;
    Ok([blocking, (overlapped.0, check(buffers)?)])
}

fn main() -> umm::Result<()> {
    let a = args();
    let mm = UniversalMemoryManager::new()?;
    let len = a.mib << 18; // u32 elements in `mib` MiB
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
        let buffers: umm::Result<Vec<UniversalBuffer<u32>>> =
            (0..a.batches).map(|_| mm.allocate_universal_with::<u32>(len, options.clone())).collect();
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
