//! Where requests and objects go under a view, decided from the view alone: the batches a
//! client sends (one per node, [`group_by_owner`]; the previous owner a miss may be asked,
//! [`previous_owner`]), and what a change of view moves: which of a node's pinned objects go to
//! which owners, and which it may drop once they have arrived ([`plan`]). The client and the
//! daemon's mover only carry the requests and copies.
//!
//! Every node holds each of its pinned objects for a reason: it is among the object's first
//! `r` serving owners. After a view change a node sends each object to the owners that may
//! lack it, keeps the ones it still owns, and drops the others once every owner confirmed a
//! copy. A join therefore moves only the objects the new node now owns, and a drain moves every
//! object of the draining node (it owns nothing) and nothing else.

use std::collections::BTreeMap;

use super::{ClusterView, NodeState};
use crate::addr::NodeId;

/// The copies one node's pinned objects need under a view.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MovePlan {
    /// Per owner other than this node (ascending id): the indexes of the keys it should hold.
    pub to: Vec<(NodeId, Vec<usize>)>,
    /// Per key: this node is one of its owners (it keeps the object).
    pub owned_here: Vec<bool>,
    /// Per key: how many owners it has (fewer than `r` when fewer nodes serve; 0 when none).
    pub owners: Vec<usize>,
}

/// What becomes of one object after the owners were asked (and sent what they lacked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This node owns it: it stays.
    Keep,
    /// Every owner confirmed a copy and this node is not one: drop it here.
    HandOff,
    /// An owner could not be reached, or none serves: it stays until a later pass.
    Stranded,
}

/// The plan for the pinned `keys` held by node `me`, each to live on its first `r` (at least 1)
/// owners under `view`.
pub fn plan(view: &ClusterView, me: NodeId, keys: &[impl AsRef<[u8]>], r: usize) -> MovePlan {
    let mut to: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    let mut owned_here = vec![false; keys.len()];
    let mut owners = vec![0; keys.len()];
    for (i, k) in keys.iter().enumerate() {
        let os = view.owners(k.as_ref(), r.max(1));
        owners[i] = os.len();
        for o in os {
            if o == me {
                owned_here[i] = true;
            } else {
                to.entry(o.0).or_default().push(i);
            }
        }
    }
    MovePlan {
        to: to.into_iter().map(|(o, ix)| (NodeId(o), ix)).collect(),
        owned_here,
        owners,
    }
}

impl MovePlan {
    /// What becomes of key `i`, which `confirmed` of its owners hold now; `failed`: some owner
    /// could not be asked or sent it.
    pub fn outcome(&self, i: usize, confirmed: usize, failed: bool) -> Outcome {
        if self.owned_here[i] {
            Outcome::Keep
        } else if failed || self.owners[i] == 0 || confirmed < self.owners[i] {
            Outcome::Stranded
        } else {
            Outcome::HandOff
        }
    }
}

/// The keys `which` of `keys` grouped by their owner under `view` (`rank` 0) or by their
/// `rank`-th owner, in ascending node order, each group's indexes in the order given; keys
/// without one are left out. What a client sends to each node in one request.
pub fn group_by_owner(
    view: &ClusterView,
    keys: &[impl AsRef<[u8]>],
    which: impl IntoIterator<Item = usize>,
    rank: usize,
) -> Vec<(NodeId, Vec<usize>)> {
    let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for i in which {
        let k = keys[i].as_ref();
        let owner = match rank {
            0 => view.owner(k),
            _ => view.owners(k, rank + 1).get(rank).copied(),
        };
        if let Some(o) = owner {
            groups.entry(o.0).or_default().push(i);
        }
    }
    groups.into_iter().map(|(o, ix)| (NodeId(o), ix)).collect()
}

/// The node that owned `key` under `prev`, the view before `view`, when that is not its owner
/// under `view` and `view` does not have it down: a miss at the owner may still be there (the
/// owner vouching that it acknowledged no newer write; see the client).
pub fn previous_owner(prev: &ClusterView, view: &ClusterView, key: &[u8]) -> Option<NodeId> {
    let before = prev.owner(key)?;
    let alive = view
        .node(before)
        .is_some_and(|n| n.state != NodeState::Down);
    (Some(before) != view.owner(key) && alive).then_some(before)
}
