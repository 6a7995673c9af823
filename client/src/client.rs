//! The async client: routes every request straight to the node that owns its keys under the
//! cluster view (weighted rendezvous hashing, see `kvpool::placement`), one connection pool per
//! node, batches split per owner and sent in parallel.
//!
//! Every routed request carries the stamp of the view it was routed by; a node holding another
//! view refuses it (`WrongView`), the client fetches the newest view and routes again, so no
//! request is served by the wrong owner. Keys on a node that can't be reached are misses. For a
//! while after the view changes (`ClientConfig::fallback_window`), a key that misses on its new
//! owner is looked up once more on its previous owner, so adding a node does not dump the hit
//! rate; that copy is used only when the key's current owners vouch that they acknowledged no
//! write or remove of it that the copy could be older than (`Op::Vouch`).
//!
//! The public API lives here; its parts are `client::routing` (the view, owners, links, node
//! failures, the `WrongView` retry), `client::fanout` (the one fan-out: keys cut into per-node
//! batches sent at once), `client::batch_ops` (the operations over many keys built on it) and
//! `client::scan` (listing keys by prefix across the nodes), `client::prefix` (the KV blocks of
//! a prompt's prefix), `client::one_sided` (two-phase puts, access by global address) and
//! `client::kv_events` (KV events for routers).
//! Uses `link` for everything that goes to one node, and `local`, `config`, `endpoint` and
//! `error`; nothing in the crate uses `client` but `lib`, `blocking` and `weights`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvpool::placement::{ClusterView, NodeState};
use kvpool::pool::PoolStats;
use kvpool::protocol::{
    DiskTierStats, ErrorCode, HelloInfo, NodeTraffic, Op, Priority, Reply, DISK_STATS_VERSION,
    TRAFFIC_VERSION,
};
use kvpool::route::{Heard, ReadPlan, Step};

use crate::config::ClientConfig;
use crate::dst::Dst;
use crate::endpoint::Endpoint;
use crate::error::ClientError;
use crate::link::{unexpected, Link};

#[macro_use]
mod routing;
mod batch_ops;
mod fanout;
mod handoff;
mod hold;
mod kv_events;
mod one_sided;
mod prefix;
mod scan;

use fanout::{add_key, pick};
pub use handoff::{KeyEvent, Subscription, WaitOutcome};
pub use hold::LocalHold;
pub use kv_events::{KvEventBatch, KvEvents};
pub use prefix::Prefix;
use routing::{Routing, Scheme};

struct Inner {
    scheme: Scheme,
    first: Arc<Link>,
    links: Mutex<HashMap<u32, Arc<Link>>>,
    /// Nodes that just failed, and until when they are treated as unreachable without trying
    /// (so a dead host costs one connect timeout, not one per request).
    backoff: Mutex<HashMap<u32, Instant>>,
    routing: RwLock<Arc<Routing>>,
    /// Times a node could not be reached and its keys were counted as misses.
    unreachable: std::sync::atomic::AtomicU64,
    /// When the view was last refreshed because a node could not be asked
    /// ([`Client::refresh_soon`]), and whether such a refresh is running.
    refreshed: Mutex<(Option<Instant>, bool)>,
    /// The view routed by has no node serving: every request fails without asking a node,
    /// so none would tell the client of a newer view; it is refreshed instead.
    ownerless: std::sync::atomic::AtomicBool,
    /// Handoff waits, subscriptions and watching connections.
    handoff: Arc<handoff::Hub>,
    /// The smallest `max_batch` and `max_payload` of the nodes met so far: requests are cut to
    /// fit them ([`fanout::Cut`]).
    cut: fanout::CutLimits,
}

/// A client of a kvpool cluster, bound to one namespace. Cheap to clone; clones share
/// connections and the view.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    ns: Arc<str>,
    /// (replicas, pinned replicas) of the namespace.
    repl: (usize, usize),
    /// This handle's settings: the connection's, with its own priority and deadline
    /// ([`Client::with_priority`], [`Client::with_deadline`]).
    cfg: Arc<ClientConfig>,
}

impl Client {
    /// Connects to the node at `endpoint` (`tcp://`, `tls://`, `quic://` or `unix://`) and
    /// learns the cluster view from it; other nodes are reached (with the same scheme, TCP for a
    /// Unix socket, QUIC for TLS) when a request needs them.
    pub async fn connect(endpoint: &str, cfg: ClientConfig) -> Result<Client, ClientError> {
        let endpoint = Endpoint::parse(endpoint)?;
        let scheme = match endpoint {
            Endpoint::Quic(_) => Scheme::Quic,
            Endpoint::Tls(_) => Scheme::Tls,
            Endpoint::Fabric(_) => Scheme::Fabric,
            _ => Scheme::Tcp,
        };
        let link = tokio::time::timeout(cfg.timeout, Link::open(endpoint, &cfg))
            .await
            .map_err(|_| ClientError::Timeout)??;
        link.ns(&cfg.namespace)?;
        let repl = replication(&link, &cfg.namespace);
        let view = link.hello.view.clone();
        let link = Arc::new(link);
        let ns: Arc<str> = cfg.namespace.as_str().into();
        let links = HashMap::from([(link.node(), link.clone())]);
        let cut = fanout::CutLimits::new(&link.hello);
        Ok(Client {
            inner: Arc::new(Inner {
                scheme,
                first: link,
                links: Mutex::new(links),
                backoff: Mutex::new(HashMap::new()),
                routing: RwLock::new(Arc::new(Routing {
                    stamp: view.stamp(),
                    view: view.clone(),
                    prev: None,
                })),
                unreachable: Default::default(),
                refreshed: Mutex::new((None, false)),
                ownerless: routing::ownerless(&view).into(),
                handoff: Arc::default(),
                cut,
            }),
            ns,
            repl,
            cfg: Arc::new(cfg),
        })
    }

    /// The same client, working in namespace `name`.
    pub fn namespace(&self, name: &str) -> Result<Client, ClientError> {
        self.inner.first.ns(name)?;
        Ok(Client {
            inner: self.inner.clone(),
            ns: name.into(),
            repl: replication(&self.inner.first, name),
            cfg: self.cfg.clone(),
        })
    }

    /// The same client (connections shared), whose bulk transfers have priority `p` on the
    /// nodes (see [`ClientConfig::priority`]).
    pub fn with_priority(&self, p: Priority) -> Client {
        self.with_cfg(|c| c.priority = p)
    }

    /// The same client (connections shared), whose calls carry deadline `d` (`None`: none):
    /// a node refuses a bulk transfer it estimates it can't finish in time at once
    /// ([`ClientError::is_deadline_refused`]), and a call still running at the deadline
    /// fails with `Timeout` (see [`ClientConfig::deadline`]).
    pub fn with_deadline(&self, d: Option<Duration>) -> Client {
        self.with_cfg(|c| c.deadline = d)
    }

    fn with_cfg(&self, f: impl FnOnce(&mut ClientConfig)) -> Client {
        let mut cfg = (*self.cfg).clone();
        f(&mut cfg);
        Client {
            cfg: Arc::new(cfg),
            ..self.clone()
        }
    }

    /// How many times, since the client (or the one it was cloned or derived from) was created,
    /// a node could not be reached and the keys a request had on it were answered as misses
    /// (lookups, gets and prefix matches do that rather than fail). A caller that must tell an
    /// unreachable node from a miss, such as a circuit breaker, compares it before and after.
    pub fn unreachable_events(&self) -> u64 {
        self.inner
            .unreachable
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True when the same-host fast path is in use for the node the client connected to.
    pub fn is_local(&self) -> bool {
        self.inner.first.local().is_some()
    }

    /// The endpoint used for the node the client connected to (the Unix socket on the
    /// same-host path).
    pub fn endpoint(&self) -> String {
        self.inner.first.endpoint.to_string()
    }

    /// What the node the client connected to said at the first handshake (a restarted daemon
    /// has another incarnation; the client follows it on its own).
    pub fn hello(&self) -> &HelloInfo {
        &self.inner.first.hello
    }

    /// The view requests are currently routed by (refreshed whenever a node reports a newer
    /// one).
    pub fn routing_view(&self) -> ClusterView {
        self.routing().view.clone()
    }

    // ----- whole values -----

    /// Stores `value` under `key` (on every replica the namespace asks for).
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        code_result(
            self.put_many(&[(key, value)], None, false, Vec::new())
                .await?[0],
        )
    }

    /// Stores `value` under `key`, pinned: it is never evicted (model weights), and it is
    /// kept on `pinned_replicas` nodes.
    pub async fn put_pinned(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        code_result(
            self.put_many(&[(key, value)], None, true, Vec::new())
                .await?[0],
        )
    }

    /// Stores many values pinned (see [`Client::put_pinned`]), one round trip per owner, in
    /// parallel; one code per item as [`Client::batch_put_from`] returns them.
    pub async fn batch_put_pinned(
        &self,
        items: &[(&[u8], &[u8])],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        self.put_many(items, None, true, Vec::new()).await
    }

    /// [`Client::batch_put_pinned`] for values whose xxh3-64 ([`kvpool::checksum()`]) the
    /// caller already computed, `sums[i]` for `items[i]`: the values are not hashed again on
    /// their way out. The node still checks every value against its sum when it commits it;
    /// an item whose sum is wrong is refused with [`ErrorCode::ChecksumMismatch`] and not
    /// stored.
    ///
    /// # Panics
    ///
    /// When `sums` and `items` differ in length.
    pub async fn batch_put_pinned_with_checksums(
        &self,
        items: &[(&[u8], &[u8])],
        sums: &[u64],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        assert_eq!(items.len(), sums.len(), "one checksum per item");
        self.put_many(items, Some(sums), true, Vec::new()).await
    }

    /// Nodes that hold each pinned object of the namespace (its `pinned_replicas`).
    pub fn pinned_replicas(&self) -> usize {
        self.repl.1.max(1)
    }

    /// The value of `key`, or None on a miss (including a key whose node can't be reached).
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        let cfg = &self.cfg;
        let ns = &*self.ns;
        routed!(self, r => {
            // The core's plan for one key's read: the owner, the next replica while one can't
            // be reached, the previous owner (while the view changes) after a miss.
            let mut plan = ReadPlan::one(&r, key, self.read_replicas(), self.fallback(&r));
            let mut step = plan.first();
            loop {
                let heard = match step {
                    Step::Ask { node, stamp } => {
                        let found = match self.link(node.0, &r).await {
                            Ok(l) => l.get(cfg, stamp, l.ns(ns)?, key).await,
                            Err(e) => Err(e),
                        };
                        match found {
                            Ok(Some(v)) => return Ok(Some(v)),
                            Ok(None) => Heard::Miss,
                            Err(e) if e.is_unreachable() => {
                                self.lost(node.0, &e);
                                Heard::Unreachable
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    Step::AskPrevious { node, .. } => {
                        let old = async {
                            let l = self.link(node.0, &r).await?;
                            l.get(cfg, 0, l.ns(ns)?, key).await
                        };
                        let (one, asked) = ([key], [(0, node.0)]);
                        let (vouched, old) = tokio::join!(self.vouched(&r, &one, &asked), old);
                        if let (true, Ok(Some(v))) = (vouched[0], old) {
                            return Ok(Some(v));
                        }
                        Heard::Miss
                    }
                    Step::Hit | Step::Miss => return Ok(None),
                };
                step = plan.next(heard);
            }
        }, wrong_view_miss => None)
    }

    /// Copies the value of `key` into `dst`; returns its length, or None on a miss.
    pub async fn get_into(&self, key: &[u8], dst: &mut [u8]) -> Result<Option<usize>, ClientError> {
        let mut bufs = [dst];
        Ok(self
            .batch_get_into(&[key], &mut bufs)
            .await?
            .pop()
            .flatten())
    }

    /// True when `key` is present.
    pub async fn exists(&self, key: &[u8]) -> Result<bool, ClientError> {
        Ok(self.batch_exists(&[key]).await? == 1)
    }

    /// Per key of `keys`, whether it is present: one round trip per node that owns any of
    /// them, in parallel. While the view is changing a miss is looked up once more on its
    /// previous owner (a second round trip), as [`Client::get`] does, and counts as present
    /// only when its owner vouches for that copy.
    pub async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>, ClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        routed!(self, r => { self.presence(&r, keys).await })
    }

    /// Length of the leading run of `keys` that are present: one round trip per node that
    /// owns any of them, in parallel (two while the view is changing, to consult previous
    /// owners).
    pub async fn batch_exists(&self, keys: &[&[u8]]) -> Result<usize, ClientError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let cfg = &self.cfg;
        routed!(self, r => {
            if self.fallback(&r).is_some() {
                // Per-key presence, so misses can be looked up on their previous owners.
                let present = self.presence(&r, keys).await?;
                return Ok(present.iter().take_while(|p| **p).count());
            }
            let mut batches = self.by_owner(&r, keys, 0..keys.len(), 0);
            let answers = self
                .fan_out(&r, &mut batches, |l, ns, b| {
                    let sub = pick(keys, &b.idx);
                    async move { l.exists(cfg, b.stamp, ns, &sub).await }
                })
                .await;
            let mut run = keys.len();
            for (b, res) in batches.iter().zip(answers) {
                let n = self.reached(b.node, res)?.unwrap_or(0);
                if n < b.idx.len() {
                    run = run.min(b.idx[n]);
                }
            }
            Ok(run)
        }, wrong_view_miss => 0)
    }

    /// Removes many keys from every node that may hold them (pinned replicas included); returns
    /// how many the keys' owners held. One round trip per node.
    pub async fn batch_remove(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        let r = self.read_replicas();
        self.keys_op(keys, r, |ns, keys| Op::Remove { ns, keys })
            .await
    }

    /// Removes `key` from every node that may hold it; true when one did.
    pub async fn remove(&self, key: &[u8]) -> Result<bool, ClientError> {
        let cfg = &self.cfg;
        routed!(self, r => {
            // The owners, routed by the view; the previous owner asked on purpose (stamp 0).
            let (mut batches, cut) = (Vec::new(), self.cut());
            for o in r.view.owners(key, self.read_replicas()) {
                add_key(&mut batches, (o.0, r.stamp, ()), 0, cut);
            }
            if let Some(p) = self.prev_owner(&r, key) {
                add_key(&mut batches, (p, 0, ()), 0, cut);
            }
            let answers = self
                .fan_out(&r, &mut batches, |l, ns, b| async move {
                    let keys = vec![key.to_vec()];
                    l.count(cfg, b.stamp, Op::Remove { ns, keys }).await
                })
                .await;
            let mut any = false;
            for (b, res) in batches.iter().zip(answers) {
                any |= self.reached(b.node, res)?.is_some_and(|k| k > 0);
            }
            Ok(any)
        })
    }

    /// Stores many values, one round trip per owner, in parallel. Returns one code per item
    /// ([`ErrorCode::Ok`] when stored; [`ErrorCode::Unavailable`] when no owner could be
    /// reached). On the same host the bytes are copied straight into the node's memory.
    pub async fn batch_put_from(
        &self,
        items: &[(&[u8], &[u8])],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        self.put_many(items, None, false, Vec::new()).await
    }

    /// Fetches many values into caller buffers (`dsts[i]` for `keys[i]`), one round trip per
    /// owner, in parallel. Returns each value's length, or None for a miss. On the same host
    /// the bytes are copied straight from the node's memory into the buffers.
    pub async fn batch_get_into(
        &self,
        keys: &[&[u8]],
        dsts: &mut [&mut [u8]],
    ) -> Result<Vec<Option<usize>>, ClientError> {
        let mut dsts: Vec<Dst<'_, '_>> = dsts.iter_mut().map(std::slice::from_mut).collect();
        self.get_many(keys, &mut dsts, false, 0).await
    }

    /// [`Client::batch_get_into`] with each value scattered over several buffers: `dsts[i]`
    /// are `keys[i]`'s, filled in order (a KV block that holds every layer, into an engine's
    /// per-layer pages). Returns each value's length, or None for a miss; a value longer than
    /// its buffers together is [`ClientError::BufferTooSmall`], a shorter one fills the first
    /// bytes. On the same host each value is copied from the node's memory straight into its
    /// buffers and checked in the same pass; over a socket it is received straight into them
    /// and hashed as it arrives. No staging copy either way.
    pub async fn batch_get_scatter(
        &self,
        keys: &[&[u8]],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Result<Vec<Option<usize>>, ClientError> {
        let mut dsts: Vec<Dst<'_, '_>> = dsts.iter_mut().map(|d| &mut d[..]).collect();
        self.get_many(keys, &mut dsts, false, 0).await
    }

    /// Ends leases; returns how many of the objects exist.
    pub async fn release(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        self.keys_op(keys, 1, |ns, keys| Op::Release { ns, keys })
            .await
    }

    /// Pins objects (on every node that holds a copy); returns how many exist.
    pub async fn pin(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        let r = self.read_replicas();
        self.keys_op(keys, r, |ns, keys| Op::Pin {
            ns,
            keys,
            pinned: true,
        })
        .await
    }

    /// Unpins objects; returns how many exist.
    pub async fn unpin(&self, keys: &[&[u8]]) -> Result<u64, ClientError> {
        let r = self.read_replicas();
        self.keys_op(keys, r, |ns, keys| Op::Pin {
            ns,
            keys,
            pinned: false,
        })
        .await
    }

    /// Statistics of the node the client connected to.
    pub async fn stats(&self) -> Result<PoolStats, ClientError> {
        self.node_stats(self.inner.first.node()).await
    }

    /// Removes every object of this client's namespace on every node of the view, pinned ones
    /// too (Mooncake's `remove_all`); returns how many were removed. One request per node, in
    /// parallel. A node that can't be reached fails the call with `Unavailable`, since what it
    /// holds was not removed; objects written meanwhile may or may not be.
    pub async fn remove_all(&self) -> Result<u64, ClientError> {
        let cfg = &self.cfg;
        let r = self.routing();
        let (mut batches, cut) = (Vec::new(), self.cut());
        for n in r.view.nodes.iter().filter(|n| n.state != NodeState::Down) {
            add_key(&mut batches, (n.id, 0, ()), 0, cut);
        }
        let answers = self
            .fan_out(&r, &mut batches, |l, ns, _| async move {
                l.count(cfg, 0, Op::Clear { ns }).await
            })
            .await;
        let mut removed = 0;
        for (b, res) in batches.iter().zip(answers) {
            match self.reached(b.node, res)? {
                Some(n) => removed += n,
                None => {
                    return Err(ClientError::Server {
                        code: ErrorCode::Unavailable,
                        message: format!("node {} could not be reached to clear it", b.node),
                    })
                }
            }
        }
        Ok(removed)
    }

    /// Statistics of node `node`.
    pub async fn node_stats(&self, node: u32) -> Result<PoolStats, ClientError> {
        let r = self.routing();
        let l = self.link(node, &r).await?;
        match l.simple(&self.cfg, 0, Op::Stats, &[]).await? {
            Reply::Stats(s) => Ok(s),
            r => Err(unexpected(&r)),
        }
    }

    /// The disk tier's statistics of the node the client connected to: None when it has no
    /// disk tier (or is of a version before [`DISK_STATS_VERSION`]).
    pub async fn disk_stats(&self) -> Result<Option<DiskTierStats>, ClientError> {
        self.node_disk_stats(self.inner.first.node()).await
    }

    /// The disk tier's statistics of node `node` (see [`Client::disk_stats`]).
    pub async fn node_disk_stats(&self, node: u32) -> Result<Option<DiskTierStats>, ClientError> {
        let r = self.routing();
        let l = self.link(node, &r).await?;
        if l.hello.version < DISK_STATS_VERSION {
            return Ok(None);
        }
        match l.simple(&self.cfg, 0, Op::DiskStats, &[]).await? {
            Reply::DiskStats(s) => Ok(s.map(|s| *s)),
            r => Err(unexpected(&r)),
        }
    }

    /// The traffic node `node` has served since start (operations, payload bytes, refusals by
    /// limit): None when it is of a version before [`TRAFFIC_VERSION`].
    pub async fn node_traffic(&self, node: u32) -> Result<Option<NodeTraffic>, ClientError> {
        let r = self.routing();
        let l = self.link(node, &r).await?;
        if l.hello.version < TRAFFIC_VERSION {
            return Ok(None);
        }
        match l.simple(&self.cfg, 0, Op::Traffic, &[]).await? {
            Reply::Traffic(t) => Ok(Some(t)),
            r => Err(unexpected(&r)),
        }
    }

    /// The cluster view, fetched now from the node the client connected to (and adopted for
    /// routing when it is newer).
    pub async fn view(&self) -> Result<ClusterView, ClientError> {
        let v = self.fetch_view(&self.inner.first).await?;
        self.adopt(v.clone());
        Ok(v)
    }

    /// Asks node `node` to drain: it takes no new objects, moves its pinned objects to their
    /// other owners, then leaves the cluster and exits. Needs
    /// [`ClientConfig::cluster_secret`]; without it the node answers `Unauthorized`.
    pub async fn drain_node(&self, node: u32) -> Result<(), ClientError> {
        let r = self.routing();
        let l = self.link(node, &r).await?;
        match l.simple(&self.cfg, 0, Op::Drain, &[]).await? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }
}

fn replication(link: &Link, ns: &str) -> (usize, usize) {
    let id = link.ns(ns).ok();
    link.hello
        .replication
        .iter()
        .find(|r| Some(r.ns) == id)
        .map_or((1, 2), |r| {
            (r.replicas as usize, r.pinned_replicas as usize)
        })
}

pub(super) fn code_result(code: ErrorCode) -> Result<(), ClientError> {
    match code {
        ErrorCode::Ok => Ok(()),
        // The only way a write or commit fails so: a `cancel` of its key came first.
        ErrorCode::Failed => Err(ClientError::Server {
            code: ErrorCode::Failed,
            message: "its key was cancelled (a `cancel` of the request) before the commit".into(),
        }),
        ErrorCode::BadKey => Err(ClientError::Server {
            code,
            message: format!(
                "the key is empty or longer than the node takes (its limits.max_key_len, at \
                 most {} bytes)",
                kvpool::MAX_KEY_LEN
            ),
        }),
        code => Err(ClientError::Server {
            code,
            message: format!("{code:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool::GlobalAddr;

    /// The public futures are `Send`, so they can be spawned on a multi-threaded runtime
    /// (`tokio::spawn`, the Python bindings): a fan-out that held something `!Send` across an
    /// `.await` would fail to compile here. The closure is type-checked, never run.
    #[test]
    fn public_futures_are_send() {
        fn send<T: Send>(_: T) {}
        let _check = |c: &Client, dst: &mut [u8], bufs: &mut [&mut [u8]], a: &GlobalAddr| {
            let keys: &[&[u8]] = &[b"k"];
            send(c.put(b"k", b"v"));
            send(c.get(b"k"));
            send(c.exists(b"k"));
            send(c.batch_exists(keys));
            send(c.remove(b"k"));
            send(c.batch_put_from(&[(b"k", b"v")]));
            send(c.match_prefix(Prefix::Keys(keys)));
            send(c.save_prefix(Prefix::Keys(keys), keys));
            send(c.alloc(b"k", 1));
            send(c.write(a, 0, b"v"));
            send(c.commit(a, 0));
            send(c.abort(a));
            send(c.lease(keys, 0));
            send(c.release(keys));
            send(c.pin(keys));
            send(c.unpin(keys));
            send(c.stats());
            send(c.keys_with_prefix(b"k"));
            send(c.view());
            send(c.drain_node(0));
            send(c.read(a, 0, dst));
            send(c.batch_get_into(keys, bufs));
        };
    }
}
