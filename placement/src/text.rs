//! Small helpers that turn numbers into the words used in reasons and error messages.

/// `bytes` in binary units: "100 B", "64 KiB", "1.5 MiB".
pub(crate) fn bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut unit = 0;
    let mut scale: u64 = 1024;
    while unit + 1 < UNITS.len() && bytes / scale >= 1024 {
        unit += 1;
        scale *= 1024;
    }
    if bytes.is_multiple_of(scale) {
        format!("{} {}", bytes / scale, UNITS[unit])
    } else {
        // Precision loss in the cast is irrelevant for a one-decimal display.
        format!("{:.1} {}", bytes as f64 / scale as f64, UNITS[unit])
    }
}

/// A fraction as a percentage with at most one decimal: "93%", "92.5%".
pub(crate) fn percent(fraction: f64) -> String {
    let tenths = format!("{:.1}", fraction * 100.0);
    let trimmed = tenths.strip_suffix(".0").unwrap_or(&tenths);
    format!("{trimmed}%")
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_are_readable() {
        assert_eq!(super::bytes(0), "0 B");
        assert_eq!(super::bytes(1023), "1023 B");
        assert_eq!(super::bytes(64 << 10), "64 KiB");
        assert_eq!(super::bytes(3 << 19), "1.5 MiB");
        assert_eq!(super::bytes(16 << 20), "16 MiB");
        assert_eq!(super::bytes(80 << 30), "80 GiB");
        assert_eq!(super::bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn percent_rounds() {
        assert_eq!(super::percent(0.934), "93.4%");
        assert_eq!(super::percent(0.925), "92.5%");
        assert_eq!(super::percent(0.9), "90%");
        assert_eq!(super::percent(1.0), "100%");
    }
}
