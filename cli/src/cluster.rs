//! `kvpool cluster`: the cluster's view with each node's use, and draining a node out of it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Subcommand;
use kvpool_client::blocking::Client;
use kvpool_client::ClientConfig;
use serde_json::json;

#[derive(Subcommand, Debug)]
pub(crate) enum ClusterCmd {
    /// Print the cluster view: every node with its address, capacity and use, state and
    /// epoch, and the view's version.
    Status {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drain a node: it takes no new objects, moves its pinned objects to their new owners,
    /// hands its unpinned ones (KV blocks) to theirs, hottest first, until `drain_timeout_ms`
    /// (`[cluster] handover`), then leaves the cluster and exits. Needs the cluster secret
    /// (and the node token when nodes have one).
    Drain {
        /// Node id.
        node: u32,
        /// Wait until the node has left (state down).
        #[arg(long)]
        wait: bool,
        /// File holding the cluster secret [default: cluster.secret in the data directory of
        /// the endpoint's node, when it runs on this host].
        #[arg(long, env = "KVPOOL_CLUSTER_SECRET_FILE")]
        cluster_secret_file: Option<PathBuf>,
    },
}

/// Runs a `kvpool cluster` command against the node at `endpoint`.
pub(crate) fn run(
    endpoint: &str,
    cfg: ClientConfig,
    client: &Client,
    cmd: &ClusterCmd,
) -> anyhow::Result<i32> {
    match cmd {
        ClusterCmd::Status { json } => status(client, *json),
        ClusterCmd::Drain {
            node,
            wait,
            cluster_secret_file,
        } => {
            let path = match cluster_secret_file {
                Some(p) => p.clone(),
                None => local_secret_file(client.async_client().hello())?,
            };
            drain(endpoint, cfg, client, &path, *node, *wait)
        }
    }
}

/// `kvpool cluster status`: the view, with each live node's use.
fn status(client: &Client, json: bool) -> anyhow::Result<i32> {
    let view = client.async_client().routing_view();
    let view = client.view().unwrap_or(view);
    let rows: Vec<ClusterRow> = view
        .nodes
        .iter()
        .map(|n| {
            let stats = n
                .state
                .reachable()
                .then(|| client.node_stats(n.id).ok())
                .flatten();
            (n.clone(), stats)
        })
        .collect();
    if json {
        println!("{}", cluster_json(view.version, &rows));
    } else {
        print_cluster(view.version, &rows);
    }
    Ok(0)
}

/// `kvpool cluster drain`: asks node `node` to drain, over a connection that proves the
/// cluster secret in `secret_file`; with `wait`, until the node has left.
fn drain(
    endpoint: &str,
    cfg: ClientConfig,
    client: &Client,
    secret_file: &std::path::Path,
    node: u32,
    wait: bool,
) -> anyhow::Result<i32> {
    let secret = std::fs::read(secret_file)
        .map_err(anyhow::Error::from)
        .and_then(|b| {
            kvpool::protocol::auth::ClusterSecret::from_file_contents(&b)
                .map_err(anyhow::Error::from)
        })
        .with_context(|| format!("reading the cluster secret {}", secret_file.display()))?;
    let control = Client::connect(
        endpoint,
        ClientConfig {
            cluster_secret: Some(secret),
            ..cfg
        },
    )
    .with_context(|| format!("connecting to {endpoint} as a cluster peer"))?;
    control.drain_node(node)?;
    eprintln!("node {node} is draining");
    if !wait {
        return Ok(0);
    }
    let start = std::time::Instant::now();
    loop {
        let v = client.view()?;
        let gone = v
            .node(kvpool::NodeId(node))
            .is_none_or(|n| n.state == kvpool::placement::NodeState::Down);
        if gone {
            eprintln!("node {node} has left");
            return Ok(0);
        }
        if start.elapsed() > Duration::from_secs(600) {
            bail!("node {node} is still draining after 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The cluster secret file of the endpoint's node, when it runs on this host: next to its Unix
/// socket, in its data directory.
fn local_secret_file(hello: &kvpool::protocol::HelloInfo) -> anyhow::Result<PathBuf> {
    let dir = std::path::Path::new(&hello.uds_path).parent();
    match dir {
        Some(d) if hello.host_id == kvpool::segment::host_id() && !hello.uds_path.is_empty() => {
            Ok(d.join("cluster.secret"))
        }
        _ => bail!(
            "node {} runs on another host: pass --cluster-secret-file with a copy of the \
             cluster secret",
            hello.node
        ),
    }
}

type ClusterRow = (kvpool::placement::NodeInfo, Option<kvpool::pool::PoolStats>);

fn used_bytes(s: &kvpool::pool::PoolStats) -> u64 {
    s.segments.iter().map(|g| g.used_bytes).sum()
}

fn print_cluster(version: u64, rows: &[ClusterRow]) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!("cluster view version {version}, {} nodes", rows.len());
    println!(
        "{:>5}  {:<9} {:>5}  {:<22} {:>11} {:>11} {:>10}",
        "node", "state", "epoch", "tcp", "capacity", "used", "objects"
    );
    for (n, s) in rows {
        let (used, objects) = match s {
            Some(s) => (
                format!("{:.3} GiB", gib(used_bytes(s))),
                s.objects.to_string(),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:>5}  {:<9} {:>5}  {:<22} {:>7.3} GiB {:>11} {:>10}",
            n.id,
            n.state.name(),
            n.epoch,
            n.tcp,
            gib(n.capacity),
            used,
            objects
        );
    }
}

/// `kvpool cluster status --json`: the view as one JSON object; a node whose statistics could
/// not be read has `null` use.
fn cluster_json(version: u64, rows: &[ClusterRow]) -> serde_json::Value {
    let nodes: Vec<_> = rows
        .iter()
        .map(|(n, s)| {
            json!({
                "id": n.id,
                "state": n.state.name(),
                "epoch": n.epoch,
                "tcp": n.tcp,
                "quic": n.quic,
                "metrics": n.metrics,
                "capacity": n.capacity,
                "used_bytes": s.as_ref().map(used_bytes),
                "objects": s.as_ref().map(|s| s.objects),
            })
        })
        .collect();
    json!({ "version": version, "nodes": nodes })
}
