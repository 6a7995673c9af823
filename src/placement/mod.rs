//! The cluster view and where keys live: weighted rendezvous hashing.
//!
//! Every node and client computes the owners of a key from the same view, so requests go
//! straight to the owner. Rendezvous hashing scores every (node, key) pair and picks the highest;
//! with weights (contributed capacity) the score is `-weight / ln(u)` for a uniform `u` derived
//! from the pair's hash. A node joining or leaving only moves the keys it wins or held. With a
//! replication factor `r` a key lives on the `r` highest-scoring owning nodes: serving ones, and
//! restarting ones, whose keys stay theirs (unavailable, not moved) while they restart in place.
//!
//! Views are merged between nodes (static membership gossips them with every heartbeat): each
//! node record carries an *epoch* that only its node raises (when it changes its own state, or
//! to refute being marked down); a record with a higher epoch wins, and at equal epochs `Down`
//! wins. [`ClusterView::version`] is derived from the records, so two nodes that agree on every
//! record agree on the version, and it increases with every change (see [`version_of`]).

use rkyv::{Archive, Deserialize, Serialize};

pub mod history;
#[cfg(test)]
mod model_tests;
pub mod routing;

use crate::addr::NodeId;

/// State of a node in the view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(compare(PartialEq), derive(Debug))]
pub enum NodeState {
    /// Announced, not yet taking new keys.
    Joining,
    /// Owns its share of keys.
    Serving,
    /// Leaving: takes no new keys, its pinned objects are moving off.
    Draining,
    /// Unreachable (or gone): its keys are misses.
    Down,
    /// Away for a restart in place, within the cluster's restart window: it still owns its
    /// share of keys, and nobody takes them meanwhile (reads of them miss, writes of them are
    /// refused), so that when it returns the objects it recovered are exactly current. Marked
    /// down once the window passes without it.
    Restarting,
}

impl NodeState {
    /// Lower case name, as `kvpool cluster status` prints it.
    pub fn name(self) -> &'static str {
        match self {
            NodeState::Joining => "joining",
            NodeState::Serving => "serving",
            NodeState::Draining => "draining",
            NodeState::Down => "down",
            NodeState::Restarting => "restarting",
        }
    }

    /// Every state, in the order of their tags.
    pub const ALL: [NodeState; 5] = [
        NodeState::Joining,
        NodeState::Serving,
        NodeState::Draining,
        NodeState::Down,
        NodeState::Restarting,
    ];

    /// True for the states that own keys: serving, and restarting (its keys stay its own while
    /// it is away; they are unavailable, not moved).
    pub fn owns(self) -> bool {
        matches!(self, NodeState::Serving | NodeState::Restarting)
    }

    /// True when requests may be sent to the node: every state but restarting and down.
    pub fn reachable(self) -> bool {
        !matches!(self, NodeState::Restarting | NodeState::Down)
    }
}

/// One node as the cluster sees it.
#[derive(Clone, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Node id (unique in the cluster).
    pub id: u32,
    /// TCP endpoint, `host:port`.
    pub tcp: String,
    /// QUIC endpoint, `host:port` (empty when disabled).
    pub quic: String,
    /// Prometheus metrics endpoint, `host:port` (empty when disabled).
    pub metrics: String,
    /// Contributed capacity in bytes: the placement weight.
    pub capacity: u64,
    /// State.
    pub state: NodeState,
    /// Raised by the node itself with every change of its own record; a record with a higher
    /// epoch replaces one with a lower.
    pub epoch: u64,
}

impl NodeInfo {
    /// A serving node with weight `capacity`, no addresses, at epoch 1: what simulations and
    /// tests that need placement only build views of.
    pub fn serving(id: u32, capacity: u64) -> NodeInfo {
        NodeInfo {
            id,
            tcp: String::new(),
            quic: String::new(),
            metrics: String::new(),
            capacity,
            state: NodeState::Serving,
            epoch: 1,
        }
    }
}

/// The cluster view: every node, and a version that increases with every change.
#[derive(Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct ClusterView {
    /// Increases with every change; equal on two nodes that hold the same records.
    pub version: u64,
    /// The nodes, sorted by id.
    pub nodes: Vec<NodeInfo>,
}

/// The version of a set of records: `sum(2 * epoch + down)`. Every change raises it: a node's
/// own change raises its epoch (+2), being marked down adds 1, and coming back from down takes
/// a refuting epoch (+2 - 1); a new node adds its record.
pub fn version_of(nodes: &[NodeInfo]) -> u64 {
    nodes
        .iter()
        .map(|n| {
            n.epoch
                .saturating_mul(2)
                .saturating_add((n.state == NodeState::Down) as u64)
        })
        .fold(0u64, u64::saturating_add)
}

impl ClusterView {
    /// A view of these records (sorted, version derived).
    pub fn from_nodes(mut nodes: Vec<NodeInfo>) -> ClusterView {
        nodes.sort_by_key(|n| n.id);
        ClusterView {
            version: version_of(&nodes),
            nodes,
        }
    }

    /// The node that owns `key`: the owning node (serving or restarting) with the highest
    /// weighted rendezvous score. None when no node owns keys.
    pub fn owner(&self, key: &[u8]) -> Option<NodeId> {
        // The hot path of routing: one pass, no allocation.
        let kh = xxhash_rust::xxh3::xxh3_64(key);
        self.serving()
            .map(|n| (score(kh, n.id, n.capacity), n.id))
            .max_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, id)| NodeId(id))
    }

    fn serving(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes
            .iter()
            .filter(|n| n.state.owns() && n.capacity > 0)
    }

    /// The `r` owning nodes (serving or restarting) that hold `key`, best first (fewer when
    /// fewer own keys).
    pub fn owners(&self, key: &[u8], r: usize) -> Vec<NodeId> {
        let kh = xxhash_rust::xxh3::xxh3_64(key);
        let mut scored: Vec<(f64, u32)> = self
            .serving()
            .map(|n| (score(kh, n.id, n.capacity), n.id))
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        scored.truncate(r);
        scored.into_iter().map(|(_, id)| NodeId(id)).collect()
    }

    /// The node with id `id`.
    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.id == id.0)
    }

    /// A digest of every record: two views with the same stamp route every key alike. Never 0
    /// (0 on the wire means "not routed by a view").
    pub fn stamp(&self) -> u64 {
        let mut b = Vec::with_capacity(self.nodes.len() * 48);
        for n in &self.nodes {
            b.extend_from_slice(&n.id.to_le_bytes());
            b.extend_from_slice(&n.epoch.to_le_bytes());
            b.push(n.state as u8);
            b.extend_from_slice(&n.capacity.to_le_bytes());
            for s in [&n.tcp, &n.quic, &n.metrics] {
                b.extend_from_slice(&(s.len() as u32).to_le_bytes());
                b.extend_from_slice(s.as_bytes());
            }
        }
        xxhash_rust::xxh3::xxh3_64(&b).max(1)
    }

    /// Puts `rec` in the view if it is newer than what the view holds for its node (see the
    /// module docs). True when the view changed.
    pub fn offer(&mut self, rec: &NodeInfo) -> bool {
        match self.nodes.binary_search_by_key(&rec.id, |n| n.id) {
            Ok(i) => {
                let cur = &self.nodes[i];
                let newer = rec.epoch > cur.epoch
                    || (rec.epoch == cur.epoch
                        && rec.state == NodeState::Down
                        && cur.state != NodeState::Down);
                if !newer {
                    return false;
                }
                self.nodes[i] = rec.clone();
            }
            Err(i) => self.nodes.insert(i, rec.clone()),
        }
        self.version = version_of(&self.nodes);
        true
    }

    /// Merges every record of `other` into this view, except the record of node `me`, which
    /// only its node writes. True when the view changed.
    pub fn merge(&mut self, other: &ClusterView, me: u32) -> bool {
        let mut changed = false;
        for rec in other.nodes.iter().filter(|n| n.id != me) {
            changed |= self.offer(rec);
        }
        changed
    }

    /// Marks node `id` down at its current epoch. True when it was not down already.
    pub fn mark_down(&mut self, id: u32) -> bool {
        let Some(n) = self.nodes.iter_mut().find(|n| n.id == id) else {
            return false;
        };
        if n.state == NodeState::Down {
            return false;
        }
        n.state = NodeState::Down;
        self.version = version_of(&self.nodes);
        true
    }
}

/// A record for tests: node `id` at `n<id>`, capacity 1.
#[cfg(test)]
pub(crate) fn test_record(id: u32, state: NodeState, epoch: u64) -> NodeInfo {
    NodeInfo {
        tcp: format!("n{id}"),
        state,
        epoch,
        ..NodeInfo::serving(id, 1)
    }
}

fn score(key_hash: u64, node: u32, weight: u64) -> f64 {
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(&key_hash.to_le_bytes(), node as u64);
    // A uniform in (0, 1): 53 bits of the hash, never 0 or 1.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -(weight as f64) / u.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(weights: &[u64]) -> ClusterView {
        ClusterView {
            version: 1,
            nodes: weights
                .iter()
                .enumerate()
                .map(|(i, &w)| NodeInfo {
                    id: i as u32,
                    tcp: String::new(),
                    quic: String::new(),
                    metrics: String::new(),
                    capacity: w,
                    state: NodeState::Serving,
                    epoch: 1,
                })
                .collect(),
        }
    }

    #[test]
    fn shares_follow_weights_and_joins_move_only_their_share() {
        let v = view(&[1, 2, 1]);
        let mut counts = [0usize; 4];
        let keys: Vec<Vec<u8>> = (0..40_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let before: Vec<NodeId> = keys.iter().map(|k| v.owner(k).unwrap()).collect();
        for o in &before {
            counts[o.0 as usize] += 1;
        }
        for (i, w) in [0.25, 0.5, 0.25].iter().enumerate() {
            let share = counts[i] as f64 / keys.len() as f64;
            assert!((share - w).abs() < 0.02, "node {i}: {share}");
        }
        let v4 = view(&[1, 2, 1, 1]);
        let moved: Vec<_> = keys
            .iter()
            .zip(&before)
            .filter(|(k, o)| v4.owner(k).unwrap() != **o)
            .collect();
        assert!(
            moved.iter().all(|(k, _)| v4.owner(k) == Some(NodeId(3))),
            "only moves to the new node"
        );
        let share = moved.len() as f64 / keys.len() as f64;
        assert!((share - 0.2).abs() < 0.02, "{share}");
    }

    #[test]
    fn down_nodes_own_nothing() {
        let mut v = view(&[1, 1]);
        v.nodes[0].state = NodeState::Down;
        assert!((0..1000u32).all(|i| v.owner(&i.to_le_bytes()) == Some(NodeId(1))));
        v.nodes[1].state = NodeState::Draining;
        assert_eq!(v.owner(b"k"), None);
    }

    #[test]
    fn replicas_are_distinct_and_start_with_the_owner() {
        let v = view(&[1, 1, 1, 1]);
        for i in 0..2000u32 {
            let k = i.to_le_bytes();
            let o = v.owners(&k, 3);
            assert_eq!(o.len(), 3);
            assert_eq!(Some(o[0]), v.owner(&k));
            assert!(o[0] != o[1] && o[1] != o[2] && o[0] != o[2]);
        }
        assert_eq!(v.owners(b"k", 9).len(), 4, "at most every serving node");
    }

    #[test]
    fn higher_epochs_win_and_down_wins_a_tie() {
        let mut v = view(&[1, 1, 1]);
        let v0 = v.version;
        let mut rec = v.nodes[2].clone();
        rec.state = NodeState::Down;
        assert!(v.offer(&rec), "down wins at an equal epoch");
        assert!(v.version > v0);
        let v1 = v.version;
        rec.state = NodeState::Serving;
        assert!(
            !v.offer(&rec),
            "a down record is only refuted by a higher epoch"
        );
        rec.epoch = 2;
        assert!(v.offer(&rec));
        assert!(v.version > v1, "refuting raises the version");
        rec.epoch = 1;
        assert!(!v.offer(&rec), "older records are ignored");
        let mut other = v.clone();
        other.nodes[0].state = NodeState::Draining;
        other.nodes[0].epoch = 5;
        assert!(!v.clone().merge(&other, 0), "nobody else writes my record");
        assert!(v.merge(&other, 1));
        assert_eq!(v.stamp(), other.stamp());
    }

    proptest::proptest! {
        /// Merging is a join: any order of merges ends in the same view, so gossip converges.
        #[test]
        fn merge_is_commutative_and_idempotent(
            a in proptest::collection::vec((0u32..6, 1u64..4, proptest::bool::ANY), 0..8),
            b in proptest::collection::vec((0u32..6, 1u64..4, proptest::bool::ANY), 0..8),
        ) {
            // Only a node writes its record at a given epoch; others may only mark it down.
            let mk = |recs: &[(u32, u64, bool)]| {
                let mut v = ClusterView::default();
                for &(id, epoch, down) in recs {
                    let own = [NodeState::Joining, NodeState::Serving, NodeState::Draining];
                    let state = if down { NodeState::Down } else { own[((id as u64 + epoch) % 3) as usize] };
                    v.offer(&NodeInfo { id, tcp: format!("n{id}"), quic: String::new(), metrics: String::new(), capacity: 1, state, epoch });
                }
                v
            };
            let (va, vb) = (mk(&a), mk(&b));
            let mut ab = va.clone();
            ab.merge(&vb, u32::MAX);
            let mut ba = vb.clone();
            ba.merge(&va, u32::MAX);
            let mut ab_states: Vec<_> = ab.nodes.iter().map(|n| (n.id, n.epoch, n.state)).collect();
            let ba_states: Vec<_> = ba.nodes.iter().map(|n| (n.id, n.epoch, n.state)).collect();
            proptest::prop_assert_eq!(&ab_states, &ba_states);
            proptest::prop_assert_eq!(ab.version, ba.version);
            proptest::prop_assert!(!ab.clone().merge(&ba, u32::MAX), "idempotent");
            ab_states.dedup_by_key(|s| s.0);
            proptest::prop_assert_eq!(ab_states.len(), ab.nodes.len());
        }
    }
}
