//! A block of device memory shared with a second process: this program allocates 64 MiB in the default pool (a
//! virtual reservation, so the handle carries its pages as file descriptors), writes a pattern, and runs itself
//! again as the child with the handle's bytes in hexadecimal; the child opens the block, checks the pattern and
//! writes another, which the parent then reads. Any channel can carry the bytes (a pipe, a socket, a file); the
//! parent keeps the handle, and so the descriptors, until the child has opened it.
//!
//! `cargo run --release -p umm-backends --features cuda --example share_between_processes`

use std::process::Command;
use umm_backends::cuda::{self, CudaDevice, ImportedMemory};
use umm_backends::{PoolConfig, PoolKind, StreamId};

const LEN: usize = 64 << 20;

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)).collect()
}

fn device() -> CudaDevice {
    let found = cuda::discover();
    found.devices.into_iter().next().unwrap_or_else(|| {
        eprintln!("no CUDA device: {}", found.skipped.join("; "));
        std::process::exit(1);
    })
}

fn main() {
    if let Some(hex) = std::env::args().nth(1) {
        return child(&hex);
    }
    let dev = device();
    let pool = dev.caching_pool(PoolKind::DeviceLocal, PoolConfig::default()).expect("a pool");
    let block = pool.allocate(LEN as u64, StreamId(0)).expect("64 MiB");
    pool.pool().write(&block, 0, &pattern(1)).expect("written");
    let handle = pool.export(&block).expect("exported");
    let kind = match handle.pages() {
        Some((page, fds)) => format!("{} pages of {} MiB as file descriptors", fds.len(), page >> 20),
        None => "a CUDA IPC handle of its segment".to_string(),
    };
    let hex: String = handle.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    println!("parent: shared {} MiB as {kind} ({} bytes of handle)", LEN >> 20, hex.len() / 2);
    let status = Command::new(std::env::current_exe().expect("this program")).arg(hex).status().expect("the child");
    assert!(status.success(), "the child failed");
    let mut back = vec![0; LEN];
    pool.pool().read(&block, 0, &mut back).expect("read");
    assert!(back == pattern(2), "the parent does not see the child's write");
    println!("parent: the child's write is there");
    drop(handle);
    pool.free(&block).expect("freed");
}

fn child(hex: &str) {
    let bytes: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    let imported = ImportedMemory::open(&device(), &bytes).expect("the parent's block opens");
    let mut seen = vec![0; LEN];
    imported.read(0, &mut seen).expect("read");
    assert!(seen == pattern(1), "the child does not see the parent's pattern");
    println!("child: the parent's pattern is there");
    imported.write(0, &pattern(2)).expect("written");
}
