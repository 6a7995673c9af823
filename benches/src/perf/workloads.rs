//! The data sets every section reads (same keys and sizes for kvpool and its baselines) and the
//! kvpool client loops driven by [`run_tasks`](super::driver::run_tasks).

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context};
use kvpool_client::{Client, ClientConfig, ErrorCode};

use super::daemon::Daemon;
use super::driver::Worker;
use kvpool_bench::units::fmt_size;

/// Bytes of values stored per size: 16× the L3 of typical servers, so reads come from DRAM.
pub(crate) const WORKING_SET: u64 = 512 << 20;

/// Pipelining (batching) depth of the "depth 8" variants.
pub(crate) const DEPTH: usize = 8;

/// Most distinct keys one put loop cycles through.
const PUT_KEYS: usize = 32;

/// Most bytes the put loops of one size keep stored, all connections together (fewer keys per
/// loop for large values and many connections), so puts never crowd out the data sets.
const PUT_BYTES: u64 = 512 << 20;

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

/// How many keys each of `conns` put loops of values of `size` cycles through.
pub(crate) fn put_keys_per_loop(size: u64, conns: usize) -> usize {
    (PUT_BYTES / size.max(1) / conns.max(1) as u64).clamp(1, PUT_KEYS as u64) as usize
}

/// Keys a put loop (`worker` of `conns`) overwrites in turn: its own run of one shared
/// numbering, so all measurements of a size together touch at most `PUT_BYTES` of values.
pub(crate) fn put_keys(size: u64, worker: usize, conns: usize) -> Vec<Vec<u8>> {
    let n = put_keys_per_loop(size, conns);
    (worker * n..(worker + 1) * n)
        .map(|i| put_key(size, i))
        .collect()
}

/// Put key number `i` of values of `size`.
fn put_key(size: u64, i: usize) -> Vec<u8> {
    format!("bench-put/{size}/{i:06}").into_bytes()
}

/// Every key the put loops of values of `size` write with any of `conns` connections. They
/// are stored with the data set, so that every measured put, in every system, overwrites a
/// value already there instead of filling memory never touched before.
pub(crate) fn all_put_keys(size: u64, conns: &[usize]) -> Vec<Vec<u8>> {
    let n = conns
        .iter()
        .map(|&c| c * put_keys_per_loop(size, c))
        .max()
        .unwrap_or(0);
    (0..n).map(|i| put_key(size, i)).collect()
}

/// Every key stored for `size`: the data set, then the put loops' keys.
pub(crate) fn stored_keys(size: u64, conns: &[usize]) -> Vec<Vec<u8>> {
    let mut all = keys(size).to_vec();
    all.extend(all_put_keys(size, conns));
    all
}

/// Bytes of values a run with `sizes` and `conns` stores in each system: every data set plus
/// every key the put loops write.
pub(crate) fn stored_bytes(sizes: &[u64], conns: &[usize]) -> u64 {
    sizes
        .iter()
        .map(|&size| stored_keys(size, conns).len() as u64 * size)
        .sum()
}

/// Receive buffers of one connection slot. The contenders of a comparison run in alternating
/// slices, never at once, so the n-th connection of each of them can share one set: the
/// memory of a shape is that of one contender (a 32 MiB depth-8 get on 16 connections needs
/// 4 GiB per set), and every contender's values land in the same, already faulted-in pages.
#[derive(Clone, Default)]
pub(crate) struct Buffers(Arc<Mutex<Vec<Vec<u8>>>>);

impl Buffers {
    /// Takes `depth` buffers of `size` bytes for one operation (allocated on first use, which
    /// falls in the unrecorded start of a window); hand them back with [`Buffers::put`].
    pub(crate) fn take(&self, depth: usize, size: usize) -> Vec<Vec<u8>> {
        let mut bufs = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        bufs.resize_with(depth, Vec::new);
        for b in &mut bufs {
            b.resize(size, 0);
        }
        bufs
    }

    /// Returns the buffers taken for an operation.
    pub(crate) fn put(&self, bufs: Vec<Vec<u8>>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = bufs;
    }
}

/// A value of `size` bytes of incompressible noise.
pub(crate) fn value(size: u64) -> Arc<Vec<u8>> {
    let mut v = vec![0u8; size as usize];
    fill_noise(&mut v);
    Arc::new(v)
}

/// Writes [`value`]'s noise for a value of `buf.len()` bytes into `buf`.
pub(crate) fn fill_noise(buf: &mut [u8]) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ buf.len() as u64;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Stores the data set (and the put keys, see [`all_put_keys`]) of every size in `sizes` not
/// stored yet.
pub(crate) async fn ensure_loaded(
    daemon: &mut Daemon,
    sizes: &[u64],
    conns: &[usize],
) -> anyhow::Result<()> {
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
        let keys = stored_keys(size, conns);
        eprintln!("  loading {} × {} into kvpoold", keys.len(), fmt_size(size));
        store(&client, &keys, size).await?;
        daemon.loaded.push(size);
    }
    Ok(())
}

/// Stores `keys`, each with the value of `size` ([`value`]), in calls of about 32 MiB (the client
/// cuts each to the node's `max_batch` and `max_payload`).
pub(crate) async fn store(client: &Client, keys: &[Vec<u8>], size: u64) -> anyhow::Result<()> {
    let value = value(size);
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
    Ok(())
}

/// Gets `depth` keys per round trip (`batch_get_into`) into reused buffers.
pub(crate) struct KvGet {
    client: Client,
    keys: Arc<Vec<Vec<u8>>>,
    next: usize,
    size: usize,
    depth: usize,
    bufs: Buffers,
}

impl KvGet {
    /// A loop over `keys` (values of `size`) starting at key `start`, receiving into `bufs`.
    pub(crate) fn new(
        client: Client,
        keys: Arc<Vec<Vec<u8>>>,
        size: u64,
        depth: usize,
        start: usize,
        bufs: Buffers,
    ) -> KvGet {
        KvGet {
            client,
            next: start % keys.len(),
            keys,
            size: size as usize,
            depth,
            bufs,
        }
    }
}

impl Worker for KvGet {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let n = self.keys.len();
        let keys: Vec<&[u8]> = (0..self.depth)
            .map(|j| self.keys[(self.next + j) % n].as_slice())
            .collect();
        self.next = (self.next + keys.len()) % n;
        let mut bufs = self.bufs.take(self.depth, self.size);
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let got = self.client.batch_get_into(&keys, &mut dsts).await?;
        drop(dsts);
        self.bufs.put(bufs);
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
    /// A put loop for worker number `worker` of `conns`.
    pub(crate) fn new(client: Client, value: Arc<Vec<u8>>, worker: usize, conns: usize) -> KvPut {
        KvPut {
            client,
            keys: put_keys(value.len() as u64, worker, conns),
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
