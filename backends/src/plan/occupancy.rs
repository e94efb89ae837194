//! Which bytes are taken during a time range, for the planner. Two indexes, each cheap where the other is
//! not; the planner picks one per trace ([`Index::for_density`]):
//!
//! - by allocation: the byte ranges of the allocations live at the query's first step (a segment tree whose
//!   nodes list the ranges covering them) and of those starting inside it (listed by first step). O(log n + k)
//!   for the k allocations that meet the query, whatever the memory looks like: best when few allocations live
//!   at once (k small), and no cost at all to insert.
//! - by runs, below: best when many allocations live at once but pack into few runs (weights live all the way
//!   through), where k would be in the thousands. Inserting costs O(log n) run sets, each a sorted vector, so
//!   fragmented memory (thousands of runs per set) makes it slow: hence the choice.
//!
//! The runs index is a segment tree over time whose nodes hold byte ranges merged into runs.
//!
//! A placed allocation with lifetime `[f, l]` (in compressed time) and bytes `[start, end)` is added:
//! - to `own` of the O(log n) *canonical* nodes that tile `[f, l]` (their whole time range is inside the
//!   lifetime, so the bytes are taken at every step of it), and to their `sub`;
//! - to `sub` of every node above those that reaches outside `[f, l]` (such nodes lie on the paths from the
//!   leaves `f` and `l` to the root): `sub(v)` is thus the bytes taken at *some* step of `v`'s time range.
//!
//! The bytes taken at some step of a query range `[f, l]` are then the `sub` runs of its canonical nodes plus
//! the `own` runs of the nodes above them that reach outside it (an allocation meeting the range either lies
//! inside some canonical node's subtree, or covers a node on those paths). Runs are merged on insertion, so
//! bytes packed tight, such as weights live all the way through, cost one run however many allocations they
//! hold.

/// Disjoint byte runs `(start, end)` sorted by start, touching runs merged. A sorted vector rather than a tree:
/// queries copy whole run sets, which a vector does with one `memcpy`.
#[derive(Debug, Default, Clone)]
struct Runs(Vec<(u64, u64)>);

impl Runs {
    /// Adds `[start, end)`, merging every run it overlaps or touches. O(log n) to find the place, plus moving
    /// the runs after it.
    fn add(&mut self, start: u64, end: u64) {
        // Runs before `first` end before `start`; runs from `last` on start after `end`.
        let first = self.0.partition_point(|&(_, e)| e < start);
        let last = self.0.partition_point(|&(s, _)| s <= end);
        if first == last {
            self.0.insert(first, (start, end));
        } else {
            let merged = (start.min(self.0[first].0), end.max(self.0[last - 1].1));
            self.0[first] = merged;
            self.0.drain(first + 1..last);
        }
    }
}

/// Which index an [`Occupancy`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Index {
    /// Byte ranges listed by allocation.
    ByAllocation,
    /// Byte ranges merged into runs.
    ByRuns,
}

impl Index {
    /// Allocations meeting one allocation, on average, above which the runs index is used. Reading k ranges
    /// costs about as much as inserting into one run set, and an insertion touches about 2 log n run sets (a
    /// few dozen), so the break-even is at a few hundred. Measured (release, 2 cores): the training traces
    /// (gpt2_train, resnet50_train: 530 to 550) and 32 gpt2 steps in a row plan about twice as fast by runs;
    /// the synthetic traces (at most 30) ten times faster or more by allocation (variable: 0.5 s against 7 s),
    /// since their random sizes leave memory in thousands of runs.
    const DENSE: u64 = 256;

    /// The index for a trace whose allocations meet `pairs` pairs of others among `allocations`.
    pub(crate) fn for_density(pairs: u64, allocations: u64) -> Self {
        if pairs > Self::DENSE.saturating_mul(allocations) {
            Index::ByRuns
        } else {
            Index::ByAllocation
        }
    }
}

/// Lists of byte ranges, one per key, in one vector. Every lifetime is known before anything is placed, so how
/// many ranges each list will get is counted first, and placing writes in place: no allocation per push, and
/// reading a list is reading a slice.
#[derive(Debug, Default)]
struct Lists {
    /// Where each key's list starts in `entries` (one more than the keys: the last is the end).
    start: Vec<u32>,
    /// How many ranges each list holds so far.
    len: Vec<u32>,
    entries: Vec<(u64, u64)>,
}

impl Lists {
    /// Empty lists that will hold at most `counts[key]` ranges each.
    fn with_capacities(counts: &[u32]) -> Self {
        let mut start = Vec::with_capacity(counts.len() + 1);
        let mut total = 0u32;
        start.push(0);
        for &count in counts {
            total += count;
            start.push(total);
        }
        Self { start, len: vec![0; counts.len()], entries: vec![(0, 0); total as usize] }
    }

    fn push(&mut self, key: usize, range: (u64, u64)) {
        let at = self.start[key] + self.len[key];
        debug_assert!(at < self.start[key + 1], "more pushes than counted");
        self.entries[at as usize] = range;
        self.len[key] += 1;
    }

    fn get(&self, key: usize) -> &[(u64, u64)] {
        let start = self.start[key] as usize;
        &self.entries[start..start + self.len[key] as usize]
    }
}

/// Taken bytes per time range (see the module documentation).
pub(crate) struct Occupancy {
    index: Index,
    leaves: usize,
    /// Runs taken at every step of each node's time range.
    own: Vec<Runs>,
    /// Runs taken at some step of each node's time range.
    sub: Vec<Runs>,
    /// Byte ranges of the allocations whose canonical nodes include each node (not merged).
    covering: Lists,
    /// Byte ranges of the allocations starting at each coordinate.
    starting: Lists,
}

impl Occupancy {
    /// An empty index over `coords` time coordinates, for allocations whose lifetimes (in coordinates) are
    /// `spans`.
    pub(crate) fn new(coords: usize, index: Index, spans: &[(u32, u32)]) -> Self {
        let leaves = coords.next_power_of_two().max(1);
        let mut occupancy = Self {
            index,
            leaves,
            own: Vec::new(),
            sub: Vec::new(),
            covering: Lists::default(),
            starting: Lists::default(),
        };
        match index {
            Index::ByRuns => {
                occupancy.own = vec![Runs::default(); 2 * leaves];
                occupancy.sub = vec![Runs::default(); 2 * leaves];
            }
            Index::ByAllocation => {
                let (mut covering, mut starting) = (vec![0u32; 2 * leaves], vec![0u32; coords]);
                for &(f, l) in spans {
                    occupancy.canonical(f, l, |_, v| covering[v] += 1);
                    starting[f as usize] += 1;
                }
                occupancy.covering = Lists::with_capacities(&covering);
                occupancy.starting = Lists::with_capacities(&starting);
            }
        }
        occupancy
    }

    /// Records `[start, end)` as taken at every step of `[f, l]`.
    pub(crate) fn insert(&mut self, f: u32, l: u32, start: u64, end: u64) {
        match self.index {
            Index::ByRuns => {
                self.canonical(f, l, |index, v| {
                    index.own[v].add(start, end);
                    index.sub[v].add(start, end);
                });
                self.above(f, l, |index, v| index.sub[v].add(start, end));
            }
            Index::ByAllocation => {
                self.canonical(f, l, |index, v| index.covering.push(v, (start, end)));
                self.starting.push(f as usize, (start, end));
            }
        }
    }

    /// Appends the byte ranges taken at some step of `[f, l]` to `out` (unsorted; they may overlap).
    pub(crate) fn occupied(&mut self, f: u32, l: u32, out: &mut Vec<(u64, u64)>) {
        match self.index {
            Index::ByRuns => self.occupied_by_runs(f, l, out),
            Index::ByAllocation => self.occupied_by_allocation(f, l, out),
        }
    }

    /// The nodes from leaf `f` to the root.
    fn path(&self, f: u32) -> impl Iterator<Item = usize> {
        let leaf = f as usize + self.leaves;
        (0..usize::BITS - leaf.leading_zeros()).map(move |k| leaf >> k)
    }

    /// The ranges live at `f`, then those starting in `(f, l]`: coordinates are lifetime endpoints, so those
    /// inside `(f, l]` number at most twice the allocations starting or ending there, and walking them is O(k).
    fn occupied_by_allocation(&self, f: u32, l: u32, out: &mut Vec<(u64, u64)>) {
        for v in self.path(f) {
            out.extend_from_slice(self.covering.get(v));
        }
        for c in f as usize + 1..=l as usize {
            out.extend_from_slice(self.starting.get(c));
        }
    }

    fn occupied_by_runs(&mut self, f: u32, l: u32, out: &mut Vec<(u64, u64)>) {
        self.canonical(f, l, |index, v| out.extend_from_slice(&index.sub[v].0));
        self.above(f, l, |index, v| out.extend_from_slice(&index.own[v].0));
    }

    /// Calls `visit` with the canonical nodes tiling `[f, l]`.
    fn canonical(&mut self, f: u32, l: u32, mut visit: impl FnMut(&mut Self, usize)) {
        let (mut lo, mut hi) = (f as usize + self.leaves, l as usize + self.leaves + 1);
        while lo < hi {
            if lo & 1 == 1 {
                visit(self, lo);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                visit(self, hi);
            }
            lo >>= 1;
            hi >>= 1;
        }
    }

    /// Calls `visit` with the nodes on the paths from leaves `f` and `l` to the root whose time range reaches
    /// outside `[f, l]`, each once.
    fn above(&mut self, f: u32, l: u32, mut visit: impl FnMut(&mut Self, usize)) {
        let (f, l) = (f as usize, l as usize);
        let (mut a, mut b) = (f + self.leaves, l + self.leaves);
        let mut level = 0;
        while a >= 1 {
            let outside = |v: usize| {
                let first = (v << level) - self.leaves;
                let last = first + (1 << level) - 1;
                first < f || last > l
            };
            let (a_out, b_out) = (outside(a), b != a && outside(b));
            if a_out {
                visit(self, a);
            }
            if b_out {
                visit(self, b);
            }
            a >>= 1;
            b >>= 1;
            level += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_what_overlaps_or_touches() {
        let mut runs = Runs::default();
        runs.add(10, 20);
        runs.add(30, 40);
        runs.add(20, 25); // touches the first
        runs.add(50, 60);
        assert_eq!(runs.0, [(10, 25), (30, 40), (50, 60)]);
        runs.add(5, 55);
        assert_eq!(runs.0, [(5, 60)]);
    }

    /// The union of the reported runs is exactly the union of the byte ranges of the allocations meeting the
    /// query, for every query range.
    #[test]
    fn occupied_bytes_are_exactly_those_of_the_allocations_that_meet() {
        let placed =
            [(0u32, 3u32, 0u64, 4u64), (2, 5, 4, 6), (4, 4, 10, 12), (6, 9, 0, 2), (1, 8, 20, 24), (7, 7, 3, 9)];
        let spans: Vec<(u32, u32)> = placed.iter().map(|p| (p.0, p.1)).collect();
        let mut runs = Occupancy::new(10, Index::ByRuns, &spans);
        let mut lists = Occupancy::new(10, Index::ByAllocation, &spans);
        for &(f, l, s, e) in &placed {
            runs.insert(f, l, s, e);
            lists.insert(f, l, s, e);
        }
        let bytes = |ranges: &mut dyn Iterator<Item = (u64, u64)>| {
            let mut taken = [false; 32];
            for (s, e) in ranges {
                taken[s as usize..e as usize].iter_mut().for_each(|t| *t = true);
            }
            taken
        };
        for f in 0..10 {
            for l in f..10 {
                let expected = bytes(&mut placed.iter().filter(|p| p.0 <= l && f <= p.1).map(|&(_, _, s, e)| (s, e)));
                let (mut by_allocation, mut by_runs) = (Vec::new(), Vec::new());
                lists.occupied(f, l, &mut by_allocation);
                runs.occupied(f, l, &mut by_runs);
                for found in [by_allocation, by_runs] {
                    assert_eq!(bytes(&mut found.into_iter()), expected, "[{f}, {l}]");
                }
            }
        }
    }
}
