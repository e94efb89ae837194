//! The offset assignment: greedy heuristics over an interval index on time, then, when none reaches the
//! lower bound, the search of [`improve`] from their plans.
//!
//! Every heuristic places allocations one at a time in some order. Placing one means finding the bytes taken,
//! at some step of its lifetime, by the allocations already placed, and taking a gap between them (or the top).
//! A scan of everything placed is O(n²). Here the taken bytes are indexed over time ([`Occupancy`]): a
//! placement reads the byte ranges of the placed allocations that meet it, O(log n + k), or, where hundreds of
//! allocations meet each one, O(log n) sets of byte runs merged as they are placed, which a good plan keeps
//! short (packed bytes merge into one run).

use super::improve;
use super::occupancy::{Index, Occupancy};
use super::PlanItem;
use super::{Fit, Heuristic, Order};

/// The best plan found by [`solve()`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Solution {
    /// Offset of each item's first byte, in the order of the items given: two items whose lifetimes meet never
    /// share a byte.
    pub offsets: Vec<u64>,
    /// Bytes the plan needs: the highest end (offset + size) of any item; 0 for no items.
    pub peak: u64,
    /// The most bytes live at one step ([`lower_bound()`]): no plan can need less than this.
    pub lower_bound: u64,
    /// The heuristic whose plan this is, and whether the search after the heuristics lowered it.
    pub heuristic: Heuristic,
}

/// The most bytes live at one step: the sum of the sizes of the items whose lifetimes include it, at the
/// busiest step. No plan can need less; 0 for no items.
pub fn lower_bound(items: &[PlanItem]) -> u64 {
    Timeline::new(items).live.iter().copied().max().unwrap_or(0)
}

/// Every heuristic tried, in order of preference among equal peaks (listed in [`solve()`]'s docs too: keep them
/// in step): two rounds on a 2-core machine. Each of the four gives the smallest plan on at least one of the
/// eight shared traces. Also tried, and dropped because none of them did better than these four on any of those
/// traces but one (by 0.4%), which is not worth their time: breadth and lifetime orders with the other fit,
/// XLA's size × lifetime order, greedy by breadth in allocation order, and best fit at the top of the gap.
const HEURISTICS: [Heuristic; 4] = [
    Heuristic { order: Order::Size, fit: Fit::Best, searched: false },
    Heuristic { order: Order::Size, fit: Fit::First, searched: false },
    Heuristic { order: Order::Breadth, fit: Fit::Best, searched: false },
    Heuristic { order: Order::Duration, fit: Fit::First, searched: false },
];

/// Assigns every item an offset such that two items whose lifetimes meet never share a byte, aiming at the
/// smallest peak. Every item needs `first <= last`; its size is taken as already aligned.
///
/// Runs every greedy heuristic (greedy by size with best fit and with first fit, greedy by breadth with best
/// fit, greedy by lifetime with first fit) and keeps the smallest plan; among equal peaks the earlier in that
/// list wins. Heuristics run on as many threads as the machine offers (they share nothing but the input), in
/// rounds, and the search stops after a round in which a plan reaches the lower bound: the result is the first
/// heuristic (in order) to reach it, or the smallest of all, whatever the number of threads or their timing.
///
/// When no heuristic reaches the lower bound, a bounded search (ruin and recreate around the items that stand
/// above a target) starts from their plans (the one in lifetime order first) and keeps its plan if it is lower
/// ([`Heuristic::searched`]). It runs on one thread, with a fixed seed and a budget counted in work rather than
/// time, so its plan too is the same whatever the machine.
pub fn solve(items: &[PlanItem]) -> Solution {
    let timeline = Timeline::new(items);
    let lower_bound = timeline.live.iter().copied().max().unwrap_or(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, HEURISTICS.len());
    let mut plans: Vec<(Heuristic, Vec<u64>, u64)> = Vec::with_capacity(HEURISTICS.len());
    for round in HEURISTICS.chunks(threads) {
        let placed: Vec<(Vec<u64>, u64)> = std::thread::scope(|scope| {
            let workers: Vec<_> = round
                .iter()
                .map(|h| {
                    let timeline = &timeline;
                    scope.spawn(move || place(items, timeline, &sequence(h.order, items, timeline), h.fit))
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("a planning thread panicked")).collect()
        });
        plans.extend(round.iter().zip(placed).map(|(&heuristic, (offsets, peak))| (heuristic, offsets, peak)));
        if plans.iter().any(|p| p.2 == lower_bound) {
            break;
        }
    }
    // The first of the lowest.
    let best = (1..plans.len()).fold(0, |best, k| if plans[k].2 < plans[best].2 { k } else { best });
    if plans[best].2 > lower_bound {
        // Every heuristic ran. The plan in lifetime order first, then the others in their order.
        let first = plans.iter().position(|p| p.0.order == Order::Duration).unwrap_or(0);
        let order: Vec<usize> = std::iter::once(first).chain((0..plans.len()).filter(|&k| k != first)).collect();
        let starts: Vec<(Vec<u64>, u64)> =
            order.iter().map(|&k| (std::mem::take(&mut plans[k].1), plans[k].2)).collect();
        let found = improve::improve(items, timeline.coords.len(), &timeline.spans, &starts, lower_bound);
        if let Some((offsets, peak, start)) = found {
            let heuristic = Heuristic { searched: true, ..plans[order[start]].0 };
            return Solution { offsets, peak, lower_bound, heuristic };
        }
        let mut starts = starts;
        let k = order.iter().position(|&k| k == best).expect("every plan is a start");
        let (heuristic, peak) = (plans[best].0, plans[best].2);
        return Solution { offsets: std::mem::take(&mut starts[k].0), peak, lower_bound, heuristic };
    }
    let (heuristic, offsets, peak) = plans.swap_remove(best);
    Solution { offsets, peak, lower_bound, heuristic }
}

/// Lifetimes on compressed time: the distinct steps at which any lifetime starts or ends, each allocation's
/// span as indices into them, and the live bytes at each.
struct Timeline {
    coords: Vec<u64>,
    spans: Vec<(u32, u32)>,
    /// Bytes live at each coordinate. Live bytes only grow at a first step, which is a coordinate, so the
    /// maximum over coordinates is the maximum over all steps.
    live: Vec<u64>,
    /// The occupancy index that suits how many allocations meet one another.
    index: Index,
}

impl Timeline {
    fn new(items: &[PlanItem]) -> Self {
        let mut coords: Vec<u64> = items.iter().flat_map(|i| [i.first, i.last]).collect();
        coords.sort_unstable();
        coords.dedup();
        let at = |t: u64| coords.binary_search(&t).expect("every endpoint is a coordinate") as u32;
        let spans: Vec<(u32, u32)> = items.iter().map(|i| (at(i.first), at(i.last))).collect();
        // Difference array: +size where a lifetime starts, -size after it ends.
        let mut delta = vec![0i128; coords.len() + 1];
        for (item, &(f, l)) in items.iter().zip(&spans) {
            delta[f as usize] += i128::from(item.size);
            delta[l as usize + 1] -= i128::from(item.size);
        }
        let mut running = 0i128;
        let live = delta[..coords.len()]
            .iter()
            .map(|d| {
                running += d;
                u64::try_from(running).unwrap_or(u64::MAX)
            })
            .collect();
        // Pairs of allocations that meet: each pair is counted once, by the one that starts later (or both, on
        // a tie), from the count live where it starts.
        let mut counts = vec![0i64; coords.len() + 1];
        for &(f, l) in &spans {
            counts[f as usize] += 1;
            counts[l as usize + 1] -= 1;
        }
        let mut running = 0i64;
        let live_count: Vec<u64> = counts[..coords.len()]
            .iter()
            .map(|d| {
                running += d;
                running as u64
            })
            .collect();
        let pairs = spans.iter().map(|&(f, _)| live_count[f as usize].saturating_sub(1)).sum();
        let index = Index::for_density(pairs, items.len() as u64);
        Self { coords, spans, live, index }
    }
}

/// The order a heuristic places allocations in (indices into `items`). Ties fall back to earlier first step,
/// then recording order, so every order is deterministic.
fn sequence(order: Order, items: &[PlanItem], timeline: &Timeline) -> Vec<u32> {
    let mut sequence: Vec<u32> = (0..items.len() as u32).collect();
    let duration = |i: u32| {
        let item = &items[i as usize];
        item.last - item.first + 1
    };
    match order {
        Order::Size => sequence.sort_by_key(|&i| {
            let item = &items[i as usize];
            (std::cmp::Reverse(item.size), std::cmp::Reverse(duration(i)), item.first, i)
        }),
        Order::Duration => sequence.sort_by_key(|&i| {
            let item = &items[i as usize];
            (std::cmp::Reverse(duration(i)), std::cmp::Reverse(item.size), item.first, i)
        }),
        Order::Breadth => {
            // Each allocation belongs to the busiest coordinate of its lifetime; coordinates are taken busiest
            // first and their allocations largest first.
            let busiest = RangeMax::new(&timeline.live);
            let keys: Vec<(u64, u32)> = timeline.spans.iter().map(|&(f, l)| busiest.query(f, l)).collect();
            sequence.sort_by_key(|&i| {
                let (live, at) = keys[i as usize];
                let item = &items[i as usize];
                (std::cmp::Reverse(live), at, std::cmp::Reverse(item.size), item.first, i)
            });
        }
    }
    sequence
}

/// Places the allocations in `sequence` order; returns their offsets and the peak.
fn place(items: &[PlanItem], timeline: &Timeline, sequence: &[u32], fit: Fit) -> (Vec<u64>, u64) {
    let mut index = Occupancy::new(timeline.coords.len(), timeline.index, &timeline.spans);
    let mut offsets = vec![0u64; items.len()];
    let mut peak = 0u64;
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &i in sequence {
        let (f, l) = timeline.spans[i as usize];
        ranges.clear();
        index.occupied(f, l, &mut ranges);
        ranges.sort_unstable();
        let size = items[i as usize].size;
        let offset = choose(&ranges, size, fit);
        offsets[i as usize] = offset;
        peak = peak.max(offset + size);
        index.insert(f, l, offset, offset + size);
    }
    (offsets, peak)
}

/// The offset for `size` bytes among `ranges` (sorted by start; they may overlap one another, since they need
/// not be live at the same time): a gap that holds it, as `fit` prefers, else the end of the highest range.
fn choose(ranges: &[(u64, u64)], size: u64, fit: Fit) -> u64 {
    let mut reach = 0u64; // the end of the ranges seen so far: everything below is taken
    let mut best: Option<(u64, u64)> = None; // (gap, offset)
    for &(start, end) in ranges {
        if start > reach {
            let gap = start - reach;
            if gap == size || (gap > size && fit == Fit::First) {
                return reach;
            }
            if gap > size && best.is_none_or(|(g, _)| gap < g) {
                best = Some((gap, reach));
            }
        }
        reach = reach.max(end);
    }
    best.map_or(reach, |(_, offset)| offset)
}

/// Range maximum over a fixed array (segment tree): the largest value in `[lo, hi]` and its lowest index.
struct RangeMax {
    leaves: usize,
    tree: Vec<(u64, std::cmp::Reverse<u32>)>,
}

impl RangeMax {
    fn new(values: &[u64]) -> Self {
        let leaves = values.len().next_power_of_two().max(1);
        let mut tree = vec![(0, std::cmp::Reverse(u32::MAX)); 2 * leaves];
        for (i, &v) in values.iter().enumerate() {
            tree[leaves + i] = (v, std::cmp::Reverse(i as u32));
        }
        for v in (1..leaves).rev() {
            tree[v] = tree[2 * v].max(tree[2 * v + 1]);
        }
        Self { leaves, tree }
    }

    fn query(&self, lo: u32, hi: u32) -> (u64, u32) {
        let mut best = (0, std::cmp::Reverse(u32::MAX));
        let (mut lo, mut hi) = (lo as usize + self.leaves, hi as usize + self.leaves + 1);
        while lo < hi {
            if lo & 1 == 1 {
                best = best.max(self.tree[lo]);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                best = best.max(self.tree[hi]);
            }
            lo >>= 1;
            hi >>= 1;
        }
        (best.0, best.1 .0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_takes_the_smallest_gap_first_fit_the_lowest() {
        let ranges = [(0, 512), (2048, 2560), (3072, 4096)];
        assert_eq!(choose(&ranges, 512, Fit::Best), 2560);
        assert_eq!(choose(&ranges, 512, Fit::First), 512);
        assert_eq!(choose(&ranges, 4096, Fit::Best), 4096);
        // Overlapping ranges (not live at the same time as each other) leave no gap between them.
        assert_eq!(choose(&[(0, 2048), (512, 1024)], 512, Fit::First), 2048);
    }

    #[test]
    fn range_max_finds_the_busiest_lowest_coordinate() {
        let max = RangeMax::new(&[3, 9, 1, 9, 4]);
        assert_eq!(max.query(0, 4), (9, 1));
        assert_eq!(max.query(2, 4), (9, 3));
        assert_eq!(max.query(2, 2), (1, 2));
    }
}
