//! KV events for cache-aware routers (docs/PROTOCOL.md, `KvEvents`): every key stored in or
//! removed from a tier of this node, published per namespace to the connections that
//! subscribed to it.
//!
//! Publishers are the pool (through [`Observers`], its [`CommitObserver`]: commits, removals,
//! evictions, under the key's index shard lock), the disk tier (a demotion indexed, a copy
//! forgotten, a region dropped) and `Clear`. With no subscriber in a namespace a publication
//! costs one atomic load. With subscribers, each event is copied into each matching
//! subscriber's queue: a byte buffer allocated when it subscribed, so publishing allocates
//! nothing and never waits for a reader. Locks: a shard's (or the disk index's) is held by the
//! publisher, then the subscription table is read-locked, then one subscriber's queue is
//! locked; neither of the last two is held while taking another lock, and nothing here calls
//! into the pool.
//!
//! **Bounded.** A subscriber's queue holds at most [`QUEUE_BYTES`] of events; what does not
//! fit is dropped and counted, and its next batch carries the count (the lag marker: the
//! reader resynchronises). Sequence numbers count every event published to a subscriber,
//! dropped ones too, so a gap is visible. Subscriptions are charged to their connection and
//! namespace in the ledger (`max_event_subscriptions_per_*`) by the handler and released when
//! the connection closes; each connection has one queue, whatever it subscribed to.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kvpool::protocol::{KvEvent, KvEventBatch, KvEventKind, KvTier};
use kvpool::CommitObserver;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;

use crate::watch::Watches;

/// Bytes of events one subscriber's queue holds before it drops (each event takes its key plus
/// [`EVENT_OVERHEAD`]). The connection holds a second buffer of the same size, which it writes
/// from while publishers fill the first.
pub(crate) const QUEUE_BYTES: usize = 128 << 10;

/// How long a subscribed connection lets events gather once its queue stops being empty,
/// before it writes them: at a high event rate a frame (and a write) per event would cost the
/// node more than the events themselves; a router hears of a store within this much more.
pub(crate) const LINGER: std::time::Duration = std::time::Duration::from_millis(1);

/// Bytes an event takes in a queue besides its key: namespace (4), kind (1), tier (1), key
/// length (2).
const EVENT_OVERHEAD: usize = 8;

/// The node's KV event publication: who subscribed to what, and the counters of the metrics.
pub(crate) struct EventHub {
    /// Per namespace id, its subscriptions: the one load a publication makes when it has none.
    active: Box<[AtomicUsize]>,
    /// Per namespace id, each subscription: its subscriber and key prefix.
    subs: RwLock<Vec<Vec<Prefixed>>>,
    series: EventSeries,
}

/// One subscription: its subscriber and key prefix.
type Prefixed = (Arc<Subscriber>, Box<[u8]>);

/// The metrics of KV events (`kvpool_kv_events_*`).
#[derive(Clone, Debug, Default)]
pub(crate) struct EventSeries {
    /// Events queued for subscribers (one per subscriber that gets it).
    pub(crate) published: Counter,
    /// Events a subscriber lost because its queue was full.
    pub(crate) dropped: Counter,
    /// Connections subscribed.
    pub(crate) subscribers: Gauge,
}

/// One subscribed connection's queue.
pub(crate) struct Subscriber {
    queue: Mutex<Queue>,
    /// Signalled when the queue goes from empty to not.
    ready: Notify,
}

/// Events waiting for one connection.
struct Queue {
    /// The events, encoded as [`push`](Queue::push) writes them; never past [`QUEUE_BYTES`].
    buf: Vec<u8>,
    /// Events in `buf`.
    events: u64,
    /// Events dropped since the last batch was taken.
    dropped: u64,
    /// The sequence number of the next event published to this subscriber.
    next_seq: u64,
}

impl Queue {
    /// Appends one event if it fits (no allocation: `buf` has its capacity from the start).
    fn push(&mut self, ns: u32, kind: KvEventKind, tier: KvTier, key: &[u8]) -> bool {
        self.next_seq += 1;
        if self.buf.len() + EVENT_OVERHEAD + key.len() > QUEUE_BYTES {
            self.dropped += 1;
            return false;
        }
        self.buf.extend_from_slice(&ns.to_le_bytes());
        self.buf.push(kind as u8);
        self.buf.push(tier as u8);
        self.buf
            .extend_from_slice(&(key.len() as u16).to_le_bytes());
        self.buf.extend_from_slice(key);
        self.events += 1;
        true
    }

    fn is_empty(&self) -> bool {
        self.events == 0 && self.dropped == 0
    }
}

impl EventHub {
    /// A hub for namespaces `0..namespaces`, counting into `series`.
    pub(crate) fn new(namespaces: usize, series: EventSeries) -> Arc<EventHub> {
        Arc::new(EventHub {
            active: (0..namespaces).map(|_| AtomicUsize::new(0)).collect(),
            subs: RwLock::new(vec![Vec::new(); namespaces]),
            series,
        })
    }

    /// A connection's subscriber, with its queue allocated and nothing subscribed yet.
    pub(crate) fn subscriber(self: &Arc<Self>) -> Subscription {
        self.series.subscribers.inc();
        Subscription {
            hub: self.clone(),
            sub: Arc::new(Subscriber {
                queue: Mutex::new(Queue {
                    buf: Vec::with_capacity(QUEUE_BYTES),
                    events: 0,
                    dropped: 0,
                    next_seq: 0,
                }),
                ready: Notify::new(),
            }),
            spare: Vec::with_capacity(QUEUE_BYTES),
            namespaces: Vec::new(),
        }
    }

    /// Publishes one event of `key` in namespace `ns` to its subscribers whose prefix it has
    /// (every subscriber of the namespace, for `Cleared`). Never blocks on a reader and
    /// allocates nothing.
    pub(crate) fn publish(&self, ns: u32, kind: KvEventKind, tier: KvTier, key: &[u8]) {
        let Some(active) = self.active.get(ns as usize) else {
            return;
        };
        if active.load(Ordering::Acquire) == 0 {
            return;
        }
        let subs = self.subs.read().unwrap_or_else(|e| e.into_inner());
        for (sub, prefix) in subs.get(ns as usize).into_iter().flatten() {
            if kind != KvEventKind::Cleared && !key.starts_with(prefix) {
                continue;
            }
            let mut q = lock(&sub.queue);
            let was_empty = q.is_empty();
            let queued = q.push(ns, kind, tier, key);
            drop(q);
            if queued {
                self.series.published.inc();
            } else {
                self.series.dropped.inc();
            }
            if was_empty {
                sub.ready.notify_one();
            }
        }
    }

    /// Every key of namespace `ns` left every tier (`Clear`): one event, whatever the prefix.
    pub(crate) fn cleared(&self, ns: u32) {
        self.publish(ns, KvEventKind::Cleared, KvTier::Dram, b"");
    }

    /// Subscribes `sub` to the keys of `ns` starting with `prefix`; whether it is new (a
    /// subscription made twice is one).
    fn subscribe(&self, sub: &Arc<Subscriber>, ns: u32, prefix: &[u8]) -> bool {
        let mut subs = self.subs.write().unwrap_or_else(|e| e.into_inner());
        let Some(list) = subs.get_mut(ns as usize) else {
            return false;
        };
        if list
            .iter()
            .any(|(s, p)| Arc::ptr_eq(s, sub) && &**p == prefix)
        {
            return false;
        }
        list.push((sub.clone(), prefix.into()));
        self.active[ns as usize].fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Ends every subscription of `sub` in `namespaces`.
    fn forget(&self, sub: &Arc<Subscriber>, namespaces: &[u32]) {
        let mut subs = self.subs.write().unwrap_or_else(|e| e.into_inner());
        for &ns in namespaces {
            if let Some(list) = subs.get_mut(ns as usize) {
                let before = list.len();
                list.retain(|(s, _)| !Arc::ptr_eq(s, sub));
                let ended = before - list.len();
                self.active[ns as usize].fetch_sub(ended, Ordering::AcqRel);
            }
        }
    }
}

/// One connection's subscriber: its queue, the buffer it writes from, and what it subscribed
/// to; every subscription ends on drop (the ledger's charges go with the connection's account).
pub(crate) struct Subscription {
    hub: Arc<EventHub>,
    sub: Arc<Subscriber>,
    /// Swapped with the queue's buffer when a batch is taken, so neither grows.
    spare: Vec<u8>,
    /// The namespace of each subscription, for [`EventHub::forget`].
    namespaces: Vec<u32>,
}

impl Subscription {
    /// Subscribes to the keys of `ns` starting with `prefix`; whether it is new.
    pub(crate) fn add(&mut self, ns: u32, prefix: &[u8]) -> bool {
        let new = self.hub.subscribe(&self.sub, ns, prefix);
        if new {
            self.namespaces.push(ns);
        }
        new
    }

    /// Waits until the queue holds events (or a drop to report). Cancel-safe.
    pub(crate) async fn ready(&self) {
        loop {
            let notified = self.sub.ready.notified();
            if !lock(&self.sub.queue).is_empty() {
                return;
            }
            notified.await;
        }
    }

    /// The events queued since the last batch, and the count of those dropped; None when there
    /// are none. The queue is emptied by swapping buffers, and decoded outside its lock.
    pub(crate) fn take(&mut self) -> Option<KvEventBatch> {
        let (events, dropped, seq) = {
            let mut q = lock(&self.sub.queue);
            if q.is_empty() {
                return None;
            }
            std::mem::swap(&mut q.buf, &mut self.spare);
            let taken = (q.events, q.dropped, q.next_seq - q.events - q.dropped);
            q.events = 0;
            q.dropped = 0;
            taken
        };
        let mut out = Vec::with_capacity(events as usize);
        let mut at = &self.spare[..];
        while at.len() >= EVENT_OVERHEAD {
            let ns = u32::from_le_bytes([at[0], at[1], at[2], at[3]]);
            let kind = match at[4] {
                0 => KvEventKind::Stored,
                1 => KvEventKind::Removed,
                _ => KvEventKind::Cleared,
            };
            let tier = if at[5] == 1 {
                KvTier::Disk
            } else {
                KvTier::Dram
            };
            let len = u16::from_le_bytes([at[6], at[7]]) as usize;
            let key = at[EVENT_OVERHEAD..EVENT_OVERHEAD + len].to_vec();
            at = &at[EVENT_OVERHEAD + len..];
            out.push(KvEvent {
                ns,
                kind,
                tier,
                key,
            });
        }
        self.spare.clear();
        Some(KvEventBatch {
            seq,
            dropped,
            events: out,
        })
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub.forget(&self.sub, &self.namespaces);
        self.hub.series.subscribers.dec();
    }
}

/// The pool's one [`CommitObserver`]: the handoff watches, then the KV events.
pub(crate) struct Observers {
    pub(crate) watches: Arc<Watches>,
    pub(crate) events: Arc<EventHub>,
}

impl CommitObserver for Observers {
    fn committed(&self, ns: u32, key: &[u8]) {
        self.watches.committed(ns, key);
        self.events
            .publish(ns, KvEventKind::Stored, KvTier::Dram, key);
    }

    fn removed(&self, ns: u32, key: &[u8]) {
        self.events
            .publish(ns, KvEventKind::Removed, KvTier::Dram, key);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding it leaves a queue that is still a queue.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(b: &KvEventBatch) -> Vec<(KvEventKind, KvTier, &[u8])> {
        b.events
            .iter()
            .map(|e| (e.kind, e.tier, &e.key[..]))
            .collect()
    }

    #[test]
    fn subscribers_hear_their_namespace_and_prefix_only() {
        let hub = EventHub::new(2, EventSeries::default());
        let mut a = hub.subscriber();
        assert!(a.add(0, b"p/"));
        assert!(!a.add(0, b"p/"), "the same subscription twice is one");
        hub.publish(0, KvEventKind::Stored, KvTier::Dram, b"p/1");
        hub.publish(0, KvEventKind::Stored, KvTier::Dram, b"q/1");
        hub.publish(1, KvEventKind::Stored, KvTier::Dram, b"p/2");
        hub.publish(0, KvEventKind::Removed, KvTier::Disk, b"p/3");
        hub.cleared(0);
        let b = a.take().unwrap();
        assert_eq!((b.seq, b.dropped), (0, 0));
        assert_eq!(
            keys(&b),
            vec![
                (KvEventKind::Stored, KvTier::Dram, &b"p/1"[..]),
                (KvEventKind::Removed, KvTier::Disk, b"p/3"),
                (KvEventKind::Cleared, KvTier::Dram, b""),
            ]
        );
        assert!(a.take().is_none());
        hub.publish(0, KvEventKind::Stored, KvTier::Dram, b"p/4");
        assert_eq!(a.take().unwrap().seq, 3, "numbered on");
        drop(a);
        assert_eq!(hub.active[0].load(Ordering::Acquire), 0);
        assert_eq!(hub.series.subscribers.get(), 0);
    }

    #[test]
    fn a_full_queue_drops_counts_and_shows_the_gap() {
        let hub = EventHub::new(1, EventSeries::default());
        let mut a = hub.subscriber();
        a.add(0, b"");
        let key = [b'k'; 100];
        let fits = QUEUE_BYTES / (EVENT_OVERHEAD + key.len());
        for _ in 0..fits + 50 {
            hub.publish(0, KvEventKind::Stored, KvTier::Dram, &key);
        }
        let b = a.take().unwrap();
        assert_eq!((b.events.len(), b.dropped), (fits, 50));
        assert_eq!(hub.series.dropped.get(), 50);
        hub.publish(0, KvEventKind::Removed, KvTier::Dram, &key);
        let b = a.take().unwrap();
        assert_eq!(
            (b.seq, b.dropped, b.events.len()),
            ((fits + 50) as u64, 0, 1)
        );
        assert!(a.spare.capacity() <= QUEUE_BYTES, "the buffers never grow");
    }
}
