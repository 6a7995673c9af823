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
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvpool_bench::units::{self, fmt_ns, fmt_size};
use kvpool_client::{Client, ClientConfig, ErrorCode, SameHost};
use serde_json::json;

use crate::perf::baseline_client::{BaselineConn, BaselineGet, BaselineSet, Proto};
use crate::perf::baselines::{self, Baseline, Limits};
use crate::perf::compare::AnyWorker;
use crate::perf::daemon::{self, Daemon};
use crate::perf::driver::{run_tasks, Measured};
use crate::perf::machine::Machine;
use crate::perf::raw::{RawGet, RawPut, RawServer};
use crate::perf::render::table;
use crate::perf::workloads::{self, Buffers, KvGet, KvPut};
use crate::weights::alternate;
use crate::weights::limits::RawStream;

mod moves;

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

/// A goal and whether a figure met it.
struct Verdict {
    text: String,
    ratio: Option<f64>,
    met: bool,
}

/// One figure: latencies (p50, p99 in ns) and optionally a throughput.
struct Row {
    part: &'static str,
    what: String,
    samples: u64,
    p50_ns: f64,
    p99_ns: f64,
    gbps: Option<f64>,
    verdict: Option<Verdict>,
    /// Gets that missed or failed (the join and drain rows; never samples).
    misses: Option<u64>,
    /// Bytes a move carried and its seconds, as the nodes reported them.
    moved: Option<(u64, f64)>,
}

impl Row {
    fn from_measured(part: &'static str, what: String, m: &Measured) -> Row {
        Row {
            part,
            what,
            samples: m.ops,
            p50_ns: m.quantile_ns(0.5),
            p99_ns: m.quantile_ns(0.99),
            gbps: None,
            verdict: None,
            misses: None,
            moved: None,
        }
    }

    fn from_times(part: &'static str, what: &str, times: &[f64]) -> Row {
        Row {
            part,
            what: what.into(),
            samples: times.len() as u64,
            p50_ns: quantile(times, 0.5),
            p99_ns: quantile(times, 0.99),
            gbps: None,
            verdict: None,
            misses: None,
            moved: None,
        }
    }

    fn gbps(mut self, bytes: u64) -> Row {
        self.gbps = Some(bytes as f64 / self.p50_ns);
        self
    }
}

/// `q` of `xs` (nearest rank); NaN when empty.
fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// Everything a run found.
struct Report {
    machine: Machine,
    loadavg: Vec<String>,
    rows: Vec<Row>,
    notes: Vec<String>,
}

impl Report {
    fn render(&self) -> String {
        let mut out = String::new();
        let mut parts: Vec<&str> = Vec::new();
        for r in &self.rows {
            if !parts.contains(&r.part) {
                parts.push(r.part);
            }
        }
        for part in parts {
            out.push_str(&format!("\n== {part} ==\n"));
            let rows: Vec<&Row> = self.rows.iter().filter(|r| r.part == part).collect();
            // The columns of moves only where a part has them.
            let moves = rows.iter().any(|r| r.moved.is_some() || r.misses.is_some());
            let mut header = vec!["what", "samples", "p50", "p99"];
            if moves {
                header.extend(["misses", "moved", "time"]);
            }
            header.extend(["GB/s", "goal"]);
            let lines: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    let mut l = vec![
                        r.what.clone(),
                        r.samples.to_string(),
                        fmt_ns(r.p50_ns),
                        fmt_ns(r.p99_ns),
                    ];
                    if moves {
                        l.push(r.misses.map_or("-".into(), |m| m.to_string()));
                        l.push(r.moved.map_or("-".into(), |(b, _)| moves::mib(b)));
                        l.push(r.moved.map_or("-".into(), |(_, s)| format!("{s:.2} s")));
                    }
                    l.push(r.gbps.map_or("-".into(), |g| format!("{g:.2}")));
                    l.push(r.verdict.as_ref().map_or("-".into(), |v| {
                        format!("{} ({})", v.text, if v.met { "met" } else { "MISSED" })
                    }));
                    l
                })
                .collect();
            out.push_str(&table(&header, &lines));
        }
        for n in &self.notes {
            out.push_str(&format!("  * {n}\n"));
        }
        out
    }

    fn to_json(&self, args: &str) -> String {
        let finite = |x: f64| x.is_finite().then_some(x);
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "part": r.part,
                    "what": r.what,
                    "samples": r.samples,
                    "p50_s": finite(r.p50_ns / 1e9),
                    "p99_s": finite(r.p99_ns / 1e9),
                    "gbps": r.gbps.and_then(finite),
                    "misses": r.misses,
                    "moved_bytes": r.moved.map(|m| m.0),
                    "moved_s": r.moved.and_then(|m| finite(m.1)),
                    "goal": r.verdict.as_ref().map(|v| json!({
                        "text": v.text,
                        "ratio": v.ratio.and_then(finite),
                        "met": v.met,
                    })),
                })
            })
            .collect();
        let mut machine = self.machine.json();
        machine["loadavg"] = json!(self.loadavg);
        let doc = json!({
            "machine": machine,
            "args": args,
            "rows": rows,
            "notes": self.notes,
        });
        let mut s = serde_json::to_string_pretty(&doc).expect("a Value always serialises");
        s.push('\n');
        s
    }
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

/// The keys and values of part 1, the same in every system.
struct Load {
    size: u64,
    getters: usize,
    putters: usize,
    value: Arc<Vec<u8>>,
    /// What the getters read, two per getter.
    get_keys: Arc<Vec<Vec<u8>>>,
    /// What the probe reads.
    probe_keys: Arc<Vec<Vec<u8>>>,
}

impl Load {
    fn new(args: &HandoffArgs) -> Load {
        let getters = args.bulk_clients / 2;
        Load {
            size: args.bulk_size,
            getters,
            putters: args.bulk_clients - getters,
            value: workloads::value(args.bulk_size),
            get_keys: Arc::new(
                (0..2 * getters)
                    .map(|i| format!("hbench-bulk/{i}").into_bytes())
                    .collect(),
            ),
            probe_keys: Arc::new(
                (0..PROBE_KEYS)
                    .map(|i| format!("hbench-probe/{i:03}").into_bytes())
                    .collect(),
            ),
        }
    }

    /// The keys the putters overwrite (stored beforehand, so every put replaces a value).
    fn put_keys(&self) -> Vec<Vec<u8>> {
        workloads::all_put_keys(self.size, &[self.putters])
    }

    fn stored_bytes(&self) -> u64 {
        (self.get_keys.len() + self.put_keys().len()) as u64 * self.size
    }
}

/// One system measured in part 1, its connection loops and what they saw.
struct Contender {
    name: String,
    /// kvpool's own figures carry the goal.
    goal: bool,
    probe: Vec<AnyWorker>,
    load: Vec<AnyWorker>,
    idle: Measured,
    loaded: Measured,
    bulk: Measured,
}

impl Contender {
    fn new(name: &str, goal: bool, probe: AnyWorker, load: Vec<AnyWorker>) -> Contender {
        Contender {
            name: name.into(),
            goal,
            probe: vec![probe],
            load,
            idle: Measured::empty(),
            loaded: Measured::empty(),
            bulk: Measured::empty(),
        }
    }

    /// One idle slice of the probe, then one with the loaders running.
    async fn slice(&mut self, window: Duration) -> anyhow::Result<()> {
        let idle = run_tasks(&mut self.probe, window).await?;
        self.idle.then(&idle);
        let (probe, load) = (&mut self.probe, &mut self.load);
        let (p, l) = tokio::join!(
            async move {
                tokio::time::sleep(LEAD).await;
                run_tasks(probe, window).await
            },
            run_tasks(load, window + LEAD)
        );
        self.loaded.then(&p?);
        self.bulk.then(&l?);
        Ok(())
    }
}

/// kvpool's probe and loaders (the getters, the putters or both), sharing one client.
fn kv_contender(
    name: &str,
    goal: bool,
    kv: &Client,
    load: &Load,
    (gets, puts): (bool, bool),
) -> Contender {
    let probe = AnyWorker::KvGet(KvGet::new(
        kv.clone(),
        load.probe_keys.clone(),
        PROBE_SIZE,
        1,
        0,
        Buffers::default(),
    ));
    let mut loaders = Vec::new();
    for i in 0..if gets { load.getters } else { 0 } {
        loaders.push(AnyWorker::KvGet(KvGet::new(
            kv.clone(),
            load.get_keys.clone(),
            load.size,
            1,
            2 * i,
            Buffers::default(),
        )));
    }
    for j in 0..if puts { load.putters } else { 0 } {
        loaders.push(AnyWorker::KvPut(KvPut::new(
            kv.clone(),
            load.value.clone(),
            j,
            load.putters,
        )));
    }
    Contender::new(name, goal, probe, loaders)
}

/// A baseline's probe and loaders, each on its own connection.
async fn baseline_contender(b: &Baseline, load: &Load) -> anyhow::Result<Contender> {
    let conn = || BaselineConn::connect(b.proto, b.port);
    let probe = AnyWorker::BaselineGet(BaselineGet::new(
        conn().await?,
        load.probe_keys.clone(),
        PROBE_SIZE,
        1,
        0,
        Buffers::default(),
    ));
    let mut loaders = Vec::new();
    for i in 0..load.getters {
        loaders.push(AnyWorker::BaselineGet(BaselineGet::new(
            conn().await?,
            load.get_keys.clone(),
            load.size,
            1,
            2 * i,
            Buffers::default(),
        )));
    }
    for j in 0..load.putters {
        loaders.push(AnyWorker::BaselineSet(BaselineSet::new(
            conn().await?,
            load.value.clone(),
            j,
            load.putters,
        )));
    }
    Ok(Contender::new(b.proto.name(), false, probe, loaders))
}

/// Part 1: the 4 KiB probe, idle and under bulk load, in every system.
fn interference(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    d: &Daemon,
    load: &Load,
    report: &mut Report,
) -> anyhow::Result<()> {
    const PART: &str = "interference: 4 KiB get, idle and under bulk load";
    eprintln!("== {PART} ==");
    let put_keys = load.put_keys();
    let mut bulk_keys = load.get_keys.to_vec();
    bulk_keys.extend(put_keys.iter().cloned());
    let stored = load.stored_bytes();
    // memcached: an item must fit in one -I; the largest it takes is 1 GiB.
    let item_mib = ((load.size >> 20) + 1).next_power_of_two().max(32);
    let limits = Limits {
        memcached_mib: ((2 * stored) >> 20).max(1024).max(2 * item_mib),
        memcached_item_mib: item_mib,
        redis_mib: ((2 * stored) >> 20).max(1024),
    };
    let mut contenders = Vec::new();
    let tcp = connect(rt, d, SameHost::Off)?;
    rt.block_on(async {
        workloads::store(&tcp, &load.probe_keys, PROBE_SIZE).await?;
        workloads::store(&tcp, &bulk_keys, load.size).await
    })?;
    contenders.push(kv_contender("kvpool, TCP", true, &tcp, load, (true, true)));
    // Where the probe's time goes: the two halves of the load on their own.
    contenders.push(kv_contender(
        "kvpool, TCP, the getters alone",
        false,
        &tcp,
        load,
        (true, false),
    ));
    contenders.push(kv_contender(
        "kvpool, TCP, the putters alone",
        false,
        &tcp,
        load,
        (false, true),
    ));
    let local = connect(rt, d, SameHost::Auto)?;
    if local.is_local() {
        contenders.push(kv_contender(
            "kvpool, same host",
            true,
            &local,
            load,
            (true, true),
        ));
    } else {
        report
            .notes
            .push("the same-host path is not available here: no same-host rows".into());
    }
    let mut running = Vec::new();
    for proto in [Proto::Redis, Proto::Memcached] {
        let Some(b) = baselines::start(proto, &limits)? else {
            let (bin, pkg) = baselines::binary(proto);
            report.notes.push(format!(
                "{bin} not installed: no {} rows (apt-get install {pkg})",
                proto.name()
            ));
            continue;
        };
        eprintln!("  loading {}", proto.name());
        rt.block_on(async {
            baselines::store(proto, b.port, &load.probe_keys, PROBE_SIZE).await?;
            baselines::store(proto, b.port, &bulk_keys, load.size).await
        })?;
        contenders.push(rt.block_on(baseline_contender(&b, load))?);
        running.push(b);
    }
    // The machine alone: kvpool's probe while the same loaders hit a raw TCP server, which
    // holds a data set of the loaders' size (their getters' keys) as kvpool does.
    let raw = RawServer::start(load.get_keys.len() as u64 * load.size)?;
    let mut raw_load = Vec::new();
    rt.block_on(async {
        for i in 0..load.getters {
            let w = RawGet::connect(
                raw.addr,
                load.size,
                1,
                load.get_keys.len(),
                2 * i,
                Buffers::default(),
            )
            .await?;
            raw_load.push(AnyWorker::RawGet(w));
        }
        for _ in 0..load.putters {
            raw_load.push(AnyWorker::RawPut(
                RawPut::connect(raw.addr, load.value.clone(), load.putters).await?,
            ));
        }
        anyhow::Ok(())
    })?;
    let probe = AnyWorker::KvGet(KvGet::new(
        tcp.clone(),
        load.probe_keys.clone(),
        PROBE_SIZE,
        1,
        0,
        Buffers::default(),
    ));
    contenders.push(Contender::new(
        "kvpool TCP probe, load on a raw TCP server instead",
        false,
        probe,
        raw_load,
    ));

    let window = Duration::from_millis(args.phase_ms.max(ROUNDS as u64)) / ROUNDS;
    for round in 0..ROUNDS {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..contenders.len()).collect()
        } else {
            (0..contenders.len()).rev().collect()
        };
        for i in order {
            let c = &mut contenders[i];
            eprintln!("  round {round}: {}", c.name);
            rt.block_on(c.slice(window))
                .with_context(|| format!("measuring {}", c.name))?;
        }
    }
    for c in &contenders {
        report.rows.push(Row::from_measured(
            PART,
            format!("{}: idle", c.name),
            &c.idle,
        ));
        let mut loaded = Row::from_measured(PART, format!("{}: under load", c.name), &c.loaded);
        loaded.gbps = Some(c.bulk.gbps());
        let ratio = loaded.p99_ns / c.idle.quantile_ns(0.99);
        if c.goal {
            loaded.verdict = Some(Verdict {
                text: format!(
                    "p99 {ratio:.1}× idle; goal ≤{P99_FACTOR}× and ≤{}",
                    fmt_ns(P99_CEILING_NS)
                ),
                ratio: Some(ratio),
                met: ratio <= P99_FACTOR && loaded.p99_ns <= P99_CEILING_NS,
            });
        }
        report.rows.push(loaded);
    }
    drop(running);
    drop(raw);
    rt.block_on(async {
        let refs: Vec<&[u8]> = bulk_keys.iter().map(|k| &k[..]).collect();
        tcp.batch_remove(&refs).await
    })?;
    report.notes.push(format!(
        "interference: the probe gets one of {PROBE_KEYS} values of {} per round trip, back to \
         back, on one connection; the load is {} tasks getting and {} putting values of {} back \
         to back, each on its own connection (kvpool: the probe and the loaders share one \
         Client, whose bulk calls take its bulk connections and the probe a latency one; \
         kvpoold moves the bulk transfers 1 MiB per turn of its bulk class); GB/s is the load's; {} ms idle then {} ms loaded per \
         contender and slice, {ROUNDS} slices forward then backward; the loaders start {} ms \
         before the loaded window; memcached -m {} -I {}m -t 2, redis maxmemory {}mb",
        fmt_size(PROBE_SIZE),
        load.getters,
        load.putters,
        fmt_size(load.size),
        window.as_millis(),
        window.as_millis(),
        LEAD.as_millis(),
        limits.memcached_mib,
        limits.memcached_item_mib,
        limits.redis_mib,
    ));
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

/// The instants of one handoff.
struct Handoff {
    /// The producer's call.
    start: Instant,
    /// `batch_put_from` returned.
    stored: Instant,
    /// The consumer's `wait` returned.
    woke: Instant,
    /// The consumer holds every byte.
    done: Instant,
}

/// One handoff of `src` in blocks under `keys`: the consumer waits first, then the producer
/// stores, then the consumer reads into `dst` (handed back).
async fn handoff_once(
    producer: &Client,
    consumer: &Client,
    keys: &[Vec<u8>],
    src: &[u8],
    (block, streaming): (usize, bool),
    mut dst: Vec<Vec<u8>>,
) -> anyhow::Result<(Handoff, Vec<Vec<u8>>)> {
    let (c, ks) = (consumer.clone(), keys.to_vec());
    let task = tokio::spawn(async move {
        let refs: Vec<&[u8]> = ks.iter().map(|k| &k[..]).collect();
        if streaming {
            // Each block read the moment it is written, while the producer sends the rest.
            let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(|d| &mut d[..]).collect();
            let (out, got) = c.wait_get_into(&refs, &mut dsts, WAIT_TIMEOUT).await?;
            let done = Instant::now();
            ensure!(
                out.complete() && got.iter().all(|g| *g == Some(block)),
                "handoff: {} missing, {} failed, or a block short",
                out.missing.len(),
                out.failed.len()
            );
            drop(dsts);
            return anyhow::Ok((done, done, dst));
        }
        let out = c.wait(&refs, WAIT_TIMEOUT).await?;
        let woke = Instant::now();
        ensure!(
            out.complete(),
            "handoff: {} missing, {} failed",
            out.missing.len(),
            out.failed.len()
        );
        let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(|d| &mut d[..]).collect();
        let got = c.batch_get_into(&refs, &mut dsts).await?;
        let done = Instant::now();
        ensure!(
            got.iter().all(|g| *g == Some(block)),
            "handoff: a block is missing or short"
        );
        drop(dsts);
        anyhow::Ok((woke, done, dst))
    });
    tokio::time::sleep(HANDOFF_SETTLE).await;
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(src.chunks(block))
        .map(|(k, v)| (&k[..], v))
        .collect();
    let start = Instant::now();
    let codes = producer.batch_put_from(&items).await?;
    let stored = Instant::now();
    ensure!(
        codes.iter().all(|c| *c == ErrorCode::Ok),
        "handoff put: {codes:?}"
    );
    let (woke, done, dst) = task.await??;
    Ok((
        Handoff {
            start,
            stored,
            woke,
            done,
        },
        dst,
    ))
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

/// Part 2: handoffs on one path against a raw TCP stream of the same bytes.
fn handoff(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    d: &Daemon,
    same_host: SameHost,
    report: &mut Report,
) -> anyhow::Result<()> {
    const PART: &str = "handoff: producer to a waiting consumer, against a raw TCP stream";
    let path = path_name(same_host);
    eprintln!("== {PART}, {path} ==");
    let Some((producer, consumer)) = pair(rt, d, same_host)? else {
        return Ok(());
    };
    let block = args.block_size as usize;
    let blocks = (args.handoff_bytes / args.block_size) as usize;
    let src = workloads::value(args.handoff_bytes);
    // Written, so no run pays for faulting them in.
    let mut dst: Vec<Vec<u8>> = (0..blocks).map(|_| vec![0xa5; block]).collect();
    let mut rep = 0usize;
    let mut stages: Vec<Handoff> = Vec::new();
    let streaming = std::cell::Cell::new(false);
    let mut one = |dst: &mut Vec<Vec<u8>>| -> anyhow::Result<Duration> {
        let keys: Vec<Vec<u8>> = (0..blocks)
            .map(|i| format!("hbench-handoff/{rep}/{i:05}").into_bytes())
            .collect();
        rep += 1;
        let (h, back) = rt.block_on(handoff_once(
            &producer,
            &consumer,
            &keys,
            &src,
            (block, streaming.get()),
            std::mem::take(dst),
        ))?;
        *dst = back;
        for (i, d) in dst.iter().enumerate() {
            ensure!(
                d[..] == src[i * block..(i + 1) * block],
                "handoff: block {i} differs"
            );
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        rt.block_on(producer.batch_remove(&refs))?;
        let took = h.done - h.start;
        stages.push(h);
        Ok(took)
    };
    // Unrecorded: opens the consumer's watching connection and the pooled connections.
    one(&mut dst)?;
    let mut raw = RawStream::start(src.clone(), 0)?;
    raw.receive(&mut dst)?;
    let (stream, kv) = alternate(args.reps, &mut dst, |dst| raw.receive(dst), &mut one)?;
    // The same, the consumer reading each block as it is written (Client::wait_get_into).
    streaming.set(true);
    let (stream2, kv2) = alternate(args.reps, &mut dst, |dst| raw.receive(dst), &mut one)?;
    drop(raw);
    // The first was the warm-up; then the waiting consumer's runs, then the streaming one's.
    let (stages, streamed) = stages[1..].split_at(args.reps);
    let secs = |t: &[Duration]| t.iter().map(|d| d.as_nanos() as f64).collect::<Vec<_>>();
    let bytes = args.handoff_bytes;
    let reference = Row::from_times(
        PART,
        &format!("{path}: raw TCP stream, 1 connection (reference)"),
        &secs(&[stream, stream2].concat()),
    )
    .gbps(bytes);
    let judged = |what: String, times: &[Duration]| {
        let mut row = Row::from_times(PART, &what, &secs(times)).gbps(bytes);
        let ratio = row.p50_ns / reference.p50_ns;
        row.verdict = Some(Verdict {
            text: format!("{ratio:.2}× raw TCP; goal ≤{HANDOFF_GOAL}×"),
            ratio: Some(ratio),
            met: ratio <= HANDOFF_GOAL,
        });
        row
    };
    let size = fmt_size(args.block_size);
    let row = judged(
        format!("{path}: wait + batch_put_from + batch_get_into, {blocks} × {size}"),
        &kv,
    );
    let row2 = judged(
        format!("{path}: batch_put_from + wait_get_into (reads as written), {blocks} × {size}"),
        &kv2,
    );
    let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as f64;
    let put: Vec<f64> = stages.iter().map(|h| ns(h.start, h.stored)).collect();
    let wake: Vec<f64> = stages.iter().map(|h| ns(h.start, h.woke)).collect();
    let get: Vec<f64> = stages.iter().map(|h| ns(h.woke, h.done)).collect();
    let put2: Vec<f64> = streamed.iter().map(|h| ns(h.start, h.stored)).collect();
    report.rows.push(reference);
    report.rows.push(row);
    report.rows.push(
        Row::from_times(
            PART,
            &format!("{path}:   stage: producer's batch_put_from"),
            &put,
        )
        .gbps(bytes),
    );
    report.rows.push(Row::from_times(
        PART,
        &format!("{path}:   stage: producer's call to the consumer's wake"),
        &wake,
    ));
    report.rows.push(
        Row::from_times(
            PART,
            &format!("{path}:   stage: consumer's batch_get_into"),
            &get,
        )
        .gbps(bytes),
    );
    report.rows.push(row2);
    report.rows.push(
        Row::from_times(
            PART,
            &format!("{path}:   stage: producer's batch_put_from, the consumer reading meanwhile"),
            &put2,
        )
        .gbps(bytes),
    );
    if same_host == SameHost::Off {
        report.notes.push(format!(
            "handoff: medians (p50) of {} alternating runs per contender after one unrecorded \
             run; the consumer is in Client::wait {} ms before the producer's call; every byte \
             is checked after each run; the keys are removed between runs",
            args.reps,
            HANDOFF_SETTLE.as_millis()
        ));
    }
    Ok(())
}

/// One notification: returns (put's call to the wait's return, the put's own round trip).
async fn notify_once(
    producer: &Client,
    consumer: &Client,
    key: &[u8],
    value: &[u8],
) -> anyhow::Result<(f64, f64)> {
    let (c, k) = (consumer.clone(), key.to_vec());
    let task = tokio::spawn(async move {
        let out = c.wait(&[&k[..]], WAIT_TIMEOUT).await?;
        let woke = Instant::now();
        ensure!(out.complete(), "notification: the key did not arrive");
        anyhow::Ok(woke)
    });
    tokio::time::sleep(NOTIFY_SETTLE).await;
    let start = Instant::now();
    producer.put(key, value).await?;
    let stored = Instant::now();
    let woke = task.await??;
    producer.remove(key).await?;
    let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as f64;
    Ok((ns(start, woke), ns(start, stored)))
}

/// Part 3: notification latency on one path, against round trips of the same run.
fn notification(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    d: &Daemon,
    same_host: SameHost,
    report: &mut Report,
) -> anyhow::Result<()> {
    const PART: &str = "notification: put's call to the waiting consumer's wake, one small key";
    let path = path_name(same_host);
    eprintln!("== {PART}, {path} ==");
    let Some((producer, consumer)) = pair(rt, d, same_host)? else {
        return Ok(());
    };
    let value = vec![0x5a_u8; 64];
    let probe = b"hbench-notify-probe".to_vec();
    rt.block_on(producer.put(&probe, &workloads::value(PROBE_SIZE)))?;
    let mut buf = vec![0u8; PROBE_SIZE as usize];
    let plain = b"hbench-notify-unwatched".to_vec();
    let (mut notify, mut put, mut exists, mut get, mut unwatched) =
        (vec![], vec![], vec![], vec![], vec![]);
    // One unrecorded pass opens the connections.
    for rep in 0..=args.notify_reps {
        let key = format!("hbench-notify/{rep}").into_bytes();
        let (n, p, e, g, u) = rt.block_on(async {
            let refs = async {
                let t = Instant::now();
                ensure!(producer.exists(&probe).await?, "probe key missing");
                let e = t.elapsed().as_nanos() as f64;
                let t = Instant::now();
                let got = producer.get_into(&probe, &mut buf).await?;
                let g = t.elapsed().as_nanos() as f64;
                ensure!(got == Some(PROBE_SIZE as usize), "probe key missing");
                let t = Instant::now();
                producer.put(&plain, &value).await?;
                anyhow::Ok((e, g, t.elapsed().as_nanos() as f64))
            };
            if rep % 2 == 0 {
                let (n, p) = notify_once(&producer, &consumer, &key, &value).await?;
                let (e, g, u) = refs.await?;
                anyhow::Ok((n, p, e, g, u))
            } else {
                let (e, g, u) = refs.await?;
                let (n, p) = notify_once(&producer, &consumer, &key, &value).await?;
                anyhow::Ok((n, p, e, g, u))
            }
        })?;
        if rep > 0 {
            notify.push(n);
            put.push(p);
            exists.push(e);
            get.push(g);
            unwatched.push(u);
        }
    }
    rt.block_on(async {
        producer.remove(&probe).await?;
        producer.remove(&plain).await
    })?;
    let exists = Row::from_times(PART, &format!("{path}: exists (reference)"), &exists);
    let get = Row::from_times(PART, &format!("{path}: 4 KiB get (reference)"), &get);
    let mut row = Row::from_times(
        PART,
        &format!("{path}: put's call to wait's return"),
        &notify,
    );
    let (over50, over99) = (row.p50_ns - exists.p50_ns, row.p99_ns - exists.p99_ns);
    row.verdict = Some(Verdict {
        text: format!(
            "exists + {} at p50, + {} at p99; goal ≤ exists + 50µs",
            fmt_signed_ns(over50),
            fmt_signed_ns(over99)
        ),
        ratio: None,
        met: over50 <= NOTIFY_SLACK_NS,
    });
    let put = Row::from_times(
        PART,
        &format!("{path}:   stage: the put's round trip (a consumer waiting)"),
        &put,
    );
    let unwatched = Row::from_times(
        PART,
        &format!("{path}:   the same put, of a key nobody waits for"),
        &unwatched,
    );
    report.rows.extend([exists, get, row, put, unwatched]);
    if same_host == SameHost::Off {
        report.notes.push(format!(
            "notification: {} repetitions per path after one unrecorded, producer and consumer \
             in this process with their own clients (one clock); the consumer is in \
             Client::wait {} ms before the put of a 64-byte value; exists, the 4 KiB get and a put \
             of an unwatched key are the producer's, alternating before and after the \
             notification; the goal is judged \
             at p50",
            args.notify_reps,
            NOTIFY_SETTLE.as_millis()
        ));
    }
    Ok(())
}

/// A signed duration for the goal column.
fn fmt_signed_ns(ns: f64) -> String {
    if ns < 0.0 {
        format!("-{}", fmt_ns(-ns))
    } else {
        fmt_ns(ns)
    }
}
