//! Work to run when the process exits through `exit`: C's `atexit`, which the trace uses for its last write-out.

use std::ffi::c_int;

extern "C" {
    /// C's `atexit`. glibc links it from `libc_nonshared.a` as `__cxa_atexit` with this library's DSO handle, so
    /// a `dlclose` of the library runs the handler then instead of leaving it to call unmapped code at exit.
    fn atexit(callback: extern "C" fn()) -> c_int;
}

/// Registers `handler` to run at process exit; false if the C library refused. `handler` must not unwind (a
/// panic across the C frame that calls it aborts): catch panics inside it.
pub(crate) fn at_exit(handler: extern "C" fn()) -> bool {
    // SAFETY: `atexit` only stores the function pointer, which is a function with the C ABI that takes and
    // returns nothing; it is this library's, so it stays mapped until the handler has run (see `atexit` above).
    unsafe { atexit(handler) == 0 }
}
