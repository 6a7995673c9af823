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

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::ensure;
use kvpool_bench::units::{self, fmt_size};

use crate::perf::daemon::{self, Daemon};
use crate::perf::machine::Machine;

mod load;
mod ops;
mod report;
pub(crate) mod sample;
mod value;
mod verdict;

use load::Load;
use sample::{sample_until, Observed, Sampler};
use verdict::Verdicts;

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
