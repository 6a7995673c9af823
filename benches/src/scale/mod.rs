//! `kvpool-bench scale`: a pool of many `kvpoold`s on this machine (64 by default, small
//! segments on loopback), with static peers and with etcd, and what its size costs:
//!
//! - how long every node's view takes to converge after the start (all serving in every
//!   view), after a join (one more node) and after a kill (SIGKILL: every other node marks it
//!   down), and after a drain;
//! - the idle pool's coordination traffic per node per second (`traffic`);
//! - the share of a known key set a join and a drain move, by the client's placement and by
//!   what the nodes handed over, against the ideal 1/N (`moves`); every key read back after;
//! - a client's routing cost at 3 nodes and at N, in the same run (`routing`);
//! - a node's memory per object for 16 KiB and 2 MiB objects (`metadata`).
//!
//! Every wait is bounded (`--timeout-s`); every process started is stopped when the run ends,
//! fails, or is interrupted. Nothing here asserts on time: the figures are printed as a table.

mod etcd;
mod fleet;
mod metadata;
mod moves;
mod report;
mod routing;
mod traffic;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvpool::placement::NodeState;
use kvpool_bench::units;
use kvpool_client::{Client, ClientConfig};

use crate::perf::daemon::{self, scratch_dir};
use fleet::{poll_cfg, serving, state_of, Fleet, Membership, NodeSpec};
use moves::KeySet;
use report::{ModeFigures, ScaleReport};

/// Flags of `kvpool-bench scale`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ScaleArgs {
    /// Nodes started (a join adds one more).
    #[arg(long, default_value_t = 64)]
    nodes: u32,
    /// Membership modes to run, comma-separated: static, etcd.
    #[arg(long, value_delimiter = ',', default_value = "static,etcd")]
    membership: Vec<String>,
    /// Segment size of each node.
    #[arg(long, default_value = "4MiB", value_parser = units::parse_size)]
    memory: u64,
    /// Tokio worker threads of each node (`TOKIO_WORKER_THREADS`).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Heartbeat period of each node, ms (the daemon's default).
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// A node silent this long is marked down, ms (the daemon's default).
    #[arg(long, default_value_t = 2000)]
    down_after_ms: u64,
    /// Keys of the key set the join and the drain move.
    #[arg(long, default_value_t = 20_000)]
    keys: usize,
    /// Value size of the key set.
    #[arg(long, default_value = "1KiB", value_parser = units::parse_size)]
    value_size: u64,
    /// Pause after the start converged, before the traffic is measured, seconds.
    #[arg(long, default_value_t = 5)]
    settle_s: u64,
    /// Length of the traffic measurement, seconds.
    #[arg(long, default_value_t = 10)]
    window_s: u64,
    /// Bound of every wait (convergence, handover), seconds.
    #[arg(long, default_value_t = 180)]
    timeout_s: u64,
    /// Passes of the routing measurement per view size.
    #[arg(long, default_value_t = 5)]
    routing_reps: usize,
    /// Segment of the node the per-object memory is measured on.
    #[arg(long, default_value = "512MiB", value_parser = units::parse_size)]
    metadata_memory: u64,
    /// Skip the per-object memory measurement.
    #[arg(long)]
    no_metadata: bool,
    /// The kvpoold binary [default: kvpoold next to this executable].
    #[arg(long)]
    kvpoold: Option<PathBuf>,
    /// The etcd binary [default: etcd on PATH].
    #[arg(long)]
    etcd: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Runs every part and prints the tables.
pub(crate) fn run(args: ScaleArgs) -> anyhow::Result<()> {
    if args.nodes < 4 {
        bail!("--nodes must be at least 4 (nodes 1 and 2 are drained and killed)");
    }
    let machine = crate::perf::machine::Machine::detect();
    eprintln!("kvpool-bench scale — {}", machine.describe());
    let rt = crate::perf::runtime(&machine)?;
    let bin = args.kvpoold.clone().unwrap_or_else(daemon::default_binary);
    let began = Instant::now();
    let mut report = ScaleReport::new(args.nodes);
    for mode in &args.membership {
        let figures = rt.block_on(run_mode(&args, &bin, mode))?;
        report.modes.push(figures);
    }
    report.routing = routing::measure(args.nodes, args.routing_reps).to_vec();
    if !args.no_metadata {
        for size in [16u64 << 10, 2 << 20] {
            eprintln!("  metadata: {} objects", units::fmt_size(size));
            let m = rt.block_on(metadata::measure(&bin, args.metadata_memory, size))?;
            report.metadata.push(m);
        }
    }
    crate::perf::render::publish(&report.render(), began, args.json.as_deref(), |cmdline| {
        report.to_json(cmdline)
    })?;
    let wrong: usize = report.modes.iter().map(|m| m.wrong).sum();
    if wrong > 0 {
        bail!("{wrong} reads returned wrong bytes");
    }
    Ok(())
}

/// One membership mode: start, traffic, key set, join, drain, kill, read back.
async fn run_mode(
    args: &ScaleArgs,
    bin: &std::path::Path,
    mode: &str,
) -> anyhow::Result<ModeFigures> {
    let n = args.nodes;
    let bound = Duration::from_secs(args.timeout_s);
    let scratch = scratch_dir("kvpool-scale")?;
    let _cleanup = RemoveDir(scratch.clone());
    let secret = scratch.join("cluster.secret");
    fleet::write_secret(&secret)?;
    let etcd = match mode {
        "static" => None,
        "etcd" => {
            let bin = etcd::find(args.etcd.as_deref())
                .context("no etcd binary (Debian: apt-get install etcd-server; or --etcd)")?;
            Some(etcd::Etcd::start(&bin, scratch.join("etcd"))?)
        }
        other => bail!("unknown membership {other:?}: static or etcd"),
    };
    let membership = match &etcd {
        None => Membership::Static,
        Some(e) => Membership::Etcd {
            url: e.url(),
            prefix: "/kvpool-scale/".into(),
        },
    };
    let spec = NodeSpec {
        bin: bin.to_path_buf(),
        memory: args.memory,
        heartbeat_ms: args.heartbeat_ms,
        down_after_ms: args.down_after_ms,
        threads: args.threads,
        membership,
        secret: secret.clone(),
    };
    let mut f = ModeFigures::new(mode);
    eprintln!("  {mode}: starting {n} nodes");
    let spawned = Instant::now();
    let mut fleet = Fleet::start(spec, n).await?;
    f.spawn = spawned.elapsed();
    let ready = Instant::now();
    let c = fleet
        .converge("start", ready, bound, |v| serving(v) == n as usize)
        .await?;
    f.start = c.after;
    f.start_rounds = c.rounds;
    eprintln!(
        "  {mode}: converged {:?} after the last ready line",
        c.after
    );

    tokio::time::sleep(Duration::from_secs(args.settle_s)).await;
    f.traffic = traffic::measure(&fleet, etcd.as_ref(), Duration::from_secs(args.window_s)).await?;
    f.etcd_rss = etcd.as_ref().map(|e| proc_rss(e.pid()));

    let set = KeySet::new(args.keys, args.value_size as usize);
    let writer = Client::connect(&fleet.endpoint(), poll_cfg()).await?;
    set.put(&writer).await?;
    let v_before = writer.view().await?;

    // Join: node n, timed from its spawn.
    let t = Instant::now();
    let (handed0, _) = moves::handover(&fleet)?;
    fleet.add(n).await?;
    let c = fleet
        .converge("join", t, bound, |v| serving(v) == n as usize + 1)
        .await?;
    f.join = c.after;
    let handed = moves::settled(&fleet, bound, || async { Ok(moves::handover(&fleet)?.0) }).await?;
    f.join_handed = (handed - handed0) as f64 / set.keys.len() as f64;
    let v_joined = writer.view().await?;
    f.join_moved = set.moved(&v_before, &v_joined);
    eprintln!("  {mode}: join converged in {:?}", f.join);

    // Drain: node 1 hands its objects over and leaves.
    let held_before = objects_except(&fleet, 1).await?;
    let admin = admin_client(&fleet, &secret).await?;
    let t = Instant::now();
    admin.drain_node(1).await.context("draining node 1")?;
    wait_exit(&mut fleet, 1, bound).await?;
    let c = fleet
        .converge("drain", t, bound, |v| {
            state_of(v, 1) != Some(NodeState::Serving) && serving(v) == n as usize
        })
        .await?;
    f.drain = c.after;
    let held_after = moves::settled(&fleet, bound, || moves::objects(&fleet)).await?;
    f.drain_handed = held_after.saturating_sub(held_before) as f64 / set.keys.len() as f64;
    let v_drained = fleet_view(&fleet).await?;
    f.drain_moved = set.moved(&v_joined, &v_drained);
    eprintln!("  {mode}: drain converged in {:?}", f.drain);

    // Kill: node 2, SIGKILL; every other node must mark it down.
    let t = Instant::now();
    fleet.kill(2);
    let c = fleet
        .converge("kill", t, bound, |v| {
            state_of(v, 2) == Some(NodeState::Down)
        })
        .await?;
    f.kill = c.after;
    eprintln!("  {mode}: kill seen by all in {:?}", f.kill);

    let (hit, miss, wrong) = set.check(&fleet.endpoint()).await?;
    f.hits = hit as f64 / set.keys.len() as f64;
    f.misses = miss;
    f.wrong = wrong;
    f.live = fleet.members.iter().filter(|m| m.alive).count() as u32;
    drop(fleet);
    drop(etcd);
    Ok(f)
}

/// Objects held by the live nodes other than `id`.
async fn objects_except(fleet: &Fleet, id: u32) -> anyhow::Result<u64> {
    let mut n = 0;
    for m in fleet.members.iter().filter(|m| m.alive && m.id != id) {
        if let Some(c) = &m.client {
            n += c.node_stats(m.id).await?.objects;
        }
    }
    Ok(n)
}

/// A live node's view.
async fn fleet_view(fleet: &Fleet) -> anyhow::Result<kvpool::placement::ClusterView> {
    let c = fleet
        .members
        .iter()
        .filter(|m| m.alive)
        .find_map(|m| m.client.as_ref())
        .context("no live node")?;
    Ok(c.view().await?)
}

/// A client holding the cluster secret (what `Drain` needs).
async fn admin_client(fleet: &Fleet, secret: &std::path::Path) -> anyhow::Result<Client> {
    let text = std::fs::read(secret)?;
    let secret = kvpool::protocol::auth::ClusterSecret::from_file_contents(&text)
        .map_err(|e| anyhow::anyhow!("the cluster secret: {e}"))?;
    let cfg = ClientConfig {
        cluster_secret: Some(secret),
        ..poll_cfg()
    };
    Ok(Client::connect(&fleet.endpoint(), cfg).await?)
}

/// Waits (at most `bound`) for drained node `id` to exit by itself.
async fn wait_exit(fleet: &mut Fleet, id: u32, bound: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    let m = fleet.member(id);
    while m.daemon.try_wait().is_none() {
        if t.elapsed() > bound {
            bail!("drained node {id} did not exit within {bound:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    m.alive = false;
    m.client = None;
    Ok(())
}

fn proc_rss(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .map_or(0, |kib: u64| kib << 10)
}

/// Removes the run's scratch directory (the secret, etcd's data) when the mode ends.
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
