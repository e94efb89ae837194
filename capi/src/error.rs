//! The thread-local last error that `umm_last_error` returns.

use std::cell::RefCell;
use std::ffi::{c_char, CString};

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Stores `message` as this thread's last error. Interior NUL bytes become spaces so the C string is whole.
/// Does nothing while the thread is being torn down (its storage is gone then).
pub(crate) fn set(message: impl Into<String>) {
    let text = message.into().replace('\0', " ");
    let c = CString::new(text).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = Some(c));
}

/// Clears this thread's last error.
pub(crate) fn clear() {
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = None);
}

/// This thread's last error as a C string owned by the thread-local slot (valid until the next umm call on
/// this thread that sets or clears it), or NULL when there is none.
pub(crate) fn as_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
        .unwrap_or(std::ptr::null())
}

/// This thread's last error as a Rust string (for tests and callers in Rust).
pub fn last_error_message() -> Option<String> {
    LAST_ERROR.try_with(|slot| slot.borrow().as_ref().map(|c| c.to_string_lossy().into_owned())).ok().flatten()
}
