//! Membership: this node's view of the cluster, kept current by heartbeats (or derived from
//! etcd, see [`crate::etcd_gateway`]), and the mover that puts pinned objects (model weights) where the
//! view says they belong.
//!
//! Static membership (the embedded default): every node heartbeats every peer it knows (the
//! configured `peers` plus every node in its view) with `Gossip`, carrying its whole view; the
//! peer merges it and answers with its own, which is merged back. A peer that has not answered
//! for `down_after_ms` is marked down; a node that finds itself marked down raises its epoch
//! to refute it (see [`kvpool::placement`]). Views therefore converge within a few heartbeats,
//! and nodes that agree on every record agree on the view's version and stamp.
//!
//! A node starts `joining` (it owns nothing yet), pulls its peers' views for two heartbeats,
//! then turns `serving`. Draining turns it `draining` (it owns nothing, clients route around
//! it), the mover copies its pinned objects to their owners, and it leaves as `down`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::protocol::{LocatedWire, Op, Reply};
use kvpool::{NodeId, Pool};
use tokio::sync::watch;

use crate::fence::History;
use crate::peer::{Peer, PeerAuth, PeerError};
use crate::written::Written;

/// Timing of heartbeats and failure detection.
#[derive(Clone, Debug)]
pub(crate) struct Timing {
    pub(crate) heartbeat: Duration,
    pub(crate) down_after: Duration,
}

/// Where the view comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// Heartbeats between the nodes, carrying their views ([`heartbeats`]).
    Gossip,
    /// etcd: the view is replaced wholesale by the one derived from etcd, versions are etcd
    /// revisions, and gossip from other nodes is ignored.
    Etcd,
}

/// This node's view of the cluster.
pub(crate) struct Membership {
    me: u32,
    source: Source,
    view: Mutex<ClusterView>,
    stamp: AtomicU64,
    changed: watch::Sender<u64>,
    /// Set when draining was asked for (`Drain`, or SIGTERM in a cluster).
    drain: watch::Sender<bool>,
    /// Set once the node has drained and left: the process should exit.
    left: watch::Sender<bool>,
    /// The epoch of this node's record as last published to etcd.
    published: watch::Sender<u64>,
    /// Keys written or removed here: what this node vouches for (see [`crate::written`]).
    written: Written,
    /// The views adopted, with the pool's generation mark at each: which objects this node
    /// may still serve as their owner (see [`crate::fence`]).
    history: RwLock<History>,
    /// The pool whose generation marks the history records (unset: every mark is 0).
    pool: OnceLock<Arc<Pool>>,
}

impl Membership {
    pub(crate) fn new(me: NodeInfo, source: Source) -> Membership {
        let id = me.id;
        let view = ClusterView::from_nodes(vec![me]);
        let stamp = view.stamp();
        let mut history = History::new(NodeId(id));
        history.adopt(&view, 0);
        Membership {
            me: id,
            source,
            view: Mutex::new(view),
            stamp: AtomicU64::new(stamp),
            changed: watch::channel(stamp).0,
            drain: watch::channel(false).0,
            left: watch::channel(false).0,
            published: watch::channel(0).0,
            written: Written::default(),
            history: RwLock::new(history),
            pool: OnceLock::new(),
        }
    }

    /// Sets the pool whose objects the view history dates (once, before serving).
    pub(crate) fn attach_pool(&self, pool: Arc<Pool>) {
        let _ = self.pool.set(pool);
    }

    fn generation_mark(&self) -> u64 {
        self.pool.get().map_or(0, |p| p.generation_mark())
    }

    fn history(&self) -> std::sync::RwLockWriteGuard<'_, History> {
        self.history.write().unwrap_or_else(|e| e.into_inner())
    }

    /// True when this node's object of `key`, allocated at `generation`, may be served by a
    /// routed read: this node was among its first `replicas` owners in every view since (see
    /// [`crate::fence`]).
    pub(crate) fn continuous(&self, key: &[u8], generation: u64, replicas: usize) -> bool {
        self.history
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .continuous(key, generation, replicas)
    }

    /// The others marked this node down (or, with etcd, its lease expired): what they did
    /// meanwhile is unknown here, so no object held now is served as an owner's copy.
    pub(crate) fn fence(&self) {
        let mark = self.generation_mark();
        tracing::info!(
            "marked down by the cluster: objects held so far are no longer served as the owner's"
        );
        self.history().fence(mark);
    }

    /// Notes a write or remove of `key` here, before it is acknowledged.
    pub(crate) fn note_write(&self, ns: u32, key: &[u8]) {
        self.written.note(ns, key, || self.view());
    }

    /// True when a copy of `key` on another node can't shadow a write or remove acknowledged
    /// here (see [`crate::written`]).
    pub(crate) fn vouches(&self, ns: u32, key: &[u8], replicas: usize) -> bool {
        self.written.vouches(ns, key, NodeId(self.me), replicas)
    }

    /// Where the view comes from.
    pub(crate) fn source(&self) -> Source {
        self.source
    }

    /// Asks the node to drain and leave (idempotent).
    pub(crate) fn request_drain(&self) {
        self.drain.send_replace(true);
    }

    /// Resolves once the node has drained and left.
    pub(crate) async fn left(&self) {
        let mut rx = self.left.subscribe();
        let _ = rx.wait_for(|l| *l).await;
    }

    /// True when some other node is serving: leaving then means draining first.
    pub(crate) fn has_serving_peers(&self) -> bool {
        self.lock()
            .nodes
            .iter()
            .any(|n| n.id != self.me && n.state == NodeState::Serving)
    }

    /// This node's id.
    pub(crate) fn me(&self) -> u32 {
        self.me
    }

    /// A copy of the current view.
    pub(crate) fn view(&self) -> ClusterView {
        self.lock().clone()
    }

    /// The current view's stamp (what routed requests must carry).
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp.load(Ordering::Acquire)
    }

    /// This node's own record, as it last set it.
    pub(crate) fn my_record(&self) -> Option<NodeInfo> {
        self.lock().node(NodeId(self.me)).cloned()
    }

    /// This node's own state.
    pub(crate) fn my_state(&self) -> NodeState {
        self.lock()
            .node(NodeId(self.me))
            .map_or(NodeState::Down, |n| n.state)
    }

    /// Wakes on every change of the view.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ClusterView> {
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut ClusterView, u32) -> bool) {
        self.update_from(false, f)
    }

    /// Applies `f`; `from_etcd`: `f` installs a view derived from etcd, at its revision.
    fn update_from(&self, from_etcd: bool, f: impl FnOnce(&mut ClusterView, u32) -> bool) {
        let mut v = self.lock();
        let before = v.version;
        if f(&mut v, self.me) {
            if self.source == Source::Etcd {
                // Versions are etcd revisions; a change made here before etcd has it, or a
                // wiped etcd starting its revisions again, still moves the version forward.
                v.version = if from_etcd {
                    v.version.max(before + 1)
                } else {
                    before + 1
                };
            }
            // Under the view lock, so marks and views are recorded in the order adopted.
            self.history().adopt(&v, self.generation_mark());
            let stamp = v.stamp();
            self.stamp.store(stamp, Ordering::Release);
            tracing::info!(
                version = v.version,
                from = before,
                nodes = %describe(&v),
                "cluster view changed"
            );
            drop(v);
            self.changed.send_replace(stamp);
        }
    }

    /// Merges a peer's view. When it holds a record of this node at least as new as the one
    /// this node holds but different (marked down, or a record from an earlier run), this node
    /// refutes it with a higher epoch. Returns the view after the merge.
    ///
    /// With etcd membership the view comes from etcd only: gossip is answered, not merged.
    pub(crate) fn merge(&self, other: &ClusterView) -> ClusterView {
        if self.source == Source::Etcd {
            return self.view();
        }
        if other
            .node(NodeId(self.me))
            .is_some_and(|n| n.state == NodeState::Down)
        {
            self.fence();
        }
        self.update(|v, me| {
            let mut changed = v.merge(other, me);
            if let Some(theirs) = other.node(NodeId(me)) {
                changed |= refute(v, me, theirs);
            }
            changed
        });
        self.view()
    }

    /// Replaces the view wholesale with one derived elsewhere (etcd), keeping this node's own
    /// record as this node last set it: its changes reach the others by being published.
    pub(crate) fn replace(&self, mut view: ClusterView) {
        if view
            .node(NodeId(self.me))
            .is_some_and(|n| n.state == NodeState::Down)
        {
            self.fence();
        }
        self.update_from(true, |v, me| {
            view.nodes.retain(|n| n.id != me);
            if let Some(mine) = v.node(NodeId(me)).cloned() {
                let at = view.nodes.partition_point(|n| n.id < me);
                view.nodes.insert(at, mine);
            }
            if view.nodes == v.nodes {
                // The same records at a later revision: no change to route by.
                v.version = v.version.max(view.version);
                return false;
            }
            *v = view;
            true
        });
    }

    /// Raises this node's epoch above `theirs`, a record of this node found elsewhere (left
    /// by an earlier run), when that is at least as new as this node's own and differs.
    pub(crate) fn outrank(&self, theirs: &NodeInfo) {
        self.update(|v, me| refute(v, me, theirs));
    }

    /// Records that this node's record at `epoch` is in etcd.
    pub(crate) fn mark_published(&self, epoch: u64) {
        self.published.send_replace(epoch);
    }

    /// Changes this node's own state (raising its epoch).
    pub(crate) fn set_state(&self, state: NodeState) {
        self.update(|v, me| {
            let Some(mut rec) = v.node(NodeId(me)).cloned() else {
                return false;
            };
            if rec.state == state {
                return false;
            }
            rec.state = state;
            rec.epoch += 1;
            v.offer(&rec)
        });
    }

    /// Marks a peer down (it stopped answering heartbeats).
    pub(crate) fn mark_down(&self, id: u32) {
        if id != self.me {
            self.update(|v, _| v.mark_down(id));
        }
    }
}

/// Raises this node's epoch above `theirs` when that record of this node is at least as new as
/// its own and differs (marked down, or from an earlier run). True when the view changed.
fn refute(v: &mut ClusterView, me: u32, theirs: &NodeInfo) -> bool {
    let Some(mine) = v.node(NodeId(me)).cloned() else {
        return false;
    };
    if theirs.epoch < mine.epoch || *theirs == mine {
        return false;
    }
    let mut rec = mine;
    rec.epoch = theirs.epoch + 1;
    v.offer(&rec)
}

fn describe(v: &ClusterView) -> String {
    v.nodes
        .iter()
        .map(|n| format!("{}:{}@{}", n.id, n.state.name(), n.epoch))
        .collect::<Vec<_>>()
        .join(",")
}

/// Heartbeats: one task per peer address, started as peers appear (configured, or learnt
/// from a view), each gossiping every heartbeat. Returns when `stop` fires.
pub(crate) async fn heartbeats(
    m: Arc<Membership>,
    peers: Vec<String>,
    creds: PeerAuth,
    timing: Timing,
    mut stop: watch::Receiver<bool>,
) {
    let mut running: HashSet<String> = HashSet::new();
    let mut tasks = Vec::new();
    let started = Instant::now();
    let mut tick = tokio::time::interval(timing.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let my_tcp = m
        .view()
        .node(NodeId(m.me()))
        .map(|n| n.tcp.clone())
        .unwrap_or_default();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let view = m.view();
        let wanted = peers.iter().cloned().chain(
            view.nodes
                .iter()
                .filter(|n| n.id != m.me() && !n.tcp.is_empty())
                .map(|n| n.tcp.clone()),
        );
        for addr in wanted {
            if addr != my_tcp && running.insert(addr.clone()) {
                tasks.push(tokio::spawn(peer_loop(
                    m.clone(),
                    addr,
                    creds.clone(),
                    timing.clone(),
                    stop.clone(),
                )));
            }
        }
        // Joining: two heartbeats to pull the peers' views, then take a share of the keys.
        if m.my_state() == NodeState::Joining && started.elapsed() >= timing.heartbeat * 2 {
            m.set_state(NodeState::Serving);
        }
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn peer_loop(
    m: Arc<Membership>,
    addr: String,
    creds: PeerAuth,
    timing: Timing,
    mut stop: watch::Receiver<bool>,
) {
    let mut peer: Option<Peer> = None;
    let mut last_ok = Instant::now();
    let mut tick = tokio::time::interval(timing.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if peer.is_none() {
            match Peer::connect(&addr, &creds, m.me(), timing.heartbeat).await {
                Ok(p) if p.hello.node == m.me() => return, // our own address under another name
                Ok(p) => peer = Some(p),
                Err(PeerError::NotInCluster) => {
                    if !warned {
                        tracing::warn!(
                            peer = %addr,
                            "peer refused: it does not hold this cluster's secret"
                        );
                        warned = true;
                    }
                }
                Err(e) => {
                    if !warned {
                        tracing::debug!(peer = %addr, error = %e, "peer unreachable");
                        warned = true;
                    }
                }
            }
        }
        if let Some(p) = peer.as_mut() {
            match p.call(Op::Gossip { view: m.view() }, &[]).await {
                Ok(Reply::View(v)) => {
                    m.merge(&v);
                    last_ok = Instant::now();
                    warned = false;
                }
                Ok(other) => {
                    tracing::warn!(peer = %addr, reply = ?other, "unexpected gossip reply");
                    peer = None;
                }
                Err(e) => {
                    tracing::debug!(peer = %addr, error = %e, "heartbeat failed");
                    peer = None;
                }
            }
        }
        if last_ok.elapsed() >= timing.down_after {
            // The node this address belongs to, as the view knows it.
            let id = m.view().nodes.iter().find(|n| n.tcp == addr).map(|n| n.id);
            if let Some(id) = id {
                m.mark_down(id);
            }
        }
    }
}

/// Tells every peer in the view this node's latest record at once (best effort), instead of
/// waiting for the next heartbeat: used when leaving. With etcd membership, waits (bounded) for
/// the record to be published instead.
pub(crate) async fn announce(m: &Membership, creds: &PeerAuth, timeout: Duration) {
    if m.source == Source::Etcd {
        let epoch = m.my_record().map_or(0, |n| n.epoch);
        let mut published = m.published.subscribe();
        let wait = published.wait_for(|&p| p >= epoch);
        if tokio::time::timeout(timeout.max(Duration::from_secs(2)), wait)
            .await
            .is_err()
        {
            tracing::warn!("etcd: this node's new state was not published in time");
        }
        return;
    }
    let view = m.view();
    let peers: Vec<String> = view
        .nodes
        .iter()
        .filter(|n| n.id != m.me() && n.state != NodeState::Down && !n.tcp.is_empty())
        .map(|n| n.tcp.clone())
        .collect();
    let calls = peers.into_iter().map(|addr| {
        let view = view.clone();
        async move {
            if let Ok(mut p) = Peer::connect(&addr, creds, m.me(), timeout).await {
                let _ = p.call(Op::Gossip { view }, &[]).await;
            }
        }
    });
    for c in calls {
        c.await;
    }
}

/// Replication factors, by namespace id.
#[derive(Clone, Debug, Default)]
pub(crate) struct Replication {
    /// Per namespace id: copies of each pinned object.
    pub(crate) pinned: Vec<u32>,
}

/// Outcome of one pass of the mover.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct MovePass {
    /// Pinned objects copied to an owner that lacked them.
    pub(crate) copied: usize,
    /// Pinned objects dropped here because every owner holds them and this node is not one.
    pub(crate) handed_off: usize,
    /// Pinned objects still here that this node does not own (an owner was unreachable).
    pub(crate) stranded: usize,
}

/// Most keys per `Lookup` a pass sends.
const MOVE_BATCH: usize = 1024;

/// One pass over the pinned objects: each goes to the serving nodes that own it under the
/// current view (a copy where an owner lacks it: a new owner after a join, a lost replica
/// after a crash), and is dropped here once every owner holds it and this node is not one of
/// them (after a join, or while draining). Objects are sent one at a time: low priority.
pub(crate) async fn move_pass(
    pool: &Pool,
    m: &Membership,
    repl: &Replication,
    creds: &PeerAuth,
    timeout: Duration,
    started: Instant,
) -> MovePass {
    let view = m.view();
    let me = NodeId(m.me());
    let mut out = MovePass::default();
    let mut peers: HashMap<u32, Option<Peer>> = HashMap::new();
    for (ns, &r) in repl.pinned.iter().enumerate() {
        let ns = ns as u32;
        let Ok(keys) = pool.pinned_keys(ns) else {
            continue;
        };
        // Per owner other than me, the keys it should hold.
        let mut by_owner: HashMap<u32, Vec<usize>> = HashMap::new();
        let mut owned_here = vec![false; keys.len()];
        for (i, k) in keys.iter().enumerate() {
            for o in view.owners(k, r.max(1) as usize) {
                if o == me {
                    owned_here[i] = true;
                } else {
                    by_owner.entry(o.0).or_default().push(i);
                }
            }
        }
        let mut confirmed = vec![0usize; keys.len()];
        let mut failed = vec![false; keys.len()];
        for (owner, idx) in by_owner {
            let peer = match peers.entry(owner) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let addr = view.node(NodeId(owner)).map(|n| n.tcp.clone());
                    let p = match addr {
                        Some(a) => Peer::connect(&a, creds, me.0, timeout).await.ok(),
                        None => None,
                    };
                    e.insert(p)
                }
            };
            let Some(p) = peer.as_mut() else {
                idx.iter().for_each(|&i| failed[i] = true);
                continue;
            };
            for chunk in idx.chunks(MOVE_BATCH) {
                let lookup = Op::Lookup {
                    ns,
                    keys: chunk.iter().map(|&i| keys[i].clone()).collect(),
                    lease_ms: 0,
                };
                let present: Vec<Option<LocatedWire>> = match p.call(lookup, &[]).await {
                    Ok(Reply::Located(l)) if l.len() == chunk.len() => l,
                    _ => {
                        chunk.iter().for_each(|&i| failed[i] = true);
                        continue;
                    }
                };
                for (&i, have) in chunk.iter().zip(present) {
                    if have.is_some() {
                        confirmed[i] += 1;
                        continue;
                    }
                    let now = started.elapsed().as_millis() as u64;
                    let Ok(obj) = pool.get_ref(ns, &keys[i], now) else {
                        continue; // removed meanwhile
                    };
                    let put = Op::Put {
                        ns,
                        key: keys[i].clone(),
                        checksum: obj.checksum(),
                        pin: true,
                    };
                    match p.call(put, &[obj.bytes()]).await {
                        Ok(Reply::Done) => {
                            confirmed[i] += 1;
                            out.copied += 1;
                        }
                        Ok(_) | Err(_) => failed[i] = true,
                    }
                }
            }
        }
        for (i, k) in keys.iter().enumerate() {
            if owned_here[i] || failed[i] {
                if !owned_here[i] {
                    out.stranded += 1;
                }
                continue;
            }
            let owners = view.owners(k, r.max(1) as usize).len();
            if owners > 0 && confirmed[i] == owners && pool.remove(ns, k).unwrap_or(false) {
                out.handed_off += 1;
            } else if owners == 0 {
                out.stranded += 1;
            }
        }
    }
    out
}

/// What the mover needs.
pub(crate) struct Mover {
    pub(crate) pool: Arc<Pool>,
    pub(crate) m: Arc<Membership>,
    pub(crate) repl: Replication,
    pub(crate) creds: PeerAuth,
    pub(crate) timing: Timing,
    pub(crate) started: Instant,
    /// Longest a drain waits for pinned objects to find a new home.
    pub(crate) drain_timeout: Duration,
}

impl Mover {
    /// One pass of [`move_pass`] with this node's settings.
    async fn pass(&self) -> MovePass {
        let timeout = self.timing.heartbeat * 4;
        move_pass(
            &self.pool,
            &self.m,
            &self.repl,
            &self.creds,
            timeout,
            self.started,
        )
        .await
    }
}

/// Runs the mover: a pass after every view change (and every few seconds while objects are
/// stranded), and the drain when asked for. Returns when `stop` fires or the node has left.
pub(crate) async fn mover(mv: Mover, mut stop: watch::Receiver<bool>) {
    let mut changed = mv.m.subscribe();
    let mut drain = mv.m.drain.subscribe();
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pending = false;
    loop {
        let drain_now = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            r = changed.changed() => { if r.is_err() { return; } pending = true; false }
            _ = tick.tick() => false,
            r = drain.wait_for(|d| *d) => r.is_ok(),
        };
        if drain_now {
            drain_and_leave(&mv).await;
            return;
        }
        if !pending || mv.m.view().nodes.len() < 2 {
            continue;
        }
        let pass = mv.pass().await;
        if pass != MovePass::default() {
            tracing::info!(
                copied = pass.copied,
                handed_off = pass.handed_off,
                stranded = pass.stranded,
                "moved pinned objects"
            );
        }
        pending = pass.stranded > 0;
    }
}

async fn drain_and_leave(mv: &Mover) {
    tracing::info!("draining: taking no new objects, moving pinned objects off");
    mv.m.set_state(NodeState::Draining);
    announce(&mv.m, &mv.creds, mv.timing.heartbeat * 4).await;
    let deadline = Instant::now() + mv.drain_timeout;
    loop {
        let pass = mv.pass().await;
        tracing::info!(
            copied = pass.copied,
            handed_off = pass.handed_off,
            stranded = pass.stranded,
            "drain pass"
        );
        if pass.stranded == 0 {
            break;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                stranded = pass.stranded,
                "drain timeout: leaving with pinned objects that found no home"
            );
            break;
        }
        tokio::time::sleep(mv.timing.heartbeat).await;
    }
    mv.m.set_state(NodeState::Down);
    announce(&mv.m, &mv.creds, mv.timing.heartbeat * 4).await;
    tracing::info!("drained: leaving the cluster");
    mv.m.left.send_replace(true);
}
