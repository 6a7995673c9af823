use std::time::Duration;

use kvpool::addr::NodeId;
use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::pool::{NamespaceConfig, DEFAULT_NAMESPACE};
use kvpool::protocol::Limits;
use kvpool::segment::{Backing, HugePages};
use kvpool::PoolConfig;

use super::*;
use crate::cluster::Source;

/// A one-node `Shared` over a small anonymous pool with namespaces `default` (open) and
/// `team` (token `team-token`); the node's token is `node-token`.
fn shared() -> Shared {
    let cfg = PoolConfig {
        segment_size: 4 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        namespaces: vec![
            NamespaceConfig::unlimited(DEFAULT_NAMESPACE),
            NamespaceConfig::unlimited("team"),
        ],
        ..PoolConfig::default()
    };
    let pool = Arc::new(Pool::new(&cfg, [7; 16]).unwrap());
    let node = NodeInfo::serving(0, 4 << 20);
    let cluster = Arc::new(Cluster::new(node, Source::Gossip));
    cluster.attach_pool(pool.clone());
    let limits = Limits::default();
    let ledger =
        crate::ledger::Ledger::new(&crate::ledger::Bounds::uniform(8, 64), &[1 << 20, 1 << 20]);
    Shared {
        hello: HelloInfo {
            version: kvpool::protocol::PROTOCOL_VERSION,
            node: 0,
            incarnation: pool.incarnation(),
            namespaces: pool.namespaces(),
            host_id: String::new(),
            uds_path: String::new(),
            max_payload: limits.max_payload,
            max_batch: limits.max_batch,
            view: ClusterView::default(),
            replication: Vec::new(),
            challenge: [0; 32],
        },
        pool,
        metrics: Arc::default(),
        started: Instant::now(),
        cluster,
        conn: ConnPolicy {
            limits,
            hello_limits: limits,
            handshake: Duration::from_secs(1),
            idle: None,
            write: Duration::from_secs(1),
            read: Duration::from_secs(1),
        },
        watches: Arc::new(crate::watch::Watches::new(
            1000,
            ledger.clone(),
            Default::default(),
        )),
        events: crate::events::EventHub::new(2, Default::default()),
        bulk: Arc::new(crate::bulk::Bulk::new(crate::bulk::BulkConfig::default())),
        trim: Default::default(),
        stagings: crate::staging::Stagings::new(
            (1 << 20, 4 << 20),
            ledger.clone(),
            Default::default(),
        ),
        ledger,
        auth: Auth {
            token: "node-token".into(),
            ns_tokens: vec![Vec::new(), vec!["team-token".into()]],
            ns_read_tokens: vec![Vec::new(), vec!["team-reader".into()]],
            failures: crate::auth_limit::AuthFailures::new(2, Duration::from_secs(60), 0),
            per_token: crate::admission::TokenCounts::new(2),
        },
        peers: PeerPolicy {
            secret: ClusterSecret::from_file_contents(&[b'k'; 32]).unwrap(),
            failures: crate::auth_limit::AuthFailures::new(0, Duration::ZERO, 0),
            timeout: Duration::from_secs(1),
        },
        disk: None,
        fabric: None,
    }
}

#[test]
fn tokens_admit_to_their_namespaces_and_the_open_ones() {
    let s = shared();
    assert!(s.authenticate("").is_none(), "no token");
    assert!(s.authenticate("wrong").is_none());
    let node = s.authenticate("node-token").unwrap();
    assert_eq!(s.namespace(&node, "team"), Ok(1));
    let team = s.authenticate("team-token").unwrap();
    assert_eq!(s.namespace(&team, "team"), Ok(1));
    assert_eq!(s.namespace(&team, DEFAULT_NAMESPACE), Ok(0));
    assert_eq!(
        s.namespace(&team, "nope"),
        Err(NamespaceError::Unknown("nope".into()))
    );
    assert_eq!(
        ErrorCode::from(&NamespaceError::Unknown("nope".into())),
        ErrorCode::UnknownNamespace
    );
}

#[test]
fn a_read_token_reads_its_namespace_and_writes_nothing_of_it() {
    let s = shared();
    let reader = s.authenticate("team-reader").unwrap();
    assert_eq!(s.namespace(&reader, "team"), Ok(1));
    assert!(reader.allows(1) && !reader.writes(1));
    // The open namespace stays open to it.
    assert!(reader.allows(0) && reader.writes(0));
    let team = s.authenticate("team-token").unwrap();
    assert!(team.writes(1));
    let node = s.authenticate("node-token").unwrap();
    assert!(node.writes(1));
    let mut peer = reader.clone();
    peer.grant_all();
    assert!(peer.writes(1));
}

#[test]
fn a_namespace_token_does_not_reach_another_tokens_namespace() {
    let mut s = shared();
    s.auth.ns_tokens[0] = vec!["default-token".into()];
    let team = s.authenticate("team-token").unwrap();
    let refused = s.namespace(&team, DEFAULT_NAMESPACE).unwrap_err();
    assert_eq!(refused, NamespaceError::Unauthorized("default".into()));
    assert_eq!(ErrorCode::from(&refused), ErrorCode::Unauthorized);
    let mut peer = team.clone();
    peer.grant_all();
    assert_eq!(s.namespace(&peer, DEFAULT_NAMESPACE), Ok(0));
}

#[test]
fn put_get_exists_remove_and_count_a_whole_value() {
    let s = shared();
    let now = s.now();
    assert_eq!(s.count(1), Ok(0));
    s.put_value(1, b"k", b"value", None, false).unwrap();
    let sum = kvpool::checksum(b"other");
    s.put_value(1, b"k2", b"other", Some(sum), false).unwrap();
    let obj = s.get(1, b"k", now, Routing::Direct).unwrap();
    assert_eq!(obj.bytes(), b"value");
    assert_eq!(obj.checksum(), kvpool::checksum(b"value"));
    drop(obj);
    assert_eq!(s.count(1), Ok(2));
    assert_eq!(s.count(0), Ok(0));
    assert_eq!(s.count(9), Err(PoolError::UnknownNamespace));
    let keys: [&[u8]; 3] = [b"k", b"k2", b"k3"];
    assert_eq!(
        s.exists_run(1, keys.iter().copied(), Routing::Direct),
        Ok(2)
    );
    assert_eq!(s.remove(1, b"k"), Ok(true));
    assert_eq!(s.remove(1, b"k"), Ok(false));
    assert_eq!(
        s.get(1, b"k", now, Routing::Direct).err(),
        Some(PoolError::NotFound)
    );
    assert_eq!(
        s.exists_run(1, keys.iter().copied(), Routing::Direct),
        Ok(0)
    );
    assert_eq!(s.count(1), Ok(1));
}

#[test]
fn a_wrong_checksum_stores_nothing_and_keeps_the_old_value() {
    let s = shared();
    s.put_value(0, b"k", b"old", None, false).unwrap();
    assert_eq!(
        s.put_value(0, b"k", b"new", Some(1), false),
        Err(PoolError::ChecksumMismatch)
    );
    let got = s.get(0, b"k", s.now(), Routing::Direct).unwrap();
    assert_eq!(got.bytes(), b"old");
    assert_eq!(
        s.put_value(0, b"", b"x", None, false),
        Err(PoolError::BadKey)
    );
}

/// The race that lost a pinned object in a drain: a read routed by the view before the
/// drain passed the front door's stamp check, the node then adopted the draining view, and
/// the read was judged by that view (in which the node owns nothing) and removed the only
/// copy before the mover could hand it over. A read is judged by the view it was routed by
/// or not at all.
#[test]
fn a_read_routed_by_a_view_the_node_has_left_misses_and_removes_nothing() {
    let s = shared();
    let key = two_nodes_and_a_key_of_mine(&s, "weights/");
    let keys = [key.as_slice()];
    s.put_value(0, &key, b"only copy", None, true).unwrap();
    let before = Routing::ByView(s.cluster.stamp());
    let now = s.now();
    assert_eq!(s.get(0, &key, now, before).unwrap().bytes(), b"only copy");

    // Between the stamp check and the continuity check: the node starts draining.
    s.cluster.set_state(NodeState::Draining);
    assert_ne!(Routing::ByView(s.cluster.stamp()), before);

    assert_eq!(s.get(0, &key, now, before).err(), Some(PoolError::NotFound));
    assert!(!s.fresh_key(0, &key, before));
    assert_eq!(s.exists_run(0, keys.iter().copied(), before), Ok(0));
    assert!(scan_all(&s, 0, 100, b"weights/", before).is_empty());
    // Still here, for the mover.
    let kept = s.get(0, &key, now, Routing::Direct).unwrap();
    assert_eq!(kept.bytes(), b"only copy");
    assert!(kept.pinned());
    drop(kept);
    assert_eq!(s.pool.pinned_keys(0).unwrap(), vec![key.clone()]);
}

/// Makes `s` node 0 of two serving nodes; returns a key starting with `prefix` that it
/// owns alone.
fn two_nodes_and_a_key_of_mine(s: &Shared, prefix: &str) -> Vec<u8> {
    let both = ClusterView::from_nodes(vec![
        NodeInfo::serving(0, 4 << 20),
        NodeInfo::serving(1, 4 << 20),
    ]);
    let view = s.cluster.merge(&both);
    assert_eq!(view.owners(b"any", 2).len(), 2, "{view:?}");
    (0..)
        .map(|i| format!("{prefix}{i}").into_bytes())
        .find(|k| view.owners(k, 1) == [NodeId(0)])
        .unwrap()
}

/// A removal or a put whose view changed between the front door's stamp check and the
/// pool's work is done, and said to have moved, so the front door answers `WrongView` and
/// the client does it again by the new view (the new owner may have been handed the older
/// value meanwhile). Under the current view or a direct request it is not.
#[test]
fn a_remove_or_put_routed_by_a_view_the_node_has_left_is_done_and_says_so() {
    let s = shared();
    let key = two_nodes_and_a_key_of_mine(&s, "k/");
    let keys = || [key.as_slice()].into_iter();
    let before = Routing::ByView(s.cluster.stamp());
    s.put_value(0, &key, b"v1", None, false).unwrap();
    assert_eq!(s.remove_keys(0, keys(), before), Ok((1, false)));
    s.put_value(0, &key, b"v2", None, false).unwrap();

    // Between the stamp check and the removal: the view changes.
    s.cluster.set_state(NodeState::Draining);
    assert!(s.view_moved(before));
    assert_eq!(s.remove_keys(0, keys(), before), Ok((1, true)));
    assert_eq!(s.pool.provenance(0, &key), Ok(None), "removed all the same");
    let now = Routing::ByView(s.cluster.stamp());
    assert_eq!(s.remove_keys(0, keys(), now), Ok((0, false)));
    assert_eq!(s.remove_keys(0, keys(), Routing::Direct), Ok((0, false)));

    // Puts: `change` moves the view while the value commits.
    let put = |value: &[u8], routing, change: bool| {
        let addr = s.begin_put(0, &key, value.len() as u64, false, 0).unwrap();
        s.pool.write(&addr, 0, value).unwrap();
        s.commit_in_view(&addr, routing, || {
            if change {
                s.cluster.set_state(NodeState::Serving);
            }
            s.pool
                .commit(Commit::new(&addr, kvpool::checksum(value)))
                .map(drop)
        })
    };
    let value = || {
        s.get(0, &key, s.now(), Routing::Direct)
            .unwrap()
            .bytes()
            .to_vec()
    };
    // Routed by a view already left: not committed.
    assert_eq!(put(b"v3", before, false), Err(ErrorCode::WrongView));
    assert_eq!(s.pool.provenance(0, &key), Ok(None));
    assert_eq!(put(b"v3", now, false), Ok(()));
    assert_eq!(put(b"v4", Routing::Direct, false), Ok(()));
    assert_eq!(value(), b"v4");
    // The view changes while it commits: committed, and said to have moved.
    let current = Routing::ByView(s.cluster.stamp());
    assert_eq!(put(b"v5", current, true), Err(ErrorCode::WrongView));
    assert!(s.view_moved(current));
    assert_eq!(value(), b"v5");
}

/// Every page of a prefix scan, in order, until the cursor comes back 0.
fn scan_all(s: &Shared, ns: u32, count: u32, prefix: &[u8], routing: Routing) -> Vec<Vec<u8>> {
    let mut cursor = 0;
    let mut keys = Vec::new();
    for _ in 0..10_000 {
        let page = s.scan(ns, cursor, count, prefix, routing).unwrap();
        assert!(page.keys.len() <= count.max(1) as usize);
        keys.extend(page.keys);
        cursor = page.cursor;
        if cursor == 0 {
            keys.sort();
            return keys;
        }
    }
    panic!("the scan never ended");
}

#[test]
fn a_prefix_scan_lists_committed_keys_with_the_prefix_once() {
    let s = shared();
    let mut want = Vec::new();
    for i in 0..40 {
        let k = format!("manifest/m{i:02}").into_bytes();
        s.put_value(1, &k, b"v", None, i % 2 == 0).unwrap();
        want.push(k);
        s.put_value(1, format!("chunk/{i}").as_bytes(), b"v", None, false)
            .unwrap();
    }
    s.put_value(0, b"manifest/other-ns", b"v", None, false)
        .unwrap();
    // A pending allocation is not an object yet.
    let pending = s.begin_put(1, b"manifest/pending", 1, false, 0).unwrap();
    for routing in [Routing::Direct, Routing::ByView(s.cluster.stamp())] {
        for count in [0, 1, 7, 100_000] {
            let got = scan_all(&s, 1, count, b"manifest/", routing);
            assert_eq!(got, want, "count {count}, {routing:?}");
        }
    }
    assert_eq!(scan_all(&s, 1, 1000, b"", Routing::Direct).len(), 80);
    assert!(scan_all(&s, 1, 1000, b"nothing/", Routing::Direct).is_empty());
    // A page never looks at more than max_batch slots, whatever the count asks.
    let mut small = shared();
    small.conn.limits.max_batch = 3;
    for i in 0..20 {
        small
            .put_value(0, format!("k{i}").as_bytes(), b"v", None, false)
            .unwrap();
    }
    let page = small.scan(0, 0, u32::MAX, b"", Routing::Direct).unwrap();
    assert!(page.keys.len() <= 3 && page.cursor != 0, "{page:?}");
    assert_eq!(
        scan_all(&small, 0, u32::MAX, b"k", Routing::Direct).len(),
        20
    );
    assert_eq!(
        s.scan(1, 0, 10, &[b'm'; kvpool::MAX_KEY_LEN + 1], Routing::Direct),
        Err(PoolError::BadKey)
    );
    assert_eq!(
        s.scan(9, 0, 10, b"", Routing::Direct),
        Err(PoolError::UnknownNamespace)
    );
    s.pool.abort(&pending).unwrap();
}

#[test]
fn batches_over_the_limit_are_refused() {
    let s = shared();
    let max = s.conn.limits.max_batch as usize;
    assert_eq!(s.batch_check(max), Ok(()));
    assert_eq!(s.batch_check(max + 1), Err(ErrorCode::BatchTooLarge));
}
