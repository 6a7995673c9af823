//! `kvpool-bench tier interference`: a reader's 4 KiB gets of a hot set that stays in DRAM,
//! while writers put large values as fast as they can so that DRAM evicts all the time, on a
//! daemon without a disk tier (a) and on one whose tier takes every eviction (b).
//!
//! Each run starts its own daemon (same DRAM, same load), stores the hot set (pinned, so that
//! it stays in DRAM whatever the policy makes of the load; `--unpinned-hot` leaves it to the
//! policy), reads it a few times, starts the writers, waits until DRAM evicts and the tier has had a moment to fill its queue, then
//! measures the reader for `--window-ms` with the writers still running. Runs come in pairs, a
//! then b, then b then a, and so on, so that a drift of the shared machine's load biases
//! neither side; the figure is each pair's ratio of the reader's p99, b over a. The tier's
//! counters over the window say how fast it demoted and what it dropped; promotions say
//! whether the hot set really stayed in DRAM (a hot get that misses DRAM would read the disk).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use clap::Args;
use kvpool::protocol::DiskTierStats;
use kvpool_bench::units::{self, fmt_ns, fmt_rate, fmt_size};
use kvpool_client::{Client, ClientConfig, ErrorCode, SameHost};

use crate::perf::daemon::{self, Daemon};
use crate::perf::driver::{run_tasks, Measured, Worker};
use crate::perf::machine::Machine;
use crate::perf::machine::{process_ticks, ticks_per_s};
use crate::perf::render::table;
use crate::perf::workloads;

/// The goal: the reader's p99 with the tier demoting at most this times its p99 without it.
const GOAL: f64 = 1.2;

/// Time the writers run past DRAM's first eviction before the reader's window opens.
const LEAD: Duration = Duration::from_millis(500);

/// Reads of each hot key before the writers start.
const HOT_READS: usize = 3;

/// Longest the writers may take to make DRAM evict.
const FILL_TIMEOUT: Duration = Duration::from_secs(60);

/// Flags of `kvpool-bench tier interference`.
#[derive(Args, Debug)]
pub(crate) struct InterferenceArgs {
    /// Pairs of runs (one without the tier, one with it, the order alternating).
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// The reader's measured window in each run, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    window_ms: u64,
    /// DRAM of each daemon (B, KiB, MiB, GiB).
    #[arg(long, default_value = "256MiB", value_parser = units::parse_size)]
    memory: u64,
    /// Value size of the writers' puts.
    #[arg(long, default_value = "1MiB", value_parser = units::parse_size)]
    put_size: u64,
    /// Writer tasks, each on its own connection, each putting new keys back to back.
    #[arg(long, default_value_t = 1)]
    writers: usize,
    /// Caps the writers' puts at this many MB/s (10^6 bytes) all together, so that both sides
    /// of a pair can be held to the same put load [default: as fast as they go].
    #[arg(long)]
    put_mbps: Option<f64>,
    /// Keys of the reader's hot set.
    #[arg(long, default_value_t = 64)]
    hot_keys: usize,
    /// Leave the hot set to the eviction policy instead of pinning it (a hot key the policy
    /// evicts then misses, or comes back from disk, and the misses and promotions say so).
    #[arg(long)]
    unpinned_hot: bool,
    /// Value size of the hot set.
    #[arg(long, default_value = "4KiB", value_parser = units::parse_size)]
    get_size: u64,
    /// The disk tier's capacity in the runs that have one.
    #[arg(long, default_value = "1GiB", value_parser = units::parse_size)]
    disk_capacity: u64,
    /// Bytes of one disk region [default: the daemon's].
    #[arg(long, value_parser = units::parse_size)]
    disk_region_size: Option<u64>,
    /// The demotion queue's bound [default: the daemon's].
    #[arg(long, value_parser = units::parse_size)]
    disk_queue: Option<u64>,
    /// Where the tier's directory goes: a real disk, not tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    disk_dir: PathBuf,
    /// Accept a tmpfs or ramfs --disk-dir: the demotion path's own cost, without a disk's.
    #[arg(long)]
    any_fs: bool,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
}

/// Runs the pairs and prints every run and the ratios.
pub(crate) fn run(args: InterferenceArgs) -> anyhow::Result<()> {
    ensure!(args.pairs > 0, "--pairs must be positive");
    ensure!(
        args.writers > 0 && args.hot_keys > 0,
        "--writers and --hot-keys must be positive"
    );
    ensure!(
        args.hot_keys as u64 * args.get_size < args.memory / 4,
        "the hot set must be a small part of --memory"
    );
    let machine = Machine::detect();
    println!("kvpool-bench tier interference — {}", machine.describe());
    let rt = crate::perf::runtime(&machine)?;
    let pace = args
        .put_mbps
        .map_or("as fast as they go".into(), |m| format!("at {m} MB/s"));
    let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
    let base = super::disk_dir(&args.disk_dir, "interference", args.any_fs)?;
    println!(
        "  disk tier in {} ({}); DRAM {}, {} writer(s) of {} puts {pace}, reader: {} keys \
         of {}, window {} ms; load average {}",
        base.display(),
        super::fs_kind(&base)?,
        fmt_size(args.memory),
        args.writers,
        fmt_size(args.put_size),
        args.hot_keys,
        fmt_size(args.get_size),
        args.window_ms,
        loadavg()
    );
    let result = pairs(&args, &rt, &bin, &base);
    let _ = std::fs::remove_dir_all(&base);
    let runs = result?;
    print!("{}", render(&runs));
    println!("  load average at the end {}", loadavg());
    Ok(())
}

/// The runs of every pair, in the order they ran.
fn pairs(
    args: &InterferenceArgs,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    base: &Path,
) -> anyhow::Result<Vec<RunResult>> {
    let mut runs = Vec::new();
    for pair in 0..args.pairs {
        let order = if pair % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for tier in order {
            let dir = base.join(format!("pair{pair}"));
            let r = one_run(args, rt, bin, tier.then_some(dir.as_path()), pair)?;
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!(
                "  pair {pair}, tier {}: p99 {}, {} demotions/s, {} queue drops",
                if tier { "on" } else { "off" },
                fmt_ns(r.reader.quantile_ns(0.99)),
                fmt_rate(r.per_s(r.disk.demoted)),
                r.disk.queue_drops
            );
            runs.push(r);
        }
    }
    Ok(runs)
}

/// What one run saw over the reader's window.
struct RunResult {
    pair: usize,
    tier: bool,
    reader: Measured,
    misses: u64,
    secs: f64,
    puts: u64,
    put_size: u64,
    evictions: u64,
    /// The tier's counters over the window (all zero without a tier).
    disk: DiskTierStats,
    /// CPU time the daemon took, in cores.
    daemon_cores: f64,
    /// Share of the machine's CPU time that was busy (every process, the kernel's included).
    machine_busy: f64,
}

impl RunResult {
    fn per_s(&self, n: u64) -> f64 {
        n as f64 / self.secs
    }
}

/// One daemon, with the tier in `disk` or without one, loaded and measured.
fn one_run(
    args: &InterferenceArgs,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    disk: Option<&Path>,
    pair: usize,
) -> anyhow::Result<RunResult> {
    let mut extra = Vec::new();
    if let Some(dir) = disk {
        extra.extend([
            "--disk-path".to_string(),
            dir.display().to_string(),
            "--disk-capacity".into(),
            format!("{}MiB", args.disk_capacity >> 20),
            "--disk-admit".into(),
            "all".into(),
        ]);
        if let Some(q) = args.disk_queue {
            extra.extend(["--disk-queue".into(), format!("{q}")]);
        }
        if let Some(r) = args.disk_region_size {
            extra.extend(["--disk-region-size".into(), format!("{r}")]);
        }
    }
    let d = Daemon::start_with(bin, args.memory, &extra)?;
    rt.block_on(measure(args, &d, disk.is_some(), pair))
}

async fn connect(d: &Daemon) -> anyhow::Result<Client> {
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        ..ClientConfig::default()
    };
    Ok(Client::connect(&format!("tcp://{}", d.tcp), cfg).await?)
}

/// The pool's evictions, the tier's counters and CPU time at one moment.
struct Snapshot {
    at: Instant,
    evictions: u64,
    puts: u64,
    disk: DiskTierStats,
    /// The daemon's CPU time (user and system), in clock ticks.
    daemon_ticks: u64,
    /// The machine's busy and total time over all CPUs, in clock ticks.
    machine: (u64, u64),
}

async fn snapshot(c: &Client, puts: &AtomicU64, pid: u32) -> anyhow::Result<Snapshot> {
    let evictions = c.stats().await?.evictions;
    let disk = c.disk_stats().await?.unwrap_or_default();
    Ok(Snapshot {
        at: Instant::now(),
        evictions,
        puts: puts.load(Ordering::Relaxed),
        disk,
        daemon_ticks: process_ticks(pid),
        machine: machine_ticks(),
    })
}

/// Busy (all but idle and iowait) and total ticks of all CPUs (/proc/stat).
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let total: u64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

async fn measure(
    args: &InterferenceArgs,
    d: &Daemon,
    tier: bool,
    pair: usize,
) -> anyhow::Result<RunResult> {
    let reader = connect(d).await?;
    let keys: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..args.hot_keys)
            .map(|i| format!("tier-hot/{i:04}").into_bytes())
            .collect(),
    );
    if args.unpinned_hot {
        workloads::store(&reader, &keys, args.get_size).await?;
    } else {
        let value = workloads::value(args.get_size);
        let items: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (&k[..], &value[..])).collect();
        if let Some(c) = reader
            .batch_put_pinned(&items)
            .await?
            .into_iter()
            .find(|c| *c != ErrorCode::Ok)
        {
            bail!("storing the hot set: {c:?}");
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let puts = Arc::new(AtomicU64::new(0));
    let value = workloads::value(args.put_size);
    let mut writers = Vec::new();
    let misses = Arc::new(AtomicU64::new(0));
    let mut hot = vec![HotGet {
        client: reader.clone(),
        keys: keys.clone(),
        next: 0,
        buf: vec![0; args.get_size as usize],
        misses: misses.clone(),
    }];
    // Read before the writers start, so that the policy knows the hot set for what it is.
    for _ in 0..HOT_READS * args.hot_keys {
        hot[0].op().await?;
    }
    // Each writer's pause between puts, when they are paced.
    let interval = args.put_mbps.map(|mbps| {
        Duration::from_secs_f64(args.put_size as f64 * args.writers as f64 / (mbps * 1e6))
    });
    for w in 0..args.writers {
        let c = connect(d).await?;
        let (stop, puts, value) = (stop.clone(), puts.clone(), value.clone());
        writers.push(tokio::spawn(async move {
            let began = tokio::time::Instant::now();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                c.put(format!("tier-cold/{w}/{n}").as_bytes(), &value)
                    .await?;
                n += 1;
                puts.fetch_add(1, Ordering::Relaxed);
                if let Some(i) = interval {
                    tokio::time::sleep_until(began + i * n as u32).await;
                }
            }
            anyhow::Ok(())
        }));
    }
    let outcome = async {
        let began = Instant::now();
        while reader.stats().await?.evictions == 0 {
            if began.elapsed() > FILL_TIMEOUT {
                bail!("DRAM did not evict within {FILL_TIMEOUT:?} of writing");
            }
            for _ in 0..args.hot_keys {
                hot[0].op().await?;
            }
        }
        // The reader runs through the lead too, unrecorded, as it will in the window.
        run_tasks(&mut hot, LEAD).await?;
        misses.store(0, Ordering::Relaxed);
        let s0 = snapshot(&reader, &puts, d.pid()).await?;
        let m = run_tasks(&mut hot, Duration::from_millis(args.window_ms)).await?;
        let s1 = snapshot(&reader, &puts, d.pid()).await?;
        anyhow::Ok(RunResult {
            pair,
            tier,
            reader: m,
            misses: misses.load(Ordering::Relaxed),
            secs: (s1.at - s0.at).as_secs_f64(),
            puts: s1.puts - s0.puts,
            put_size: args.put_size,
            evictions: s1.evictions - s0.evictions,
            disk: delta(&s0.disk, &s1.disk),
            daemon_cores: (s1.daemon_ticks - s0.daemon_ticks) as f64
                / ticks_per_s()
                / (s1.at - s0.at).as_secs_f64(),
            machine_busy: (s1.machine.0 - s0.machine.0) as f64
                / (s1.machine.1 - s0.machine.1).max(1) as f64,
        })
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await??;
    }
    outcome
}

/// The counters `b` has over `a` (what happened between the two).
fn delta(a: &DiskTierStats, b: &DiskTierStats) -> DiskTierStats {
    DiskTierStats {
        demoted: b.demoted - a.demoted,
        demoted_bytes: b.demoted_bytes - a.demoted_bytes,
        bytes_written: b.bytes_written - a.bytes_written,
        queue_drops: b.queue_drops - a.queue_drops,
        not_admitted: b.not_admitted - a.not_admitted,
        write_failures: b.write_failures - a.write_failures,
        promoted: b.promoted - a.promoted,
        hits: b.hits - a.hits,
        regions_dropped: b.regions_dropped - a.regions_dropped,
        queued_bytes: b.queued_bytes,
        ..b.clone()
    }
}

/// The reader: one get at a time, cycling over the hot set, into one reused buffer.
struct HotGet {
    client: Client,
    keys: Arc<Vec<Vec<u8>>>,
    next: usize,
    buf: Vec<u8>,
    misses: Arc<AtomicU64>,
}

impl Worker for HotGet {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let key = &self.keys[self.next];
        self.next = (self.next + 1) % self.keys.len();
        match self.client.get_into(key, &mut self.buf).await? {
            Some(n) => Ok(n as u64),
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                Ok(0)
            }
        }
    }
}

/// Every run, then each pair's ratios and their spread against the goal.
fn render(runs: &[RunResult]) -> String {
    let cells: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.pair.to_string(),
                if r.tier { "on" } else { "off" }.into(),
                fmt_rate(r.reader.ops_per_s()),
                fmt_ns(r.reader.quantile_ns(0.5)),
                fmt_ns(r.reader.quantile_ns(0.99)),
                fmt_ns(r.reader.quantile_ns(0.999)),
                r.misses.to_string(),
                format!("{:.2}", r.per_s(r.puts) * r.put_size as f64 / 1e9),
                fmt_rate(r.per_s(r.evictions)),
                fmt_rate(r.per_s(r.disk.demoted)),
                format!("{:.0}", r.per_s(r.disk.bytes_written) / 1e6),
                r.disk.queue_drops.to_string(),
                r.disk.promoted.to_string(),
                format!("{:.2}", r.daemon_cores),
                format!("{:.0}%", r.machine_busy * 100.0),
            ]
        })
        .collect();
    let mut out = String::from("\nreader gets of the hot set while writers make DRAM evict\n");
    out += &table(
        &[
            "pair",
            "tier",
            "gets/s",
            "p50",
            "p99",
            "p99.9",
            "misses",
            "puts GB/s",
            "evictions/s",
            "demotions/s",
            "disk MB/s",
            "queue drops",
            "promotions",
            "kvpoold cores",
            "machine busy",
        ],
        &cells,
    );
    let mut p99 = Vec::new();
    let mut p50 = Vec::new();
    for pair in runs.chunks(2) {
        let (off, on) = if pair[0].tier {
            (&pair[1], &pair[0])
        } else {
            (&pair[0], &pair[1])
        };
        let ratio = |q: f64| on.reader.quantile_ns(q) / off.reader.quantile_ns(q).max(1.0);
        p99.push(ratio(0.99));
        p50.push(ratio(0.5));
    }
    let spread = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[0], v[v.len() / 2], v[v.len() - 1])
    };
    let (lo, med, hi) = spread(&mut p99);
    let (lo50, med50, hi50) = spread(&mut p50);
    out += &format!(
        "\np99 with the tier demoting / p99 without, per pair: min {lo:.3}, median {med:.3}, \
         max {hi:.3} (goal ≤ {GOAL}: {})\n",
        if med <= GOAL { "met" } else { "missed" }
    );
    out += &format!("p50, the same: min {lo50:.3}, median {med50:.3}, max {hi50:.3}\n");
    out
}

/// The first three fields of /proc/loadavg.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
