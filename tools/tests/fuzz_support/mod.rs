//! A small generator for the fuzz suites (`tests/fuzz_inputs.rs`, `tests/fuzz_cli.rs`): a seeded random source,
//! pools of troublesome values, and a runner that gives every case its own seed, catches panics, times each case
//! and reports the failing inputs with the seed that makes them again.
//!
//! Case counts: the CI tests run 10,000 cases per target, the `#[ignore]`d ones 100,000 (`cargo test --release
//! --test fuzz_inputs -- --ignored`); `UMM_FUZZ_CASES=N` overrides both, `UMM_FUZZ_SEED=S` changes the seeds.
#![allow(dead_code)]

use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// Cases per target in CI.
pub const CI_CASES: u64 = 10_000;
/// Cases per target in the ignored (long) tests.
pub const LONG_CASES: u64 = 100_000;
/// A case running longer than this counts as a hang (inputs are bounded, so none should come near it).
pub const HANG: Duration = Duration::from_secs(20);

/// The number of cases to run: `UMM_FUZZ_CASES` if set, else `default`.
pub fn cases(default: u64) -> u64 {
    match std::env::var("UMM_FUZZ_CASES") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("UMM_FUZZ_CASES={v:?}: expected a number of cases")),
        Err(_) => default,
    }
}

/// SplitMix64: small, fast, and every seed gives a distinct stream.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True one time in `n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }

    /// A u64 that is often at an edge: 0, 1, powers of two and their neighbours, the largest values.
    pub fn edgy_u64(&mut self) -> u64 {
        match self.below(6) {
            0 => *self.pick(&[0, 1, 2, u64::MAX, u64::MAX - 1, i64::MAX as u64, u32::MAX as u64, 1 << 32]),
            1 => {
                let p = 1u64 << self.below(64);
                [p.wrapping_sub(1), p, p.wrapping_add(1)][self.below(3) as usize]
            }
            2 => self.below(16),
            3 => self.below(1 << 20),
            _ => self.next_u64() >> self.below(64),
        }
    }

    /// A short string of troublesome characters: unicode, controls, whitespace, quotes.
    pub fn weird_text(&mut self, max_chars: u64) -> String {
        const CHARS: &[char] = &[
            'a', 'Z', '0', '9', '.', '-', '+', '%', 'e', 'E', ' ', '\t', '\n', '\r', '\0', '"', '\'', '`', '\\', '=',
            ',', '#', 'µ', 'é', 'ß', '€', '５', '٣', '\u{200b}', '\u{feff}', '\u{2028}', '😀', '\u{7f}', '\u{1b}',
        ];
        let n = self.below(max_chars + 1);
        (0..n)
            .map(|_| {
                if self.one_in(8) {
                    char::from_u32(self.below(0x11_0000) as u32).unwrap_or('?')
                } else {
                    *self.pick(CHARS)
                }
            })
            .collect()
    }
}

/// Text of sizes as people write them, and as they should not: fractions, units in every case, signs,
/// exponents, hex, huge digit runs, unicode digits and units, spaces, empty.
pub fn size_text(rng: &mut Rng) -> String {
    const UNITS: &[&str] = &[
        "", "B", "b", "KiB", "kib", "KIB", "MiB", "mib", "GiB", "gib", "TiB", "KB", "kb", "MB", "GB", "gb", "TB",
        "PiB", "EiB", "K", "M", "G", "k", "bytes", "byte", "iB", "MiBs", "µB", "㎆", "ＭiB", "%", "%%", " %", "e3",
        "E+9", "e-2", "x", " MiB", "MiB ", " ",
    ];
    let number = match rng.below(10) {
        0 => rng.edgy_u64().to_string(),
        1 => format!("{}.{}", rng.below(10_000), rng.below(1_000_000)),
        2 => format!("-{}", rng.edgy_u64()),
        3 => format!("+{}", rng.below(100)),
        4 => "9".repeat(rng.range(15, 400) as usize),
        5 => rng
            .pick(&["", ".", "..", "1.", ".5", "1.2.3", "0x10", "1e30", "1_000", "NaN", "inf", "-0", "١٢", "５"])
            .to_string(),
        6 => format!("{}.{}", "9".repeat(rng.range(15, 40) as usize), rng.below(100)),
        7 => rng.weird_text(6),
        _ => rng.below(4096).to_string(),
    };
    let unit = *rng.pick(UNITS);
    let pad = |rng: &mut Rng| rng.pick(&["", "", "", " ", "\t", "\n", "\u{a0}", "  "]).to_string();
    let text = format!("{}{number}{}{unit}{}", pad(rng), if rng.one_in(6) { " " } else { "" }, pad(rng));
    if rng.one_in(20) {
        rng.weird_text(12)
    } else {
        text
    }
}

/// Runs `cases` cases of a target: each draws its input from its own seeded [`Rng`] and is checked by `check`,
/// which returns an error saying what is wrong with the answer. A panic in either counts as a failure. Fails the
/// test listing the first failures (input, seed, what went wrong) and prints the cases run and the slowest case.
pub fn run<I: Debug>(
    target: &str,
    cases: u64,
    generate: impl Fn(&mut Rng) -> I,
    check: impl Fn(&I) -> Result<(), String>,
) {
    let base: u64 = std::env::var("UMM_FUZZ_SEED").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0x5EED);
    let mut failures = Vec::new();
    let mut failed = 0u64;
    let mut slowest = (Duration::ZERO, 0u64);
    let start = Instant::now();
    for case in 0..cases {
        let seed = base.wrapping_mul(0x100_0000_01B3) ^ case;
        let began = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let input = generate(&mut Rng::new(seed));
            let verdict = catch_unwind(AssertUnwindSafe(|| check(&input)));
            (format!("{input:?}"), verdict)
        }));
        let took = began.elapsed();
        if took > slowest.0 {
            slowest = (took, seed);
        }
        let problem = match outcome {
            Err(panic) => Some(("<the generator panicked>".to_string(), format!("panic: {}", panic_text(&*panic)))),
            Ok((input, Err(panic))) => Some((input, format!("panic: {}", panic_text(&*panic)))),
            Ok((input, Ok(Err(why)))) => Some((input, why)),
            Ok((input, Ok(Ok(())))) if took > HANG => Some((input, format!("took {took:?}: a hang"))),
            Ok(_) => None,
        };
        if let Some((input, why)) = problem {
            failed += 1;
            if failures.len() < 4 {
                let input: String = input.chars().take(600).collect();
                failures.push(format!("seed {seed:#x}: {why}\n    input: {input}"));
            }
        }
    }
    eprintln!(
        "fuzz {target}: {cases} cases, {failed} failed, {:.1} s, slowest case {:?} (seed {:#x})",
        start.elapsed().as_secs_f64(),
        slowest.0,
        slowest.1
    );
    assert!(failed == 0, "fuzz {target}: {failed} of {cases} cases failed:\n{}", failures.join("\n"));
}

pub fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
