//! A rolling restart keeps the cache: each node of a 4-node cluster in turn is stopped with
//! SIGTERM (in a cluster it drains: its objects go to the nodes that own their keys while it is
//! away) and started again with the same flags on the same directory and addresses; once it
//! serves again, every key it held before its stop is read back, byte-exact, and so is every
//! other key. Static membership with fast heartbeats; every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{cfg, cluster_args, fill, key, serving, wait_view};
use common::{value, Node};
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

fn start(id: u32, seed: Option<&Node>, dir: Option<(&std::path::Path, [&str; 3])>) -> Node {
    let f = flags(id, seed);
    let f: Vec<&str> = f.iter().map(String::as_str).collect();
    match dir {
        None => Node::start(MEMORY, &f),
        Some((dir, addrs)) => Node::start_in(dir.to_path_buf(), MEMORY, &f, &addrs),
    }
}

/// Reads every key of `held` through `c` until all are present (at most 20 s); every value read
/// must be the one written. Returns how long that took.
async fn wait_all_present(c: &Client, held: &[u64]) -> Duration {
    let t = Instant::now();
    loop {
        let mut missing = 0;
        for &i in held {
            match c.get(&key(i)).await {
                Ok(Some(v)) => assert_eq!(v, value(i, 256), "key {i}: wrong bytes"),
                Ok(None) | Err(_) => missing += 1,
            }
        }
        if missing == 0 {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{missing} of {} keys still missing",
            held.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_keeps_every_object() {
    let mut nodes = vec![start(0, None, None)];
    for id in 1..NODES {
        let n = start(id, Some(&nodes[0]), None);
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

        let n = &mut nodes[id as usize];
        assert!(n.stop().success(), "node {id} stops cleanly on SIGTERM");
        let (dir, addrs) = (
            n.dir.clone(),
            [n.tcp.clone(), n.quic.clone(), n.metrics.clone()],
        );
        let addrs = [addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()];
        // While it is away its keys are served by their owners then.
        wait_all_present(&c, &held).await;
        let seed = (id != 0).then(|| &nodes[0]);
        let again = start(id, seed, Some((&dir, addrs)));
        nodes[id as usize] = again;
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
        let took = wait_all_present(&back, &held).await;
        eprintln!(
            "node {id}: its {} keys served again {took:?} after it serves",
            held.len()
        );
        let all: Vec<u64> = (0..KEYS).collect();
        wait_all_present(&c, &all).await;
    }
}
