//! Membership against a model: gossip in any order converging, merges commuting, and the
//! liveness rules (joining, silence, relayed hearings, fencing, etcd views).

use proptest::prelude::*;

use super::*;

use crate::placement::test_record as rec;
use crate::protocol::Heard;

const TIMING: Timing = Timing {
    heartbeat: 100,
    down_after: 1000,
    restart_window: 5000,
};

#[derive(Clone, Debug)]
enum Event {
    /// Node i changes its own state.
    SetState(usize, NodeState),
    /// Node i stops hearing from node j and marks it down.
    MarkDown(usize, usize),
    /// Node i heartbeats node j: j merges i's view, i merges j's answer.
    Gossip(usize, usize),
}

fn events(n: usize) -> impl Strategy<Value = Vec<Event>> {
    let state = prop_oneof![
        Just(NodeState::Joining),
        Just(NodeState::Serving),
        Just(NodeState::Draining),
        Just(NodeState::Restarting),
    ];
    let ev = prop_oneof![
        (0..n, state).prop_map(|(i, s)| Event::SetState(i, s)),
        (0..n, 0..n).prop_map(|(i, j)| Event::MarkDown(i, j)),
        (0..n, 0..n).prop_map(|(i, j)| Event::Gossip(i, j)),
        (0..n, 0..n).prop_map(|(i, j)| Event::Gossip(i, j)),
    ];
    proptest::collection::vec(ev, 0..40)
}

fn gossip(nodes: &mut [Membership], i: usize, j: usize, fenced: &mut [bool]) {
    if i == j {
        return;
    }
    let vi = nodes[i].view().clone();
    fenced[j] |= nodes[j].merge(&vi, 0).fenced;
    let vj = nodes[j].view().clone();
    fenced[i] |= nodes[i].merge(&vj, 0).fenced;
}

proptest! {
    /// Whatever happened before, a few rounds of gossip between live nodes leave every node
    /// with the same records; a node marked down refutes it (and was fenced when told); and
    /// every record is the newest any node wrote.
    #[test]
    fn gossip_converges_and_live_nodes_refute_being_down(script in events(4)) {
        let n = 4;
        let mut nodes: Vec<Membership> = (0..n)
            .map(|i| Membership::new(rec(i as u32, NodeState::Serving, 1), Source::Gossip))
            .collect();
        let mut fenced = vec![false; n];
        let mut marked = vec![false; n];
        for ev in script {
            match ev {
                Event::SetState(i, s) => {
                    let _ = nodes[i].set_state(s, 0);
                }
                Event::MarkDown(i, j) => {
                    if i != j && nodes[i].view().node(NodeId(j as u32)).is_some() {
                        marked[j] |= nodes[i].mark_down(j as u32, 0).changed;
                    }
                }
                Event::Gossip(i, j) => gossip(&mut nodes, i, j, &mut fenced),
            }
        }
        for _ in 0..3 {
            for i in 0..n {
                for j in 0..n {
                    gossip(&mut nodes, i, j, &mut fenced);
                }
            }
        }
        let first = nodes[0].view().clone();
        for m in &nodes {
            prop_assert_eq!(&m.view().nodes, &first.nodes);
            prop_assert_eq!(m.view().stamp(), first.stamp());
        }
        for (i, m) in nodes.iter().enumerate() {
            let mine = m.my_record().unwrap();
            prop_assert!(mine.state != NodeState::Down, "node {} refuted", i);
            prop_assert_eq!(first.node(NodeId(i as u32)), Some(mine), "its own record won");
            if marked[i] {
                prop_assert!(fenced[i] || mine.epoch > 1, "told it was down, node {} fenced", i);
            }
        }
    }

    /// Merging the others' records is a join: any order, any repetition, the same result.
    #[test]
    fn merges_commute_and_repeat_harmlessly(
        a in proptest::collection::vec((1u32..5, 1u64..4, any::<bool>()), 0..6),
        b in proptest::collection::vec((1u32..5, 1u64..4, any::<bool>()), 0..6),
    ) {
        let mk = |recs: &[(u32, u64, bool)]| {
            let mut v = ClusterView::default();
            for &(id, e, down) in recs {
                let s = if down { NodeState::Down } else { NodeState::Serving };
                let _ = v.offer(&NodeInfo { capacity: id as u64, ..rec(id, s, e) });
            }
            v
        };
        let (va, vb) = (mk(&a), mk(&b));
        let me = || Membership::new(rec(0, NodeState::Serving, 1), Source::Gossip);
        let (mut ab, mut ba) = (me(), me());
        let _ = ab.merge(&va, 0);
        let _ = ab.merge(&vb, 0);
        let _ = ba.merge(&vb, 0);
        let _ = ba.merge(&va, 0);
        prop_assert_eq!(&ab.view().nodes, &ba.view().nodes);
        let again = ab.merge(&va, 0);
        prop_assert!(!again.changed, "idempotent");
    }
}

#[test]
fn joining_turns_serving_after_two_heartbeats() {
    let mut m = Membership::new(rec(1, NodeState::Joining, 1), Source::Gossip);
    assert!(!m.tick(1000, TIMING, 0).changed);
    assert!(!m.tick(1199, TIMING, 0).changed);
    assert_eq!(m.my_state(), NodeState::Joining);
    assert!(m.tick(1200, TIMING, 0).changed);
    assert_eq!(m.my_state(), NodeState::Serving);
    assert_eq!(m.my_record().unwrap().epoch, 2);
}

#[test]
fn a_silent_peer_is_marked_down_and_a_heard_one_is_not() {
    let mut m = Membership::new(rec(1, NodeState::Serving, 1), Source::Gossip);
    let peers = ClusterView::from_nodes(vec![
        rec(2, NodeState::Serving, 1),
        rec(3, NodeState::Serving, 1),
    ]);
    assert!(m.merge(&peers, 0).changed);
    assert_eq!(
        m.heartbeat_targets(&["n2".into(), "x".into()]),
        ["n2", "x", "n3"]
    );
    m.watch("n2", 0);
    m.watch("n3", 0);
    // The heartbeats tick from the start: nodes 2 and 3 are in the view, up, since 0.
    assert!(!m.tick(0, TIMING, 0).changed);
    assert!(m.heard("n2", &peers, 900, 0) == Step::default());
    let step = m.tick(1000, TIMING, 0);
    assert!(step.changed);
    let state = |m: &Membership, id| m.view().node(NodeId(id)).unwrap().state;
    assert_eq!(state(&m, 3), NodeState::Down);
    assert_eq!(state(&m, 2), NodeState::Serving);
    assert!(!m.tick(1001, TIMING, 0).changed, "down once");
    assert_eq!(m.announce_targets(), ["n2"]);
}

#[test]
fn a_peer_another_still_hears_is_not_marked_down_until_that_hearing_is_old() {
    // Node 1 lost its link to node 3; node 2 still hears 3 and relays that.
    let mut m = Membership::new(rec(1, NodeState::Serving, 1), Source::Gossip);
    let peers = ClusterView::from_nodes(vec![
        rec(2, NodeState::Serving, 1),
        rec(3, NodeState::Serving, 1),
    ]);
    let _ = m.merge(&peers, 0);
    m.watch("n2", 0);
    m.watch("n3", 0);
    // The heartbeats tick from the start: nodes 2 and 3 are in the view, up, since 0.
    assert!(!m.tick(0, TIMING, 0).changed);
    assert_eq!(
        m.heard_directly(500, 1000),
        [],
        "watched, never heard: nothing to relay"
    );
    let _ = m.heard("n2", &peers, 900, 0);
    assert_eq!(
        m.heard_directly(1000, 1000),
        [Heard {
            node: 2,
            age_ms: 100
        }]
    );
    // Node 2 heard 3 at 800; what it says about node 1 is ignored.
    let relayed = [
        Heard {
            node: 3,
            age_ms: 100,
        },
        Heard { node: 1, age_ms: 0 },
    ];
    m.relayed(&relayed, 900);
    // An older hearing relayed later does not move it back.
    m.relayed(
        &[Heard {
            node: 3,
            age_ms: 900,
        }],
        950,
    );
    let state = |m: &Membership, id| m.view().node(NodeId(id)).unwrap().state;
    assert!(!m.tick(1000, TIMING, 0).changed, "silent here, heard by 2");
    assert!(!m.tick(1799, TIMING, 0).changed);
    assert_eq!(state(&m, 3), NodeState::Serving);
    assert!(
        m.tick(1800, TIMING, 0).changed,
        "no hearing of 3 within down_after"
    );
    assert_eq!(state(&m, 3), NodeState::Down);
    assert_eq!(state(&m, 2), NodeState::Serving);
    assert_eq!(m.heard_directly(1900, 1000), [], "2's answer is old now");
}

#[test]
fn a_node_that_appears_late_at_a_watched_address_gets_its_full_down_after() {
    // Node 1 has watched its static peer "n2" since 0, but node 2 starts at 5 000 and its
    // own gossip brings it into node 1's view before node 1's heartbeat reaches it.
    let mut m = Membership::new(rec(1, NodeState::Serving, 1), Source::Gossip);
    m.watch("n2", 0);
    assert!(!m.tick(0, TIMING, 0).changed);
    assert!(!m.tick(4_900, TIMING, 0).changed, "no node at n2 yet");
    let joined = ClusterView::from_nodes(vec![rec(2, NodeState::Joining, 1)]);
    assert!(m.merge(&joined, 0).changed);
    let state = |m: &Membership| m.view().node(NodeId(2)).unwrap().state;
    assert!(
        !m.tick(5_000, TIMING, 0).changed,
        "silence counts from here"
    );
    assert!(!m.tick(5_999, TIMING, 0).changed);
    assert_eq!(state(&m), NodeState::Joining);
    assert!(
        m.tick(6_000, TIMING, 0).changed,
        "silent for down_after since it appeared"
    );
    assert_eq!(state(&m), NodeState::Down);
    // It restarts and refutes (a higher epoch, up again): a fresh down_after from the tick
    // that sees it up, although its address has been silent all along.
    let back = ClusterView::from_nodes(vec![rec(2, NodeState::Joining, 3)]);
    assert!(m.merge(&back, 0).changed);
    assert_eq!(state(&m), NodeState::Joining);
    assert!(!m.tick(7_000, TIMING, 0).changed);
    assert!(!m.tick(7_999, TIMING, 0).changed);
    assert!(m.tick(8_000, TIMING, 0).changed);
    assert_eq!(state(&m), NodeState::Down);
    // Heard, it stays up.
    let again = ClusterView::from_nodes(vec![rec(2, NodeState::Serving, 5)]);
    let _ = m.merge(&again, 0);
    let _ = m.heard("n2", &again, 9_000, 0);
    assert!(!m.tick(9_000, TIMING, 0).changed);
    assert!(!m.tick(9_999, TIMING, 0).changed);
    assert_eq!(state(&m), NodeState::Serving);
}

#[test]
fn told_it_is_down_a_node_refutes_and_is_fenced() {
    let mut m = Membership::new(rec(1, NodeState::Serving, 3), Source::Gossip);
    let theirs = ClusterView::from_nodes(vec![rec(1, NodeState::Down, 3)]);
    let step = m.merge(&theirs, 50);
    assert!(step.changed && step.fenced);
    let mine = m.my_record().unwrap();
    assert_eq!((mine.state, mine.epoch), (NodeState::Serving, 4));
    // An object allocated before the fence is no longer this node's to serve.
    assert!(!m.continuous(b"k", 10, 1));
    assert!(m.continuous(b"k", 60, 1));
}

#[test]
fn etcd_views_replace_ignore_gossip_and_keep_versions_moving() {
    let mut m = Membership::new(rec(1, NodeState::Serving, 2), Source::Etcd);
    let mut etcd = EtcdRecords::default();
    etcd.set_record(1, Some(rec(1, NodeState::Joining, 1)));
    etcd.set_record(2, Some(rec(2, NodeState::Serving, 1)));
    etcd.set_record(3, Some(rec(4, NodeState::Serving, 1)));
    etcd.set_alive(1, true);
    etcd.set_alive(2, true);
    etcd.revision = 40;
    let v = etcd.view();
    assert_eq!(v.nodes.len(), 2, "a record naming another node is dropped");
    assert!(m.replace(v.clone(), 0).changed);
    assert_eq!(m.view().version, 40);
    assert_eq!(
        m.my_record().unwrap().state,
        NodeState::Serving,
        "own record kept"
    );
    let gossip = ClusterView::from_nodes(vec![rec(5, NodeState::Serving, 9)]);
    assert_eq!(m.merge(&gossip, 0), Step::default());
    assert!(m.set_state(NodeState::Draining, 0).changed);
    assert_eq!(m.view().version, 41, "a change made here moves the version");
    etcd.revision = 10; // a wiped etcd starts again
    etcd.set_alive(2, false);
    assert!(m.replace(etcd.view(), 0).changed);
    assert_eq!(m.view().version, 42);
    assert_eq!(m.view().node(NodeId(2)).unwrap().state, NodeState::Down);
}

#[test]
fn a_node_whose_lease_etcd_dropped_routes_by_the_view_the_others_hold_until_it_registers_again() {
    let mut m = Membership::new(rec(1, NodeState::Serving, 2), Source::Etcd);
    let mut etcd = EtcdRecords::default();
    for id in 1..=3 {
        etcd.set_record(id, Some(rec(id, NodeState::Serving, 2)));
        etcd.set_alive(id, true);
    }
    etcd.revision = 10;
    assert!(m.replace(etcd.view(), 0).changed);
    assert!(!m.lapsed());
    // etcd revoked node 1's lease: every node derives the same view, node 1 down in it.
    etcd.set_alive(1, false);
    etcd.revision = 11;
    let step = m.replace(etcd.view(), 5);
    assert!(step.changed && step.fenced && m.lapsed());
    assert_eq!(m.view().stamp(), etcd.view().stamp(), "the others' view");
    assert_eq!(m.my_state(), NodeState::Down);
    // A state set meanwhile is kept aside for the registration, not routed by.
    let before = m.view().clone();
    assert_eq!(m.set_state(NodeState::Draining, 6), Step::default());
    assert_eq!(m.view(), &before);
    // Registering again: its own record, at an epoch above any it had, once etcd shows it.
    let back = m.reinstated().unwrap();
    assert_eq!((back.state, back.epoch), (NodeState::Draining, 4));
    assert!(!m.replace(etcd.view(), 7).changed, "not before etcd has it");
    assert!(m.lapsed());
    etcd.set_record(1, Some(back.clone()));
    etcd.set_alive(1, true);
    etcd.revision = 13;
    assert!(m.replace(etcd.view(), 8).changed);
    assert!(!m.lapsed());
    assert_eq!(m.my_record(), Some(&back));
    assert_eq!(m.view().stamp(), etcd.view().stamp());
    // A node that put itself down (shutting down) does not lapse; nor does gossip membership.
    let mut gone = Membership::new(rec(1, NodeState::Down, 3), Source::Etcd);
    etcd.set_alive(1, false);
    let _ = gone.replace(etcd.view(), 0);
    assert!(!gone.lapsed() && gone.reinstated().is_none());
    let mut g = Membership::new(rec(1, NodeState::Serving, 2), Source::Gossip);
    assert_eq!(g.lapse(&rec(1, NodeState::Down, 2), 0), Step::default());
    assert!(!g.lapsed());
}

#[test]
fn a_lease_found_gone_by_its_keepalive_lapses_the_node_at_the_record_etcd_holds() {
    let mut m = Membership::new(rec(1, NodeState::Serving, 3), Source::Etcd);
    let mut etcd = EtcdRecords::default();
    for id in 1..=2 {
        etcd.set_record(id, Some(rec(id, NodeState::Serving, 3)));
        etcd.set_alive(id, true);
    }
    etcd.revision = 4;
    let _ = m.replace(etcd.view(), 0);
    assert!(m.lapse(&rec(1, NodeState::Serving, 3), 1).changed);
    etcd.set_alive(1, false);
    assert_eq!(m.view().nodes, etcd.view().nodes);
    assert_eq!(m.reinstated().map(|r| r.epoch), Some(4));
}

#[test]
fn etcd_records_carry_nodes_a_wiped_etcd_lost_until_they_register_again() {
    let mut before = EtcdRecords::default();
    for id in 1..=3 {
        before.set_record(id, Some(rec(id, NodeState::Serving, 2)));
        before.set_alive(id, true);
    }
    before.set_record(4, Some(rec(4, NodeState::Serving, 1)));
    before.revision = 90;
    let last = before.view();
    assert_eq!(last.node(NodeId(4)).unwrap().state, NodeState::Down);

    // etcd wiped: node 1 registered first and finds only itself.
    let mut etcd = EtcdRecords::default();
    etcd.set_record(1, Some(rec(1, NodeState::Serving, 2)));
    etcd.set_alive(1, true);
    etcd.revision = 3;
    assert_eq!(etcd.view().nodes.len(), 1);
    assert_eq!(etcd.carry(&last), vec![2, 3, 4]);
    assert!(etcd.carrying());
    let v = etcd.view();
    assert_eq!(v.nodes, last.nodes, "the same records: the same owners");
    assert_eq!(v.version, 3);

    // Node 2 registers again: its own record replaces the carried one.
    etcd.set_record(2, Some(rec(2, NodeState::Serving, 3)));
    etcd.set_alive(2, true);
    assert_eq!(etcd.view().node(NodeId(2)).unwrap().epoch, 3);
    // An explicit delete is not carried back.
    etcd.set_record(4, None);
    assert!(etcd.view().node(NodeId(4)).is_none());
    // Node 3 never comes back: once the carry ends it is gone from the view.
    assert_eq!(etcd.end_carry(), vec![3]);
    assert!(!etcd.carrying());
    let ids: Vec<u32> = etcd.view().nodes.iter().map(|n| n.id).collect();
    assert_eq!(ids, vec![1, 2]);
}

#[test]
fn etcd_records_carry_nodes_whose_lease_expired_only_while_the_record_is_unchanged() {
    let mut before = EtcdRecords::default();
    for id in 1..=4 {
        before.set_record(id, Some(rec(id, NodeState::Serving, 2)));
        before.set_alive(id, true);
    }
    let last = before.view();
    // Every lease expired while etcd was unreachable; node 1 registered again first. Node 3
    // changed its record meanwhile (drained), node 4's lease is back.
    let mut etcd = EtcdRecords::default();
    for id in 1..=4 {
        etcd.set_record(id, Some(rec(id, NodeState::Serving, 2)));
    }
    etcd.set_record(3, Some(rec(3, NodeState::Down, 3)));
    etcd.set_alive(1, true);
    etcd.set_alive(4, true);
    assert_eq!(
        etcd.carry(&last),
        vec![2],
        "only node 2: same record, no lease"
    );
    let v = etcd.view();
    assert_eq!(v.node(NodeId(2)).unwrap().state, NodeState::Serving);
    assert_eq!(v.node(NodeId(3)).unwrap().state, NodeState::Down);
    // Its lease comes back: etcd's record again; its lease goes: down at once.
    etcd.set_alive(2, true);
    assert!(!etcd.carrying());
    etcd.set_alive(2, false);
    assert_eq!(etcd.view().node(NodeId(2)).unwrap().state, NodeState::Down);
}

/// Nodes 0..3 serving at epoch 1, node 1 restarting at epoch 2: what node 1 left with.
fn departed() -> ClusterView {
    ClusterView::from_nodes(vec![
        rec(0, NodeState::Serving, 1),
        rec(1, NodeState::Restarting, 2),
        rec(2, NodeState::Serving, 1),
    ])
}

/// Node 1's next process, resuming from [`departed`] with its window ending at 10 000.
fn resumer() -> Membership {
    Membership::resuming(
        departed(),
        rec(1, NodeState::Joining, 1),
        Source::Gossip,
        10_000,
    )
    .expect("departed restarting")
}

fn keys_of(v: &ClusterView, id: u32) -> Vec<Vec<u8>> {
    (0..300u32)
        .map(|i| i.to_le_bytes().to_vec())
        .filter(|k| v.owner(k) == Some(NodeId(id)))
        .collect()
}

#[test]
fn a_restarting_node_keeps_its_keys() {
    let serving = ClusterView::from_nodes(vec![
        rec(0, NodeState::Serving, 1),
        rec(1, NodeState::Serving, 1),
        rec(2, NodeState::Serving, 1),
    ]);
    let mine = keys_of(&serving, 1);
    assert!(!mine.is_empty());
    assert_eq!(keys_of(&departed(), 1), mine, "nobody takes them");
    assert!(!NodeState::Restarting.reachable());
    assert!(NodeState::Restarting.owns());
    assert!(
        Membership::resuming(serving, rec(1, NodeState::Joining, 1), Source::Gossip, 1).is_none()
    );
}

#[test]
fn a_restart_in_place_resumes_once_every_owner_answered_with_nothing_changed() {
    let mut m = resumer();
    m.watch("n0", 0);
    m.watch("n2", 0);
    assert!(m.is_resuming());
    let _ = m.tick(0, TIMING, 7);
    assert!(m.is_resuming(), "nobody answered yet");
    let theirs = departed();
    assert_eq!(m.heard("n0", &theirs, 50, 7).resumed, None);
    assert!(
        m.tick(100, TIMING, 7).resumed.is_none(),
        "node 2 not heard yet"
    );
    let _ = m.heard("n2", &theirs, 150, 7);
    let step = m.tick(200, TIMING, 7);
    assert_eq!(step.resumed, Some(Ok(())));
    assert!(step.changed && !step.fenced);
    let mine = m.my_record().unwrap();
    assert_eq!((mine.state, mine.epoch), (NodeState::Serving, 3));
    // Objects recovered before the decision (generations below the mark) are served again.
    for k in keys_of(m.view(), 1) {
        assert!(m.continuous(&k, 3, 1));
    }
}

#[test]
fn a_node_that_joined_while_it_was_away_stops_the_resume() {
    let mut m = resumer();
    m.watch("n0", 0);
    m.watch("n2", 0);
    let mut theirs = departed();
    theirs.offer(&rec(3, NodeState::Serving, 2));
    let _ = m.heard("n0", &theirs, 50, 7);
    let _ = m.heard("n2", &theirs, 60, 7);
    let step = m.tick(100, TIMING, 7);
    assert_eq!(
        step.resumed,
        Some(Err("the cluster changed while it was away"))
    );
    assert!(step.fenced);
    assert_eq!(m.my_state(), NodeState::Joining);
    for k in keys_of(m.view(), 1) {
        assert!(!m.continuous(&k, 3, 1), "fenced");
    }
}

#[test]
fn a_node_only_marked_down_while_away_does_not_stop_the_resume() {
    let mut m = resumer();
    m.watch("n0", 0);
    m.watch("n2", 0);
    let mut theirs = departed();
    theirs.mark_down(2);
    let _ = m.heard("n0", &theirs, 50, 7);
    let step = m.tick(100, TIMING, 7);
    assert_eq!(
        step.resumed,
        Some(Ok(())),
        "node 2 is down: nothing to hear"
    );
}

#[test]
fn a_resume_past_its_window_or_after_being_marked_down_joins_afresh() {
    let mut late = resumer();
    let step = late.tick(10_000, TIMING, 7);
    assert_eq!(step.resumed, Some(Err("its restart window passed")));
    assert_eq!(late.my_state(), NodeState::Joining);

    let mut told = resumer();
    let mut theirs = departed();
    theirs.mark_down(1);
    let step = told.merge(&theirs, 7);
    assert!(step.fenced);
    assert_eq!(step.resumed, Some(Err("it was marked down while away")));
    assert_eq!(told.my_state(), NodeState::Joining);
    assert!(told.my_record().unwrap().epoch > 2, "above the down record");
    assert!(!told.is_resuming());
}

#[test]
fn etcd_resumes_by_the_record_etcd_holds() {
    let start = || {
        Membership::resuming(
            departed(),
            rec(1, NodeState::Joining, 1),
            Source::Etcd,
            10_000,
        )
        .unwrap()
    };
    let mut m = start();
    let _ = m.replace(departed(), 7);
    let held = rec(1, NodeState::Restarting, 2);
    assert_eq!(m.resume(100, Some(&held), 7).resumed, Some(Ok(())));
    let mut m = start();
    let _ = m.replace(departed(), 7);
    let down = rec(1, NodeState::Down, 2);
    assert_eq!(
        m.resume(100, Some(&down), 7).resumed,
        Some(Err("the others no longer hold it as restarting"))
    );
}

#[test]
fn a_restarting_peer_is_held_for_the_restart_window_not_down_after() {
    let mut m = Membership::new(rec(0, NodeState::Serving, 1), Source::Gossip);
    let peers = ClusterView::from_nodes(vec![
        rec(1, NodeState::Restarting, 2),
        rec(2, NodeState::Serving, 1),
    ]);
    let _ = m.merge(&peers, 0);
    m.watch("n1", 0);
    m.watch("n2", 0);
    let _ = m.tick(0, TIMING, 0);
    let state = |m: &Membership, id| m.view().node(NodeId(id)).unwrap().state;
    let _ = m.tick(1000, TIMING, 0);
    assert_eq!(state(&m, 2), NodeState::Down, "silent for down_after");
    assert_eq!(state(&m, 1), NodeState::Restarting, "held");
    assert!(!m.tick(4999, TIMING, 0).changed);
    assert!(m.tick(5000, TIMING, 0).changed);
    assert_eq!(state(&m, 1), NodeState::Down, "its window passed");
}
