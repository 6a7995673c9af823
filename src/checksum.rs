//! The checksum that guards every byte crossing a boundary: xxh3-64.

/// xxh3-64 of `bytes`: what `put` sends, `commit` verifies and `get` returns.
#[inline]
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
