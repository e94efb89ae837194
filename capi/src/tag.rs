//! The calling thread's tag (`umm_set_tag`) and the tags asleep (`umm_sleep`): what an allocation reads to find
//! its pool, kept apart from the pools themselves ([`crate::registry`]) and from sleep and wake
//! ([`crate::sleep`]), which both read it.

use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;
use umm_backends::pool::check_tag;
use umm_backends::SleepAction;

thread_local! {
    /// The calling thread's tag (`umm_set_tag`).
    static CURRENT: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
    /// Whether `CURRENT` holds a tag: a plain flag (no destructor to register, no borrow to count), which is all
    /// an untagged allocation reads.
    static TAGGED: Cell<bool> = const { Cell::new(false) };
}

/// The sleeping tags; held through a whole sleep or wake, so that two never interleave.
pub(crate) static ASLEEP: Mutex<BTreeMap<String, SleepAction>> = Mutex::new(BTreeMap::new());

/// The calling thread's tag: one thread-local load when it has none.
#[inline(always)]
pub(crate) fn current() -> Option<Arc<str>> {
    if !TAGGED.with(Cell::get) {
        return None;
    }
    CURRENT.with(|c| c.borrow().clone())
}

/// Sets the calling thread's tag (`None` or empty: no tag). A bad tag is refused and the tag stays.
pub(crate) fn set_current(tag: Option<&str>) -> Result<(), String> {
    let tag = match tag.filter(|t| !t.is_empty()) {
        Some(tag) => {
            check_tag(tag).map_err(|e| format!("umm_set_tag: {e}"))?;
            Some(Arc::from(tag))
        }
        None => None,
    };
    TAGGED.with(|t| t.set(tag.is_some()));
    CURRENT.with(|c| *c.borrow_mut() = tag);
    Ok(())
}
