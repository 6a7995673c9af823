//! Reads while the cluster settles after a view change.
//!
//! A pinned object reaches a node that became one of its key's owners by the movers of the
//! nodes that held it, each after it adopts the new view: a put acknowledged while a joining
//! node was not serving yet went to the owners of that view only, and the joiner gets its copy
//! when their movers run. A read routed to the new owner by the new view can come before the
//! copy (a client that connects through that node knows no earlier view to fall back to), and
//! it would miss an acknowledged pinned object. So before a client's routed read of keys this
//! node lacks is served, while the view changed less than [`crate::cluster::SETTLE`] ago, the
//! node asks the nodes that held each key it took over ([`Cluster::holders`]) to move their
//! pinned object of it here now (`Move`): the mover's own copy, brought forward for the keys
//! being read. Then the read is served as usual.
//!
//! A holder is asked for a key only when no write or remove acknowledged on one of the key's
//! owners can be newer than its copy: this node vouches for the key (it noted no write or
//! remove of it since it could have taken one over it) and so does every other current owner
//! but the holder, the rule a client's read from a previous owner follows (docs/SECURITY.md,
//! "Stale copies in a cluster"). Whatever cannot be asked, or does not arrive, is a miss.

use std::collections::{BTreeMap, HashSet};

use kvpool::placement::ClusterView;
use kvpool::protocol::{ErrorCode, Op, Reply, MOVE_VERSION};
use kvpool::NodeId;

use crate::cluster::Cluster;
use crate::peers::Peers;
use crate::service::Shared;

impl Shared {
    /// Before a client's read of `keys` in namespace `ns`, routed by the view of `stamp`: the
    /// pinned objects of those keys that this node lacks but took over while the cluster
    /// settles are asked of the nodes that held them (see the module docs). Returns once they
    /// arrived, or could not be had.
    pub(crate) async fn settle_misses(&self, ns: u32, keys: &[&[u8]], stamp: u64) {
        if !self.cluster.settling() {
            return;
        }
        let Some(r) = self.replication(ns) else {
            return;
        };
        let replicas = r.replicas.max(r.pinned_replicas).max(1) as usize;
        let mut wanted: Vec<(&[u8], Vec<NodeId>)> = keys
            .iter()
            .filter(|k| matches!(self.pool.provenance(ns, k), Ok(None)))
            .filter_map(|&k| {
                let holders = self.cluster.holders(k, replicas);
                let vouched = !holders.is_empty() && self.cluster.vouches(ns, k, replicas);
                vouched.then_some((k, holders))
            })
            .collect();
        if wanted.is_empty() {
            return;
        }
        let view = self.cluster.view();
        if view.stamp() != stamp {
            return;
        }
        let creds = self.peer_auth();
        let mut peers = Peers::new(&view, &creds, self.cluster.me(), self.peers.timeout);
        let ask = Ask {
            m: &self.cluster,
            view: &view,
            ns,
            replicas,
        };
        // Round k asks each key still missing of its k-th holder.
        for round in 0.. {
            let mut by_holder: BTreeMap<u32, Vec<&[u8]>> = BTreeMap::new();
            for (k, holders) in &wanted {
                if let Some(h) = holders.get(round) {
                    by_holder.entry(h.0).or_default().push(k);
                }
            }
            if by_holder.is_empty() || self.cluster.stamp() != stamp {
                return;
            }
            for (holder, keys) in by_holder {
                ask.holder(&mut peers, holder, keys).await;
            }
            wanted.retain(|(k, _)| matches!(self.pool.provenance(ns, k), Ok(None)));
            if wanted.is_empty() {
                return;
            }
        }
    }
}

/// Asking one holder at a time, under the view the read was routed by.
struct Ask<'a> {
    m: &'a Cluster,
    view: &'a ClusterView,
    ns: u32,
    /// How many owners a key's copies may be on.
    replicas: usize,
}

impl Ask<'_> {
    /// Asks `holder` to move here its pinned objects of those of `keys` that every other
    /// current owner vouches for.
    async fn holder(&self, peers: &mut Peers<'_>, holder: u32, keys: Vec<&[u8]>) {
        let keys = self.vouched(peers, holder, keys).await;
        if keys.is_empty() {
            return;
        }
        let Some(p) = peers.get(holder).await else {
            return;
        };
        if p.hello.version < MOVE_VERSION {
            return;
        }
        let op = Op::Move {
            ns: self.ns,
            keys: keys.iter().map(|k| k.to_vec()).collect(),
            view: self.view.clone(),
        };
        // The holder moves under the newer of the two views; when that is not this node's,
        // its copies are refused here, and this node takes the newer view, so the read is
        // answered `WrongView` and routed again by it.
        match p.call(op, &[]).await {
            Ok(Reply::View(v)) => {
                self.m.merge(&v);
            }
            Ok(other) => {
                tracing::debug!(node = holder, reply = ?other, "unexpected answer to a move");
            }
            Err(e) => {
                tracing::debug!(node = holder, error = %e, "a holder was not asked to move keys here");
            }
        }
    }

    /// Those of `keys` that every current owner but this node and `holder` vouches for: none
    /// of them acknowledged a write or remove that `holder`'s copy could be older than. An
    /// owner that does not answer vouches for nothing.
    async fn vouched<'k>(
        &self,
        peers: &mut Peers<'_>,
        holder: u32,
        mut keys: Vec<&'k [u8]>,
    ) -> Vec<&'k [u8]> {
        let me = self.m.me();
        let mut by_owner: BTreeMap<u32, Vec<&'k [u8]>> = BTreeMap::new();
        for &k in &keys {
            for o in self.view.owners(k, self.replicas) {
                if o.0 != me && o.0 != holder {
                    by_owner.entry(o.0).or_default().push(k);
                }
            }
        }
        for (owner, asked) in by_owner {
            let answers = match peers.get(owner).await {
                Some(p) => {
                    let op = Op::Vouch {
                        ns: self.ns,
                        keys: asked.iter().map(|k| k.to_vec()).collect(),
                    };
                    match p.call(op, &[]).await {
                        Ok(Reply::Statuses(s)) if s.len() == asked.len() => s,
                        _ => Vec::new(),
                    }
                }
                None => Vec::new(),
            };
            let refused: HashSet<&[u8]> = asked
                .iter()
                .enumerate()
                .filter(|&(i, _)| answers.get(i) != Some(&(ErrorCode::Ok as u16)))
                .map(|(_, &k)| k)
                .collect();
            keys.retain(|k| !refused.contains(k));
        }
        keys
    }
}
