//! The engine against a shadow model: random operation sequences, checking after every step that live blocks
//! never overlap, lie inside their segment and are aligned, and that the statistics equal the shadow's.

use super::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    /// Allocate preferring offsets whose 4 KiB page number is a multiple of the second value.
    AllocPreferring(u64, u64),
    Free(usize),
    AddSegment(u64),
    RemoveEmpty,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u64..200_000).prop_map(Op::Alloc),
        2 => (1u64..64).prop_map(|k| Op::Alloc(k << 12)),
        2 => (1u64..200_000, 1u64..8).prop_map(|(size, k)| Op::AllocPreferring(size, k)),
        6 => any::<usize>().prop_map(Op::Free),
        1 => (1u64..(1 << 21)).prop_map(Op::AddSegment),
        1 => Just(Op::RemoveEmpty),
    ]
}

/// The shadow: live blocks by (segment, offset) and segment sizes.
#[derive(Default)]
struct Shadow {
    live: Vec<Allocation>,
    segments: BTreeMap<SegmentId, u64>,
}

fn check(engine: &Engine, shadow: &Shadow) {
    let align = engine.alignment();
    let mut by_segment: BTreeMap<SegmentId, Vec<(u64, u64)>> = BTreeMap::new();
    for a in &shadow.live {
        assert_eq!(a.offset % align, 0, "misaligned block {a:?}");
        assert_eq!(a.size % align, 0, "unrounded block {a:?}");
        let seg_size = shadow.segments[&a.segment];
        assert!(a.offset + a.size <= seg_size, "block {a:?} outside its segment of {seg_size}");
        by_segment.entry(a.segment).or_default().push((a.offset, a.size));
        assert_eq!(engine.block(a.block).map(|b| (b.offset, b.size)), Some((a.offset, a.size)));
    }
    for ranges in by_segment.values_mut() {
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
        }
    }
    let stats = engine.stats();
    let allocated: u64 = shadow.live.iter().map(|a| a.size).sum();
    let reserved: u64 = shadow.segments.values().sum();
    let empty: u64 = shadow.segments.iter().filter(|(id, _)| !by_segment.contains_key(id)).map(|(_, s)| s).sum();
    assert_eq!(stats.allocated_bytes, allocated);
    assert_eq!(stats.reserved_bytes, reserved);
    assert_eq!(stats.empty_segment_bytes, empty);
    assert_eq!(stats.live_blocks, shadow.live.len() as u64);
    assert_eq!(stats.segments, shadow.segments.len() as u64);
    // Blocks of every segment tile it exactly, and no two free blocks are neighbours (coalescing happened).
    let mut free_blocks = 0;
    for (&id, &size) in &shadow.segments {
        let mut end = 0;
        let mut last_free = false;
        for b in engine.blocks_in(id) {
            assert_eq!(b.offset, end, "gap or overlap in segment {id:?}");
            assert!(!(last_free && b.free), "uncoalesced free neighbours in {id:?}");
            last_free = b.free;
            free_blocks += b.free as u64;
            end += b.size;
        }
        assert_eq!(end, size);
        let mut backwards: Vec<_> = engine.blocks_in_rev(id).collect();
        backwards.reverse();
        assert_eq!(backwards, engine.blocks_in(id).collect::<Vec<_>>(), "walking down from the top of {id:?}");
    }
    assert_eq!(stats.free_blocks, free_blocks);
}

/// `size` rounded up to `alignment`, as the engine rounds requests.
fn engine_size(size: u64, alignment: u64) -> u64 {
    size.next_multiple_of(alignment)
}

/// Allocates with `allocate`; when nothing fits, grows like a pool does (a segment of at least 1 MiB), and then
/// the allocation must succeed. Checks the rounding and records the block in the shadow.
fn alloc_or_grow(
    engine: &mut Engine,
    shadow: &mut Shadow,
    size: u64,
    mut allocate: impl FnMut(&mut Engine) -> Option<Allocation>,
) {
    let a = match allocate(engine) {
        Some(a) => a,
        None => {
            let seg = engine.add_segment(size.max(1 << 20)).unwrap();
            shadow.segments.insert(seg, engine.segment_size(seg).unwrap());
            allocate(engine).expect("fits in a fresh segment")
        }
    };
    let alignment = engine.alignment();
    assert!(a.size >= size && a.size < size + alignment);
    shadow.live.push(a);
}

fn run(ops: &[Op], alignment: u64, check_every: usize) {
    let mut engine = Engine::new(alignment).unwrap();
    let mut shadow = Shadow::default();
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc(size) => alloc_or_grow(&mut engine, &mut shadow, size, |e| e.allocate(size)),
            Op::AllocPreferring(size, k) => {
                // Place at the first 4 KiB page inside the block whose number is a multiple of k, if it fits.
                let prefer = move |_: SegmentId, offset: u64, block: u64| {
                    let page = (offset >> 12).next_multiple_of(k) << 12;
                    let at = page.max(offset).next_multiple_of(alignment);
                    (at + engine_size(size, alignment) <= offset + block).then_some(at)
                };
                alloc_or_grow(&mut engine, &mut shadow, size, |e| e.allocate_placed(size, prefer));
            }
            Op::Free(k) if !shadow.live.is_empty() => {
                let a = shadow.live.swap_remove(k % shadow.live.len());
                let freed = engine.free(a.block).expect("live block frees");
                assert_eq!((freed.segment, freed.offset, freed.size), (a.segment, a.offset, a.size));
                assert!(engine.free(a.block).is_none(), "double free must be refused");
            }
            Op::Free(_) => {}
            Op::AddSegment(size) => {
                let seg = engine.add_segment(size).unwrap();
                shadow.segments.insert(seg, engine.segment_size(seg).unwrap());
            }
            Op::RemoveEmpty => {
                let empty: Vec<_> = engine.empty_segments().collect();
                for id in empty {
                    assert!(engine.remove_segment(id).is_some());
                    shadow.segments.remove(&id);
                }
            }
        }
        if i % check_every == 0 || i + 1 == ops.len() {
            check(&engine, &shadow);
        }
    }
    // After freeing everything only whole, empty segments remain, each one free block.
    for a in shadow.live.drain(..) {
        engine.free(a.block).unwrap();
    }
    check(&engine, &shadow);
    for (&id, &size) in &shadow.segments {
        let blocks: Vec<_> = engine.blocks_in(id).collect();
        assert_eq!(blocks.len(), 1);
        assert!(blocks[0].free && blocks[0].size == size);
        assert!(engine.is_segment_empty(id));
    }
    assert_eq!(engine.stats().empty_segment_bytes, engine.stats().reserved_bytes);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn engine_matches_shadow(ops in prop::collection::vec(op(), 1..400), align_shift in 0u32..9) {
        run(&ops, 1 << align_shift, 1);
    }
}

/// At least 10^5 operations per CI run, checked every 64 operations (the full check is O(live blocks)).
#[test]
fn long_random_sequence_matches_shadow() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let ops = prop::collection::vec(op(), 120_000).new_tree(&mut runner).unwrap().current();
    run(&ops, 256, 64);
}

/// A longer soak: `cargo test -p umm-backends -- --ignored`.
#[test]
#[ignore]
fn soak_matches_shadow() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for _ in 0..20 {
        let ops = prop::collection::vec(op(), 200_000).new_tree(&mut runner).unwrap().current();
        run(&ops, 512, 16);
    }
}

#[test]
fn rejects_bad_alignment_and_zero_sizes() {
    assert!(Engine::new(0).is_none());
    assert!(Engine::new(48).is_none());
    let mut e = Engine::new(256).unwrap();
    assert!(e.add_segment(0).is_none());
    assert!(e.add_segment(u64::MAX).is_none(), "rounding overflow is refused");
    let seg = e.add_segment(4096).unwrap();
    assert!(e.allocate(0).is_none());
    assert!(e.allocate_in(seg, 8192).is_none());
    assert!(e.remove_segment(SegmentId(99)).is_none());
}

#[test]
fn best_fit_prefers_the_tightest_hole() {
    let mut e = Engine::new(64).unwrap();
    let seg = e.add_segment(1 << 20).unwrap();
    // Carve holes of 8 KiB and 4 KiB separated by live blocks.
    let a = e.allocate(8192).unwrap();
    let _sep1 = e.allocate(64).unwrap();
    let b = e.allocate(4096).unwrap();
    let _sep2 = e.allocate(64).unwrap();
    e.free(a.block).unwrap();
    e.free(b.block).unwrap();
    let c = e.allocate(4000).unwrap();
    assert_eq!((c.segment, c.offset), (seg, b.offset), "4000 B goes into the 4 KiB hole, not the 8 KiB one");
}

#[test]
fn segment_with_live_blocks_is_not_removed() {
    let mut e = Engine::new(64).unwrap();
    let seg = e.add_segment(1 << 16).unwrap();
    let a = e.allocate_in(seg, 100).unwrap();
    assert!(a.segment_was_empty);
    assert!(e.remove_segment(seg).is_none());
    let freed = e.free(a.block).unwrap();
    assert!(freed.segment_now_empty);
    assert_eq!(e.remove_segment(seg), Some(1 << 16));
    assert_eq!(e.stats(), EngineStats::default());
}

#[test]
fn parked_blocks_refuse_their_old_id_and_free_with_the_new_one() {
    let mut e = Engine::new(64).unwrap();
    e.add_segment(1 << 16).unwrap();
    let a = e.allocate(1000).unwrap();
    let parked = e.park(a.block).unwrap();
    assert!(e.free(a.block).is_none(), "the old id is stale once parked");
    assert!(e.park(a.block).is_none());
    assert!(e.block(parked).is_none(), "a parked block is not live");
    let live = e.unpark(parked).unwrap();
    assert_eq!(e.block(live).map(|b| b.offset), Some(a.offset));
    let parked = e.park(live).unwrap();
    let freed = e.free(parked).unwrap();
    assert!(freed.segment_now_empty);
    assert_eq!(e.stats().allocated_bytes, 0);
}

#[test]
fn placed_allocation_goes_where_the_chooser_says() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(1 << 20).unwrap();
    // Holes of 4 KiB at 0 and 64 KiB at 8 KiB, separated by live blocks.
    let blocks: Vec<_> = [4096, 4096, 65536, 4096].iter().map(|&s| e.allocate(s).unwrap()).collect();
    e.free(blocks[0].block).unwrap();
    e.free(blocks[2].block).unwrap();
    // Best fit for 4 KiB is the hole at 0; the chooser passes on it and asks for the middle of the other hole.
    let a = e.allocate_placed(4096, |s, off, _| (s == seg && off == 8192).then_some(8192 + 16384)).unwrap();
    assert_eq!(a.offset, 8192 + 16384);
    let free: Vec<_> = e.blocks_in(seg).filter(|b| b.free).map(|b| (b.offset, b.size)).collect();
    assert_eq!(&free[..3], &[(0, 4096), (8192, 16384), (8192 + 16384 + 4096, 65536 - 16384 - 4096)]);
    // The chooser passes everywhere: the best fit, at its start.
    let b = e.allocate_placed(4096, |_, _, _| None).unwrap();
    assert_eq!(b.offset, 0);
    // No fit at all: none, whatever the chooser says.
    assert!(e.allocate_placed(1 << 21, |_, off, _| Some(off)).is_none());
}
