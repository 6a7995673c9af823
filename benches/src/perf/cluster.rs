//! kvpool as a cluster on this machine: 1, 2 and 4 `kvpoold`s joined into one pool, gets of the
//! largest configured size over loopback TCP (same-host path off) from clients that route each
//! key to its owner. Reported as the ratio of aggregate throughput to one daemon's, measured in
//! the same run: on a machine with few cores the daemons share them, so this shows what
//! routing costs rather than how a cluster of real hosts scales.
//!
//! Then the extra hop: with 3 daemons serving a data set, a 4th joins. Keys that now hash to
//! it miss there and are fetched from their previous owner (the client's fallback, one extra
//! round trip); the other keys are one hop as before. Both are measured one get at a time,
//! alternating, and their latencies compared.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvpool::placement::NodeState;
use kvpool_client::{Client, ClientConfig, SameHost};

use super::compare::{interleave_tasks, AnyWorker};
use super::daemon::{self, Daemon};
use super::driver::Measured;
use super::report::{Ref, Report, Row};
use super::workloads::{self, Buffers, KvGet};
use super::{Ctx, Section};

/// Cluster sizes measured.
const NODES: [usize; 3] = [1, 2, 4];

/// Starts `n` daemons as one cluster (node 0 first, the others joining through it) with
/// `memory` bytes each, and waits until a client of node 0 sees all of them serving.
fn start_cluster(ctx: &Ctx, n: usize, memory: u64) -> anyhow::Result<(Vec<Daemon>, String)> {
    let bin = ctx
        .args
        .kvpoold
        .clone()
        .unwrap_or_else(daemon::default_binary);
    start_daemons(&ctx.rt, &bin, n, memory)
}

/// Starts `n` daemons of binary `bin` as one cluster with `memory` bytes each (node 0 first,
/// the others joining through it) and waits until node 0 sees all of them serving; returns
/// them and node 0's endpoint.
pub(crate) fn start_daemons(
    rt: &tokio::runtime::Runtime,
    bin: &std::path::Path,
    n: usize,
    memory: u64,
) -> anyhow::Result<(Vec<Daemon>, String)> {
    let mut nodes: Vec<Daemon> = Vec::new();
    for id in 0..n {
        let mut extra = vec![
            "--node-id".to_string(),
            id.to_string(),
            "--heartbeat-ms".into(),
            "100".into(),
        ];
        if let Some(seed) = nodes.first() {
            extra.push("--peer".into());
            extra.push(seed.tcp.clone());
            extra.push("--cluster-secret-file".into());
            extra.push(seed.secret_file().display().to_string());
        }
        nodes.push(Daemon::start_with(bin, memory, &extra)?);
    }
    let endpoint = format!("tcp://{}", nodes[0].tcp);
    rt.block_on(wait_serving(&endpoint, n))?;
    Ok((nodes, endpoint))
}

/// Waits (20 s at most) until node `endpoint`'s view has `n` serving nodes.
async fn wait_serving(endpoint: &str, n: usize) -> anyhow::Result<()> {
    let c = Client::connect(endpoint, ClientConfig::default()).await?;
    let t = Instant::now();
    loop {
        let v = c.view().await?;
        if v.nodes
            .iter()
            .filter(|x| x.state == NodeState::Serving)
            .count()
            == n
        {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!("the cluster did not reach {n} serving nodes: {v:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn client_cfg(ctx: &Ctx) -> ClientConfig {
    ClientConfig {
        same_host: SameHost::Off,
        verify_checksums: !ctx.args.no_verify,
        ..ClientConfig::default()
    }
}

/// Aggregate throughput of 1, 2 and 4 daemons, then the extra hop.
pub(crate) fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let size = ctx.args.sizes.iter().copied().max().context("no sizes")?;
    let keys = workloads::keys(size);
    let stored = keys.len() as u64 * size;
    let window = ctx.window();
    let cfg = client_cfg(ctx);
    for n in NODES {
        let memory = (stored * 3 / 2 / n as u64 + (256 << 20)).next_multiple_of(256 << 20);
        let (nodes, endpoint) = start_cluster(ctx, n, memory)?;
        eprintln!("  {n} daemon(s), {} MiB each", memory >> 20);
        let loader = ctx.rt.block_on(Client::connect(&endpoint, cfg.clone()))?;
        ctx.rt.block_on(workloads::store(&loader, &keys, size))?;
        for conns in ctx.args.conns.clone() {
            let m = ctx.rt.block_on(async {
                let mut side = Vec::new();
                for w in 0..conns {
                    // Clients connect to the nodes in turn; each routes to every owner.
                    let ep = format!("tcp://{}", nodes[w % n].tcp);
                    let c = Client::connect(&ep, cfg.clone()).await?;
                    side.push(AnyWorker::KvGet(KvGet::new(
                        c,
                        keys.clone(),
                        size,
                        1,
                        w * keys.len() / conns,
                        Buffers::default(),
                    )));
                }
                interleave_tasks(&mut [side], window).await
            })?;
            let mut row = Row::new(Section::Cluster, &format!("kvpool ×{n}"), "get")
                .shape(size, conns, 1)
                .measured(&m[0]);
            if n > 1 {
                let one = ctx
                    .report
                    .find(Section::Cluster, "kvpool ×1", "get", &row)
                    .and_then(|r| r.gbps);
                if let (Some(base), Some(g)) = (one, row.gbps) {
                    row.refs.push(Ref::new("1 daemon", g / base));
                }
            }
            ctx.report.push(row);
        }
        drop(nodes);
    }
    hop(ctx, &cfg)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    ctx.report.note(
        Section::Cluster,
        format!(
            "all daemons and the clients share this machine's {cores} cores, so aggregate \
             throughput here measures what routing and more processes cost, not how a cluster of \
             hosts scales; clients connect to the nodes in turn and route each get to its key's \
             owner (weighted rendezvous hashing over equal capacities); same_host: Off; the 1-daemon \
             rows are the reference of the others (same run, same data set of {} values)",
            keys.len()
        ),
    );
    Ok(())
}

/// Gets of keys whose owner changed when a 4th node joined (miss on the new owner, hit on the
/// previous one) against keys that stayed, one get at a time.
fn hop(ctx: &mut Ctx, cfg: &ClientConfig) -> anyhow::Result<()> {
    let size = ctx.args.sizes.iter().copied().min().context("no sizes")?;
    let keys: Vec<Vec<u8>> = (0..2_000)
        .map(|i| format!("hop/{size}/{i:06}").into_bytes())
        .collect();
    let memory = (keys.len() as u64 * size * 2 + (256 << 20)).next_multiple_of(256 << 20);
    let (mut nodes, endpoint) = start_cluster(ctx, 3, memory)?;
    let client = ctx.rt.block_on(Client::connect(&endpoint, cfg.clone()))?;
    ctx.rt.block_on(workloads::store(&client, &keys, size))?;
    let fourth = join_fourth(ctx, &nodes[0], memory)?;
    nodes.push(fourth);
    ctx.rt.block_on(wait_serving(&endpoint, 4))?;
    // The client loaded the keys under the 3-node view; it adopts the new one now and keeps
    // the old one for the fallback.
    let view = ctx.rt.block_on(client.view())?;
    let (moved, stayed): (Vec<Vec<u8>>, Vec<Vec<u8>>) = keys
        .iter()
        .cloned()
        .partition(|k| view.owner(k).is_some_and(|o| o.0 == 3));
    anyhow::ensure!(!moved.is_empty(), "no key moved to the new node");
    let window = ctx.window();
    let m = ctx.rt.block_on(async {
        let a = AnyWorker::KvGet(KvGet::new(
            client.clone(),
            Arc::new(stayed.clone()),
            size,
            1,
            0,
            Buffers::default(),
        ));
        let b = AnyWorker::KvGet(KvGet::new(
            client.clone(),
            Arc::new(moved.clone()),
            size,
            1,
            0,
            Buffers::default(),
        ));
        interleave_tasks(&mut [vec![a], vec![b]], window).await
    })?;
    push_hop_rows(&mut ctx.report, &m, size);
    ctx.report.note(
        Section::Cluster,
        format!(
            "extra hop: 3 daemons hold {} values of {}; a 4th joins and owns {} of them, which it \
             does not have: the client misses there and reads them from the previous owner \
             (fallback_window); the other keys take one hop; one get at a time, alternating",
            keys.len(),
            kvpool_bench::units::fmt_size(size),
            moved.len()
        ),
    );
    drop(nodes);
    Ok(())
}

/// Starts node 3 with `memory` bytes, joining the cluster through `seed`.
fn join_fourth(ctx: &Ctx, seed: &Daemon, memory: u64) -> anyhow::Result<Daemon> {
    let bin = ctx
        .args
        .kvpoold
        .clone()
        .unwrap_or_else(daemon::default_binary);
    let secret = seed.secret_file().display().to_string();
    let extra: Vec<String> = [
        "--node-id",
        "3",
        "--heartbeat-ms",
        "100",
        "--peer",
        &seed.tcp,
        "--cluster-secret-file",
        &secret,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    Daemon::start_with(&bin, memory, &extra)
}

/// The extra hop's rows from its measurement `m`: keys that stayed (one hop), then keys that
/// moved (two hops) with their p50 against the first.
fn push_hop_rows(report: &mut Report, m: &[Measured], size: u64) {
    let one = Row::new(Section::Cluster, "owner (1 hop)", "get")
        .shape(size, 1, 1)
        .measured(&m[0]);
    let mut two = Row::new(Section::Cluster, "previous owner (2 hops)", "get")
        .shape(size, 1, 1)
        .measured(&m[1]);
    if let (Some(a), Some(b)) = (one.p50_ns, two.p50_ns) {
        two.refs.push(Ref::new("1-hop p50", b / a));
    }
    report.push(one);
    report.push(two);
}
