//! Engines that drive a real kvpool: an in-process [`kvpool::Pool`], or running daemons through
//! the client. Both store real bytes of the block size, load the hit prefix back like an
//! inference engine would, and check every loaded block is the one that was stored.

use anyhow::{bail, Context};
use kvpool::pool::{Commit, NamespaceConfig, Pool, PoolConfig};
use kvpool::segment::{Backing, HugePages};
use kvpool_client::blocking::Client;
use kvpool_client::ErrorCode;

use super::cache::BlockCache;

/// The pool key of a block id.
pub fn block_key(block: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = b'b';
    k[1..].copy_from_slice(&block.to_le_bytes());
    k
}

/// The bytes stored for a block: its id, repeated. Loads are checked against it.
fn fill(buf: &mut [u8], block: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = (block ^ (i as u64).rotate_left(32)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// A loaded block whose bytes are not the ones stored: the pool returned wrong data. A replay
/// stops on it, whatever else it tolerates.
#[derive(Debug)]
pub struct WrongBytes(pub u64);

impl std::fmt::Display for WrongBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "block {} came back with other bytes: the pool returned wrong data",
            self.0
        )
    }
}

impl std::error::Error for WrongBytes {}

fn check(buf: &[u8], block: u64) -> anyhow::Result<()> {
    let mut want = vec![0u8; buf.len()];
    fill(&mut want, block);
    if buf != want {
        return Err(WrongBytes(block).into());
    }
    Ok(())
}

/// A kvpool node in this process, with a namespace whose quota holds exactly `capacity` blocks.
pub struct InProcess {
    pool: Pool,
    value: Vec<u8>,
    scratch: Vec<u8>,
    now: u64,
}

impl InProcess {
    /// A node holding `capacity` blocks of `block_bytes`, its index in `shards` shards.
    pub fn new(
        capacity: u64,
        block_bytes: u64,
        shards: usize,
        policy: kvpool::eviction::PolicyKind,
    ) -> anyhow::Result<InProcess> {
        let probe = kvpool::alloc::Allocator::new(1 << 30, Default::default())?;
        let reserved = probe
            .reserved_size(block_bytes)
            .context("block larger than a segment")?;
        let quota = capacity
            .checked_mul(reserved)
            .context("capacity overflows")?;
        // Room beyond the quota for slab tails, so only the quota (exact, per block) evicts.
        let page = probe.page_size();
        let segment = (quota + quota / 32 + 4 * page).next_multiple_of(page);
        if segment > 64 << 30 {
            bail!("{capacity} blocks of {block_bytes} bytes need {segment} bytes: use a smaller --block-bytes or capacity");
        }
        let cfg = PoolConfig {
            segment_size: segment,
            backing: Backing::Anonymous,
            huge_pages: HugePages::Off,
            shards,
            namespaces: vec![NamespaceConfig {
                name: kvpool::pool::DEFAULT_NAMESPACE.into(),
                quota_bytes: Some(quota),
                eviction: policy,
                own_segment: false,
            }],
            ..PoolConfig::default()
        };
        let pool = Pool::new(&cfg, [0x5a; 16])?;
        Ok(InProcess {
            pool,
            value: vec![0; block_bytes as usize],
            scratch: vec![0; block_bytes as usize],
            now: 0,
        })
    }
}

impl BlockCache for InProcess {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        let keys: Vec<[u8; 9]> = blocks.iter().map(|&b| block_key(b)).collect();
        let hits = self.pool.exists_prefix(0, keys.iter().map(|k| &k[..]))?;
        // Loaded tail first, as the node reads a batch.
        for &b in blocks[..hits].iter().rev() {
            let n = self
                .pool
                .get_into(0, &block_key(b), &mut self.scratch, self.now)?;
            check(&self.scratch[..n], b)?;
        }
        Ok(hits)
    }

    fn store(&mut self, blocks: &[u64], _: &[u64]) -> anyhow::Result<()> {
        self.now += 1;
        // Looked up and then stored tail first, as the node takes a `Lookup` and the client
        // stores a batch (`Client::put_many`).
        let mut missing = Vec::new();
        for (depth, &b) in blocks.iter().enumerate().rev() {
            if self.pool.lookup(0, &block_key(b), 0, self.now)?.is_none() {
                missing.push((depth as u32, b));
            }
        }
        for (depth, b) in missing {
            fill(&mut self.value, b);
            let key = block_key(b);
            let len = self.value.len() as u64;
            let a = self
                .pool
                .alloc_in_chain(0, &key, len, false, depth, self.now)?;
            self.pool.write(&a, 0, &self.value)?;
            self.pool
                .commit(Commit::new(&a, kvpool::checksum(&self.value)))?;
        }
        Ok(())
    }
}

/// A running daemon, through the client: one round trip for the lookup, one to load the hits,
/// one to touch the present blocks and one to store the missing ones.
pub struct Remote {
    client: Client,
    tag: u32,
    block_bytes: usize,
}

impl Remote {
    /// Connects to `endpoint`. Keys carry `tag` so that runs against the same daemon don't see
    /// each other's blocks.
    pub fn connect(
        endpoint: &str,
        namespace: &str,
        block_bytes: u64,
        tag: u32,
    ) -> anyhow::Result<Remote> {
        let cfg = kvpool_client::ClientConfig {
            namespace: namespace.into(),
            client_name: "kvpool-bench replay".into(),
            ..Default::default()
        };
        let client =
            Client::connect(endpoint, cfg).with_context(|| format!("connecting to {endpoint}"))?;
        Ok(Remote {
            client,
            tag,
            block_bytes: block_bytes as usize,
        })
    }

    /// Serving nodes in the cluster this daemon belongs to (1 for a standalone daemon): the
    /// client routes every block to its owner among them.
    pub fn cluster_nodes(&self) -> anyhow::Result<usize> {
        let view = self.client.view()?;
        Ok(view
            .nodes
            .iter()
            .filter(|n| n.state == kvpool::placement::NodeState::Serving)
            .count())
    }

    fn key(&self, block: u64) -> Vec<u8> {
        let mut k = self.tag.to_le_bytes().to_vec();
        k.extend_from_slice(&block_key(block));
        k
    }
}

/// Keys per request, so no batch exceeds the node's limits.
const CHUNK: usize = 64;

impl BlockCache for Remote {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        let keys: Vec<Vec<u8>> = blocks.iter().map(|&b| self.key(b)).collect();
        let mut hits = 0;
        for chunk in keys.chunks(CHUNK * 16) {
            let refs: Vec<&[u8]> = chunk.iter().map(|k| &k[..]).collect();
            let n = self.client.batch_exists(&refs)?;
            hits += n;
            if n < chunk.len() {
                break;
            }
        }
        let mut bufs = vec![vec![0u8; self.block_bytes]; CHUNK.min(hits)];
        // The last chunk first: the node reads each batch tail first, so the whole run is.
        for (i, chunk) in keys[..hits].chunks(CHUNK).enumerate().rev() {
            let refs: Vec<&[u8]> = chunk.iter().map(|k| &k[..]).collect();
            let mut dsts: Vec<&mut [u8]> = bufs
                .iter_mut()
                .take(chunk.len())
                .map(|b| &mut b[..])
                .collect();
            let got = self.client.batch_get_into(&refs, &mut dsts)?;
            for (j, g) in got.iter().enumerate() {
                // Evicted between the lookup and the load: a miss the engine would recompute.
                if let Some(n) = g {
                    check(&bufs[j][..*n], blocks[i * CHUNK + j])?;
                }
            }
        }
        Ok(hits)
    }

    fn store(&mut self, blocks: &[u64], _: &[u64]) -> anyhow::Result<()> {
        // The last chunk first: the client stores each batch tail first, so the request's
        // blocks reach the node from the last to the first, as in the other engines. A block
        // that could not be stored (its node unreachable, or restarting) does not stop the
        // others, as an engine's connector goes on; the request counts as failed.
        let mut failed = None;
        for chunk in blocks.chunks(CHUNK).rev() {
            let keys: Vec<Vec<u8>> = chunk.iter().map(|&b| self.key(b)).collect();
            let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
            let present = self.client.lease(&refs, 0)?;
            let missing: Vec<usize> = (0..chunk.len()).filter(|&i| present[i].is_none()).collect();
            if missing.is_empty() {
                continue;
            }
            let values: Vec<Vec<u8>> = missing
                .iter()
                .map(|&i| {
                    let mut v = vec![0u8; self.block_bytes];
                    fill(&mut v, chunk[i]);
                    v
                })
                .collect();
            let items: Vec<(&[u8], &[u8])> = missing
                .iter()
                .zip(&values)
                .map(|(&i, v)| (&keys[i][..], &v[..]))
                .collect();
            for code in self.client.batch_put_from(&items)? {
                if code != ErrorCode::Ok
                    && code != ErrorCode::PoolFull
                    && code != ErrorCode::QuotaExceeded
                {
                    failed.get_or_insert(code);
                }
            }
        }
        match failed {
            Some(code) => bail!("storing a block failed: {code:?}"),
            None => Ok(()),
        }
    }
}
