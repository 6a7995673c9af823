//! The cluster view and where keys live: weighted rendezvous hashing.
//!
//! Every node and client computes the owner of a key from the same view, so requests go
//! straight to the owner. Rendezvous hashing scores every (node, key) pair and picks the highest;
//! with weights (contributed capacity) the score is `-weight / ln(u)` for a uniform `u` derived
//! from the pair's hash. A node joining or leaving only moves the keys it wins or held.

use rkyv::{Archive, Deserialize, Serialize};

use crate::addr::NodeId;

/// State of a node in the view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(compare(PartialEq), derive(Debug))]
pub enum NodeState {
    /// Announced, not yet taking new keys.
    Joining,
    /// Owns its share of keys.
    Serving,
    /// Leaving: takes no new keys, its objects are moving off.
    Draining,
    /// Unreachable: its keys are misses.
    Down,
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
    /// Contributed capacity in bytes: the placement weight.
    pub capacity: u64,
    /// State.
    pub state: NodeState,
}

/// The cluster view: every node, and a version that increases with every change.
#[derive(Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct ClusterView {
    /// Increases with every change.
    pub version: u64,
    /// The nodes.
    pub nodes: Vec<NodeInfo>,
}

impl ClusterView {
    /// The node that owns `key`: the serving node with the highest weighted rendezvous score.
    /// None when no node is serving.
    pub fn owner(&self, key: &[u8]) -> Option<NodeId> {
        let kh = xxhash_rust::xxh3::xxh3_64(key);
        self.nodes
            .iter()
            .filter(|n| n.state == NodeState::Serving && n.capacity > 0)
            .map(|n| (score(kh, n.id, n.capacity), n.id))
            .max_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, id)| NodeId(id))
    }

    /// The node with id `id`.
    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.id == id.0)
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
                    capacity: w,
                    state: NodeState::Serving,
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
}
