//! This node's view of the cluster, kept current by heartbeats (or derived from etcd, see
//! [`crate::etcd_gateway`]); the mover (`mover`) puts pinned objects (model weights) where the
//! view says they belong.
//!
//! Static membership (the embedded default): every node heartbeats every peer it knows (the
//! configured `peers` plus every node in its view) with `Heartbeat`, carrying its whole view
//! and the nodes it heard from directly lately; the peer merges the view and answers with its
//! own, which is merged back. A peer that has not answered for `down_after_ms` is marked down,
//! unless another peer relayed a hearing of it within `down_after_ms` (so losing one link does
//! not mark a live node down); a node that finds itself marked down raises its epoch to refute
//! it (see [`kvpool::placement`]). Views therefore converge within a few heartbeats,
//! and nodes that agree on every record agree on the view's version and stamp.
//!
//! A node starts `joining` (it owns nothing yet), pulls its peers' views for two heartbeats,
//! then turns `serving`. Draining turns it `draining` (it owns nothing, clients route around
//! it), the mover copies its pinned objects to their owners, and it leaves as `down`.
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use kvpool::membership::{self, Step};
use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::protocol::{Heard, Op, Reply, HEARTBEAT_VERSION};
use kvpool::{NodeId, Pool};
use tokio::sync::watch;

use crate::peer::{Peer, PeerAuth, PeerError};
use crate::written::Written;

pub(crate) use kvpool::membership::Source;

/// Timing of heartbeats and failure detection.
#[derive(Clone, Debug)]
pub(crate) struct Timing {
    pub(crate) heartbeat: Duration,
    pub(crate) down_after: Duration,
    /// How long a restarting node's keys are held for it (`restart_window_ms`).
    pub(crate) restart_window: Duration,
}

impl Timing {
    fn millis(&self) -> membership::Timing {
        membership::Timing {
            heartbeat: self.heartbeat.as_millis() as u64,
            down_after: self.down_after.as_millis() as u64,
            restart_window: self.restart_window.as_millis() as u64,
        }
    }
}

/// How long after a view change this node, where it took keys over, asks the nodes that held
/// them for a pinned object it lacks before a read misses it (see [`Cluster::holders`]): as
/// long as a client looks a miss up on the key's previous owner (its `fallback_window`).
pub(crate) const SETTLE: Duration = Duration::from_secs(60);

/// What [`Cluster::continuity`] found of an object for a routed read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Continuity {
    /// The node held it as one of its first owners in every view since it was written.
    Continuous,
    /// It did not: the copy may be older than a write made elsewhere.
    Broken,
    /// The read was routed by a view other than this node's current one: nothing is judged.
    Moved,
}

/// This node's view of the cluster: the core's [`membership::Membership`], which makes every
/// decision, behind a lock, with the channels that tell the rest of the daemon about changes.
pub(crate) struct Cluster {
    me: u32,
    source: Source,
    core: RwLock<membership::Membership>,
    /// The clock the core is given readings of.
    started: Instant,
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
    /// The pool whose generation marks date the adopted views (unset: every mark is 0).
    pool: OnceLock<Arc<Pool>>,
    /// While the cluster settles: the first view adopted since the view was last steady for
    /// [`SETTLE`] (the core's count, see [`membership::Membership::adopted`]).
    settle_since: AtomicU64,
    /// Until when (ms on [`Cluster::now`]'s clock) the cluster settles: [`SETTLE`] after the
    /// last change of the view; 0 before the first.
    settle_until: AtomicU64,
}

impl Cluster {
    pub(crate) fn new(me: NodeInfo, source: Source) -> Cluster {
        Cluster::of(membership::Membership::new(me, source), source)
    }

    /// A node resuming a restart in place (see [`membership::Membership::resuming`]):
    /// `departed` is its previous process's last view, `me` this process's record, and
    /// `remaining` what is left of the restart window, of which the last `margin` is not used
    /// (the others' clocks). None when `departed` holds no restarting record of this node.
    pub(crate) fn resuming(
        departed: ClusterView,
        me: NodeInfo,
        source: Source,
        (remaining, margin): (Duration, Duration),
    ) -> Option<Cluster> {
        let until = remaining.saturating_sub(margin).as_millis() as u64;
        let core = membership::Membership::resuming(departed, me, source, until)?;
        Some(Cluster::of(core, source))
    }

    fn of(core: membership::Membership, source: Source) -> Cluster {
        let id = core.me();
        let stamp = core.view().stamp();
        Cluster {
            me: id,
            source,
            core: RwLock::new(core),
            started: Instant::now(),
            stamp: AtomicU64::new(stamp),
            changed: watch::channel(stamp).0,
            drain: watch::channel(false).0,
            left: watch::channel(false).0,
            published: watch::channel(0).0,
            written: Written::default(),
            pool: OnceLock::new(),
            settle_since: AtomicU64::new(0),
            settle_until: AtomicU64::new(0),
        }
    }

    /// Sets the pool whose objects the view history dates (once, before serving).
    pub(crate) fn attach_pool(&self, pool: Arc<Pool>) {
        let _ = self.pool.set(pool);
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn read(&self) -> RwLockReadGuard<'_, membership::Membership> {
        self.core.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one step of the core under the lock, with the pool's generation mark read under
    /// it too (so views are recorded in the order adopted), and publishes what changed.
    fn step(&self, f: impl FnOnce(&mut membership::Membership, u64) -> Step) {
        let mut core: RwLockWriteGuard<'_, _> =
            self.core.write().unwrap_or_else(|e| e.into_inner());
        let before = core.view().version;
        let mark = self.pool.get().map_or(0, |p| p.generation_mark());
        let step = f(&mut core, mark);
        match step.resumed {
            Some(Ok(())) => tracing::info!(
                "resumed the restart in place: the objects kept are served as the owner's again"
            ),
            Some(Err(why)) => tracing::info!(
                %why,
                "not resuming the restart in place: the objects kept are no longer served as the owner's; joining afresh"
            ),
            None if step.fenced => tracing::info!(
                "marked down by the cluster: objects held so far are no longer served as the owner's"
            ),
            None => {}
        }
        if step.changed {
            // Settling goes on while the view keeps changing; a change after a steady spell
            // starts it afresh. Stored under the lock, as `holders` reads them under it.
            let now = self.now();
            if now >= self.settle_until.load(Ordering::Acquire) {
                self.settle_since.store(core.adopted(), Ordering::Release);
            }
            let until = now.saturating_add(SETTLE.as_millis() as u64);
            self.settle_until.store(until, Ordering::Release);
            let v = core.view();
            let stamp = v.stamp();
            self.stamp.store(stamp, Ordering::Release);
            tracing::info!(
                version = v.version,
                from = before,
                nodes = %describe(v),
                "cluster view changed"
            );
            drop(core);
            self.changed.send_replace(stamp);
        }
    }

    /// Whether this node's object of `key`, allocated at `generation`, may be served by a read
    /// routed by the view of stamp `stamp`: this node was among its first `replicas` owners in
    /// every view since (see [`kvpool::placement::history`]). Judged under the lock that view
    /// changes take, so a read routed by a view this node has since left is told
    /// [`Continuity::Moved`], never judged by the newer view (in which this node may own
    /// nothing: a draining node's copies are still the mover's to hand over).
    pub(crate) fn continuity(
        &self,
        stamp: u64,
        key: &[u8],
        generation: u64,
        replicas: usize,
    ) -> Continuity {
        let core = self.read();
        // `step` stores the stamp while it holds the write lock: under the read lock it is
        // the stamp of the view `core` judges by.
        if self.stamp.load(Ordering::Acquire) != stamp {
            return Continuity::Moved;
        }
        match core.continuous(key, generation, replicas) {
            true => Continuity::Continuous,
            false => Continuity::Broken,
        }
    }

    /// Whether the view changed less than [`SETTLE`] ago: the nodes that held keys this node
    /// took over may still be moving their pinned objects here.
    pub(crate) fn settling(&self) -> bool {
        self.now() < self.settle_until.load(Ordering::Acquire)
    }

    /// The nodes to ask for a pinned object of `key` that this node lacks, as one of its first
    /// `replicas` owners, because it took the key over while the cluster settles: its other
    /// owners first, then the nodes that owned it in the views since the last steady one (see
    /// [`kvpool::placement::history::History::holders`]). Empty when the cluster is steady, or
    /// this node owned the key throughout.
    pub(crate) fn holders(&self, key: &[u8], replicas: usize) -> Vec<NodeId> {
        let core = self.read();
        if !self.settling() {
            return Vec::new();
        }
        core.holders(key, replicas, self.settle_since.load(Ordering::Acquire))
    }

    /// The node that took `key` over directly from this node, when this node's unpinned
    /// object of it allocated at `generation` was the owner's copy up to then: where the mover
    /// may hand it (see [`kvpool::placement::history::History::handed_to`]).
    pub(crate) fn handed_to(&self, key: &[u8], generation: u64) -> Option<NodeId> {
        self.read().handed_to(key, generation)
    }

    /// The others marked this node down (or, with etcd, its lease expired): what they did
    /// meanwhile is unknown here, so no object held now is served as an owner's copy.
    pub(crate) fn fence(&self) {
        self.step(|c, mark| {
            c.fence(mark);
            Step {
                fenced: true,
                ..Step::default()
            }
        });
    }

    /// Notes a write or remove of `key` here, before it is acknowledged.
    pub(crate) fn note_write(&self, ns: u32, key: &[u8]) {
        self.written.note(ns, key, || self.view());
    }

    /// Forgets the writes of `key` noted here: its owners hold this node's latest write of it
    /// and this node's copy is gone (the mover handed it off).
    pub(crate) fn forget_write(&self, ns: u32, key: &[u8]) {
        self.written.forget(ns, key);
    }

    /// True when a copy of `key` on another node can't shadow a write or remove acknowledged
    /// here (see [`crate::written`]).
    pub(crate) fn vouches(&self, ns: u32, key: &[u8], replicas: usize) -> bool {
        self.written.vouches(ns, key, NodeId(self.me), replicas)
    }

    /// Runs `f`, the commit of a cluster peer's copy of `key`, only while no write or remove
    /// of the key acknowledged here can be newer than the copy (see [`Written::if_vouched`]).
    pub(crate) fn if_vouched<T>(
        &self,
        (ns, key): (u32, &[u8]),
        replicas: usize,
        f: impl FnOnce() -> T,
    ) -> Option<T> {
        self.written
            .if_vouched((ns, key), NodeId(self.me), replicas, f)
    }

    /// Where the view comes from.
    pub(crate) fn source(&self) -> Source {
        self.source
    }

    /// Asks the node to drain and leave (idempotent).
    pub(crate) fn request_drain(&self) {
        self.drain.send_replace(true);
    }

    /// Tells when draining is asked for.
    pub(crate) fn drain_asked(&self) -> watch::Receiver<bool> {
        self.drain.subscribe()
    }

    /// Marks the node as drained and gone: [`Cluster::left`] resolves.
    pub(crate) fn mark_left(&self) {
        self.left.send_replace(true);
    }

    /// Resolves once the node has drained and left.
    pub(crate) async fn left(&self) {
        let mut rx = self.left.subscribe();
        let _ = rx.wait_for(|l| *l).await;
    }

    /// True when some other node is serving: leaving then means draining first.
    pub(crate) fn has_serving_peers(&self) -> bool {
        self.read().has_serving_peers()
    }

    /// This node's id.
    pub(crate) fn me(&self) -> u32 {
        self.me
    }

    /// A copy of the current view.
    pub(crate) fn view(&self) -> ClusterView {
        self.read().view().clone()
    }

    /// The current view's stamp (what routed requests must carry).
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp.load(Ordering::Acquire)
    }

    /// This node's own record, as it last set it.
    pub(crate) fn my_record(&self) -> Option<NodeInfo> {
        self.read().my_record().cloned()
    }

    /// This node's own state.
    pub(crate) fn my_state(&self) -> NodeState {
        self.read().my_state()
    }

    /// Wakes on every change of the view.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Merges a peer's view (see [`membership::Membership::merge`]). Returns the view after.
    pub(crate) fn merge(&self, other: &ClusterView) -> ClusterView {
        self.step(|c, mark| c.merge(other, mark));
        self.view()
    }

    /// A peer's `Heartbeat` relayed the nodes it heard from directly (see
    /// [`membership::Membership::relayed`]).
    pub(crate) fn relayed(&self, heard: &[Heard]) {
        let now = self.now();
        self.step(|c, _| {
            c.relayed(heard, now);
            Step::default()
        });
    }

    /// Replaces the view wholesale with one derived from etcd, keeping this node's own record.
    pub(crate) fn replace(&self, view: ClusterView) {
        self.step(|c, mark| c.replace(view, mark));
    }

    /// etcd holds no lease of this node any more: the others have it down (`shown`, their
    /// record of it), and so does its own view from now on, which also fences it, until it
    /// registers again ([`membership::Membership::lapse`]).
    pub(crate) fn lapse(&self, shown: &NodeInfo) {
        self.step(|c, mark| {
            c.fence(mark);
            Step {
                fenced: true,
                ..c.lapse(shown, mark)
            }
        });
    }

    /// True while etcd holds no lease of this node.
    pub(crate) fn lapsed(&self) -> bool {
        self.read().lapsed()
    }

    /// After a lapse: the record to register again with (this node's own, at a new epoch);
    /// the view takes it once etcd shows it.
    pub(crate) fn reinstated(&self) -> Option<NodeInfo> {
        self.read().reinstated()
    }

    /// Raises this node's epoch above `theirs`, a record of this node found elsewhere (left
    /// by an earlier run), when that is at least as new as this node's own and differs.
    pub(crate) fn outrank(&self, theirs: &NodeInfo) {
        self.step(|c, mark| c.outrank(theirs, mark));
    }

    /// True while this node resumes a restart in place (undecided yet).
    pub(crate) fn is_resuming(&self) -> bool {
        self.read().is_resuming()
    }

    /// Decides the restart in place this node resumes, `theirs` being the record of this node
    /// the others hold (etcd's; see [`membership::Membership::resume`]).
    pub(crate) fn resume(&self, theirs: Option<&NodeInfo>) {
        let now = self.now();
        self.step(|c, mark| c.resume(now, theirs, mark));
    }

    /// Records that this node's record at `epoch` is in etcd.
    pub(crate) fn mark_published(&self, epoch: u64) {
        self.published.send_replace(epoch);
    }

    /// Changes this node's own state (raising its epoch).
    pub(crate) fn set_state(&self, state: NodeState) {
        self.step(|c, mark| c.set_state(state, mark));
    }
}

fn describe(v: &ClusterView) -> String {
    v.nodes
        .iter()
        .map(|n| format!("{}:{}@{}", n.id, n.state.name(), n.epoch))
        .collect::<Vec<_>>()
        .join(",")
}

/// Heartbeats: one task per peer address, started as peers appear (configured, or learnt
/// from a view), each gossiping every heartbeat; and every heartbeat a tick of the core, which
/// marks silent peers down and turns a joining node serving. Returns when `stop` fires.
pub(crate) async fn heartbeats(
    m: Arc<Cluster>,
    peers: Vec<String>,
    creds: PeerAuth,
    timing: Timing,
    mut stop: watch::Receiver<bool>,
) {
    let mut running: HashSet<String> = HashSet::new();
    let mut tasks = Vec::new();
    let mut tick = tokio::time::interval(timing.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let targets = m.read().heartbeat_targets(&peers);
        for addr in targets {
            if running.insert(addr.clone()) {
                let now = m.now();
                m.step(|c, _| {
                    c.watch(&addr, now);
                    Step::default()
                });
                tasks.push(tokio::spawn(peer_loop(
                    m.clone(),
                    addr,
                    creds.clone(),
                    timing.clone(),
                    stop.clone(),
                )));
            }
        }
        let now = m.now();
        m.step(|c, mark| c.tick(now, timing.millis(), mark));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// Gossips with the peer at `addr` every heartbeat, (re)connecting as needed, and hands its
/// answers to the core.
async fn peer_loop(
    m: Arc<Cluster>,
    addr: String,
    creds: PeerAuth,
    timing: Timing,
    mut stop: watch::Receiver<bool>,
) {
    let mut peer: Option<Peer> = None;
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
                Ok(p) if p.hello.node == m.me() => {
                    // Our own address under another name.
                    m.step(|c, _| {
                        c.forget(&addr);
                        Step::default()
                    });
                    return;
                }
                Ok(p) => peer = Some(p),
                Err(e) => warn_once(&addr, &e, &mut warned),
            }
        }
        let Some(p) = peer.as_mut() else { continue };
        let view = kvpool::protocol::view_for(m.view(), p.hello.version);
        let op = if p.hello.version >= HEARTBEAT_VERSION {
            let heard = m.read().heard_directly(m.now(), timing.millis().down_after);
            Op::Heartbeat { view, heard }
        } else {
            // A node of protocol 5 (a rolling upgrade): it takes no relayed hearings.
            Op::Gossip { view }
        };
        match p.call(op, &[]).await {
            Ok(Reply::View(v)) => {
                let now = m.now();
                m.step(|c, mark| c.heard(&addr, &v, now, mark));
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
}

/// Logs, once until the peer answers again, why it could not be reached.
fn warn_once(addr: &str, e: &PeerError, warned: &mut bool) {
    if std::mem::replace(warned, true) {
        return;
    }
    match e {
        PeerError::NotInCluster => tracing::warn!(
            peer = %addr,
            "peer refused: it does not hold this cluster's secret"
        ),
        e => tracing::debug!(peer = %addr, error = %e, "peer unreachable"),
    }
}

/// Tells every peer in the view this node's latest record at once (best effort), instead of
/// waiting for the next heartbeat: used when leaving. With etcd membership, waits (bounded) for
/// the record to be published instead.
pub(crate) async fn announce(m: &Cluster, creds: &PeerAuth, timeout: Duration) {
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
    let peers = m.read().announce_targets();
    let calls = peers.into_iter().map(|addr| {
        let view = view.clone();
        async move {
            if let Ok(mut p) = Peer::connect(&addr, creds, m.me(), timeout).await {
                let view = kvpool::protocol::view_for(view, p.hello.version);
                let _ = p.call(Op::Gossip { view }, &[]).await;
            }
        }
    });
    for c in calls {
        c.await;
    }
}
