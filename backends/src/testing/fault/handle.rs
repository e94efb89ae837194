//! The kinds of call a [`FaultyBackend`](super::FaultyBackend) fails, and the [`FaultHandle`] a test keeps: when
//! to fail, and the ledger of what the pool holds and what it did wrong.

#[cfg(doc)]
use super::FaultyBackend;
#[cfg(doc)]
use crate::Backend;
use crate::{Error, StreamId};
use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A kind of backend call that [`FaultyBackend`] can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// [`Backend::create_segment`].
    CreateSegment,
    /// [`Backend::reserve_virtual`].
    ReserveVirtual,
    /// [`Backend::map_pages`].
    MapPages,
    /// [`Backend::write`], [`Backend::read`] and [`Backend::fill`], counted together.
    Copy,
    /// [`Backend::settle`].
    Settle,
    /// [`Backend::free_bytes`], the device query: a faulted call reports 0 bytes free.
    FreeBytes,
    /// [`Backend::alias_pages`].
    AliasPages,
}

impl FaultKind {
    /// Every kind, in declaration order.
    pub const ALL: [FaultKind; 7] = [
        FaultKind::CreateSegment,
        FaultKind::ReserveVirtual,
        FaultKind::MapPages,
        FaultKind::Copy,
        FaultKind::Settle,
        FaultKind::FreeBytes,
        FaultKind::AliasPages,
    ];

    /// The backend call's name (`"copy"` for the three copies together).
    pub fn call(self) -> &'static str {
        match self {
            FaultKind::CreateSegment => "create_segment",
            FaultKind::ReserveVirtual => "reserve_virtual",
            FaultKind::MapPages => "map_pages",
            FaultKind::Copy => "copy",
            FaultKind::Settle => "settle",
            FaultKind::FreeBytes => "free_bytes",
            FaultKind::AliasPages => "alias_pages",
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.call())
    }
}

/// The start of every injected error's message.
pub(super) const INJECTED: &str = "injected fault";

/// Whether `error` is (or, for an out-of-memory error, was caused by) a fault that a [`FaultyBackend`] injected.
pub fn is_injected(error: &Error) -> bool {
    match error {
        Error::Driver { message, .. } => message.starts_with(INJECTED),
        Error::OutOfMemory { cause: Some(cause), .. } => cause.contains(INJECTED),
        _ => false,
    }
}

/// Which calls of one kind fail: those numbered `from..=to` (1-based, counted since the wrapper was made).
#[derive(Debug, Clone, Copy)]
pub(super) struct Trigger {
    pub(super) from: u64,
    pub(super) to: u64,
}

/// A segment the inner backend holds, as the ledger sees it.
#[derive(Debug)]
pub(super) struct Record {
    pub(super) size: u64,
    pub(super) reservation: bool,
    /// Mapped ranges, start → end, disjoint and merged.
    pub(super) mapped: BTreeMap<u64, u64>,
    /// The stream its unmaps named: one arena's reservation, so one stream.
    pub(super) unmapped_for: Option<StreamId>,
}

/// A second mapping: `len` bytes at `dst_offset` of the reservation it lies in map `src`'s pages at `src_offset`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Alias {
    pub(super) dst_offset: u64,
    pub(super) src: u64,
    pub(super) src_offset: u64,
    pub(super) len: u64,
}

#[derive(Debug, Default)]
pub(super) struct Ledger {
    pub(super) live: HashMap<u64, Record>,
    /// Bytes of live plain segments plus mapped pages.
    pub(super) resident: u64,
    pub(super) mapped: u64,
    pub(super) created: u64,
    pub(super) destroyed: u64,
    /// Every stream an unmap named.
    pub(super) unmap_streams: BTreeSet<u64>,
    /// Second mappings ([`Backend::alias_pages`]): by the reservation they lie in, the source reservation and
    /// range of each.
    pub(super) aliases: HashMap<u64, Vec<Alias>>,
    pub(super) violations: Vec<String>,
}

impl Ledger {
    pub(super) fn violation(&mut self, what: String) {
        log::error!("fault injection ledger: {what}");
        self.violations.push(what);
    }
}

#[derive(Debug, Default)]
pub(super) struct Shared {
    pub(super) calls: [AtomicU64; 7],
    pub(super) injected: [AtomicU64; 7],
    pub(super) unmap_calls: AtomicU64,
    pub(super) next_id: AtomicU64,
    pub(super) triggers: Mutex<[Option<Trigger>; 7]>,
    pub(super) ledger: Mutex<Ledger>,
}

impl Shared {
    /// Counts a call of `kind` and says whether it is to fail (and its number).
    pub(super) fn call(&self, kind: FaultKind) -> Option<u64> {
        let n = self.calls[kind.index()].fetch_add(1, Ordering::Relaxed) + 1;
        let trigger = self.triggers.lock()[kind.index()]?;
        (trigger.from..=trigger.to).contains(&n).then(|| {
            self.injected[kind.index()].fetch_add(1, Ordering::Relaxed);
            n
        })
    }
}

/// The test's side of a [`FaultyBackend`]: says which calls fail, and reads the counts and the ledger. Cheap to
/// clone; every clone and the backend share one state.
#[derive(Debug, Clone)]
pub struct FaultHandle(pub(super) Arc<Shared>);

impl FaultHandle {
    /// Fails the `k`-th call of `kind` (1-based, counted since the wrapper was made), once. A call already made
    /// is not failed after the fact: a `k` at or below [`FaultHandle::calls`] never fires.
    pub fn fail_nth(&self, kind: FaultKind, k: u64) {
        self.0.triggers.lock()[kind.index()] = Some(Trigger { from: k, to: k });
    }

    /// Fails the `k`-th call of `kind` and every later one, until [`FaultHandle::clear`]: a fault that a retry
    /// does not cure.
    pub fn fail_from(&self, kind: FaultKind, k: u64) {
        self.0.triggers.lock()[kind.index()] = Some(Trigger { from: k, to: u64::MAX });
    }

    /// Fails the next call of `kind`, once.
    pub fn fail_next(&self, kind: FaultKind) {
        self.fail_nth(kind, self.calls(kind) + 1);
    }

    /// Stops failing calls of `kind`.
    pub fn clear(&self, kind: FaultKind) {
        self.0.triggers.lock()[kind.index()] = None;
    }

    /// Stops failing calls of every kind.
    pub fn clear_all(&self) {
        *self.0.triggers.lock() = [None; 7];
    }

    /// Calls of `kind` made so far, failed or not.
    pub fn calls(&self, kind: FaultKind) -> u64 {
        self.0.calls[kind.index()].load(Ordering::Relaxed)
    }

    /// Calls of `kind` failed so far.
    pub fn injected(&self, kind: FaultKind) -> u64 {
        self.0.injected[kind.index()].load(Ordering::Relaxed)
    }

    /// Calls of every kind failed so far.
    pub fn total_injected(&self) -> u64 {
        FaultKind::ALL.iter().map(|&k| self.injected(k)).sum()
    }

    /// Calls of [`Backend::unmap_pages`] made so far.
    pub fn unmap_calls(&self) -> u64 {
        self.0.unmap_calls.load(Ordering::Relaxed)
    }

    /// Segments and reservations the inner backend holds now (created and not yet destroyed).
    pub fn live_segments(&self) -> u64 {
        self.0.ledger.lock().live.len() as u64
    }

    /// Segments and reservations created so far.
    pub fn segments_created(&self) -> u64 {
        self.0.ledger.lock().created
    }

    /// Segments and reservations destroyed so far.
    pub fn segments_destroyed(&self) -> u64 {
        self.0.ledger.lock().destroyed
    }

    /// Bytes of pages mapped now in virtual reservations.
    pub fn mapped_bytes(&self) -> u64 {
        self.0.ledger.lock().mapped
    }

    /// Physical bytes held now: live plain segments plus mapped pages (what a pool reports as `reserved_bytes`).
    pub fn resident_bytes(&self) -> u64 {
        self.0.ledger.lock().resident
    }

    /// Whether `[offset, offset + len)` of `segment` is mapped, as the ledger sees it: by pages of its own, or,
    /// in a range of second mappings, by pages mapped where they came from.
    pub fn is_mapped<S>(&self, segment: &FaultySegment<S>, offset: u64, len: u64) -> bool {
        let ledger = self.0.ledger.lock();
        let own = |ledger: &Ledger, id: u64, offset: u64, len: u64| {
            let record = ledger.live.get(&id);
            // Adjacent mappings are merged, so a mapped range lies inside one entry.
            record.and_then(|r| r.mapped.range(..=offset).next_back()).is_some_and(|(_, &end)| end >= offset + len)
        };
        let Some(aliases) = ledger.aliases.get(&segment.id) else { return own(&ledger, segment.id, offset, len) };
        let mut covered = 0;
        for a in aliases {
            let (lo, hi) = (offset.max(a.dst_offset), (offset + len).min(a.dst_offset + a.len));
            if lo < hi {
                if !own(&ledger, a.src, a.src_offset + (lo - a.dst_offset), hi - lo) {
                    return false;
                }
                covered += hi - lo;
            }
        }
        covered == len
    }

    /// The streams that unmaps have named, each once, in the order of their numbers.
    pub fn unmap_streams(&self) -> Vec<StreamId> {
        self.0.ledger.lock().unmap_streams.iter().map(|&s| StreamId(s)).collect()
    }

    /// Misuse the ledger saw: segments destroyed twice or with pages mapped, pages mapped twice, ranges unmapped
    /// that were not mapped, ranges off the page grid, one reservation's pages unmapped for two streams, pages
    /// mapped a second time that were not mapped, and pages unmapped (or their reservation destroyed) while
    /// mapped a second time.
    pub fn violations(&self) -> Vec<String> {
        self.0.ledger.lock().violations.clone()
    }

    /// `Ok` when nothing is held (every segment destroyed, every page unmapped) and nothing was misused; else
    /// what is wrong. Call it once the pool is dropped.
    pub fn check_released(&self) -> std::result::Result<(), String> {
        let ledger = self.0.ledger.lock();
        let mut problems = ledger.violations.clone();
        if !ledger.live.is_empty() {
            let bytes: u64 = ledger.live.values().map(|r| r.size).sum();
            problems.push(format!(
                "{} segments ({bytes} bytes of address space) not destroyed ({} created, {} destroyed)",
                ledger.live.len(),
                ledger.created,
                ledger.destroyed
            ));
        }
        if ledger.mapped > 0 {
            problems.push(format!("{} bytes of pages still mapped", ledger.mapped));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// A segment of a [`FaultyBackend`]: the inner backend's, with the number the ledger knows it by.
#[derive(Debug, Clone)]
pub struct FaultySegment<S> {
    pub(super) inner: S,
    pub(super) id: u64,
}

impl<S> FaultySegment<S> {
    /// The inner backend's segment.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}
