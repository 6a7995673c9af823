//! The cluster as etcd holds it, from which every node derives the same view.
//!
//! A node coming back to etcd after it could not reach it can't tell what happened to the
//! others meanwhile from what etcd holds: a node whose record is gone (etcd was wiped, or
//! restored from an older backup), or whose lease expired while its record is unchanged (etcd
//! was unreachable to it too, or wiped its lease), may be alive and about to register again at
//! its next retry. Marking it down or dropping it at once would move its keys to the nodes that
//! registered first, which would take writes for them that the node itself, still routing by
//! its own unchanged view, never hears of; it would later serve its older copies as their owner.
//! So a session that comes back [`EtcdRecords::carry`]s such nodes' records from this node's
//! last view, as they were, until etcd says something new of them (a record, a lease) or the
//! carry ends (the etcd gateway ends it after one lease TTL, the time a live node takes to
//! register again).
use std::collections::{BTreeMap, BTreeSet};

use crate::placement::{ClusterView, NodeInfo, NodeState};

/// The cluster as etcd holds it: every node's record and which nodes hold a live lease, at
/// the last revision seen. The etcd gateway feeds it key changes; [`EtcdRecords::view`] is
/// what every node derives alike.
#[derive(Clone, Debug, Default)]
pub struct EtcdRecords {
    records: BTreeMap<u32, NodeInfo>,
    alive: BTreeSet<u32>,
    /// Records of nodes etcd holds none of, kept from this node's last view (see the module).
    carried: BTreeMap<u32, NodeInfo>,
    /// The etcd revision of the last change seen.
    pub revision: u64,
}

impl EtcdRecords {
    /// Node `id`'s record changed: `Some` the new one, `None` deleted (or unreadable).
    pub fn set_record(&mut self, id: u32, rec: Option<NodeInfo>) {
        self.carried.remove(&id);
        match rec {
            Some(r) if r.id == id => {
                self.records.insert(id, r);
            }
            _ => {
                self.records.remove(&id);
            }
        }
    }

    /// Node `id`'s lease appeared or went.
    pub fn set_alive(&mut self, id: u32, alive: bool) {
        self.carried.remove(&id);
        if alive {
            self.alive.insert(id);
        } else {
            self.alive.remove(&id);
        }
    }

    /// Keeps the records of `last` (this node's view before etcd was lost) of nodes etcd holds
    /// no record of, or holds the same record of (same epoch) without a lease while `last` had
    /// them up, as they are in `last`, until etcd says something new of each or
    /// [`EtcdRecords::end_carry`]. Returns their ids.
    pub fn carry(&mut self, last: &ClusterView) -> Vec<u32> {
        for n in &last.nodes {
            let carried = match self.records.get(&n.id) {
                None => true,
                Some(r) => {
                    r.epoch == n.epoch && n.state != NodeState::Down && !self.alive.contains(&n.id)
                }
            };
            if carried {
                self.carried.insert(n.id, n.clone());
            }
        }
        self.carried.keys().copied().collect()
    }

    /// Whether any record is carried.
    pub fn carrying(&self) -> bool {
        !self.carried.is_empty()
    }

    /// Drops the carried records: those nodes did not register again in time.
    pub fn end_carry(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.carried).into_keys().collect()
    }

    /// The view: every record, down where its node holds no lease, and every carried record
    /// as it was instead of etcd's, at the revision seen.
    pub fn view(&self) -> ClusterView {
        let nodes = self
            .records
            .values()
            .filter(|n| !self.carried.contains_key(&n.id))
            .map(|n| {
                let mut n = n.clone();
                if !self.alive.contains(&n.id) {
                    n.state = NodeState::Down;
                }
                n
            });
        let mut nodes: Vec<NodeInfo> = nodes.chain(self.carried.values().cloned()).collect();
        nodes.sort_by_key(|n| n.id);
        ClusterView {
            version: self.revision,
            nodes,
        }
    }
}
