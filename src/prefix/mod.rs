//! Prefix hashing: the keys of KV blocks, reproducible by any engine in any language.
//!
//! A block's key is a chained hash: `h_0 = H(seed, block 0)`, `h_i = H(h_{i-1}, block i)`, so a
//! key stands for its block *and everything before it*, and two requests share a key exactly when
//! they share the whole prefix up to that block. The seed covers everything that makes KV bytes
//! differ for the same tokens: tenant, model, KV layout (dtype, tensor-parallel rank and size,
//! pipeline stage, layer range), block size, and an optional per-request salt (vLLM's
//! `cache_salt`), so blocks of different tenants, models or layouts never share a key.
//!
//! `H` is xxh3-128 over an exact byte encoding; docs/HASHING.md specifies it to the byte, with
//! test vectors and a Python reference. Only full blocks have keys: a partial last block is never
//! stored.

use xxhash_rust::xxh3::xxh3_128;

/// Everything that makes KV bytes differ for the same tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixSeed {
    /// Tenant (may be empty).
    pub tenant: String,
    /// Model id, e.g. `"meta-llama/Llama-3.1-8B-Instruct"`.
    pub model: String,
    /// KV dtype, e.g. `"bf16"`, `"fp8_e4m3"`.
    pub dtype: String,
    /// Tensor-parallel rank of the KV shard.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline stage.
    pub pp_stage: u32,
    /// First layer held (inclusive).
    pub layer_start: u32,
    /// Last layer held (exclusive).
    pub layer_end: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Optional per-request salt isolating users (vLLM's `cache_salt`); `None` and `Some("")`
    /// are different seeds.
    pub salt: Option<String>,
}

/// The version tag every seed starts with; changes whenever the encoding does.
pub const SEED_TAG: &[u8] = b"kvpool-prefix-v1";

/// A block key: 16 bytes, the little-endian encoding of the xxh3-128 value.
pub type BlockKey = [u8; 16];

impl PrefixSeed {
    /// The seed's byte encoding (docs/HASHING.md, "Seed").
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(128);
        b.extend_from_slice(SEED_TAG);
        for s in [&self.tenant, &self.model, &self.dtype] {
            put_str(&mut b, s);
        }
        for v in [
            self.tp_rank,
            self.tp_size,
            self.pp_stage,
            self.layer_start,
            self.layer_end,
            self.block_tokens,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        match &self.salt {
            None => b.push(0),
            Some(s) => {
                b.push(1);
                put_str(&mut b, s);
            }
        }
        b
    }

    /// `h_{-1}`: xxh3-128 of the encoding.
    pub fn seed(&self) -> u128 {
        xxh3_128(&self.encode())
    }

    /// The keys of every full block of `tokens` (a partial last block gets none).
    pub fn block_keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        block_keys(self.seed(), tokens, self.block_tokens as usize)
    }
}

/// `H(prev, block)`: xxh3-128 over `prev` (16 bytes LE), the token count (u32 LE) and each token
/// (u32 LE).
pub fn chain(prev: u128, block: &[u32]) -> u128 {
    let mut b = Vec::with_capacity(20 + 4 * block.len());
    b.extend_from_slice(&prev.to_le_bytes());
    b.extend_from_slice(&(block.len() as u32).to_le_bytes());
    for t in block {
        b.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_128(&b)
}

/// The keys of every full block of `tokens`, chained from `seed`.
pub fn block_keys(seed: u128, tokens: &[u32], block_tokens: usize) -> Vec<BlockKey> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut h = seed;
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            h = chain(h, block);
            h.to_le_bytes()
        })
        .collect()
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests;
