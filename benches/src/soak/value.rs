//! The soak's values: sizes from 4 KiB to 2 MiB skewed towards small ones, and values that
//! describe themselves, so that every read is checked completely.

use kvpool_bench::replay::synth::Rng;
use xxhash_rust::xxh3::xxh3_64;

/// Smallest value.
pub(super) const MIN_SIZE: usize = 4 << 10;

/// Largest value.
pub(super) const MAX_SIZE: usize = 2 << 20;

/// Bytes of a value's self-description.
const HEADER: usize = 32;

/// 4 KiB .. 2 MiB, skewed towards small: the power of two is geometric (each size class 0.6
/// times as likely as the one below), then anywhere up to twice that.
pub(super) fn size(rng: &mut Rng) -> usize {
    let mut class = 0;
    while class < 9 && rng.below(10) < 6 {
        class += 1;
    }
    let base = MIN_SIZE << class;
    (base + rng.below(base as u64) as usize).min(MAX_SIZE)
}

/// Writes a self-describing value for `key` of `len` bytes into `v`.
pub(super) fn fill(v: &mut Vec<u8>, key: &[u8], seed: u64, len: usize) {
    v.clear();
    v.resize(len, 0);
    let mut w = seed;
    for chunk in v[HEADER..].chunks_mut(8) {
        w = w.wrapping_add(0x9e37_79b9_7f4a_7c15);
        chunk.copy_from_slice(&w.to_le_bytes()[..chunk.len()]);
    }
    v[0..8].copy_from_slice(&xxh3_64(key).to_le_bytes());
    v[16..24].copy_from_slice(&(len as u64).to_le_bytes());
    v[24..32].copy_from_slice(&seed.to_le_bytes());
    let sum = xxh3_64(&v[16..]);
    v[8..16].copy_from_slice(&sum.to_le_bytes());
}

/// Whether `v` is a value [`fill`] wrote for `key`.
pub(super) fn valid(key: &[u8], v: &[u8]) -> bool {
    let word = |i: usize| u64::from_le_bytes(v[i..i + 8].try_into().expect("8 bytes"));
    v.len() >= HEADER
        && word(0) == xxh3_64(key)
        && word(16) == v.len() as u64
        && word(8) == xxh3_64(&v[16..])
}

/// The length a self-describing value in `buf` claims (for load_prefix, which returns counts).
pub(super) fn claimed_len(buf: &[u8]) -> usize {
    let n = u64::from_le_bytes(buf[16..24].try_into().expect("8 bytes"));
    usize::try_from(n).map_or(buf.len(), |n| n.clamp(HEADER, buf.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_checks_only_for_its_key_and_whole() {
        let mut v = Vec::new();
        fill(&mut v, b"a", 7, 5000);
        assert!(valid(b"a", &v));
        assert!(!valid(b"b", &v));
        assert_eq!(claimed_len(&v), 5000);
        let mut torn = v.clone();
        torn[4000] ^= 1;
        assert!(!valid(b"a", &torn));
        let mut other = Vec::new();
        fill(&mut other, b"a", 8, 5000);
        let mut mixed = v.clone();
        mixed[2048..].copy_from_slice(&other[2048..]);
        assert!(!valid(b"a", &mixed));
        assert!(!valid(b"a", &v[..4999]));
        assert!(!valid(b"a", &v[..10]));
    }

    #[test]
    fn sizes_stay_in_range_and_favour_small_ones() {
        let mut rng = Rng::new(1);
        let sizes: Vec<usize> = (0..10_000).map(|_| size(&mut rng)).collect();
        assert!(sizes.iter().all(|s| (MIN_SIZE..=MAX_SIZE).contains(s)));
        let small = sizes.iter().filter(|&&s| s < 64 << 10).count();
        assert!(small > 5_000, "{small}");
        assert!(sizes.iter().any(|&s| s >= 1 << 20));
    }
}
