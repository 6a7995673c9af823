//! KV events for cache-aware routers (docs/PROTOCOL.md, `KvEvents`): the keys of the client's
//! namespace stored in and removed from each tier of each node, as the nodes publish them.
//! Part of `client`; uses `link` and `conn`.
//!
//! One connection of its own per node serving when the call is made; a reader task per node
//! forwards its batches into one bounded channel. A reader that falls behind stops reading its
//! socket, so the node's queue for it fills and the node drops events and says so (the batch's
//! `dropped`): the client's memory stays bounded as the node's does.

use std::time::Duration;

use kvpool::placement::NodeState;
use kvpool::protocol::{KvEvent, Op, Reply, EVENT_ID};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::Client;
use crate::conn::{judged, ConnReader, ConnWriter};
use crate::error::ClientError;
use crate::link::unexpected;

/// Batches waiting to be taken before the nodes' connections are left unread.
const BATCHES: usize = 64;

/// One node's batch of KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventBatch {
    /// The node that published them.
    pub node: u32,
    /// The node's sequence number (for this subscription) of the first event: it counts the
    /// events dropped too, so a gap shows a loss.
    pub seq: u64,
    /// Events the node dropped since its previous batch because this subscription fell behind
    /// (0: none). Nonzero is the lag marker: list the keys again to resynchronise.
    pub dropped: u64,
    /// The events, in the order the node published them.
    pub events: Vec<KvEvent>,
}

/// A subscription to KV events (see [`Client::kv_events`]); dropping it ends it.
pub struct KvEvents {
    rx: mpsc::Receiver<Result<KvEventBatch, ClientError>>,
    readers: Vec<JoinHandle<()>>,
}

impl KvEvents {
    /// The next batch of any node. None once every node's connection has ended; an error when
    /// one broke (the others go on).
    pub async fn next(&mut self) -> Option<Result<KvEventBatch, ClientError>> {
        self.rx.recv().await
    }

    /// [`KvEvents::next`], waiting at most `timeout`: None when nothing came in time (or every
    /// connection has ended).
    pub async fn next_within(
        &mut self,
        timeout: Duration,
    ) -> Option<Result<KvEventBatch, ClientError>> {
        tokio::time::timeout(timeout, self.next())
            .await
            .ok()
            .flatten()
    }
}

impl Drop for KvEvents {
    fn drop(&mut self) {
        for r in &self.readers {
            r.abort();
        }
    }
}

impl Client {
    /// Subscribes to the KV events of every key of the client's namespace that starts with
    /// `prefix` (at most 256 bytes; empty: every key), on every node serving now: each key
    /// stored in or removed from a node's memory or disk tier, and each clear of the
    /// namespace. Batches come as the nodes publish them; see [`KvEventBatch::dropped`] for a
    /// subscription that falls behind.
    pub async fn kv_events(&self, prefix: &[u8]) -> Result<KvEvents, ClientError> {
        let r = self.routing();
        let serving: Vec<u32> = r
            .view
            .nodes
            .iter()
            .filter(|n| n.state == NodeState::Serving)
            .map(|n| n.id)
            .collect();
        let (tx, rx) = mpsc::channel(BATCHES);
        let mut sub = KvEvents {
            rx,
            readers: Vec::new(),
        };
        for node in serving {
            let link = self.link(node, &r).await?;
            let ns = link.ns(&self.ns)?;
            let (mut rd, mut w) = link.dedicated(&self.cfg).await?.split();
            let op = Op::KvEvents {
                ns,
                prefix: prefix.to_vec(),
            };
            let id = w.send(op).await?;
            // A node that never answers (one too old to know the request) is a timeout.
            tokio::time::timeout(self.cfg.timeout, subscribed(&mut rd, id))
                .await
                .map_err(|_| ClientError::Timeout)??;
            sub.readers
                .push(tokio::spawn(forward(node, rd, w, tx.clone())));
        }
        Ok(sub)
    }
}

/// Reads up to the reply to request `id` (the `KvEvents`): Ok when the node subscribed.
async fn subscribed(rd: &mut ConnReader, id: u64) -> Result<(), ClientError> {
    loop {
        let (got, reply) = rd.next().await?;
        if got == id {
            return match judged(reply)? {
                Reply::Done => Ok(()),
                other => Err(unexpected(&other)),
            };
        }
    }
}

/// A node's reader: its batches into `tx` (waiting for room), until the connection ends or
/// the subscription is dropped. `_w` keeps the connection's writing half open.
async fn forward(
    node: u32,
    mut rd: ConnReader,
    _w: ConnWriter,
    tx: mpsc::Sender<Result<KvEventBatch, ClientError>>,
) {
    loop {
        let batch = match rd.next().await {
            Ok((EVENT_ID, Reply::KvEvents(b))) => Ok(KvEventBatch {
                node,
                seq: b.seq,
                dropped: b.dropped,
                events: b.events,
            }),
            Ok(_) => continue,
            Err(e) => Err(e),
        };
        let end = batch.is_err();
        if tx.send(batch).await.is_err() || end {
            return;
        }
    }
}
