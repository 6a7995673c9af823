//! Helpers for multi-node tests: client settings, bounded waits on a node's view, and
//! writing and checking numbered keys.

use std::time::{Duration, Instant};

use kvpool::placement::{ClusterView, NodeState};
use kvpool_client::{Client, ClientConfig, ErrorCode, SameHost};

use super::{value, Node};

pub fn cfg(same_host: SameHost) -> ClientConfig {
    ClientConfig {
        same_host,
        timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Starts node `id` with `memory`, joining through `seed` (none for the first node, which
/// generates the cluster secret the others are given); `extra` goes on its command line after
/// the cluster flags (timing flags such as `--heartbeat-ms` among them).
pub fn start_node(id: u32, memory: &str, seed: Option<&Node>, extra: &[&str]) -> Node {
    let mut args = cluster_args(id, seed);
    args.extend(extra.iter().map(|s| s.to_string()));
    Node::start(memory, &args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The flags of node `id` joining through `seed` (its address and the cluster secret it
/// generated), or of the first node.
pub fn cluster_args(id: u32, seed: Option<&Node>) -> Vec<String> {
    let mut args = vec!["--node-id".to_string(), id.to_string()];
    if let Some(s) = seed {
        let secret = s.secret_file().to_str().unwrap().to_string();
        args.extend([
            "--peer".into(),
            s.tcp.clone(),
            "--cluster-secret-file".into(),
            secret,
        ]);
    }
    args
}

/// Polls `node`'s view until `want` holds (at most 20 s).
pub async fn wait_view(
    client: &Client,
    what: &str,
    want: impl Fn(&ClusterView) -> bool,
) -> Duration {
    let t = Instant::now();
    loop {
        if let Ok(v) = client.view().await {
            if want(&v) {
                return t.elapsed();
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "view never reached: {what}: {:?}",
            client.view().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Drains node `id` of `nodes` (ids are their index) through node 0, as the cluster's admin
/// (its secret), and waits (at most 30 s) for its process to exit.
pub async fn drain(nodes: &mut [Node], id: u32) {
    admin(&nodes[0]).await.drain_node(id).await.unwrap();
    let mut child = nodes[id as usize].child.take().unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "drained node did not exit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client of `node` holding the cluster's secret: an operator's tool, or (for its puts) a
/// cluster peer.
pub async fn admin(node: &Node) -> Client {
    let secret = std::fs::read(node.secret_file()).unwrap();
    let secret = kvpool::protocol::auth::ClusterSecret::from_file_contents(&secret).unwrap();
    let c = ClientConfig {
        cluster_secret: Some(secret),
        ..cfg(SameHost::Off)
    };
    Client::connect(&node.tcp_url(), c).await.unwrap()
}

pub fn serving(v: &ClusterView) -> usize {
    v.nodes
        .iter()
        .filter(|n| n.state == NodeState::Serving)
        .count()
}

pub fn key(i: u64) -> Vec<u8> {
    format!("key-{i:08}").into_bytes()
}

/// Writes keys `range` with 256-byte values, in batches; returns how many were stored.
pub async fn fill(c: &Client, range: std::ops::Range<u64>) -> usize {
    let mut stored = 0;
    let ids: Vec<u64> = range.collect();
    for chunk in ids.chunks(500) {
        let keys: Vec<Vec<u8>> = chunk.iter().map(|&i| key(i)).collect();
        let vals: Vec<Vec<u8>> = chunk.iter().map(|&i| value(i, 256)).collect();
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&vals)
            .map(|(k, v)| (&k[..], &v[..]))
            .collect();
        let codes = c.batch_put_from(&items).await.unwrap();
        stored += codes.iter().filter(|c| **c == ErrorCode::Ok).count();
    }
    stored
}

/// Reads keys `range` back in batches, checking every byte; returns how many were present.
pub async fn check(c: &Client, range: std::ops::Range<u64>) -> usize {
    let mut present = 0;
    let ids: Vec<u64> = range.collect();
    for chunk in ids.chunks(500) {
        let keys: Vec<Vec<u8>> = chunk.iter().map(|&i| key(i)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let mut bufs = vec![vec![0u8; 256]; chunk.len()];
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
        for ((g, b), &i) in got.iter().zip(&bufs).zip(chunk) {
            if let Some(len) = g {
                assert_eq!(*len, 256);
                assert_eq!(b, &value(i, 256), "key {i}: wrong bytes");
                present += 1;
            }
        }
    }
    present
}
