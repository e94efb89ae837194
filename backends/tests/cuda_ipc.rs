//! A block shared with a second process through CUDA IPC ([`CudaPool::export`], [`ImportedMemory::open`]): the
//! child maps the parent's block, reads what the parent wrote and writes back, and the parent sees the write.
//! The child is this test binary again, run for `ipc_child` with the handle in an environment variable. Skips
//! without a GPU (fails where `UMM_REQUIRE_BACKENDS` names `cuda`).
#![cfg(feature = "cuda")]

use std::process::Command;
use umm_backends::cuda::{self, CudaDevice, ImportedMemory, IpcHandle};
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

#[test]
fn a_second_process_reads_and_writes_an_exported_block() {
    if std::env::var_os(HANDLE).is_some() {
        return; // the child runs `ipc_child` only
    }
    let Some(dev) = device() else { return };
    let config = PoolConfig { segment_mode: SegmentMode::Plain, ..PoolConfig::default() };
    let pool = dev.caching_pool(PoolKind::DeviceLocal, config).expect("a plain pool");
    // Two blocks of one segment, so that the shared one does not start at the segment's first byte.
    let first = pool.allocate(LEN as u64, StreamId(0)).expect("allocates");
    let block = pool.allocate(LEN as u64, StreamId(0)).expect("allocates");
    pool.pool().write(&block, 0, &pattern(7)).expect("writes");
    let handle = pool.export(&block).expect("a block of a plain segment is exported");
    assert_eq!(IpcHandle::from_bytes(&handle.to_bytes()).unwrap(), handle);
    assert!(handle.offset > 0 && handle.len >= LEN as u64, "{handle:?}");
    let hex: String = handle.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "ipc_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(HANDLE, hex)
        .output()
        .expect("the child runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "the child failed:\n{text}");
    let mut back = vec![0u8; LEN];
    pool.pool().read(&block, 0, &mut back).expect("reads");
    assert!(back == pattern(9), "the parent sees the child's write");
    pool.free(&block).unwrap();
    pool.free(&first).unwrap();

    // A block of a virtual reservation has no IPC handle: refused, saying how to share.
    let virtual_pool = dev.caching_pool(
        PoolKind::DeviceLocal,
        PoolConfig { segment_mode: SegmentMode::Virtual, ..PoolConfig::default() },
    );
    if let Ok(virtual_pool) = virtual_pool {
        let large = virtual_pool.allocate(64 * MIB, StreamId(0)).expect("allocates");
        match virtual_pool.export(&large) {
            Err(Error::Unsupported { what, .. }) => assert!(what.contains("SegmentMode::Plain"), "{what}"),
            other => panic!("a virtual block exported: {other:?}"),
        }
        virtual_pool.free(&large).unwrap();
    }
    assert!(IpcHandle::from_bytes(&[0; 79]).is_err(), "a handle of the wrong length");
}

/// The child of `a_second_process_reads_and_writes_an_exported_block`.
#[test]
#[ignore = "run by a_second_process_reads_and_writes_an_exported_block in a process of its own"]
fn ipc_child() {
    let hex = std::env::var(HANDLE).expect("run by a_second_process_reads_and_writes_an_exported_block");
    let bytes: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    let handle = IpcHandle::from_bytes(&bytes).expect("a handle");
    let dev = device().expect("the parent's device");
    let imported = ImportedMemory::open(&dev, &handle).expect("opens the parent's block");
    let mut seen = vec![0u8; LEN];
    imported.read(0, &mut seen).expect("reads");
    assert!(seen == pattern(7), "the child reads what the parent wrote");
    assert!(imported.read(handle.len, &mut [0u8; 1]).is_err(), "past the block's end");
    imported.write(0, &pattern(9)).expect("writes");
}
