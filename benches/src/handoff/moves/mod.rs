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

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use kvpool::placement::{ClusterView, NodeState};
use kvpool::protocol::auth::ClusterSecret;
use kvpool::NodeId;
use kvpool_bench::units::{fmt_ns, fmt_size};
use kvpool_client::{Client, ClientConfig, ErrorCode, SameHost};

use super::{
    HandoffArgs, Report, Row, Verdict, P99_CEILING_NS, P99_FACTOR, PROBE_KEYS, PROBE_SIZE,
};
use crate::perf::daemon::{self, Daemon};
use crate::perf::driver::Measured;
use crate::perf::workloads;

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

/// What one probe loop saw.
struct ProbeOut {
    m: Measured,
    /// Gets that found nothing (a pinned object must always be found).
    misses: u64,
    /// Gets that failed, and the first error's text.
    errors: u64,
    first_error: Option<String>,
    /// Distinct probe keys that missed, and the last miss, from the probe's start.
    missed_keys: std::collections::BTreeSet<usize>,
    last_miss: Option<Duration>,
}

impl ProbeOut {
    /// Where the misses were, for the notes.
    fn misses_text(&self) -> String {
        match self.last_miss {
            None => "none".into(),
            Some(t) => format!(
                "{} on {} of the {PROBE_KEYS} keys, the last {:.2} s after the probe's start",
                self.misses,
                self.missed_keys.len(),
                t.as_secs_f64()
            ),
        }
    }
}

/// The probe, running on the runtime until stopped.
struct Probe {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<anyhow::Result<ProbeOut>>,
}

impl Probe {
    /// Starts the loop: gets of the probe's keys in turn, back to back, one at a time.
    fn start(rt: &tokio::runtime::Runtime, client: &Client, data: &Arc<Data>) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let (c, d, s) = (client.clone(), data.clone(), stop.clone());
        let task = rt.spawn(async move {
            let mut out = ProbeOut {
                m: Measured::empty(),
                misses: 0,
                errors: 0,
                first_error: None,
                missed_keys: Default::default(),
                last_miss: None,
            };
            let began = Instant::now();
            let mut buf = vec![0u8; PROBE_SIZE as usize];
            let mut i = 0usize;
            while !s.load(Ordering::Acquire) {
                let k = i % PROBE_KEYS;
                i += 1;
                let t = Instant::now();
                let got = c.get_into(&d.probe_keys[k], &mut buf).await;
                let ns = t.elapsed().as_nanos().max(1) as u64;
                match got {
                    Ok(Some(n)) => {
                        ensure!(
                            n == buf.len() && buf == d.probe_values[k],
                            "probe: {} returned {n} bytes that are not the value stored",
                            String::from_utf8_lossy(&d.probe_keys[k])
                        );
                        out.m.ops += 1;
                        out.m.bytes += n as u64;
                        out.m.hist.saturating_record(ns);
                    }
                    Ok(None) => {
                        out.misses += 1;
                        out.missed_keys.insert(k);
                        out.last_miss = Some(began.elapsed());
                    }
                    Err(e) => {
                        out.errors += 1;
                        out.first_error.get_or_insert_with(|| e.to_string());
                    }
                }
            }
            out.m.secs = began.elapsed().as_secs_f64();
            Ok(out)
        });
        Probe { stop, task }
    }

    fn finish(self, rt: &tokio::runtime::Runtime) -> anyhow::Result<ProbeOut> {
        self.stop.store(true, Ordering::Release);
        rt.block_on(self.task).context("the probe task")?
    }
}

/// The keys and values: the moved blocks and the probe's.
struct Data {
    block_keys: Vec<Vec<u8>>,
    /// One block; block `i` is it with `i` in its first 8 bytes.
    block: Arc<Vec<u8>>,
    probe_keys: Vec<Vec<u8>>,
    probe_values: Vec<Vec<u8>>,
}

impl Data {
    fn new(args: &HandoffArgs) -> Data {
        let blocks = args.move_bytes / args.block_size;
        let probe = workloads::value(PROBE_SIZE);
        Data {
            block_keys: (0..blocks)
                .map(|i| format!("hbench-move/{i:06}").into_bytes())
                .collect(),
            block: workloads::value(args.block_size),
            probe_keys: (0..PROBE_KEYS)
                .map(|i| format!("hbench-move-probe/{i:03}").into_bytes())
                .collect(),
            probe_values: (0..PROBE_KEYS as u64)
                .map(|i| numbered(&probe, i))
                .collect(),
        }
    }

    fn block_value(&self, i: usize) -> Vec<u8> {
        numbered(&self.block, i as u64)
    }

    fn objects(&self) -> u64 {
        (self.block_keys.len() + self.probe_keys.len()) as u64
    }

    fn all_keys(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.block_keys.iter().chain(&self.probe_keys)
    }

    /// Stores every value pinned through `c`.
    async fn load(&self, c: &Client) -> anyhow::Result<()> {
        let per = (LOAD_BATCH / self.block.len() as u64).max(1) as usize;
        for (n, chunk) in self.block_keys.chunks(per).enumerate() {
            let values: Vec<Vec<u8>> = (0..chunk.len())
                .map(|j| self.block_value(n * per + j))
                .collect();
            put_all(c, chunk, &values).await?;
        }
        put_all(c, &self.probe_keys, &self.probe_values).await
    }

    /// Reads every value back through `c` and checks its bytes.
    async fn check(&self, c: &Client) -> anyhow::Result<()> {
        let per = (LOAD_BATCH / self.block.len() as u64).max(1) as usize;
        let mut bufs = vec![vec![0u8; self.block.len()]; per];
        for (n, chunk) in self.block_keys.chunks(per).enumerate() {
            let refs: Vec<&[u8]> = chunk.iter().map(|k| &k[..]).collect();
            let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let got = c.batch_get_into(&refs, &mut dsts[..chunk.len()]).await?;
            for (j, g) in got.iter().enumerate() {
                let i = n * per + j;
                ensure!(
                    *g == Some(self.block.len()) && bufs[j] == self.block_value(i),
                    "block {i} is missing or differs after the move ({g:?})"
                );
            }
        }
        for (k, v) in self.probe_keys.iter().zip(&self.probe_values) {
            let got = c.get(k).await?;
            ensure!(got.as_ref() == Some(v), "probe value {k:?} after the move");
        }
        Ok(())
    }
}

/// Bytes in MiB with one decimal (moved bytes are rarely whole KiB multiples of a unit).
pub(super) fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// `base` with `i` in its first 8 bytes.
fn numbered(base: &[u8], i: u64) -> Vec<u8> {
    let mut v = base.to_vec();
    let n = v.len().min(8);
    v[..n].copy_from_slice(&i.to_le_bytes()[..n]);
    v
}

async fn put_all(c: &Client, keys: &[Vec<u8>], values: &[Vec<u8>]) -> anyhow::Result<()> {
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(values)
        .map(|(k, v)| (&k[..], &v[..]))
        .collect();
    let codes = c.batch_put_pinned(&items).await?;
    ensure!(
        codes.iter().all(|c| *c == ErrorCode::Ok),
        "loading node A: {codes:?}"
    );
    Ok(())
}

/// One move as the nodes reported it.
struct Moved {
    /// Bytes of pinned objects that changed node.
    bytes: u64,
    /// From the move's start (B seen serving, or the drain asked for) to the reports showing
    /// it done, or to the timeout.
    secs: f64,
    /// From B's start, or the drain's call, to the move's start.
    lead_secs: f64,
    timed_out: bool,
    /// Not started: the drain was refused (B never joined), and why.
    refused: Option<String>,
    /// What the nodes reported last (for the timeout's note).
    last: String,
}

impl Moved {
    /// The nodes reported the move done.
    fn done(&self) -> bool {
        !self.timed_out && self.refused.is_none()
    }
}

/// The namespace's pinned bytes and objects on `node`, from its own `Stats`.
async fn held(c: &Client, node: u32) -> anyhow::Result<(u64, u64)> {
    let s = c.node_stats(node).await?;
    let ns = s
        .namespaces
        .iter()
        .find(|n| n.name == NS)
        .with_context(|| format!("node {node} has no namespace {NS}"))?;
    Ok((ns.pinned_bytes, ns.objects))
}

fn serving(v: &ClusterView) -> usize {
    v.nodes
        .iter()
        .filter(|n| n.state == NodeState::Serving)
        .count()
}

/// Objects of `data` each node owns under `v`: `[A, B]`.
fn shares(v: &ClusterView, data: &Data) -> [u64; 2] {
    let mut own = [0u64; 2];
    for k in data.all_keys() {
        if let Some(NodeId(n)) = v.owner(k) {
            if let Some(o) = own.get_mut(n as usize) {
                *o += 1;
            }
        }
    }
    own
}

/// Waits until B joined and both nodes hold exactly their shares, as node A's view and both
/// nodes' stats report it.
async fn join_done(admin: &Client, data: &Data, launched: Instant, timeout: Duration) -> Moved {
    let mut start: Option<Instant> = None;
    let mut last = String::from("no report yet");
    // What B held at the last report: what had moved when the timeout hits.
    let mut on_b = 0;
    loop {
        let now = Instant::now();
        if now - launched >= timeout {
            let s = start.unwrap_or(now);
            return Moved {
                bytes: on_b,
                secs: (now - s).as_secs_f64(),
                lead_secs: (s - launched).as_secs_f64(),
                timed_out: true,
                refused: None,
                last,
            };
        }
        if let Ok(v) = admin.view().await {
            if serving(&v) == 2 {
                let s = *start.get_or_insert(now);
                let own = shares(&v, data);
                if let (Ok(a), Ok(b)) = (held(admin, 0).await, held(admin, 1).await) {
                    on_b = b.0;
                    last = format!(
                        "A holds {} objects ({} its own), B {} ({} its own)",
                        a.1, own[0], b.1, own[1]
                    );
                    if a.1 == own[0] && b.1 == own[1] {
                        let done = Instant::now();
                        return Moved {
                            bytes: b.0,
                            secs: (done - s).as_secs_f64(),
                            lead_secs: (s - launched).as_secs_f64(),
                            timed_out: false,
                            refused: None,
                            last,
                        };
                    }
                }
            } else {
                last = format!("node A's view: {} serving", serving(&v));
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until B is down in node A's view: it announces that once its last pass found every
/// object a new home (or its own drain timeout passed; the caller counts what A lacks).
async fn drain_done(
    admin: &Client,
    data: &Data,
    before: u64,
    t: Instant,
    timeout: Duration,
) -> Moved {
    let mut last = String::from("no report yet");
    // What A had gained at the last report: what had moved when the timeout hits.
    let mut gained = 0;
    loop {
        let now = Instant::now();
        if now - t >= timeout {
            return Moved {
                bytes: gained,
                secs: (now - t).as_secs_f64(),
                lead_secs: 0.0,
                timed_out: true,
                refused: None,
                last,
            };
        }
        if let (Ok(v), Ok(a)) = (admin.view().await, held(admin, 0).await) {
            let b = v.node(NodeId(1)).map(|n| n.state);
            gained = a.0.saturating_sub(before);
            last = format!(
                "A holds {} of {} objects, B is {} in A's view",
                a.1,
                data.objects(),
                b.map_or("absent".into(), |s| format!("{s:?}").to_lowercase())
            );
            // B announces itself down after its last pass: nothing more will come. What did
            // not arrive is reported by the caller.
            if b == Some(NodeState::Down) {
                return Moved {
                    bytes: gained,
                    secs: (Instant::now() - t).as_secs_f64(),
                    lead_secs: 0.0,
                    timed_out: false,
                    refused: None,
                    last,
                };
            }
        }
        tokio::time::sleep(POLL).await;
    }
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
    let memory = daemon::memory_for(stored);
    let conf_dir = Scratch(daemon::scratch_dir("kvpool-bench-move")?);
    let conf = conf_dir.0.join("kvpool.toml");
    std::fs::write(
        &conf,
        format!("[[namespace]]\nname = \"{NS}\"\npinned_replicas = 1\n"),
    )
    .with_context(|| format!("writing {}", conf.display()))?;
    let conf = conf.display().to_string();
    let flags = |id: &str, seed: Option<&Daemon>| {
        let mut v: Vec<String> = ["--node-id", id, "--heartbeat-ms", HEARTBEAT_MS, "--config"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.push(conf.clone());
        if let Some(s) = seed {
            v.push("--peer".into());
            v.push(s.tcp.clone());
            v.push("--cluster-secret-file".into());
            v.push(s.secret_file().display().to_string());
        }
        v
    };
    let a = Daemon::start_with(&bin, memory, &flags("0", None))?;
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
    let (probe_client, admin) = rt.block_on(async {
        let p = Client::connect(&endpoint, cfg).await?;
        let a = Client::connect(&endpoint, admin_cfg).await?;
        anyhow::Ok((p, a))
    })?;
    eprintln!(
        "  loading node A: {} in {} values of {}, pinned",
        mib(stored),
        data.objects(),
        fmt_size(args.block_size)
    );
    rt.block_on(data.load(&probe_client))?;
    let (before_a, objects_a) = rt.block_on(held(&admin, 0))?;
    ensure!(
        objects_a == data.objects(),
        "node A holds {objects_a} objects after the load, not {}",
        data.objects()
    );
    let window = Duration::from_millis(args.phase_ms);
    let timeout = Duration::from_secs(args.move_timeout_s);

    eprintln!("  idle, one node");
    // Unrecorded: opens the probe's connection.
    rt.block_on(async {
        let mut buf = vec![0u8; PROBE_SIZE as usize];
        for k in &data.probe_keys {
            probe_client.get_into(k, &mut buf).await?;
        }
        anyhow::Ok(())
    })?;
    let idle = Probe::start(rt, &probe_client, &data);
    std::thread::sleep(window);
    let idle = idle.finish(rt)?;
    if idle.misses + idle.errors > 0 {
        bail!(
            "the idle probe on one node missed {} times and failed {} times ({:?})",
            idle.misses,
            idle.errors,
            idle.first_error
        );
    }
    let idle_p99 = idle.m.quantile_ns(0.99);

    eprintln!("  node B joins");
    let probe = Probe::start(rt, &probe_client, &data);
    let launched = Instant::now();
    let b = Daemon::start_with(&bin, memory, &flags("1", Some(&a)));
    let joined = match b {
        Ok(b) => {
            let mv = rt.block_on(join_done(&admin, &data, launched, timeout));
            (b, mv)
        }
        Err(e) => {
            let _ = probe.finish(rt);
            return Err(e.context("starting node B"));
        }
    };
    let join_probe = probe.finish(rt)?;
    let (mut b, join) = joined;
    if join.done() {
        rt.block_on(data.check(&admin))
            .context("checking every value after the join")?;
    }

    eprintln!("  two nodes, idle");
    let idle2 = Probe::start(rt, &probe_client, &data);
    std::thread::sleep(window);
    let idle2 = idle2.finish(rt)?;

    eprintln!("  node B drains");
    let (before_drain, _) = rt.block_on(held(&admin, 0))?;
    let probe = Probe::start(rt, &probe_client, &data);
    let asked_at = Instant::now();
    let asked = rt.block_on(admin.drain_node(1));
    let drain = match asked {
        Ok(()) => rt.block_on(drain_done(&admin, &data, before_drain, asked_at, timeout)),
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
    let drain_probe = probe.finish(rt)?;
    // B exits by itself once drained; give it a moment, then say how it ended.
    let t = Instant::now();
    let mut exit = b.try_wait();
    while drain.done() && exit.is_none() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(POLL);
        exit = b.try_wait();
    }
    let mut lost = 0u64;
    if drain.done() {
        let (_, now_a) = rt.block_on(held(&admin, 0))?;
        lost = data.objects().saturating_sub(now_a);
        if lost == 0 {
            rt.block_on(data.check(&admin))
                .context("checking every value after the drain")?;
        }
    }
    drop(b);
    drop(a);

    let mut one = Row::from_measured(PART, "one node: idle".into(), &idle.m);
    one.misses = Some(0);
    report.rows.push(one);
    report.rows.push(move_row(
        "node B joins: moving its share to it",
        &join_probe,
        idle_p99,
        &join,
    ));
    let mut two = Row::from_measured(PART, "two nodes: idle".into(), &idle2.m);
    two.misses = Some(idle2.misses + idle2.errors);
    report.rows.push(two);
    let mut drained = move_row(
        "node B drains: moving everything back to A",
        &drain_probe,
        idle_p99,
        &drain,
    );
    if lost > 0 {
        if let Some(v) = drained.verdict.as_mut() {
            v.text.push_str(&format!("; {lost} objects lost"));
            v.met = false;
        }
    }
    report.rows.push(drained);

    let secs = |x: f64| format!("{x:.2} s");
    report.notes.push(format!(
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
        fmt_size(memory),
        mib(stored),
        data.block_keys.len(),
        fmt_size(args.block_size),
        fmt_size(PROBE_SIZE),
        before_a,
        window.as_millis(),
        POLL.as_millis(),
        timeout.as_secs(),
    ));
    report.notes.push(format!(
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
        match exit {
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
    ));
    Ok(())
}
