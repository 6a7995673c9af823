//! The cluster as etcd holds it, from which every node derives the same view.
//!
//! A node whose record etcd does not hold at all (etcd was wiped, or restored from an older
//! backup) is not known to be down: its lease, if it is alive, is simply gone with the rest, and
//! it registers again at its next retry. Dropping it from the view at once would move its keys
//! to the nodes that registered first, which would take writes for them that the node itself,
//! still routing by its own unchanged view, never hears of, and it would later serve its older
//! copies as the owner. So a session that finds such nodes [`EtcdRecords::carry`]s their last
//! records from this node's view, as they were, until they register again or the carry ends
//! (the etcd gateway ends it after one lease TTL, as long as a lease would have let them live).

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
        if alive {
            self.alive.insert(id);
        } else {
            self.alive.remove(&id);
        }
    }

    /// Keeps the records of `last` (this node's view) of nodes etcd holds no record of, as
    /// they are there, until each registers again or [`EtcdRecords::end_carry`]. Returns
    /// their ids.
    pub fn carry(&mut self, last: &ClusterView) -> Vec<u32> {
        for n in &last.nodes {
            if !self.records.contains_key(&n.id) {
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
    /// as it was, at the revision seen.
    pub fn view(&self) -> ClusterView {
        let held = self.records.values().map(|n| {
            let mut n = n.clone();
            if !self.alive.contains(&n.id) {
                n.state = NodeState::Down;
            }
            n
        });
        let mut nodes: Vec<NodeInfo> = held.chain(self.carried.values().cloned()).collect();
        nodes.sort_by_key(|n| n.id);
        ClusterView {
            version: self.revision,
            nodes,
        }
    }
}
