//! The host's memory figures, from sysinfo on every platform (Linux, macOS, Windows), for every backend whose
//! memory is host memory: pinned pools, devices that share memory with the host, the host pool itself.

/// The host's memory now: (total, available) in bytes, where available is what can be given without swapping.
/// `None` where sysinfo cannot read it (an exotic platform, a sandbox without /proc).
pub fn host_memory() -> Option<(u64, u64)> {
    let mut system = sysinfo::System::new().ok()?;
    system.refresh_memory();
    let total = system.total_memory();
    (total > 0).then(|| (total, system.available_memory()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_has_memory_and_some_of_it_is_available() {
        let (total, available) = super::host_memory().expect("sysinfo reads this machine's memory");
        assert!(total >= 64 << 20, "{total}");
        assert!(available > 0 && available <= total, "{available} of {total}");
    }
}
