//! `kvpool-bench soak`: the soak. One kvpoold with a pool smaller than the keys' values
//! (so it runs full and evicts the whole time) under a mixed load at saturation for
//! `--minutes`, sampled every `--sample-every` seconds; then the verdict whether the daemon's
//! resident memory, open descriptors and pending allocations stayed flat after the warm-up.
//!
//! The load: `--clients` tasks, alternately on the same-host path and over TCP, each looping
//! without pause over a weighted mix of put, get, batch_get_into, exists, remove, batch_put_from,
//! save_prefix, load_prefix and two-phase puts (alloc, write, then commit; one in ten aborted,
//! one in ten abandoned after a partial write, which the daemon's reaper must reclaim after
//! `pending_timeout_ms`). Value sizes run from 4 KiB to 2 MiB, skewed towards small ones. One
//! more task keeps opening a client (same-host and TCP in turn), doing a put and a get, and
//! closing it again.
//!
//! Every value describes itself: its first 32 bytes hold the xxh3 of its key, the xxh3 of the
//! rest of the value, its length and a per-write seed; the body is derived from the seed. So a
//! read is checked completely: the bytes are a value some put wrote for that key, or the read is
//! a miss. Anything else is counted as wrong (the goal: none).
//!
//! Each sample reads the daemon's VmRSS and RssAnon (/proc/PID/status), its open descriptors
//! (/proc/PID/fd) and its Prometheus gauges (pending allocations, connections, objects, used
//! bytes, evictions, reaped allocations), and the load's operations since the last sample.
//!
//! Bounded: the load stops at the deadline; the drain afterwards waits at most the pending
//! timeout plus 10 s. Nothing here asserts on time.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvpool_bench::replay::synth::Rng;
use kvpool_bench::units::{self, fmt_size};
use kvpool_client::{Client, ClientConfig, ClientError, ErrorCode, Prefix, SameHost};
use serde_json::json;
use xxhash_rust::xxh3::xxh3_64;

use crate::perf::daemon::{self, Daemon};
use crate::perf::machine::Machine;
use crate::perf::render::table;

/// Smallest value.
const MIN_SIZE: usize = 4 << 10;

/// Largest value.
const MAX_SIZE: usize = 2 << 20;

/// Keys of one batch_get_into and of one batch_put_from.
const BATCH: usize = 8;

/// Distinct prefixes, blocks per prefix and bytes per block of save_prefix / load_prefix.
const PREFIXES: u64 = 512;
const PREFIX_BLOCKS: usize = 4;
const PREFIX_BLOCK: usize = 64 << 10;

/// Bytes of a value's self-description.
const HEADER: usize = 32;

/// Most distinct error messages kept for the report.
const ERROR_KINDS: usize = 32;

/// Flatness thresholds (stated in the report).
const RSS_FRACTION: f64 = 0.02;
const RSS_SLACK: f64 = 16.0 * 1048576.0;
const FD_RANGE: f64 = 16.0;
const FD_DRIFT: f64 = 8.0;
const PENDING_DRIFT_FRACTION: f64 = 0.25;

/// Flags of `kvpool-bench soak`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct SoakArgs {
    /// Length of the load in minutes.
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Length of the load in seconds instead of --minutes (short checks).
    #[arg(long)]
    seconds: Option<u64>,
    /// Pool size of the daemon (B, KiB, MiB, GiB); the keys' values take about twice as much,
    /// so it runs full and evicts.
    #[arg(long, default_value = "1GiB", value_parser = units::parse_size)]
    memory: u64,
    /// Client tasks at saturation, alternately same-host and TCP (plus one task that keeps
    /// opening and closing clients).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10)]
    sample_every: u64,
    /// Samples before this many seconds are the warm-up and not judged (at most half the
    /// run).
    #[arg(long, default_value_t = 120)]
    warmup: u64,
    /// The daemon's `[memory] pending_timeout_ms`: abandoned allocations are reclaimed after it.
    #[arg(long, default_value_t = 30_000)]
    pending_timeout_ms: u64,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

impl SoakArgs {
    fn duration(&self) -> Duration {
        match self.seconds {
            Some(s) => Duration::from_secs(s),
            None => Duration::from_secs_f64(self.minutes * 60.0),
        }
    }
}

/// The load's operations.
#[derive(Clone, Copy, Debug)]
enum Op {
    Put,
    Get,
    BatchGet,
    Exists,
    Remove,
    BatchPut,
    SavePrefix,
    LoadPrefix,
    Commit,
    Abort,
    Abandon,
    Churn,
}

const OPS: [Op; 12] = [
    Op::Put,
    Op::Get,
    Op::BatchGet,
    Op::Exists,
    Op::Remove,
    Op::BatchPut,
    Op::SavePrefix,
    Op::LoadPrefix,
    Op::Commit,
    Op::Abort,
    Op::Abandon,
    Op::Churn,
];

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::BatchGet => "batch_get_into",
            Op::Exists => "exists",
            Op::Remove => "remove",
            Op::BatchPut => "batch_put_from",
            Op::SavePrefix => "save_prefix",
            Op::LoadPrefix => "load_prefix",
            Op::Commit => "alloc+write+commit",
            Op::Abort => "alloc+write+abort",
            Op::Abandon => "alloc+write, abandoned",
            Op::Churn => "connect+put+get+close",
        }
    }
}

/// Counters every task adds to.
#[derive(Default)]
struct Stats {
    ops: [AtomicU64; OPS.len()],
    errors: [AtomicU64; OPS.len()],
    /// Values read and checked.
    hits: AtomicU64,
    misses: AtomicU64,
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
    wrong: AtomicU64,
    wrong_bytes: AtomicU64,
    error_kinds: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    fn total_ops(&self) -> u64 {
        self.ops.iter().map(|c| c.load(Relaxed)).sum()
    }

    fn total_errors(&self) -> u64 {
        self.errors.iter().map(|c| c.load(Relaxed)).sum()
    }

    fn record(&self, op: Op, r: Result<(), ClientError>) {
        self.ops[op as usize].fetch_add(1, Relaxed);
        if let Err(e) = r {
            self.error(op, &e.to_string());
        }
    }

    fn error(&self, op: Op, what: &str) {
        self.errors[op as usize].fetch_add(1, Relaxed);
        let mut kinds = self.error_kinds.lock().unwrap_or_else(|e| e.into_inner());
        let key = format!(
            "{}: {}",
            op.name(),
            what.chars().take(100).collect::<String>()
        );
        if kinds.len() < ERROR_KINDS || kinds.contains_key(&key) {
            *kinds.entry(key).or_default() += 1;
        }
    }

    /// Counts one read of `key`: a miss (`None`) or bytes that must be a value written for it.
    fn check(&self, key: &[u8], got: Option<&[u8]>) {
        match got {
            None => {
                self.misses.fetch_add(1, Relaxed);
            }
            Some(v) => {
                self.hits.fetch_add(1, Relaxed);
                self.read_bytes.fetch_add(v.len() as u64, Relaxed);
                if !valid(key, v) {
                    self.wrong.fetch_add(1, Relaxed);
                    self.wrong_bytes.fetch_add(v.len() as u64, Relaxed);
                }
            }
        }
    }
}

/// 4 KiB .. 2 MiB, skewed towards small: the power of two is geometric (each size class 0.6
/// times as likely as the one below), then anywhere up to twice that.
fn size(rng: &mut Rng) -> usize {
    let mut class = 0;
    while class < 9 && rng.below(10) < 6 {
        class += 1;
    }
    let base = MIN_SIZE << class;
    (base + rng.below(base as u64) as usize).min(MAX_SIZE)
}

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

/// Writes a self-describing value for `key` of `len` bytes into `v`.
fn fill(v: &mut Vec<u8>, key: &[u8], seed: u64, len: usize) {
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
fn valid(key: &[u8], v: &[u8]) -> bool {
    let word = |i: usize| u64::from_le_bytes(v[i..i + 8].try_into().expect("8 bytes"));
    v.len() >= HEADER
        && word(0) == xxh3_64(key)
        && word(16) == v.len() as u64
        && word(8) == xxh3_64(&v[16..])
}

/// The length a self-describing value in `buf` claims (for load_prefix, which returns counts).
fn claimed_len(buf: &[u8]) -> usize {
    let n = u64::from_le_bytes(buf[16..24].try_into().expect("8 bytes"));
    usize::try_from(n).map_or(buf.len(), |n| n.clamp(HEADER, buf.len()))
}

/// What the tasks share.
struct Plan {
    keys: u64,
    stats: Stats,
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
        let pick = self.rng.below(100);
        let plan = self.plan.clone();
        let stats = &plan.stats;
        match pick {
            0..=21 => {
                let k = self.random_key();
                let len = size(&mut self.rng);
                self.new_value(0, &k, len);
                (Op::Put, self.client.put(&k, &self.values[0]).await)
            }
            22..=45 => {
                let k = self.random_key();
                let r = self.client.get(&k).await.map(|v| {
                    self.plan.stats.check(&k, v.as_deref());
                });
                (Op::Get, r)
            }
            46..=55 => {
                let keys: Vec<Vec<u8>> = (0..BATCH).map(|_| self.random_key()).collect();
                let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                let mut dsts: Vec<&mut [u8]> = self.bufs.iter_mut().map(|b| &mut b[..]).collect();
                let r = self.client.batch_get_into(&refs, &mut dsts).await;
                drop(dsts);
                let r = r.map(|lens| {
                    for ((k, len), buf) in keys.iter().zip(lens).zip(&self.bufs) {
                        stats.check(k, len.map(|n| &buf[..n.min(buf.len())]));
                    }
                });
                (Op::BatchGet, r)
            }
            56..=63 => {
                let k = self.random_key();
                (Op::Exists, self.client.exists(&k).await.map(|_| ()))
            }
            64..=67 => {
                let k = self.random_key();
                (Op::Remove, self.client.remove(&k).await.map(|_| ()))
            }
            68..=73 => {
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
                let r = self.client.batch_put_from(&items).await.map(|codes| {
                    for c in codes.into_iter().filter(|c| *c != ErrorCode::Ok) {
                        stats.error(Op::BatchPut, &format!("item {c:?}"));
                    }
                });
                (Op::BatchPut, r)
            }
            74..=78 => {
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
                (Op::SavePrefix, r.map(|_| ()))
            }
            79..=85 => {
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
                let r = r.map(|n| {
                    for (k, buf) in keys.iter().zip(&self.bufs).take(n) {
                        let buf = &buf[..PREFIX_BLOCK];
                        stats.check(k, Some(&buf[..claimed_len(buf)]));
                    }
                    if n < PREFIX_BLOCKS {
                        stats.misses.fetch_add(1, Relaxed);
                    }
                });
                (Op::LoadPrefix, r)
            }
            _ => self.two_phase().await,
        }
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

/// One sample of the daemon and the load.
#[derive(Clone, Debug)]
struct Sample {
    t_s: f64,
    rss: u64,
    rss_anon: u64,
    fds: u64,
    pending: f64,
    connections: f64,
    objects: f64,
    used: f64,
    evictions: f64,
    reaped: f64,
    ops: u64,
    ops_s: f64,
    hits: u64,
    misses: u64,
    wrong: u64,
    errors: u64,
}

impl Sample {
    fn json(&self) -> serde_json::Value {
        json!({
            "t_s": self.t_s,
            "rss_bytes": self.rss,
            "rss_anon_bytes": self.rss_anon,
            "fds": self.fds,
            "pending_allocations": self.pending,
            "connections": self.connections,
            "objects": self.objects,
            "used_bytes": self.used,
            "evictions": self.evictions,
            "reaped": self.reaped,
            "ops": self.ops,
            "ops_per_s": self.ops_s,
            "hits": self.hits,
            "misses": self.misses,
            "wrong": self.wrong,
            "errors": self.errors,
        })
    }
}

/// A field of /proc/PID/status, in bytes.
fn proc_status(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(field)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib << 10)
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// The daemon's /metrics, as series (`name{labels}`) to values.
fn scrape(addr: &str) -> anyhow::Result<HashMap<String, f64>> {
    let mut s = std::net::TcpStream::connect(addr).with_context(|| format!("metrics at {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    let (_, body) = body.split_once("\r\n\r\n").context("no HTTP body")?;
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect())
}

/// Sum of the series of metric `name` whose labels contain `label` (empty: all).
fn metric(m: &HashMap<String, f64>, name: &str, label: &str) -> f64 {
    m.iter()
        .filter(|(series, _)| {
            let (n, labels) = series.split_once('{').unwrap_or((series, ""));
            n == name && labels.contains(label)
        })
        .map(|(_, v)| v)
        .sum()
}

/// Sample-taking state.
struct Sampler {
    pid: u32,
    metrics: String,
    began: Instant,
    last: Option<(Instant, u64)>,
}

impl Sampler {
    fn take(&mut self, stats: &Stats) -> anyhow::Result<Sample> {
        let m = scrape(&self.metrics)?;
        let now = Instant::now();
        let ops = stats.total_ops();
        let ops_s = match self.last {
            Some((t, n)) => (ops - n) as f64 / now.duration_since(t).as_secs_f64(),
            None => 0.0,
        };
        self.last = Some((now, ops));
        Ok(Sample {
            t_s: now.duration_since(self.began).as_secs_f64(),
            rss: proc_status(self.pid, "VmRSS"),
            rss_anon: proc_status(self.pid, "RssAnon"),
            fds: open_fds(self.pid),
            pending: metric(&m, "kvpool_pending_allocations", ""),
            connections: metric(&m, "kvpool_connections", ""),
            objects: metric(&m, "kvpool_objects", ""),
            used: metric(&m, "kvpool_segment_bytes", "state=\"used\""),
            evictions: metric(&m, "kvpool_evictions_total", ""),
            reaped: metric(&m, "kvpool_reaped_total", ""),
            ops,
            ops_s,
            hits: stats.hits.load(Relaxed),
            misses: stats.misses.load(Relaxed),
            wrong: stats.wrong.load(Relaxed),
            errors: stats.total_errors(),
        })
    }
}

/// A gauge over the judged samples: its spread, its least-squares slope, and the verdict.
struct Judged {
    name: &'static str,
    min: f64,
    max: f64,
    mean: f64,
    /// Per minute.
    slope: f64,
    /// Slope times the judged window.
    drift: f64,
    /// None: only the drift is judged.
    range_limit: Option<f64>,
    drift_limit: f64,
    flat: bool,
    rule: String,
}

fn judge(
    name: &'static str,
    points: &[(f64, f64)],
    range_limit: Option<f64>,
    drift_limit: f64,
    rule: String,
) -> Judged {
    let n = points.len() as f64;
    let mean_t = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_t).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_t) * (p.1 - mean)).sum();
    let slope_s = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let window = points.last().map_or(0.0, |p| p.0) - points.first().map_or(0.0, |p| p.0);
    let min = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let max = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let drift = slope_s * window;
    Judged {
        name,
        min,
        max,
        mean,
        slope: slope_s * 60.0,
        drift,
        range_limit,
        drift_limit,
        flat: range_limit.is_none_or(|l| max - min <= l) && drift.abs() <= drift_limit,
        rule,
    }
}

impl Judged {
    fn json(&self) -> serde_json::Value {
        json!({
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "range": self.max - self.min,
            "slope_per_min": self.slope,
            "drift": self.drift,
            "range_limit": self.range_limit,
            "drift_limit": self.drift_limit,
            "flat": self.flat,
            "rule": self.rule,
        })
    }
}

fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / 1048576.0)
}

/// Runs the soak, prints the samples and the verdict, and writes the JSON.
pub(crate) fn run(args: SoakArgs) -> anyhow::Result<()> {
    let duration = args.duration();
    check(&args, duration)?;
    let began_all = Instant::now();
    let machine = Machine::detect();
    eprintln!("kvpool-bench soak — {}", machine.describe());
    let rt = crate::perf::runtime(&machine)?;
    let d = start_daemon(&args)?;
    let mut load = Load::start(&rt, &args, &d, duration)?;
    let plan = load.plan.clone();
    let stats = &plan.stats;
    let mut sampler = Sampler {
        pid: d.pid(),
        metrics: d.metrics.clone(),
        began: Instant::now(),
        last: None,
    };
    let every = Duration::from_secs(args.sample_every);
    let samples = sample_until(&mut sampler, stats, duration, every)?;
    let stopped = load.stop(&rt)?;

    // After the load: every abandoned allocation must be reclaimed within the pending timeout
    // (plus the reaper's period and slack).
    let drain_deadline = stopped + Duration::from_millis(args.pending_timeout_ms + 10_000);
    let mut after = sampler.take(stats)?;
    while after.pending > 0.0 && Instant::now() < drain_deadline {
        std::thread::sleep(Duration::from_millis(250));
        after = sampler.take(stats)?;
    }
    let o = Observed {
        args: &args,
        duration,
        samples,
        after,
        drained_s: stopped.elapsed().as_secs_f64(),
        stats,
        local_paths: load.local_paths,
        keys: plan.keys,
    };
    let v = Verdicts::of(&o);
    let out = o.text(&v);
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    crate::perf::render::publish(&out, began_all, args.json.as_deref(), |cmdline| {
        let doc = o.json(&v, cmdline, &machine, &loadavg);
        let mut s = serde_json::to_string_pretty(&doc).expect("a Value always serialises");
        s.push('\n');
        s
    })?;
    drop(d);
    Ok(())
}

/// Refuses flags the soak can't run with.
fn check(args: &SoakArgs, duration: Duration) -> anyhow::Result<()> {
    ensure!(args.clients > 0, "--clients must be positive");
    ensure!(args.sample_every > 0, "--sample-every must be positive");
    ensure!(
        duration.as_secs() >= 2 * args.sample_every,
        "the run must last at least two sample intervals"
    );
    ensure!(
        args.memory >= 64 << 20,
        "--memory must be at least 64MiB (values are up to 2 MiB)"
    );
    Ok(())
}

/// Starts the daemon under test with the flags' memory and pending timeout.
fn start_daemon(args: &SoakArgs) -> anyhow::Result<Daemon> {
    let cfg_dir = daemon::scratch_dir("kvpool-bench-soak")?;
    let cfg_path = cfg_dir.join("kvpoold.toml");
    std::fs::write(
        &cfg_path,
        format!(
            "[memory]\npending_timeout_ms = {}\n",
            args.pending_timeout_ms
        ),
    )?;
    let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
    eprintln!(
        "  starting {} with {}",
        bin.display(),
        fmt_size(args.memory)
    );
    let started = Daemon::start_with(
        &bin,
        args.memory,
        &["--config".to_string(), cfg_path.display().to_string()],
    );
    let _ = std::fs::remove_dir_all(&cfg_dir);
    let d = started?;
    ensure!(
        !d.metrics.is_empty() && d.metrics != "off",
        "kvpoold serves no metrics"
    );
    Ok(d)
}

/// The load's tasks, running.
struct Load {
    plan: Arc<Plan>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Clients on the same-host path.
    local_paths: usize,
}

impl Load {
    /// Connects the clients and starts their loops and the reconnecting task on `rt`.
    fn start(
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
    fn stop(&mut self, rt: &tokio::runtime::Runtime) -> anyhow::Result<Instant> {
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

/// Samples every `every` from the start of `sampler` for `duration`, printing each sample.
fn sample_until(
    sampler: &mut Sampler,
    stats: &Stats,
    duration: Duration,
    every: Duration,
) -> anyhow::Result<Vec<Sample>> {
    let n = (duration.as_secs_f64() / every.as_secs_f64()).floor() as u32;
    let mut samples = Vec::new();
    for k in 0..=n {
        let at = sampler.began + every * k;
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        let s = sampler.take(stats)?;
        eprintln!(
            "  t={:>5.0}s  rss {:>10}  fds {:>4}  pending {:>5}  ops/s {:>8.0}  wrong {}",
            s.t_s,
            mib(s.rss as f64),
            s.fds,
            s.pending,
            s.ops_s,
            s.wrong
        );
        samples.push(s);
    }
    Ok(samples)
}

/// What a finished run observed.
struct Observed<'a> {
    args: &'a SoakArgs,
    duration: Duration,
    samples: Vec<Sample>,
    /// The last sample, once the load stopped and the pending allocations drained (or the
    /// drain's deadline passed).
    after: Sample,
    /// Seconds from stopping the load to `after`.
    drained_s: f64,
    stats: &'a Stats,
    local_paths: usize,
    keys: u64,
}

/// The verdicts over the samples from the warm-up on.
struct Verdicts {
    /// Samples before this many seconds are not judged.
    warmup: f64,
    rss: Judged,
    rss_anon: Judged,
    fds: Judged,
    pending: Judged,
    /// The pending allocations fell to at most one per client once the load stopped.
    drained: bool,
    wrong: u64,
    met: bool,
}

impl Verdicts {
    fn of(o: &Observed<'_>) -> Verdicts {
        let args = o.args;
        let warmup = (args.warmup as f64).min(o.duration.as_secs_f64() / 2.0);
        let judged: Vec<&Sample> = o.samples.iter().filter(|s| s.t_s >= warmup - 0.5).collect();
        let pts = |f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
            judged.iter().map(|s| (s.t_s, f(s))).collect()
        };
        let rss_limit = RSS_FRACTION * args.memory as f64 + RSS_SLACK;
        let rss = judge(
            "RSS",
            &pts(&|s| s.rss as f64),
            Some(rss_limit),
            rss_limit,
            format!(
                "max-min and slope x window each <= 2% of the pool + 16 MiB ({})",
                mib(rss_limit)
            ),
        );
        let rss_anon = judge(
            "RssAnon",
            &pts(&|s| s.rss_anon as f64),
            Some(rss_limit),
            rss_limit,
            "as RSS (the heap alone; informative)".into(),
        );
        let fds = judge(
            "open fds",
            &pts(&|s| s.fds as f64),
            Some(FD_RANGE),
            FD_DRIFT,
            format!("max-min <= {FD_RANGE}, |slope x window| <= {FD_DRIFT}"),
        );
        let pend_pts = pts(&|s| s.pending);
        let pend_mean = pend_pts.iter().map(|p| p.1).sum::<f64>() / pend_pts.len() as f64;
        let pend_drift = PENDING_DRIFT_FRACTION * pend_mean + args.clients as f64;
        let mut pending = judge(
            "pending allocations",
            &pend_pts,
            None,
            pend_drift,
            format!(
                "|slope x window| <= 25% of the mean + clients ({pend_drift:.0}), and <= clients ({}) \
                 once the load stops, within pending_timeout_ms + 10 s",
                args.clients
            ),
        );
        let drained = o.after.pending <= args.clients as f64;
        pending.flat &= drained;
        let wrong = o.stats.wrong.load(Relaxed);
        let met = [&rss, &fds, &pending].iter().all(|j| j.flat) && wrong == 0;
        Verdicts {
            warmup,
            rss,
            rss_anon,
            fds,
            pending,
            drained,
            wrong,
            met,
        }
    }
}

impl Observed<'_> {
    /// The report: the samples, the verdicts, the totals.
    fn text(&self, v: &Verdicts) -> String {
        let mut out = format!(
            "soak: {} pool, {} clients + 1 reconnecting, {:.0} s, samples every {} s, judged from {:.0} s\n\n",
            fmt_size(self.args.memory),
            self.args.clients,
            self.duration.as_secs_f64(),
            self.args.sample_every,
            v.warmup
        );
        out += &self.samples_table();
        out += "\n";
        out += &verdicts_table(v);
        out += &self.totals_text(v);
        out += &format!(
            "verdict: {} (RSS {}, fds {}, pending {}, wrong reads {})",
            if v.met { "met" } else { "missed" },
            if v.rss.flat { "flat" } else { "not flat" },
            if v.fds.flat { "flat" } else { "not flat" },
            if v.pending.flat { "flat" } else { "not flat" },
            v.wrong
        );
        out
    }

    /// One row per sample, and the sample after the load.
    fn samples_table(&self) -> String {
        let head = [
            "t (s)",
            "RSS",
            "RssAnon",
            "fds",
            "pending",
            "conns",
            "objects",
            "used",
            "evictions",
            "reaped",
            "ops/s",
            "wrong",
        ];
        let cells: Vec<Vec<String>> = self
            .samples
            .iter()
            .chain(std::iter::once(&self.after))
            .enumerate()
            .map(|(i, s)| {
                vec![
                    if i == self.samples.len() {
                        format!("{:.0} (after)", s.t_s)
                    } else {
                        format!("{:.0}", s.t_s)
                    },
                    mib(s.rss as f64),
                    mib(s.rss_anon as f64),
                    s.fds.to_string(),
                    format!("{:.0}", s.pending),
                    format!("{:.0}", s.connections),
                    format!("{:.0}", s.objects),
                    mib(s.used),
                    format!("{:.0}", s.evictions),
                    format!("{:.0}", s.reaped),
                    format!("{:.0}", s.ops_s),
                    s.wrong.to_string(),
                ]
            })
            .collect();
        table(&head, &cells)
    }

    /// The drain after the load, the operations and their errors, the wrong reads.
    fn totals_text(&self, v: &Verdicts) -> String {
        let stats = self.stats;
        let (hits, misses) = (stats.hits.load(Relaxed), stats.misses.load(Relaxed));
        let mut out = format!(
            "\n  after the load: pending {:.0} after {:.1} s ({} allocations reaped in all)\n",
            self.after.pending, self.drained_s, self.after.reaped
        );
        let total = stats.total_ops();
        out += &format!(
            "  operations {total} ({:.0}/s), errors {}, reads checked {} ({} hits, {} misses), \
             {} read, {} written\n",
            total as f64 / self.duration.as_secs_f64(),
            stats.total_errors(),
            hits + misses,
            hits,
            misses,
            mib(stats.read_bytes.load(Relaxed) as f64),
            mib(stats.written_bytes.load(Relaxed) as f64),
        );
        let op_cells: Vec<Vec<String>> = OPS
            .iter()
            .map(|op| {
                vec![
                    op.name().to_string(),
                    stats.ops[*op as usize].load(Relaxed).to_string(),
                    stats.errors[*op as usize].load(Relaxed).to_string(),
                ]
            })
            .collect();
        out += &table(&["operation", "count", "errors"], &op_cells);
        for (k, n) in &self.error_kinds() {
            out += &format!("  error x{n}: {k}\n");
        }
        out += &format!(
            "  wrong reads: {} ({} bytes)\n",
            v.wrong,
            stats.wrong_bytes.load(Relaxed)
        );
        out
    }

    /// The distinct error messages, with how often each came.
    fn error_kinds(&self) -> BTreeMap<String, u64> {
        self.stats
            .error_kinds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The JSON document of the run.
    fn json(
        &self,
        v: &Verdicts,
        cmdline: &str,
        machine: &Machine,
        loadavg: &str,
    ) -> serde_json::Value {
        let (args, stats) = (self.args, self.stats);
        json!({
            "command": cmdline,
            "machine": machine.json(),
            "loadavg_end": loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
            "memory": args.memory,
            "clients": args.clients,
            "same_host_clients": self.local_paths,
            "keys": self.keys,
            "duration_s": self.duration.as_secs_f64(),
            "sample_every_s": args.sample_every,
            "warmup_s": v.warmup,
            "pending_timeout_ms": args.pending_timeout_ms,
            "samples": self.samples.iter().map(Sample::json).collect::<Vec<_>>(),
            "after": {
                "sample": self.after.json(),
                "secs_after_stop": self.drained_s,
                "drained": v.drained,
            },
            "verdict": {
                "rss": v.rss.json(),
                "rss_anon": v.rss_anon.json(),
                "fds": v.fds.json(),
                "pending": v.pending.json(),
                "wrong": v.wrong,
                "met": v.met,
            },
            "totals": {
                "ops": stats.total_ops(),
                "errors": stats.total_errors(),
                "hits": stats.hits.load(Relaxed),
                "misses": stats.misses.load(Relaxed),
                "wrong": v.wrong,
                "wrong_bytes": stats.wrong_bytes.load(Relaxed),
                "read_bytes": stats.read_bytes.load(Relaxed),
                "written_bytes": stats.written_bytes.load(Relaxed),
                "by_op": OPS.iter().map(|op| json!({
                    "op": op.name(),
                    "count": stats.ops[*op as usize].load(Relaxed),
                    "errors": stats.errors[*op as usize].load(Relaxed),
                })).collect::<Vec<_>>(),
                "error_kinds": self.error_kinds(),
            },
        })
    }
}

/// One row per judged gauge.
fn verdicts_table(v: &Verdicts) -> String {
    let vcells: Vec<Vec<String>> = [&v.rss, &v.rss_anon, &v.fds, &v.pending]
        .iter()
        .map(|j| {
            let fmt = |x: f64| {
                if j.name.starts_with("R") {
                    mib(x)
                } else {
                    format!("{x:.1}")
                }
            };
            vec![
                j.name.to_string(),
                fmt(j.min),
                fmt(j.max),
                fmt(j.max - j.min),
                format!("{}/min", fmt(j.slope)),
                if j.name == "RssAnon" {
                    "-".into()
                } else if j.flat {
                    "flat".into()
                } else {
                    "NOT flat".into()
                },
                j.rule.clone(),
            ]
        })
        .collect();
    table(
        &["gauge", "min", "max", "max-min", "slope", "verdict", "rule"],
        &vcells,
    )
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

    #[test]
    fn a_steady_gauge_is_flat_and_a_growing_one_is_not() {
        let steady: Vec<(f64, f64)> = (0..10).map(|i| (i as f64 * 10.0, 100.0)).collect();
        assert!(judge("x", &steady, Some(1.0), 1.0, String::new()).flat);
        let growing: Vec<(f64, f64)> = (0..10).map(|i| (i as f64 * 10.0, i as f64)).collect();
        let j = judge("x", &growing, Some(100.0), 1.0, String::new());
        assert!(!j.flat);
        assert!((j.slope - 6.0).abs() < 1e-9);
    }
}
