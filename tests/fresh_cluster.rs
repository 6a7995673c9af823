//! Fresh clusters: pinned objects (model weights) acknowledged through the first node while
//! the others are still joining are readable, byte for byte, through every node from then on,
//! while the joiners turn serving and take their share of the keys. Real `kvpoold` processes
//! on loopback with fast heartbeats (100 ms, down after 600 ms), formed afresh round after
//! round, since what a read meets depends on how it falls against the join's view changes and
//! the movers that follow them. Every wait is bounded.

mod common;

use common::cluster::{cfg, serving, start_node, wait_view};
use common::{value, Node};
use kvpool_client::{Client, SameHost};

const HEARTBEAT: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "600"];
/// Pinned values put per round.
const KEYS: u64 = 40;
/// Rounds per cluster size (2 and 3 nodes).
const ROUNDS: u64 = 25;
/// Passes over every key through every node a round may take before its views settle.
const MAX_PASSES: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_pinned_keys_read_from_every_node_of_a_fresh_cluster() {
    let mut failed = Vec::new();
    for round in 0..2 * ROUNDS {
        let size = 2 + (round % 2) as u32;
        let misses = fresh_round(round, size).await;
        if !misses.is_empty() {
            failed.push(format!(
                "round {round} ({size} nodes): {}",
                misses.join(", ")
            ));
        }
    }
    println!(
        "{} of {} fresh clusters missed an acknowledged pinned key",
        failed.len(),
        2 * ROUNDS
    );
    assert!(failed.is_empty(), "{failed:#?}");
}

/// Forms a cluster of `size` fresh nodes (the others joining through node 0), puts the pinned
/// values through node 0 as soon as its view lists every node, then reads each acknowledged one
/// through every node, pass after pass, until a pass that began with every node's view showing
/// every node serving. Returns the misses, as `key@node`; wrong bytes fail at once.
async fn fresh_round(round: u64, size: u32) -> Vec<String> {
    let first = start_node(0, "64MiB", None, HEARTBEAT);
    let c0 = client(&first, SameHost::Off).await;
    let mut nodes = vec![first];
    for id in 1..size {
        nodes.push(start_node(id, "64MiB", Some(&nodes[0]), HEARTBEAT));
    }
    wait_view(&c0, "the first node lists every node", |v| {
        v.nodes.len() == size as usize
    })
    .await;
    let mut acked = Vec::new();
    for i in 0..KEYS {
        let put = c0.put_pinned(&pinned_key(i), &pinned_value(round, i)).await;
        if put.is_ok() {
            acked.push(i);
        }
    }
    assert!(
        !acked.is_empty(),
        "round {round}: no pinned put acknowledged"
    );
    // Half the rounds read over the same-host path (lookups, then the mapping).
    let same_host = match round % 4 {
        0 | 1 => SameHost::Off,
        _ => SameHost::Auto,
    };
    let mut missing = Vec::new();
    for _ in 0..MAX_PASSES {
        let settled = all_serving(&nodes, size).await;
        for (id, n) in nodes.iter().enumerate() {
            // A client that connects now, knowing only the node's view of this moment.
            let c = client(n, same_host).await;
            for &i in &acked {
                match c.get(&pinned_key(i)).await.unwrap() {
                    Some(v) => assert!(
                        v == pinned_value(round, i),
                        "round {round}: key {i} through node {id}: wrong bytes"
                    ),
                    None => missing.push(format!("{i}@{id}")),
                }
            }
        }
        if settled {
            missing.dedup();
            return missing;
        }
    }
    panic!("round {round}: the views never showed every node serving");
}

/// Whether every node's view shows all `size` nodes serving.
async fn all_serving(nodes: &[Node], size: u32) -> bool {
    for n in nodes {
        let v = client(n, SameHost::Off).await.view().await.unwrap();
        if serving(&v) != size as usize {
            return false;
        }
    }
    true
}

fn pinned_key(i: u64) -> Vec<u8> {
    format!("weights/layer-{i:03}").into_bytes()
}

/// The value of pinned key `i` in round `round`: 4 to 44 KB.
fn pinned_value(round: u64, i: u64) -> Vec<u8> {
    let len = 4096 + (i * 7919 + round * 104_729) % (40 * 1024);
    value(round * 1_000 + i, len as usize)
}

/// A client connected to `n`.
async fn client(n: &Node, same_host: SameHost) -> Client {
    Client::connect(&n.tcp_url(), cfg(same_host)).await.unwrap()
}
