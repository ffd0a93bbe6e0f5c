//! A Bloom filter of the keys the durable tier may hold.
//!
//! Guarantee: no false negatives for keys added. It only picks the cheaper
//! statement for a change: "not in the filter" means a guarded insert that
//! still checks the durable tier in the same statement (see
//! [`super::mirror::insert_new`]), so neither a false positive nor a key
//! missing from the filter (written by another instance) can apply a
//! change twice; they only cost a round trip.

use std::hash::{DefaultHasher, Hash, Hasher};

#[derive(Debug)]
pub struct Bloom {
    bits: Vec<u64>,
    /// Number of bits.
    m: u64,
    /// Hashes per key.
    k: u32,
}

impl Bloom {
    /// A filter sized for `keys` keys at about a 1% false-positive rate.
    pub fn new(keys: usize) -> Bloom {
        // m = -n ln p / (ln 2)^2, k = (m / n) ln 2, with p = 0.01.
        let n = keys.max(1) as f64;
        let m = ((-n * 0.01f64.ln()) / (2f64.ln().powi(2))).ceil().max(64.0) as u64;
        let k = ((m as f64 / n) * 2f64.ln()).round().clamp(1.0, 16.0) as u32;
        Bloom {
            bits: vec![0; m.div_ceil(64) as usize],
            m,
            k,
        }
    }

    /// Double hashing: bit i is h1 + i·h2 (mod m).
    fn positions(&self, key: &str) -> impl Iterator<Item = u64> + '_ {
        let mut a = DefaultHasher::new();
        key.hash(&mut a);
        let h1 = a.finish();
        let mut b = DefaultHasher::new();
        (key, 0x9e37_79b9u32).hash(&mut b);
        let h2 = b.finish() | 1;
        (0..u64::from(self.k)).map(move |i| h1.wrapping_add(i.wrapping_mul(h2)) % self.m)
    }

    pub fn insert(&mut self, key: &str) {
        let positions: Vec<u64> = self.positions(key).collect();
        for p in positions {
            self.bits[(p / 64) as usize] |= 1 << (p % 64);
        }
    }

    /// False only for a key never inserted.
    pub fn may_contain(&self, key: &str) -> bool {
        self.positions(key)
            .all(|p| self.bits[(p / 64) as usize] & (1 << (p % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserted_keys_are_always_found_and_false_positives_are_rare() {
        let mut b = Bloom::new(10_000);
        for i in 0..10_000 {
            b.insert(&format!("k{i}"));
        }
        for i in 0..10_000 {
            assert!(b.may_contain(&format!("k{i}")), "false negative for k{i}");
        }
        let false_positives = (0..10_000)
            .filter(|i| b.may_contain(&format!("other{i}")))
            .count();
        // Sized for 1%; allow for chance.
        assert!(false_positives < 300, "{false_positives} false positives");
    }

    #[test]
    fn an_empty_filter_contains_nothing() {
        let b = Bloom::new(0);
        assert!(!b.may_contain("a"));
    }
}
