//! The search after the greedy heuristics: ruin and recreate around the allocations that stand above a
//! target.
//!
//! Greedy placement decides each allocation once, and some plans need a choice that only pays off later. In
//! bert_infer_varlen every layer's two attention-score tensors fill the memory left at the peak, and the
//! activation that crosses into the next layer fits below the bound only in the bytes of the first score tensor
//! once it has died, and only if the next layer's score tensors sit elsewhere: the slots must alternate from
//! layer to layer. Every greedy order gives all layers the same slots and one activation too many.
//!
//! The search takes a plan and a target height. It repeats a move: pick an allocation that reaches above the
//! target, take it and every allocation whose lifetime lies inside a random time window around it off the plan,
//! and place them again (in one of several orders, each at a gap below the target if one holds it: smallest gap
//! or lowest, at the gap's bottom or top). The allocations that stay are the fixed context. A move is kept when
//! the bytes above the target, summed over the allocations moved, do not grow and the peak does not rise, so
//! moves that only shift the excess from one place to another are kept too: that is how the alternation
//! spreads from layer to layer until the excess leaves at the end. Every state is a valid plan (a placement
//! only ever takes bytes no allocation meeting it holds), so the search returns the lowest peak it saw.
//!
//! Attempts alternate: aiming at the lower bound from the greedy plan in lifetime order (long-lived
//! allocations packed low, so that what stands above is short-lived and movable), and aiming a little below
//! the attempt's own peak, lower each time it gets there, from each greedy plan in turn (the lifetime order
//! first). An attempt ends when the bytes above its target have not shrunk for [`AT_BOUND_STALL`] or [`STALL`]
//! moves, or when its share of the budget is spent. Starting again from a greedy plan, with other random
//! choices, gets out of the dead ends that one attempt can run into.
//!
//! The work is bounded by a count of the placements' range reads ([`BUDGET`]), not by time, and the random
//! choices come from a fixed seed: the plan is the same on every machine, however loaded.

use super::PlanItem;
use std::collections::BTreeMap;

/// Range reads the search may spend, in all: about half a second on a 2-core KVM guest.
const BUDGET: u64 = 45_000_000;
/// Range reads per allocation, below [`BUDGET`]: small plans get a budget in proportion.
const BUDGET_PER_ALLOCATION: u64 = 40_000;
/// An attempt aiming lower may spend this fraction of the budget (an attempt that reaches the lower bound ends
/// the search).
const ATTEMPTS: u64 = 8;
/// An attempt aiming at the lower bound may spend this fraction of the budget.
const AT_BOUND_SHARE: u64 = 4;
/// Moves without shrinking the bytes above the target after which an attempt aiming lower gives up.
const STALL: u64 = 2_000;
/// The same for an attempt aiming at the lower bound, which has further to go.
const AT_BOUND_STALL: u64 = 4_000;
/// The most allocations one move re-places (the window shrinks until it holds no more).
const MOVED: usize = 256;
/// An aiming-lower attempt sets its next target this fraction of the way from its peak to the lower bound.
const STEP: u64 = 8;
/// The seed of the random choices.
const SEED: u64 = 0x756d_6d2d_706c_616e;

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// Which allocations meet a time range. Lifetimes never change, so this is built once: a segment tree over
/// compressed time whose nodes list the allocations covering them (canonical nodes of each lifetime), and the
/// allocations listed by first coordinate. A query reads the lists on the path of its first coordinate (those
/// live there) and those starting inside it: O(log n + k).
struct Meets {
    leaves: usize,
    covering: Csr,
    starting: Csr,
}

/// Lists of allocations, one per key, in one vector.
struct Csr {
    start: Vec<u32>,
    entries: Vec<u32>,
}

impl Csr {
    fn new(keys: usize, pairs: &[(usize, u32)]) -> Self {
        let mut start = vec![0u32; keys + 1];
        for &(key, _) in pairs {
            start[key + 1] += 1;
        }
        for key in 0..keys {
            start[key + 1] += start[key];
        }
        let mut fill = start.clone();
        let mut entries = vec![0u32; pairs.len()];
        for &(key, value) in pairs {
            entries[fill[key] as usize] = value;
            fill[key] += 1;
        }
        Self { start, entries }
    }

    fn range(&self, from: usize, to: usize) -> &[u32] {
        &self.entries[self.start[from] as usize..self.start[to] as usize]
    }
}

impl Meets {
    fn new(coords: usize, spans: &[(u32, u32)]) -> Self {
        let leaves = coords.next_power_of_two().max(1);
        let (mut covering, mut starting) = (Vec::new(), Vec::with_capacity(spans.len()));
        for (i, &(f, l)) in spans.iter().enumerate() {
            let (mut lo, mut hi) = (f as usize + leaves, l as usize + leaves + 1);
            while lo < hi {
                if lo & 1 == 1 {
                    covering.push((lo, i as u32));
                    lo += 1;
                }
                if hi & 1 == 1 {
                    hi -= 1;
                    covering.push((hi, i as u32));
                }
                lo >>= 1;
                hi >>= 1;
            }
            starting.push((f as usize, i as u32));
        }
        Self { leaves, covering: Csr::new(2 * leaves, &covering), starting: Csr::new(coords, &starting) }
    }

    /// Appends the allocations whose lifetimes meet `[f, l]`, each once.
    fn query(&self, f: u32, l: u32, out: &mut Vec<u32>) {
        let mut v = f as usize + self.leaves;
        while v >= 1 {
            out.extend_from_slice(self.covering.range(v, v + 1));
            v >>= 1;
        }
        out.extend_from_slice(self.starting.range(f as usize + 1, l as usize + 1));
    }
}

/// Where a move puts an allocation among the gaps of `ranges` (sorted by start; they may overlap).
#[derive(Clone, Copy)]
struct GapChoice {
    /// The smallest gap that holds it below the target, else the lowest.
    best: bool,
    /// At the top of the gap rather than its bottom.
    top: bool,
}

/// An offset for `size` bytes below `target` as `fit` says; where no gap below the target holds it, the lowest
/// gap that does (above the target), else the end of the highest range.
fn choose_below(ranges: &[(u64, u64)], size: u64, fit: GapChoice, target: u64) -> u64 {
    let at = |start: u64, end: u64| if fit.top { end - size } else { start };
    let mut reach = 0u64; // the end of the ranges seen so far: everything below is taken
    let mut best: Option<(u64, u64, u64)> = None; // (gap below the target, start, end)
    let mut lowest: Option<u64> = None;
    for &(start, end) in ranges {
        if start > reach && start - reach >= size {
            lowest.get_or_insert(reach);
            if reach + size <= target {
                let end = start.min(target);
                if !fit.best {
                    return at(reach, end);
                }
                if best.is_none_or(|(gap, _, _)| end - reach < gap) {
                    best = Some((end - reach, reach, end));
                }
            }
        }
        reach = reach.max(end);
    }
    if reach + size <= target {
        if !fit.best {
            return at(reach, target);
        }
        if best.is_none_or(|(gap, _, _)| target - reach < gap) {
            best = Some((target - reach, reach, target));
        }
    }
    best.map_or(lowest.unwrap_or(reach), |(_, start, end)| at(start, end))
}

/// Searches for a lower plan than the greedy plans in `starts` (`(offsets, peak)` each; the first is the one in
/// lifetime order), within [`BUDGET`] (or [`BUDGET_PER_ALLOCATION`] times the allocations, if less). Returns
/// the lowest plan found and the index of the start it came from, or `None` when no attempt got below the
/// lowest start.
pub(crate) fn improve(
    items: &[PlanItem],
    coords: usize,
    spans: &[(u32, u32)],
    starts: &[(Vec<u64>, u64)],
    lower_bound: u64,
) -> Option<(Vec<u64>, u64, usize)> {
    let budget = BUDGET.min(BUDGET_PER_ALLOCATION.saturating_mul(items.len() as u64));
    let meets = Meets::new(coords, spans);
    // Every offset is a sum of sizes less a size, so a multiple of their greatest common divisor (of the
    // alignment, then), and so are targets stepped in it.
    let grain = items.iter().fold(0, |g, item| gcd(g, item.size)).max(1);
    let mut search = Search { items, spans, coords, meets, grain, rng: Rng(SEED), work: 0 };
    // The first start, then the others, least bytes above the lower bound first.
    let above = |offsets: &[u64]| -> u128 {
        offsets.iter().zip(items).map(|(&o, it)| u128::from((o + it.size).saturating_sub(lower_bound))).sum()
    };
    let mut others: Vec<(u128, usize)> = (1..starts.len()).map(|k| (above(&starts[k].0), k)).collect();
    others.sort_unstable();
    let order: Vec<usize> = std::iter::once(0).chain(others.iter().map(|&(_, k)| k)).collect();
    let mut best: Option<(Vec<u64>, u64, usize)> = None;
    let mut lowest = starts.iter().map(|s| s.1).min().unwrap_or(u64::MAX);
    let mut attempt = 0usize;
    while search.work < budget && lowest > lower_bound {
        let (start, aim_lower, share, stall) = if attempt.is_multiple_of(2) {
            (0, false, budget / AT_BOUND_SHARE, AT_BOUND_STALL)
        } else {
            (order[(attempt / 2) % order.len()], true, budget / ATTEMPTS, STALL)
        };
        attempt += 1;
        let limit = (search.work + share).min(budget);
        let mut offsets = starts[start].0.clone();
        let peak = search.attempt(&mut offsets, lower_bound, aim_lower, limit, stall);
        if peak < lowest {
            lowest = peak;
            best = Some((offsets, peak, start));
        }
    }
    best
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

struct Search<'a> {
    items: &'a [PlanItem],
    /// What every size is a multiple of.
    grain: u64,
    spans: &'a [(u32, u32)],
    coords: usize,
    meets: Meets,
    rng: Rng,
    /// Range reads spent so far.
    work: u64,
}

/// Scratch vectors of one move.
#[derive(Default)]
struct Scratch {
    found: Vec<u32>,
    moved: Vec<u32>,
    fixed: Vec<u32>,
    old: Vec<u64>,
    ranges: Vec<(u64, u64)>,
    always: Vec<(u64, u64)>,
    runs: Vec<(u64, u64)>,
    merged: Vec<(u64, u64)>,
}

impl Search<'_> {
    fn top(&self, i: usize, offsets: &[u64]) -> u64 {
        offsets[i] + self.items[i].size
    }

    /// One attempt from `offsets` (changed in place to the attempt's last plan, which is its lowest); returns
    /// its peak.
    fn attempt(&mut self, offsets: &mut [u64], lower_bound: u64, aim_lower: bool, limit: u64, stall: u64) -> u64 {
        let n = self.items.len() as u64;
        let peak_of = |search: &mut Self, offsets: &[u64]| {
            search.work += n;
            (0..search.items.len()).map(|i| search.top(i, offsets)).max().unwrap_or(0).max(lower_bound)
        };
        let grain = self.grain;
        let next_target = |peak: u64| {
            if aim_lower {
                lower_bound.max(peak - ((peak - lower_bound) / STEP / grain * grain).max(grain))
            } else {
                lower_bound
            }
        };
        let mut peak = peak_of(self, offsets);
        let mut scratch = Scratch::default();
        while peak > lower_bound && self.work < limit {
            let target = next_target(peak);
            if !self.reach(offsets, target, limit, stall, &mut scratch) {
                return peak_of(self, offsets);
            }
            peak = peak_of(self, offsets);
        }
        peak
    }

    /// Moves until nothing stands above `target` (true), or the moves stall or the work reaches `limit`
    /// (false). The peak never rises.
    fn reach(&mut self, offsets: &mut [u64], target: u64, limit: u64, stall: u64, s: &mut Scratch) -> bool {
        let items = self.items;
        self.work += items.len() as u64;
        let mut above: Vec<u32> = (0..items.len() as u32).filter(|&i| self.top(i as usize, offsets) > target).collect();
        // Tops above the target, counted: the last key is the peak.
        let mut tops: BTreeMap<u64, u32> = BTreeMap::new();
        for &i in &above {
            *tops.entry(self.top(i as usize, offsets)).or_default() += 1;
        }
        let excess =
            |i: u32, offsets: &[u64]| u128::from((offsets[i as usize] + items[i as usize].size).saturating_sub(target));
        let mut total: u128 = above.iter().map(|&i| excess(i, offsets)).sum();
        let (mut least, mut since) = (total, 0u64);
        while let Some((&peak, _)) = tops.last_key_value() {
            if since >= stall || self.work >= limit {
                return false;
            }
            let k = self.rng.below(above.len() as u64) as usize;
            let v = above[k];
            if self.top(v as usize, offsets) <= target {
                above.swap_remove(k);
                continue;
            }
            since += 1;
            self.take_window(v, offsets, s);
            let before: u128 = s.moved.iter().map(|&i| excess(i, offsets)).sum();
            self.replace(offsets, target, s);
            let after: u128 = s.moved.iter().map(|&i| excess(i, offsets)).sum();
            let highest = s.moved.iter().map(|&i| self.top(i as usize, offsets)).max().unwrap_or(0);
            if after > before || highest > peak {
                for (&i, &offset) in s.moved.iter().zip(&s.old) {
                    offsets[i as usize] = offset;
                }
                continue;
            }
            total = total - before + after;
            if total < least {
                least = total;
                since = 0;
            }
            for (&i, &offset) in s.moved.iter().zip(&s.old) {
                let (was, now) = (offset + items[i as usize].size, self.top(i as usize, offsets));
                if was > target {
                    let count = tops.get_mut(&was).expect("every top above the target is counted");
                    *count -= 1;
                    if *count == 0 {
                        tops.remove(&was);
                    }
                }
                if now > target {
                    *tops.entry(now).or_default() += 1;
                    if was <= target {
                        above.push(i);
                    }
                }
            }
        }
        true
    }

    /// Takes `v` and the allocations whose lifetimes lie inside a random window around a random step of `v`'s
    /// into `s.moved` (at most [`MOVED`] besides `v`), and those meeting them into `s.fixed`, except those that
    /// meet every moved one, whose bytes go merged into `s.merged`. Records the moved ones' offsets in `s.old`.
    fn take_window(&mut self, v: u32, offsets: &[u64], s: &mut Scratch) {
        let (f, l) = self.spans[v as usize];
        let len = u64::from(l - f) + 1;
        let mut width = 1 + self.rng.below(4 * len + 1);
        let at = u64::from(f) + self.rng.below(len);
        loop {
            let wf = at.saturating_sub(self.rng.below(width + 1)) as u32;
            let wl = (at + self.rng.below(width + 1)).min(self.coords as u64 - 1) as u32;
            s.found.clear();
            self.meets.query(wf.min(f), wl.max(l), &mut s.found);
            s.moved.clear();
            s.fixed.clear();
            s.moved.push(v);
            for &c in &s.found {
                let (a, b) = self.spans[c as usize];
                if c == v {
                    continue;
                } else if a >= wf && b <= wl {
                    s.moved.push(c);
                } else {
                    s.fixed.push(c);
                }
            }
            if s.moved.len() <= MOVED + 1 || width <= 1 {
                break;
            }
            width /= 2;
        }
        let (mut first, mut last) = (f, l);
        for &i in &s.moved {
            first = first.min(self.spans[i as usize].0);
            last = last.max(self.spans[i as usize].1);
        }
        s.always.clear();
        let (spans, items, always) = (self.spans, self.items, &mut s.always);
        s.fixed.retain(|&c| {
            let (a, b) = spans[c as usize];
            let everywhere = a <= first && b >= last;
            if everywhere {
                always.push((offsets[c as usize], offsets[c as usize] + items[c as usize].size));
            }
            !everywhere
        });
        s.always.sort_unstable();
        s.merged.clear();
        for &(start, end) in &s.always {
            match s.merged.last_mut() {
                Some(run) if start <= run.1 => run.1 = run.1.max(end),
                _ => s.merged.push((start, end)),
            }
        }
        let (moved, others) = (s.moved.len() as u64, (s.fixed.len() + s.merged.len()) as u64);
        self.work += moved * (moved + others) + s.found.len() as u64;
    }

    /// Places the allocations of `s.moved` again, in a random order and with a random fit, around the fixed
    /// ones; `s.old` gets their offsets before, in the order they are placed.
    fn replace(&mut self, offsets: &mut [u64], target: u64, s: &mut Scratch) {
        let items = self.items;
        let duration = |i: u32| items[i as usize].last - items[i as usize].first;
        match self.rng.below(4) {
            0 => s.moved.sort_unstable_by_key(|&i| {
                (std::cmp::Reverse(items[i as usize].size), std::cmp::Reverse(duration(i)), i)
            }),
            1 => s.moved.sort_unstable_by_key(|&i| (items[i as usize].first, i)),
            2 => s.moved.sort_unstable_by_key(|&i| {
                (std::cmp::Reverse(duration(i)), std::cmp::Reverse(items[i as usize].size), i)
            }),
            _ => {
                for j in (1..s.moved.len()).rev() {
                    let k = self.rng.below(j as u64 + 1) as usize;
                    s.moved.swap(j, k);
                }
            }
        }
        let choice = self.rng.below(4);
        let fit = GapChoice { best: choice & 1 == 0, top: choice & 2 != 0 };
        s.old.clear();
        s.old.extend(s.moved.iter().map(|&i| offsets[i as usize]));
        for j in 0..s.moved.len() {
            let i = s.moved[j] as usize;
            let (f, l) = self.spans[i];
            s.ranges.clear();
            for &c in s.fixed.iter().chain(&s.moved[..j]) {
                let (a, b) = self.spans[c as usize];
                if a <= l && f <= b {
                    s.ranges.push((offsets[c as usize], offsets[c as usize] + items[c as usize].size));
                }
            }
            s.ranges.sort_unstable();
            s.runs.clear();
            let (mut x, mut y) = (0, 0);
            while x < s.ranges.len() || y < s.merged.len() {
                if y == s.merged.len() || (x < s.ranges.len() && s.ranges[x] < s.merged[y]) {
                    s.runs.push(s.ranges[x]);
                    x += 1;
                } else {
                    s.runs.push(s.merged[y]);
                    y += 1;
                }
            }
            offsets[i] = choose_below(&s.runs, items[i].size, fit, target);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_stay_below_the_target_where_a_gap_holds_them() {
        let ranges = [(0, 512), (2048, 2560), (3072, 4096)];
        let (best, first) = (GapChoice { best: true, top: false }, GapChoice { best: false, top: false });
        let (best_top, first_top) = (GapChoice { best: true, top: true }, GapChoice { best: false, top: true });
        // Gaps below 8192: [512, 2048), [2560, 3072), [4096, 8192).
        assert_eq!(choose_below(&ranges, 512, best, 8192), 2560);
        assert_eq!(choose_below(&ranges, 512, first, 8192), 512);
        assert_eq!(choose_below(&ranges, 512, first_top, 8192), 1536);
        assert_eq!(choose_below(&ranges, 1024, best_top, 8192), 1024);
        assert_eq!(choose_below(&ranges, 2048, best, 8192), 4096);
        assert_eq!(choose_below(&ranges, 2048, best_top, 8192), 6144);
        // Nothing below the target holds it: the lowest gap that does, else the top.
        assert_eq!(choose_below(&ranges, 1024, best, 1024), 512);
        assert_eq!(choose_below(&ranges, 2048, best, 4096), 4096);
        assert_eq!(choose_below(&[(0, 2048), (512, 1024)], 512, first, 1024), 2048);
    }

    #[test]
    fn meets_finds_exactly_the_lifetimes_that_meet() {
        let spans = [(0, 3), (2, 5), (4, 4), (6, 9), (1, 8), (7, 7)];
        let meets = Meets::new(10, &spans);
        for f in 0..10 {
            for l in f..10 {
                let mut found = Vec::new();
                meets.query(f, l, &mut found);
                found.sort_unstable();
                let expected: Vec<u32> =
                    (0..spans.len() as u32).filter(|&i| spans[i as usize].0 <= l && f <= spans[i as usize].1).collect();
                assert_eq!(found, expected, "[{f}, {l}]");
            }
        }
    }
}
