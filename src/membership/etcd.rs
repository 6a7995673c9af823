//! The cluster as etcd holds it, from which every node derives the same view.

use std::collections::{BTreeMap, BTreeSet};

use crate::placement::{ClusterView, NodeInfo, NodeState};

/// The cluster as etcd holds it: every node's record and which nodes hold a live lease, at
/// the last revision seen. The etcd gateway feeds it key changes; [`EtcdRecords::view`] is
/// what every node derives alike.
#[derive(Clone, Debug, Default)]
pub struct EtcdRecords {
    records: BTreeMap<u32, NodeInfo>,
    alive: BTreeSet<u32>,
    /// The etcd revision of the last change seen.
    pub revision: u64,
}

impl EtcdRecords {
    /// Node `id`'s record changed: `Some` the new one, `None` deleted (or unreadable).
    pub fn set_record(&mut self, id: u32, rec: Option<NodeInfo>) {
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

    /// The view: every record, down where its node holds no lease, at the revision seen.
    pub fn view(&self) -> ClusterView {
        ClusterView {
            version: self.revision,
            nodes: self
                .records
                .values()
                .map(|n| {
                    let mut n = n.clone();
                    if !self.alive.contains(&n.id) {
                        n.state = NodeState::Down;
                    }
                    n
                })
                .collect(),
        }
    }
}
