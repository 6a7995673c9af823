//! One poll of the cluster: its view, then each node's statistics, traffic and disk tier, asked
//! of every node at once so that one that hangs delays the poll by at most its wait.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvpool::placement::NodeInfo;
use kvpool::pool::PoolStats;
use kvpool::protocol::{DiskTierStats, NodeTraffic};
use kvpool_client::blocking::Client;

/// The cluster at one poll.
pub(crate) struct Sample {
    /// The view's version.
    pub(crate) version: u64,
    /// Every node of the view, in its order.
    pub(crate) nodes: Vec<NodeSample>,
}

/// One node at one poll.
pub(crate) struct NodeSample {
    /// Its record in the view.
    pub(crate) info: NodeInfo,
    /// When its answer came (or the poll gave up on it).
    pub(crate) at: Instant,
    /// What it answered, or why it did not.
    pub(crate) answer: Result<Answer, String>,
}

/// What a node answered.
pub(crate) struct Answer {
    /// `Stats`.
    pub(crate) stats: PoolStats,
    /// `Traffic`: None from a node of a protocol before it.
    pub(crate) traffic: Option<NodeTraffic>,
    /// `DiskStats`: None when the node has no disk tier.
    pub(crate) disk: Option<DiskTierStats>,
}

/// Polls the cluster `client` is connected to: the view from its node (the last one known when
/// that node does not answer), then every node in it that is neither down nor restarting,
/// waiting at most `wait` for their answers. A node that does not answer in time is reported
/// with an error, not waited for.
pub(crate) fn poll(client: &Client, wait: Duration) -> Sample {
    let view = client
        .view()
        .unwrap_or_else(|_| client.async_client().routing_view());
    let (tx, rx) = mpsc::channel();
    for (i, n) in view.nodes.iter().enumerate() {
        if !n.state.reachable() {
            continue;
        }
        let (client, tx, id) = (client.clone(), tx.clone(), n.id);
        // A node that hangs holds its thread until the client's call times out; the poll does
        // not wait for it, and the answer, when it comes, goes nowhere.
        std::thread::spawn(move || {
            let answer = ask(&client, id);
            let _ = tx.send((i, Instant::now(), answer));
        });
    }
    drop(tx);
    let deadline = Instant::now() + wait;
    let mut answers: Vec<Option<(Instant, Result<Answer, String>)>> =
        view.nodes.iter().map(|_| None).collect();
    while let Ok((i, at, answer)) =
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
    {
        answers[i] = Some((at, answer));
    }
    let now = Instant::now();
    let nodes = view
        .nodes
        .into_iter()
        .zip(answers)
        .map(|(info, a)| {
            let (at, answer) = a.unwrap_or_else(|| {
                let why = if !info.state.reachable() {
                    format!("{} in the cluster view", info.state.name())
                } else {
                    format!("no answer within {} ms", wait.as_millis())
                };
                (now, Err(why))
            });
            NodeSample { info, at, answer }
        })
        .collect();
    Sample {
        version: view.version,
        nodes,
    }
}

/// Asks node `id` for its statistics, traffic and disk tier.
fn ask(client: &Client, id: u32) -> Result<Answer, String> {
    let stats = client.node_stats(id).map_err(|e| e.to_string())?;
    let traffic = client.node_traffic(id).map_err(|e| e.to_string())?;
    let disk = client.node_disk_stats(id).map_err(|e| e.to_string())?;
    Ok(Answer {
        stats,
        traffic,
        disk,
    })
}
