//! Several nodes in one process: routing by the view, view changes (`WrongView` and the
//! refresh), previous owners consulted during a change and vouched for, replicas, and nodes
//! that leave or can't be reached.

use std::sync::Arc;

use kvpool::placement::NodeState;
use kvpool::NodeId;
use kvpool_client::{Client, ClientConfig, ErrorCode};
use kvpool_server::Node;

use crate::harness::{cluster, converge, holds, keys, pairs, refs, value_of, Net};

/// Namespace `default`'s id on every node.
const DEFAULT_NS: u32 = 0;

#[tokio::test]
async fn each_key_is_stored_on_its_owner_only() {
    let (net, nodes) = cluster(3, "").await;
    let kv = net.client(&nodes[0]).await;
    let ks = keys("spread", 60);
    for k in &ks {
        kv.put(k, &value_of(k, 64)).await.unwrap();
    }
    let view = kv.routing_view();
    let mut per_node = [0usize; 3];
    for k in &ks {
        let owner = view.owner(k).unwrap();
        for n in &nodes {
            assert_eq!(holds(n, DEFAULT_NS, k), n.id() == owner.0, "key {k:?}");
        }
        per_node[owner.0 as usize - 1] += 1;
    }
    assert!(per_node.iter().all(|&c| c > 0), "{per_node:?}");
    for k in &ks {
        assert_eq!(kv.get(k).await.unwrap().unwrap(), value_of(k, 64));
    }
}

#[tokio::test]
async fn a_batch_across_owners_comes_back_in_the_callers_order() {
    let (net, nodes) = cluster(3, "").await;
    let kv = net.client(&nodes[1]).await;
    let ks = keys("fan", 90);
    let vals: Vec<Vec<u8>> = ks.iter().map(|k| value_of(k, 100)).collect();
    let items = pairs(&ks, &vals);
    assert!(kv
        .batch_put_from(&items)
        .await
        .unwrap()
        .iter()
        .all(|c| *c == ErrorCode::Ok));
    let mut asked = refs(&ks);
    asked.reverse();
    let mut bufs = vec![vec![0u8; 100]; 90];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let lens = kv.batch_get_into(&asked, &mut dsts).await.unwrap();
    assert!(lens.iter().all(|l| *l == Some(100)));
    for (k, b) in asked.iter().zip(&bufs) {
        assert_eq!(b, &value_of(k, 100));
    }
}

#[tokio::test]
async fn the_client_learns_every_node_from_the_one_it_connected_to() {
    let (net, nodes) = cluster(3, "").await;
    let kv = net.client(&nodes[2]).await;
    let view = kv.view().await.unwrap();
    let ids: Vec<u32> = view.nodes.iter().map(|n| n.id).collect();
    assert_eq!(ids, vec![1, 2, 3]);
    assert_eq!(view.stamp(), nodes[0].view().stamp());
}

/// Node 1 alone with `ks` stored, a client of it, then node 2 joined: returns the network,
/// both nodes and the client, which still routes by the one-node view.
async fn joined(
    ks: &[Vec<u8>],
    cfg: impl FnOnce(ClientConfig) -> ClientConfig,
) -> (Net, Vec<Arc<Node>>, Client) {
    let net = Net::default();
    let a = net.start(1, "").await;
    let kv = net.client_with(&a, cfg(net.client_config())).await.unwrap();
    for k in ks {
        kv.put(k, &value_of(k, 32)).await.unwrap();
    }
    let b = net.start(2, "").await;
    converge(&[&a, &b]);
    (net, vec![a, b], kv)
}

#[tokio::test]
async fn a_view_change_is_adopted_after_a_wrong_view_answer() {
    let ks = keys("join", 40);
    let (_net, nodes, kv) = joined(&ks, |c| c).await;
    let before = kv.routing_view();
    assert_eq!(before.nodes.len(), 1);
    assert_ne!(before.stamp(), nodes[0].view().stamp());
    assert!(kv.get(&ks[0]).await.unwrap().is_some());
    let after = kv.routing_view();
    assert_eq!(after.stamp(), nodes[0].view().stamp());
    assert_eq!(after.nodes.len(), 2);
}

#[tokio::test]
async fn keys_moved_to_a_joining_node_are_read_from_their_previous_owner() {
    let ks = keys("fallback", 40);
    let (_net, nodes, kv) = joined(&ks, |c| c).await;
    for k in &ks {
        assert_eq!(kv.get(k).await.unwrap(), Some(value_of(k, 32)), "key {k:?}");
    }
    // Some of them did move: the new node holds none of them.
    let view = nodes[1].view();
    let moved = ks
        .iter()
        .filter(|k| view.owner(k) == Some(NodeId(2)))
        .count();
    assert!(moved > 0);
    assert!(ks.iter().all(|k| !holds(&nodes[1], DEFAULT_NS, k)));
}

#[tokio::test]
async fn batched_reads_consult_previous_owners_too() {
    let ks = keys("fallback-batch", 40);
    let (_net, _nodes, kv) = joined(&ks, |c| c).await;
    let mut bufs = vec![vec![0u8; 32]; ks.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let lens = kv.batch_get_into(&refs(&ks), &mut dsts).await.unwrap();
    assert!(lens.iter().all(|l| *l == Some(32)), "{lens:?}");
    assert_eq!(kv.present(&refs(&ks)).await.unwrap(), vec![true; ks.len()]);
    assert_eq!(kv.batch_exists(&refs(&ks)).await.unwrap(), ks.len());
}

#[tokio::test]
async fn without_a_fallback_window_moved_keys_miss() {
    let ks = keys("no-fallback", 40);
    let (_net, nodes, kv) = joined(&ks, |c| ClientConfig {
        fallback_window: std::time::Duration::ZERO,
        ..c
    })
    .await;
    let view = nodes[0].view();
    for k in &ks {
        let found = kv.get(k).await.unwrap();
        let moved = view.owner(k) == Some(NodeId(2));
        assert_eq!(found.is_none(), moved, "key {k:?}");
    }
}

#[tokio::test]
async fn a_previous_owners_copy_is_not_served_over_a_newer_write() {
    let ks = keys("vouch", 40);
    let (_net, nodes, kv) = joined(&ks, |c| c).await;
    let view = nodes[0].view();
    let moved: Vec<&Vec<u8>> = ks
        .iter()
        .filter(|k| view.owner(k) == Some(NodeId(2)))
        .collect();
    assert!(moved.len() >= 2);
    let (written, untouched) = (moved[0], moved[1]);
    // A newer write on the new owner, then its copy lost there (evicted): the previous
    // owner's older copy must not come back.
    kv.put(written, b"newer").await.unwrap();
    assert!(holds(&nodes[1], DEFAULT_NS, written));
    nodes[1].pool().remove(DEFAULT_NS, written).unwrap();
    assert!(holds(&nodes[0], DEFAULT_NS, written));
    assert_eq!(kv.get(written).await.unwrap(), None);
    // A key the new owner never wrote is vouched for.
    assert_eq!(
        kv.get(untouched).await.unwrap(),
        Some(value_of(untouched, 32))
    );
}

#[tokio::test]
async fn writes_after_a_join_go_to_the_new_owner() {
    let (_net, nodes, kv) = joined(&[], |c| c).await;
    let ks = keys("after-join", 40);
    for k in &ks {
        kv.put(k, b"v").await.unwrap();
    }
    let view = nodes[0].view();
    for k in &ks {
        let owner = view.owner(k).unwrap().0;
        assert!(holds(&nodes[owner as usize - 1], DEFAULT_NS, k));
        assert!(!holds(&nodes[2 - owner as usize], DEFAULT_NS, k));
    }
}

#[tokio::test]
async fn a_draining_node_owns_nothing_and_its_keys_are_read_from_it() {
    let (net, nodes) = cluster(2, "").await;
    let kv = net.client(&nodes[0]).await;
    let ks = keys("drain", 40);
    for k in &ks {
        kv.put(k, &value_of(k, 16)).await.unwrap();
    }
    nodes[1].set_state(NodeState::Draining);
    converge(&[&nodes[0], &nodes[1]]);
    for k in &ks {
        assert_eq!(kv.get(k).await.unwrap(), Some(value_of(k, 16)), "key {k:?}");
    }
    let fresh = keys("drain-new", 20);
    for k in &fresh {
        kv.put(k, b"v").await.unwrap();
        assert!(holds(&nodes[0], DEFAULT_NS, k) && !holds(&nodes[1], DEFAULT_NS, k));
    }
}

#[tokio::test]
async fn keys_of_a_node_that_left_are_misses() {
    let (net, nodes) = cluster(2, "").await;
    let kv = net.client(&nodes[0]).await;
    let ks = keys("left", 40);
    for k in &ks {
        kv.put(k, b"v").await.unwrap();
    }
    let owners: Vec<u32> = ks
        .iter()
        .map(|k| kv.routing_view().owner(k).unwrap().0)
        .collect();
    nodes[1].set_state(NodeState::Down);
    converge(&[&nodes[0], &nodes[1]]);
    for (k, owner) in ks.iter().zip(owners) {
        assert_eq!(kv.get(k).await.unwrap().is_some(), owner == 1, "key {k:?}");
    }
}

#[tokio::test]
async fn keys_on_an_unreachable_node_are_misses_and_counted() {
    let (net, nodes) = cluster(2, "").await;
    let kv = net.client(&nodes[0]).await;
    let ks = keys("cut", 40);
    for k in &ks {
        kv.put(k, b"v").await.unwrap();
    }
    let view = kv.routing_view();
    net.cut(&nodes[1]);
    assert_eq!(kv.unreachable_events(), 0);
    for k in &ks {
        let owned_by_1 = view.owner(k) == Some(NodeId(1));
        assert_eq!(kv.get(k).await.unwrap().is_some(), owned_by_1, "key {k:?}");
    }
    assert!(kv.unreachable_events() > 0);
}

const TWO_REPLICAS: &str = "[[namespace]]\nname = \"default\"\nreplicas = 2\n";

#[tokio::test]
async fn a_namespace_with_two_replicas_stores_each_key_twice() {
    let (net, nodes) = cluster(3, TWO_REPLICAS).await;
    let kv = net.client(&nodes[0]).await;
    let ks = keys("repl", 30);
    for k in &ks {
        kv.put(k, b"v").await.unwrap();
    }
    let view = kv.routing_view();
    for k in &ks {
        let owners: Vec<u32> = view.owners(k, 2).iter().map(|n| n.0).collect();
        for n in &nodes {
            assert_eq!(
                holds(n, DEFAULT_NS, k),
                owners.contains(&n.id()),
                "key {k:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_replica_answers_when_the_owner_is_unreachable() {
    let (net, nodes) = cluster(2, TWO_REPLICAS).await;
    let kv = net.client(&nodes[0]).await;
    let ks = keys("replica-read", 30);
    for k in &ks {
        kv.put(k, &value_of(k, 8)).await.unwrap();
    }
    net.cut(&nodes[1]);
    for k in &ks {
        assert_eq!(kv.get(k).await.unwrap(), Some(value_of(k, 8)), "key {k:?}");
    }
}

#[tokio::test]
async fn a_remove_reaches_every_replica() {
    let (net, nodes) = cluster(2, TWO_REPLICAS).await;
    let kv = net.client(&nodes[0]).await;
    kv.put(b"k", b"v").await.unwrap();
    assert!(nodes.iter().all(|n| holds(n, DEFAULT_NS, b"k")));
    assert!(kv.remove(b"k").await.unwrap());
    assert!(nodes.iter().all(|n| !holds(n, DEFAULT_NS, b"k")));
}

#[tokio::test]
async fn a_pinned_object_is_kept_on_its_pinned_replicas() {
    let (net, nodes) = cluster(3, "").await;
    let kv = net.client(&nodes[0]).await;
    assert_eq!(kv.pinned_replicas(), 2);
    kv.put_pinned(b"weights/layer-0", b"w").await.unwrap();
    let owners = kv.routing_view().owners(b"weights/layer-0", 2);
    let holding: Vec<u32> = nodes
        .iter()
        .filter(|n| holds(n, DEFAULT_NS, b"weights/layer-0"))
        .map(|n| n.id())
        .collect();
    assert_eq!(holding, {
        let mut o: Vec<u32> = owners.iter().map(|n| n.0).collect();
        o.sort();
        o
    });
}
