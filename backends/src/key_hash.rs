//! A hasher for `u64` keys that no one chooses to collide (block keys, device addresses): one multiplication
//! (Fibonacci hashing). SipHash, the standard default, protects maps from keys an attacker picks and costs about
//! 20 ns per call, more than the rest of what the pool's step records and the C ABI's table of live pointers do
//! per operation. The multiply spreads low bits (dense indices, aligned addresses) over the high ones hashbrown
//! reads.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// See the module's doc.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

const FIBONACCI: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(FIBONACCI);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(FIBONACCI);
    }
}

/// A map keyed by `u64` with [`KeyHasher`].
pub type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_keys_spread_over_the_high_bits() {
        let hash = |n: u64| {
            let mut h = KeyHasher::default();
            h.write_u64(n);
            h.finish()
        };
        // Addresses 256 bytes apart differ in their top 7 bits, which pick hashbrown's control bytes.
        let tops: std::collections::HashSet<u64> = (0..64u64).map(|i| hash(i * 256) >> 57).collect();
        assert!(tops.len() > 32, "{}", tops.len());
        let mut map: KeyMap<u32> = KeyMap::default();
        map.insert(7, 1);
        assert_eq!(map.get(&7), Some(&1));
    }
}
