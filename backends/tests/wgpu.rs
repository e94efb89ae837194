//! The wgpu backend on a real adapter (lavapipe in CI: `mesa-vulkan-drivers libvulkan1`). Without an adapter the
//! tests skip, unless `UMM_REQUIRE_BACKENDS` names wgpu.
#![cfg(feature = "wgpu")]

use umm_backends::wgpu_backend::{self, discover, WgpuBackend, WgpuDevice, WgpuPoolKind};
use umm_backends::{skip_or_fail, BlockHandle, DeviceKind, Error, Pool, PoolConfig, PoolPlacement, Strategy, StreamId};

const S0: StreamId = StreamId(0);

/// Every adapter (Vulkan first: lavapipe in CI), after skip_or_fail when there is none.
fn devices() -> Vec<WgpuDevice> {
    let discovery = discover();
    let mut devices = discovery.devices;
    devices.sort_by_key(|d| d.adapter_info().backend != wgpu::Backend::Vulkan);
    if devices.is_empty() {
        skip_or_fail("wgpu", &format!("no wgpu adapter: {}", discovery.skipped.join("; ")));
    }
    devices
}

/// The first adapter of [`devices`].
fn device() -> Option<WgpuDevice> {
    devices().into_iter().next()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

fn detail<'a>(device: &'a WgpuDevice, key: &str) -> Option<&'a str> {
    device.info().details.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

#[test]
fn discovery_describes_every_adapter() {
    let discovery = discover();
    for reason in &discovery.skipped {
        eprintln!("skipped: {reason}");
    }
    if discovery.devices.is_empty() {
        return skip_or_fail("wgpu", &discovery.skipped.join("; "));
    }
    for (i, d) in discovery.devices.iter().enumerate() {
        let info = d.info();
        eprintln!("{i}: {} [{}] {:?}", info.name, info.kind, info.details);
        assert_eq!(info.api, umm_backends::Api::Wgpu);
        assert_eq!(info.ordinal, i);
        assert!(info.alignment.is_power_of_two() && info.alignment >= 4);
        assert_eq!(info.max_allocation, d.limits().max_buffer_size);
        assert!(info.total_memory > 0);
        for key in ["backend", "vendor_id", "device_id", "driver", "max_storage_buffer_binding_size"] {
            assert!(detail(d, key).is_some(), "{key} missing from {:?}", info.details);
        }
        let name = info.name.to_lowercase();
        if name.contains("llvmpipe") || name.contains("lavapipe") {
            assert_eq!(info.kind, DeviceKind::Cpu, "a software adapter is a CPU device");
            assert!(info.shares_memory_with_host);
            assert_eq!(detail(d, "identity"), Some("cpu:host"));
        }
        if let Some(other) = detail(d, "same_device_as") {
            let j: usize = other.trim_start_matches("wgpu:").parse().unwrap();
            let twin = &discovery.devices[j];
            assert!(j < i);
            assert_eq!(detail(twin, "identity"), detail(d, "identity"));
            assert_ne!(twin.adapter_info().backend, d.adapter_info().backend);
        }
    }
}

/// Every pool kind keeps the bytes: odd sizes, odd offsets, partial words, neighbours untouched, fills.
#[test]
fn every_pool_round_trips_bytes() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        every_pool_round_trips_bytes_on(&dev);
    }
}

fn every_pool_round_trips_bytes_on(dev: &WgpuDevice) {
    let mut kinds =
        vec![WgpuPoolKind::DeviceLocal, WgpuPoolKind::ReadOnly, WgpuPoolKind::Upload, WgpuPoolKind::Readback];
    if dev.has_shared_buffers() {
        kinds.push(WgpuPoolKind::Shared);
    }
    for placement in [PoolPlacement::DeviceLocal, PoolPlacement::HostPinned, PoolPlacement::ReadOnly] {
        assert!(kinds.contains(&dev.kind_for(placement)));
        dev.pool(placement, PoolConfig::default()).expect("pool for every placement");
    }
    for kind in kinds {
        let pool = dev.pool_of(kind, PoolConfig::default()).unwrap();
        let align = umm_backends::Backend::alignment(pool.backend());
        assert!(
            align >= u64::from(dev.limits().min_storage_buffer_offset_alignment)
                || !kind.usages().contains(wgpu::BufferUsages::STORAGE)
        );
        let mut blocks: Vec<(BlockHandle, Vec<u8>)> = Vec::new();
        for (i, &len) in [1usize, 3, 5, 255, 1001, 4097, 70_001, (2 << 20) + 3].iter().enumerate() {
            let block = pool.allocate(len as u64, S0).unwrap();
            assert_eq!(block.offset() % align, 0);
            let data = pattern(len, i as u8);
            pool.write(&block, 0, &data).unwrap();
            blocks.push((block, data));
        }
        for (block, data) in &mut blocks {
            let mut back = vec![0u8; data.len()];
            pool.read(block, 0, &mut back).unwrap();
            assert_eq!(&back, data, "{kind}: round trip of {} bytes", data.len());
            // Unaligned partial writes leave their neighbours alone.
            for (offset, len) in [(1usize, 1usize), (3, 2), (2, 7), (5, 13)] {
                if offset + len > data.len() {
                    continue;
                }
                let piece = pattern(len, 0xA5);
                pool.write(block, offset as u64, &piece).unwrap();
                data[offset..offset + len].copy_from_slice(&piece);
                let mut back = vec![0u8; data.len()];
                pool.read(block, 0, &mut back).unwrap();
                assert_eq!(&back, data, "{kind}: {len} bytes at {offset}");
                let mut part = vec![0u8; len];
                pool.read(block, offset as u64, &mut part).unwrap();
                assert_eq!(part, piece);
            }
            if data.len() > 9 {
                pool.fill(block, 3, 6, 0x5A).unwrap();
                pool.fill(block, 1, 1, 0).unwrap();
                data[3..9].fill(0x5A);
                data[1] = 0;
                let mut back = vec![0u8; data.len()];
                pool.read(block, 0, &mut back).unwrap();
                assert_eq!(&back, data, "{kind}: fills");
            }
        }
        // Zeroed allocation over dirty, reused memory.
        let sizes: Vec<u64> = blocks.iter().map(|(b, _)| b.requested()).collect();
        for (block, _) in &blocks {
            pool.free(block).unwrap();
        }
        for size in sizes {
            let block = pool.allocate_zeroed(size, S0).unwrap();
            let mut back = vec![1u8; size as usize];
            pool.read(&block, 0, &mut back).unwrap();
            assert!(back.iter().all(|&b| b == 0), "{kind}: zeroed block of {size} bytes");
            pool.free(&block).unwrap();
        }
        assert!(pool.stats().cache_hits > 0);
    }
}

const SAXPY: &str = r#"
// x and y may share one pooled buffer: WebGPU forbids read and read-write use of one buffer in a dispatch,
// so both are bound read_write. The parameters are a ReadOnly block: a, b, then a table of 16.
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i >= arrayLength(&y)) {
        return;
    }
    y[i] = params[0] * x[i] + params[1] + params[2u + (i % 16u)];
}
"#;

struct Saxpy {
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipeline: wgpu::ComputePipeline,
}

impl Saxpy {
    fn new(dev: &WgpuDevice) -> Self {
        let (device, queue) = dev.device_and_queue().unwrap();
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("saxpy"),
            source: wgpu::ShaderSource::Wgsl(SAXPY.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("saxpy"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        Self { device, queue, pipeline }
    }

    /// y = a*x + b + table over `n` elements, bindings given as (buffer, offset, size).
    fn run(&self, bindings: [wgpu::BufferBinding<'_>; 3], n: u32) {
        let layout = self.pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry<'_>> = bindings
            .into_iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: wgpu::BindingResource::Buffer(b) })
            .collect();
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(n.div_ceil(64), 1, 1);
        }
        self.queue.submit([encoder.finish()]);
        self.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    }

    fn fresh(&self, bytes: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("fresh"),
            size: bytes.len() as u64,
            usage: usage | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&buffer, 0, bytes);
        buffer
    }

    fn read_fresh(&self, buffer: &wgpu::Buffer) -> Vec<u8> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("fresh read-back"),
            size: buffer.size(),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, buffer.size());
        self.queue.submit([encoder.finish()]);
        staging.map_async(wgpu::MapMode::Read, .., |r| r.unwrap());
        self.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
        let bytes = staging.get_mapped_range(..).unwrap().to_vec();
        staging.unmap();
        bytes
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn params() -> Vec<f32> {
    let mut p = vec![1.7320508f32, -0.333_333_34];
    p.extend((0..16).map(|i| (i as f32).sin() * 1e-3));
    p
}

/// Pooled blocks at non-zero offsets, in a segment first filled with garbage (by the host and by the GPU) and
/// freed, compute exactly what fresh buffers compute; the parameters come from a ReadOnly block read by the
/// shader through a read-only storage binding.
#[test]
fn shader_over_reused_dirty_blocks_matches_fresh_buffers() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        shader_over_reused_dirty_blocks_matches_fresh_buffers_on(&dev);
    }
}

fn shader_over_reused_dirty_blocks_matches_fresh_buffers_on(dev: &WgpuDevice) {
    let saxpy = Saxpy::new(dev);
    let pool = dev.pool(PoolPlacement::DeviceLocal, PoolConfig::default()).unwrap();
    let constants = dev.pool(PoolPlacement::ReadOnly, PoolConfig::default()).unwrap();
    let n: u32 = 10_007; // odd: the binding is not a multiple of the workgroup size or the alignment
    let bytes = u64::from(n) * 4;
    let xs: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).cos() * 1e3 + 1.0 / (i as f32 + 0.5)).collect();

    // A ReadOnly block at a non-zero offset, filled once at allocation, sealed.
    let filler = constants.allocate(40, S0).unwrap();
    let p = constants.allocate(params().len() as u64 * 4, S0).unwrap();
    assert_ne!(p.offset(), 0);
    constants.write(&p, 0, &f32_bytes(&params())).unwrap();
    wgpu_backend::seal(&constants, &p).unwrap();

    // Dirty a segment: garbage from the host, then from the GPU, then free it.
    let lead = pool.allocate(100, S0).unwrap();
    pool.write(&lead, 0, &pattern(100, 9)).unwrap();
    let g1 = pool.allocate(bytes, S0).unwrap();
    let g2 = pool.allocate(bytes, S0).unwrap();
    pool.fill(&g1, 0, bytes, 0xFF).unwrap(); // NaN everywhere
    pool.write(&g2, 0, &pattern(bytes as usize, 7)).unwrap();
    let run_pooled = |x: &BlockHandle, y: &BlockHandle| {
        let (bx, by, bp) = (
            wgpu_backend::binding(&pool, x).unwrap(),
            wgpu_backend::binding(&pool, y).unwrap(),
            wgpu_backend::binding(&constants, &p).unwrap(),
        );
        saxpy.run([bx.as_buffer_binding(), by.as_buffer_binding(), bp.as_buffer_binding()], n);
    };
    run_pooled(&g1, &g2);
    let (g1_offset, g2_offset, segment) = (g1.offset(), g2.offset(), g1.segment_index());
    pool.free(&g1).unwrap();
    pool.free(&g2).unwrap();

    // Reuse: the same places (in either order: recently freed small blocks come back last-in, first-out),
    // non-zero offsets, one buffer.
    let hits = pool.stats().cache_hits;
    let x = pool.allocate(bytes, S0).unwrap();
    let y = pool.allocate(bytes, S0).unwrap();
    assert_eq!(pool.stats().cache_hits, hits + 2);
    let mut reused = [x.offset(), y.offset()];
    reused.sort_unstable();
    let mut before = [g1_offset, g2_offset];
    before.sort_unstable();
    assert_eq!((reused, x.segment_index(), y.segment_index()), (before, segment, segment));
    assert!(x.offset() > 0 && y.offset() > 0);
    let (bx, by) = (wgpu_backend::binding(&pool, &x).unwrap(), wgpu_backend::binding(&pool, &y).unwrap());
    assert_eq!(bx.buffer, by.buffer);
    assert_eq!((bx.offset, bx.size), (x.offset(), bytes));
    pool.write(&x, 0, &f32_bytes(&xs)).unwrap();
    run_pooled(&x, &y);
    let mut pooled = vec![0u8; bytes as usize];
    pool.read(&y, 0, &mut pooled).unwrap();

    // Fresh buffers, same computation.
    let fx = saxpy.fresh(&f32_bytes(&xs), wgpu::BufferUsages::STORAGE);
    let fy = saxpy.fresh(&vec![0u8; bytes as usize], wgpu::BufferUsages::STORAGE);
    let fp = saxpy.fresh(&f32_bytes(&params()), wgpu::BufferUsages::STORAGE);
    saxpy.run([fx.as_entire_buffer_binding(), fy.as_entire_buffer_binding(), fp.as_entire_buffer_binding()], n);
    let fresh = saxpy.read_fresh(&fy);
    assert!(pooled == fresh, "pooled and fresh results differ");

    // And both are right.
    let ps = params();
    for (i, chunk) in pooled.chunks(4).enumerate() {
        let got = f32::from_le_bytes(chunk.try_into().unwrap());
        let want = ps[0] * xs[i] + ps[1] + ps[2 + i % 16];
        assert!((got - want).abs() <= want.abs() * 1e-5 + 1e-5, "y[{i}] = {got}, want {want}");
    }
    // The neighbours of the blocks were not touched by the dispatch.
    let mut lead_bytes = vec![0u8; 100];
    pool.read(&lead, 0, &mut lead_bytes).unwrap();
    assert_eq!(lead_bytes, pattern(100, 9));

    // The sealed ReadOnly block refuses writes and fills, and is writable again once unsealed.
    let err = constants.write(&p, 0, &[0; 4]).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("sealed read-only"), "{err}");
    let err = constants.fill(&p, 0, 4, 0).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("sealed read-only"), "{err}");
    constants.write(&filler, 0, &[1; 40]).unwrap(); // its neighbour is not sealed
    assert!(wgpu_backend::unseal(&constants, &p).unwrap());
    constants.write(&p, 0, &[0; 4]).unwrap();
    constants.free(&p).unwrap();
    assert_eq!(dev.take_uncaptured_error(), None);
}

#[test]
fn device_copies_between_blocks() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        device_copies_between_blocks_on(&dev);
    }
}

fn device_copies_between_blocks_on(dev: &WgpuDevice) {
    let pool = dev.pool(PoolPlacement::DeviceLocal, PoolConfig::default()).unwrap();
    let readback = dev.pool_of(WgpuPoolKind::Readback, PoolConfig::default()).unwrap();
    let a = pool.allocate(4096, S0).unwrap();
    let b = pool.allocate(4096, S0).unwrap();
    let r = readback.allocate(4096, S0).unwrap();
    let data = pattern(4096, 3);
    pool.write(&a, 0, &data).unwrap();
    // Same buffer (through a temporary), then to another pool.
    wgpu_backend::copy_block(&pool, &a, 16, &pool, &b, 32, 1024).unwrap();
    wgpu_backend::copy_block(&pool, &b, 0, &readback, &r, 0, 4096).unwrap();
    let mut back = vec![0u8; 1024];
    readback.read(&r, 32, &mut back).unwrap();
    assert_eq!(back, data[16..16 + 1024]);
    // Unaligned copies and copies out of bounds are refused clearly.
    let err = wgpu_backend::copy_block(&pool, &a, 1, &pool, &b, 0, 8).unwrap_err();
    assert!(err.to_string().contains("multiples of 4"), "{err}");
    assert!(matches!(wgpu_backend::copy_block(&pool, &a, 0, &pool, &b, 4000, 1024), Err(Error::OutOfBounds(_))));
    // Read-back buffers (MAP_READ | COPY_DST) cannot be a copy source.
    let err = wgpu_backend::copy_block(&readback, &r, 0, &pool, &a, 0, 4).unwrap_err();
    assert!(err.to_string().contains("COPY_SRC"), "{err}");
}

#[test]
fn bad_requests_give_clear_errors() {
    for dev in devices() {
        eprintln!("on {}", dev.info().name);
        bad_requests_give_clear_errors_on(&dev);
    }
}

fn bad_requests_give_clear_errors_on(dev: &WgpuDevice) {
    let limits = dev.limits().clone();
    let pool = dev.pool(PoolPlacement::DeviceLocal, PoolConfig::default()).unwrap();

    // Above max_buffer_size: refused before touching the device.
    let err = pool.allocate(limits.max_buffer_size + 1, S0).unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }), "{err}");
    let max = umm_backends::Backend::max_segment_size(pool.backend());
    assert!(max <= limits.max_buffer_size && max + 256 > limits.max_buffer_size);
    assert!(err.to_string().contains(&max.to_string()), "{err}");

    // A block larger than a uniform binding may span.
    let constants = dev.pool(PoolPlacement::ReadOnly, PoolConfig::default()).unwrap();
    let uniform_max = limits.max_uniform_buffer_binding_size;
    let big = constants.allocate(uniform_max + 4, S0).unwrap();
    let err = wgpu_backend::uniform_binding(&constants, &big).unwrap_err();
    assert!(err.to_string().contains("max_uniform_buffer_binding_size"), "{err}");
    constants.free(&big).unwrap();

    // A block larger than a storage binding may span (where that limit is small enough to allocate here).
    let storage_max = limits.max_storage_buffer_binding_size;
    if storage_max + 4 <= limits.max_buffer_size.min(1 << 30) {
        let big = pool.allocate(storage_max + 4, S0).unwrap();
        let err = wgpu_backend::binding(&pool, &big).unwrap_err();
        assert!(err.to_string().contains("max_storage_buffer_binding_size"), "{err}");
        pool.free(&big).unwrap();
    } else {
        eprintln!("max_storage_buffer_binding_size {storage_max} too large to allocate one past it here");
    }

    // Mappable upload buffers are not bindable; freed blocks are unknown.
    let upload = dev.pool_of(WgpuPoolKind::Upload, PoolConfig::default()).unwrap();
    let u = upload.allocate(64, S0).unwrap();
    assert!(matches!(wgpu_backend::binding(&upload, &u), Err(Error::Unsupported { .. })));
    upload.free(&u).unwrap();
    assert!(matches!(wgpu_backend::binding(&upload, &u), Err(Error::UnknownBlock(_))));
    // Out of the block.
    let a = pool.allocate(10, S0).unwrap();
    assert!(matches!(pool.write(&a, 250, &[0; 10]), Err(Error::OutOfBounds(_))));
}

/// A destroyed device: every later call errors (no panic, no hang), naming the loss.
#[test]
fn lost_device_errors_without_panicking() {
    let Some(dev) = device() else { return };
    let pool: Pool<WgpuBackend> = dev
        .pool(PoolPlacement::DeviceLocal, PoolConfig { strategy: Strategy::Direct, ..PoolConfig::default() })
        .unwrap();
    let block = pool.allocate(1000, S0).unwrap();
    pool.write(&block, 0, &[7; 1000]).unwrap();
    pool.backend().device().destroy();
    let _ = pool.backend().device().poll(wgpu::PollType::Poll);
    let err = pool.write(&block, 0, &[1; 1000]).unwrap_err();
    eprintln!("write after loss: {err}");
    assert!(err.is_device_lost(), "{err}");
    assert!(err.to_string().contains("lost"), "{err}");
    let mut back = [0u8; 8];
    let err = pool.read(&block, 0, &mut back).unwrap_err();
    assert!(err.to_string().contains("lost"), "{err}");
    let retries = pool.stats().num_alloc_retries;
    let err = pool.allocate(1 << 20, S0).unwrap_err();
    assert!(err.is_device_lost(), "an allocation on a lost device says so, not out of memory: {err}");
    assert_eq!(pool.stats().num_alloc_retries, retries, "releasing memory cannot bring a device back");
    assert!(dev.lost_reason().is_some());
    pool.free(&block).unwrap();
}
