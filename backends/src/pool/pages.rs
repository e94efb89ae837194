//! Which pages of a virtual segment have physical memory behind them: one bit per page.

/// A bitset over the pages of one virtual reservation.
#[derive(Debug, Clone)]
pub(super) struct PageMap {
    page_size: u64,
    words: Vec<u64>,
    mapped: u64,
}

impl PageMap {
    pub(super) fn new(reservation: u64, page_size: u64) -> Self {
        let pages = reservation.div_ceil(page_size);
        Self { page_size, words: vec![0; pages.div_ceil(64) as usize], mapped: 0 }
    }

    /// Mapped bytes.
    pub(super) fn mapped_bytes(&self) -> u64 {
        self.mapped * self.page_size
    }

    /// The page range `[first, end)` covering the byte range `[offset, offset + len)`.
    pub(super) fn covering(&self, offset: u64, len: u64) -> (u64, u64) {
        (offset / self.page_size, (offset + len).div_ceil(self.page_size))
    }

    /// The page range `[first, end)` lying entirely inside `[offset, offset + len)` (may be empty).
    pub(super) fn inside(&self, offset: u64, len: u64) -> (u64, u64) {
        let first = offset.div_ceil(self.page_size);
        let end = (offset + len) / self.page_size;
        (first, end.max(first))
    }

    fn is_mapped(&self, page: u64) -> bool {
        self.words[(page / 64) as usize] >> (page % 64) & 1 == 1
    }

    /// Unmapped bytes in pages `[first, end)`. O(pages / 64) when the range is fully mapped.
    pub(super) fn unmapped_bytes_in(&self, first: u64, end: u64) -> u64 {
        let mut missing = 0;
        let mut page = first;
        while page < end {
            // Skip whole mapped words quickly.
            if page % 64 == 0 && end - page >= 64 && self.words[(page / 64) as usize] == u64::MAX {
                page += 64;
                continue;
            }
            missing += u64::from(!self.is_mapped(page));
            page += 1;
        }
        missing * self.page_size
    }

    /// Maximal runs of pages in `[first, end)` whose mapped state is `mapped`, as page ranges.
    pub(super) fn runs(&self, first: u64, end: u64, mapped: bool) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut page = first;
        while page < end {
            if self.is_mapped(page) != mapped {
                page += 1;
                continue;
            }
            let start = page;
            while page < end && self.is_mapped(page) == mapped {
                page += 1;
            }
            runs.push((start, page));
        }
        runs
    }

    /// Marks pages `[first, end)` mapped or unmapped.
    pub(super) fn set(&mut self, first: u64, end: u64, mapped: bool) {
        for page in first..end {
            let (w, bit) = ((page / 64) as usize, 1u64 << (page % 64));
            let was = self.words[w] & bit != 0;
            if was != mapped {
                self.words[w] ^= bit;
                if mapped {
                    self.mapped += 1;
                } else {
                    self.mapped -= 1;
                }
            }
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
    }
}
