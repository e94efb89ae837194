//! The host: memory from sysinfo (through `umm_backends::host_memory`), processor identity and features from raw-cpuid.

use serde::Serialize;

/// What the manager knows of the host machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostInfo {
    /// Total physical memory in bytes.
    pub total_bytes: u64,
    /// Memory available to new allocations, in bytes, when discovered.
    pub available_bytes: u64,
    /// Logical processors.
    pub logical_cpus: usize,
    /// Processor vendor ("GenuineIntel", "AuthenticAMD"), when the CPU reports it.
    pub cpu_vendor: Option<String>,
    /// Processor brand string, when reported.
    pub cpu_brand: Option<String>,
    /// Cache line size in bytes (64 when unknown).
    pub cache_line_bytes: u64,
    /// SIMD features that matter for host buffers' alignment ("sse4.2", "avx2", "avx512f", ...).
    pub simd: Vec<String>,
}

impl HostInfo {
    /// Reads the host now. Never fails: unknown facts are `None` or conservative defaults.
    pub fn discover() -> Self {
        // Unknown (zero) memory on a platform sysinfo cannot read, rather than a failed discovery.
        let (total_bytes, available_bytes) = umm_backends::host_memory().unwrap_or((0, 0));
        let logical_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (cpu_vendor, cpu_brand, cache_line_bytes, simd) = cpu_identity();
        Self { total_bytes, available_bytes, logical_cpus, cpu_vendor, cpu_brand, cache_line_bytes, simd }
    }

    /// The alignment host blocks should honour: the cache line, and 64 bytes for AVX-512 loads at least.
    pub fn preferred_alignment(&self) -> u64 {
        self.cache_line_bytes.max(64).next_power_of_two()
    }
}

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
fn cpu_identity() -> (Option<String>, Option<String>, u64, Vec<String>) {
    let cpuid = raw_cpuid::CpuId::new();
    let vendor = cpuid.get_vendor_info().map(|v| v.as_str().to_string());
    let brand = cpuid.get_processor_brand_string().map(|b| b.as_str().trim().to_string());
    let line = cpuid.get_feature_info().map_or(64, |f| u64::from(f.cflush_cache_line_size()) * 8).max(64);
    let mut simd = Vec::new();
    if let Some(f) = cpuid.get_feature_info() {
        for (on, name) in
            [(f.has_sse2(), "sse2"), (f.has_sse42(), "sse4.2"), (f.has_avx(), "avx"), (f.has_fma(), "fma")]
        {
            if on {
                simd.push(name.to_string());
            }
        }
    }
    if let Some(f) = cpuid.get_extended_feature_info() {
        for (on, name) in [(f.has_avx2(), "avx2"), (f.has_avx512f(), "avx512f"), (f.has_avx512bw(), "avx512bw")] {
            if on {
                simd.push(name.to_string());
            }
        }
    }
    (vendor, brand, line, simd)
}

#[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
fn cpu_identity() -> (Option<String>, Option<String>, u64, Vec<String>) {
    (None, None, 64, Vec::new())
}
