//! Placement against a simple model: random views, random keys, the properties routing and
//! moving rely on.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::routing::{self, Outcome};
use super::{ClusterView, NodeInfo, NodeState};
use crate::addr::NodeId;

fn rec(id: u32, capacity: u64, state: NodeState) -> NodeInfo {
    NodeInfo {
        capacity,
        ..super::test_record(id, state, 1)
    }
}

fn states() -> impl Strategy<Value = NodeState> {
    prop_oneof![
        Just(NodeState::Joining),
        Just(NodeState::Serving),
        Just(NodeState::Serving),
        Just(NodeState::Draining),
        Just(NodeState::Down),
    ]
}

/// Up to 8 nodes with distinct ids, any capacity (0 included) and any state.
fn any_view() -> impl Strategy<Value = ClusterView> {
    proptest::collection::btree_map(0u32..64, (0u64..4, states()), 1..8).prop_map(|m| {
        ClusterView::from_nodes(m.into_iter().map(|(id, (c, s))| rec(id, c, s)).collect())
    })
}

/// 2 to 7 serving nodes with distinct ids and capacities 1 to 4.
fn serving_view() -> impl Strategy<Value = ClusterView> {
    proptest::collection::btree_map(0u32..64, 1u64..5, 2..8).prop_map(|m| {
        ClusterView::from_nodes(
            m.into_iter()
                .map(|(id, c)| rec(id, c, NodeState::Serving))
                .collect(),
        )
    })
}

fn keys(n: u32, salt: u64) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("k{salt}/{i}").into_bytes())
        .collect()
}

fn takes_keys(n: &NodeInfo) -> bool {
    n.state == NodeState::Serving && n.capacity > 0
}

/// Per node, the indexes of the keys it holds.
type Holdings = BTreeMap<u32, BTreeSet<usize>>;

/// Which nodes hold which keys: every key on its first `r` owners under `v`.
fn settled(v: &ClusterView, keys: &[Vec<u8>], r: usize) -> Holdings {
    let mut held = Holdings::new();
    for (i, k) in keys.iter().enumerate() {
        for o in v.owners(k, r) {
            held.entry(o.0).or_default().insert(i);
        }
    }
    held
}

/// Runs the movers of every node under `next` until nothing moves: each node sends every
/// pinned object to the owners that lack it, then drops those it hands off. Returns the keys
/// copied (key index, to whom), and the holdings after.
fn run_movers(
    next: &ClusterView,
    keys: &[Vec<u8>],
    r: usize,
    mut held: Holdings,
) -> (Vec<(usize, u32)>, Holdings) {
    let mut copies = Vec::new();
    let nodes: Vec<u32> = held.keys().copied().collect();
    for me in nodes {
        let mine: Vec<usize> = held[&me].iter().copied().collect();
        let my_keys: Vec<&Vec<u8>> = mine.iter().map(|&i| &keys[i]).collect();
        let plan = routing::plan(next, NodeId(me), &my_keys, r);
        let mut confirmed = vec![0usize; mine.len()];
        for (owner, ix) in &plan.to {
            for &j in ix {
                let slot = held.entry(owner.0).or_default();
                if slot.insert(mine[j]) {
                    copies.push((mine[j], owner.0));
                }
                confirmed[j] += 1;
            }
        }
        for (j, &c) in confirmed.iter().enumerate() {
            if plan.outcome(j, c, false) == Outcome::HandOff {
                held.get_mut(&me).unwrap().remove(&mine[j]);
            }
        }
    }
    held.retain(|_, ks| !ks.is_empty());
    (copies, held)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every key has exactly one owner in every view, the same on every node that holds the
    /// same records, and it is a node that takes keys; taking away any other node keeps it.
    #[test]
    fn every_key_has_exactly_one_owner(v in any_view(), salt in any::<u64>()) {
        let any_serving = v.nodes.iter().any(takes_keys);
        let mut renumbered = v.clone();
        renumbered.version += 17;
        for k in keys(200, salt) {
            let owner = v.owner(&k);
            prop_assert_eq!(owner.is_some(), any_serving);
            let Some(o) = owner else { continue };
            prop_assert!(takes_keys(v.node(o).unwrap()));
            prop_assert_eq!(renumbered.owner(&k), Some(o), "the version does not route");
            prop_assert_eq!(v.owners(&k, 1), vec![o]);
            let all = v.owners(&k, 8);
            prop_assert_eq!(all.len(), v.nodes.iter().filter(|n| takes_keys(n)).count());
            prop_assert_eq!(all.iter().collect::<BTreeSet<_>>().len(), all.len(), "distinct");
            for other in v.nodes.iter().filter(|n| n.id != o.0) {
                let mut without = v.clone();
                without.nodes.retain(|n| n.id != other.id);
                prop_assert_eq!(without.owner(&k), Some(o));
            }
        }
    }

    /// A join moves only keys the new node now owns, about its share of them (its capacity
    /// over the total); with replicas, the new node takes one place in a key's owners and the
    /// others keep their order; the movers copy only to the new node.
    #[test]
    fn a_join_moves_only_what_the_new_node_owns(
        v in serving_view(),
        new_id in 64u32..128,
        new_cap in 1u64..5,
        r in 1usize..4,
        salt in any::<u64>(),
    ) {
        let ks = keys(3000, salt);
        let mut nodes = v.nodes.clone();
        nodes.push(rec(new_id, new_cap, NodeState::Serving));
        let joined = ClusterView::from_nodes(nodes);
        let moved = ks.iter().filter(|k| v.owner(k) != joined.owner(k));
        let mut count = 0usize;
        for k in moved {
            prop_assert_eq!(joined.owner(k), Some(NodeId(new_id)));
            count += 1;
        }
        let total: u64 = joined.nodes.iter().map(|n| n.capacity).sum();
        let share = new_cap as f64 / total as f64;
        let seen = count as f64 / ks.len() as f64;
        prop_assert!((seen - share).abs() < 0.06, "moved {seen}, share {share}");
        for k in &ks {
            let before = v.owners(k, r);
            let after: Vec<NodeId> =
                joined.owners(k, r).into_iter().filter(|o| o.0 != new_id).collect();
            prop_assert!(before.starts_with(&after), "{before:?} then {after:?}");
        }
        let (copies, held) = run_movers(&joined, &ks, r, settled(&v, &ks, r));
        prop_assert!(copies.iter().all(|&(_, to)| to == new_id));
        prop_assert_eq!(held, settled(&joined, &ks, r), "every key ends on its owners");
    }

    /// A drain moves every one of the drained node's objects (one new home each, since it owns
    /// nothing any more, when enough nodes stay to hold `r` copies) and nothing else.
    #[test]
    fn a_drain_moves_the_drained_nodes_objects_and_nothing_else(
        v in serving_view(),
        pick in any::<prop::sample::Index>(),
        r in 1usize..4,
        salt in any::<u64>(),
    ) {
        let ks = keys(1000, salt);
        let d = v.nodes[pick.index(v.nodes.len())].id;
        let mut draining = v.clone();
        draining.nodes.iter_mut().find(|n| n.id == d).unwrap().state = NodeState::Draining;
        let before = settled(&v, &ks, r);
        let theirs = before.get(&d).cloned().unwrap_or_default();
        let (copies, held) = run_movers(&draining, &ks, r, before);
        let copied: Vec<usize> = copies.iter().map(|&(i, _)| i).collect();
        let copied_set: BTreeSet<usize> = copied.iter().copied().collect();
        prop_assert!(copied_set.is_subset(&theirs), "only the drained node's objects move");
        if v.nodes.len() > r {
            // Enough nodes stay for r copies: each object takes exactly one new home.
            prop_assert_eq!(&copied_set, &theirs);
            prop_assert_eq!(copied.len(), theirs.len(), "one new home per object");
        } else {
            prop_assert!(copies.is_empty(), "every staying node holds every key already");
        }
        prop_assert!(!held.contains_key(&d), "the drained node keeps nothing");
        prop_assert_eq!(held, settled(&draining, &ks, r));
    }
}

#[test]
fn an_unreachable_owner_strands_the_object_and_nothing_is_dropped() {
    let v = ClusterView::from_nodes(vec![
        rec(1, 1, NodeState::Draining),
        rec(2, 1, NodeState::Serving),
    ]);
    let ks = keys(10, 7);
    let plan = routing::plan(&v, NodeId(1), &ks, 1);
    assert_eq!(plan.to, vec![(NodeId(2), (0..10).collect())]);
    assert_eq!(plan.outcome(0, 0, true), Outcome::Stranded);
    assert_eq!(plan.outcome(0, 1, false), Outcome::HandOff);
    let none = ClusterView::from_nodes(vec![rec(1, 1, NodeState::Draining)]);
    let plan = routing::plan(&none, NodeId(1), &ks, 1);
    assert!(plan.to.is_empty());
    assert_eq!(
        plan.outcome(0, 0, false),
        Outcome::Stranded,
        "no owner: keep it"
    );
}

#[test]
fn groups_follow_the_owners_of_each_rank() {
    let v = ClusterView::from_nodes((0..4).map(|i| rec(i, 1, NodeState::Serving)).collect());
    let ks = keys(500, 3);
    for rank in 0..3 {
        let groups = routing::group_by_owner(&v, &ks, 0..ks.len(), rank);
        let mut seen = 0;
        for (node, ix) in &groups {
            for &i in ix {
                assert_eq!(v.owners(&ks[i], rank + 1)[rank], *node);
                seen += 1;
            }
        }
        assert_eq!(seen, ks.len());
    }
    let odd = routing::group_by_owner(&v, &ks, (1..ks.len()).step_by(2), 0);
    assert!(odd.iter().flat_map(|(_, ix)| ix).all(|i| i % 2 == 1));
}

#[test]
fn a_previous_owner_is_asked_only_when_it_changed_and_is_not_down() {
    let two = ClusterView::from_nodes((0..2).map(|i| rec(i, 1, NodeState::Serving)).collect());
    let mut three = two.clone();
    three.nodes.push(rec(2, 1, NodeState::Serving));
    let ks = keys(300, 9);
    let mut asked = 0;
    for k in &ks {
        match routing::previous_owner(&two, &three, k) {
            Some(p) => {
                assert_eq!(three.owner(k), Some(NodeId(2)), "only moved keys");
                assert_eq!(two.owner(k), Some(p));
                asked += 1;
            }
            None => assert_eq!(two.owner(k), three.owner(k)),
        }
    }
    assert!(asked > 0);
    let mut down = three.clone();
    down.nodes[0].state = NodeState::Down;
    down.nodes[1].state = NodeState::Down;
    assert!(ks
        .iter()
        .all(|k| routing::previous_owner(&two, &down, k).is_none()));
}
