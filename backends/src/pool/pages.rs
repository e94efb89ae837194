//! Which pages of a virtual reservation have physical memory behind them: one bit per page. Page sizes are powers
//! of two, so every page computation is a shift, not a division; run searches go a word (64 pages) at a time.

/// A bitset over the pages of one virtual reservation.
#[derive(Debug, Clone)]
pub(super) struct PageMap {
    shift: u32,
    mapped: Vec<u64>,
    mapped_pages: u64,
    /// No page at or above this index is mapped. Reservations are sized for the whole device, so most of their
    /// pages are never mapped: scans for mapped pages stop here instead of walking the unmapped tail.
    mapped_end: u64,
}

/// Which pages a run search looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Mapped,
    Unmapped,
}

impl PageMap {
    /// A map of a `reservation`-byte range in pages of `page_size` bytes (a power of two), nothing mapped.
    pub(super) fn new(reservation: u64, page_size: u64) -> Self {
        assert!(page_size.is_power_of_two(), "page sizes are powers of two");
        let shift = page_size.trailing_zeros();
        let pages = reservation.div_ceil(page_size);
        let words = pages.div_ceil(64) as usize;
        Self { shift, mapped: vec![0; words], mapped_pages: 0, mapped_end: 0 }
    }

    /// Mapped bytes. O(1).
    #[inline]
    pub(super) fn mapped_bytes(&self) -> u64 {
        self.mapped_pages << self.shift
    }

    /// Number of pages in the reservation.
    pub(super) fn page_count(&self) -> u64 {
        self.mapped.len() as u64 * 64
    }

    /// Byte offset of page `page`.
    #[inline]
    pub(super) fn offset_of(&self, page: u64) -> u64 {
        page << self.shift
    }

    /// Bytes in `pages` pages.
    #[inline]
    pub(super) fn bytes(&self, pages: u64) -> u64 {
        pages << self.shift
    }

    /// Pages needed to hold `bytes` bytes.
    #[inline]
    pub(super) fn pages_for(&self, bytes: u64) -> u64 {
        bytes.div_ceil(1 << self.shift)
    }

    /// The page range `[first, end)` covering the byte range `[offset, offset + len)`.
    #[inline]
    pub(super) fn covering(&self, offset: u64, len: u64) -> (u64, u64) {
        let page_mask = (1u64 << self.shift) - 1;
        (offset >> self.shift, (offset + len + page_mask) >> self.shift)
    }

    /// The page range `[first, end)` lying entirely inside `[offset, offset + len)` (may be empty).
    #[inline]
    pub(super) fn inside(&self, offset: u64, len: u64) -> (u64, u64) {
        let page_mask = (1u64 << self.shift) - 1;
        let first = (offset + page_mask) >> self.shift;
        let end = (offset + len) >> self.shift;
        (first, end.max(first))
    }

    /// Mask of the bits of word `w` that fall in pages `[first, end)`.
    #[inline]
    fn mask(w: u64, first: u64, end: u64) -> u64 {
        let lo = first.max(w * 64) - w * 64;
        let hi = end.min(w * 64 + 64) - w * 64;
        if hi <= lo {
            return 0;
        }
        let upper = if hi == 64 { u64::MAX } else { (1u64 << hi) - 1 };
        upper & !((1u64 << lo) - 1)
    }

    /// Word `w` with a bit set for each page of the kind `want`.
    #[inline]
    fn word(&self, w: usize, want: Want) -> u64 {
        match want {
            Want::Mapped => self.mapped[w],
            Want::Unmapped => !self.mapped[w],
        }
    }

    /// Whether any page in `[first, end)` is unmapped. O((end - first) / 64): the check every allocation in a
    /// reservation makes.
    #[inline]
    pub(super) fn any_unmapped(&self, first: u64, end: u64) -> bool {
        let end = end.min(self.page_count());
        (first / 64..end.div_ceil(64)).any(|w| !self.mapped[w as usize] & Self::mask(w, first, end) != 0)
    }

    /// Unmapped bytes in pages `[first, end)`. O((end - first) / 64).
    pub(super) fn unmapped_bytes_in(&self, first: u64, end: u64) -> u64 {
        let end = end.min(self.page_count());
        if first >= end {
            return 0;
        }
        let missing: u64 = (first / 64..end.div_ceil(64))
            .map(|w| u64::from((!self.mapped[w as usize] & Self::mask(w, first, end)).count_ones()))
            .sum();
        self.bytes(missing)
    }

    /// The lowest offset `p >= lo`, a multiple of `align` (a power of two), such that `[p, p + size)` lies inside
    /// `[lo, hi)` and on mapped pages only. The pool asks this of every candidate block when a request would
    /// otherwise map new pages, so it checks only the pages a placement needs, a word at a time, and on a miss
    /// jumps past the highest unmapped page of the window (every placement starting before it needs that page
    /// too). O((hi - lo) / page / 64) at worst, without allocating.
    pub(super) fn mapped_span(&self, lo: u64, hi: u64, size: u64, align: u64) -> Option<u64> {
        let align_up = |x: u64| x.checked_add(align - 1).map(|x| x & !(align - 1));
        let mut p = align_up(lo)?;
        loop {
            if p.checked_add(size)? > hi {
                return None;
            }
            let (first, end) = self.covering(p, size);
            if end > self.mapped_end {
                return None;
            }
            match self.last_unmapped(first, end) {
                None => return Some(p),
                Some(page) => p = align_up(self.offset_of(page + 1))?,
            }
        }
    }

    /// The highest unmapped page in `[first, end)`, if any. O((end - first) / 64).
    #[inline]
    fn last_unmapped(&self, first: u64, end: u64) -> Option<u64> {
        let end = end.min(self.page_count());
        (first / 64..end.div_ceil(64)).rev().find_map(|w| {
            let gaps = !self.mapped[w as usize] & Self::mask(w, first, end);
            (gaps != 0).then(|| w * 64 + 63 - u64::from(gaps.leading_zeros()))
        })
    }

    /// The lowest maximal run of pages of kind `want` inside `[from, end)`, as a page range.
    /// O((run end - from) / 64).
    fn next_run(&self, from: u64, end: u64, want: Want) -> Option<(u64, u64)> {
        let end = end.min(self.page_count());
        let mut page = from;
        // The run's first page: the lowest wanted page at or after `from`.
        loop {
            if page >= end {
                return None;
            }
            let bits = self.word((page / 64) as usize, want) >> (page % 64);
            if bits != 0 {
                page += u64::from(bits.trailing_zeros());
                break;
            }
            page = (page / 64 + 1) * 64;
        }
        if page >= end {
            return None;
        }
        let start = page;
        // Its end: the next unwanted page.
        while page < end {
            let gaps = !self.word((page / 64) as usize, want) >> (page % 64);
            if gaps != 0 {
                page += u64::from(gaps.trailing_zeros());
                break;
            }
            page = (page / 64 + 1) * 64;
        }
        Some((start, page.min(end)))
    }

    /// The highest maximal run of pages of kind `want` inside `[first, below)`, as a page range.
    /// O((below - run start) / 64).
    fn prev_run(&self, first: u64, below: u64, want: Want) -> Option<(u64, u64)> {
        let mut page = below.min(self.page_count());
        // The run's end: one past the highest wanted page below `page`.
        loop {
            if page <= first {
                return None;
            }
            let w = (page - 1) / 64;
            let bits = self.word(w as usize, want) & (u64::MAX >> (63 - (page - 1) % 64));
            if bits != 0 {
                page = w * 64 + 64 - u64::from(bits.leading_zeros());
                break;
            }
            page = w * 64;
        }
        if page <= first {
            return None;
        }
        let end = page;
        // Its start: one past the highest unwanted page below the end.
        while page > first {
            let w = (page - 1) / 64;
            let gaps = !self.word(w as usize, want) & (u64::MAX >> (63 - (page - 1) % 64));
            if gaps != 0 {
                page = w * 64 + 64 - u64::from(gaps.leading_zeros());
                break;
            }
            page = w * 64;
        }
        Some((page.max(first), end))
    }

    /// The lowest run of unmapped pages in `[from, end)`: the next range to map for a block.
    #[inline]
    pub(super) fn next_unmapped_run(&self, from: u64, end: u64) -> Option<(u64, u64)> {
        self.next_run(from, end, Want::Unmapped)
    }

    /// The lowest run of mapped pages at or after `from`: the next range to unmap when releasing everything.
    pub(super) fn next_mapped_run(&self, from: u64) -> Option<(u64, u64)> {
        self.next_run(from, self.mapped_end, Want::Mapped)
    }

    /// The highest run of mapped pages inside `[first, below)`: the next range a trim gives back.
    #[inline]
    pub(super) fn prev_mapped_run(&self, first: u64, below: u64) -> Option<(u64, u64)> {
        self.prev_run(first, below.min(self.mapped_end), Want::Mapped)
    }

    /// Highest mapped page plus one (0 when nothing is mapped).
    #[inline]
    pub(super) fn mapped_end(&self) -> u64 {
        self.mapped_end
    }

    /// Marks pages `[first, end)` mapped or unmapped. O((end - first) / 64).
    pub(super) fn set(&mut self, first: u64, end: u64, mapped: bool) {
        let end = end.min(self.page_count());
        if first >= end {
            return;
        }
        for w in first / 64..end.div_ceil(64) {
            let mask = Self::mask(w, first, end);
            let word = &mut self.mapped[w as usize];
            let before = u64::from(word.count_ones());
            if mapped {
                *word |= mask;
            } else {
                *word &= !mask;
            }
            let after = u64::from(word.count_ones());
            self.mapped_pages = self.mapped_pages + after - before;
        }
        if mapped {
            self.mapped_end = self.mapped_end.max(end);
        } else if end >= self.mapped_end {
            // The top mapped page may have gone: step down to the highest non-empty word. Amortised O(1) per
            // page ever mapped.
            let mut w = self.mapped_end.min(first).div_ceil(64);
            while w > 0 && self.mapped[w as usize - 1] == 0 {
                w -= 1;
            }
            self.mapped_end = if w == 0 { 0 } else { w * 64 - u64::from(self.mapped[w as usize - 1].leading_zeros()) };
        }
    }

    /// Checks the page count and the end of the mapped pages (tests only).
    #[cfg(test)]
    pub(super) fn check(&self) {
        let mapped: u64 = self.mapped.iter().map(|w| u64::from(w.count_ones())).sum();
        assert_eq!(mapped, self.mapped_pages);
        assert!(self.next_run(self.mapped_end, self.page_count(), Want::Mapped).is_none(), "mapped above the end");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn runs_naive(m: &PageMap, first: u64, end: u64, want: Want) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for p in first..end.min(m.page_count()) {
            let w = (p / 64) as usize;
            if m.word(w, want) >> (p % 64) & 1 == 1 {
                match runs.last_mut() {
                    Some(last) if last.1 == p => last.1 = p + 1,
                    _ => runs.push((p, p + 1)),
                }
            }
        }
        runs
    }

    fn runs_up(m: &PageMap, first: u64, end: u64, want: Want) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut from = first;
        while let Some(run) = m.next_run(from, end, want) {
            runs.push(run);
            from = run.1;
        }
        runs
    }

    fn runs_down(m: &PageMap, first: u64, end: u64, want: Want) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut below = end;
        while let Some(run) = m.prev_run(first, below, want) {
            runs.push(run);
            below = run.0;
        }
        runs.reverse();
        runs
    }

    #[test]
    fn runs_and_counts() {
        let page = 4096;
        let mut m = PageMap::new(10 * page, page);
        assert_eq!(m.unmapped_bytes_in(0, 10), 10 * page);
        m.set(2, 5, true);
        assert_eq!(m.mapped_bytes(), 3 * page);
        assert_eq!(runs_up(&m, 0, 10, Want::Unmapped), vec![(0, 2), (5, 10)]);
        assert_eq!(runs_up(&m, 0, 10, Want::Mapped), vec![(2, 5)]);
        assert_eq!(m.covering(4095, 2), (0, 2));
        assert_eq!(m.inside(4095, 4098), (1, 2));
        assert_eq!(m.inside(100, 5000), (1, 1));
        assert_eq!(m.inside(4096, 8192), (1, 3));
        m.set(0, 10, false);
        assert_eq!(m.mapped_bytes(), 0);
        // Runs across word boundaries.
        let mut m = PageMap::new(300 * page, page);
        m.set(60, 200, true);
        assert_eq!(runs_up(&m, 0, 300, Want::Mapped), vec![(60, 200)]);
        assert_eq!(runs_down(&m, 0, 300, Want::Mapped), vec![(60, 200)]);
        assert_eq!(runs_up(&m, 0, 300, Want::Unmapped), vec![(0, 60), (200, 300)]);
        assert_eq!(runs_up(&m, 100, 130, Want::Mapped), vec![(100, 130)]);
        assert_eq!(runs_down(&m, 100, 130, Want::Mapped), vec![(100, 130)]);
        assert_eq!(m.unmapped_bytes_in(50, 210), 20 * page);
        assert!(m.any_unmapped(50, 210) && m.any_unmapped(199, 201) && m.any_unmapped(0, 1));
        assert!(!m.any_unmapped(60, 200) && !m.any_unmapped(64, 128) && !m.any_unmapped(70, 70));
        // Spans on mapped pages (pages 60..200 mapped).
        assert_eq!(m.mapped_span(0, 300 * page, 10 * page, 256), Some(60 * page));
        assert_eq!(m.mapped_span(100 * page + 1, 300 * page, page, 256), Some(100 * page + 256));
        assert_eq!(m.mapped_span(0, 300 * page, 140 * page, 256), Some(60 * page));
        assert_eq!(m.mapped_span(0, 300 * page, 141 * page, 256), None);
        assert_eq!(m.mapped_span(0, 150 * page, 100 * page, 256), None, "must end inside [lo, hi)");
        assert_eq!(m.mapped_span(190 * page, 400 * page, 10 * page, 256), Some(190 * page));
        m.set(64, 128, false);
        assert_eq!(runs_up(&m, 0, 300, Want::Mapped), vec![(60, 64), (128, 200)]);
        assert_eq!(m.mapped_span(0, 300 * page, 72 * page, 256), Some(128 * page), "skips a short run");
        assert_eq!(m.mapped_bytes(), 76 * page);
        // The end of the mapped pages follows unmapping from the top.
        assert_eq!(m.mapped_end, 200);
        m.set(150, 300, false);
        assert_eq!(m.mapped_end, 150);
        m.set(128, 150, false);
        assert_eq!(m.mapped_end, 64);
        m.set(0, 64, false);
        assert_eq!((m.mapped_end, m.mapped_bytes()), (0, 0));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn run_searches_match_a_page_by_page_scan(
            words in prop::collection::vec(any::<u64>(), 1..5),
            first in 0u64..320,
            len in 0u64..320,
        ) {
            let mut m = PageMap::new(words.len() as u64 * 64 * 4096, 4096);
            for (i, w) in words.iter().enumerate() {
                for bit in 0..64 {
                    if w >> bit & 1 == 1 {
                        m.set(i as u64 * 64 + bit, i as u64 * 64 + bit + 1, true);
                    }
                }
            }
            let end = first + len;
            m.check();
            for want in [Want::Mapped, Want::Unmapped] {
                let naive = runs_naive(&m, first, end, want);
                prop_assert_eq!(&runs_up(&m, first, end, want), &naive);
                prop_assert_eq!(&runs_down(&m, first, end, want), &naive);
            }
            let unmapped: u64 = runs_naive(&m, first, end, Want::Unmapped).iter().map(|r| r.1 - r.0).sum();
            prop_assert_eq!(m.unmapped_bytes_in(first, end), unmapped * 4096);
            prop_assert_eq!(m.any_unmapped(first, end), unmapped > 0);
            let last = runs_naive(&m, first, end, Want::Unmapped).last().map(|r| r.1 - 1);
            prop_assert_eq!(m.last_unmapped(first, end), last);
        }
    }
}
