//! Every `UMM_*` name the project's sources mention is one umm knows: a setting (`umm::config::KNOWN_VARS`) or a
//! variable of its own test suites and benches. A name read somewhere but missing from the lists would draw a
//! "not one umm reads" warning from every program that sets it.

use std::path::Path;

/// Names the sources spell wrong on purpose, to test the warning, and the bare prefix. (C headers' include guards,
/// `UMM_H`, end in `_H` and are no variables.)
const DELIBERATE: &[&str] = &["UMM_", "UMM_LIMT", "UMM_POISSON", "UMM_LARGE_SEGMNT", "UMM_FROBNICATE"];

fn names_in(dir: &Path, found: &mut Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            // Build outputs (`target`, the Python package's `build`) copy the sources; fixtures are data.
            if !matches!(name.as_str(), "target" | "build" | "fixtures") && !name.starts_with('.') {
                names_in(&path, found);
            }
        } else if [".rs", ".py", ".sh", ".c", ".h"].iter().any(|ext| name.ends_with(ext)) {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for (at, _) in text.match_indices("UMM_") {
                let var: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                found.push((var, path.display().to_string()));
            }
        }
    }
}

#[test]
fn every_umm_variable_in_the_sources_is_known() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    names_in(root, &mut found);
    assert!(found.iter().any(|(var, _)| var == "UMM_LIMIT"), "the sources were read: {} names", found.len());
    let unknown: Vec<String> = found
        .iter()
        .filter(|(var, _)| !DELIBERATE.contains(&var.as_str()) && !var.ends_with("_H"))
        .filter(|(var, _)| !umm::config::unknown_vars([var.as_str()]).is_empty())
        .map(|(var, path)| format!("{var} in {path}"))
        .collect();
    assert!(unknown.is_empty(), "variables missing from umm::config's lists: {unknown:#?}");
}
