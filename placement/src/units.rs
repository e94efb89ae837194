//! Sizes in the words people read and write: one place that formats byte counts and parses sizes, for every
//! crate of umm (reasons and errors, reports, the command line, environment variables).
//!
//! - [`bytes`]: exact where it can be (`64 KiB`), else one decimal (`1.5 MiB`): reasons and messages.
//! - [`human_bytes`]: always two decimals (`7.19 GiB`): reports and tables, where columns line up.
//! - [`short_bytes`]: two decimals without trailing zeros (`1.5 GiB`, `512 MiB`): axis labels.
//! - [`percent`]: a fraction as a percentage with at most one decimal.
//! - [`parse_size`], [`read_size`], [`parse_capacity`]: sizes with binary or decimal units.

/// Binary units above the byte, in order.
const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// `bytes` in binary units: "100 B", "64 KiB", "1.5 MiB".
pub fn bytes(bytes: u64) -> String {
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
pub fn percent(fraction: f64) -> String {
    let tenths = format!("{:.1}", fraction * 100.0);
    let trimmed = tenths.strip_suffix(".0").unwrap_or(&tenths);
    format!("{trimmed}%")
}

/// `bytes` in binary units with two decimals (`7.19 GiB`), or plain bytes below 1 KiB.
pub fn human_bytes(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let (value, unit) = scaled(bytes);
    format!("{value:.2} {unit}")
}

/// `bytes` in the largest binary unit that keeps it at least 1, without needless decimals (`1.5 GiB`,
/// `512 MiB`, `100 B`).
pub fn short_bytes(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let (value, unit) = scaled(bytes);
    let text = format!("{value:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} {unit}")
}

/// `bytes` (at least 1 KiB) as a value below 1024 of the largest unit up to PiB.
fn scaled(bytes: u64) -> (f64, &'static str) {
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    (value, UNITS[unit])
}

/// The sizes [`parse_size`] reads, in words, for error messages.
pub const SIZE_ACCEPTED: &str =
    "a size in bytes such as 1048576, 512MiB, 2GiB or 1.5GB (suffixes B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)";

/// Parses a byte size: plain bytes (`1048576`), binary suffixes (`KiB`, `MiB`, `GiB`, `TiB`), decimal ones
/// (`KB`, `MB`, `GB`, `TB`) or `B`; suffixes are case-insensitive and may follow a fraction (`1.5GB`). An error
/// quotes the text and says what is wrong with it (no number, a sign, an exponent, an unknown unit, too large).
pub fn parse_size(text: &str) -> Result<u64, String> {
    read_size(text).map_err(|problem| format!("{problem}: expected {SIZE_ACCEPTED}"))
}

/// [`parse_size`] without the list of accepted forms in its error, which says only what is wrong: for parsers
/// of their own forms (a limit also takes a percentage) that name those forms themselves.
pub fn read_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("no size given".into());
    }
    // A sign or an exponent is named as such; read as part of the unit it would be an unknown unit `-1MiB`.
    if text.starts_with('-') {
        return Err(format!("`{text}` is negative"));
    }
    if let Some(unsigned) = text.strip_prefix('+') {
        return Err(format!("`{text}` has a sign (write `{}`)", unsigned.trim_start()));
    }
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    if number.is_empty() {
        return Err(format!("`{text}` does not start with a number"));
    }
    let exponent = suffix.strip_prefix(['e', 'E']).map(|rest| rest.trim_start_matches(['+', '-']));
    if exponent.is_some_and(|digits| digits.starts_with(|c: char| c.is_ascii_digit())) {
        return Err(format!("`{text}` has an exponent, which sizes do not take"));
    }
    let unit: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("unknown unit `{}` in `{text}`", suffix.trim())),
    };
    let too_large = || format!("`{text}` is too large: sizes must fit in 64 bits (at most 16 EiB)");
    if let Ok(n) = number.parse::<u64>() {
        return n.checked_mul(unit).ok_or_else(too_large);
    }
    let value: f64 = match number.parse() {
        Ok(value) => value,
        // Only digits: a number too long for u64 (f64 reads any run of digits).
        Err(_) if !number.contains('.') => return Err(too_large()),
        Err(_) => {
            return Err(format!(
                "`{text}` is not a number followed by a unit ({number:?} has more than one `.` or no digit)"
            ))
        }
    };
    let bytes = (value * unit as f64).round();
    if bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

/// Parses a device capacity (`--capacity`, `--sim`): a size as [`parse_size`] reads it, above zero.
pub fn parse_capacity(text: &str) -> Result<u64, String> {
    match parse_size(text)? {
        0 => Err(format!("a capacity of `{}` holds nothing: give a size above zero such as 80GiB", text.trim())),
        bytes => Ok(bytes),
    }
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
    fn human_and_short_bytes_read_as_reports_and_axes_print_them() {
        assert_eq!(super::human_bytes(1023), "1023 B");
        assert_eq!(super::human_bytes(1024), "1.00 KiB");
        assert_eq!(super::human_bytes(7_720_000_000), "7.19 GiB");
        assert_eq!(super::human_bytes(1 << 50), "1.00 PiB");
        assert_eq!(super::human_bytes(u64::MAX), "16384.00 PiB");
        assert_eq!(super::short_bytes(100), "100 B");
        assert_eq!(super::short_bytes(512 << 20), "512 MiB");
        assert_eq!(super::short_bytes(3 << 29), "1.5 GiB");
        assert_eq!(super::short_bytes(1 << 50), "1 PiB");
    }

    #[test]
    fn capacities_are_sizes_above_zero() {
        assert_eq!(super::parse_capacity("80GiB"), Ok(80 << 30));
        assert!(super::parse_capacity(" 0 ").unwrap_err().contains("a capacity of `0` holds nothing"));
        assert!(super::parse_capacity("x").unwrap_err().contains("does not start with a number"));
    }

    #[test]
    fn percent_rounds() {
        assert_eq!(super::percent(0.934), "93.4%");
        assert_eq!(super::percent(0.925), "92.5%");
        assert_eq!(super::percent(0.9), "90%");
        assert_eq!(super::percent(1.0), "100%");
    }

    #[test]
    fn sizes_read_every_unit() {
        let cases = [
            ("4096", 4096),
            ("7b", 7),
            ("3KiB", 3 << 10),
            ("3MiB", 3 << 20),
            ("3GiB", 3 << 30),
            ("3TiB", 3 << 40),
            ("3kB", 3_000),
            ("3MB", 3_000_000),
            ("3 gb", 3_000_000_000),
            ("3TB", 3_000_000_000_000),
            ("1.5GiB", 3 << 29),
        ];
        for (text, bytes) in cases {
            assert_eq!(super::parse_size(text), Ok(bytes), "{text}");
        }
        for bad in ["", "MiB", "3XB", "1e3", "99999999999999999999", "20EiB"] {
            assert!(super::parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(super::parse_size("1048576"), Ok(1 << 20));
        assert_eq!(super::parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(super::parse_size("2 gib"), Ok(2 << 30));
        assert_eq!(super::parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(super::parse_size("4KiB"), Ok(4096));
        assert_eq!(super::parse_size("3MB"), Ok(3_000_000));
        assert_eq!(super::parse_size("1TiB"), Ok(1 << 40));
        assert!(super::parse_size("2XB").unwrap_err().contains("unknown unit"));
        assert!(super::parse_size("GiB").unwrap_err().contains("does not start with a number"));
        assert!(super::parse_size("1.2.3GiB").unwrap_err().contains("more than one `.`"));
        assert!(super::parse_size("99999999999TiB").unwrap_err().contains("is too large"));
    }
}
