//! The one fan-out of the client: a request over many keys is cut into batches, one per node
//! that owns some of them, all sent at once, and the answers are put back in key order by the
//! callers. Part of `client`; uses `routing` (who owns a key, the links) and `link`.

use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use futures_util::future::join_all;
use kvpool::placement::routing;
use kvpool::protocol::HelloInfo;

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
    /// Payload bytes the batch carries (a put's values; 0 for keys alone).
    pub(super) bytes: u64,
}

/// How large one request may be: at most `keys` keys or items, and `bytes` of payload. A
/// batch that would pass either is cut into several requests to the same node, sent together,
/// so a caller never meets a node's `max_batch` (`BatchTooLarge`) or `max_payload` (which
/// closes the connection) however many keys it passes. A single item larger than `bytes` still
/// goes alone, and the node refuses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Cut {
    pub(super) keys: usize,
    pub(super) bytes: u64,
}

/// The smallest limits of the nodes a client has met, each from its `Hello` (nodes of one
/// cluster are usually configured alike; a node first met in the middle of a request lowers
/// them from the next one on).
pub(super) struct CutLimits {
    keys: AtomicU32,
    bytes: AtomicU64,
}

impl CutLimits {
    pub(super) fn new(hello: &HelloInfo) -> CutLimits {
        CutLimits {
            keys: AtomicU32::new(hello.max_batch),
            bytes: AtomicU64::new(hello.max_payload),
        }
    }

    /// A node's limits, met when a link to it opens.
    pub(super) fn meet(&self, hello: &HelloInfo) {
        self.keys.fetch_min(hello.max_batch, Relaxed);
        self.bytes.fetch_min(hello.max_payload, Relaxed);
    }

    pub(super) fn get(&self) -> Cut {
        Cut {
            keys: (self.keys.load(Relaxed) as usize).max(1),
            bytes: self.bytes.load(Relaxed).max(1),
        }
    }
}

/// Puts key index `i` in the batch for `(node, stamp, tag)`, a new one when there is none
/// yet or the last one is full by `cut` (batches keep the order they first appear in).
pub(super) fn add_key<X: PartialEq>(
    batches: &mut Vec<Batch<X>>,
    (node, stamp, tag): (u32, u64, X),
    i: usize,
    cut: Cut,
) {
    add_item(batches, (node, stamp, tag), (i, 0), cut)
}

/// [`add_key`] for an item carrying `bytes` of payload.
pub(super) fn add_item<X: PartialEq>(
    batches: &mut Vec<Batch<X>>,
    (node, stamp, tag): (u32, u64, X),
    (i, bytes): (usize, u64),
    cut: Cut,
) {
    let last = batches
        .iter_mut()
        .rev()
        .find(|b| b.node == node && b.stamp == stamp && b.tag == tag);
    match last {
        Some(b) if b.idx.len() < cut.keys && b.bytes.saturating_add(bytes) <= cut.bytes => {
            b.idx.push(i);
            b.bytes += bytes;
        }
        _ => batches.push(Batch {
            node,
            stamp,
            tag,
            idx: vec![i],
            bytes,
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
    /// How large one request may be now.
    pub(super) fn cut(&self) -> Cut {
        self.inner.cut.get()
    }

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
        let (mut batches, cut) = (Vec::new(), self.cut());
        for (node, ix) in routing::group_by_owner(&r.view, keys, which, k) {
            for i in ix {
                add_key(&mut batches, (node.0, r.stamp, ()), i, cut);
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
        let (mut batches, cut) = (Vec::new(), self.cut());
        for i in which {
            if let Some(p) = self.prev_owner(r, keys[i]) {
                add_key(&mut batches, (p, 0, ()), i, cut);
            }
        }
        batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    proptest! {
        /// Against a model of the cut: each key lands in one batch of its node, in the order
        /// given; no batch passes the limits but a lone item larger than `bytes`; and a node's
        /// batches fill in turn (each but its last is full by one limit or the other).
        #[test]
        fn batches_are_cut_to_the_limits(
            items in vec((0u32..3, 0u64..100), 0..200),
            keys in 1usize..10,
            bytes in 1u64..300,
        ) {
            let cut = Cut { keys, bytes };
            let mut batches: Vec<Batch> = Vec::new();
            for (i, &(node, b)) in items.iter().enumerate() {
                add_item(&mut batches, (node, 1, ()), (i, b), cut);
            }
            for node in 0..3 {
                let want: Vec<usize> = (0..items.len()).filter(|&i| items[i].0 == node).collect();
                let mine: Vec<&Batch> = batches.iter().filter(|b| b.node == node).collect();
                let got: Vec<usize> = mine.iter().flat_map(|b| b.idx.iter().copied()).collect();
                prop_assert_eq!(got, want);
                for (k, b) in mine.iter().enumerate() {
                    let sum: u64 = b.idx.iter().map(|&i| items[i].1).sum();
                    prop_assert_eq!(sum, b.bytes);
                    prop_assert!(!b.idx.is_empty() && b.idx.len() <= keys);
                    prop_assert!(sum <= bytes || b.idx.len() == 1);
                    if let Some(next) = mine.get(k + 1) {
                        let first = items[next.idx[0]].1;
                        prop_assert!(b.idx.len() == keys || sum + first > bytes);
                    }
                }
            }
        }
    }
}
