//! Part 1 of `kvpool-bench handoff`: a 4 KiB get's latency idle and under a bulk load, in
//! kvpool, redis, memcached, and with the load on a raw TCP server instead.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvpool_bench::units::{fmt_ns, fmt_size};
use kvpool_client::{Client, SameHost};

use super::{
    connect, HandoffArgs, Report, Row, Verdict, LEAD, P99_CEILING_NS, P99_FACTOR, PROBE_KEYS,
    PROBE_SIZE, ROUNDS,
};
use crate::perf::baseline_client::{BaselineConn, BaselineGet, BaselineSet, Proto};
use crate::perf::baselines::{self, Baseline, Limits};
use crate::perf::compare::AnyWorker;
use crate::perf::daemon::Daemon;
use crate::perf::driver::{run_tasks, Measured};
use crate::perf::raw::{RawGet, RawPut, RawServer};
use crate::perf::workloads::{self, Buffers, KvGet, KvPut};

/// The keys and values of part 1, the same in every system.
pub(super) struct Load {
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
    pub(super) fn new(args: &HandoffArgs) -> Load {
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

    pub(super) fn stored_bytes(&self) -> u64 {
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

/// The table's heading.
const PART: &str = "interference: 4 KiB get, idle and under bulk load";

/// Part 1: the 4 KiB probe, idle and under bulk load, in every system.
pub(super) fn interference(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    d: &Daemon,
    load: &Load,
    report: &mut Report,
) -> anyhow::Result<()> {
    eprintln!("== {PART} ==");
    let put_keys = load.put_keys();
    let mut bulk_keys = load.get_keys.to_vec();
    bulk_keys.extend(put_keys.iter().cloned());
    let limits = baseline_limits(load);
    let tcp = connect(rt, d, SameHost::Off)?;
    rt.block_on(async {
        workloads::store(&tcp, &load.probe_keys, PROBE_SIZE).await?;
        workloads::store(&tcp, &bulk_keys, load.size).await
    })?;
    let local = connect(rt, d, SameHost::Auto)?;
    let mut contenders = kv_contenders(&tcp, &local, load, report);
    let running = start_baselines(rt, load, &bulk_keys, &limits, &mut contenders, report)?;
    let raw = RawServer::start(load.get_keys.len() as u64 * load.size)?;
    contenders.push(raw_contender(rt, &raw, &tcp, load)?);

    let window = Duration::from_millis(args.phase_ms.max(ROUNDS as u64)) / ROUNDS;
    measure(rt, &mut contenders, window)?;
    push_rows(&contenders, report);
    drop(running);
    drop(raw);
    rt.block_on(async {
        let refs: Vec<&[u8]> = bulk_keys.iter().map(|k| &k[..]).collect();
        tcp.batch_remove(&refs).await
    })?;
    report.notes.push(note(load, window, &limits));
    Ok(())
}

/// The baselines' memory: room for twice what the load stores.
fn baseline_limits(load: &Load) -> Limits {
    let stored = load.stored_bytes();
    // memcached: an item must fit in one -I; the largest it takes is 1 GiB.
    let item_mib = ((load.size >> 20) + 1).next_power_of_two().max(32);
    Limits {
        memcached_mib: ((2 * stored) >> 20).max(1024).max(2 * item_mib),
        memcached_item_mib: item_mib,
        redis_mib: ((2 * stored) >> 20).max(1024),
    }
}

/// kvpool's contenders: over TCP (whole load, then each half alone) and on the same-host path
/// where `local` took it.
fn kv_contenders(tcp: &Client, local: &Client, load: &Load, report: &mut Report) -> Vec<Contender> {
    let mut contenders = vec![kv_contender("kvpool, TCP", true, tcp, load, (true, true))];
    // Where the probe's time goes: the two halves of the load on their own.
    contenders.push(kv_contender(
        "kvpool, TCP, the getters alone",
        false,
        tcp,
        load,
        (true, false),
    ));
    contenders.push(kv_contender(
        "kvpool, TCP, the putters alone",
        false,
        tcp,
        load,
        (false, true),
    ));
    if local.is_local() {
        contenders.push(kv_contender(
            "kvpool, same host",
            true,
            local,
            load,
            (true, true),
        ));
    } else {
        report
            .notes
            .push("the same-host path is not available here: no same-host rows".into());
    }
    contenders
}

/// Starts redis and memcached where installed, loads them with the same keys and adds their
/// contenders; the running servers, to be stopped when dropped.
fn start_baselines(
    rt: &tokio::runtime::Runtime,
    load: &Load,
    bulk_keys: &[Vec<u8>],
    limits: &Limits,
    contenders: &mut Vec<Contender>,
    report: &mut Report,
) -> anyhow::Result<Vec<Baseline>> {
    let mut running = Vec::new();
    for proto in [Proto::Redis, Proto::Memcached] {
        let Some(b) = baselines::start(proto, limits)? else {
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
            baselines::store(proto, b.port, bulk_keys, load.size).await
        })?;
        contenders.push(rt.block_on(baseline_contender(&b, load))?);
        running.push(b);
    }
    Ok(running)
}

/// The machine alone: kvpool's probe while the same loaders hit a raw TCP server, which
/// holds a data set of the loaders' size (their getters' keys) as kvpool does.
fn raw_contender(
    rt: &tokio::runtime::Runtime,
    raw: &RawServer,
    tcp: &Client,
    load: &Load,
) -> anyhow::Result<Contender> {
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
    Ok(Contender::new(
        "kvpool TCP probe, load on a raw TCP server instead",
        false,
        probe,
        raw_load,
    ))
}

/// The measured loop: every contender's slices, forward then backward.
fn measure(
    rt: &tokio::runtime::Runtime,
    contenders: &mut [Contender],
    window: Duration,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// Each contender's idle and loaded rows, kvpool's judged against the goal.
fn push_rows(contenders: &[Contender], report: &mut Report) {
    for c in contenders {
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
}

/// How part 1 measured.
fn note(load: &Load, window: Duration, limits: &Limits) -> String {
    format!(
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
    )
}
