//! Part 4 of `kvpool-bench handoff`: the 4 KiB probe while the cluster moves data.
//!
//! Node A alone holds `--move-bytes` of pinned values of `--block-size` and the probe's 64
//! values of 4 KiB, all pinned in a namespace with `pinned_replicas = 1`, so every object has
//! exactly one home and a change of owner is a move (copied to the new owner, then dropped by
//! the old one). The probe (one `Client`, the 4 KiB get loop of part 1, every byte checked)
//! runs idle on the one-node cluster; then node B joins and the probe runs until the nodes
//! report that B holds its share and A only what it still owns; then B drains and the probe
//! runs until A reports every object back and B is down in A's view. Completion is read from
//! the nodes' own reports (their views and per-namespace object counts, polled), bounded by
//! `--move-timeout-s`, which is reported when hit. After each move every moved value is read
//! back and checked.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use kvpool::protocol::auth::ClusterSecret;
use kvpool_bench::units::{fmt_ns, fmt_size};
use kvpool_client::{Client, ClientConfig, SameHost};

use super::{
    HandoffArgs, Report, Row, Verdict, P99_CEILING_NS, P99_FACTOR, PROBE_KEYS, PROBE_SIZE,
};
use crate::perf::daemon::{self, Daemon};

mod data;
mod probe;
mod progress;

use data::Data;
use probe::{Probe, ProbeOut};
use progress::{drain_done, held, join_done, Moved};

/// The table's heading.
pub(super) const PART: &str = "join and drain: 4 KiB get while the cluster moves pinned objects";

/// The namespace the moved objects live in: one copy of each pinned object.
const NS: &str = "hbench-move";

/// How often the nodes' reports are read while a move runs.
const POLL: Duration = Duration::from_millis(20);

/// Heartbeat of both nodes (the cluster benchmark's): a join is seen within a few.
const HEARTBEAT_MS: &str = "100";

/// Longest the stores of the load may take per batch, and the clients' call timeout.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Bytes per `batch_put_pinned` while loading node A.
const LOAD_BATCH: u64 = 32 << 20;

/// Bytes in MiB with one decimal (moved bytes are rarely whole KiB multiples of a unit).
pub(super) fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// Removes the config's directory when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A row of the probe while the cluster moved, with the move's figures and the goal.
fn move_row(what: &str, p: &ProbeOut, idle_p99: f64, mv: &Moved) -> Row {
    let mut row = Row::from_measured(PART, what.into(), &p.m);
    row.misses = Some(p.misses + p.errors);
    row.moved = Some((mv.bytes, mv.secs));
    if mv.secs > 0.0 && mv.done() {
        row.gbps = Some(mv.bytes as f64 / mv.secs / 1e9);
    }
    let ratio = row.p99_ns / idle_p99;
    let mut text = format!(
        "p99 {ratio:.1}× idle; goal ≤{P99_FACTOR}× and ≤{}",
        fmt_ns(P99_CEILING_NS)
    );
    if mv.timed_out {
        text.push_str(&format!("; move timed out after {:.1} s", mv.secs));
    }
    if let Some(why) = &mv.refused {
        text.push_str(&format!("; {why}"));
    }
    if p.misses + p.errors > 0 {
        text.push_str(&format!("; {} misses, {} errors", p.misses, p.errors));
    }
    row.verdict = Some(Verdict {
        text,
        ratio: Some(ratio),
        met: ratio <= P99_FACTOR
            && row.p99_ns <= P99_CEILING_NS
            && mv.done()
            && p.misses + p.errors == 0,
    });
    row
}

/// The run's sizes and bounds, from the flags.
struct Plan {
    /// Bytes node A holds: the moved blocks and the probe's values.
    stored: u64,
    /// Each node's pool.
    memory: u64,
    /// Each idle window.
    window: Duration,
    /// Longest a move may take.
    timeout: Duration,
}

/// Part 4: the probe idle on one node, while B joins, while B drains.
pub(super) fn join_and_drain(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    report: &mut Report,
) -> anyhow::Result<()> {
    eprintln!("== {PART} ==");
    let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
    let data = Arc::new(Data::new(args));
    let stored = data.block_keys.len() as u64 * args.block_size + PROBE_KEYS as u64 * PROBE_SIZE;
    let plan = Plan {
        stored,
        memory: daemon::memory_for(stored),
        window: Duration::from_millis(args.phase_ms),
        timeout: Duration::from_secs(args.move_timeout_s),
    };
    let conf_dir = Scratch(daemon::scratch_dir("kvpool-bench-move")?);
    let conf = write_config(&conf_dir)?;
    let a = Daemon::start_with(&bin, plan.memory, &flags(&conf, "0", None))?;
    let (probe_client, admin) = connect(rt, &a)?;
    let before_a = load_node_a(args, rt, &plan, &data, (&probe_client, &admin))?;

    eprintln!("  idle, one node");
    let idle = idle_probe(rt, &probe_client, &data, plan.window)?;

    eprintln!("  node B joins");
    let b_flags = flags(&conf, "1", Some(&a));
    let node_b = (bin.as_path(), plan.memory, &b_flags[..]);
    let (mut b, join, join_probe) = b_joins(rt, node_b, (&probe_client, &admin), &data, &plan)?;

    eprintln!("  two nodes, idle");
    let idle2 = probe_for(rt, &probe_client, &data, plan.window)?;

    eprintln!("  node B drains");
    let drained = b_drains(rt, &mut b, (&probe_client, &admin), &data, &plan)?;
    drop(b);
    drop(a);

    push_rows(report, (&idle, &idle2), (&join_probe, &join), &drained);
    report.notes.push(setup_note(args, &plan, &data, before_a));
    report
        .notes
        .push(outcome_note(&join, &join_probe, &drained));
    Ok(())
}

/// Writes the nodes' config (the namespace of the moved objects); its path.
fn write_config(dir: &Scratch) -> anyhow::Result<String> {
    let conf = dir.0.join("kvpool.toml");
    std::fs::write(
        &conf,
        format!("[[namespace]]\nname = \"{NS}\"\npinned_replicas = 1\n"),
    )
    .with_context(|| format!("writing {}", conf.display()))?;
    Ok(conf.display().to_string())
}

/// A node's flags: its id, the heartbeat, the config, and the seed it joins through.
fn flags(conf: &str, id: &str, seed: Option<&Daemon>) -> Vec<String> {
    let mut v: Vec<String> = ["--node-id", id, "--heartbeat-ms", HEARTBEAT_MS, "--config"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(conf.to_string());
    if let Some(s) = seed {
        v.push("--peer".into());
        v.push(s.tcp.clone());
        v.push("--cluster-secret-file".into());
        v.push(s.secret_file().display().to_string());
    }
    v
}

/// The probe's client and an admin client (holding node A's cluster secret), both in the
/// moved objects' namespace over TCP.
fn connect(rt: &tokio::runtime::Runtime, a: &Daemon) -> anyhow::Result<(Client, Client)> {
    let endpoint = format!("tcp://{}", a.tcp);
    let secret = std::fs::read(a.secret_file())
        .with_context(|| format!("reading {}", a.secret_file().display()))?;
    let cfg = ClientConfig {
        namespace: NS.into(),
        same_host: SameHost::Off,
        timeout: CALL_TIMEOUT,
        ..ClientConfig::default()
    };
    let admin_cfg = ClientConfig {
        cluster_secret: Some(
            ClusterSecret::from_file_contents(&secret)
                .map_err(|e| anyhow::anyhow!("node A's cluster secret: {e}"))?,
        ),
        ..cfg.clone()
    };
    rt.block_on(async {
        let p = Client::connect(&endpoint, cfg).await?;
        let a = Client::connect(&endpoint, admin_cfg).await?;
        anyhow::Ok((p, a))
    })
}

/// Stores every value on node A, pinned, and checks that A holds them all; the pinned bytes
/// A reports.
fn load_node_a(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    plan: &Plan,
    data: &Data,
    (probe_client, admin): (&Client, &Client),
) -> anyhow::Result<u64> {
    eprintln!(
        "  loading node A: {} in {} values of {}, pinned",
        mib(plan.stored),
        data.objects(),
        fmt_size(args.block_size)
    );
    rt.block_on(data.load(probe_client))?;
    let (before_a, objects_a) = rt.block_on(held(admin, 0))?;
    ensure!(
        objects_a == data.objects(),
        "node A holds {objects_a} objects after the load, not {}",
        data.objects()
    );
    Ok(before_a)
}

/// The probe on one node, after an unrecorded pass that opens its connection; every get must
/// find its value.
fn idle_probe(
    rt: &tokio::runtime::Runtime,
    probe_client: &Client,
    data: &Arc<Data>,
    window: Duration,
) -> anyhow::Result<ProbeOut> {
    // Unrecorded: opens the probe's connection.
    rt.block_on(async {
        let mut buf = vec![0u8; PROBE_SIZE as usize];
        for k in &data.probe_keys {
            probe_client.get_into(k, &mut buf).await?;
        }
        anyhow::Ok(())
    })?;
    let idle = probe_for(rt, probe_client, data, window)?;
    if idle.misses + idle.errors > 0 {
        bail!(
            "the idle probe on one node missed {} times and failed {} times ({:?})",
            idle.misses,
            idle.errors,
            idle.first_error
        );
    }
    Ok(idle)
}

/// The probe for one window.
fn probe_for(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    data: &Arc<Data>,
    window: Duration,
) -> anyhow::Result<ProbeOut> {
    let probe = Probe::start(rt, client, data);
    std::thread::sleep(window);
    probe.finish(rt)
}

/// Node B joins: the probe runs from B's start until the nodes report its share moved, then
/// every value is read back and checked. Node B, the move, and what the probe saw.
fn b_joins(
    rt: &tokio::runtime::Runtime,
    (bin, memory, flags): (&Path, u64, &[String]),
    (probe_client, admin): (&Client, &Client),
    data: &Arc<Data>,
    plan: &Plan,
) -> anyhow::Result<(Daemon, Moved, ProbeOut)> {
    let probe = Probe::start(rt, probe_client, data);
    let launched = Instant::now();
    let b = Daemon::start_with(bin, memory, flags);
    let joined = match b {
        Ok(b) => {
            let mv = rt.block_on(join_done(admin, data, launched, plan.timeout));
            (b, mv)
        }
        Err(e) => {
            let _ = probe.finish(rt);
            return Err(e.context("starting node B"));
        }
    };
    let join_probe = probe.finish(rt)?;
    let (b, join) = joined;
    if join.done() {
        rt.block_on(data.check(admin))
            .context("checking every value after the join")?;
    }
    Ok((b, join, join_probe))
}

/// How the drain went.
struct Drained {
    moved: Moved,
    /// What the probe saw meanwhile.
    probe: ProbeOut,
    /// How node B ended, if it did.
    exit: Option<std::process::ExitStatus>,
    /// Objects node A lacks after the drain.
    lost: u64,
}

/// Node B drains: the probe runs from the drain's call until B is down in A's view; then
/// B's exit is awaited a moment and every value read back and checked.
fn b_drains(
    rt: &tokio::runtime::Runtime,
    b: &mut Daemon,
    (probe_client, admin): (&Client, &Client),
    data: &Arc<Data>,
    plan: &Plan,
) -> anyhow::Result<Drained> {
    let (before_drain, _) = rt.block_on(held(admin, 0))?;
    let probe = Probe::start(rt, probe_client, data);
    let asked_at = Instant::now();
    let asked = rt.block_on(admin.drain_node(1));
    let moved = match asked {
        Ok(()) => rt.block_on(drain_done(
            admin,
            data,
            before_drain,
            asked_at,
            plan.timeout,
        )),
        // B never joined (the join timed out): reported, like a timeout.
        Err(e) => Moved {
            bytes: 0,
            secs: asked_at.elapsed().as_secs_f64(),
            lead_secs: 0.0,
            timed_out: false,
            refused: Some(format!("the drain was refused: {e}")),
            last: String::new(),
        },
    };
    let probe = probe.finish(rt)?;
    // B exits by itself once drained; give it a moment, then say how it ended.
    let t = Instant::now();
    let mut exit = b.try_wait();
    while moved.done() && exit.is_none() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(POLL);
        exit = b.try_wait();
    }
    let mut lost = 0u64;
    if moved.done() {
        let (_, now_a) = rt.block_on(held(admin, 0))?;
        lost = data.objects().saturating_sub(now_a);
        if lost == 0 {
            rt.block_on(data.check(admin))
                .context("checking every value after the drain")?;
        }
    }
    Ok(Drained {
        moved,
        probe,
        exit,
        lost,
    })
}

/// The part's rows: the idle windows, and each move judged against the one-node idle p99.
fn push_rows(
    report: &mut Report,
    (idle, idle2): (&ProbeOut, &ProbeOut),
    (join_probe, join): (&ProbeOut, &Moved),
    drained: &Drained,
) {
    let idle_p99 = idle.m.quantile_ns(0.99);
    let mut one = Row::from_measured(PART, "one node: idle".into(), &idle.m);
    one.misses = Some(0);
    report.rows.push(one);
    report.rows.push(move_row(
        "node B joins: moving its share to it",
        join_probe,
        idle_p99,
        join,
    ));
    let mut two = Row::from_measured(PART, "two nodes: idle".into(), &idle2.m);
    two.misses = Some(idle2.misses + idle2.errors);
    report.rows.push(two);
    let mut row = move_row(
        "node B drains: moving everything back to A",
        &drained.probe,
        idle_p99,
        &drained.moved,
    );
    if drained.lost > 0 {
        if let Some(v) = row.verdict.as_mut() {
            v.text.push_str(&format!("; {} objects lost", drained.lost));
            v.met = false;
        }
    }
    report.rows.push(row);
}

/// How the part measured.
fn setup_note(args: &HandoffArgs, plan: &Plan, data: &Data, before_a: u64) -> String {
    format!(
        "join and drain: two kvpoolds of {} each (heartbeat {HEARTBEAT_MS} ms), namespace {NS} \
         with pinned_replicas = 1 (one copy: a new owner means a move); node A alone holds {} \
         pinned: {} values of {} and the probe's {PROBE_KEYS} of {} ({} pinned bytes by its own \
         Stats); the probe is one Client over TCP getting one of its {PROBE_KEYS} keys per \
         round trip, back to back, every byte checked (a miss or a failed call is counted, \
         never a sample); idle windows {} ms; the probe of a move runs from B's start (the \
         drain's call) until the nodes report the move done: node A's view and both nodes' \
         per-namespace object counts, polled every {} ms (join: B serving and each node \
         holding exactly the objects it owns; drain: B down in A's view and A holding all); \
         bytes moved are pinned bytes by the nodes' Stats; time from B seen serving in A's \
         view (the drain's call) to done; every value read back and checked after each move; \
         timeout {} s; goal judged against the one-node idle p99",
        fmt_size(plan.memory),
        mib(plan.stored),
        data.block_keys.len(),
        fmt_size(args.block_size),
        fmt_size(PROBE_SIZE),
        before_a,
        plan.window.as_millis(),
        POLL.as_millis(),
        plan.timeout.as_secs(),
    )
}

/// What the moves did: their times and bytes, how B ended, what the probe missed.
fn outcome_note(join: &Moved, join_probe: &ProbeOut, drained: &Drained) -> String {
    let secs = |x: f64| format!("{x:.2} s");
    let (drain, drain_probe) = (&drained.moved, &drained.probe);
    format!(
        "join: {}; drain: {} to move {} back ({}); B {}; probe misses while joining: {}; while \
         draining: {}; failed gets {} and {}{}",
        if join.timed_out {
            format!(
                "TIMED OUT {} after B started, {} moved ({})",
                secs(join.lead_secs + join.secs),
                mib(join.bytes),
                join.last
            )
        } else {
            format!(
                "B started, {} until A's view showed it serving, then {} to move {} ({})",
                secs(join.lead_secs),
                secs(join.secs),
                mib(join.bytes),
                join.last
            )
        },
        secs(drain.secs),
        mib(drain.bytes),
        match (&drain.refused, drain.timed_out) {
            (Some(why), _) => why.clone(),
            (None, true) => format!("TIMED OUT: {}", drain.last),
            (None, false) => drain.last.clone(),
        },
        match drained.exit {
            Some(s) => format!("exited ({s})"),
            None if drain.done() => "had not exited 5 s after the drain's end".into(),
            None => "still running (the drain did not finish)".into(),
        },
        join_probe.misses_text(),
        drain_probe.misses_text(),
        join_probe.errors,
        drain_probe.errors,
        join_probe
            .first_error
            .iter()
            .chain(&drain_probe.first_error)
            .next()
            .map(|e| format!("; first error: {e}"))
            .unwrap_or_default(),
    )
}
