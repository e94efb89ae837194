//! The engine against a shadow model: random operation sequences over every entry point (allocate,
//! allocate_in, park, unpark, free, segments added and removed, space withheld and restored), checking after
//! every step that live blocks never overlap, lie inside their segment and are aligned, never touch withheld
//! ranges, and that the statistics equal the shadow's.
//!
//! The shadow keeps its own model of free space: a segment's free runs are what its live and parked blocks and
//! its withheld granules leave, computed from the shadow's own records, never from the engine's. So it checks
//! that the engine's free blocks are exactly those runs (nothing lost, everything coalesced), that a miss is a
//! true miss (no free run holds the request), that every block is carved from the start of a free run, and that
//! the block chosen is one the engine's documented policy allows ([`allowed_fits`]): the tightest fitting block of
//! the request's own size class whenever its bounded scan ([`FIT_SCAN_LIMIT`] blocks) sees the whole class.

use super::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use std::collections::{BTreeMap, BTreeSet};

/// Granule of withheld ranges in these tests.
const GRANULE: u64 = 4096;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
    AddSegment(u64),
    RemoveEmpty,
    /// Withhold up to this many bytes of free space from the top of a segment (picked by the first value).
    Withhold(usize, u64),
    /// Allocate from withheld space, as a pool does on a miss in a virtual reservation.
    AllocWithheld(u64),
    AddWithheldSegment(u64),
    /// Park a live block (as a cache holding it does), or unpark a parked one.
    Park(usize),
    Unpark(usize),
    /// Allocate at the start of a segment (picked by the first value), as a pool does right after adding one.
    AllocIn(usize, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u64..200_000).prop_map(Op::Alloc),
        2 => (1u64..64).prop_map(|k| Op::Alloc(k << 12)),
        6 => any::<usize>().prop_map(Op::Free),
        1 => (1u64..(1 << 21)).prop_map(Op::AddSegment),
        1 => Just(Op::RemoveEmpty),
        2 => (any::<usize>(), 1u64..(1 << 19)).prop_map(|(k, want)| Op::Withhold(k, want)),
        2 => (1u64..200_000).prop_map(Op::AllocWithheld),
        1 => (1u64..(1 << 21)).prop_map(Op::AddWithheldSegment),
        2 => any::<usize>().prop_map(Op::Park),
        1 => any::<usize>().prop_map(Op::Unpark),
        1 => (any::<usize>(), 1u64..(1 << 20)).prop_map(|(k, size)| Op::AllocIn(k, size)),
    ]
}

/// A block the shadow holds: where it lies, the id it answers to now, and whether it is parked.
#[derive(Debug, Clone, Copy)]
struct Held {
    segment: SegmentId,
    offset: u64,
    size: u64,
    id: BlockId,
    parked: bool,
}

/// A maximal free run of a segment, in the shadow's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Run {
    segment: SegmentId,
    offset: u64,
    len: u64,
}

/// The shadow: held blocks, segment sizes (rounded by the shadow itself), and the withheld granules of each
/// segment.
struct Shadow {
    alignment: u64,
    held: Vec<Held>,
    segments: BTreeMap<SegmentId, u64>,
    withheld: BTreeMap<SegmentId, BTreeSet<u64>>,
}

impl Shadow {
    fn new(alignment: u64) -> Self {
        Self { alignment, held: Vec::new(), segments: BTreeMap::new(), withheld: BTreeMap::new() }
    }

    /// A request or segment size as the engine must round it: up to the alignment.
    fn rounded(&self, size: u64) -> u64 {
        size.next_multiple_of(self.alignment)
    }

    fn add_segment(&mut self, engine: &Engine, id: SegmentId, asked: u64) {
        let size = self.rounded(asked);
        assert_eq!(engine.segment_size(id), Some(size), "segment of {asked} bytes");
        assert!(self.segments.insert(id, size).is_none(), "segment id {id:?} handed out twice");
    }

    fn hold(&mut self, a: &Allocation, asked: u64) {
        assert_eq!(a.size, self.rounded(asked), "{a:?} for {asked} bytes");
        self.held.push(Held { segment: a.segment, offset: a.offset, size: a.size, id: a.block, parked: false });
    }

    fn withhold(&mut self, segment: SegmentId, offset: u64, len: u64) {
        assert!(offset.is_multiple_of(GRANULE) && len.is_multiple_of(GRANULE) && len > 0, "withheld {offset}+{len}");
        let set = self.withheld.entry(segment).or_default();
        for g in (offset..offset + len).step_by(GRANULE as usize) {
            assert!(set.insert(g), "granule {g} of {segment:?} withheld twice");
        }
    }

    fn restore(&mut self, segment: SegmentId, offset: u64, len: u64) {
        let set = self.withheld.entry(segment).or_default();
        for g in (offset..offset + len).step_by(GRANULE as usize) {
            assert!(set.remove(&g), "granule {g} of {segment:?} restored but not withheld");
        }
    }

    /// The withheld ranges of `segment`: its granules merged where they touch.
    fn withheld_ranges(&self, segment: SegmentId) -> Vec<(u64, u64)> {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for &g in self.withheld.get(&segment).into_iter().flatten() {
            match ranges.last_mut() {
                Some((start, len)) if *start + *len == g => *len += GRANULE,
                _ => ranges.push((g, GRANULE)),
            }
        }
        ranges
    }

    /// Every free run: each segment less its held blocks and withheld ranges, in address order.
    fn free_runs(&self) -> Vec<Run> {
        let mut runs = Vec::new();
        let mut held: BTreeMap<SegmentId, Vec<(u64, u64)>> = BTreeMap::new();
        for h in &self.held {
            held.entry(h.segment).or_default().push((h.offset, h.size));
        }
        for (&segment, &size) in &self.segments {
            let mut taken = held.remove(&segment).unwrap_or_default();
            taken.extend(self.withheld_ranges(segment));
            taken.sort_unstable();
            let mut end = 0;
            for (offset, len) in taken {
                assert!(offset >= end, "{segment:?}: {offset} taken twice");
                if offset > end {
                    runs.push(Run { segment, offset: end, len: offset - end });
                }
                end = offset + len;
            }
            assert!(end <= size, "{segment:?}: taken past its end");
            if end < size {
                runs.push(Run { segment, offset: end, len: size - end });
            }
        }
        runs
    }

    fn held_in(&self, segment: SegmentId) -> bool {
        self.held.iter().any(|h| h.segment == segment)
    }
}

fn check(engine: &Engine, shadow: &Shadow) {
    engine.check_index();
    let align = engine.alignment();
    let mut by_segment: BTreeMap<SegmentId, Vec<(u64, u64)>> = BTreeMap::new();
    for h in &shadow.held {
        assert_eq!(h.offset % align, 0, "misaligned block {h:?}");
        assert_eq!(h.size % align, 0, "unrounded block {h:?}");
        let seg_size = shadow.segments[&h.segment];
        assert!(h.offset + h.size <= seg_size, "block {h:?} outside its segment of {seg_size}");
        by_segment.entry(h.segment).or_default().push((h.offset, h.size));
        // `block` answers for live blocks only: a parked one is not live until unparked.
        let expected = (!h.parked).then_some((h.offset, h.size));
        assert_eq!(engine.block(h.id).map(|b| (b.offset, b.size)), expected, "{h:?}");
    }
    for ranges in by_segment.values_mut() {
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
        }
    }
    let stats = engine.stats();
    let allocated: u64 = shadow.held.iter().map(|h| h.size).sum();
    let reserved: u64 = shadow.segments.values().sum();
    let empty: u64 = shadow.segments.iter().filter(|(id, _)| !by_segment.contains_key(id)).map(|(_, s)| s).sum();
    assert_eq!(stats.allocated_bytes, allocated);
    assert_eq!(stats.reserved_bytes, reserved);
    assert_eq!(stats.empty_segment_bytes, empty);
    assert_eq!(stats.live_blocks, shadow.held.len() as u64);
    assert_eq!(stats.segments, shadow.segments.len() as u64);
    // The engine's free blocks are exactly the shadow's free runs: no free byte lost or handed out twice, and
    // free neighbours coalesced (a run is maximal, so two engine blocks in one run would not match it).
    let engine_free: Vec<Run> = shadow
        .segments
        .keys()
        .flat_map(|&segment| {
            engine.blocks_in(segment).filter(|b| b.free).map(move |b| Run { segment, offset: b.offset, len: b.size })
        })
        .collect();
    assert_eq!(engine_free, shadow.free_runs(), "free blocks against the shadow's free runs");
    assert_eq!(stats.free_blocks, engine_free.len() as u64);
    // Blocks of every segment tile it exactly, withheld ranges are merged, and they are the shadow's granules.
    for (&id, &size) in &shadow.segments {
        let mut end = 0;
        let mut last_withheld = false;
        let mut withheld = BTreeSet::new();
        for b in engine.blocks_in(id) {
            assert_eq!(b.offset, end, "gap or overlap in segment {id:?}");
            assert!(!(last_withheld && b.withheld), "unmerged withheld neighbours in {id:?}");
            last_withheld = b.withheld;
            if b.withheld {
                withheld.extend((b.offset..b.offset + b.size).step_by(GRANULE as usize));
            }
            end += b.size;
        }
        assert_eq!(end, size);
        assert_eq!(&withheld, shadow.withheld.get(&id).unwrap_or(&BTreeSet::new()), "withheld granules of {id:?}");
    }
    let withheld: usize = shadow.withheld.values().map(BTreeSet::len).sum();
    assert_eq!(stats.withheld_bytes, withheld as u64 * GRANULE);
}

/// The free runs that the engine's documented policy (the module documentation and [`Engine::allocate`]) allows
/// to serve a request of `rounded` bytes, given every free run before the allocation (the engine's free blocks,
/// which [`check`] holds equal to the runs). With `own` the runs of the request's size class ([`bins::bin_of`]):
///
/// - where `own` holds at most [`FIT_SCAN_LIMIT`] runs, the bounded scan sees all of them, so where one of them
///   fits, exactly the tightest fitting ones (every run of that length: the engine breaks ties by list order);
/// - where no run of `own` fits, every run of the smallest class above it that holds a run (the engine takes that
///   class's head, and the order of a class list is not part of the policy: all of them fit, within 1/32 of each
///   other);
/// - where `own` holds more than [`FIT_SCAN_LIMIT`] runs, the scan may miss the tightest, and then may move on to
///   the class above: every fitting run of `own`, and the runs of that class;
/// - none when no run holds `rounded`: only then may the engine miss.
fn allowed_fits(runs: &[Run], rounded: u64) -> Vec<Run> {
    let bin = bins::bin_of(rounded);
    let own: Vec<Run> = runs.iter().copied().filter(|r| bins::bin_of(r.len) == bin).collect();
    let fitting: Vec<Run> = own.iter().copied().filter(|r| r.len >= rounded).collect();
    let above = runs.iter().map(|r| bins::bin_of(r.len)).filter(|&b| b > bin).min();
    let next_class = runs.iter().copied().filter(|r| Some(bins::bin_of(r.len)) == above);
    if own.len() <= FIT_SCAN_LIMIT {
        match fitting.iter().map(|r| r.len).min() {
            Some(tightest) => fitting.into_iter().filter(|r| r.len == tightest).collect(),
            None => next_class.collect(),
        }
    } else {
        fitting.into_iter().chain(next_class).collect()
    }
}

/// Checks an allocation from the free index against the shadow's free runs as they were before it: carved from
/// the start of a run that holds it, and that run one of [`allowed_fits`]. `None` is checked to be a true miss.
fn check_fit(shadow: &Shadow, runs: &[Run], size: u64, got: Option<&Allocation>) {
    let rounded = shadow.rounded(size);
    let allowed = allowed_fits(runs, rounded);
    let Some(a) = got else {
        assert!(
            allowed.is_empty(),
            "false miss: free runs {:?} hold {rounded} bytes",
            &allowed[..allowed.len().min(4)]
        );
        return;
    };
    let run = runs
        .iter()
        .find(|r| r.segment == a.segment && r.offset == a.offset)
        .unwrap_or_else(|| panic!("{a:?} does not start a free run"));
    assert!(run.len >= a.size, "{a:?} runs past its free run {run:?}");
    assert!(
        allowed.contains(run),
        "{rounded} bytes (class {}) from {run:?} (class {}); the policy allows only {} runs, such as {:?}",
        bins::bin_of(rounded),
        bins::bin_of(run.len),
        allowed.len(),
        &allowed[..allowed.len().min(4)]
    );
}

/// Allocates with `allocate`; when nothing fits, grows like a pool does (a segment of at least 1 MiB), and then
/// the allocation must succeed. Records the block in the shadow; with `verify`, checks the fit first (building
/// the shadow's free runs costs O(blocks), so long runs verify one step in many).
fn alloc_or_grow(engine: &mut Engine, shadow: &mut Shadow, size: u64, verify: bool) {
    let runs = if verify { shadow.free_runs() } else { Vec::new() };
    let got = engine.allocate(size);
    if verify {
        check_fit(shadow, &runs, size, got.as_ref());
    }
    let a = match got {
        Some(a) => a,
        None => {
            let asked = size.max(1 << 20);
            let seg = engine.add_segment(asked).unwrap();
            shadow.add_segment(engine, seg, asked);
            let a = engine.allocate(size).expect("fits in a fresh segment");
            assert_eq!((a.segment, a.offset, a.segment_was_empty), (seg, 0, true), "{a:?}: from the fresh segment");
            a
        }
    };
    shadow.hold(&a, size);
}

/// The fewest bytes any withheld range needs restored to serve `size` bytes after the free index missed
/// (`None` when no range can serve), worked out from the shadow's model by the definition: a request starts at
/// the free run before a range and runs into it (the granules up to its end, at least one), or ends in the free
/// run after a range and starts inside it (the granules from its start to the range's end, at least one), or,
/// when it would run past the range either way, the whole range joins the free runs on both sides if together
/// they hold it.
fn fewest_restored_bytes(shadow: &Shadow, size: u64) -> Option<u64> {
    let size = shadow.rounded(size);
    let runs = shadow.free_runs();
    let free_at = |segment: SegmentId, pred: &dyn Fn(&Run) -> bool| {
        runs.iter().find(|r| r.segment == segment && pred(r)).map_or(0, |r| r.len)
    };
    let mut fewest = None::<u64>;
    for &id in shadow.segments.keys() {
        for (offset, len) in shadow.withheld_ranges(id) {
            let before = free_at(id, &|r| r.offset + r.len == offset);
            let after = free_at(id, &|r| r.offset == offset + len);
            let whole = (before + len + after >= size).then_some(len);
            let end = offset - before + size;
            let head =
                if end <= offset + len { Some((end.next_multiple_of(GRANULE) - offset).max(GRANULE)) } else { whole };
            let range_end = offset + len;
            let start = (range_end + after).checked_sub(size).filter(|&s| s >= offset);
            let tail = match start {
                Some(start) => Some(range_end.saturating_sub(start / GRANULE * GRANULE).max(GRANULE)),
                None => whole,
            };
            for bytes in [head, tail] {
                fewest = match (fewest, bytes) {
                    (Some(f), Some(b)) => Some(f.min(b)),
                    (f, b) => f.or(b),
                };
            }
        }
    }
    fewest
}

fn run(ops: &[Op], alignment: u64, check_every: usize) {
    let mut engine = Engine::new(alignment).unwrap();
    let mut shadow = Shadow::new(alignment);
    for (i, op) in ops.iter().enumerate() {
        let verify = i % check_every == 0;
        match *op {
            Op::Alloc(size) => alloc_or_grow(&mut engine, &mut shadow, size, verify),
            Op::Withhold(k, want) if !shadow.segments.is_empty() => {
                let id = *shadow.segments.keys().nth(k % shadow.segments.len()).unwrap();
                let mut released = Vec::new();
                let got = engine.withhold_free(
                    GRANULE,
                    want,
                    |s| s == id,
                    |s, offset, len| {
                        assert_eq!(s, id, "only the eligible segment");
                        released.push((offset, len));
                    },
                );
                assert!(got < want + GRANULE, "withheld {got} for {want}");
                assert_eq!(released.iter().map(|r| r.1).sum::<u64>(), got);
                for (offset, len) in released {
                    shadow.withhold(id, offset, len);
                }
            }
            Op::Withhold(..) => {}
            Op::AllocWithheld(size) => {
                // As a pool does: the free index first, withheld space on a miss.
                let runs = if verify { shadow.free_runs() } else { Vec::new() };
                let got = engine.allocate(size);
                if verify {
                    check_fit(&shadow, &runs, size, got.as_ref());
                }
                if let Some(a) = got {
                    shadow.hold(&a, size);
                } else if let Some(r) = engine.find_withheld(size, GRANULE) {
                    // Every range is weighed, so the choice is the best however many ranges there are.
                    if verify {
                        let fewest = fewest_restored_bytes(&shadow, size).expect("a range serves");
                        assert_eq!(r.len, fewest, "{r:?} for {size} bytes restores more than needed");
                    }
                    let a = engine.restore_and_allocate(&r, size).expect("restores what it found");
                    assert!(a.offset <= r.offset + r.len && a.offset + a.size > r.offset, "{a:?} uses {r:?}");
                    shadow.restore(r.segment, r.offset, r.len);
                    shadow.hold(&a, size);
                } else if verify {
                    assert_eq!(fewest_restored_bytes(&shadow, size), None, "a range serves {size} bytes");
                }
            }
            Op::AddWithheldSegment(size) => {
                let asked = size.next_multiple_of(GRANULE);
                let seg = engine.add_withheld_segment(asked).unwrap();
                shadow.add_segment(&engine, seg, asked);
                let size = shadow.segments[&seg];
                shadow.withhold(seg, 0, size);
            }
            Op::Free(k) if !shadow.held.is_empty() => {
                let h = shadow.held.swap_remove(k % shadow.held.len());
                let freed = engine.free(h.id).expect("a live or parked block frees");
                assert_eq!((freed.segment, freed.size), (h.segment, h.size));
                assert_eq!(freed.segment_now_empty, !shadow.held_in(h.segment), "{h:?}");
                assert!(engine.free(h.id).is_none(), "double free must be refused");
            }
            Op::Free(_) => {}
            Op::Park(k) if shadow.held.iter().any(|h| !h.parked) => {
                let live: Vec<usize> = (0..shadow.held.len()).filter(|&i| !shadow.held[i].parked).collect();
                let h = &mut shadow.held[live[k % live.len()]];
                let old = h.id;
                let new = engine.park(old).expect("a live block parks");
                assert!(engine.park(old).is_none() && engine.free(old).is_none(), "the old id is refused");
                assert!(engine.unpark(old).is_none(), "the old id does not unpark");
                (h.id, h.parked) = (new, true);
            }
            Op::Park(_) => {}
            Op::Unpark(k) if shadow.held.iter().any(|h| h.parked) => {
                let parked: Vec<usize> = (0..shadow.held.len()).filter(|&i| shadow.held[i].parked).collect();
                let h = &mut shadow.held[parked[k % parked.len()]];
                assert_eq!(engine.park(h.id), None, "a parked block does not park again");
                assert_eq!(engine.unpark(h.id), Some(h.id), "a parked block unparks with its id");
                h.parked = false;
            }
            Op::Unpark(_) => {}
            Op::AllocIn(k, size) if !shadow.segments.is_empty() => {
                let id = *shadow.segments.keys().nth(k % shadow.segments.len()).unwrap();
                let rounded = shadow.rounded(size);
                // Served only from an entirely free segment whose first run, from offset 0, holds the request.
                let serves = !shadow.held_in(id)
                    && shadow.free_runs().iter().any(|r| r.segment == id && r.offset == 0 && r.len >= rounded);
                match engine.allocate_in(id, size) {
                    Some(a) => {
                        assert!(serves, "allocate_in served {a:?} from {id:?}, which the shadow says cannot");
                        assert_eq!((a.segment, a.offset, a.segment_was_empty), (id, 0, true), "{a:?}");
                        shadow.hold(&a, size);
                    }
                    None => assert!(!serves, "allocate_in refused {size} bytes of the free segment {id:?}"),
                }
            }
            Op::AllocIn(..) => {}
            Op::AddSegment(size) => {
                let seg = engine.add_segment(size).unwrap();
                shadow.add_segment(&engine, seg, size);
            }
            Op::RemoveEmpty => {
                let empty: Vec<_> = engine.empty_segments().collect();
                let expected: Vec<_> = shadow.segments.keys().copied().filter(|&id| !shadow.held_in(id)).collect();
                assert_eq!(empty.iter().copied().collect::<BTreeSet<_>>(), expected.into_iter().collect());
                for id in empty {
                    assert!(engine.remove_segment(id).is_some());
                    shadow.segments.remove(&id);
                    shadow.withheld.remove(&id);
                }
            }
        }
        if i % check_every == 0 || i + 1 == ops.len() {
            check(&engine, &shadow);
        }
    }
    // After freeing everything only empty segments remain, each one free block where nothing is withheld.
    for h in shadow.held.drain(..) {
        engine.free(h.id).unwrap();
    }
    check(&engine, &shadow);
    for (&id, &size) in &shadow.segments {
        let blocks: Vec<_> = engine.blocks_in(id).collect();
        if shadow.withheld.get(&id).is_none_or(BTreeSet::is_empty) {
            assert_eq!(blocks.len(), 1);
            assert!(blocks[0].free && blocks[0].size == size);
        }
        assert!(blocks.iter().all(|b| b.free || b.withheld));
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
fn the_whole_fit_slack_is_the_documented_quarter() {
    assert_eq!(WHOLE_FIT_SLACK, 0.25);
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
    assert!(e.allocate(u64::MAX).is_none(), "rounding overflow is refused");
    assert!(e.allocate(u64::MAX - 254).is_none(), "rounding overflow is refused");
    assert!(e.allocate_in(seg, 0).is_none());
    assert!(e.allocate_in(seg, 8192).is_none());
    assert_eq!(e.allocate(1).map(|a| a.size), Some(256), "one byte takes one aligned unit");
    assert!(e.remove_segment(SegmentId(99)).is_none());
    // A zero request finds nothing withheld even where a real one would.
    e.add_withheld_segment(8192).unwrap();
    assert_eq!(e.find_withheld(0, 4096), None);
    assert!(e.find_withheld(256, 4096).is_some());
    assert_eq!(e.find_withheld(256, 3000), None, "granules are powers of two");
    assert_eq!(e.find_withheld(u64::MAX - 4096, 4096), None, "a request's end past u64::MAX serves from nothing");
    assert_eq!(e.find_withheld(256, 0), None, "granules are powers of two");
}

#[test]
fn block_size_refuses_zero_and_overflow_and_rounds_up() {
    // The huge requests above fail for want of room as much as for overflow; this checks the rounding itself.
    let e = Engine::new(256).unwrap();
    assert_eq!(e.block_size(0), None);
    assert_eq!(e.block_size(1), Some(256));
    assert_eq!(e.block_size(256), Some(256));
    assert_eq!(e.block_size(257), Some(512));
    assert_eq!(e.block_size(u64::MAX - 255), Some(u64::MAX - 255), "the largest aligned size");
    assert_eq!(e.block_size(u64::MAX - 254), None, "rounding overflow");
    assert_eq!(e.block_size(u64::MAX), None, "rounding overflow");
    let unit = Engine::new(1).unwrap();
    assert_eq!(unit.block_size(0), None);
    assert_eq!(unit.block_size(u64::MAX), Some(u64::MAX));
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

/// Holes of one size class: the tightest one serves, not the class's first (most recently freed) one.
#[test]
fn best_fit_within_one_class_takes_the_tightest_hole() {
    let mut e = Engine::new(8).unwrap();
    let seg = e.add_segment(1 << 20).unwrap();
    // Holes of 4,200 and 4,152 bytes (one class: [4096, 4224)), the wider one freed last, so it heads the class.
    let tight = e.allocate(4152).unwrap();
    let _sep1 = e.allocate(64).unwrap();
    let wide = e.allocate(4200).unwrap();
    let _sep2 = e.allocate(64).unwrap();
    assert_eq!(bins::bin_of(4152), bins::bin_of(4200), "one class");
    e.free(tight.block).unwrap();
    e.free(wide.block).unwrap();
    let c = e.allocate(4104).unwrap();
    assert_eq!((c.segment, c.offset), (seg, tight.offset), "4,104 B goes into the 4,152 B hole");
}

/// An engine of alignment 8 with one segment of 1 MiB in which free holes of `sizes` (in address order) lie between
/// live 8-byte separators, freed in the order `freed` (indexes into `sizes`): a class list is last freed first.
/// Returns the engine, the segment and each hole's offset.
fn engine_with_holes(sizes: &[u64], freed: &[usize]) -> (Engine, SegmentId, Vec<u64>) {
    let mut e = Engine::new(8).unwrap();
    let seg = e.add_segment(1 << 20).unwrap();
    let holes: Vec<Allocation> = sizes
        .iter()
        .map(|&size| {
            let hole = e.allocate(size).unwrap();
            e.allocate(8).unwrap();
            hole
        })
        .collect();
    for &i in freed {
        e.free(holes[i].block).unwrap();
    }
    e.check_index();
    (e, seg, holes.iter().map(|h| h.offset).collect())
}

/// First- and second-level index of a size's class.
fn levels(size: u64) -> (usize, usize) {
    let bin = bins::bin_of(size);
    (bin / bins::SL_COUNT, bin % bins::SL_COUNT)
}

/// Five holes of one size class (same first- and second-level index as the request), freed so that the widest
/// heads the class list and the tightest lies in its middle: each request of 4,104 bytes takes the tightest hole
/// left, so they go in order of size, where a first fit (by list or by address) takes the widest first. A request
/// of exactly one hole's size takes that hole, though wider ones come before it in the list.
#[test]
fn best_fit_takes_the_tightest_of_several_holes_of_one_class() {
    let sizes = [4216, 4176, 4112, 4200, 4144];
    for size in sizes {
        assert_eq!(levels(size), levels(4104), "{size}: one class with the request");
    }
    // The list, head first: 4,216, 4,200, 4,176, 4,112, 4,144.
    let (mut e, seg, offsets) = engine_with_holes(&sizes, &[4, 2, 1, 3, 0]);
    for (i, expected) in [2, 4, 1, 3, 0].into_iter().enumerate() {
        let a = e.allocate(4104).unwrap();
        assert_eq!(
            (a.segment, a.offset),
            (seg, offsets[expected]),
            "request {i}: the {}-byte hole is the tightest left",
            sizes[expected]
        );
        e.check_index();
    }
    let (mut e, seg, offsets) = engine_with_holes(&sizes, &[4, 2, 1, 3, 0]);
    let a = e.allocate(4170).unwrap();
    assert_eq!((a.segment, a.offset, a.size), (seg, offsets[1], 4176), "4,170 B rounds to 4,176: the exact hole");
}

/// Holes in two neighbouring classes: the request's own class holds holes too small and one that fits, the class
/// above holds two (freed last). The own-class fit serves first, though every hole of the class above fits too;
/// then, with no fit left in the own class, the holes of the class above (any of them: they differ by under 1/32),
/// before the segment's large free tail.
#[test]
fn best_fit_across_two_classes_takes_the_own_class_fit_then_the_next_class() {
    // Address order: 4,112 (too small), 4,232 (the class above), 4,216 (fits), 4,160 (too small), 4,344 (above).
    let sizes = [4112, 4232, 4216, 4160, 4344];
    let own = levels(4200);
    assert!([4112, 4216, 4160].iter().all(|&s| levels(s) == own), "own class");
    assert!([4232, 4344].iter().all(|&s| levels(s) == (own.0, own.1 + 1)), "the class just above");
    let (mut e, seg, offsets) = engine_with_holes(&sizes, &[0, 2, 3, 1, 4]);
    let a = e.allocate(4200).unwrap();
    assert_eq!((a.segment, a.offset), (seg, offsets[2]), "the 4,216-byte hole of the request's own class");
    let b = e.allocate(4200).unwrap();
    let c = e.allocate(4200).unwrap();
    let mut taken = [b.offset, c.offset];
    taken.sort_unstable();
    assert_eq!(taken, [offsets[1], offsets[4]], "then both holes of the class above, not the tail");
    let d = e.allocate(4200).unwrap();
    assert!(d.offset > offsets[4], "{d:?}: only the segment's tail is left");
    e.check_index();
}

/// The shadow's fit check itself, fed choices the policy forbids: it must refuse a first fit inside a class, a
/// block of the class above where the own class fits, and a miss where a run fits, and accept the tightest.
#[test]
fn the_fit_check_refuses_what_the_policy_does_not_allow() {
    let shadow = Shadow::new(4);
    let seg = SegmentId(0);
    let run = |offset, len| Run { segment: seg, offset, len };
    // 4,216 and 4,144 in the class of 4,104; 4,232 in the class above; a large tail.
    let runs = [run(0, 4216), run(8192, 4144), run(16384, 4232), run(32768, 1 << 19)];
    assert_eq!(allowed_fits(&runs, 4104), vec![run(8192, 4144)], "the tightest of the own class");
    assert_eq!(allowed_fits(&runs, 4220), vec![run(16384, 4232)], "the own class holds no fit: the class above");
    assert_eq!(allowed_fits(&runs, 1 << 20), Vec::<Run>::new(), "nothing holds it");
    let taken =
        |offset, size| Allocation { block: BlockId::new(0, 0), segment: seg, offset, size, segment_was_empty: false };
    let refused = |size, got: Option<Allocation>| {
        let err = std::panic::catch_unwind(|| check_fit(&shadow, &runs, size, got.as_ref()))
            .expect_err("the check accepted a choice the policy forbids");
        err.downcast_ref::<String>().cloned().unwrap_or_default()
    };
    let first_fit = refused(4104, Some(taken(0, 4104)));
    assert!(first_fit.contains("the policy allows only 1 runs"), "{first_fit}");
    let next_class = refused(4104, Some(taken(16384, 4104)));
    assert!(next_class.contains("the policy allows only"), "{next_class}");
    let miss = refused(4104, None);
    assert!(miss.contains("false miss"), "{miss}");
    check_fit(&shadow, &runs, 4104, Some(&taken(8192, 4104)));
    check_fit(&shadow, &runs, 4220, Some(&taken(16384, 4220)));
    check_fit(&shadow, &runs, 1 << 20, None);
    // More blocks in the own class than the scan sees: any that fits, or the class above.
    let mut crowded: Vec<Run> = (0..=FIT_SCAN_LIMIT as u64).map(|i| run(i << 14, 4100)).collect();
    crowded.extend([run(1 << 18, 4216), run(1 << 19, 4144), run(1 << 20, 4232)]);
    let allowed = allowed_fits(&crowded, 4104);
    assert_eq!(allowed, vec![run(1 << 18, 4216), run(1 << 19, 4144), run(1 << 20, 4232)]);
}

/// The engine's index check itself, fed a corrupted index: a free block moved to the list of another class
/// (bitmaps updated to match) must be reported, naming the block and the class.
#[test]
fn the_index_check_finds_a_free_block_in_another_class() {
    let (mut e, _, _) = engine_with_holes(&[4112, 8192], &[0]);
    let bin = bins::bin_of(4112);
    let node = e.free.heads[bin];
    assert_eq!(e.nodes[node].size, 4112);
    let wrong = bins::bin_of(8192);
    e.free.heads[bin] = NIL;
    e.free.bins.clear(bin);
    e.free.heads[wrong] = node;
    e.free.bins.set(wrong);
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.check_index()))
        .expect_err("the check accepted a block in another class");
    let message = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains(&format!("node {node} of 4112 bytes in class {wrong}")), "{message}");
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
fn withheld_space_is_never_handed_out_and_comes_back_where_least_is_needed() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_withheld_segment(64 * GRANULE).unwrap();
    assert!(e.allocate(100).is_none(), "nothing is backed yet");
    // The first request restores just the granules it needs, from the start.
    let r = e.find_withheld(GRANULE + 1, GRANULE).unwrap();
    assert_eq!((r.segment, r.offset, r.len), (seg, 0, 2 * GRANULE));
    let a = e.restore_and_allocate(&r, GRANULE + 1).unwrap();
    assert_eq!(a.offset, 0);
    assert_eq!(e.stats().withheld_bytes, 62 * GRANULE);
    // The rest of the second granule is backed and free: a small request fits there without restoring.
    let b = e.allocate(1000).unwrap();
    assert_eq!(b.offset, a.offset + a.size);
    // A request larger than the free tail restores from the withheld range and runs on from the free block.
    let r = e.find_withheld(3 * GRANULE, GRANULE).unwrap();
    assert_eq!((r.offset, r.len), (2 * GRANULE, 3 * GRANULE), "the free tail of granule 1 counts");
    let c = e.restore_and_allocate(&r, 3 * GRANULE).unwrap();
    assert_eq!(c.offset, b.offset + b.size);
    assert!(e.restore_and_allocate(&r, 3 * GRANULE).is_none(), "a used description is refused");
    // Give back: only granules wholly inside free blocks go. Granule 4 holds c's last bytes.
    e.free(a.block).unwrap();
    let mut released = Vec::new();
    let got = e.withhold_free(GRANULE, u64::MAX, |_| true, |_, o, l| released.push((o, l)));
    assert_eq!((released, got), (vec![(0, GRANULE)], GRANULE));
    assert!(!e.withhold_range(seg, 0, GRANULE, GRANULE), "already withheld");
    assert!(!e.withhold_range(seg, GRANULE, GRANULE, GRANULE), "b and c are live there");
    assert_eq!(e.backed_ranges(seg).collect::<Vec<_>>(), vec![(GRANULE, 4 * GRANULE)]);
    assert_eq!(e.stats().withheld_bytes, 60 * GRANULE);
}

/// An engine with one segment of live blocks of `blocks` granules, in address order, of which block `hole` is
/// then freed and `withheld` (first granule, granules) withheld inside it.
fn holed_segment(blocks: &[u64], hole: usize, withheld: (u64, u64)) -> (Engine, SegmentId) {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(blocks.iter().sum::<u64>() * GRANULE).unwrap();
    let live: Vec<_> = blocks.iter().map(|&g| e.allocate(g * GRANULE).unwrap()).collect();
    e.free(live[hole].block).unwrap();
    assert!(e.withhold_range(seg, withheld.0 * GRANULE, withheld.1 * GRANULE, GRANULE));
    (e, seg)
}

#[test]
fn a_short_withheld_hole_between_free_blocks_is_restored_whole() {
    // Live | free 2 granules | withheld 2 | free 2 | live | rest.
    let (mut e, _) = holed_segment(&[1, 6, 1, 8], 1, (3, 2));
    // 5 granules fit only across the hole: the whole withheld range (2 granules) comes back, not 5.
    assert!(e.allocate(5 * GRANULE).is_none());
    let r = e.find_withheld(5 * GRANULE, GRANULE).unwrap();
    assert_eq!((r.offset, r.len), (3 * GRANULE, 2 * GRANULE));
    let a = e.restore_and_allocate(&r, 5 * GRANULE).unwrap();
    assert_eq!(a.offset, GRANULE);
    assert_eq!(e.stats().withheld_bytes, 0);
}

#[test]
fn a_request_ending_in_the_free_block_after_a_range_restores_the_range_tail() {
    // Live | withheld 4 granules | free 3 | live | rest.
    let (mut e, seg) = holed_segment(&[1, 7, 1, 7], 1, (1, 4));
    // From the head the request would need the whole range (4 granules); ending in the free block, 2 do.
    assert!(e.allocate(5 * GRANULE).is_none());
    let r = e.find_withheld(5 * GRANULE, GRANULE).unwrap();
    assert_eq!((r.segment, r.offset, r.len), (seg, 3 * GRANULE, 2 * GRANULE));
    let a = e.restore_and_allocate(&r, 5 * GRANULE).unwrap();
    assert_eq!((a.offset, a.size), (3 * GRANULE, 5 * GRANULE), "from the first restored granule into the free block");
    assert!(e.restore_and_allocate(&r, 5 * GRANULE).is_none(), "a used description is refused");
    assert_eq!(e.stats().withheld_bytes, 2 * GRANULE);
    assert_eq!(e.backed_ranges(seg).collect::<Vec<_>>(), vec![(0, GRANULE), (3 * GRANULE, 13 * GRANULE)]);
    // Freed, the block and the restored granules can be withheld again, back to the range's old extent.
    e.free(a.block).unwrap();
    assert!(e.withhold_range(seg, 3 * GRANULE, 2 * GRANULE, GRANULE));
    assert_eq!(e.stats().withheld_bytes, 4 * GRANULE);
    assert_eq!(e.backed_ranges(seg).collect::<Vec<_>>(), vec![(0, GRANULE), (5 * GRANULE, 11 * GRANULE)]);
}

/// When the head and the tail of a range need as many granules, the head serves (as before the tail was
/// weighed).
#[test]
fn a_tie_between_head_and_tail_restores_from_the_head() {
    // Live | free 2 granules | withheld 4 | free 2 | live | rest.
    let (mut e, _) = holed_segment(&[1, 8, 1, 6], 1, (3, 4));
    let r = e.find_withheld(3 * GRANULE, GRANULE).unwrap();
    assert_eq!((r.offset, r.len), (3 * GRANULE, GRANULE));
    let a = e.restore_and_allocate(&r, 3 * GRANULE).unwrap();
    assert_eq!(a.offset, GRANULE, "from the free block before");
}

/// `find_withheld` is public: asked when the free block before a withheld range already holds the request (a
/// pool never asks then, its free index would have served), it still restores one granule, the least it ever
/// restores, rather than nothing.
#[test]
fn a_request_the_free_block_before_holds_still_restores_one_granule() {
    // Live | free 3 granules | withheld 2 | live rest.
    let (mut e, seg) = holed_segment(&[1, 5, 2], 1, (4, 2));
    let r = e.find_withheld(2 * GRANULE, GRANULE).unwrap();
    assert_eq!((r.segment, r.offset, r.len), (seg, 4 * GRANULE, GRANULE));
    let a = e.restore_and_allocate(&r, 2 * GRANULE).unwrap();
    assert_eq!(a.offset, GRANULE, "served from the free block's start");
    assert_eq!(e.stats().withheld_bytes, GRANULE);
}

#[test]
fn withholding_takes_the_smallest_free_blocks_first_from_their_top() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(64 * GRANULE).unwrap();
    // Free holes of 8 and 3 granules between live blocks; the rest of the segment is live.
    let blocks: Vec<_> =
        [GRANULE, 8 * GRANULE, GRANULE, 3 * GRANULE, 51 * GRANULE].iter().map(|&s| e.allocate(s).unwrap()).collect();
    e.free(blocks[1].block).unwrap();
    e.free(blocks[3].block).unwrap();
    let mut released = Vec::new();
    let got = e.withhold_free(GRANULE, 2 * GRANULE, |_| true, |s, o, l| released.push((s, o, l)));
    assert_eq!(got, 2 * GRANULE);
    assert_eq!(released, vec![(seg, 11 * GRANULE, 2 * GRANULE)], "top of the 3-granule hole");
    // Segments the caller excludes are left alone.
    assert_eq!(e.withhold_free(GRANULE, u64::MAX, |_| false, |_, _, _| panic!("excluded")), 0);
    let got = e.withhold_free(GRANULE, u64::MAX, |_| true, |_, _, _| {});
    assert_eq!(got, 9 * GRANULE, "the rest of both holes");
    assert_eq!(e.stats().withheld_bytes, 11 * GRANULE);
}

/// Generations never wrap: a node whose generation reaches the last one moves to another slot and its slot is
/// retired, so an id kept from the slot's first use cannot match a block 2^32 uses later.
#[test]
fn a_slot_whose_generation_runs_out_is_retired_not_wrapped() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(1 << 20).unwrap();
    // Free: the node survives coalescing (its neighbour is live) and moves.
    let a = e.allocate(4096).unwrap();
    let keep = e.allocate(4096).unwrap();
    let a_id = e.age(a.block, u32::MAX - 1);
    let stale = a_id;
    e.free(a_id).unwrap();
    e.check_index();
    assert!(e.block(stale).is_none() && e.free(stale).is_none(), "the stale id is refused");
    let again = e.allocate(4096).unwrap();
    assert_eq!((again.segment, again.offset), (seg, a.offset), "same range");
    assert_ne!(again.block.index(), stale.index(), "in another slot");
    // Park: a parked block that reaches the last generation moves too, and unparks and frees by its new id.
    let aged = e.age(again.block, u32::MAX - 1);
    let parked = e.park(aged).unwrap();
    assert_ne!(parked.index(), aged.index());
    let live = e.unpark(parked).unwrap();
    assert_eq!(e.block(live).map(|b| b.offset), Some(a.offset));
    assert!(e.block(aged).is_none());
    e.free(live).unwrap();
    // Absorbed by a free neighbour: the node's slot is vacated and not reused.
    let b = e.allocate(8192).unwrap();
    let c = e.allocate(8192).unwrap();
    assert_eq!(c.offset, b.offset + b.size, "c's address neighbour is b");
    e.free(b.block).unwrap();
    let c_id = e.age(c.block, u32::MAX - 1);
    e.free(c_id).unwrap();
    e.check_index();
    let retired = [stale.index(), aged.index(), c_id.index()];
    let many: Vec<_> = (0..64).map(|_| e.allocate(256).unwrap()).collect();
    for x in &many {
        assert!(!retired.contains(&x.block.index()), "a retired slot was reused");
    }
    for x in many {
        e.free(x.block).unwrap();
    }
    e.free(keep.block).unwrap();
    e.check_index();
    assert_eq!(e.stats().live_blocks, 0);
    assert_eq!(e.empty_segments().count(), 1, "everything coalesced back into one free segment");
}

#[test]
fn a_fitting_block_behind_the_scan_limit_is_found_when_no_larger_class_has_one() {
    // Nine free blocks of 1,024 bytes and one of 1,050, all in the class of a 1,040-byte request, the fitting one
    // last in its list, and nothing free in any larger class: a miss here would grow the pool while a block fits.
    let mut e = Engine::new(2).unwrap();
    let mut sizes = vec![1050];
    sizes.extend([1024; FIT_SCAN_LIMIT + 1]);
    let total: u64 = sizes.iter().map(|s| s + 2).sum();
    let seg = e.add_segment(total).unwrap();
    let mut blocks = Vec::new();
    for &size in &sizes {
        blocks.push(e.allocate_in(seg, size).or_else(|| e.allocate(size)).unwrap());
        e.allocate(2).unwrap(); // a live separator, so the freed blocks do not coalesce
    }
    assert_eq!(e.stats().free_blocks, 0, "the segment is used up");
    for b in &blocks {
        e.free(b.block).unwrap();
    }
    let a = e.allocate(1040).expect("the 1,050-byte block fits");
    assert_eq!((a.offset, a.size), (blocks[0].offset, 1040));
    assert_eq!(e.allocate(1040).map(|a| a.size), None, "now nothing fits");
}

// ------------------------------------------------------------------------------------------------ whole blocks

/// Operations on an engine of whole blocks: allocations, frees, segments added at a chosen size (as a pool adds
/// one for a miss), and empty segments removed.
#[derive(Debug, Clone)]
enum WholeOp {
    Alloc(u64),
    Free(usize),
    AddFor(u64),
    RemoveEmpty(usize),
    Park(usize),
}

fn whole_op() -> impl Strategy<Value = WholeOp> {
    prop_oneof![
        6 => (1u64..5_000).prop_map(WholeOp::Alloc),
        4 => any::<usize>().prop_map(WholeOp::Free),
        2 => (1u64..5_000).prop_map(WholeOp::AddFor),
        1 => any::<usize>().prop_map(WholeOp::RemoveEmpty),
        1 => any::<usize>().prop_map(WholeOp::Park),
    ]
}

/// An engine of whole blocks against a shadow of segment sizes: a block is always a whole segment; an
/// allocation takes a free segment at most 1/4 larger than the request and one the fit policy allows
/// ([`allowed_fits`], free segments as runs), and misses only when none lies within 1/16 of it; the statistics
/// are the shadow's.
fn run_whole(ops: &[WholeOp], alignment: u64) {
    let mut e = Engine::whole_blocks(alignment).unwrap();
    assert!(e.is_whole_blocks());
    let round = |s: u64| s.next_multiple_of(alignment);
    let mut segments: BTreeMap<SegmentId, u64> = BTreeMap::new();
    let mut live: Vec<(Allocation, bool)> = Vec::new(); // (block, parked)
    for op in ops {
        match *op {
            WholeOp::Alloc(asked) => {
                let r = round(asked);
                let taken: BTreeSet<SegmentId> = live.iter().map(|(a, _)| a.segment).collect();
                let free: Vec<u64> =
                    segments.iter().filter(|(id, _)| !taken.contains(id)).map(|(_, &size)| size).collect();
                let runs: Vec<Run> = segments
                    .iter()
                    .filter(|(id, _)| !taken.contains(id))
                    .map(|(&segment, &len)| Run { segment, offset: 0, len })
                    .collect();
                match e.allocate(asked) {
                    Some(a) => {
                        assert_eq!(a.offset, 0, "{a:?}: a block starts its segment");
                        assert_eq!(Some(a.size), segments.get(&a.segment).copied(), "{a:?}: the whole segment");
                        assert!(!taken.contains(&a.segment), "{a:?}: a segment handed out twice");
                        assert!(a.size >= r && a.size - r <= r / 4, "{a:?} for {r}: beyond the slack");
                        // The slack only narrows the choice: what is taken is what the fit policy allows.
                        let allowed = allowed_fits(&runs, r);
                        assert!(
                            allowed.iter().any(|x| x.segment == a.segment),
                            "{a:?} for {r}, not one of {allowed:?}"
                        );
                        assert!(a.segment_was_empty);
                        live.push((a, false));
                    }
                    None => {
                        let near = free.iter().find(|&&s| s >= r && s - r <= r / 16);
                        assert!(near.is_none(), "a miss for {r} with a free segment of {near:?}");
                    }
                }
            }
            WholeOp::Free(k) if !live.is_empty() => {
                let (a, _) = live.swap_remove(k % live.len());
                let freed = e.free(a.block).expect("a live or parked block frees");
                assert_eq!((freed.segment, freed.size, freed.segment_now_empty), (a.segment, a.size, true));
                assert!(e.free(a.block).is_none(), "a double free is refused");
            }
            WholeOp::AddFor(asked) => {
                let id = e.add_segment(asked).unwrap();
                segments.insert(id, round(asked));
                let a = e.allocate_in(id, asked.div_ceil(3)).expect("a fresh segment serves any smaller request");
                assert_eq!((a.segment, a.offset, a.size), (id, 0, round(asked)), "allocate_in takes it whole");
                live.push((a, false));
            }
            WholeOp::RemoveEmpty(k) => {
                let empty: Vec<SegmentId> = e.empty_segments().collect();
                if let Some(&id) = empty.get(k % empty.len().max(1)) {
                    assert_eq!(e.remove_segment(id), segments.remove(&id));
                }
            }
            WholeOp::Park(k) if !live.is_empty() => {
                let i = k % live.len();
                let (a, parked) = live[i];
                let id = if parked { e.unpark(a.block) } else { e.park(a.block) }.unwrap();
                live[i] = (Allocation { block: id, ..a }, !parked);
            }
            WholeOp::Free(_) | WholeOp::Park(_) => {}
        }
        e.check_index();
        let s = e.stats();
        let taken: BTreeSet<SegmentId> = live.iter().map(|(a, _)| a.segment).collect();
        assert_eq!(s.reserved_bytes, segments.values().sum::<u64>());
        assert_eq!(s.allocated_bytes, live.iter().map(|(a, _)| a.size).sum::<u64>());
        assert_eq!(s.live_blocks, live.len() as u64);
        assert_eq!(s.free_blocks, (segments.len() - taken.len()) as u64, "every free block is a whole segment");
        assert_eq!(s.inactive_split_bytes(), 0, "nothing is ever split");
        assert_eq!(
            s.empty_segment_bytes,
            segments.iter().filter(|(id, _)| !taken.contains(id)).map(|(_, &size)| size).sum::<u64>()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn whole_blocks_match_their_shadow(ops in prop::collection::vec(whole_op(), 1..400), align_shift in 0u32..9) {
        run_whole(&ops, 1 << align_shift);
    }
}

#[test]
fn whole_blocks_reuse_a_segment_up_to_a_quarter_larger_and_take_the_tightest() {
    let mut e = Engine::whole_blocks(8).unwrap();
    let big = e.add_segment(1024).unwrap();
    assert!(e.allocate(816).is_none(), "1,024 is more than 1/4 above 816: a miss, not a split");
    let a = e.allocate(824).expect("1,024 is within 1/4 above 824");
    assert_eq!((a.segment, a.offset, a.size), (big, 0, 1024));
    e.free(a.block).unwrap();
    let tight = e.add_segment(1000).unwrap();
    let b = e.allocate(1000).unwrap();
    assert_eq!((b.segment, b.size), (tight, 1000), "the tightest free segment");
    let c = e.allocate(1000).unwrap();
    assert_eq!((c.segment, c.size), (big, 1024));
    assert!(e.allocate(8).is_none());
    let mut edge = Engine::whole_blocks(8).unwrap();
    edge.add_segment(1000).unwrap();
    assert!(edge.allocate(792).is_none(), "1,000 is more than a quarter above 792");
    assert_eq!(edge.allocate(800).map(|a| a.size), Some(1000), "1,000 is exactly a quarter above 800");
    let fresh = e.add_segment(4096).unwrap();
    let d = e.allocate_in(fresh, 8).unwrap();
    assert_eq!(d.size, 4096, "allocate_in hands out the whole segment");
    assert_eq!(e.stats().inactive_split_bytes(), 0);
}

#[test]
fn whole_blocks_find_a_fitting_block_of_their_class_behind_a_too_large_head() {
    // Nine free segments of 1,024 bytes and one of 1,050 in the class of a 1,040-byte request, the fitting one
    // last, and one of 4,000 in a higher class: the higher class's head is far beyond the slack, so the request's
    // own class is walked.
    let mut e = Engine::whole_blocks(2).unwrap();
    let mut blocks = Vec::new();
    for size in std::iter::once(1050).chain([1024; FIT_SCAN_LIMIT + 1]).chain([4000]) {
        let segment = e.add_segment(size).unwrap();
        blocks.push(e.allocate_in(segment, size).unwrap());
    }
    for b in &blocks {
        e.free(b.block).unwrap();
    }
    let a = e.allocate(1040).expect("the 1,050-byte segment fits");
    assert_eq!((a.segment, a.size), (blocks[0].segment, 1050));
    assert!(e.allocate(1040).is_none(), "now nothing fits within the slack");
}

#[test]
fn whole_blocks_withhold_nothing() {
    let mut e = Engine::whole_blocks(4096).unwrap();
    assert!(e.add_withheld_segment(1 << 20).is_none());
    let seg = e.add_segment(1 << 20).unwrap();
    assert_eq!(e.withhold_free(4096, 1 << 20, |_| true, |_, _, _| panic!("nothing to release")), 0);
    assert!(!e.withhold_range(seg, 0, 4096, 4096));
    assert_eq!(e.stats().withheld_bytes, 0);
    assert!(Engine::whole_blocks(48).is_none());
}

#[test]
fn the_empty_segment_covering_a_want_is_the_tightest_and_only_in_whole_engines() {
    let mut e = Engine::whole_blocks(8).unwrap();
    let sizes = [4096u64, 1024, 65536, 2048];
    let ids: Vec<SegmentId> = sizes.iter().map(|&s| e.add_segment(s).unwrap()).collect();
    assert_eq!(e.empty_segment_covering(1500), Some((ids[3], 2048)));
    assert_eq!(e.empty_segment_covering(4096), Some((ids[0], 4096)));
    assert_eq!(e.empty_segment_covering(5000), Some((ids[2], 65536)));
    assert_eq!(e.empty_segment_covering(65537), None);
    assert_eq!(e.empty_segment_covering(0), None);
    let live = e.allocate_in(ids[3], 2048).unwrap();
    assert_eq!(e.empty_segment_covering(1500), Some((ids[0], 4096)), "a live segment is not empty");
    e.free(live.block).unwrap();
    let mut split = Engine::new(8).unwrap();
    split.add_segment(4096).unwrap();
    assert_eq!(split.empty_segment_covering(100), None, "free blocks of an engine that splits are not segments");
}

// ------------------------------------------------------------------------------------------------ planned placement

/// In a segment's layout (`layout`): a free block, and a live one.
const FREE: bool = true;
const LIVE: bool = false;

/// The blocks of a segment in address order, as (offset, size, free).
fn layout(e: &Engine, segment: SegmentId) -> Vec<(u64, u64, bool)> {
    e.blocks_in(segment).map(|b| (b.offset, b.size, b.free)).collect()
}

/// Everything an `allocate_at` refusal must leave as it was: the counts and every segment's blocks.
fn snapshot(e: &Engine) -> (EngineStats, Vec<(SegmentId, Vec<SegmentBlock>)>) {
    (e.stats(), e.segment_ids().map(|s| (s, e.blocks_in(s).collect())).collect())
}

/// Asserts that `allocate_at` refuses the placement and changes nothing.
#[track_caller]
fn refused(e: &mut Engine, segment: SegmentId, after: Option<BlockId>, offset: u64, size: u64, why: &str) {
    let before = snapshot(e);
    let got = e.allocate_at(segment, after, offset, size);
    assert_eq!(got, None, "{why}: {size} bytes at {offset} of {segment:?} after {after:?}");
    assert_eq!(snapshot(e), before, "{why}: a refusal changed the engine");
    e.check_index();
}

#[test]
fn allocate_at_places_a_block_at_the_start_and_in_the_middle_of_a_free_segment() {
    let mut e = Engine::new(256).unwrap();
    let first = e.add_segment(16384).unwrap();
    let second = e.add_segment(16384).unwrap();
    // At offset 0 of an empty segment, with no block below: the size is rounded up, the rest stays free.
    let a = e.allocate_at(first, None, 0, 1000).unwrap();
    assert_eq!((a.segment, a.offset, a.size, a.segment_was_empty), (first, 0, 1024, true));
    assert_eq!(e.block(a.block).map(|b| (b.segment, b.offset, b.size)), Some((first, 0, 1024)));
    assert_eq!(layout(&e, first), vec![(0, 1024, LIVE), (1024, 15360, FREE)]);
    e.check_index();
    let s = e.stats();
    assert_eq!((s.allocated_bytes, s.live_blocks, s.free_blocks), (1024, 1, 2));
    assert_eq!((s.empty_segment_bytes, s.reserved_bytes), (16384, 32768), "only the second segment is empty");
    // In the middle: the free block is split three ways, free before and after the placed range.
    let b = e.allocate_at(second, None, 4096, 2048).unwrap();
    assert_eq!((b.segment, b.offset, b.size, b.segment_was_empty), (second, 4096, 2048, true));
    assert_eq!(layout(&e, second), vec![(0, 4096, FREE), (4096, 2048, LIVE), (6144, 10240, FREE)]);
    e.check_index();
    let s = e.stats();
    assert_eq!((s.allocated_bytes, s.live_blocks, s.free_blocks), (3072, 2, 3));
    assert_eq!((s.empty_segment_bytes, s.reserved_bytes), (0, 32768));
    assert_eq!(s.inactive_split_bytes(), 32768 - 3072);
    // Still no live block below offset 1024 of the second segment (b lies above): no neighbour to name.
    let c = e.allocate_at(second, None, 1024, 256).unwrap();
    assert_eq!((c.offset, c.size, c.segment_was_empty), (1024, 256, false));
    assert_eq!(
        layout(&e, second),
        vec![(0, 1024, FREE), (1024, 256, LIVE), (1280, 2816, FREE), (4096, 2048, LIVE), (6144, 10240, FREE)]
    );
    e.check_index();
    // The remainders are ordinary free blocks, indexed by size: `allocate` finds them.
    let d = e.allocate(2816).unwrap();
    assert_eq!((d.segment, d.offset), (second, 1280), "the exact fit left between c and b");
    assert_eq!(e.stats().free_blocks, 3);
    e.check_index();
}

#[test]
fn allocate_at_places_a_block_after_a_live_neighbour_at_its_end_and_past_a_gap() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(16384).unwrap();
    let a = e.allocate_at(seg, None, 0, 1024).unwrap();
    // Right at its neighbour's end: the free block starts where the range does, so only a tail is left.
    let b = e.allocate_at(seg, Some(a.block), 1024, 512).unwrap();
    assert_eq!((b.segment, b.offset, b.size, b.segment_was_empty), (seg, 1024, 512, false));
    assert_eq!(layout(&e, seg), vec![(0, 1024, LIVE), (1024, 512, LIVE), (1536, 14848, FREE)]);
    e.check_index();
    // Past a gap: a free block before the range and one after it.
    let c = e.allocate_at(seg, Some(b.block), 4096, 1000).unwrap();
    assert_eq!((c.offset, c.size), (4096, 1024));
    assert_eq!(
        layout(&e, seg),
        vec![(0, 1024, LIVE), (1024, 512, LIVE), (1536, 2560, FREE), (4096, 1024, LIVE), (5120, 11264, FREE)]
    );
    e.check_index();
    // Ending at the segment's end: nothing after it.
    let d = e.allocate_at(seg, Some(c.block), 16128, 256).unwrap();
    assert_eq!((d.offset, d.size), (16128, 256));
    assert_eq!(&layout(&e, seg)[4..], &[(5120, 11008, FREE), (16128, 256, LIVE)]);
    e.check_index();
    // Inside the gap before c: b is still the live block closest below.
    let f = e.allocate_at(seg, Some(b.block), 2048, 1024).unwrap();
    assert_eq!((f.offset, f.size), (2048, 1024));
    // Filling what is left of the gap above f exactly: no remainder on either side.
    let g = e.allocate_at(seg, Some(f.block), 3072, 1024).unwrap();
    assert_eq!((g.offset, g.size), (3072, 1024));
    assert_eq!(
        layout(&e, seg),
        vec![
            (0, 1024, LIVE),
            (1024, 512, LIVE),
            (1536, 512, FREE),
            (2048, 1024, LIVE),
            (3072, 1024, LIVE),
            (4096, 1024, LIVE),
            (5120, 11008, FREE),
            (16128, 256, LIVE),
        ]
    );
    e.check_index();
    let s = e.stats();
    assert_eq!((s.allocated_bytes, s.live_blocks, s.free_blocks), (4864, 6, 2));
    assert_eq!((s.empty_segment_bytes, s.reserved_bytes), (0, 16384));
    for x in [a, b, c, d, f, g] {
        assert_eq!(e.block(x.block).map(|y| (y.offset, y.size)), Some((x.offset, x.size)));
    }
}

#[test]
fn freeing_placed_blocks_coalesces_their_segment_back_into_one_free_block() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(65536).unwrap();
    let other = e.add_segment(4096).unwrap();
    let before = e.stats();
    // A plan with gaps, placed in address order, each after the one before.
    let plan = [(0, 4096), (4096, 1024), (8192, 8192), (20480, 256), (61440, 4096)];
    let mut after = None;
    let mut placed = Vec::new();
    for (offset, size) in plan {
        let a = e.allocate_at(seg, after, offset, size).unwrap();
        assert_eq!((a.offset, a.size, a.segment_was_empty), (offset, size, after.is_none()));
        after = Some(a.block);
        placed.push(a);
        e.check_index();
    }
    let s = e.stats();
    assert_eq!((s.allocated_bytes, s.live_blocks), (17664, 5));
    assert_eq!(s.free_blocks, 4, "three gaps and the other segment");
    assert_eq!(s.empty_segment_bytes, 4096, "the other segment");
    // Freed out of address order: each free merges with whichever neighbours are free.
    for (i, k) in [2, 0, 4, 1, 3].into_iter().enumerate() {
        let freed = e.free(placed[k].block).unwrap();
        assert_eq!((freed.segment, freed.size), (seg, plan[k].1));
        assert_eq!(freed.segment_now_empty, i == 4, "empty only once the last block goes");
        e.check_index();
    }
    assert_eq!(layout(&e, seg), vec![(0, 65536, FREE)]);
    assert_eq!(layout(&e, other), vec![(0, 4096, FREE)]);
    assert!(e.is_segment_empty(seg));
    assert_eq!(e.stats(), before, "counts back to the empty segments'");
    // The empty segment serves another plan at once, and is released whole once it is freed again.
    let again = e.allocate_at(seg, None, 8192, 4096).unwrap();
    assert!(again.segment_was_empty);
    assert!(e.free(again.block).unwrap().segment_now_empty);
    assert_eq!(e.stats(), before);
    assert_eq!(e.remove_segment(seg), Some(65536));
    e.check_index();
}

#[test]
fn allocate_at_refuses_a_range_that_is_not_free_as_described_and_changes_nothing() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(16384).unwrap();
    // a | b | free [2048, 4096) | c | free [5120, 16384).
    let a = e.allocate_at(seg, None, 0, 1024).unwrap();
    let b = e.allocate_at(seg, Some(a.block), 1024, 1024).unwrap();
    let c = e.allocate_at(seg, Some(b.block), 4096, 1024).unwrap();
    let (a, b, c) = (Some(a.block), Some(b.block), Some(c.block));

    refused(&mut e, seg, a, 2048, 256, "the block after `after` is live");
    refused(&mut e, seg, None, 2048, 256, "the segment's first block is live");
    refused(&mut e, seg, None, 0, 256, "the segment's first block is live, at its own offset");
    refused(&mut e, seg, b, 1536, 256, "the range starts inside `after`");
    refused(&mut e, seg, b, 1024, 256, "the range is `after` itself");
    refused(&mut e, seg, c, 2048, 256, "the range lies below `after`");
    refused(&mut e, seg, b, 2048, 2304, "the free block after `after` is too short");
    refused(&mut e, seg, b, 3840, 512, "the range runs into the next live block");
    refused(&mut e, seg, c, 16128, 512, "the range runs past the segment's end");
    refused(&mut e, seg, c, 5120, 11265, "the size rounded up no longer fits");
    refused(&mut e, seg, c, 1 << 40, 256, "the range lies far past the segment's end");
    refused(&mut e, seg, b, 2048 + 128, 256, "offset off the alignment");
    refused(&mut e, seg, b, 2049, 256, "offset off the alignment");
    refused(&mut e, seg, b, 2048, 0, "zero size");
    refused(&mut e, seg, b, 2048, u64::MAX, "size overflows when rounded");
    refused(&mut e, seg, b, 2048, u64::MAX - 254, "size overflows when rounded");
    refused(&mut e, seg, c, u64::MAX - 255, 256, "offset plus size overflows");
    refused(&mut e, seg, c, 1 << 63, 1 << 63, "offset plus size overflows to zero");
    refused(&mut e, seg, Some(BlockId::new(9999, 0)), 2048, 256, "`after` was never handed out");
    refused(&mut e, SegmentId(99), None, 0, 256, "no such segment");
    refused(&mut e, SegmentId(99), b, 2048, 256, "no such segment, `after` in another");
    let gone = e.add_segment(4096).unwrap();
    assert_eq!(e.remove_segment(gone), Some(4096));
    refused(&mut e, gone, None, 0, 256, "a removed segment");

    // After all that, the free ranges are still there to be placed.
    let fill = e.allocate_at(seg, b, 2048, 2048).unwrap();
    assert_eq!((fill.offset, fill.size), (2048, 2048));
    let tail = e.allocate_at(seg, c, 5120, 11264).unwrap();
    assert_eq!((tail.offset, tail.size), (5120, 11264));
    assert_eq!(e.stats().free_blocks, 0);
    e.check_index();

    // An engine of whole blocks never splits, so it places nothing.
    let mut whole = Engine::whole_blocks(256).unwrap();
    let ws = whole.add_segment(4096).unwrap();
    refused(&mut whole, ws, None, 0, 4096, "an engine of whole blocks, the whole segment");
    refused(&mut whole, ws, None, 0, 256, "an engine of whole blocks");

    // A withheld range is not free: neither a wholly withheld segment nor one between `after` and the range.
    let mut w = Engine::new(256).unwrap();
    let ws = w.add_withheld_segment(4 * GRANULE).unwrap();
    refused(&mut w, ws, None, 0, 256, "the segment's first block is withheld");
    // Live [0, G) | withheld [G, 3G) | free [3G, 7G) | live [7G, 8G).
    let (mut h, hs) = holed_segment(&[1, 6, 1], 1, (1, 2));
    let first = h.blocks_in(hs).next().unwrap().block;
    assert!(first.is_some());
    refused(&mut h, hs, first, GRANULE, 256, "the block after `after` is withheld");
    refused(&mut h, hs, first, 3 * GRANULE, 256, "a withheld range lies between `after` and the range");
}

#[test]
fn allocate_at_refuses_a_stale_or_parked_neighbour() {
    let mut e = Engine::new(256).unwrap();
    let seg = e.add_segment(16384).unwrap();
    let a = e.allocate_at(seg, None, 0, 1024).unwrap();
    let b = e.allocate_at(seg, Some(a.block), 1024, 1024).unwrap();
    e.free(b.block).unwrap();
    // b was the live block closest below 2048; freed, its id names nothing, though its range is free.
    refused(&mut e, seg, Some(b.block), 2048, 256, "a freed `after`");
    refused(&mut e, seg, Some(b.block), 1024, 256, "a freed `after`, at its own old offset");
    // A freed block whose slot serves a new block at the same place: the old id is still refused.
    e.free(a.block).unwrap();
    let again = e.allocate_at(seg, None, 0, 1024).unwrap();
    assert_eq!(again.block.index(), a.block.index(), "the freed block's slot serves again");
    assert_ne!(again.block, a.block);
    refused(&mut e, seg, Some(a.block), 1024, 256, "a stale `after` whose slot holds a live block");
    refused(&mut e, seg, Some(b.block), 2048, 256, "a stale `after`");
    // A parked neighbour is not live: neither its old id nor its parked one places.
    let parked = e.park(again.block).unwrap();
    refused(&mut e, seg, Some(again.block), 1024, 256, "the id a block had before it was parked");
    refused(&mut e, seg, Some(parked), 1024, 256, "a parked `after`");
    // Unparked, it is live again.
    assert_eq!(e.unpark(parked), Some(parked));
    let next = e.allocate_at(seg, Some(parked), 1024, 256).unwrap();
    assert_eq!((next.offset, next.size), (1024, 256));
    e.check_index();
}

#[test]
fn allocate_at_refuses_a_neighbour_from_another_segment() {
    let mut e = Engine::new(256).unwrap();
    let s1 = e.add_segment(8192).unwrap();
    let s2 = e.add_segment(8192).unwrap();
    let x = e.allocate_at(s1, None, 0, 1024).unwrap();
    let y = e.allocate_at(s2, None, 0, 1024).unwrap();
    // Both segments are alike: a live block over [0, 1024), the rest free. Only each one's own block places there.
    refused(&mut e, s2, Some(x.block), 1024, 1024, "`after` lies in the other segment");
    refused(&mut e, s1, Some(y.block), 1024, 1024, "`after` lies in the other segment");
    refused(&mut e, s1, Some(y.block), 4096, 256, "`after` lies in the other segment, past a gap");
    let a = e.allocate_at(s2, Some(y.block), 1024, 1024).unwrap();
    assert_eq!((a.segment, a.offset, a.size), (s2, 1024, 1024));
    assert_eq!(layout(&e, s1), vec![(0, 1024, LIVE), (1024, 7168, FREE)], "the other segment is untouched");
    e.check_index();
}

/// Operations for `allocate_at` against a shadow of live ranges.
#[derive(Debug, Clone)]
enum PlanOp {
    /// Place a range in a segment (picked by the first value): its offset in alignment units (nudged off the
    /// alignment when `misalign`), its size in units less `trim` bytes (rounded back up by the engine), and which
    /// neighbour to name: mostly the true one, else none or a live block picked by `pick`.
    Place { segment: usize, offset: u64, units: u64, trim: u64, neighbour: u8, pick: usize, misalign: bool },
    /// Free a live block (picked by the value).
    Free(usize),
    /// Allocate by size, as a pool does for what no plan placed.
    Alloc(u64),
}

fn plan_op() -> impl Strategy<Value = PlanOp> {
    prop_oneof![
        8 => (any::<usize>(), 0u64..72, 1u64..24, any::<u64>(), 0u8..10, any::<usize>(), prop::bool::weighted(0.05))
            .prop_map(|(segment, offset, units, trim, neighbour, pick, misalign)| PlanOp::Place {
                segment,
                offset,
                units,
                trim,
                neighbour,
                pick,
                misalign
            }),
        4 => any::<usize>().prop_map(PlanOp::Free),
        1 => (1u64..8).prop_map(PlanOp::Alloc),
    ]
}

/// A live block of the shadow.
#[derive(Debug, Clone, Copy)]
struct Placed {
    segment: SegmentId,
    offset: u64,
    size: u64,
    id: BlockId,
}

/// Checks the engine against the shadow: every segment's blocks are its live ranges and the maximal gaps between
/// them, free; the counts agree.
fn check_placed(e: &Engine, segments: &[(SegmentId, u64)], live: &[Placed]) {
    e.check_index();
    let mut free_blocks = 0;
    let mut empty = 0;
    for &(id, size) in segments {
        let mut mine: Vec<Placed> = live.iter().copied().filter(|p| p.segment == id).collect();
        mine.sort_unstable_by_key(|p| p.offset);
        let mut expected = Vec::new();
        let mut end = 0;
        for p in &mine {
            assert!(p.offset >= end, "overlap in the shadow at {p:?}");
            if p.offset > end {
                expected.push((end, p.offset - end, None));
            }
            expected.push((p.offset, p.size, Some(p.id)));
            end = p.offset + p.size;
        }
        if end < size {
            expected.push((end, size - end, None));
        }
        free_blocks += expected.iter().filter(|b| b.2.is_none()).count() as u64;
        if mine.is_empty() {
            empty += size;
        }
        let got: Vec<_> = e
            .blocks_in(id)
            .map(|b| {
                assert_eq!(b.free, b.block.is_none(), "{b:?}: free or live, nothing else here");
                (b.offset, b.size, b.block)
            })
            .collect();
        assert_eq!(got, expected, "blocks of {id:?}");
    }
    let s = e.stats();
    assert_eq!(s.allocated_bytes, live.iter().map(|p| p.size).sum::<u64>());
    assert_eq!(s.live_blocks, live.len() as u64);
    assert_eq!(s.free_blocks, free_blocks);
    assert_eq!(s.empty_segment_bytes, empty);
    assert_eq!(s.reserved_bytes, segments.iter().map(|s| s.1).sum::<u64>());
}

/// Random placements against a shadow of live ranges. With the true neighbour (the live block ending closest
/// below the offset, or none), `allocate_at` must place exactly the ranges that lie inside the segment, aligned,
/// and overlap no live block; with any other neighbour it must refuse (the free block after a block that is not
/// the closest below cannot reach the range). Returns how many placements succeeded, and how many free ranges
/// were refused for the wrong neighbour and how many ranges for overlapping a live block.
fn run_planned(ops: &[PlanOp], alignment: u64, segment_units: &[u64]) -> (u64, u64, u64) {
    let mut e = Engine::new(alignment).unwrap();
    let segments: Vec<(SegmentId, u64)> =
        segment_units.iter().map(|&u| (e.add_segment(u * alignment).unwrap(), u * alignment)).collect();
    let mut live: Vec<Placed> = Vec::new();
    let (mut placed, mut wrong_neighbour, mut overlapping) = (0, 0, 0);
    for op in ops {
        match *op {
            PlanOp::Place { segment, offset, units, trim, neighbour, pick, misalign } => {
                let (seg, seg_size) = segments[segment % segments.len()];
                let offset = offset * alignment + if misalign { alignment / 2 } else { 0 };
                let rounded = units * alignment;
                let size = rounded - trim % alignment;
                let end = offset + rounded;
                let truth = live
                    .iter()
                    .filter(|p| p.segment == seg && p.offset + p.size <= offset)
                    .max_by_key(|p| p.offset + p.size)
                    .map(|p| p.id);
                let after = match neighbour {
                    0..=6 => truth,
                    7 => None,
                    _ if live.is_empty() => truth,
                    _ => Some(live[pick % live.len()].id),
                };
                let overlaps = live.iter().any(|p| p.segment == seg && p.offset < end && offset < p.offset + p.size);
                let free = offset.is_multiple_of(alignment) && end <= seg_size && !overlaps;
                let was_empty = !live.iter().any(|p| p.segment == seg);
                let before = snapshot(&e);
                match e.allocate_at(seg, after, offset, size) {
                    Some(a) => {
                        assert!(free, "{a:?} placed over a live block or outside {seg:?} of {seg_size}");
                        assert_eq!(after, truth, "{a:?} placed after {after:?}, not the closest block below");
                        assert_eq!(
                            (a.segment, a.offset, a.size, a.segment_was_empty),
                            (seg, offset, rounded, was_empty)
                        );
                        live.push(Placed { segment: seg, offset, size: rounded, id: a.block });
                        placed += 1;
                    }
                    None => {
                        assert!(!free || after != truth, "refused the free range {offset}+{rounded} of {seg:?}");
                        assert_eq!(snapshot(&e), before, "a refusal changed the engine");
                        wrong_neighbour += u64::from(free);
                        overlapping += u64::from(overlaps);
                    }
                }
            }
            PlanOp::Free(k) if !live.is_empty() => {
                let p = live.swap_remove(k % live.len());
                let freed = e.free(p.id).expect("a live block frees");
                assert_eq!((freed.segment, freed.size), (p.segment, p.size));
                assert_eq!(freed.segment_now_empty, !live.iter().any(|q| q.segment == p.segment));
                assert!(e.allocate_at(p.segment, Some(p.id), p.offset + p.size, alignment).is_none(), "stale id");
            }
            PlanOp::Free(_) => {}
            PlanOp::Alloc(units) => {
                if let Some(a) = e.allocate(units * alignment) {
                    live.push(Placed { segment: a.segment, offset: a.offset, size: a.size, id: a.block });
                }
            }
        }
        check_placed(&e, &segments, &live);
    }
    // Freed, every segment is one free block again.
    for p in live.drain(..) {
        e.free(p.id).unwrap();
    }
    check_placed(&e, &segments, &live);
    for &(id, size) in &segments {
        assert_eq!(layout(&e, id), vec![(0, size, FREE)]);
        assert!(e.is_segment_empty(id));
    }
    let s = e.stats();
    assert_eq!((s.empty_segment_bytes, s.free_blocks), (s.reserved_bytes, segments.len() as u64));
    (placed, wrong_neighbour, overlapping)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn allocate_at_matches_a_shadow_of_live_ranges(
        ops in prop::collection::vec(plan_op(), 1..300),
        align_shift in 0u32..9,
        segment_units in prop::collection::vec(1u64..80, 1..4),
    ) {
        run_planned(&ops, 1 << align_shift, &segment_units);
    }
}

/// A longer deterministic sequence, dense enough that most placements meet live blocks.
#[test]
fn a_long_sequence_of_placements_matches_the_shadow() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let ops = prop::collection::vec(plan_op(), 20_000).new_tree(&mut runner).unwrap().current();
    let (placed, wrong_neighbour, overlapping) = run_planned(&ops, 256, &[64, 40, 8]);
    eprintln!("placed {placed}, refused {wrong_neighbour} for the neighbour, {overlapping} overlapping");
    assert!(placed > 2000 && wrong_neighbour > 200 && overlapping > 1000, "every outcome is exercised");
}

// ----- ranges: free granules, a named range, withheld space restored as free -----

/// `[offset, end)` of every live block of `segment`, by offset.
fn live_ranges(e: &Engine, segment: SegmentId) -> Vec<(u64, u64)> {
    e.blocks_in(segment).filter(|b| !b.free && !b.withheld).map(|b| (b.offset, b.offset + b.size)).collect()
}

#[test]
fn free_granules_finds_whole_granules_inside_free_blocks_smallest_blocks_first() {
    let mut e = Engine::new(256).unwrap();
    let s = e.add_segment(64 * GRANULE).unwrap();
    // Live at [0, 1.5g), free [1.5g, 4g) (whole granules 2..4), live [4g, 5g), free [5g, 64g).
    let a = e.allocate_at(s, None, 0, GRANULE + GRANULE / 2).unwrap();
    let b = e.allocate_at(s, None, 4 * GRANULE, GRANULE);
    assert!(b.is_none(), "allocate_at needs the live block below it");
    let b = e.allocate_at(s, Some(a.block), 4 * GRANULE, GRANULE).unwrap();
    let runs = e.free_granules(GRANULE, 3 * GRANULE);
    // The small free block first (its granules 2 and 3), then the large one from its bottom.
    assert_eq!(
        runs,
        vec![
            GranuleRun { segment: s, offset: 2 * GRANULE, len: 2 * GRANULE },
            GranuleRun { segment: s, offset: 5 * GRANULE, len: GRANULE },
        ]
    );
    // Nothing was taken, and a want past what is free returns what there is.
    assert_eq!(live_ranges(&e, s), vec![(0, GRANULE + GRANULE / 2), (4 * GRANULE, 5 * GRANULE)]);
    assert_eq!(e.free_granules(GRANULE, u64::MAX).iter().map(|r| r.len).sum::<u64>(), 61 * GRANULE);
    assert!(e.free_granules(3000, GRANULE).is_empty(), "a granule must be a power of two");
    assert!(e.free_granules(128, GRANULE).is_empty(), "a granule below the alignment");
    e.free(b.block).unwrap();
    e.check_index();
}

#[test]
fn allocate_range_takes_the_range_from_the_free_block_covering_it_or_refuses() {
    let mut e = Engine::new(256).unwrap();
    let s = e.add_segment(16 * GRANULE).unwrap();
    let first = e.allocate_range(s, None, 4 * GRANULE, 2 * GRANULE).unwrap();
    assert_eq!((first.offset, first.size), (4 * GRANULE, 2 * GRANULE));
    // Inside the free space after it, found by walking; then again with a hint that names a stale node.
    let second = e.allocate_range(s, Some(9999), 10 * GRANULE, 1000).unwrap();
    assert_eq!((second.offset, second.size), (10 * GRANULE, 1024), "the size is rounded to the alignment");
    assert_eq!(live_ranges(&e, s), vec![(4 * GRANULE, 6 * GRANULE), (10 * GRANULE, 10 * GRANULE + 1024)]);
    let before = e.stats();
    // Refusals change nothing: over a live block, across one, off the alignment, zero, past the end, no segment.
    for (segment, offset, size) in [
        (s, 5 * GRANULE, GRANULE),
        (s, 3 * GRANULE, 2 * GRANULE),
        (s, 100, GRANULE),
        (s, 0, 0),
        (s, 15 * GRANULE, 2 * GRANULE),
        (s, u64::MAX - 255, 512),
        (SegmentId(7), 0, GRANULE),
    ] {
        assert_eq!(e.allocate_range(segment, None, offset, size), None, "{offset} + {size}");
    }
    assert_eq!(e.stats(), before);
    // Freed, the range coalesces; its old node index is a hint that still covers it.
    e.free(first.block).unwrap();
    let again = e.allocate_range(s, Some(first.block.index()), 4 * GRANULE, 2 * GRANULE).unwrap();
    assert_eq!(again.offset, 4 * GRANULE);
    let mut whole = Engine::whole_blocks(256).unwrap();
    let w = whole.add_segment(GRANULE).unwrap();
    assert_eq!(whole.allocate_range(w, None, 0, 256), None, "an engine of whole blocks never splits");
    e.check_index();
}

#[test]
fn restore_free_gives_back_withheld_space_as_free_from_the_smallest_range_that_holds_it() {
    let mut e = Engine::new(256).unwrap();
    let big = e.add_withheld_segment(64 * GRANULE).unwrap();
    let small = e.add_withheld_segment(4 * GRANULE).unwrap();
    assert_eq!(e.restore_free(3 * GRANULE, GRANULE), Some((small, 0)), "the smallest range that holds it");
    assert_eq!(e.stats().withheld_bytes, 65 * GRANULE);
    let a = e.allocate(3 * GRANULE).unwrap();
    assert_eq!((a.segment, a.offset), (small, 0), "the restored bytes are free");
    assert_eq!(e.restore_free(8 * GRANULE, GRANULE), Some((big, 0)));
    for (len, granule) in [(0, GRANULE), (GRANULE + 1, GRANULE), (GRANULE, 3000), (128 * GRANULE, GRANULE)] {
        assert_eq!(e.restore_free(len, granule), None, "{len} in granules of {granule}");
    }
    // Restored next to free space, it joins it: one free block of both.
    assert_eq!(e.restore_free(8 * GRANULE, GRANULE), Some((big, 8 * GRANULE)));
    // The small segment's last granule is still withheld: not free, not reported.
    assert_eq!(e.free_granules(GRANULE, u64::MAX), vec![GranuleRun { segment: big, offset: 0, len: 16 * GRANULE }]);
    e.check_index();
}

/// Random named ranges against a model of the segment's bytes: a range is taken exactly when every byte of it is
/// free (and only then), and the free granules reported are exactly the whole free granules of the model.
#[test]
fn named_ranges_match_a_byte_model() {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |below: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % below
    };
    const UNITS: u64 = 64; // the segment, in 1 KiB units
    let unit = 1024;
    let mut e = Engine::new(256).unwrap();
    let s = e.add_segment(UNITS * unit).unwrap();
    let mut used = [false; UNITS as usize];
    let mut live: Vec<(BlockId, u64, u64)> = Vec::new();
    for step in 0..4000 {
        if next(10) < 6 || live.is_empty() {
            let start = next(UNITS);
            let len = 1 + next((UNITS - start).min(12));
            let free = used[start as usize..(start + len) as usize].iter().all(|u| !u);
            let got = e.allocate_range(s, None, start * unit, len * unit);
            assert_eq!(got.is_some(), free, "step {step}: range {start}+{len}");
            if let Some(a) = got {
                assert_eq!((a.offset, a.size), (start * unit, len * unit));
                used[start as usize..(start + len) as usize].fill(true);
                live.push((a.block, start, len));
            }
        } else {
            let (block, start, len) = live.swap_remove(next(live.len() as u64) as usize);
            e.free(block).unwrap();
            used[start as usize..(start + len) as usize].fill(false);
        }
        let granule = 4 * unit;
        let model: u64 =
            (0..UNITS / 4).filter(|g| used[(g * 4) as usize..(g * 4 + 4) as usize].iter().all(|u| !u)).count() as u64
                * granule;
        let found: u64 = e.free_granules(granule, u64::MAX).iter().map(|r| r.len).sum();
        assert_eq!(found, model, "step {step}");
    }
    e.check_index();
}
