//! `kvpool-bench tier restart`: how long a node with many objects on disk takes to serve again.
//!
//! A daemon with little DRAM and a tier that takes every eviction is filled through the client
//! with `--objects` small values (batched puts, paced so the demotion queue never drops one)
//! until that many are on disk; it is stopped cleanly (the queue drained, the files synced, the
//! index saved), or with `--crash` killed once the queue is empty (so that the restart reads
//! every record's header back, as after a crash), and started again on the same disk directory
//! with a fresh, empty DRAM, twice: first with the tier's files dropped from the page cache
//! (`posix_fadvise(DONTNEED)`, so recovery reads the disk), then with them cached as the first
//! restart left them; each restart ends as the fill's daemon did. Each restart is timed from
//! the spawn to the daemon's ready line and to the first value served from disk (a get of the
//! first object put, read up from disk and checked), and the daemon's own "disk tier ready"
//! log gives the time recovery took inside it. A sample of objects spread over the whole fill
//! is then read back and checked.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use clap::Args;
use kvpool_bench::units::{self, fmt_size};
use kvpool_client::{Client, ClientConfig, ErrorCode, SameHost};

use crate::perf::daemon;
use crate::perf::machine::Machine;

/// Bytes of a disk record's header (docs/ARCHITECTURE.md, "Disk tier").
const RECORD_HEADER: u64 = 56;

/// Records are padded to this (so that they can be read with `O_DIRECT`).
const RECORD_ALIGN: u64 = 4096;

/// The demotion queue's bound in these runs (the daemon's default).
const QUEUE: u64 = 256 << 20;

/// Puts per batch of the fill.
const BATCH: usize = 1024;

/// Longest a daemon may take to print its ready line, and to stop.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
const STOP_TIMEOUT: Duration = Duration::from_secs(120);

/// Objects read back and checked after each restart.
const SAMPLE: u64 = 1000;

/// Flags of `kvpool-bench tier restart`.
#[derive(Args, Debug)]
pub(crate) struct RestartArgs {
    /// Objects to put on disk.
    #[arg(long, default_value_t = 1_000_000)]
    objects: u64,
    /// Bytes per value (each object takes a whole 4 KiB record on disk).
    #[arg(long, default_value = "1KiB", value_parser = units::parse_size)]
    value_size: u64,
    /// DRAM of the daemon: small, so that nearly everything put goes to disk.
    #[arg(long, default_value = "64MiB", value_parser = units::parse_size)]
    memory: u64,
    /// Bytes of one disk region.
    #[arg(long, default_value = "64MiB", value_parser = units::parse_size)]
    disk_region_size: u64,
    /// Where the tier's directory goes: a real disk, not tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    disk_dir: PathBuf,
    /// Accept a tmpfs or ramfs --disk-dir (the figures are then no disk's).
    #[arg(long)]
    any_fs: bool,
    /// Kill the filled daemon (SIGKILL) instead of stopping it: its shutdown does not run, so
    /// the restart recovers from the records alone, as after a crash.
    #[arg(long)]
    crash: bool,
    /// Refuse to start when the fill would leave less than this free on that file system.
    #[arg(long, default_value = "2GiB", value_parser = units::parse_size)]
    keep_free: u64,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
}

/// Runs the fill and the two restarts and prints their figures.
pub(crate) fn run(args: RestartArgs) -> anyhow::Result<()> {
    ensure!(args.value_size >= 8, "--value-size must be at least 8");
    ensure!(args.objects > 0, "--objects must be positive");
    let machine = Machine::detect();
    println!("kvpool-bench tier restart — {}", machine.describe());
    let record =
        (RECORD_HEADER + key(0).len() as u64 + args.value_size).next_multiple_of(RECORD_ALIGN);
    // The records, and room for the regions being written and the one kept empty.
    let capacity =
        (args.objects * record + 3 * args.disk_region_size).next_multiple_of(args.disk_region_size);
    let free = super::free_bytes(&args.disk_dir)?;
    if free < capacity + args.keep_free {
        bail!(
            "{} objects take up to {} on disk and {} has {:.2} GiB free (keeping {}): pass \
             fewer --objects",
            args.objects,
            fmt_size(capacity),
            args.disk_dir.display(),
            free as f64 / (1u64 << 30) as f64,
            fmt_size(args.keep_free)
        );
    }
    let dir = super::disk_dir(&args.disk_dir, "restart", args.any_fs)?;
    println!(
        "  disk tier in {} ({}), capacity {} in regions of {}; {:.2} GiB free before the fill",
        dir.display(),
        super::fs_kind(&dir)?,
        fmt_size(capacity),
        fmt_size(args.disk_region_size),
        free as f64 / (1u64 << 30) as f64
    );
    let rt = crate::perf::runtime(&machine)?;
    let result = measure(&args, &rt, &dir, capacity);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(
    args: &RestartArgs,
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    capacity: u64,
) -> anyhow::Result<()> {
    let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
    let flags = vec![
        "--disk-path".to_string(),
        dir.display().to_string(),
        "--disk-capacity".into(),
        format!("{}MiB", capacity >> 20),
        "--disk-region-size".into(),
        format!("{}MiB", args.disk_region_size >> 20),
        "--disk-queue".into(),
        format!("{}MiB", QUEUE >> 20),
        "--disk-admit".into(),
        "all".into(),
    ];
    let mut first = Node::spawn(&bin, args.memory, &flags)?;
    let t = Instant::now();
    let (puts, on_disk) = rt.block_on(fill(&first, args))?;
    let fill_secs = t.elapsed().as_secs_f64();
    println!(
        "  fill: {puts} puts of {} in {fill_secs:.1} s ({:.0} puts/s); on disk: {} objects, \
         {} of records, {} dropped from the queue",
        fmt_size(args.value_size),
        puts as f64 / fill_secs,
        on_disk.objects,
        fmt_size(on_disk.bytes),
        on_disk.queue_drops
    );
    if args.crash {
        first.kill();
        println!("  killed (SIGKILL) once the demotion queue was empty");
    } else {
        let stop_secs = first.stop()?;
        println!("  clean stop: {stop_secs:.2} s");
    }
    for cold in [true, false] {
        if cold {
            drop_cache(dir)?;
        }
        let mut n = Node::spawn(&bin, args.memory, &flags)?;
        let served = rt.block_on(first_get(&n, args.value_size))?;
        let (found, recovered) = rt.block_on(sample(&n, args, on_disk.objects))?;
        println!(
            "  restart, {}: ready after {:.3} s (disk tier ready after {} ms by its log), \
             first value from disk after {:.3} s; {recovered} objects recovered; \
             {found} of {} sampled objects read back and checked",
            if cold {
                "tier's files not in the page cache"
            } else {
                "files cached"
            },
            n.ready_after.as_secs_f64(),
            n.disk_millis.map_or("?".into(), |m| m.to_string()),
            served.as_secs_f64(),
            SAMPLE.min(on_disk.objects)
        );
        ensure!(
            recovered == on_disk.objects,
            "the restart recovered {recovered} of the {} objects on disk",
            on_disk.objects
        );
        if args.crash {
            n.kill();
        } else {
            n.stop()?;
        }
    }
    Ok(())
}

/// Key of object `i`.
fn key(i: u64) -> Vec<u8> {
    format!("tier-restart/{i:010}").into_bytes()
}

/// Value of object `i`: its number, then a pattern of it.
fn value(i: u64, len: u64) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len)
        .map(|j| (j ^ i.wrapping_mul(0x9e37)) as u8)
        .collect();
    v[..8].copy_from_slice(&i.to_le_bytes());
    v
}

async fn connect(n: &Node) -> anyhow::Result<Client> {
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        timeout: Duration::from_secs(120),
        ..ClientConfig::default()
    };
    Ok(Client::connect(&format!("tcp://{}", n.tcp), cfg).await?)
}

/// What the fill left on disk.
struct OnDisk {
    objects: u64,
    bytes: u64,
    queue_drops: u64,
}

/// Puts objects in batches until `args.objects` are on disk, keeping the demotion queue under
/// half its bound, then waits for it to empty. Returns the puts made and what is on disk.
async fn fill(n: &Node, args: &RestartArgs) -> anyhow::Result<(u64, OnDisk)> {
    let c = connect(n).await?;
    let mut next = 0u64;
    loop {
        let s = c
            .disk_stats()
            .await?
            .context("the daemon has no disk tier")?;
        ensure!(
            s.queue_drops == 0,
            "the demotion queue dropped {} writes",
            s.queue_drops
        );
        // Counting what waits in the queue, so that the fill stops near the target.
        if s.objects + s.queued_bytes / args.value_size >= args.objects {
            break;
        }
        if s.queued_bytes > QUEUE / 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        let values: Vec<(Vec<u8>, Vec<u8>)> = (next..next + BATCH as u64)
            .map(|i| (key(i), value(i, args.value_size)))
            .collect();
        let items: Vec<(&[u8], &[u8])> = values
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        if let Some(code) = c
            .batch_put_from(&items)
            .await?
            .into_iter()
            .find(|c| *c != ErrorCode::Ok)
        {
            bail!("a put of the fill failed: {code:?}");
        }
        next += BATCH as u64;
    }
    let s = loop {
        let s = c.disk_stats().await?.unwrap_or_default();
        if s.queued_bytes == 0 {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    Ok((
        next,
        OnDisk {
            objects: s.objects,
            bytes: s.bytes,
            queue_drops: s.queue_drops,
        },
    ))
}

/// Time from the daemon's spawn until a get of object 0 (the first put, so the first
/// demoted) returns its value.
async fn first_get(n: &Node, len: u64) -> anyhow::Result<Duration> {
    let c = connect(n).await?;
    let got = c.get(&key(0)).await?;
    let at = n.spawned.elapsed();
    ensure!(
        got.as_deref() == Some(&value(0, len)[..]),
        "object 0 did not come back from disk as it was put"
    );
    Ok(at)
}

/// Reads back [`SAMPLE`] objects spread over the first `on_disk` put (the ones DRAM evicted,
/// nearly all in the order they came), checking each one found; returns how many were found,
/// and the objects the tier recovered.
async fn sample(n: &Node, args: &RestartArgs, on_disk: u64) -> anyhow::Result<(u64, u64)> {
    let c = connect(n).await?;
    let recovered = c.disk_stats().await?.unwrap_or_default().objects;
    let mut found = 0;
    let step = (on_disk / SAMPLE).max(1) as usize;
    for i in (0..on_disk).step_by(step).take(SAMPLE as usize) {
        if let Some(v) = c.get(&key(i)).await? {
            ensure!(v == value(i, args.value_size), "object {i} came back wrong");
            found += 1;
        }
    }
    Ok((found, recovered))
}

/// Drops the page cache of every file in `dir` (synced here first, for a killed daemon's).
fn drop_cache(dir: &Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let f = std::fs::File::open(&path)?;
        f.sync_all()?;
        // SAFETY: a valid open descriptor; advice only, over the whole file.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        ensure!(rc == 0, "posix_fadvise on {}: error {rc}", path.display());
    }
    Ok(())
}

/// A kvpoold started with its log at info (for the disk tier's own figure), timed from spawn.
struct Node {
    child: Child,
    data: PathBuf,
    tcp: String,
    spawned: Instant,
    ready_after: Duration,
    disk_millis: Option<u64>,
}

impl Node {
    fn spawn(bin: &Path, memory: u64, flags: &[String]) -> anyhow::Result<Node> {
        if !bin.exists() {
            bail!("{} not found: build it with `cargo build --release -p kvpool-server` or pass --kvpoold", bin.display());
        }
        let data = daemon::scratch_dir("kvpool-bench-tier")?;
        let spawned = Instant::now();
        let mut child = Command::new(bin)
            .arg("--data-dir")
            .arg(&data)
            .args(["--memory", &format!("{}MiB", memory >> 20)])
            .args(["--tcp", "127.0.0.1:0", "--quic", "", "--metrics", ""])
            .args(flags)
            .env("KVPOOL_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        daemon::register(child.id(), Some(data.clone()));
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().context("kvpoold stdout")?;
        let err = child.stderr.take().context("kvpoold stderr")?;
        let ready = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.starts_with("kvpoold ready") {
                    let _ = ready.send(Line::Ready(spawned.elapsed(), line));
                }
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if line.contains("disk tier ready") {
                    let _ = tx.send(Line::Disk(millis(&line)));
                } else if line.contains("ERROR") || line.contains("WARN") {
                    eprintln!("  kvpoold: {line}");
                }
            }
        });
        let mut node = Node {
            child,
            data,
            tcp: String::new(),
            spawned,
            ready_after: Duration::ZERO,
            disk_millis: None,
        };
        loop {
            match rx.recv_timeout(READY_TIMEOUT) {
                Ok(Line::Disk(m)) => node.disk_millis = m,
                Ok(Line::Ready(at, line)) => {
                    node.ready_after = at;
                    node.tcp = line
                        .split_whitespace()
                        .find_map(|f| f.strip_prefix("tcp="))
                        .context("the ready line has no TCP address")?
                        .to_string();
                    return Ok(node);
                }
                Err(_) => bail!(
                    "kvpoold did not print its ready line within {READY_TIMEOUT:?} (exit status: {:?})",
                    node.child.try_wait()?
                ),
            }
        }
    }

    /// Kills the daemon (SIGKILL): nothing of its shutdown runs.
    fn kill(&mut self) {
        let _ = self.child.kill();
        // Reaps it (the SIGTERM this sends first finds it dead, and its pid still ours).
        daemon::stop(&mut self.child, Duration::from_secs(5));
        let _ = std::fs::remove_dir_all(&self.data);
    }

    /// Stops the daemon cleanly (SIGTERM) and returns the seconds it took; an error if it had
    /// to be killed or exited with a failure.
    fn stop(&mut self) -> anyhow::Result<f64> {
        let t = Instant::now();
        daemon::stop(&mut self.child, STOP_TIMEOUT);
        let secs = t.elapsed().as_secs_f64();
        let _ = std::fs::remove_dir_all(&self.data);
        let status = self.child.try_wait()?;
        ensure!(
            status.is_some_and(|s| s.success()),
            "kvpoold did not stop cleanly within {STOP_TIMEOUT:?}: {status:?}"
        );
        Ok(secs)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // A child already reaped (stopped above) is left alone: its pid may be another's now.
        if self.child.try_wait().ok().flatten().is_none() {
            daemon::stop(&mut self.child, Duration::from_secs(5));
        }
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// What the daemon's output threads report.
enum Line {
    Ready(Duration, String),
    Disk(Option<u64>),
}

/// The `millis=` field of a log line.
fn millis(line: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("millis="))
        .and_then(|v| v.parse().ok())
}
