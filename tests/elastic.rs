//! Elastic membership without losing the cache (issue 18): a drained node hands its unpinned
//! blocks to their new owners before it leaves, previous owners hand a joining node its share,
//! and a handed-over copy never replaces a newer value. Real `kvpoold` processes on loopback;
//! clients read with no fallback to previous owners, so every hit is a block that reached its
//! owner. Every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{admin, cfg, check, drain, fill, serving, wait_view};
use common::{value, Node};
use kvpool_client::{Client, ClientConfig, SameHost};

const HEARTBEAT: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "600"];
const N: u64 = 3_000;

fn start(id: u32, seed: Option<&Node>, handover: bool) -> Node {
    let flag = if handover { "true" } else { "false" };
    let extra = [HEARTBEAT, &["--handover", flag]].concat();
    common::cluster::start_node(id, "64MiB", seed, &extra)
}

/// A client through `n` that never looks a miss up on the key's previous owner.
async fn owners_only(n: &Node) -> Client {
    let c = ClientConfig {
        fallback_window: Duration::ZERO,
        ..cfg(SameHost::Off)
    };
    Client::connect(&n.tcp_url(), c).await.unwrap()
}

/// Objects held by the nodes of `ids`, summed.
async fn held(c: &Client, ids: &[u32]) -> u64 {
    let mut n = 0;
    for &id in ids {
        n += c.node_stats(id).await.map_or(0, |s| s.objects);
    }
    n
}

/// Three serving nodes holding keys `0..N`, and a client through node 0 that reads owners only.
async fn three_filled(handover: bool) -> ([Node; 3], Client) {
    let n0 = start(0, None, handover);
    let n1 = start(1, Some(&n0), handover);
    let n2 = start(2, Some(&n0), handover);
    let c = owners_only(&n0).await;
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    assert_eq!(fill(&c, 0..N).await, N as usize);
    ([n0, n1, n2], c)
}

/// Three nodes holding keys `0..N`; then node 1 drains. Returns the keys found afterwards.
async fn drain_one(handover: bool) -> usize {
    let (mut nodes, c) = three_filled(handover).await;
    let on_1 = c.node_stats(1).await.unwrap().objects;
    assert!(on_1 > N / 5, "node 1 holds its share: {on_1}");
    drain(&mut nodes, 1).await;
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    check(&c, 0..N).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_hands_its_unpinned_blocks_to_their_new_owners() {
    let kept = drain_one(true).await;
    // The control: without the handover the drained node's share is lost.
    let lost_without = N as usize - drain_one(false).await;
    println!("after a drain: {kept} of {N} found; without handover {lost_without} lost");
    assert!(lost_without as u64 > N / 5, "the control lost its share");
    assert_eq!(kept, N as usize, "every block reached its new owner");
}

/// Three nodes holding keys `0..N`; then node 3 joins. Returns the keys found on their owners
/// afterwards, and how many node 3 was handed.
async fn join_one(handover: bool) -> (usize, u64) {
    let (nodes, c) = three_filled(handover).await;
    let _n3 = start(3, Some(&nodes[0]), handover);
    wait_view(&c, "4 serving", |v| serving(v) == 4).await;
    if !handover {
        // Give a handover (there should be none) time to happen.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let on_3 = c.node_stats(3).await.map_or(0, |s| s.objects);
        return (check(&c, 0..N).await, on_3);
    }
    // Handed over: node 3 holds its share, and each key is held once (the previous owners
    // dropped what they handed).
    let t = Instant::now();
    loop {
        let on_3 = c.node_stats(3).await.map_or(0, |s| s.objects);
        if on_3 > N / 8 && held(&c, &[0, 1, 2, 3]).await == N {
            return (check(&c, 0..N).await, on_3);
        }
        assert!(t.elapsed() < Duration::from_secs(30), "never handed over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_owners_hand_a_joining_node_its_share() {
    let (found, handed) = join_one(true).await;
    let (without, none) = join_one(false).await;
    println!(
        "after a join: {found} of {N} found, node 3 handed {handed}; without handover {without} found"
    );
    assert_eq!(none, 0, "the control handed nothing over");
    assert!(
        (without as u64) < N - N / 8,
        "the control missed node 3's share"
    );
    assert_eq!(found, N as usize, "every key on its owner");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_copy_never_replaces_a_newer_value() {
    // A cluster peer's unpinned put is a handover copy: taken only where the key is absent
    // and no write or remove of it was acknowledged here.
    let n0 = start(0, None, true);
    let c = owners_only(&n0).await;
    let peer = admin(&n0).await;
    let (old, new) = (value(1, 4096), value(2, 4096));
    // Never seen here: the copy is taken.
    peer.put(b"fresh", &old).await.unwrap();
    assert_eq!(c.get(b"fresh").await.unwrap(), Some(old.clone()));
    // Present (a newer write): refused, and the value stays.
    c.put(b"written", &new).await.unwrap();
    assert!(peer.put(b"written", &old).await.is_err());
    assert_eq!(c.get(b"written").await.unwrap(), Some(new.clone()));
    // Removed after a write: the older copy does not come back.
    c.put(b"removed", &new).await.unwrap();
    assert!(c.remove(b"removed").await.unwrap());
    assert!(peer.put(b"removed", &old).await.is_err());
    assert_eq!(c.get(b"removed").await.unwrap(), None);
    // A copy over a copy: the key is present, so refused too.
    assert!(peer.put(b"fresh", &new).await.is_err());
    assert_eq!(c.get(b"fresh").await.unwrap(), Some(old));
}
