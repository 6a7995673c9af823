//! The data sets every section reads (same keys and sizes for kvpool and its peers) and the
//! kvpool client loops driven by [`run_tasks`](super::driver::run_tasks).

use std::sync::Arc;

use anyhow::{anyhow, bail, Context};
use kvpool_client::{Client, ClientConfig, ErrorCode};

use super::daemon::Daemon;
use super::driver::Worker;
use kvpool_bench::units::fmt_size;

/// Bytes of values stored per size: 16× the L3 of typical servers, so reads come from DRAM.
pub(crate) const WORKING_SET: u64 = 512 << 20;

/// Pipelining (batching) depth of the "depth 8" variants.
pub(crate) const DEPTH: usize = 8;

/// Distinct keys each put loop cycles through (bounds the memory puts take).
const PUT_KEYS: usize = 32;

/// How many objects of `size` make up the working set.
pub(crate) fn object_count(size: u64) -> usize {
    (WORKING_SET / size).clamp(16, 16_384) as usize
}

/// The keys of the data set of `size`.
pub(crate) fn keys(size: u64) -> Arc<Vec<Vec<u8>>> {
    Arc::new(
        (0..object_count(size))
            .map(|i| format!("bench/{size}/{i:06}").into_bytes())
            .collect(),
    )
}

/// Keys a put loop (`worker` of a measurement) overwrites in turn.
pub(crate) fn put_keys(size: u64, worker: usize) -> Vec<Vec<u8>> {
    (0..PUT_KEYS)
        .map(|i| format!("bench-put/{size}/{worker}/{i}").into_bytes())
        .collect()
}

/// A value of `size` bytes of incompressible noise.
pub(crate) fn value(size: u64) -> Arc<Vec<u8>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ size;
    let mut v = Vec::with_capacity(size as usize);
    while v.len() < size as usize {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(size as usize);
    Arc::new(v)
}

/// Stores the data set of every size in `sizes` not stored yet.
pub(crate) async fn ensure_loaded(daemon: &mut Daemon, sizes: &[u64]) -> anyhow::Result<()> {
    let todo: Vec<u64> = sizes
        .iter()
        .copied()
        .filter(|s| !daemon.loaded.contains(s))
        .collect();
    if todo.is_empty() {
        return Ok(());
    }
    let client = Client::connect(&format!("tcp://{}", daemon.tcp), ClientConfig::default()).await?;
    for size in todo {
        let (keys, value) = (keys(size), value(size));
        eprintln!("  loading {} × {} into kvpoold", keys.len(), fmt_size(size));
        let per_batch = ((32u64 << 20) / size).max(1) as usize;
        for chunk in keys.chunks(per_batch) {
            let items: Vec<(&[u8], &[u8])> = chunk
                .iter()
                .map(|k| (k.as_slice(), value.as_slice()))
                .collect();
            let codes = client
                .batch_put_from(&items)
                .await
                .context("loading the data set")?;
            if let Some(c) = codes.iter().find(|c| **c != ErrorCode::Ok) {
                bail!("loading {} values: {c:?}", fmt_size(size));
            }
        }
        daemon.loaded.push(size);
    }
    Ok(())
}

/// Gets `depth` keys per round trip (`batch_get_into`) into reused buffers.
pub(crate) struct KvGet {
    client: Client,
    keys: Arc<Vec<Vec<u8>>>,
    next: usize,
    bufs: Vec<Vec<u8>>,
}

impl KvGet {
    /// A loop over `keys` (values of `size`) starting at key `start`.
    pub(crate) fn new(
        client: Client,
        keys: Arc<Vec<Vec<u8>>>,
        size: u64,
        depth: usize,
        start: usize,
    ) -> KvGet {
        KvGet {
            client,
            next: start % keys.len(),
            keys,
            bufs: vec![vec![0u8; size as usize]; depth],
        }
    }
}

impl Worker for KvGet {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let n = self.keys.len();
        let keys: Vec<&[u8]> = (0..self.bufs.len())
            .map(|j| self.keys[(self.next + j) % n].as_slice())
            .collect();
        self.next = (self.next + keys.len()) % n;
        let mut dsts: Vec<&mut [u8]> = self.bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let got = self.client.batch_get_into(&keys, &mut dsts).await?;
        got.iter().try_fold(0u64, |acc, g| {
            g.map(|len| acc + len as u64)
                .ok_or_else(|| anyhow!("kvpool miss during the benchmark"))
        })
    }
}

/// Puts one value per round trip, cycling over a few keys of its own.
pub(crate) struct KvPut {
    client: Client,
    keys: Vec<Vec<u8>>,
    next: usize,
    value: Arc<Vec<u8>>,
}

impl KvPut {
    /// A put loop for worker number `worker`.
    pub(crate) fn new(client: Client, value: Arc<Vec<u8>>, worker: usize) -> KvPut {
        KvPut {
            client,
            keys: put_keys(value.len() as u64, worker),
            next: 0,
            value,
        }
    }
}

impl Worker for KvPut {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let key = &self.keys[self.next];
        self.next = (self.next + 1) % self.keys.len();
        self.client.put(key, &self.value).await?;
        Ok(self.value.len() as u64)
    }
}
