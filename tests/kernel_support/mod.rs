//! What the kernel suites share: a manager that sees one API's devices.

use umm::backends::testing::skip_or_fail;
use umm::{Api, UniversalMemoryManager};

/// A manager that sees `api`'s devices, or `None` (after a skip notice) when there are none.
pub fn manager_with(api: Api) -> Option<UniversalMemoryManager> {
    let mm = UniversalMemoryManager::builder()
        .backends(api == Api::Cuda, api == Api::OpenCl, api == Api::Wgpu)
        .build()
        .unwrap();
    if mm.devices().iter().any(|d| d.apis().contains(&api)) {
        return Some(mm);
    }
    skip_or_fail(&api.to_string(), &format!("no {api} device ({})", mm.skipped().join("; ")));
    None
}
