//! The properties, each a function of a [`Fixture`]; `conformance!` makes one test per backend and property.
//! Every assertion names the exact value or error variant; [`run`] checks every pool's statistics afterwards.

use crate::common::pattern;
use crate::fixtures::Fixture;
use std::sync::Arc;
use umm_backends::pool::POISON_BYTE;
use umm_backends::{
    BlockHandle, CrossStream, Error, Limit, MemoryPool, OwnedBlock, PoolConfig, SegmentMode, Strategy, StreamId,
};

const MIB: u64 = 1 << 20;

/// Runs `property` on every fixture (one per device) that `fixtures` finds, then checks every pool it made.
pub fn run(fixtures: fn() -> Vec<Fixture>, property: fn(&Fixture)) {
    for fixture in fixtures() {
        eprintln!("on {}", fixture.label);
        property(&fixture);
        fixture.finish();
    }
}

fn read(pool: &Arc<dyn MemoryPool>, block: &BlockHandle, offset: u64, len: usize) -> Vec<u8> {
    let mut back = vec![0xA5; len];
    pool.read(block, offset, &mut back).unwrap_or_else(|e| panic!("read {len} bytes at {offset}: {e}"));
    back
}

/// The exact refusal of a host write to read-only memory filled at allocation.
fn assert_read_only(result: umm_backends::Result<()>, what: &str) {
    match result {
        Err(Error::Unsupported { what: ref said, .. })
            if said.contains("read-only") || said.contains("filled once") => {}
        other => panic!("{what}: expected Unsupported (read-only), got {other:?}"),
    }
}

fn assert_unknown_block(result: umm_backends::Result<()>, what: &str) {
    assert!(matches!(result, Err(Error::UnknownBlock(_))), "{what}: expected UnknownBlock, got {result:?}");
}

fn assert_out_of_bounds(result: umm_backends::Result<()>, what: &str) {
    assert!(matches!(result, Err(Error::OutOfBounds(_))), "{what}: expected OutOfBounds, got {result:?}");
}

/// Blocks of odd sizes keep their bytes, whole and in unaligned pieces; partial writes and fills leave their
/// neighbours alone; reads and writes past a block's end are refused; owned blocks lend exactly those bytes as
/// host slices where the memory is host-addressable.
pub fn round_trips_at_odd_sizes_and_offsets(fx: &Fixture) {
    let pool = fx.pool(fx.config());
    let s = fx.streams[0];
    let align = pool.alignment();
    assert!(align.is_power_of_two(), "{}: alignment {align}", fx.label);
    let sizes = [1usize, 3, 5, 255, 1001, 4097, 70_001, (MIB + 5) as usize, (2 * MIB + 3) as usize];
    let mut blocks: Vec<(BlockHandle, Vec<u8>)> = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(len, i as u32);
        let block = fx.put(&pool, &data, s);
        assert_eq!(block.offset() % align, 0, "{}: block of {len} at offset {}", fx.label, block.offset());
        assert_eq!(block.requested(), len as u64);
        assert_eq!(block.size(), (len as u64).next_multiple_of(align), "{}: block of {len}", fx.label);
        blocks.push((block, data));
    }
    assert!(matches!(pool.allocate(0, s), Err(Error::ZeroSize { ref device }) if device == pool.name()));

    // Every block whole, after all were written: no write spilled into a neighbour.
    for (block, data) in &blocks {
        assert_eq!(&read(&pool, block, 0, data.len()), data, "{}: {} bytes", fx.label, data.len());
    }
    for (block, data) in &mut blocks {
        let len = data.len();
        // Partial reads at unaligned offsets, the last byte included.
        for (offset, n) in [(1usize, 1usize), (3, 2), (len.saturating_sub(7), 7.min(len)), (len - 1, 1)] {
            if offset + n <= len {
                assert_eq!(read(&pool, block, offset as u64, n), data[offset..offset + n], "{}", fx.label);
            }
        }
        if fx.host_writes {
            for (offset, n) in [(1usize, 1usize), (3, 2), (2, 7), (5, 13), (len.saturating_sub(3), 3.min(len))] {
                if offset + n > len {
                    continue;
                }
                let piece = pattern(n, 0xA5 + offset as u32);
                pool.write(block, offset as u64, &piece).unwrap();
                data[offset..offset + n].copy_from_slice(&piece);
            }
            if len > 9 {
                pool.fill(block, 3, 6, 0x5A).unwrap();
                pool.fill(block, 1, 1, 0).unwrap();
                data[3..9].fill(0x5A);
                data[1] = 0;
            }
            assert_eq!(&read(&pool, block, 0, len), data, "{}: pieces of {len} bytes", fx.label);
            assert_out_of_bounds(pool.write(block, block.size() - 1, &[1, 2]), "write past the end");
            assert_out_of_bounds(pool.fill(block, block.size(), 1, 0), "fill past the end");
        } else {
            assert_read_only(pool.write(block, 0, &[1]), "write to read-only memory");
            assert_read_only(pool.fill(block, 0, 1, 0), "fill of read-only memory");
        }
        assert_out_of_bounds(pool.read(block, block.size() - 1, &mut [0; 2]), "read past the end");
    }
    // What neighbours hold after all the pieces.
    for (block, data) in &blocks {
        assert_eq!(&read(&pool, block, 0, data.len()), data, "{}: after pieces", fx.label);
    }
    // An owned block lends the same bytes as a host slice where the memory is host-addressable.
    let data = pattern(4099, 77);
    let owned = if fx.host_writes {
        let mut owned = OwnedBlock::allocate(Arc::clone(&pool), data.len() as u64, s, false).unwrap();
        owned.write(0, &data).unwrap();
        owned
    } else {
        OwnedBlock::allocate_filled(Arc::clone(&pool), &data, s).unwrap()
    };
    let mut back = vec![0; data.len()];
    owned.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert_out_of_bounds(owned.read(1, &mut back), "owned read past the requested bytes");
    match owned.host_bytes() {
        Some(host) => assert_eq!(host, &data[..], "{}: host slice", fx.label),
        None => assert_eq!(pool.host_ptr(&blocks[0].0), None, "{}: no host slice, no host pointer", fx.label),
    }
    let freed = blocks[0].0.clone();
    for (block, _) in &blocks {
        pool.free(block).unwrap();
    }
    assert_unknown_block(pool.free(&freed), "double free");
    assert_unknown_block(pool.read(&freed, 0, &mut [0]), "read after free");
}

/// Blocks carved from memory that other blocks filled with garbage and freed compute exactly what blocks of a
/// pool that gives every block its own fresh segment compute: with the API's kernel where there is one (output
/// first filled with NaN, so every element must be written), with copies and fills elsewhere.
pub fn dirty_reuse_matches_a_fresh_buffer(fx: &Fixture) {
    const N: u32 = 10_007; // odd: not a multiple of a workgroup or of the alignment
    let bytes = u64::from(N) * 4;
    let s = fx.streams[0];
    let pool = fx.pool(fx.config());
    let fresh = fx.pool(PoolConfig { strategy: Strategy::Direct, ..fx.config() });
    let xs: Vec<f32> = (0..N).map(|i| (i as f32 * 0.37).cos() * 1e3 + 1.0 / (i as f32 + 0.5)).collect();
    let x_bytes: Vec<u8> = xs.iter().flat_map(|v| v.to_le_bytes()).collect();

    // Dirty the pool: a block that stays (so reused blocks lie past offset 0), then garbage (all-ones: NaN),
    // freed.
    let lead = fx.put(&pool, &pattern(100, 9), s);
    let junk: Vec<BlockHandle> =
        [bytes, bytes, 3000, 70_001].iter().map(|&n| fx.put(&pool, &vec![0xFF; n as usize], s)).collect();
    let places: Vec<(u32, u64)> = junk[..2].iter().map(|b| (b.segment_index(), b.offset())).collect();
    for block in &junk {
        pool.free(block).unwrap();
    }
    let before = pool.stats();
    let x = fx.put(&pool, &x_bytes, s);
    let after = pool.stats();
    assert_eq!(after.cache_hits, before.cache_hits + 1, "{}: x comes from the dirtied memory", fx.label);
    assert_eq!(after.reserved_bytes.current, before.reserved_bytes.current, "{}: no new memory", fx.label);
    assert!(places.contains(&(x.segment_index(), x.offset())), "{}: x at {:?}, junk at {places:?}", fx.label, x);
    // A block is a whole segment where every block has its own; elsewhere x was cut from a shared one.
    assert_eq!(x.offset() > 0, !fx.segment_per_block, "{}: x at offset {}", fx.label, x.offset());
    let fresh_x = fx.put(&fresh, &x_bytes, s);
    assert_eq!(fresh_x.offset(), 0, "{}: a fresh block starts its own segment", fx.label);

    if let Some(kernel) = fx.kernel() {
        // Kernels write y beside x, or in device-local memory where the fixture's memory is read-only.
        let (out, fresh_out) = if fx.read_only {
            (fx.output_pool(fx.config()), fx.output_pool(PoolConfig { strategy: Strategy::Direct, ..fx.config() }))
        } else {
            (Arc::clone(&pool), Arc::clone(&fresh))
        };
        // The output, too, over garbage in the pooled case, zeros in the fresh one.
        let garbage = out.allocate(bytes, s).unwrap();
        out.fill(&garbage, 0, garbage.size(), 0xFF).unwrap();
        out.free(&garbage).unwrap();
        let y = out.allocate(bytes, s).unwrap();
        out.fill(&y, 0, bytes, 0xFF).unwrap();
        let fresh_y = fresh_out.allocate_zeroed(bytes, s).unwrap();
        kernel.run((&*pool, &x), (&*out, &y), N);
        kernel.run((&*fresh, &fresh_x), (&*fresh_out, &fresh_y), N);
        let (pooled, reference) = (read(&out, &y, 0, bytes as usize), read(&fresh_out, &fresh_y, 0, bytes as usize));
        assert!(pooled == reference, "{}: pooled and fresh results differ", fx.label);
        for (i, chunk) in pooled.chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes(chunk.try_into().unwrap());
            let want = xs[i] * 3.0 - xs[N as usize - 1 - i];
            assert!((got - want).abs() <= want.abs() * 1e-6 + 1e-3, "{}: y[{i}] = {got}, want {want}", fx.label);
        }
        out.free(&y).unwrap();
        fresh_out.free(&fresh_y).unwrap();
    } else {
        // No kernel: the same copies and fills on both, at unaligned offsets.
        if fx.host_writes {
            for (p, b) in [(&pool, &x), (&fresh, &fresh_x)] {
                p.write(b, 13, &pattern(1001, 5)).unwrap();
                p.fill(b, 7, 3, 0x11).unwrap();
                p.fill(b, bytes - 5, 5, 0x22).unwrap();
            }
        }
        let (pooled, reference) = (read(&pool, &x, 0, bytes as usize), read(&fresh, &fresh_x, 0, bytes as usize));
        assert!(pooled == reference, "{}: pooled and fresh bytes differ", fx.label);
    }
    assert_eq!(read(&pool, &lead, 0, 100), pattern(100, 9), "{}: the neighbour is untouched", fx.label);
    for block in [&lead, &x] {
        pool.free(block).unwrap();
    }
    fresh.free(&fresh_x).unwrap();
    assert_eq!(fresh.stats().reserved_bytes.current, 0, "{}: a direct pool keeps nothing", fx.label);
}

/// Zeroed blocks read zero over dirty reused memory, whether asked per allocation or for every allocation by
/// `zero_on_alloc`; memory that refuses host writes refuses zeroing with the same error, and leaks nothing.
pub fn zeroed_allocation_reads_zero_over_dirty_memory(fx: &Fixture) {
    let s = fx.streams[0];
    let sizes = [1000u64, MIB + 13, 3 * MIB + 7];
    for zero_on_alloc in [false, true] {
        let pool = fx.pool(PoolConfig { zero_on_alloc, ..fx.config() });
        let zeroed = |n: u64| if zero_on_alloc { pool.allocate(n, s) } else { pool.allocate_zeroed(n, s) };
        let dirty: Vec<BlockHandle> =
            sizes.iter().enumerate().map(|(i, &n)| fx.put(&pool, &pattern(n as usize, i as u32 | 1), s)).collect();
        for block in &dirty {
            pool.free(block).unwrap();
        }
        if !fx.host_writes {
            if zero_on_alloc {
                // Read-only pools ignore zero_on_alloc: their blocks are filled at allocation.
                let block = zeroed(1000).unwrap();
                pool.free(&block).unwrap();
            } else {
                assert_read_only(zeroed(1000).map(drop), "zeroing read-only memory");
                assert_eq!(pool.stats().allocated_bytes.current, 0, "{}: a failed zeroing frees its block", fx.label);
            }
            continue;
        }
        let hits = pool.stats().cache_hits;
        let blocks: Vec<BlockHandle> = sizes.iter().map(|&n| zeroed(n).unwrap()).collect();
        assert_eq!(pool.stats().cache_hits, hits + sizes.len() as u64, "{}: all reused", fx.label);
        for block in &blocks {
            let back = read(&pool, block, 0, block.size() as usize);
            assert!(back.iter().all(|&b| b == 0), "{}: zeroed block of {} is not zero", fx.label, block.size());
            pool.free(block).unwrap();
        }
    }
}

/// With `poison_on_free`, a freed block's bytes are overwritten with the poison byte (NaN in floats): the same
/// place, allocated again, reads all poison. Read-only memory ignores it (filled once, never written after).
pub fn poison_on_free_overwrites_freed_blocks(fx: &Fixture) {
    let s = fx.streams[0];
    let pool = fx.pool(PoolConfig { poison_on_free: true, ..fx.config() });
    for (i, len) in [1usize, 4097, (MIB + 5) as usize, (12 * MIB + 1) as usize].into_iter().enumerate() {
        let data = pattern(len, 40 + i as u32);
        let block = fx.put(&pool, &data, s);
        let place = (block.segment_index(), block.offset(), block.size());
        pool.free(&block).unwrap();
        let again = pool.allocate(len as u64, s).unwrap();
        assert_eq!((again.segment_index(), again.offset(), again.size()), place, "{}: the same place", fx.label);
        let back = read(&pool, &again, 0, len);
        if fx.host_writes {
            assert!(back.iter().all(|&b| b == POISON_BYTE), "{}: {len} bytes not poisoned", fx.label);
        } else {
            assert_eq!(back, data, "{}: read-only memory is never written after its fill", fx.label);
        }
        pool.free(&again).unwrap();
    }
    let block = pool.allocate(64, s).unwrap();
    pool.free(&block).unwrap();
    assert_unknown_block(pool.free(&block), "double free with poison on");
}

/// Under a limit the pool first releases what it caches and retries, and only then fails with
/// [`Error::OutOfMemory`] carrying the request, the limit and what it holds; a fraction of the device is a limit
/// too. (A limit, not the device's whole memory, so that tests may run in parallel on a GPU.)
pub fn limit_releases_cached_memory_retries_then_reports_out_of_memory(fx: &Fixture) {
    let s = fx.streams[0];
    // No segment slack: here the limit alone is what releases the cached segment.
    let config = PoolConfig { limit: Some(Limit::Bytes(16 * MIB)), segment_slack: None, ..fx.config() };
    let pool = fx.pool(config);
    assert_eq!(pool.stats().limit_bytes, Some(16 * MIB));
    let a = pool.allocate(12 * MIB, s).unwrap();
    pool.free(&a).unwrap();
    assert_eq!(pool.stats().reserved_bytes.current, 12 * MIB, "{}: a's memory is cached", fx.label);
    let b = pool.allocate(14 * MIB, s).expect("the cached memory is released and the request retried");
    let stats = pool.stats();
    let virtual_memory = fx.mode == SegmentMode::Virtual;
    // Plain segments: the cached 12 MiB segment had to go. A reservation maps 2 MiB more instead.
    assert_eq!(stats.num_alloc_retries, u64::from(!virtual_memory), "{}: {stats:?}", fx.label);
    assert_eq!(stats.reserved_bytes.current, 14 * MIB, "{}: {stats:?}", fx.label);
    match pool.allocate(14 * MIB, s) {
        Err(Error::OutOfMemory { device, requested, free, cached, reserved, limit, cause }) => {
            let now = pool.stats();
            assert_eq!(device, pool.name());
            assert_eq!(requested, 14 * MIB);
            assert_eq!(limit, Some(16 * MIB));
            assert_eq!(reserved, now.reserved_bytes.current, "{}: {now:?}", fx.label);
            assert_eq!(cached, reserved - now.allocated_bytes.current, "{}: {now:?}", fx.label);
            assert_eq!(cause, None, "{}: the limit, not the device, refused", fx.label);
            if fx.exclusive {
                assert_eq!(free, pool.capacity() - reserved, "{}", fx.label);
            }
            assert_eq!(now.num_ooms, 1);
        }
        other => panic!("{}: expected out of memory, got {other:?}", fx.label),
    }
    let message = pool.allocate(14 * MIB, s).unwrap_err().to_string();
    for number in [14 * MIB, 16 * MIB] {
        assert!(message.contains(&number.to_string()), "{}: {message}", fx.label);
    }
    assert_eq!(pool.stats().num_ooms, 2);
    // Small requests still fit beside b, and the limit holds for them too.
    let small = pool.allocate(1000, s).unwrap();
    pool.free(&small).unwrap();
    pool.free(&b).unwrap();
    // A fraction of the device is a limit too; none lifts it.
    pool.set_limit(Some(Limit::Fraction(0.5))).unwrap();
    assert_eq!(pool.stats().limit_bytes, Some((pool.capacity() as f64 * 0.5) as u64));
    assert!(matches!(pool.set_limit(Some(Limit::Fraction(1.5))), Err(Error::InvalidConfig(_))));
    assert!(matches!(pool.set_limit(Some(Limit::Bytes(0))), Err(Error::InvalidConfig(_))));
    pool.set_limit(None).unwrap();
    assert_eq!(pool.stats().limit_bytes, None);
    let c = pool.allocate(20 * MIB, s).unwrap();
    pool.free(&c).unwrap();
}

/// Without sharing across streams, a block freed on a stream is reused at once on that stream, and never handed
/// to another stream while cached.
pub fn freed_blocks_come_back_on_their_own_stream_only(fx: &Fixture) {
    let [s1, s2] = fx.streams;
    // No segment slack: an empty segment cached for s1 stays, rather than making room for s2's.
    let config = PoolConfig { segment_slack: None, cross_stream: CrossStream::Off, ..fx.config() };
    let pool = fx.pool(config);
    for size in [4096u64, 3 * MIB] {
        let a = pool.allocate(size, s1).unwrap();
        let place = (a.segment_index(), a.offset(), a.key());
        pool.free(&a).unwrap();
        let before = pool.stats();
        let b = pool.allocate(size, s1).unwrap();
        let after = pool.stats();
        assert_eq!((b.segment_index(), b.offset(), b.key()), place, "{}: same stream, same place", fx.label);
        assert_eq!(after.cache_hits, before.cache_hits + 1, "{}", fx.label);
        assert_eq!(after.reserved_bytes.current, before.reserved_bytes.current, "{}", fx.label);
        pool.free(&b).unwrap();
        // On the other stream, b's memory stays cached for s1: new memory.
        let before = pool.stats();
        let c = pool.allocate(size, s2).unwrap();
        let after = pool.stats();
        assert_ne!(c.key(), place.2, "{}: another stream's block", fx.label);
        assert_eq!(after.cache_misses, before.cache_misses + 1, "{}: {after:?}", fx.label);
        assert!(after.reserved_bytes.current > before.reserved_bytes.current, "{}: {after:?}", fx.label);
        if fx.host_writes {
            // Distinct memory: writing one leaves the other's bytes alone.
            let d = pool.allocate(size, s1).unwrap();
            assert_eq!((d.segment_index(), d.offset(), d.key()), place);
            pool.write(&d, 0, &pattern(size as usize, 1)).unwrap();
            pool.write(&c, 0, &pattern(size as usize, 2)).unwrap();
            assert_eq!(read(&pool, &d, 0, size as usize), pattern(size as usize, 1), "{}", fx.label);
            pool.free(&d).unwrap();
        }
        pool.free(&c).unwrap();
    }
}

/// With sharing across streams (the default), memory a stream freed serves another stream's miss instead of new
/// memory once the giving stream's work has passed (here nothing is queued), and the bytes written through the
/// new block are its own.
pub fn a_stream_takes_what_another_freed_when_shared(fx: &Fixture) {
    let [s1, s2] = fx.streams;
    for size in [4096u64, 3 * MIB] {
        let pool = fx.pool(fx.config());
        let a = pool.allocate(size, s1).unwrap();
        pool.free(&a).unwrap();
        let before = pool.stats();
        let b = pool.allocate(size, s2).unwrap();
        let after = pool.stats();
        assert_eq!(after.reserved_bytes.current, before.reserved_bytes.current, "{} {size}: {after:?}", fx.label);
        let moved = after.num_segments_shared + after.num_pages_shared;
        assert!(moved > before.num_segments_shared + before.num_pages_shared, "{} {size}: {after:?}", fx.label);
        if fx.host_writes {
            pool.write(&b, 0, &pattern(size as usize, 3)).unwrap();
            assert_eq!(read(&pool, &b, 0, size as usize), pattern(size as usize, 3), "{}", fx.label);
        }
        pool.free(&b).unwrap();
        // With sharing off (and no segment slack, which would destroy s1's empty segment first), the same steps
        // take new memory.
        let off = fx.pool(PoolConfig { cross_stream: CrossStream::Off, segment_slack: None, ..fx.config() });
        let a = off.allocate(size, s1).unwrap();
        off.free(&a).unwrap();
        let before = off.stats().reserved_bytes.current;
        let b = off.allocate(size, s2).unwrap();
        assert!(off.stats().reserved_bytes.current > before, "{} {size}: new memory when off", fx.label);
        off.free(&b).unwrap();
    }
}

/// Eight threads share one pool, each allocating blocks of varied sizes on two streams, writing, reading back
/// and freeing them, some held across iterations; nothing is lost or mixed up.
pub fn eight_threads_allocate_write_read_and_free(fx: &Fixture) {
    let pool = fx.pool(fx.config());
    let (host_writes, streams) = (fx.host_writes, fx.streams);
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                let stream: StreamId = streams[(t % 2) as usize];
                let mut held: Vec<(BlockHandle, Vec<u8>)> = Vec::new();
                for i in 0..40u32 {
                    let seed = t * 1000 + i;
                    let r = (u64::from(pattern(4, seed)[0]) << 8) | u64::from(pattern(4, seed)[1]);
                    let size = if i % 10 == 9 { MIB + r * 17 } else { 1 + r % 20_000 };
                    let data = pattern(size as usize, seed);
                    let block = if host_writes {
                        let b = pool.allocate(size, stream).unwrap();
                        pool.write(&b, 0, &data).unwrap();
                        b
                    } else {
                        pool.allocate_filled(&data, stream).unwrap()
                    };
                    held.push((block, data));
                    if held.len() > 3 || i % 3 == 0 {
                        let (block, data) = held.remove(0);
                        let mut back = vec![0; data.len()];
                        pool.read(&block, 0, &mut back).unwrap();
                        assert!(back == data, "thread {t}: block of {} bytes changed", data.len());
                        pool.free(&block).unwrap();
                    }
                }
                for (block, data) in held {
                    let mut back = vec![0; data.len()];
                    pool.read(&block, 0, &mut back).unwrap();
                    assert!(back == data, "thread {t}: block of {} bytes changed", data.len());
                    pool.free(&block).unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a thread failed");
    }
    let stats = pool.stats();
    assert_eq!(stats.num_allocs, 8 * 40, "{}: {stats:?}", fx.label);
    assert_eq!(stats.num_frees, stats.num_allocs, "{}: {stats:?}", fx.label);
}

/// The statistics count every block exactly: allocated and requested bytes, live blocks, allocations and frees,
/// peaks; reserved memory covers what is allocated.
pub fn statistics_count_every_block_exactly(fx: &Fixture) {
    let s = fx.streams[0];
    let pool = fx.pool(fx.config());
    let align = pool.alignment();
    let start = pool.stats();
    assert_eq!((start.allocated_bytes, start.reserved_bytes, start.num_allocs), Default::default());
    let sizes = [7u64, 1000, 4097, MIB + 1, 3 * MIB, 12 * MIB + 5];
    let mut blocks = Vec::new();
    let (mut allocated, mut requested) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        blocks.push(fx.put(&pool, &pattern(n as usize, i as u32), s));
        allocated += n.next_multiple_of(align);
        requested += n;
        let st = pool.stats();
        assert_eq!(st.allocated_bytes.current, allocated, "{}: {st:?}", fx.label);
        assert_eq!(st.requested_bytes.current, requested, "{}: {st:?}", fx.label);
        assert_eq!(st.active_blocks.current, i as u64 + 1, "{}: {st:?}", fx.label);
        assert_eq!(st.num_allocs, i as u64 + 1, "{}: {st:?}", fx.label);
        assert!(st.reserved_bytes.current >= allocated, "{}: {st:?}", fx.label);
    }
    let peak = pool.stats();
    for (i, block) in blocks.iter().enumerate().rev() {
        pool.free(block).unwrap();
        allocated -= block.size();
        requested -= block.requested();
        let st = pool.stats();
        assert_eq!((st.allocated_bytes.current, st.requested_bytes.current), (allocated, requested), "{st:?}");
        assert_eq!(st.active_blocks.current, i as u64, "{}: {st:?}", fx.label);
        assert_eq!(st.num_frees, (sizes.len() - i) as u64, "{}: {st:?}", fx.label);
        assert_eq!(st.allocated_bytes.peak, peak.allocated_bytes.current, "{}: the peak stays", fx.label);
    }
    pool.reset_peaks();
    let st = pool.stats();
    assert_eq!((st.allocated_bytes.peak, st.active_blocks.peak), (0, 0), "{}: {st:?}", fx.label);
    assert_eq!(st.reserved_bytes.peak, st.reserved_bytes.current, "{}: {st:?}", fx.label);
}
