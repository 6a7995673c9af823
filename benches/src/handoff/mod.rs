//! `kvpool-bench handoff`: the handoff benchmarks, in one run against one kvpoold (and
//! redis-server and memcached for the first part), each figure next to its reference of the
//! same run.
//!
//! 1. Interference: p50 and p99 of a 4 KiB get, idle and while `--bulk-clients` tasks (half
//!    getting, half putting values of `--bulk-size`) keep the server busy. Contenders: kvpool
//!    over TCP and on the same-host path (the probe and the loaders share one `Client`, as an
//!    engine would: the bulk calls on the client's bulk connections, the probe on a latency
//!    one, and kvpoold's bulk class scheduling the 64 MiB transfers), redis and memcached
//!    (the probe on its own connection, each loader on its own), and kvpool's probe while the
//!    loaders hit a raw TCP server in this process instead — what the machine's cores alone
//!    cost the probe. Contenders run in slices, forward then backward.
//! 2. Handoff: a consumer is already in `Client::wait` on `--handoff-bytes` of blocks of
//!    `--block-size`; the producer stores them with one `batch_put_from`; the consumer then
//!    reads them with `batch_get_into` into preallocated buffers. Timed from the producer's
//!    call to the consumer holding every byte, alternating with one raw TCP stream of the same
//!    bytes over loopback; the stages (put, wake, get) are timed too. Then the same with the
//!    consumer in `Client::wait_get_into`, reading each block as soon as it is written.
//! 3. Notification: the consumer waits on one small key, the producer (same process, same
//!    clock) puts it; timed from the put's call to the wait's return, next to an `exists` and a
//!    4 KiB get, alternating, many times.
//! 4. Join and drain (its own pair of kvpoolds, [`moves`]): the probe of part 1 idle on one
//!    node holding `--move-bytes` of pinned values, then while a second node joins and takes
//!    its share, then while that node drains and hands everything back.
//!
//! `--phases` picks the parts to run.
//!
//! Every part is bounded: fixed windows and fixed repetition counts. Nothing asserts on time.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::ensure;
use kvpool_bench::units;
use kvpool_client::{Client, ClientConfig, SameHost};

use crate::perf::daemon::{self, Daemon};
use crate::perf::machine::Machine;

mod interference;
mod moves;
mod notification;
mod report;
mod transfer;

use interference::{interference, Load};
use notification::notification;
use report::{Report, Row, Verdict};
use transfer::handoff;

/// Size of the probe's values.
const PROBE_SIZE: u64 = 4096;

/// Distinct keys the probe cycles through.
const PROBE_KEYS: usize = 64;

/// Slices each interference phase is cut into (forward, backward, ...).
const ROUNDS: u32 = 2;

/// Head start of the loaders before the probe's loaded window opens.
const LEAD: Duration = Duration::from_millis(300);

/// Goals (docs/BENCHMARKS.md, "Handoff and interference").
const P99_FACTOR: f64 = 2.0;
const P99_CEILING_NS: f64 = 1e6;
const HANDOFF_GOAL: f64 = 1.25;
const NOTIFY_SLACK_NS: f64 = 50e3;

/// Time the consumer is given to be waiting before the producer starts (its watch is one
/// round trip; the first wait also opens the watching connection, in an unrecorded warm-up).
const HANDOFF_SETTLE: Duration = Duration::from_millis(50);
const NOTIFY_SETTLE: Duration = Duration::from_millis(3);

/// Longest any wait of the benchmark may take.
const WAIT_TIMEOUT: Duration = Duration::from_secs(30);

/// Flags of `kvpool-bench handoff`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct HandoffArgs {
    /// Length of each interference phase (idle, loaded) per contender, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    phase_ms: u64,
    /// Value size of the bulk load (B, KiB, MiB, GiB).
    #[arg(long, default_value = "64MiB", value_parser = units::parse_size)]
    bulk_size: u64,
    /// Loader tasks (half get, half put; at least 2).
    #[arg(long, default_value_t = 4)]
    bulk_clients: usize,
    /// Bytes of one handoff.
    #[arg(long, default_value = "64MiB", value_parser = units::parse_size)]
    handoff_bytes: u64,
    /// Block size of a handoff (one key per block) and of the values moved by the join and
    /// drain.
    #[arg(long, default_value = "1MiB", value_parser = units::parse_size)]
    block_size: u64,
    /// Timed handoffs per path, alternating with the raw TCP stream.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Timed notifications per path.
    #[arg(long, default_value_t = 1000)]
    notify_reps: usize,
    /// Bytes of pinned values node A holds before the join and drain (values of
    /// `--block-size`, plus the probe's 64 of 4 KiB).
    #[arg(long, default_value = "1GiB", value_parser = units::parse_size)]
    move_bytes: u64,
    /// Longest a join's or a drain's move may take before it is reported as timed out.
    #[arg(long, default_value_t = 300)]
    move_timeout_s: u64,
    /// Parts to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "interference,handoff,notification,join-drain"
    )]
    phases: Vec<Phase>,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The parts of the benchmark.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// 4 KiB gets idle and under bulk load, kvpool against redis and memcached.
    Interference,
    /// A producer-to-consumer handoff against a raw TCP stream.
    Handoff,
    /// Notification latency of a small key.
    Notification,
    /// 4 KiB gets while a node joins and then drains (its own two kvpoolds).
    JoinDrain,
}

/// The first three fields of /proc/loadavg.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Runs the three parts, prints the tables and writes the JSON.
pub(crate) fn run(args: HandoffArgs) -> anyhow::Result<()> {
    ensure!(args.bulk_clients >= 2, "--bulk-clients must be at least 2");
    ensure!(
        args.reps > 0 && args.notify_reps > 0,
        "--reps and --notify-reps must be positive"
    );
    ensure!(args.block_size > 0, "--block-size must be positive");
    ensure!(
        args.handoff_bytes % args.block_size == 0,
        "--handoff-bytes must be a multiple of --block-size"
    );
    ensure!(
        args.move_bytes % args.block_size == 0,
        "--move-bytes must be a multiple of --block-size"
    );
    ensure!(!args.phases.is_empty(), "--phases names no part");
    let began = Instant::now();
    let machine = Machine::detect();
    eprintln!("kvpool-bench handoff — {}", machine.describe());
    let rt = crate::perf::runtime(&machine)?;
    let mut report = Report {
        machine,
        loadavg: vec![loadavg()],
        rows: Vec::new(),
        notes: Vec::new(),
    };
    let on = |p: Phase| args.phases.contains(&p);
    if on(Phase::Interference) || on(Phase::Handoff) || on(Phase::Notification) {
        let load = Load::new(&args);
        let stored =
            load.stored_bytes() + 2 * args.handoff_bytes + (PROBE_KEYS as u64 * PROBE_SIZE);
        let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
        eprintln!("  starting {}", bin.display());
        let d = Daemon::start(&bin, daemon::memory_for(stored))?;
        if on(Phase::Interference) {
            interference(&args, &rt, &d, &load, &mut report)?;
        }
        if on(Phase::Handoff) {
            for same_host in [SameHost::Off, SameHost::Auto] {
                handoff(&args, &rt, &d, same_host, &mut report)?;
            }
        }
        if on(Phase::Notification) {
            for same_host in [SameHost::Off, SameHost::Auto] {
                notification(&args, &rt, &d, same_host, &mut report)?;
            }
        }
    }
    if on(Phase::JoinDrain) {
        moves::join_and_drain(&args, &rt, &mut report)?;
    }
    report.loadavg.push(loadavg());
    report.notes.push(format!(
        "load average (1, 5, 15 min) at the start: {}; at the end: {}",
        report.loadavg[0], report.loadavg[1]
    ));
    crate::perf::render::publish(&report.render(), began, args.json.as_deref(), |cmdline| {
        report.to_json(cmdline)
    })?;
    Ok(())
}

/// A client of the daemon over TCP, on the same-host path or not.
fn connect(
    rt: &tokio::runtime::Runtime,
    d: &Daemon,
    same_host: SameHost,
) -> anyhow::Result<Client> {
    let cfg = ClientConfig {
        same_host,
        ..ClientConfig::default()
    };
    Ok(rt.block_on(Client::connect(&format!("tcp://{}", d.tcp), cfg))?)
}

/// Name of a path in the tables.
fn path_name(same_host: SameHost) -> &'static str {
    match same_host {
        SameHost::Off => "TCP",
        SameHost::Auto => "same host",
    }
}

/// A producer's and a consumer's client on `same_host`'s path; None when the same-host path
/// was asked for and is not in use.
fn pair(
    rt: &tokio::runtime::Runtime,
    d: &Daemon,
    same_host: SameHost,
) -> anyhow::Result<Option<(Client, Client)>> {
    let producer = connect(rt, d, same_host)?;
    let consumer = connect(rt, d, same_host)?;
    let local = producer.is_local() && consumer.is_local();
    Ok((same_host != SameHost::Auto || local).then_some((producer, consumer)))
}
