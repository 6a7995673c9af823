//! Same-host holds: objects of this host's nodes kept in place while this process reads their
//! memory where it lies, without a copy (the zero-copy views of model weights). Part of
//! `client`; uses `link` (the `Hold` exchange) and `local` (the read-only mappings).

use std::sync::Arc;

use kvpool::{AddrFault, GlobalAddr};

use super::fanout::pick;
use super::Client;
use crate::conn::Conn;
use crate::error::ClientError;
use crate::local::{stitch, LocalMap, ReadView, ViewError};
use crate::located::Located;

/// Objects of this host's nodes held in place (`Op::Hold`): while this value lives, each held
/// object is neither evicted nor its memory reused, a removal or an overwrite waiting for it,
/// so [`LocalHold::view`] may map its memory and read it as it is. Dropping it (every view
/// made from it first) ends the holds: they live on connections of their own, one per node,
/// which the daemon ends the holds of when they close, however this process ends.
#[derive(Default)]
pub struct LocalHold {
    /// Never used again, only kept open (behind a lock so that a hold can be shared between
    /// threads: a connection's stream is not `Sync`).
    conns: std::sync::Mutex<Vec<Conn>>,
    maps: Vec<(u32, Arc<LocalMap>)>,
}

impl LocalHold {
    /// Takes `other`'s holds into this one.
    pub fn absorb(&mut self, other: LocalHold) {
        let theirs = other.conns.into_inner().unwrap_or_else(|e| e.into_inner());
        self.conns
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .extend(theirs);
        self.maps.extend(other.maps);
    }

    /// Connections (one per node asked) that keep the holds.
    pub fn connections(&self) -> usize {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Maps objects held by this hold, read-only and end to end, into one range of memory
    /// (see [`ReadView`]); the view must be dropped before this hold. The objects must be
    /// page aligned end to end (always true of one object, and of the large blocks weights
    /// chunks are); anything else is an error, and the caller copies instead.
    /// `populate` fills in the page tables at once (see `local::stitch`).
    pub fn view(&self, addrs: &[GlobalAddr], populate: bool) -> Result<ReadView, ViewError> {
        let mut parts = Vec::with_capacity(addrs.len());
        for a in addrs {
            let map = self
                .maps
                .iter()
                .rev()
                .find(|(node, m)| *node == a.node.0 && m.covers(a))
                .ok_or(ViewError::Fault(AddrFault::WrongNode))?;
            parts.push((&*map.1, *a));
        }
        stitch(&parts, populate)
    }
}

impl Client {
    /// Holds `keys` on their `replica`-th owners (see [`Client::lease_replica`]) when those are
    /// on this host, for reading in place with [`LocalHold::view`]. A key whose owner is not
    /// on this host (or can't be reached), or that is absent, is None. One connection per node
    /// (and per `max_batch` keys) is opened for the holds and kept by the returned
    /// [`LocalHold`].
    pub async fn hold_local(
        &self,
        keys: &[&[u8]],
        replica: usize,
    ) -> Result<(LocalHold, Vec<Option<Located>>), ClientError> {
        let cfg = &self.cfg;
        routed!(self, r => {
            let mut batches = self.by_owner(&r, keys, 0..keys.len(), replica);
            let answers = self
                .fan_out(&r, &mut batches, |l, ns, b| {
                    let sub = pick(keys, &b.idx);
                    async move {
                        if l.local().is_none() {
                            return Ok(None);
                        }
                        l.hold(cfg, b.stamp, ns, &sub).await.map(Some)
                    }
                })
                .await;
            let mut hold = LocalHold::default();
            let mut out = vec![None; keys.len()];
            for (b, res) in batches.iter().zip(answers) {
                if let Some(Some((conn, map, found))) = self.reached(b.node, res)? {
                    hold.conns
                        .get_mut()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(conn);
                    hold.maps.push((b.node, map));
                    b.idx.iter().zip(found).for_each(|(&i, f)| out[i] = f);
                }
            }
            Ok((hold, out))
        })
    }
}
