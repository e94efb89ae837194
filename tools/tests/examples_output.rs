//! The examples that write files write them where they say: the profiling example into a directory of the
//! system's temporary one (or the one given), never into the current directory.

#[path = "../examples/profiling.rs"]
mod profiling;

#[test]
fn the_profiling_example_writes_outside_the_current_directory_unless_told() {
    let default = profiling::default_dir();
    let here = std::env::current_dir().unwrap();
    assert!(default.is_absolute() && !default.starts_with(&here), "{} under {}", default.display(), here.display());
    let repository = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().canonicalize().unwrap();
    assert!(!default.starts_with(&repository), "{}", default.display());

    let out = std::env::temp_dir().join(format!("umm-profiling-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    profiling::run(&out).unwrap();
    for file in ["profiling_snapshot.json", "profiling_timeline.svg"] {
        assert!(out.join(file).is_file(), "{file} in {}", out.display());
        assert!(!here.join(file).exists(), "{file} left in {}", here.display());
    }
    std::fs::remove_dir_all(&out).unwrap();
}
