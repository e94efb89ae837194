//! The pages of a CUDA backend's virtual reservations: each page one physical allocation (`cuMemCreate`), mapped,
//! mapped a second time elsewhere (a stitched block), unmapped and kept as a spare or released. The backend's
//! [`Backend`](crate::Backend) methods for pages call these.

use super::backend::{CudaBackend, CudaSegment};
use super::raw;
use crate::{Error, Result};

impl CudaBackend {
    /// A new physical page, shareable with other processes ([`crate::cuda::CudaPool::export`]) where the driver
    /// allows it: its first refusal makes this backend's later pages plain ones.
    fn create_page(&self, page: u64) -> raw::Raw<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.shareable_pages.load(Relaxed) {
            match raw::mem_create(page, self.ordinal, true) {
                Err(f) if f.refuses_sharing() => {
                    log::info!("{}: pages cannot be shared with other processes here ({})", self.name, f.message());
                    self.shareable_pages.store(false, Relaxed);
                }
                created => return created,
            }
        }
        raw::mem_create(page, self.ordinal, false)
    }

    /// Creates one physical allocation per page (so that any page can be unmapped on its own later), maps each,
    /// then grants read-write access to the whole range in one call, to this device and its peers. On failure
    /// nothing stays mapped.
    #[allow(unsafe_code)] // Discharges `raw::mem_map`'s, `raw::mem_unmap`'s and `raw::mem_release`'s contracts.
    pub(super) fn map_new_pages(&self, segment: &CudaSegment, offset: u64, len: u64) -> Result<()> {
        let (Some(vm), Some(pages)) = (self.vmm, segment.pages.as_ref()) else {
            return Err(Error::Unsupported { backend: self.name.clone(), what: "page mapping".into() });
        };
        let page = vm.page_size;
        if !offset.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(Error::OutOfBounds(format!("page mapping of {len} bytes at {offset}: not {page}-aligned")));
        }
        self.check(segment, offset, len)?;
        self.bind()?;
        let mut table = pages.lock();
        let first = (offset / page) as usize;
        let count = (len / page) as usize;
        if let Some(i) = (first..first + count).find(|&i| table[i] != 0) {
            return Err(Error::InvalidConfig(format!("page {i} of a reservation of {} is mapped twice", self.name)));
        }
        let mut done = 0;
        let mut failure = None;
        let mut spare = self.spare_pages.lock();
        for i in first..first + count {
            let at = segment.device_ptr + i as u64 * page;
            let created = match spare.pop() {
                Some(h) => Ok(h),
                None => self.create_page(page),
            };
            let handle = match created {
                Ok(h) => h,
                Err(f) => {
                    failure = Some(f);
                    break;
                }
            };
            // SAFETY: the page at `at` lies inside `segment`'s live reservation (the range was checked above) and
            // is not mapped (its table entry is 0, checked under the table's lock, which is held); `handle` is a
            // live allocation of exactly `page` bytes, fresh from `raw::mem_create` or a spare page of this size.
            if let Err(f) = unsafe { raw::mem_map(at, page, handle) } {
                // SAFETY: `handle` is in neither the table nor the spares, so this is its one release.
                let _ = unsafe { raw::mem_release(handle) };
                failure = Some(f);
                break;
            }
            table[i] = handle;
            done += 1;
        }
        if failure.is_none() {
            match raw::set_access(segment.device_ptr + offset, len, &self.access) {
                Ok(()) => return Ok(()),
                Err(f) => failure = Some(f),
            }
        }
        // SAFETY: pages `first..first + done` were mapped by this call, each under the reference its entry holds
        // (from `raw::mem_create` or the spares), and no block uses them yet.
        unsafe { undo_mappings(segment.device_ptr, &mut table[first..first + done], first, page) };
        Err(self.error(failure.expect("a failure ended the loop")))
    }

    /// Maps each source page's physical allocation at the destination under a reference of its own
    /// (`cuMemRetainAllocationHandle`), so that the destination's table releases it like any page when the range
    /// is destroyed, and the memory lives until both mappings are gone. Then grants access to the range as
    /// [`Backend::map_pages`] does. On failure nothing of this call stays mapped.
    #[allow(unsafe_code)] // Discharges `raw::mem_map`'s, `raw::mem_unmap`'s and `raw::mem_release`'s contracts.
    pub(super) fn map_pages_again(
        &self,
        dst: &CudaSegment,
        dst_offset: u64,
        src: &CudaSegment,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        let (Some(vm), Some(pages), true) = (self.vmm, dst.pages.as_ref(), src.is_virtual()) else {
            return Err(Error::Unsupported { backend: self.name.clone(), what: "mapping pages twice".into() });
        };
        let page = vm.page_size;
        if ![dst_offset, src_offset, len].iter().all(|v| v.is_multiple_of(page)) {
            return Err(Error::OutOfBounds(format!(
                "second mapping of {len} bytes at {src_offset} to {dst_offset}: not {page}-aligned"
            )));
        }
        self.check(dst, dst_offset, len)?;
        self.check(src, src_offset, len)?;
        self.bind()?;
        let mut table = pages.lock();
        let first = (dst_offset / page) as usize;
        let count = (len / page) as usize;
        if let Some(i) = (first..first + count).find(|&i| table[i] != 0) {
            return Err(Error::InvalidConfig(format!("page {i} of a reservation of {} is mapped twice", self.name)));
        }
        let mut done = 0;
        let mut failure = None;
        for j in 0..count {
            let handle = match raw::retain_handle(src.device_ptr + src_offset + j as u64 * page) {
                Ok(h) => h,
                Err(f) => {
                    failure = Some(f);
                    break;
                }
            };
            let at = dst.device_ptr + (first + j) as u64 * page;
            // SAFETY: the page at `at` lies inside `dst`'s live reservation (checked above) and is not mapped (its
            // table entry is 0, under the table's lock, which is held); `handle` is a live physical allocation of
            // exactly `page` bytes (every page of a reservation is one `raw::mem_create` of the page size), under
            // the reference just retained.
            if let Err(f) = unsafe { raw::mem_map(at, page, handle) } {
                // SAFETY: the reference retained just above, in neither table: its one release.
                let _ = unsafe { raw::mem_release(handle) };
                failure = Some(f);
                break;
            }
            table[first + j] = handle;
            done += 1;
        }
        if failure.is_none() {
            match raw::set_access(dst.device_ptr + dst_offset, len, &self.access) {
                Ok(()) => return Ok(()),
                Err(f) => failure = Some(f),
            }
        }
        // SAFETY: pages `first..first + done` were mapped by this call, each under the reference it retained, and
        // nothing uses them yet.
        unsafe { undo_mappings(dst.device_ptr, &mut table[first..first + done], first, page) };
        Err(self.error(failure.expect("a failure ended the loop")))
    }

    /// Unmaps every mapped page of a reservation and frees its memory (used before freeing it).
    ///
    /// # Safety
    /// As for [`Self::unmap_range`], for the whole reservation.
    #[allow(unsafe_code)] // A contract passed on to `unmap_range`.
    pub(super) unsafe fn unmap_all(&self, segment: &CudaSegment, page: u64) {
        // SAFETY: this function's contract is `unmap_range`'s.
        unsafe { self.unmap_range(segment, 0, segment.size, page, false) };
    }

    /// Unmaps the mapped pages of `[offset, offset + len)`; their memory is kept in `spare_pages` (`keep`) or
    /// freed.
    ///
    /// # Safety
    /// No work queued before this call still uses the range (the caller waited for every stream that may use
    /// it), and no live block lies over it.
    #[allow(unsafe_code)] // Discharges `raw::mem_unmap`'s and `raw::mem_release`'s contracts.
    pub(super) unsafe fn unmap_range(&self, segment: &CudaSegment, offset: u64, len: u64, page: u64, keep: bool) {
        let Some(pages) = segment.pages.as_ref() else { return };
        let mut table = pages.lock();
        let first = (offset / page) as usize;
        let end = (offset + len).div_ceil(page).min(table.len() as u64) as usize;
        let mut spare = self.spare_pages.lock();
        for i in first..end {
            let handle = std::mem::take(&mut table[i]);
            if handle == 0 {
                continue;
            }
            // SAFETY: a non-zero page table entry is exactly one mapping of one page made by `map_pages` or
            // `alias_pages`, taken out of the table here so it is unmapped once; by this function's contract nothing
            // uses it any more.
            if let Err(f) = unsafe { raw::mem_unmap(segment.device_ptr + i as u64 * page, page) } {
                log::error!("{}: {}", self.name, self.error(f));
            }
            if keep {
                spare.push(handle);
                continue;
            }
            // SAFETY: `handle` is the table's reference (from `raw::mem_create`, or from `raw::retain_handle` for a
            // second mapping), which the table no longer holds, released once, here.
            if let Err(f) = unsafe { raw::mem_release(handle) } {
                log::error!("{}: {}", self.name, self.error(f));
            }
        }
    }
}

/// Unmaps the pages of a reservation at `base` whose table entries are `entries` (page `first` onward), releases
/// the reference each entry holds and clears it: undoing the mappings of a `map_pages` or `alias_pages` call that
/// failed part-way.
///
/// # Safety
/// Each entry is one whole mapping of one page made by the failing call, under the one reference the entry holds,
/// and nothing uses those pages yet.
#[allow(unsafe_code)] // Discharges `raw::mem_unmap`'s and `raw::mem_release`'s contracts.
unsafe fn undo_mappings(base: u64, entries: &mut [u64], first: usize, page: u64) {
    for (i, entry) in entries.iter_mut().enumerate() {
        // SAFETY: by this function's contract the page is one mapping nothing uses; unmapped once (cleared below).
        let _ = unsafe { raw::mem_unmap(base + (first + i) as u64 * page, page) };
        // SAFETY: by this function's contract the entry holds one reference, released once (cleared below).
        let _ = unsafe { raw::mem_release(*entry) };
        *entry = 0;
    }
}
