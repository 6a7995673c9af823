//! Context caching: the KV blocks of a prompt's prefix, matched, saved and loaded as a run.

use super::Client;
use crate::dst::Dst;
use crate::error::ClientError;
use kvpool::protocol::ErrorCode;

/// How long `load_prefix` leases blocks while copying them on the same host.
const LOAD_LEASE_MS: u64 = 5_000;

/// The blocks of a prefix, named by their tokens or by keys the engine computed itself.
#[derive(Clone, Copy, Debug)]
pub enum Prefix<'a> {
    /// Token ids, hashed into block keys as docs/HASHING.md specifies (full blocks only).
    Tokens {
        /// Tenant, model, KV layout, block size and salt.
        seed: &'a kvpool::prefix::PrefixSeed,
        /// The request's tokens.
        tokens: &'a [u32],
    },
    /// Block keys an engine already has (vLLM, SGLang and Dynamo block hashes, trace ids).
    Keys(&'a [&'a [u8]]),
}

impl Prefix<'_> {
    /// The block keys, in order.
    pub fn keys(&self) -> Vec<Vec<u8>> {
        match self {
            Prefix::Tokens { seed, tokens } => {
                seed.block_keys(tokens).iter().map(|k| k.to_vec()).collect()
            }
            Prefix::Keys(keys) => keys.iter().map(|k| k.to_vec()).collect(),
        }
    }
}

impl Client {
    /// How many leading blocks of `prefix` the pool holds: one round trip per node holding
    /// any of them, never one per block.
    pub async fn match_prefix(&self, prefix: Prefix<'_>) -> Result<usize, ClientError> {
        let keys = prefix.keys();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        self.batch_exists(&refs).await
    }

    /// Stores the KV blocks of a prefix (`blocks[i]` for block `i`; only full blocks, so
    /// `blocks` may not be longer than the prefix has blocks). Blocks the pool already holds
    /// are not sent again. Returns how many leading blocks the pool holds afterwards.
    pub async fn save_prefix(
        &self,
        prefix: Prefix<'_>,
        blocks: &[&[u8]],
    ) -> Result<usize, ClientError> {
        let keys = prefix.keys();
        if blocks.len() > keys.len() {
            return Err(ClientError::Protocol(format!(
                "{} blocks given for a prefix of {} full blocks",
                blocks.len(),
                keys.len()
            )));
        }
        let refs: Vec<&[u8]> = keys[..blocks.len()].iter().map(|k| &k[..]).collect();
        let have = self.batch_exists(&refs).await?;
        if have == blocks.len() {
            return Ok(have);
        }
        let items: Vec<(&[u8], &[u8])> = refs[have..]
            .iter()
            .zip(&blocks[have..])
            .map(|(k, b)| (*k, *b))
            .collect();
        let depths = (have as u32..blocks.len() as u32).collect();
        let codes = self.put_many(&items, None, false, depths).await?;
        Ok(have + codes.iter().take_while(|c| **c == ErrorCode::Ok).count())
    }

    /// Loads the leading run of a prefix's blocks the pool holds into `dsts` (`dsts[i]` for
    /// block `i`) and returns how many it loaded; never a block after a gap. Zero-copy into the
    /// buffers on the same host, with the blocks leased while they are copied so eviction can't
    /// recycle them meanwhile. Buffers past the run are left as they were, with one exception:
    /// when a block is removed or replaced while this load copies it, blocks after it may
    /// already have been copied into their buffers; they are still not counted.
    pub async fn load_prefix(
        &self,
        prefix: Prefix<'_>,
        dsts: &mut [&mut [u8]],
    ) -> Result<usize, ClientError> {
        let keys = prefix.keys();
        let n = keys.len().min(dsts.len());
        let refs: Vec<&[u8]> = keys[..n].iter().map(|k| &k[..]).collect();
        let mut dsts: Vec<Dst<'_, '_>> = dsts[..n].iter_mut().map(std::slice::from_mut).collect();
        let got = self.get_many(&refs, &mut dsts, true, LOAD_LEASE_MS).await?;
        Ok(got.iter().take_while(|g| g.is_some()).count())
    }
}
