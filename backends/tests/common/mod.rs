//! Helpers shared by the backend suites (each `tests/*.rs` file is a crate of its own and includes this one).

/// Deterministic bytes (xorshift32) for round trips: a block written with them and read back shows any byte
/// that moved, went missing or came from elsewhere.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}
