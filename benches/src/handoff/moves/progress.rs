//! When a move is done, as the nodes report it: node A's view and both nodes' per-namespace
//! object counts, polled.

use std::time::{Duration, Instant};

use anyhow::Context;
use kvpool::placement::{ClusterView, NodeState};
use kvpool::NodeId;
use kvpool_client::Client;

use super::data::Data;
use super::{NS, POLL};

/// One move as the nodes reported it.
pub(super) struct Moved {
    /// Bytes of pinned objects that changed node.
    pub(super) bytes: u64,
    /// From the move's start (B seen serving, or the drain asked for) to the reports showing
    /// it done, or to the timeout.
    pub(super) secs: f64,
    /// From B's start, or the drain's call, to the move's start.
    pub(super) lead_secs: f64,
    pub(super) timed_out: bool,
    /// Not started: the drain was refused (B never joined), and why.
    pub(super) refused: Option<String>,
    /// What the nodes reported last (for the timeout's note).
    pub(super) last: String,
}

impl Moved {
    /// The nodes reported the move done.
    pub(super) fn done(&self) -> bool {
        !self.timed_out && self.refused.is_none()
    }
}

/// The namespace's pinned bytes and objects on `node`, from its own `Stats`.
pub(super) async fn held(c: &Client, node: u32) -> anyhow::Result<(u64, u64)> {
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
pub(super) async fn join_done(
    admin: &Client,
    data: &Data,
    launched: Instant,
    timeout: Duration,
) -> Moved {
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
pub(super) async fn drain_done(
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
