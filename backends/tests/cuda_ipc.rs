//! A block shared with a second process ([`CudaPool::export`], [`ImportedMemory::open`]), of a plain segment (CUDA
//! IPC) and of a virtual reservation (its pages as file descriptors): the child maps the parent's block, reads
//! what the parent wrote and writes back, and the parent sees the write. The child is this test binary again, run for `ipc_child` with the handle in an environment variable. Skips
//! without a GPU (fails where `UMM_REQUIRE_BACKENDS` names `cuda`).
#![cfg(feature = "cuda")]

use std::process::Command;
use umm_backends::cuda::{self, CudaDevice, ImportedMemory};
use umm_backends::testing::skip_or_fail;
use umm_backends::{Error, PoolConfig, PoolKind, SegmentMode, StreamId};

const MIB: u64 = 1 << 20;
/// The variable that hands the child its handle, in hexadecimal.
const HANDLE: &str = "UMM_IPC_TEST_HANDLE";
const LEN: usize = (3 * MIB) as usize;

fn device() -> Option<CudaDevice> {
    let found = cuda::discover();
    let device = found.devices.into_iter().next();
    if device.is_none() {
        skip_or_fail("cuda", &found.skipped.join("; "));
    }
    device
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Exports a block of a pool in `mode`, lets a child process read it and write it over, and checks the write.
/// The shared block starts neither at its segment's first byte nor on a page boundary, and spans pages.
fn shared_with_a_child(dev: &CudaDevice, mode: SegmentMode) {
    // 2 MiB pages, so that the 3 MiB block after the first spans three of them.
    let page_size = (mode == SegmentMode::Virtual).then_some(2 * MIB);
    let config = PoolConfig { segment_mode: mode, page_size, ..PoolConfig::default() };
    let pool = dev.caching_pool(PoolKind::DeviceLocal, config).expect("a pool");
    let first = pool.allocate(LEN as u64 + 512, StreamId(0)).expect("allocates");
    let block = pool.allocate(LEN as u64, StreamId(0)).expect("allocates");
    pool.pool().write(&block, 0, &pattern(7)).expect("writes");
    let handle = pool.export(&block).expect("a block is exported");
    assert_eq!(handle.is_pages(), mode == SegmentMode::Virtual, "{handle:?}");
    assert!(handle.offset() > 0 && handle.len() >= LEN as u64, "{handle:?}");
    let hex: String = handle.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "ipc_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(HANDLE, hex)
        .output()
        .expect("the child runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "{mode:?}: the child failed:\n{text}");
    let mut back = vec![0u8; LEN];
    pool.pool().read(&block, 0, &mut back).expect("reads");
    assert!(back == pattern(9), "{mode:?}: the parent sees the child's write");
    drop(handle);
    pool.free(&block).unwrap();
    pool.free(&first).unwrap();
}

#[test]
fn a_second_process_reads_and_writes_an_exported_block() {
    if std::env::var_os(HANDLE).is_some() {
        return; // the child runs `ipc_child` only
    }
    let Some(dev) = device() else { return };
    shared_with_a_child(&dev, SegmentMode::Plain);
    if dev.supports_virtual_memory() {
        shared_with_a_child(&dev, SegmentMode::Virtual);
    }
    // Bytes that are no handle are refused before any driver call.
    let err = ImportedMemory::open(&dev, &[0; 79]).err().expect("refused");
    assert!(matches!(&err, Error::InvalidConfig(m) if m.contains("not an IPC handle")), "{err}");
    // A handle naming descriptors of a process that does not exist: the copy fails, saying which call.
    let mut bytes = vec![b'e'];
    for word in [u32::MAX.to_le_bytes().to_vec(), (2u64 << 20).to_le_bytes().to_vec(), 1u64.to_le_bytes().to_vec()] {
        bytes.extend(word);
    }
    bytes.extend(0u64.to_le_bytes());
    bytes.extend(4096u64.to_le_bytes());
    bytes.extend(3i32.to_le_bytes());
    let err = ImportedMemory::open(&dev, &bytes).err().expect("refused");
    assert!(matches!(&err, Error::Driver { call, .. } if call == "pidfd_open"), "{err}");
}

/// The child of `a_second_process_reads_and_writes_an_exported_block`.
#[test]
#[ignore = "run by a_second_process_reads_and_writes_an_exported_block in a process of its own"]
fn ipc_child() {
    let hex = std::env::var(HANDLE).expect("run by a_second_process_reads_and_writes_an_exported_block");
    let bytes: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    let dev = device().expect("the parent's device");
    let imported = ImportedMemory::open(&dev, &bytes).expect("opens the parent's block");
    let mut seen = vec![0u8; LEN];
    imported.read(0, &mut seen).expect("reads");
    assert!(seen == pattern(7), "the child reads what the parent wrote");
    assert!(imported.read(imported.len(), &mut [0u8; 1]).is_err(), "past the block's end");
    imported.write(0, &pattern(9)).expect("writes");
}
