//! The Prefetcher on whatever the machine has: batches of a fallible source (a stand-in for files read from
//! disk, one of which fails) are uploaded ahead by worker threads to the first accelerator found (CUDA, OpenCL or
//! wgpu; else the host), consumed in order, and checked against their sums. The failed read comes through in
//! its place; at the end every buffer is back in its pool.
//!
//! `cargo run --release --example prefetch -- [--batches N] [--lookahead L] [--workers W]`
//! Exit status 0 when every batch arrived intact and in order, 1 otherwise.

use std::process::ExitCode;
use std::time::Instant;
use umm::overlap::PrefetchError;
use umm::{Api, DeviceSelector, UniversalMemoryManager};

/// A batch source error: the stand-in for a file that could not be read.
#[derive(Debug)]
struct ReadError(usize);

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "batch file {} could not be read", self.0)
    }
}

/// Batch `i`: a length that varies with `i`, contents that name it.
fn batch(i: usize) -> Vec<f32> {
    let len = 50_000 + (i * 7919) % 200_000;
    (0..len).map(|j| ((i * 31 + j) % 1024) as f32).collect()
}

fn sum(xs: &[f32]) -> f64 {
    xs.iter().map(|&x| f64::from(x)).sum()
}

fn parse(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args.get(i + 1).ok_or(format!("{name} needs a value"))?.parse().map_err(|e| format!("{name}: {e}")),
    }
}

fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let (count, lookahead, workers) = (parse("--batches", 200)?, parse("--lookahead", 3)?, parse("--workers", 2)?);
    let mm = UniversalMemoryManager::new()?;
    let selector = [Api::Cuda, Api::OpenCl, Api::Wgpu]
        .into_iter()
        .find(|&api| mm.devices().iter().any(|d| d.has_api(api)))
        .map_or(DeviceSelector::Host, DeviceSelector::Api);
    let failing = count / 3;
    let source = (0..count).map(move |i| if i == failing { Err(ReadError(i)) } else { Ok(batch(i)) });

    let start = Instant::now();
    let (mut good, mut bytes, mut bad) = (0usize, 0u64, 0usize);
    let mut device = String::new();
    for (i, item) in mm.prefetcher(lookahead, workers).device(selector).try_wrap(source)?.enumerate() {
        match item {
            Ok(b) => {
                // A kernel would read `b` here (b.cuda_view, b.opencl_buffer, b.wgpu_binding); read it back instead.
                let got = b.to_vec()?;
                if b.index() != i as u64 || sum(&got) != sum(&batch(i)) {
                    eprintln!("batch {i} arrived wrong (index {}, {} elements)", b.index(), got.len());
                    bad += 1;
                }
                device = b.device().name().to_string();
                bytes += b.size_bytes();
                good += 1;
            }
            Err(PrefetchError::Source(e)) if i == failing => println!("batch {i}: {e} (skipped)"),
            Err(e) => {
                eprintln!("batch {i}: {e}");
                bad += 1;
            }
        }
    }
    let elapsed = start.elapsed();
    println!(
        "{good} batches ({:.1} MiB) prefetched to {device} ({}) with lookahead {lookahead} and {workers} workers in \
         {:.1} ms ({:.2} GB/s including the read-back checks)",
        bytes as f64 / f64::from(1u32 << 20),
        selector.describe(),
        elapsed.as_secs_f64() * 1e3,
        bytes as f64 / elapsed.as_secs_f64() / 1e9
    );
    // On CUDA a buffer dropped while its stream may still use it goes back to its pool once that work is done;
    // a cleanup round collects those whose work has finished (all of them here: every batch was read back).
    mm.cleanup();
    let left = mm.global_memory_stats().total.allocated_bytes.current;
    println!("allocated after the loop: {left} bytes");
    if bad > 0 || good != count - 1 || left != 0 {
        eprintln!("{bad} batches wrong, {good} of {} arrived, {left} bytes still allocated", count - 1);
        return Ok(ExitCode::FAILURE);
    }
    println!("every batch arrived intact and in order");
    Ok(ExitCode::SUCCESS)
}
