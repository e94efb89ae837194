//! Which pages of a virtual segment have physical memory behind them: one bit per page.

/// A bitset over the pages of one virtual reservation.
#[derive(Debug, Clone)]
pub(super) struct PageMap {
    page_size: u64,
    words: Vec<u64>,
    mapped: u64,
    /// No page at or above this index is mapped. Reservations are sized for the whole device, so most of their
    /// pages are never mapped: scans for mapped pages stop here instead of walking the unmapped tail.
    mapped_end: u64,
}

impl PageMap {
    pub(super) fn new(reservation: u64, page_size: u64) -> Self {
        let pages = reservation.div_ceil(page_size);
        Self { page_size, words: vec![0; pages.div_ceil(64) as usize], mapped: 0, mapped_end: 0 }
    }

    /// Mapped bytes.
    pub(super) fn mapped_bytes(&self) -> u64 {
        self.mapped * self.page_size
    }

    /// The page range `[first, end)` covering the byte range `[offset, offset + len)`.
    #[inline]
    pub(super) fn covering(&self, offset: u64, len: u64) -> (u64, u64) {
        (offset / self.page_size, (offset + len).div_ceil(self.page_size))
    }

    /// The page range `[first, end)` lying entirely inside `[offset, offset + len)` (may be empty).
    pub(super) fn inside(&self, offset: u64, len: u64) -> (u64, u64) {
        let first = offset.div_ceil(self.page_size);
        let end = (offset + len) / self.page_size;
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

    /// Whether any page in `[first, end)` is unmapped. O((end - first) / 64), and without a population count,
    /// which baseline x86-64 lacks: this is the check every allocation in a reservation makes.
    #[inline]
    pub(super) fn any_unmapped(&self, first: u64, end: u64) -> bool {
        let end = end.min(self.page_count());
        (first / 64..end.div_ceil(64)).any(|w| !self.words[w as usize] & Self::mask(w, first, end) != 0)
    }

    /// Unmapped bytes in pages `[first, end)`. O((end - first) / 64).
    #[inline]
    pub(super) fn unmapped_bytes_in(&self, first: u64, end: u64) -> u64 {
        let end = end.min(self.page_count());
        if first >= end {
            return 0;
        }
        let mut missing = 0;
        for w in first / 64..end.div_ceil(64) {
            let mask = Self::mask(w, first, end);
            missing += u64::from((!self.words[w as usize] & mask).count_ones());
        }
        missing * self.page_size
    }

    /// The lowest offset `p >= lo`, a multiple of `align`, such that `[p, p + size)` lies inside `[lo, hi)` and
    /// on mapped pages only. O((hi - lo) / page / 64 + runs), without allocating: the pool asks this of every
    /// candidate block when a request would otherwise map new pages.
    pub(super) fn mapped_span(&self, lo: u64, hi: u64, size: u64, align: u64) -> Option<u64> {
        let (first, end) = self.covering(lo, hi.checked_sub(lo)?);
        let end = end.min(self.mapped_end);
        let mut run_start: Option<u64> = None;
        let mut page = first;
        while page < end {
            let bit = page % 64;
            let word = self.words[(page / 64) as usize] >> bit;
            let left_in_word = 64 - bit;
            if word & 1 == 1 {
                let ones = u64::from(word.trailing_ones()).min(left_in_word);
                let start = *run_start.get_or_insert(page);
                page += ones;
                let p = self.offset_of(start).max(lo).next_multiple_of(align);
                if p.checked_add(size).is_some_and(|e| e <= self.offset_of(page.min(end)).min(hi)) {
                    return Some(p);
                }
            } else {
                run_start = None;
                page += if word == 0 { left_in_word } else { u64::from(word.trailing_zeros()).min(left_in_word) };
            }
        }
        None
    }

    /// Maximal runs of pages in `[first, end)` whose mapped state is `mapped`, as page ranges.
    /// O((end - first) / 64 + runs).
    pub(super) fn runs(&self, first: u64, end: u64, mapped: bool) -> Vec<(u64, u64)> {
        let end = end.min(if mapped { self.mapped_end } else { self.page_count() });
        let mut runs: Vec<(u64, u64)> = Vec::new();
        if first >= end {
            return runs;
        }
        for w in first / 64..end.div_ceil(64) {
            let word = if mapped { self.words[w as usize] } else { !self.words[w as usize] };
            let mut bits = word & Self::mask(w, first, end);
            while bits != 0 {
                let lo = u64::from(bits.trailing_zeros());
                let len = u64::from((bits >> lo).trailing_ones());
                let (a, b) = (w * 64 + lo, w * 64 + lo + len);
                match runs.last_mut() {
                    Some(last) if last.1 == a => last.1 = b,
                    _ => runs.push((a, b)),
                }
                bits &= if lo + len >= 64 { 0 } else { u64::MAX << (lo + len) };
            }
        }
        runs
    }

    /// Marks pages `[first, end)` mapped or unmapped. O((end - first) / 64).
    pub(super) fn set(&mut self, first: u64, end: u64, mapped: bool) {
        let end = end.min(self.page_count());
        if first >= end {
            return;
        }
        for w in first / 64..end.div_ceil(64) {
            let mask = Self::mask(w, first, end);
            let word = &mut self.words[w as usize];
            let before = u64::from(word.count_ones());
            if mapped {
                *word |= mask;
            } else {
                *word &= !mask;
            }
            let after = u64::from(word.count_ones());
            self.mapped = self.mapped + after - before;
        }
        if mapped {
            self.mapped_end = self.mapped_end.max(end);
        } else if end >= self.mapped_end {
            // The top mapped page may have gone: step down to the highest non-empty word. Amortised O(1) per
            // page ever mapped.
            let mut w = self.mapped_end.min(first).div_ceil(64);
            while w > 0 && self.words[w as usize - 1] == 0 {
                w -= 1;
            }
            self.mapped_end = if w == 0 { 0 } else { w * 64 - u64::from(self.words[w as usize - 1].leading_zeros()) };
        }
    }

    /// Number of pages in the reservation.
    pub(super) fn page_count(&self) -> u64 {
        self.words.len() as u64 * 64
    }

    /// Byte offset of page `page`.
    pub(super) fn offset_of(&self, page: u64) -> u64 {
        page * self.page_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_counts() {
        let mut m = PageMap::new(10 * 4096, 4096);
        assert_eq!(m.unmapped_bytes_in(0, 10), 10 * 4096);
        m.set(2, 5, true);
        assert_eq!(m.mapped_bytes(), 3 * 4096);
        assert_eq!(m.runs(0, 10, false), vec![(0, 2), (5, 10)]);
        assert_eq!(m.runs(0, 10, true), vec![(2, 5)]);
        assert_eq!(m.covering(4095, 2), (0, 2));
        assert_eq!(m.inside(4095, 4098), (1, 2));
        assert_eq!(m.inside(100, 5000), (1, 1));
        assert_eq!(m.inside(4096, 8192), (1, 3));
        m.set(0, 10, false);
        assert_eq!(m.mapped_bytes(), 0);
        // Runs across word boundaries.
        let mut m = PageMap::new(300 * 4096, 4096);
        m.set(60, 200, true);
        assert_eq!(m.runs(0, 300, true), vec![(60, 200)]);
        assert_eq!(m.runs(0, 300, false), vec![(0, 60), (200, 300)]);
        assert_eq!(m.runs(100, 130, true), vec![(100, 130)]);
        assert_eq!(m.unmapped_bytes_in(50, 210), 20 * 4096);
        assert!(m.any_unmapped(50, 210) && m.any_unmapped(199, 201) && m.any_unmapped(0, 1));
        assert!(!m.any_unmapped(60, 200) && !m.any_unmapped(64, 128) && !m.any_unmapped(70, 70));
        // Spans on mapped pages (4 KiB pages; pages 60..200 mapped).
        let page = 4096;
        assert_eq!(m.mapped_span(0, 300 * page, 10 * page, 256), Some(60 * page));
        assert_eq!(m.mapped_span(100 * page + 1, 300 * page, page, 256), Some(100 * page + 256));
        assert_eq!(m.mapped_span(0, 300 * page, 140 * page, 256), Some(60 * page));
        assert_eq!(m.mapped_span(0, 300 * page, 141 * page, 256), None);
        assert_eq!(m.mapped_span(0, 150 * page, 100 * page, 256), None, "must end inside [lo, hi)");
        assert_eq!(m.mapped_span(190 * page, 400 * page, 10 * page, 256), Some(190 * page));
        m.set(64, 128, false);
        assert_eq!(m.runs(0, 300, true), vec![(60, 64), (128, 200)]);
        assert_eq!(m.mapped_bytes(), 76 * 4096);
        // The end of the mapped pages follows unmapping from the top.
        assert_eq!(m.mapped_end, 200);
        m.set(150, 300, false);
        assert_eq!(m.mapped_end, 150);
        assert_eq!(m.runs(0, 300, true), vec![(60, 64), (128, 150)]);
        m.set(128, 150, false);
        assert_eq!(m.mapped_end, 64);
        m.set(0, 64, false);
        assert_eq!((m.mapped_end, m.mapped_bytes()), (0, 0));
    }
}
