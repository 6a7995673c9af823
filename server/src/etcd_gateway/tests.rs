use super::*;

fn rec(id: u32, state: NodeState, epoch: u64) -> NodeInfo {
    NodeInfo {
        id,
        tcp: format!("127.0.0.1:{}", 7000 + id),
        quic: String::new(),
        metrics: String::new(),
        capacity: 1 << 20,
        state,
        epoch,
    }
}

#[test]
fn records_round_trip_and_bad_ones_are_refused() {
    for s in [
        NodeState::Joining,
        NodeState::Serving,
        NodeState::Draining,
        NodeState::Down,
    ] {
        let r = rec(3, s, 7);
        assert_eq!(decode_record(&encode_record(&r)), Some(r));
    }
    assert_eq!(decode_record(b"{\"id\":1}"), None);
    assert_eq!(decode_record(b"nonsense"), None);
}

#[test]
fn the_view_is_the_records_with_down_where_no_lease_is_held() {
    let p = "/kvpool/";
    let mut a = Registry::default();
    a.apply(
        p,
        b"/kvpool/nodes/1",
        Some(&encode_record(&rec(1, NodeState::Serving, 2))),
    );
    a.apply(
        p,
        b"/kvpool/nodes/0",
        Some(&encode_record(&rec(0, NodeState::Serving, 2))),
    );
    a.apply(p, b"/kvpool/alive/0", Some(b""));
    a.apply(p, b"/kvpool/alive/1", Some(b""));
    a.apply(
        p,
        b"/other/nodes/5",
        Some(&encode_record(&rec(5, NodeState::Serving, 1))),
    );
    a.apply(
        p,
        b"/kvpool/nodes/9",
        Some(&encode_record(&rec(8, NodeState::Serving, 1))),
    );
    a.apply(p, b"/kvpool/nodes/x", Some(b"{}"));
    a.apply(p, b"/kvpool/alive/1", None);
    a.records.revision = 12;
    let v = a.view();
    assert_eq!(v.version, 12);
    let states: Vec<_> = v.nodes.iter().map(|n| (n.id, n.state)).collect();
    assert_eq!(
        states,
        [(0, NodeState::Serving), (1, NodeState::Down)],
        "sorted, node 1 down, foreign and mismatched keys ignored"
    );
    // The same keys in another order make the same view.
    let mut b = Registry::default();
    b.apply(p, b"/kvpool/alive/0", Some(b""));
    b.apply(
        p,
        b"/kvpool/nodes/0",
        Some(&encode_record(&rec(0, NodeState::Serving, 2))),
    );
    b.apply(
        p,
        b"/kvpool/nodes/1",
        Some(&encode_record(&rec(1, NodeState::Serving, 2))),
    );
    assert_eq!(b.view().stamp(), v.stamp());
}

#[test]
fn watch_messages_parse() {
    let line = br#"{"result":{"header":{"revision":"3"},"events":[{"kv":{"key":"L2t2cG9vbC9hbGl2ZS8x","mod_revision":"2","value":"eA=="}},{"type":"DELETE","kv":{"key":"L2t2cG9vbC9hbGl2ZS8x","mod_revision":"3"}}]}}"#;
    let (rev, kvs) = parse_watch(line).unwrap();
    assert_eq!(rev, 3);
    assert_eq!(
        kvs,
        vec![
            (b"/kvpool/alive/1".to_vec(), Some(b"x".to_vec())),
            (b"/kvpool/alive/1".to_vec(), None)
        ]
    );
    assert!(parse_watch(br#"{"result":{"canceled":true,"compact_revision":"9"}}"#).is_err());
    assert!(parse_watch(br#"{"error":{"grpc_code":14}}"#).is_err());
}

#[test]
fn prefix_ends_and_lease_ttls() {
    assert_eq!(prefix_end(b"/kvpool/"), b"/kvpool0");
    assert_eq!(prefix_end(b"a\xff"), b"b");
    assert_eq!(lease_ttl(Duration::from_millis(2000)), 2);
    assert_eq!(lease_ttl(Duration::from_millis(2001)), 3);
    assert_eq!(lease_ttl(Duration::from_millis(100)), 1);
}

#[test]
fn a_replaced_view_keeps_this_nodes_own_record_and_never_goes_back() {
    let m = Cluster::new(rec(1, NodeState::Draining, 5), crate::cluster::Source::Etcd);
    let mut reg = Registry::default();
    let p = "/p/";
    reg.apply(
        p,
        b"/p/nodes/0",
        Some(&encode_record(&rec(0, NodeState::Serving, 1))),
    );
    reg.apply(
        p,
        b"/p/nodes/1",
        Some(&encode_record(&rec(1, NodeState::Serving, 4))),
    );
    reg.apply(p, b"/p/alive/0", Some(b""));
    reg.apply(p, b"/p/alive/1", Some(b""));
    reg.records.revision = 40;
    m.replace(reg.view());
    let v = m.view();
    assert_eq!(v.version, 40);
    assert_eq!(v.nodes.len(), 2);
    assert_eq!(v.nodes[1], rec(1, NodeState::Draining, 5), "my own record");
    // A wiped etcd starts its revisions again: the version still only goes up.
    reg.apply(p, b"/p/alive/0", None);
    reg.records.revision = 3;
    m.replace(reg.view());
    assert_eq!(m.view().version, 41);
    assert_eq!(m.view().nodes[0].state, NodeState::Down);
    // A leftover record of mine with a higher epoch is outranked.
    m.outrank(&rec(1, NodeState::Serving, 9));
    assert_eq!(m.my_record().unwrap().epoch, 10);
    assert_eq!(m.my_record().unwrap().state, NodeState::Draining);
}
