//! Leaving the caller's current CUDA context as it was. A library called from PyTorch (or any CUDA program) must
//! not change the thread's current context behind the caller's back, yet umm's backends bind their device's
//! context before every driver call. Reading the current context on entry and comparing on exit costs two driver
//! calls per allocation, even when the allocation is a cache hit that calls no driver at all; a
//! [`ContextScope`] instead reads the caller's context only when a umm backend is about to bind one, and
//! restores it when the outermost scope ends.

use super::raw;
use cudarc::driver::sys;
use std::cell::Cell;
use std::marker::PhantomData;

#[derive(Clone, Copy)]
struct State {
    /// Open scopes on this thread.
    depth: u32,
    /// The caller's context, read at the first bind inside the outermost scope.
    saved: Option<Option<sys::CUcontext>>,
}

thread_local! {
    static STATE: Cell<State> = const { Cell::new(State { depth: 0, saved: None }) };
}

/// While alive, umm restores the thread's current CUDA context on exit if one of its backends bound another.
/// Scopes nest; the outermost one restores. Not `Send`: it belongs to the thread that opened it.
#[must_use = "the context is restored when the scope is dropped"]
pub struct ContextScope {
    _thread_bound: PhantomData<*const ()>,
}

impl ContextScope {
    /// Opens a scope. O(1), no driver call.
    pub fn enter() -> Self {
        STATE.with(|s| {
            let mut state = s.get();
            state.depth += 1;
            s.set(state);
        });
        ContextScope { _thread_bound: PhantomData }
    }

    /// Opens a scope that restores the thread's current context whatever binds another inside it, umm's
    /// backends or not (cudarc's `CudaContext::new` during discovery binds its context itself). Reads the
    /// current context now: one driver call, none when the driver library is absent (checked once).
    pub fn enter_saving() -> Self {
        let scope = Self::enter();
        static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *PRESENT.get_or_init(raw::driver_library_present) {
            before_bind();
        }
        scope
    }
}

impl Drop for ContextScope {
    #[allow(unsafe_code)] // Discharges `raw::restore_context`'s contract.
    fn drop(&mut self) {
        let saved = STATE.with(|s| {
            let mut state = s.get();
            state.depth -= 1;
            let saved = if state.depth == 0 { state.saved.take() } else { None };
            s.set(state);
            saved
        });
        let Some(saved) = saved else { return };
        if raw::current_context().is_ok_and(|now| now != saved) {
            // SAFETY: `saved` was read with `raw::current_context` on this thread (scopes are not `Send`) at the
            // first bind inside this outermost scope: the caller's own context, which it keeps alive while the
            // scope is open (umm never destroys a context it did not create, and keeps its primary contexts
            // retained).
            if let Err(f) = unsafe { raw::restore_context(saved) } {
                log::error!("restoring the caller's CUDA context failed: {}", f.message());
            }
        }
    }
}

/// Called by a backend before it binds its context: inside a scope, remembers the caller's context once.
pub(super) fn before_bind() {
    STATE.with(|s| {
        let mut state = s.get();
        if state.depth > 0 && state.saved.is_none() {
            if let Ok(ctx) = raw::current_context() {
                state.saved = Some(ctx);
                s.set(state);
            }
        }
    });
}
