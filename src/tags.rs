//! Tags at the manager: which tag a request carries (its own, or its thread's [`TagScope`]) and which tags sleep
//! ([`Sleepers`]). What a sleep and a wake do is in `sleep.rs`.

use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;
pub use umm_backends::pool::{check_tag, MAX_TAG_LEN};
use umm_backends::SleepAction;

thread_local! {
    /// The calling thread's tag ([`UniversalMemoryManager::tag_scope`](crate::UniversalMemoryManager::tag_scope)).
    static CURRENT_TAG: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
    /// Whether `CURRENT_TAG` holds a tag: a plain flag (no destructor to register, no borrow to count), which is
    /// all an untagged allocation reads.
    static TAGGED: Cell<bool> = const { Cell::new(false) };
}

/// The tag of a request: its own, else the calling thread's ([`TagScope`]), checked, and refused while it
/// sleeps. An untagged request on a thread without a scope costs a field test and one thread-local load.
#[inline(always)]
pub(crate) fn tag_of(sleepers: &Sleepers, own: Option<&Arc<str>>) -> Result<Option<Arc<str>>> {
    if own.is_none() && !TAGGED.with(Cell::get) {
        return Ok(None);
    }
    checked_tag(sleepers, own)
}

#[cold]
#[inline(never)]
fn checked_tag(sleepers: &Sleepers, own: Option<&Arc<str>>) -> Result<Option<Arc<str>>> {
    let tag = own.cloned().or_else(|| CURRENT_TAG.with(|t| t.borrow().clone()));
    if let Some(tag) = &tag {
        check_tag(tag)?;
        sleepers.check_awake(tag)?;
    }
    Ok(tag)
}

/// Sets the calling thread's tag and returns the one before it.
fn set_current(tag: Option<Arc<str>>) -> Option<Arc<str>> {
    TAGGED.with(|t| t.set(tag.is_some()));
    CURRENT_TAG.with(|t| std::mem::replace(&mut *t.borrow_mut(), tag))
}

/// While it lives, the calling thread's allocations without a tag of their own carry its tag
/// ([`UniversalMemoryManager::tag_scope`](crate::UniversalMemoryManager::tag_scope)). Scopes nest: dropping one restores the tag before it. Not `Send`:
/// the tag is the thread's.
#[must_use = "the tag applies while the scope lives"]
pub struct TagScope {
    previous: Option<Arc<str>>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl TagScope {
    /// Makes `tag` the calling thread's until the scope drops.
    pub(crate) fn enter(tag: Arc<str>) -> TagScope {
        TagScope { previous: set_current(Some(tag)), _not_send: std::marker::PhantomData }
    }
}

impl Drop for TagScope {
    fn drop(&mut self) {
        set_current(self.previous.take());
    }
}

/// The manager's sleeping tags (a tag asleep refuses new allocations on every device, even one whose pool for
/// it does not exist yet).
#[derive(Debug, Default)]
pub(crate) struct Sleepers {
    pub(crate) asleep: Mutex<BTreeMap<Arc<str>, SleepAction>>,
    /// Held through a whole sleep or wake, so that two never interleave.
    pub(crate) turn: Mutex<()>,
}

impl Sleepers {
    /// [`Error::Backend`]`(Asleep)` when `tag` sleeps.
    pub(crate) fn check_awake(&self, tag: &str) -> Result<()> {
        match self.asleep.lock().get(tag) {
            None => Ok(()),
            Some(action) => Err(Error::Backend(umm_backends::Error::Asleep {
                pool: format!("tag {tag} ({action})"),
                what: "allocation".into(),
            })),
        }
    }
}
