//! A rolling restart keeps the cache: each node of a 4-node cluster in turn is stopped with
//! SIGTERM (in a cluster it drains: its objects go to the nodes that own their keys while it is
//! away) and started again with the same flags on the same directory and addresses; once it
//! serves again, every key it held before its stop is read back, byte-exact, and so is every
//! other key (drained objects are handed back best effort).
//!
//! A restart in place (`--restart-on-shutdown`) keeps its keys instead: while it is away they
//! are misses and their writes are refused, nothing moves, and the next process serves the
//! objects it recovered; one that comes back past the restart window joins afresh and never
//! serves a copy older than a write the others took meanwhile. Static membership with fast
//! heartbeats; every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{cfg, cluster_args, fill, key, serving, wait_view};
use common::{value, Node};
use kvpool::placement::{ClusterView, NodeState};
use kvpool::NodeId;
use kvpool_client::{Client, SameHost};

const HEARTBEAT: [&str; 4] = ["--heartbeat-ms", "100", "--down-after-ms", "600"];
const NODES: u32 = 4;
const KEYS: u64 = 2000;
const MEMORY: &str = "32MiB";

/// The flags node `id` runs with, in every life: the cluster's (node 0 the seed), fast
/// heartbeats.
fn flags(id: u32, seed: Option<&Node>) -> Vec<String> {
    let mut f = cluster_args(id, seed);
    f.extend(HEARTBEAT.iter().map(|s| s.to_string()));
    f
}

fn start_with(
    id: u32,
    seed: Option<&Node>,
    dir: Option<(&std::path::Path, [&str; 3])>,
    extra: &[&str],
) -> Node {
    let mut f = flags(id, seed);
    f.extend(extra.iter().map(|s| s.to_string()));
    let f: Vec<&str> = f.iter().map(String::as_str).collect();
    match dir {
        None => Node::start(MEMORY, &f),
        Some((dir, addrs)) => Node::start_in(dir.to_path_buf(), MEMORY, &f, &addrs),
    }
}

/// Reads every key of `held` through `c` until all are present (at most 20 s); every value read
/// must be the one written. Returns how long that took.
async fn wait_all_present(c: &Client, held: &[u64]) -> Duration {
    wait_present(c, held, held.len()).await
}

/// Reads every key of `held` through `c` until at least `want` are present (at most 20 s);
/// every value read must be the one written. Returns how long that took.
async fn wait_present(c: &Client, held: &[u64], want: usize) -> Duration {
    let t = Instant::now();
    loop {
        let mut present = 0;
        for &i in held {
            if let Ok(Some(v)) = c.get(&key(i)).await {
                assert_eq!(v, value(i, 256), "key {i}: wrong bytes");
                present += 1;
            }
        }
        if present >= want {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{} of {} keys still missing",
            held.len() - present,
            held.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Restarts each node of a 4-node cluster in turn (SIGTERM, then a start with the same flags
/// on the same directory and addresses), with `extra` flags on every node; after each restart,
/// waits until at least `share` of the keys the node held are served again, through a client
/// of the restarted node, and as many of the other keys through a client of another node;
/// every value read is the one written.
async fn rolling_restart(extra: &[&str], share: f64) {
    let mut nodes = vec![start_with(0, None, None, extra)];
    for id in 1..NODES {
        let n = start_with(id, Some(&nodes[0]), None, extra);
        nodes.push(n);
    }
    let c = Client::connect(&nodes[1].tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "4 serving", |v| serving(v) == NODES as usize).await;
    assert_eq!(fill(&c, 0..KEYS).await as u64, KEYS);
    for id in 0..NODES {
        let other = &nodes[((id + 1) % NODES) as usize];
        let c = Client::connect(&other.tcp_url(), cfg(SameHost::Off))
            .await
            .unwrap();
        let view = c.view().await.unwrap();
        let held: Vec<u64> = (0..KEYS)
            .filter(|&i| view.owner(&key(i)) == Some(NodeId(id)))
            .collect();
        assert!(!held.is_empty(), "node {id} holds some keys");

        let (dir, addrs) = stop_for_restart(&mut nodes, id);
        let addrs = [addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()];
        // Node 0, the seed, starts again with no peers: its view (restarting in place) or the
        // others' heartbeats bring it back.
        let seed = (id != 0).then(|| &nodes[0]);
        nodes[id as usize] = start_with(id, seed, Some((&dir, addrs)), extra);
        wait_view(&c, "the restarted node serving", |v| {
            serving(v) == NODES as usize
        })
        .await;
        let back = Client::connect(&nodes[id as usize].tcp_url(), cfg(SameHost::Off))
            .await
            .unwrap();
        wait_view(&back, "the restarted node sees 4 serving", |v| {
            serving(v) == NODES as usize
        })
        .await;
        let want = (held.len() as f64 * share).ceil() as usize;
        let took = wait_present(&back, &held, want).await;
        eprintln!(
            "node {id}: {want} of its {} keys served again {took:?} after it serves",
            held.len()
        );
        let others: Vec<u64> = (0..KEYS)
            .filter(|&i| view.owner(&key(i)) != Some(NodeId(id)))
            .collect();
        let want = (others.len() as f64 * share).ceil() as usize;
        wait_present(&c, &others, want).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_in_place_keeps_every_object() {
    rolling_restart(
        &[
            "--restart-on-shutdown",
            "true",
            "--restart-window-ms",
            "30000",
        ],
        1.0,
    )
    .await;
}

/// Draining hands the node's objects to the owners of its keys while it is away, and they hand
/// them back when it returns. Handover is best effort (an object judged across view changes
/// it cannot vouch for stays where it is: a miss for a client without the previous view), so
/// most, not always all, come back (90 % to all of a node's keys here, fewer on a loaded
/// machine), and none with wrong bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_by_drains_hands_objects_back() {
    rolling_restart(&[], 0.75).await;
}

fn state_of(v: &ClusterView, id: u32) -> Option<NodeState> {
    v.node(NodeId(id)).map(|n| n.state)
}

/// A 3-node cluster restarting in place with `window_ms`, filled with keys `0..KEYS`; the
/// client is node 2's.
async fn restarting_cluster(window_ms: &str) -> (Vec<Node>, Client) {
    let extra = [
        "--restart-on-shutdown",
        "true",
        "--restart-window-ms",
        window_ms,
    ];
    let mut nodes = vec![start_with(0, None, None, &extra)];
    for id in 1..3 {
        let n = start_with(id, Some(&nodes[0]), None, &extra);
        nodes.push(n);
    }
    let c = Client::connect(&nodes[2].tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    assert_eq!(fill(&c, 0..KEYS).await as u64, KEYS);
    (nodes, c)
}

/// Stops node `id` of `nodes` with SIGTERM; returns its directory and addresses for the next
/// start.
fn stop_for_restart(nodes: &mut [Node], id: u32) -> (std::path::PathBuf, [String; 3]) {
    let n = &mut nodes[id as usize];
    assert!(n.stop().success(), "node {id} stops cleanly on SIGTERM");
    (
        n.dir.clone(),
        [n.tcp.clone(), n.quic.clone(), n.metrics.clone()],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_place_keeps_its_keys_and_serves_them_again() {
    let (mut nodes, c) = restarting_cluster("30000").await;
    let view = c.view().await.unwrap();
    let (held, others): (Vec<u64>, Vec<u64>) =
        (0..KEYS).partition(|&i| view.owner(&key(i)) == Some(NodeId(1)));
    assert!(!held.is_empty() && !others.is_empty());

    let (dir, addrs) = stop_for_restart(&mut nodes, 1);
    let away = wait_view(&c, "node 1 restarting", |v| {
        state_of(v, 1) == Some(NodeState::Restarting)
    })
    .await;
    eprintln!("node 1 seen restarting {away:?} after its exit");
    // While it is away nothing moves: its keys are misses, its writes refused; the rest serve.
    for &i in held.iter().take(200) {
        assert_eq!(c.get(&key(i)).await.unwrap(), None, "key {i} of node 1");
    }
    let refused = c.put(&key(held[0]), b"written while away").await;
    assert!(
        refused.is_err(),
        "a write of a restarting node's key is refused"
    );
    wait_all_present(&c, &others).await;
    assert_eq!(
        state_of(&c.view().await.unwrap(), 1),
        Some(NodeState::Restarting),
        "still held for it"
    );

    let addrs = [addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()];
    let extra = [
        "--restart-on-shutdown",
        "true",
        "--restart-window-ms",
        "30000",
    ];
    nodes[1] = start_with(1, Some(&nodes[0]), Some((&dir, addrs)), &extra);
    let back = wait_view(&c, "node 1 serving again", |v| serving(v) == 3).await;
    let v = c.view().await.unwrap();
    assert_eq!(
        v.node(NodeId(1)).unwrap().epoch,
        view.node(NodeId(1)).unwrap().epoch + 2,
        "serving → restarting → serving again, no join in between"
    );
    // The objects it recovered are its keys' current values: served at once, byte-exact.
    let mut missing = 0;
    for &i in &held {
        match c.get(&key(i)).await.unwrap() {
            Some(v) => assert_eq!(v, value(i, 256), "key {i}: wrong bytes"),
            None => missing += 1,
        }
    }
    assert_eq!(
        missing, 0,
        "every recovered key served {back:?} after the restart"
    );
    let all: Vec<u64> = (0..KEYS).collect();
    wait_all_present(&c, &all).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_past_its_window_serves_nothing_older_than_a_later_write() {
    let (mut nodes, c) = restarting_cluster("1500").await;
    let view = c.view().await.unwrap();
    let held: Vec<u64> = (0..KEYS)
        .filter(|&i| view.owner(&key(i)) == Some(NodeId(1)))
        .collect();
    let (dir, addrs) = stop_for_restart(&mut nodes, 1);
    wait_view(&c, "node 1 down once its window passed", |v| {
        state_of(v, 1) == Some(NodeState::Down)
    })
    .await;
    // Its keys moved: the new owners take newer writes of half of them.
    let rewritten: Vec<u64> = held.iter().copied().step_by(2).collect();
    for &i in &rewritten {
        c.put(&key(i), &value(i + 1_000_000, 256)).await.unwrap();
    }
    let addrs = [addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()];
    let extra = [
        "--restart-on-shutdown",
        "true",
        "--restart-window-ms",
        "1500",
    ];
    nodes[1] = start_with(1, Some(&nodes[0]), Some((&dir, addrs)), &extra);
    wait_view(&c, "node 1 serving again", |v| serving(v) == 3).await;
    let back = Client::connect(&nodes[1].tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&back, "node 1 sees 3 serving", |v| serving(v) == 3).await;
    for client in [&c, &back] {
        for &i in &rewritten {
            if let Some(v) = client.get(&key(i)).await.unwrap() {
                assert_eq!(
                    v,
                    value(i + 1_000_000, 256),
                    "key {i}: an older copy served"
                );
            }
        }
        for &i in held.iter().skip(1).step_by(2) {
            if let Some(v) = client.get(&key(i)).await.unwrap() {
                assert_eq!(v, value(i, 256), "key {i}: wrong bytes");
            }
        }
    }
}
