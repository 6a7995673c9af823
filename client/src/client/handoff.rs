//! Handoffs on the client (docs/HANDOFF.md): a consumer waits for keys a producer writes, with
//! no polling, and a producer that gives up fails them. Part of `client`; uses `link` and
//! `conn`.
//!
//! One watching connection per node, opened on first use and shared by every wait of the
//! client: its reader task hands each event (`Event` frames: a key committed or failed) to the
//! waits for that key, and answers the `Watch`/`Subscribe` requests sent on it. A wait
//! registers itself before asking the keys' owners to watch them, so no event is missed; the
//! `Watch` reply says which keys are there already. When the connection breaks (the node
//! exited or drained) or the node says events were dropped (`Lagged`), every wait watches its
//! keys again, under a fresh view.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvpool::protocol::{ErrorCode, Op, Reply, EVENT_ID};
use tokio::sync::{mpsc, oneshot, Notify};

use super::Client;
use crate::conn::{ConnReader, ConnWriter};
use crate::error::ClientError;
use crate::link::{unexpected, Link};

/// Keys per `Watch` request (under the node's `max_batch`).
const KEYS_PER_WATCH: usize = 4096;

/// Events a subscription keeps before it counts as lagging.
const SUBSCRIPTION_EVENTS: usize = 4096;

/// How long a wait pauses before watching again after a node could not be reached.
const RETRY: Duration = Duration::from_millis(100);

/// Where the keys of a [`Client::wait`] stand when it returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WaitOutcome {
    /// Keys not written by the deadline (in the order asked).
    pub missing: Vec<Vec<u8>>,
    /// Keys whose producer posted a tombstone, with its reason.
    pub failed: Vec<(Vec<u8>, String)>,
}

impl WaitOutcome {
    /// Every key is there.
    pub fn complete(&self) -> bool {
        self.missing.is_empty() && self.failed.is_empty()
    }
}

/// What a [`Subscription`] hears.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyEvent {
    /// The key was committed.
    Written(Vec<u8>),
    /// The key's producer posted a tombstone.
    Failed(Vec<u8>, String),
    /// Events were dropped (this subscription, or a node's connection, fell behind or broke):
    /// look the keys up again.
    Lagged,
}

/// Events for every key under a prefix (see [`Client::subscribe`]); dropping it ends it.
pub struct Subscription {
    rx: mpsc::Receiver<KeyEvent>,
    lagged: Arc<AtomicBool>,
    hub: Arc<Hub>,
    id: u64,
}

impl Subscription {
    /// The next event; None when the client is gone.
    pub async fn recv(&mut self) -> Option<KeyEvent> {
        if self.lagged.swap(false, Ordering::AcqRel) {
            return Some(KeyEvent::Lagged);
        }
        let ev = self.rx.recv().await;
        if self.lagged.swap(false, Ordering::AcqRel) {
            return Some(KeyEvent::Lagged);
        }
        ev
    }
}

impl Subscription {
    /// [`Subscription::recv`], waiting at most `timeout`: None when nothing came in time.
    pub async fn recv_within(&mut self, timeout: Duration) -> Option<KeyEvent> {
        tokio::time::timeout(timeout, self.recv())
            .await
            .ok()
            .flatten()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        lock(&self.hub.subs).retain(|s| s.id != self.id);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A wait is over: every key settled, or the deadline passed.
fn settled(w: &Waiter, deadline: tokio::time::Instant) -> bool {
    lock(&w.state).left.is_empty() || tokio::time::Instant::now() >= deadline
}

/// One wait's state: the keys still missing, those failed, whether to watch again.
struct Waiter {
    ns: Arc<str>,
    state: Mutex<WaitState>,
    wake: Notify,
}

struct WaitState {
    left: HashSet<Vec<u8>>,
    failed: Vec<(Vec<u8>, String)>,
    recheck: bool,
    /// Keys written since the waiter last looked, when it fetches them as they come
    /// ([`Client::wait_get_into`]); `None` for a plain wait.
    arrived: Option<Vec<Vec<u8>>>,
}

impl Waiter {
    fn settle(&self, key: &[u8], code: ErrorCode, reason: &str) {
        let mut st = lock(&self.state);
        if !st.left.remove(key) {
            return;
        }
        if code == ErrorCode::Failed {
            st.failed.push((key.to_vec(), reason.to_owned()));
        } else if let Some(a) = st.arrived.as_mut() {
            a.push(key.to_vec());
        }
        drop(st);
        self.wake.notify_one();
    }

    fn recheck(&self) {
        lock(&self.state).recheck = true;
        self.wake.notify_one();
    }
}

struct Sub {
    id: u64,
    ns: Arc<str>,
    prefix: Vec<u8>,
    tx: mpsc::Sender<KeyEvent>,
    lagged: Arc<AtomicBool>,
}

impl Sub {
    fn send(&self, ev: KeyEvent) {
        if self.tx.try_send(ev).is_err() {
            self.lagged.store(true, Ordering::Release);
        }
    }
}

/// One node's watching connection.
struct NodeWatch {
    writer: tokio::sync::Mutex<ConnWriter>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    alive: AtomicBool,
}

impl NodeWatch {
    /// Sends `op` and waits for its reply (the reader task hands it over).
    async fn call(&self, op: Op) -> Result<Reply, ClientError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut w = self.writer.lock().await;
            if !self.alive.load(Ordering::Acquire) {
                return Err(ClientError::Io(std::io::ErrorKind::BrokenPipe.into()));
            }
            // Registered under the writer's lock, before the request can be answered.
            let id = w.next_id();
            lock(&self.pending).insert(id, tx);
            if let Err(e) = w.send(op).await {
                lock(&self.pending).remove(&id);
                return Err(e);
            }
        }
        match rx.await {
            Ok(reply) => crate::conn::judged(reply),
            Err(_) => Err(ClientError::Io(std::io::ErrorKind::ConnectionReset.into())),
        }
    }
}

/// The waits of each (namespace, key).
type WaitersByKey = HashMap<(Arc<str>, Vec<u8>), Vec<Arc<Waiter>>>;

/// The waits, subscriptions and watching connections of one client (all its namespaces).
#[derive(Default)]
pub(super) struct Hub {
    waiters: Mutex<WaitersByKey>,
    subs: Mutex<Vec<Sub>>,
    next_sub: std::sync::atomic::AtomicU64,
    nodes: tokio::sync::Mutex<HashMap<u32, Arc<NodeWatch>>>,
}

impl Hub {
    fn dispatch(&self, link: &Link, ns: u32, key: Vec<u8>, code: ErrorCode, reason: &str) {
        if code == ErrorCode::Lagged {
            self.everyone_recheck();
            return;
        }
        let Some(name) = link.ns_name(ns) else {
            return;
        };
        let name: Arc<str> = name.into();
        if let Some(ws) = lock(&self.waiters).get(&(name.clone(), key.clone())) {
            for w in ws {
                w.settle(&key, code, reason);
            }
        }
        for s in lock(&self.subs).iter() {
            if *s.ns == *name && key.starts_with(&s.prefix) {
                s.send(match code {
                    ErrorCode::Failed => KeyEvent::Failed(key.clone(), reason.to_owned()),
                    _ => KeyEvent::Written(key.clone()),
                });
            }
        }
    }

    /// Every wait watches its keys again and every subscription hears `Lagged`.
    fn everyone_recheck(&self) {
        for ws in lock(&self.waiters).values() {
            for w in ws {
                w.recheck();
            }
        }
        for s in lock(&self.subs).iter() {
            s.send(KeyEvent::Lagged);
        }
    }

    fn add(&self, w: &Arc<Waiter>, keys: &[&[u8]]) {
        let mut map = lock(&self.waiters);
        for k in keys {
            map.entry((w.ns.clone(), k.to_vec()))
                .or_default()
                .push(w.clone());
        }
    }

    /// Takes `w` out; returns the keys no other wait is waiting for.
    fn remove(&self, w: &Arc<Waiter>, keys: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut map = lock(&self.waiters);
        let mut free = Vec::new();
        for k in keys {
            let entry = (w.ns.clone(), k.to_vec());
            if let Some(ws) = map.get_mut(&entry) {
                ws.retain(|x| !Arc::ptr_eq(x, w));
                if ws.is_empty() {
                    map.remove(&entry);
                    free.push(k.to_vec());
                }
            }
        }
        free
    }
}

/// The reader task of a node's watching connection: replies to their requests, events to the
/// hub; when the stream ends, every pending request fails and every wait watches again.
async fn read_events(mut r: ConnReader, nw: Arc<NodeWatch>, hub: Arc<Hub>, link: Arc<Link>) {
    loop {
        match r.next().await {
            Ok((
                EVENT_ID,
                Reply::Event {
                    ns,
                    key,
                    code,
                    reason,
                },
            )) => hub.dispatch(&link, ns, key, ErrorCode::from_u16(code), &reason),
            Ok((id, reply)) => {
                if let Some(tx) = lock(&nw.pending).remove(&id) {
                    let _ = tx.send(reply);
                }
            }
            Err(_) => break,
        }
    }
    nw.alive.store(false, Ordering::Release);
    lock(&nw.pending).clear();
    hub.everyone_recheck();
}

impl Client {
    /// The watching connection to `node` (opened on first use, again after it broke).
    async fn node_watch(&self, node: u32) -> Result<Arc<NodeWatch>, ClientError> {
        let hub = &self.inner.handoff;
        let mut nodes = hub.nodes.lock().await;
        if let Some(nw) = nodes.get(&node).filter(|n| n.alive.load(Ordering::Acquire)) {
            return Ok(nw.clone());
        }
        let link = self.link(node, &self.routing()).await?;
        let conn = link.dedicated(&self.cfg).await?;
        let (r, w) = conn.split();
        let nw = Arc::new(NodeWatch {
            writer: tokio::sync::Mutex::new(w),
            pending: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
        });
        tokio::spawn(read_events(r, nw.clone(), hub.clone(), link));
        nodes.insert(node, nw.clone());
        Ok(nw)
    }

    /// Waits until every key is written, or failed by its producer ([`Client::fail`]), or
    /// `timeout` passes: no polling, each key's owner sends an event the moment it is
    /// committed. Returns which keys are missing and which failed (with the producer's
    /// reason); `complete()` when all are there. A key written before the call counts as
    /// written. Keys may be on any node; a node lost meanwhile is watched again under the new
    /// view (its keys' new owners).
    pub async fn wait(
        &self,
        keys: &[&[u8]],
        timeout: Duration,
    ) -> Result<WaitOutcome, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let waiter = self.start_wait(keys, false);
        let res = self.wait_for(&waiter, deadline).await;
        self.end_wait(&waiter, keys);
        res?;
        let st = lock(&waiter.state);
        Ok(WaitOutcome {
            missing: keys
                .iter()
                .filter(|k| st.left.contains(**k))
                .map(|k| k.to_vec())
                .collect(),
            failed: st.failed.clone(),
        })
    }

    /// [`Client::wait`] that also reads each key into `dsts[i]` the moment it is written, while
    /// the producer is still writing the others: a handoff's consumer overlaps its reads with
    /// the producer's writes instead of starting them after the last one. Keys written
    /// together are read together (one batched get per arrival). Returns the outcome (a key
    /// written but gone again before it could be read counts as missing) and, per key, the
    /// bytes read. A buffer too small for its value fails the call, as `batch_get_into` does.
    pub async fn wait_get_into(
        &self,
        keys: &[&[u8]],
        dsts: &mut [&mut [u8]],
        timeout: Duration,
    ) -> Result<(WaitOutcome, Vec<Option<usize>>), ClientError> {
        if keys.len() != dsts.len() {
            return Err(ClientError::Protocol(format!(
                "{} keys but {} buffers",
                keys.len(),
                dsts.len()
            )));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let waiter = self.start_wait(keys, true);
        let mut got = vec![None; keys.len()];
        let res = self
            .fetch_as_written(&waiter, (keys, dsts), &mut got, deadline)
            .await;
        self.end_wait(&waiter, keys);
        res?;
        let st = lock(&waiter.state);
        let failed = st.failed.clone();
        let missing = keys
            .iter()
            .zip(&got)
            .filter(|(k, g)| g.is_none() && !failed.iter().any(|(f, _)| f == **k))
            .map(|(k, _)| k.to_vec())
            .collect();
        Ok((WaitOutcome { missing, failed }, got))
    }

    /// The loop of [`Client::wait_get_into`]: reads what arrived, then waits as
    /// [`Client::wait`] does, until every key is read or failed, or the deadline.
    async fn fetch_as_written(
        &self,
        w: &Arc<Waiter>,
        (keys, dsts): (&[&[u8]], &mut [&mut [u8]]),
        got: &mut [Option<usize>],
        deadline: tokio::time::Instant,
    ) -> Result<(), ClientError> {
        let index: HashMap<&[u8], usize> = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        let mut want = vec![false; keys.len()];
        loop {
            let arrived = lock(&w.state).arrived.as_mut().map(std::mem::take);
            let arrived = arrived.unwrap_or_default();
            if !arrived.is_empty() {
                want.iter_mut().for_each(|x| *x = false);
                for k in &arrived {
                    if let Some(&i) = index.get(&k[..]) {
                        want[i] = got[i].is_none();
                    }
                }
                let idx: Vec<usize> = (0..keys.len()).filter(|&i| want[i]).collect();
                let sub: Vec<&[u8]> = idx.iter().map(|&i| keys[i]).collect();
                let mut bufs: Vec<&mut [u8]> = dsts
                    .iter_mut()
                    .zip(&want)
                    .filter(|(_, w)| **w)
                    .map(|(d, _)| &mut **d)
                    .collect();
                let read =
                    tokio::time::timeout_at(deadline, self.batch_get_into(&sub, &mut bufs)).await;
                let Ok(read) = read else { return Ok(()) };
                for (&i, n) in idx.iter().zip(read?) {
                    got[i] = n;
                }
                continue;
            }
            if settled(w, deadline) {
                return Ok(());
            }
            self.wait_step(w, deadline).await?;
        }
    }

    async fn wait_for(
        &self,
        w: &Arc<Waiter>,
        deadline: tokio::time::Instant,
    ) -> Result<(), ClientError> {
        while !settled(w, deadline) {
            self.wait_step(w, deadline).await?;
        }
        Ok(())
    }

    /// Registers a wait for `keys` with this client's hub; `collect`: it also hands over the
    /// keys written as they come ([`Client::wait_get_into`]).
    fn start_wait(&self, keys: &[&[u8]], collect: bool) -> Arc<Waiter> {
        let waiter = Arc::new(Waiter {
            ns: self.ns.clone(),
            state: Mutex::new(WaitState {
                left: keys.iter().map(|k| k.to_vec()).collect(),
                failed: Vec::new(),
                recheck: true,
                arrived: collect.then(Vec::new),
            }),
            wake: Notify::new(),
        });
        self.inner.handoff.add(&waiter, keys);
        waiter
    }

    /// Ends a wait: forgets it, and unwatches the keys no other wait needs.
    fn end_wait(&self, waiter: &Arc<Waiter>, keys: &[&[u8]]) {
        let free = self.inner.handoff.remove(waiter, keys);
        if !free.is_empty() {
            // Best effort, in the background: the watches also end with the connection.
            let c = self.clone();
            tokio::spawn(async move { c.unwatch(&free).await });
        }
    }

    /// One step of a wait: watches the keys still missing (again) when asked to, otherwise
    /// sleeps until an event settles a key (a settle before the sleep is not lost: `Notify`
    /// keeps it) or the deadline passes.
    async fn wait_step(
        &self,
        w: &Arc<Waiter>,
        deadline: tokio::time::Instant,
    ) -> Result<(), ClientError> {
        let rewatch = std::mem::take(&mut lock(&w.state).recheck);
        if !rewatch {
            tokio::select! {
                () = w.wake.notified() => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
            return Ok(());
        }
        let left: Vec<Vec<u8>> = lock(&w.state).left.iter().cloned().collect();
        match tokio::time::timeout_at(deadline, self.watch_keys(w, &left)).await {
            Err(_) | Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if e.is_unreachable() || e.code() == Some(ErrorCode::WrongView) => {
                // A node gone or the view moving: look again shortly, under a fresh view.
                let _ = self.view().await;
                tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + RETRY)).await;
                w.recheck();
                Ok(())
            }
            Ok(Err(e)) => Err(e),
        }
    }

    /// Asks each key's owner to watch it and settles the keys it says are there or failed.
    async fn watch_keys(&self, w: &Arc<Waiter>, keys: &[Vec<u8>]) -> Result<(), ClientError> {
        let r = self.routing();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let mut by_node: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, k) in refs.iter().enumerate() {
            let owner = self.owner_at(&r, k, 0).ok_or(ClientError::Server {
                code: ErrorCode::Unavailable,
                message: "no node serves the key".into(),
            })?;
            by_node.entry(owner.0).or_default().push(i);
        }
        for (node, idx) in by_node {
            let nw = self.node_watch(node).await?;
            let link = self.link(node, &r).await?;
            let ns = link.ns(&self.ns)?;
            for part in idx.chunks(KEYS_PER_WATCH) {
                let sub: Vec<Vec<u8>> = part.iter().map(|&i| keys[i].clone()).collect();
                let n = sub.len();
                match nw.call(Op::Watch { ns, keys: sub }).await? {
                    Reply::Statuses(s) if s.len() == n => {
                        for (&i, code) in part.iter().zip(s) {
                            // A key failed already is settled by the event the node sends
                            // right after this reply, which carries the producer's reason.
                            if ErrorCode::from_u16(code) == ErrorCode::Ok {
                                w.settle(refs[i], ErrorCode::Ok, "");
                            }
                        }
                    }
                    other => return Err(unexpected(&other)),
                }
            }
        }
        Ok(())
    }

    /// Ends the watches of `keys` on their owners (best effort).
    async fn unwatch(&self, keys: &[Vec<u8>]) {
        let r = self.routing();
        let mut by_node: HashMap<u32, Vec<Vec<u8>>> = HashMap::new();
        for k in keys {
            if let Some(o) = self.owner_at(&r, k, 0) {
                by_node.entry(o.0).or_default().push(k.clone());
            }
        }
        let nodes = self.inner.handoff.nodes.lock().await.clone();
        for (node, ks) in by_node {
            let (Some(nw), Ok(link)) = (nodes.get(&node), self.link(node, &r).await) else {
                continue;
            };
            let Ok(ns) = link.ns(&self.ns) else { continue };
            for part in ks.chunks(KEYS_PER_WATCH) {
                let _ = nw
                    .call(Op::Unwatch {
                        ns,
                        keys: part.to_vec(),
                    })
                    .await;
            }
        }
    }

    /// Every key of the namespace that starts with `prefix`, as it is written or failed, from
    /// every node serving now (nodes that join later are not asked). Events may repeat; after a
    /// `Lagged`, look the keys up again.
    pub async fn subscribe(&self, prefix: &[u8]) -> Result<Subscription, ClientError> {
        let hub = self.inner.handoff.clone();
        let (tx, rx) = mpsc::channel(SUBSCRIPTION_EVENTS);
        let lagged = Arc::new(AtomicBool::new(false));
        let id = hub.next_sub.fetch_add(1, Ordering::Relaxed);
        lock(&hub.subs).push(Sub {
            id,
            ns: self.ns.clone(),
            prefix: prefix.to_vec(),
            tx,
            lagged: lagged.clone(),
        });
        let sub = Subscription {
            rx,
            lagged,
            hub: hub.clone(),
            id,
        };
        let r = self.routing();
        let serving: Vec<u32> = r
            .view
            .nodes
            .iter()
            .filter(|n| n.state == kvpool::placement::NodeState::Serving)
            .map(|n| n.id)
            .collect();
        for node in serving {
            let nw = self.node_watch(node).await?;
            let ns = self.link(node, &r).await?.ns(&self.ns)?;
            let op = Op::Subscribe {
                ns,
                prefix: prefix.to_vec(),
            };
            match nw.call(op).await? {
                Reply::Done => {}
                other => return Err(unexpected(&other)),
            }
        }
        Ok(sub)
    }

    /// A handoff's lease on keys, written yet or not: every copy of each key is removed `ttl`
    /// from now unless the lease is renewed (call again) or ended (`ttl` zero), so a handoff
    /// whose producer or consumer went away frees its memory by itself. A producer leases its
    /// keys before writing them. Returns how many keys are present.
    pub async fn expire(&self, keys: &[&[u8]], ttl: Duration) -> Result<u64, ClientError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let ttl_ms = if ttl.is_zero() { 0 } else { ttl_ms.max(1) };
        self.keys_op(keys, self.read_replicas(), |ns, keys| Op::Expire {
            ns,
            keys,
            ttl_ms,
        })
        .await
    }

    /// A producer gives up on `keys`: their owners post tombstones with `reason`, and every
    /// [`Client::wait`] and [`Subscription`] for them hears it at once (instead of waiting for
    /// its timeout). A later write of a key ends its tombstone. Returns how many were posted.
    pub async fn fail(&self, keys: &[&[u8]], reason: &str) -> Result<u64, ClientError> {
        self.keys_op(keys, 1, |ns, keys| Op::Fail {
            ns,
            keys,
            reason: reason.to_owned(),
        })
        .await
    }

    /// Aborts a request on both sides of its handoff, in one call: on every copy's owner, each
    /// key's object is removed (pinned too), every pending allocation of it — a consumer's
    /// reservation ([`Client::alloc`]), a producer's put or alloc still in flight — is released
    /// (its later commit fails with [`ErrorCode::Failed`]), its lease is dropped, and a
    /// tombstone with `reason` (at most 1 KiB) wakes every waiter at once as [`Client::fail`]
    /// does. Returns how many objects and allocations the keys' first owners freed.
    pub async fn cancel(&self, keys: &[&[u8]], reason: &str) -> Result<u64, ClientError> {
        self.keys_op(keys, self.read_replicas(), |ns, keys| Op::Cancel {
            ns,
            keys,
            reason: reason.to_owned(),
        })
        .await
    }
}
