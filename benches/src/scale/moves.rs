//! What a join and a drain move: a known key set is written, the owner of every key is taken
//! from the views before and after with the client's placement (`ClusterView::owner`), and
//! what the nodes handed over is counted (`kvpool_handover_objects_total` of the previous
//! owners for a join; the objects the others gained for a drain, since the drained node's
//! counters leave with it). Afterwards every key is read back: a hit must carry its bytes.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvpool::placement::ClusterView;
use kvpool_client::{Client, ErrorCode};

use crate::soak::sample::{metric, scrape};

use super::fleet::{poll_cfg, Fleet};

/// The key set: `n` keys and a deterministic value of `size` bytes each.
pub(crate) struct KeySet {
    pub(crate) keys: Vec<Vec<u8>>,
    pub(crate) size: usize,
}

impl KeySet {
    pub(crate) fn new(n: usize, size: usize) -> KeySet {
        KeySet {
            keys: (0..n)
                .map(|i| format!("scale/{i:08}").into_bytes())
                .collect(),
            size,
        }
    }

    /// Writes every key through `c` (routed to its owner); fails unless all were stored.
    pub(crate) async fn put(&self, c: &Client) -> anyhow::Result<()> {
        for (b, chunk) in self.keys.chunks(256).enumerate() {
            let vals: Vec<Vec<u8>> = (0..chunk.len())
                .map(|j| value(b * 256 + j, self.size))
                .collect();
            let items: Vec<(&[u8], &[u8])> = chunk
                .iter()
                .zip(&vals)
                .map(|(k, v)| (&k[..], &v[..]))
                .collect();
            let codes = c
                .batch_put_from(&items)
                .await
                .context("storing the key set")?;
            if let Some(code) = codes.iter().find(|c| **c != ErrorCode::Ok) {
                bail!("storing the key set: {code:?}");
            }
        }
        Ok(())
    }

    /// Share of the keys whose owner differs between `before` and `after`.
    pub(crate) fn moved(&self, before: &ClusterView, after: &ClusterView) -> f64 {
        let moved = self
            .keys
            .iter()
            .filter(|k| before.owner(k) != after.owner(k))
            .count();
        moved as f64 / self.keys.len() as f64
    }

    /// Reads every key back through a fresh client of `endpoint`: (hits, misses, wrong bytes).
    pub(crate) async fn check(&self, endpoint: &str) -> anyhow::Result<(usize, usize, usize)> {
        let c = Client::connect(endpoint, poll_cfg()).await?;
        let (mut hit, mut miss, mut wrong) = (0, 0, 0);
        for (b, chunk) in self.keys.chunks(256).enumerate() {
            let refs: Vec<&[u8]> = chunk.iter().map(|k| &k[..]).collect();
            let mut bufs = vec![vec![0u8; self.size]; chunk.len()];
            let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let got = c.batch_get_into(&refs, &mut dsts).await?;
            for (j, (g, buf)) in got.iter().zip(&bufs).enumerate() {
                match g {
                    None => miss += 1,
                    Some(len) if *len == self.size && *buf == value(b * 256 + j, self.size) => {
                        hit += 1
                    }
                    Some(_) => wrong += 1,
                }
            }
        }
        Ok((hit, miss, wrong))
    }
}

/// Deterministic bytes of key `i`.
fn value(i: usize, len: usize) -> Vec<u8> {
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `kvpool_handover_objects_total` and `kvpool_handover_pending` summed over the live nodes.
pub(crate) fn handover(fleet: &Fleet) -> anyhow::Result<(u64, u64)> {
    let (mut handed, mut pending) = (0.0, 0.0);
    for m in fleet.members.iter().filter(|m| m.alive) {
        let page = scrape(&m.daemon.metrics)?;
        handed += metric(&page, "kvpool_handover_objects_total", "");
        pending += metric(&page, "kvpool_handover_pending", "");
    }
    Ok((handed as u64, pending as u64))
}

/// Objects held by each live node, by its own count.
pub(crate) async fn objects(fleet: &Fleet) -> anyhow::Result<u64> {
    let mut n = 0;
    for m in fleet.members.iter().filter(|m| m.alive) {
        if let Some(c) = &m.client {
            n += c.node_stats(m.id).await?.objects;
        }
    }
    Ok(n)
}

/// Waits (at most `bound`) until the handover is done: nothing pending on any live node and
/// the `probe` (a count of what was handed) unchanged over two readings a second apart.
pub(crate) async fn settled<F, Fut>(fleet: &Fleet, bound: Duration, probe: F) -> anyhow::Result<u64>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<u64>>,
{
    let t = Instant::now();
    let mut last = None;
    loop {
        let (_, pending) = handover(fleet)?;
        let now = probe().await?;
        if pending == 0 && last == Some(now) {
            return Ok(now);
        }
        last = Some(now);
        if t.elapsed() > bound {
            bail!("the handover did not settle within {bound:?} ({pending} objects pending)");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
