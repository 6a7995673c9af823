//! The values the join and drain moves: numbered blocks and the probe's values, loaded
//! pinned and read back and checked after each move.

use std::sync::Arc;

use anyhow::ensure;
use kvpool_client::{Client, ErrorCode};

use super::{HandoffArgs, LOAD_BATCH, PROBE_KEYS, PROBE_SIZE};
use crate::perf::workloads;

/// The keys and values: the moved blocks and the probe's.
pub(super) struct Data {
    pub(super) block_keys: Vec<Vec<u8>>,
    /// One block; block `i` is it with `i` in its first 8 bytes.
    block: Arc<Vec<u8>>,
    pub(super) probe_keys: Vec<Vec<u8>>,
    pub(super) probe_values: Vec<Vec<u8>>,
}

impl Data {
    pub(super) fn new(args: &HandoffArgs) -> Data {
        let blocks = args.move_bytes / args.block_size;
        let probe = workloads::value(PROBE_SIZE);
        Data {
            block_keys: (0..blocks)
                .map(|i| format!("hbench-move/{i:06}").into_bytes())
                .collect(),
            block: workloads::value(args.block_size),
            probe_keys: (0..PROBE_KEYS)
                .map(|i| format!("hbench-move-probe/{i:03}").into_bytes())
                .collect(),
            probe_values: (0..PROBE_KEYS as u64)
                .map(|i| numbered(&probe, i))
                .collect(),
        }
    }

    fn block_value(&self, i: usize) -> Vec<u8> {
        numbered(&self.block, i as u64)
    }

    pub(super) fn objects(&self) -> u64 {
        (self.block_keys.len() + self.probe_keys.len()) as u64
    }

    pub(super) fn all_keys(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.block_keys.iter().chain(&self.probe_keys)
    }

    /// Stores every value pinned through `c`.
    pub(super) async fn load(&self, c: &Client) -> anyhow::Result<()> {
        let per = (LOAD_BATCH / self.block.len() as u64).max(1) as usize;
        for (n, chunk) in self.block_keys.chunks(per).enumerate() {
            let values: Vec<Vec<u8>> = (0..chunk.len())
                .map(|j| self.block_value(n * per + j))
                .collect();
            put_all(c, chunk, &values).await?;
        }
        put_all(c, &self.probe_keys, &self.probe_values).await
    }

    /// Reads every value back through `c` and checks its bytes.
    pub(super) async fn check(&self, c: &Client) -> anyhow::Result<()> {
        let per = (LOAD_BATCH / self.block.len() as u64).max(1) as usize;
        let mut bufs = vec![vec![0u8; self.block.len()]; per];
        for (n, chunk) in self.block_keys.chunks(per).enumerate() {
            let refs: Vec<&[u8]> = chunk.iter().map(|k| &k[..]).collect();
            let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let got = c.batch_get_into(&refs, &mut dsts[..chunk.len()]).await?;
            for (j, g) in got.iter().enumerate() {
                let i = n * per + j;
                ensure!(
                    *g == Some(self.block.len()) && bufs[j] == self.block_value(i),
                    "block {i} is missing or differs after the move ({g:?})"
                );
            }
        }
        for (k, v) in self.probe_keys.iter().zip(&self.probe_values) {
            let got = c.get(k).await?;
            ensure!(got.as_ref() == Some(v), "probe value {k:?} after the move");
        }
        Ok(())
    }
}

/// `base` with `i` in its first 8 bytes.
fn numbered(base: &[u8], i: u64) -> Vec<u8> {
    let mut v = base.to_vec();
    let n = v.len().min(8);
    v[..n].copy_from_slice(&i.to_le_bytes()[..n]);
    v
}

async fn put_all(c: &Client, keys: &[Vec<u8>], values: &[Vec<u8>]) -> anyhow::Result<()> {
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(values)
        .map(|(k, v)| (&k[..], &v[..]))
        .collect();
    let codes = c.batch_put_pinned(&items).await?;
    ensure!(
        codes.iter().all(|c| *c == ErrorCode::Ok),
        "loading node A: {codes:?}"
    );
    Ok(())
}
