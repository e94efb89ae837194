//! Compiles tests/abi_test.c against include/umm.h and the built libumm_capi.so with the system C compiler, and
//! runs it. Skips with a reason where no C compiler or no built shared library is found.

use std::path::PathBuf;
use std::process::Command;
use umm_backends::testing::skip_or_fail;

fn shared_library_dir() -> Option<PathBuf> {
    // Integration tests run from <target>/<profile>/deps; the cdylib is built into deps and <profile>.
    let deps = std::env::current_exe().ok()?.parent()?.to_path_buf();
    [deps.clone(), deps.parent()?.to_path_buf()].into_iter().find(|d| d.join("libumm_capi.so").exists())
}

#[test]
fn c_program_uses_the_header() {
    // `UMM_REQUIRE_BACKENDS=c-header` (or `all`) turns each skip into a failure.
    if !cfg!(target_os = "linux") {
        return skip_or_fail("c-header", "written for Linux");
    }
    let Some(lib_dir) = shared_library_dir() else {
        return skip_or_fail("c-header", "libumm_capi.so not found next to the test binary");
    };
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    if Command::new(&cc).arg("--version").output().is_err() {
        return skip_or_fail("c-header", &format!("no C compiler ({cc})"));
    }
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("umm_abi_test_{}", std::process::id()));
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"))
        .arg("-I")
        .arg(crate_dir.join("tests"))
        .arg(crate_dir.join("tests/abi_test.c"))
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lumm_capi", "-o"])
        .arg(&out)
        .status()
        .expect("run the C compiler");
    assert!(status.success(), "compiling tests/abi_test.c failed");
    // Cargo's LD_LIBRARY_PATH, which outranks the rpath, also holds <target>/<profile>, where a `cargo build` of
    // another revision may have left an older libumm_capi.so: run against the library the program was linked with.
    let mut paths = vec![lib_dir.clone()];
    paths.extend(std::env::var_os("LD_LIBRARY_PATH").iter().flat_map(std::env::split_paths));
    let library_path = std::env::join_paths(paths).expect("library paths");
    let run = Command::new(&out).env("LD_LIBRARY_PATH", library_path).output().expect("run the C test");
    let _ = std::fs::remove_file(&out);
    assert!(
        run.status.success(),
        "C test failed: {}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    println!("{}", String::from_utf8_lossy(&run.stdout));
}
