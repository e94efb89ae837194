//! The OpenCL backend on real devices (PoCL in CI; any OpenCL device here): what only OpenCL has (discovery,
//! zero-copy mapped memory, queued copies, sub-buffers through opencl3, limits of a device). What every backend
//! must do is in the conformance suite (`tests/conformance.rs`), which runs on every OpenCL device and placement.
//! Without a device each test prints why it skips, unless `UMM_REQUIRE_BACKENDS` names `opencl`, in which case
//! that is a failure.

#![cfg(feature = "opencl")]

use opencl3::kernel::{ExecuteKernel, Kernel};
use opencl3::memory::{Buffer, ClMem, CL_MEM_COPY_HOST_PTR, CL_MEM_READ_WRITE};
use opencl3::program::Program;
use opencl3::types::{cl_int, cl_mem, CL_BLOCKING};
use std::sync::Arc;
use std::time::{Duration, Instant};
use umm_backends::opencl::{
    self, cl_sub_buffer, fill_block_async, read_block_async, write_block_async, OpenClBackend, OpenClDevice,
};
use umm_backends::testing::skip_or_fail;
use umm_backends::{Api, Backend, DeviceKind, Error, MemoryPool, OwnedBlock, Pool, PoolConfig, PoolKind, StreamId};

const S0: StreamId = StreamId(0);

mod common;

use common::pattern;

/// Every OpenCL device, or none after `skip_or_fail`.
fn devices() -> Vec<OpenClDevice> {
    let found = opencl::discover();
    if found.devices.is_empty() {
        skip_or_fail("opencl", &format!("no OpenCL device: {}", found.skipped.join("; ")));
    }
    found.devices
}

fn pool(device: &OpenClDevice, placement: PoolKind) -> Pool<OpenClBackend> {
    device.pool(placement, PoolConfig::default()).expect("pool")
}

#[test]
fn discovery_lists_devices_with_sensible_fields() {
    for (i, d) in devices().iter().enumerate() {
        let info = d.info();
        println!("{info:#?}");
        assert_eq!(info.api, Api::OpenCl);
        assert_eq!(info.ordinal, i);
        assert!(!info.name.is_empty());
        assert!(info.total_bytes > 0);
        assert!(info.alignment.is_power_of_two() && info.alignment >= 4, "alignment {}", info.alignment);
        let bits: u64 = info.details.iter().find(|(k, _)| k == "mem_base_addr_align_bits").unwrap().1.parse().unwrap();
        assert_eq!(info.alignment, (bits / 8).max(4).next_power_of_two());
        assert!(info.max_allocation >= info.alignment);
        if info.kind == DeviceKind::Cpu {
            assert!(info.shares_memory_with_host, "a CPU device's memory is host memory");
        }
        if let Some(pci) = &info.pci_bus_id {
            let ok = pci.len() == 12
                && pci.chars().enumerate().all(|(i, c)| match i {
                    4 | 7 => c == ':',
                    10 => c == '.',
                    _ => c.is_ascii_digit() || ('a'..='f').contains(&c),
                });
            assert!(ok, "pci bus id {pci} is not dddd:bb:dd.f");
        }
        assert!(info.details.iter().any(|(k, v)| k == "platform" && !v.is_empty()));
    }
}

/// The child half of `discovery_without_platforms_is_instant_and_silent`: does nothing unless asked.
#[test]
fn discovery_child_without_platforms() {
    if std::env::var_os("UMM_OPENCL_DISCOVERY_CHILD").is_none() {
        return;
    }
    let found = opencl::discover();
    println!("UMM-CHILD devices={} skipped={:?}", found.devices.len(), found.skipped);
}

#[test]
fn discovery_without_platforms_is_instant_and_silent() {
    // An ICD loader pointed at a vendor directory without a usable ICD has no platform (or, without a loader, the
    // library is missing): discovery must return at once, with a reason, no panic and nothing on stderr.
    let empty = std::env::temp_dir().join(format!("umm-no-icd-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    // A registration whose library is missing must be ignored just as quietly.
    std::fs::write(empty.join("missing.icd"), "/nonexistent/libOpenCL-missing-vendor.so\n").unwrap();
    let start = Instant::now();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["discovery_child_without_platforms", "--exact", "--nocapture", "--test-threads=1"])
        .env("UMM_OPENCL_DISCOVERY_CHILD", "1")
        .env("OCL_ICD_VENDORS", &empty)
        .env("OCL_ICD_FILENAMES", "")
        .env_remove("OPENCL_DYLIB_PATH")
        .output()
        .unwrap();
    let elapsed = start.elapsed();
    let _ = std::fs::remove_dir_all(&empty);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {stdout}\n{stderr}");
    let line = stdout.lines().find_map(|l| l.find("UMM-CHILD").map(|i| &l[i..])).expect("child ran discovery");
    assert!(line.contains("devices=0"), "{line}");
    assert!(line.contains("no platform") || line.contains("libOpenCL.so.1"), "{line}");
    assert!(stderr.trim().is_empty(), "discovery wrote to stderr: {stderr}");
    assert!(elapsed < Duration::from_secs(5), "discovery took {elapsed:?}");
}

/// The child half of `first_discovery_from_many_threads_is_safe`: does nothing unless asked.
#[test]
fn discovery_child_from_many_threads() {
    let Some(threads) = std::env::var("UMM_OPENCL_THREADS_CHILD").ok().and_then(|v| v.parse::<usize>().ok()) else {
        return;
    };
    let barrier = Arc::new(std::sync::Barrier::new(threads));
    let found: Vec<(usize, String)> = (0..threads)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let found = opencl::discover();
                let names: Vec<String> = found.devices.iter().map(|d| d.info().name.clone()).collect();
                (found.devices.len(), format!("{names:?} skipped {:?}", found.skipped))
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let (counts, found): (Vec<usize>, Vec<String>) = found.into_iter().unzip();
    println!("UMM-CHILD counts={counts:?}");
    println!("UMM-FOUND {}", found[0]);
}

/// Runs `discovery_child_from_many_threads` in a fresh process with `threads` threads; returns each thread's
/// device count and what the first one found.
fn discover_in_a_fresh_process(threads: usize) -> (Vec<usize>, String) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["discovery_child_from_many_threads", "--exact", "--nocapture", "--test-threads=1"])
        .env("UMM_OPENCL_THREADS_CHILD", threads.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed ({:?}): {stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
    let line = |tag: &str| stdout.lines().find_map(|l| l.find(tag).map(|i| l[i + tag.len()..].to_string()));
    let counts = line("UMM-CHILD counts=").expect("child ran");
    let counts = counts.trim_matches(['[', ']']).split(", ").map(|c| c.parse().expect("a count")).collect();
    (counts, line("UMM-FOUND ").unwrap_or_default())
}

#[test]
fn first_discovery_from_many_threads_is_safe() {
    // Without a runtime every thread trivially sees no device: report that (or fail when opencl is required)
    // rather than pass on a race that never happened.
    if devices().is_empty() {
        return;
    }
    // What one thread of a fresh process finds is the reference. (Not this process's own list: a GPU in
    // exclusive-process compute mode, held by this process's other tests, is hidden from a second process.)
    let (single, reference) = discover_in_a_fresh_process(1);
    if single[0] == 0 {
        skip_or_fail("opencl", &format!("a fresh process finds no OpenCL device ({reference})"));
        return;
    }
    // A fresh process per round, so that every round races the runtime's first initialisation.
    for _ in 0..4 {
        let (counts, found) = discover_in_a_fresh_process(8);
        // Every thread sees what one thread sees alone, not merely the same number as its siblings (eight
        // threads that all found nothing would agree too).
        assert!(counts.iter().all(|&c| c == single[0]), "{counts:?}: {found}; one thread alone: {reference}");
    }
}

#[test]
fn host_pinned_blocks_are_zero_copy_on_host_shared_devices() {
    let all = devices();
    let (shared, discrete): (Vec<_>, Vec<_>) = all.into_iter().partition(|d| d.info().shares_memory_with_host);
    if shared.is_empty() && !discrete.is_empty() {
        // OpenCL is present, only no device of it maps host memory: a skip, not a missing backend.
        let names: Vec<_> = discrete.iter().map(|d| d.info().name.clone()).collect();
        let reason = format!("no device shares memory with the host ({})", names.join(", "));
        skip_or_fail("opencl-shared-memory", &reason);
    }
    for d in shared {
        let p: Arc<dyn MemoryPool> = Arc::new(pool(&d, PoolKind::HostPinned));
        let mut block = OwnedBlock::allocate(Arc::clone(&p), 1000, S0, false).unwrap();
        let data = pattern(1000, 7);
        block.host_bytes_mut().expect("mapped").copy_from_slice(&data);
        let mut back = vec![0; 1000];
        block.read(0, &mut back).unwrap();
        assert_eq!(back, data, "bytes written through the mapping are what the queue reads");
        block.write(0, &data[..500].iter().map(|x| !x).collect::<Vec<_>>()).unwrap();
        let host = block.host_bytes().unwrap();
        assert!(host[..500].iter().zip(&data).all(|(h, d)| *h == !d) && host[500..] == data[500..]);
    }
}

#[test]
fn non_blocking_copies_and_fills_complete_in_queue_order() {
    for d in devices() {
        let p = pool(&d, PoolKind::DeviceLocal);
        let b = p.allocate(1 << 20, S0).unwrap();
        let data = pattern(1 << 20, 3);
        let w = write_block_async(&p, &b, 0, data.clone()).unwrap();
        let fill = fill_block_async(&p, &b, 100, 50, 0xEE).unwrap();
        let r = read_block_async(&p, &b, 0, 1 << 20).unwrap();
        let back = r.wait().unwrap();
        assert!(fill.is_complete().unwrap(), "in-order queue: the fill finished before the later read");
        assert!(w.is_complete().unwrap());
        assert_eq!(w.wait().unwrap(), data, "the written buffer comes back for reuse");
        let mut expect = data.clone();
        expect[100..150].fill(0xEE);
        assert_eq!(back, expect);
        // Dropping a pending read without waiting is safe (it waits).
        drop(read_block_async(&p, &b, 0, 1 << 20).unwrap());
        assert!(matches!(read_block_async(&p, &b, (1 << 20) - 1, 2), Err(Error::OutOfBounds(_))));
        p.free(&b).unwrap();
        assert!(matches!(write_block_async(&p, &b, 0, vec![1]), Err(Error::UnknownBlock(_))));
    }
}

const M: usize = 37;
const K: usize = 41;
const N: usize = 29;

const MATMUL: &str = r#"
__kernel void matmul(__global const float* a, __global const float* b, __global float* c,
                     int m, int k, int n, int accumulate) {
    int i = get_global_id(0);
    int j = get_global_id(1);
    if (i >= m || j >= n) return;
    float acc = accumulate ? c[i * n + j] : 0.0f;
    for (int p = 0; p < k; ++p) acc += a[i * k + p] * b[p * n + j];
    c[i * n + j] = acc;
}
"#;

fn matrices() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let f = |seed: u32, n: usize| -> Vec<f32> {
        pattern(n * 4, seed)
            .chunks(4)
            .map(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) % 2001) as f32 / 997.0 - 1.0)
            .collect()
    };
    (f(11, M * K), f(12, K * N), f(13, M * N))
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats_of(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

struct Matmul {
    kernel: Kernel,
}

impl Matmul {
    fn build(d: &OpenClDevice) -> Self {
        let program = Program::create_and_build_from_source(d.context(), MATMUL, "").expect("kernel builds");
        Self { kernel: Kernel::create(&program, "matmul").unwrap() }
    }

    fn run(&self, d: &OpenClDevice, a: cl_mem, b: cl_mem, c: cl_mem, accumulate: bool) {
        let (m, k, n, acc) = (M as cl_int, K as cl_int, N as cl_int, cl_int::from(accumulate));
        // SAFETY: the arguments match the kernel's signature: three live buffers of at least M*K, K*N and M*N
        // floats, then four ints; the kernel stays inside those bounds.
        let event = unsafe {
            ExecuteKernel::new(&self.kernel)
                .set_arg(&a)
                .set_arg(&b)
                .set_arg(&c)
                .set_arg(&m)
                .set_arg(&k)
                .set_arg(&n)
                .set_arg(&acc)
                .set_global_work_sizes(&[M, N])
                .enqueue_nd_range(d.queue())
                .unwrap()
        };
        event.wait().unwrap();
    }

    /// The same kernel on fresh standalone buffers (C starts as `c0`).
    fn fresh(&self, d: &OpenClDevice, a: &[f32], b: &[f32], c0: &[f32], accumulate: bool) -> Vec<f32> {
        let make = |v: &[f32]| -> Buffer<f32> {
            // SAFETY: COPY_HOST_PTR copies `v.len()` floats from a live slice during the call.
            unsafe {
                Buffer::<f32>::create(
                    d.context(),
                    CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                    v.len(),
                    v.as_ptr() as *mut _,
                )
                .unwrap()
            }
        };
        let (ba, bb, bc) = (make(a), make(b), make(c0));
        self.run(d, ba.get(), bb.get(), bc.get(), accumulate);
        let mut out = vec![0f32; M * N];
        // SAFETY: a blocking read of M*N floats into a slice of that length.
        unsafe { d.queue().enqueue_read_buffer(&bc, CL_BLOCKING, 0, &mut out, &[]).unwrap() };
        out
    }
}

fn assert_bits_eq(pooled: &[f32], fresh: &[f32], what: &str) {
    assert_eq!(pooled.len(), fresh.len());
    for (i, (p, f)) in pooled.iter().zip(fresh).enumerate() {
        assert_eq!(p.to_bits(), f.to_bits(), "{what}: element {i} differs: pooled {p}, fresh {f}");
    }
}

#[test]
fn kernels_read_read_only_and_host_pinned_pool_buffers() {
    for d in devices() {
        let mm = Matmul::build(&d);
        let (a, b, c0) = matrices();
        let fresh = mm.fresh(&d, &a, &b, &c0, false);
        let weights: Arc<dyn MemoryPool> = Arc::new(pool(&d, PoolKind::ReadOnly));
        let staging: Arc<dyn MemoryPool> = Arc::new(pool(&d, PoolKind::HostPinned));
        let out_pool: Arc<dyn MemoryPool> = Arc::new(pool(&d, PoolKind::DeviceLocal));
        // Garbage first, then the operands at non-zero origins of reused memory, filled once.
        let mut junk = OwnedBlock::allocate(Arc::clone(&weights), 4096, S0, false).unwrap();
        junk.fill(0, 4096, 0xFF).unwrap();
        let pad = OwnedBlock::allocate(Arc::clone(&weights), 64, S0, false).unwrap();
        drop(junk);
        let mut wa = OwnedBlock::allocate(Arc::clone(&weights), (M * K * 4) as u64, S0, false).unwrap();
        wa.write(0, &bytes_of(&a)).unwrap();
        let mut wb = OwnedBlock::allocate(Arc::clone(&staging), (K * N * 4) as u64, S0, false).unwrap();
        match wb.host_bytes_mut() {
            Some(host) => host.copy_from_slice(&bytes_of(&b)), // zero-copy on host-shared devices
            None => wb.write(0, &bytes_of(&b)).unwrap(),
        }
        let c = OwnedBlock::allocate(Arc::clone(&out_pool), (M * N * 4) as u64, S0, false).unwrap();
        let sa = opencl::block_sub_buffer(&wa).unwrap();
        let sb = opencl::block_sub_buffer(&wb).unwrap();
        let sc = opencl::block_sub_buffer(&c).unwrap();
        mm.run(&d, sa.as_raw(), sb.as_raw(), sc.as_raw(), false);
        let mut out = vec![0u8; M * N * 4];
        c.read(0, &mut out).unwrap();
        assert_bits_eq(&floats_of(&out), &fresh, "A in a ReadOnly pool, B in a HostPinned pool");
        // A sub-buffer also works through opencl3's own typed Buffer.
        let typed: Buffer<f32> = opencl::block_sub_buffer(&wa).unwrap().into_buffer();
        let mut first = vec![0f32; K];
        // SAFETY: a blocking read of K floats from a sub-buffer of M*K floats.
        unsafe { d.queue().enqueue_read_buffer(&typed, CL_BLOCKING, 0, &mut first, &[]).unwrap() };
        assert_bits_eq(&first, &a[..K], "ReadOnly block read through opencl3");
        drop(pad);
    }
}

#[test]
fn requests_over_the_max_allocation_are_refused() {
    for d in devices() {
        let p = pool(&d, PoolKind::DeviceLocal);
        let max = d.info().max_allocation;
        assert_eq!(p.backend().max_segment_size(), max);
        match p.allocate(max + 1, S0) {
            Err(Error::TooLarge { requested, max: m, .. }) => assert!(requested > max && m == max),
            other => panic!("expected TooLarge over {max} bytes, got {other:?}"),
        }
        assert_eq!(p.stats().reserved_bytes.current, 0, "nothing was created for a refused request");
        assert!(matches!(p.allocate(0, S0), Err(Error::ZeroSize { .. })));

        let b = p.allocate(10_000, S0).unwrap();
        p.free(&b).unwrap();
        assert!(matches!(cl_sub_buffer(&p, &b), Err(Error::UnknownBlock(_))));
    }
}

/// Asynchronous transfers through a plain handle could land after the block was freed and its memory lent to an
/// owned block as a host slice, so they are refused on host-mapped memory; blocking copies (under the pool's
/// lock) and owned blocks' device copies are not.
#[test]
fn plain_handles_get_no_asynchronous_transfers_on_host_mapped_memory() {
    for d in devices() {
        let p = pool(&d, PoolKind::HostPinned);
        let device = pool(&d, PoolKind::DeviceLocal);
        let (b, on_device) = (p.allocate(4096, S0).unwrap(), device.allocate(4096, S0).unwrap());
        let mapped = p.host_ptr(&b).is_some();
        assert_eq!(mapped, d.info().shares_memory_with_host, "HostPinned is mapped exactly on host-unified devices");
        let refused = |e: Error| matches!(e, Error::Unsupported { ref what, .. } if what.contains("host-mapped"));
        let results = [
            write_block_async(&p, &b, 0, vec![1; 16]).map(drop),
            read_block_async(&p, &b, 0, 16).map(drop),
            fill_block_async(&p, &b, 0, 16, 1).map(drop),
            opencl::copy_block(&device, &on_device, &p, &b, 16),
            opencl::copy_block(&p, &b, &device, &on_device, 16),
        ];
        for (i, r) in results.into_iter().enumerate() {
            if mapped {
                assert!(refused(r.unwrap_err()), "transfer {i}");
            } else {
                r.unwrap();
            }
        }
        p.write(&b, 0, &[9; 16]).unwrap();
        let mut back = [0; 16];
        p.read(&b, 0, &mut back).unwrap();
        assert_eq!(back, [9; 16], "blocking copies work on every placement");
        p.free(&b).unwrap();
        device.free(&on_device).unwrap();
    }
}

#[test]
fn pools_of_one_device_share_its_memory_count() {
    for d in devices() {
        let p = pool(&d, PoolKind::DeviceLocal);
        let q = pool(&d, PoolKind::HostPinned);
        let before = q.backend().free_bytes();
        let b = p.allocate(3 << 20, S0).unwrap();
        assert!(q.backend().free_bytes() < before, "segments of one pool count against the device for all");
        p.free(&b).unwrap();
        p.release_cached();
        assert_eq!(q.backend().free_bytes(), before);
    }
}

/// The pools' device copy (`MemoryPool::copy_on_device_from`): between two pools of one device it is
/// `clEnqueueCopyBuffer` and names its path; a length past either block is refused before the device sees it; a
/// pool of another kind is no path (the caller stages through the host).
#[test]
fn pools_of_one_device_copy_on_the_device_and_refuse_a_length_past_a_block() {
    for device in devices() {
        let (a, b) = (pool(&device, PoolKind::DeviceLocal), pool(&device, PoolKind::DeviceLocal));
        let data = pattern(4096, 7);
        let src = a.allocate(4096, S0).unwrap();
        let dst = b.allocate(4096, S0).unwrap();
        a.write(&src, 0, &data).unwrap();
        let path = MemoryPool::copy_on_device_from(&b, &dst, &a, &src, 4096).unwrap();
        assert_eq!(path, Some(umm_backends::DevicePath::OpenClDevice));
        let mut back = vec![0; 4096];
        b.read(&dst, 0, &mut back).unwrap();
        assert_eq!(back, data);

        let past = MemoryPool::copy_on_device_from(&b, &dst, &a, &src, src.size() + 1).unwrap_err();
        assert!(matches!(past, Error::OutOfBounds(_)), "{past}");

        let host = Pool::new(umm_backends::HostBackend::new("host", 1 << 30), PoolConfig::default()).unwrap();
        let on_host = host.allocate(4096, S0).unwrap();
        assert_eq!(MemoryPool::copy_on_device_from(&b, &dst, &host, &on_host, 4096).unwrap(), None);
        assert_eq!(MemoryPool::copy_on_device_from(&host, &on_host, &a, &src, 4096).unwrap(), None);
        for (pool, block) in [(&a, &src), (&b, &dst)] {
            pool.free(block).unwrap();
        }
        host.free(&on_host).unwrap();
    }
}
