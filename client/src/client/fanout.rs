//! The one fan-out of the client: a request over many keys is cut into batches, one per node
//! that owns some of them, all sent at once, and the answers are put back in key order by the
//! callers. Part of `client`; uses `routing` (who owns a key, the links) and `link`.

use std::future::Future;
use std::sync::Arc;

use futures_util::future::join_all;
use kvpool::placement::routing;

use super::routing::Routing;
use super::Client;
use crate::error::ClientError;
use crate::link::Link;

/// The keys of one request to one node: indexes into the caller's keys, in order.
pub(super) struct Batch<X = ()> {
    pub(super) node: u32,
    /// The view stamp the request is routed by (0: the node is asked on purpose, e.g. a
    /// previous owner).
    pub(super) stamp: u64,
    /// What else tells two batches to one node apart (whether they are to the keys' primary
    /// owner), or travels with the batch (its destination buffers).
    pub(super) tag: X,
    pub(super) idx: Vec<usize>,
}

/// Puts key index `i` in the batch for `(node, stamp, tag)`, a new one when there is none
/// yet (batches keep the order they first appear in).
pub(super) fn add_key<X: PartialEq>(
    batches: &mut Vec<Batch<X>>,
    node: u32,
    stamp: u64,
    tag: X,
    i: usize,
) {
    match batches
        .iter_mut()
        .find(|b| b.node == node && b.stamp == stamp && b.tag == tag)
    {
        Some(b) => b.idx.push(i),
        None => batches.push(Batch {
            node,
            stamp,
            tag,
            idx: vec![i],
        }),
    }
}

/// The items of `all` a batch carries, in its order.
pub(super) fn pick<T: Copy>(all: &[T], idx: &[usize]) -> Vec<T> {
    idx.iter().map(|&i| all[i]).collect()
}

/// The `(key index, node asked)` pairs of batches to previous owners.
pub(super) fn asked_of(batches: &[Batch]) -> Vec<(usize, u32)> {
    batches
        .iter()
        .flat_map(|b| b.idx.iter().map(move |&i| (i, b.node)))
        .collect()
}

impl Client {
    /// Sends one request per batch, all at once: `call` gets the link to the batch's node
    /// (opened on first use), the namespace's id on that node, and the batch. The answers come
    /// back in batch order, a failure to reach the node included; what a failure means is the
    /// caller's decision (most pass it through [`Client::reached`]).
    pub(super) async fn fan_out<'a, X, T, Fut>(
        &'a self,
        r: &'a Routing,
        batches: &'a mut [Batch<X>],
        call: impl Fn(Arc<Link>, u32, &'a mut Batch<X>) -> Fut,
    ) -> Vec<Result<T, ClientError>>
    where
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let call = &call;
        join_all(batches.iter_mut().map(|b| async move {
            let l = self.link(b.node, r).await?;
            let ns = l.ns(&self.ns)?;
            call(l, ns, b).await
        }))
        .await
    }

    /// A node's answer; None when the node can't be reached (logged and its link dropped: its
    /// keys are misses), the error when the node refused or broke the protocol.
    pub(super) fn reached<T>(
        &self,
        node: u32,
        res: Result<T, ClientError>,
    ) -> Result<Option<T>, ClientError> {
        match res {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_unreachable() => {
                self.lost(node, &e);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The keys `which` of `keys`, batched by their `k`-th owner under `r` (the grouping is
    /// the core's, [`routing::group_by_owner`]); keys without one are left out.
    pub(super) fn by_owner(
        &self,
        r: &Routing,
        keys: &[&[u8]],
        which: impl IntoIterator<Item = usize>,
        k: usize,
    ) -> Vec<Batch> {
        let mut batches = Vec::new();
        for (node, ix) in routing::group_by_owner(&r.view, keys, which, k) {
            for i in ix {
                add_key(&mut batches, node.0, r.stamp, (), i);
            }
        }
        batches
    }

    /// The keys `which` of `keys`, batched by their previous owner (asked on purpose: stamp
    /// 0); keys whose owner did not change, or whose previous owner is down, are left out.
    pub(super) fn by_previous_owner(
        &self,
        r: &Routing,
        keys: &[&[u8]],
        which: impl IntoIterator<Item = usize>,
    ) -> Vec<Batch> {
        let mut batches = Vec::new();
        for i in which {
            if let Some(p) = self.prev_owner(r, keys[i]) {
                add_key(&mut batches, p, 0, (), i);
            }
        }
        batches
    }
}
