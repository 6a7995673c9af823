//! The load: client tasks at saturation over a weighted mix of operations, alternately on the
//! same-host path and over TCP, and one task that keeps opening and closing clients.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_bench::replay::synth::Rng;
use kvpool_client::{Client, ClientConfig, ClientError, ErrorCode, Prefix, SameHost};
use xxhash_rust::xxh3::xxh3_64;

use super::ops::{Op, Stats};
use super::value::{claimed_len, fill, size, MAX_SIZE, MIN_SIZE};
use super::SoakArgs;
use crate::perf::daemon::Daemon;

/// Keys of one batch_get_into and of one batch_put_from.
const BATCH: usize = 8;

/// Distinct prefixes, blocks per prefix and bytes per block of save_prefix / load_prefix.
const PREFIXES: u64 = 512;
const PREFIX_BLOCKS: usize = 4;
const PREFIX_BLOCK: usize = 64 << 10;

/// Clients alternate between the same-host path (even `n`) and TCP only (odd).
fn alternating(n: u64) -> ClientConfig {
    ClientConfig {
        same_host: if n % 2 == 0 {
            SameHost::Auto
        } else {
            SameHost::Off
        },
        ..ClientConfig::default()
    }
}

/// What the tasks share.
pub(super) struct Plan {
    pub(super) keys: u64,
    pub(super) stats: Stats,
    stop: AtomicBool,
    endpoint: String,
}

fn key(i: u64) -> Vec<u8> {
    format!("soak/{i:08}").into_bytes()
}

fn prefix_keys(p: u64) -> Vec<Vec<u8>> {
    (0..PREFIX_BLOCKS)
        .map(|b| format!("soak/prefix/{p:04}/{b}").into_bytes())
        .collect()
}

/// One client task's state.
struct Worker {
    client: Client,
    plan: Arc<Plan>,
    rng: Rng,
    bufs: Vec<Vec<u8>>,
    values: Vec<Vec<u8>>,
}

impl Worker {
    fn random_key(&mut self) -> Vec<u8> {
        key(self.rng.below(self.plan.keys))
    }

    fn new_value(&mut self, slot: usize, k: &[u8], len: usize) {
        let seed = self.rng.next_u64();
        fill(&mut self.values[slot], k, seed, len);
        self.plan.stats.written_bytes.fetch_add(len as u64, Relaxed);
    }

    async fn run(mut self) {
        while !self.plan.stop.load(Relaxed) {
            let (op, r) = self.step().await;
            self.plan.stats.record(op, r);
        }
    }

    /// One operation, picked by weight.
    async fn step(&mut self) -> (Op, Result<(), ClientError>) {
        match self.rng.below(100) {
            0..=21 => (Op::Put, self.put().await),
            22..=45 => (Op::Get, self.get().await),
            46..=55 => (Op::BatchGet, self.batch_get().await),
            56..=63 => {
                let k = self.random_key();
                (Op::Exists, self.client.exists(&k).await.map(|_| ()))
            }
            64..=67 => {
                let k = self.random_key();
                (Op::Remove, self.client.remove(&k).await.map(|_| ()))
            }
            68..=73 => (Op::BatchPut, self.batch_put().await),
            74..=78 => (Op::SavePrefix, self.save_prefix().await),
            79..=85 => (Op::LoadPrefix, self.load_prefix().await),
            _ => self.two_phase().await,
        }
    }

    /// A put of a new value under a random key.
    async fn put(&mut self) -> Result<(), ClientError> {
        let k = self.random_key();
        let len = size(&mut self.rng);
        self.new_value(0, &k, len);
        self.client.put(&k, &self.values[0]).await
    }

    /// A get of a random key, its value checked.
    async fn get(&mut self) -> Result<(), ClientError> {
        let k = self.random_key();
        self.client.get(&k).await.map(|v| {
            self.plan.stats.check(&k, v.as_deref());
        })
    }

    /// A batch_get_into of random keys, every value checked.
    async fn batch_get(&mut self) -> Result<(), ClientError> {
        let plan = self.plan.clone();
        let stats = &plan.stats;
        let keys: Vec<Vec<u8>> = (0..BATCH).map(|_| self.random_key()).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let mut dsts: Vec<&mut [u8]> = self.bufs.iter_mut().map(|b| &mut b[..]).collect();
        let r = self.client.batch_get_into(&refs, &mut dsts).await;
        drop(dsts);
        r.map(|lens| {
            for ((k, len), buf) in keys.iter().zip(lens).zip(&self.bufs) {
                stats.check(k, len.map(|n| &buf[..n.min(buf.len())]));
            }
        })
    }

    /// A batch_put_from of new values under random keys; an item refused counts as an error.
    async fn batch_put(&mut self) -> Result<(), ClientError> {
        let plan = self.plan.clone();
        let stats = &plan.stats;
        let keys: Vec<Vec<u8>> = (0..BATCH / 2).map(|_| self.random_key()).collect();
        for (i, k) in keys.iter().enumerate() {
            let len = size(&mut self.rng);
            self.new_value(i, k, len);
        }
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&self.values)
            .map(|(k, v)| (&k[..], &v[..]))
            .collect();
        self.client.batch_put_from(&items).await.map(|codes| {
            for c in codes.into_iter().filter(|c| *c != ErrorCode::Ok) {
                stats.error(Op::BatchPut, &format!("item {c:?}"));
            }
        })
    }

    /// A save_prefix of new blocks under a random prefix's keys.
    async fn save_prefix(&mut self) -> Result<(), ClientError> {
        let keys = prefix_keys(self.rng.below(PREFIXES));
        for (i, k) in keys.iter().enumerate() {
            self.new_value(i, k, PREFIX_BLOCK);
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let blocks: Vec<&[u8]> = self.values[..PREFIX_BLOCKS]
            .iter()
            .map(|v| &v[..])
            .collect();
        let r = self.client.save_prefix(Prefix::Keys(&refs), &blocks).await;
        r.map(|_| ())
    }

    /// A load_prefix of a random prefix, every block found checked; a short run counts as a
    /// miss.
    async fn load_prefix(&mut self) -> Result<(), ClientError> {
        let plan = self.plan.clone();
        let stats = &plan.stats;
        let keys = prefix_keys(self.rng.below(PREFIXES));
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let mut dsts: Vec<&mut [u8]> = self.bufs[..PREFIX_BLOCKS]
            .iter_mut()
            .map(|b| &mut b[..PREFIX_BLOCK])
            .collect();
        let r = self
            .client
            .load_prefix(Prefix::Keys(&refs), &mut dsts)
            .await;
        drop(dsts);
        r.map(|n| {
            for (k, buf) in keys.iter().zip(&self.bufs).take(n) {
                let buf = &buf[..PREFIX_BLOCK];
                stats.check(k, Some(&buf[..claimed_len(buf)]));
            }
            if n < PREFIX_BLOCKS {
                stats.misses.fetch_add(1, Relaxed);
            }
        })
    }

    /// Alloc and write, then commit; one in ten aborted, one in ten abandoned half-written.
    async fn two_phase(&mut self) -> (Op, Result<(), ClientError>) {
        let k = self.random_key();
        let len = size(&mut self.rng);
        self.new_value(0, &k, len);
        let fate = self.rng.below(10);
        let op = match fate {
            0 => Op::Abandon,
            1 => Op::Abort,
            _ => Op::Commit,
        };
        let c = &self.client;
        let v = &self.values[0];
        let r = async {
            let addr = c.alloc(&k, len as u64).await?;
            match op {
                Op::Abandon => c.write(&addr, 0, &v[..len / 2]).await,
                Op::Abort => {
                    c.write(&addr, 0, v).await?;
                    c.abort(&addr).await
                }
                _ => {
                    c.write(&addr, 0, v).await?;
                    c.commit(&addr, xxh3_64(v)).await
                }
            }
        }
        .await;
        (op, r)
    }
}

/// Opens a client (same-host and TCP in turn), puts and gets one small value, closes it;
/// again and again.
async fn churn(plan: Arc<Plan>) {
    let mut rng = Rng::new(0xc4a2);
    let mut value = Vec::new();
    let mut turn = 0u64;
    while !plan.stop.load(Relaxed) {
        turn += 1;
        let cfg = alternating(turn);
        let k = key(rng.below(plan.keys));
        let len = MIN_SIZE + rng.below(60 << 10) as usize;
        fill(&mut value, &k, rng.next_u64(), len);
        let r = async {
            let c = Client::connect(&plan.endpoint, cfg).await?;
            c.put(&k, &value).await?;
            let got = c.get(&k).await?;
            plan.stats.check(&k, got.as_deref());
            Ok(())
        }
        .await;
        plan.stats.record(Op::Churn, r);
    }
}

/// The load's tasks, running.
pub(super) struct Load {
    pub(super) plan: Arc<Plan>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Clients on the same-host path.
    pub(super) local_paths: usize,
}

impl Load {
    /// Connects the clients and starts their loops and the reconnecting task on `rt`.
    pub(super) fn start(
        rt: &tokio::runtime::Runtime,
        args: &SoakArgs,
        d: &Daemon,
        duration: Duration,
    ) -> anyhow::Result<Load> {
        // About twice the pool in values of the mean size (about 64 KiB).
        let keys = (2 * args.memory / (64 << 10)).max(1024);
        let plan = Arc::new(Plan {
            keys,
            stats: Stats::default(),
            stop: AtomicBool::new(false),
            endpoint: format!("tcp://{}", d.tcp),
        });
        let mut local_paths = 0;
        let mut tasks = Vec::new();
        for i in 0..args.clients {
            let cfg = alternating(i as u64);
            let client = rt.block_on(Client::connect(&plan.endpoint, cfg))?;
            local_paths += usize::from(client.is_local());
            let w = Worker {
                client,
                plan: plan.clone(),
                rng: Rng::new(0x50a6_0000 + i as u64),
                bufs: (0..BATCH).map(|_| vec![0; MAX_SIZE]).collect(),
                values: (0..BATCH).map(|_| Vec::with_capacity(MAX_SIZE)).collect(),
            };
            tasks.push(rt.spawn(w.run()));
        }
        tasks.push(rt.spawn(churn(plan.clone())));
        eprintln!(
            "  {} clients ({local_paths} same-host, {} TCP) and one reconnecting, {} keys, for {:.0} s",
            args.clients,
            args.clients - local_paths,
            keys,
            duration.as_secs_f64()
        );
        Ok(Load {
            plan,
            tasks,
            local_paths,
        })
    }

    /// Stops the load and waits for every task (at most 60 s each); when it stopped.
    pub(super) fn stop(&mut self, rt: &tokio::runtime::Runtime) -> anyhow::Result<Instant> {
        self.plan.stop.store(true, Relaxed);
        let stopped = Instant::now();
        rt.block_on(async {
            for t in self.tasks.drain(..) {
                match tokio::time::timeout(Duration::from_secs(60), t).await {
                    Err(_) => anyhow::bail!("a client task did not stop within 60 s"),
                    Ok(Err(e)) => anyhow::bail!("a client task failed: {e}"),
                    Ok(Ok(())) => {}
                }
            }
            Ok(())
        })?;
        Ok(stopped)
    }
}
