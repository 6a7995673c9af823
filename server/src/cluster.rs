//! Membership: this node's view of the cluster, kept current by heartbeats (or derived from
//! etcd, see [`crate::etcd_gateway`]), and the mover that puts pinned objects (model weights) where the
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

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use kvpool::membership::{self, Step};
use kvpool::placement::routing::{self, Outcome};
use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::protocol::{Heard, LocatedWire, Op, Priority, Reply, HEARTBEAT_VERSION};
use kvpool::{NodeId, Pool};
use tokio::sync::watch;

use crate::bulk::{Bulk, CLUSTER_NS};
use crate::handover::{handover_pass, Budget, HandoverPass};
use crate::metrics::Metrics;
use crate::peer::{Peer, PeerAuth, PeerError};
use crate::written::Written;

pub(crate) use kvpool::membership::Source;

/// Timing of heartbeats and failure detection.
#[derive(Clone, Debug)]
pub(crate) struct Timing {
    pub(crate) heartbeat: Duration,
    pub(crate) down_after: Duration,
}

impl Timing {
    fn millis(&self) -> membership::Timing {
        membership::Timing {
            heartbeat: self.heartbeat.as_millis() as u64,
            down_after: self.down_after.as_millis() as u64,
        }
    }
}

/// How long after a view change this node, where it took keys over, asks the nodes that held
/// them for a pinned object it lacks before a read misses it (see [`Membership::holders`]): as
/// long as a client looks a miss up on the key's previous owner (its `fallback_window`).
pub(crate) const SETTLE: Duration = Duration::from_secs(60);

/// What [`Membership::continuity`] found of an object for a routed read.
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
pub(crate) struct Membership {
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
    /// Until when (ms on [`Membership::now`]'s clock) the cluster settles: [`SETTLE`] after the
    /// last change of the view; 0 before the first.
    settle_until: AtomicU64,
}

impl Membership {
    pub(crate) fn new(me: NodeInfo, source: Source) -> Membership {
        let id = me.id;
        let core = membership::Membership::new(me, source);
        let stamp = core.view().stamp();
        Membership {
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
        if step.fenced {
            tracing::info!(
                "marked down by the cluster: objects held so far are no longer served as the owner's"
            );
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
                changed: false,
                fenced: true,
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

    /// Raises this node's epoch above `theirs`, a record of this node found elsewhere (left
    /// by an earlier run), when that is at least as new as this node's own and differs.
    pub(crate) fn outrank(&self, theirs: &NodeInfo) {
        self.step(|c, mark| c.outrank(theirs, mark));
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
    m: Arc<Membership>,
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
    m: Arc<Membership>,
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
        let view = m.view();
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
    let peers = m.read().announce_targets();
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
    /// Pinned objects this node owns that an owner lacking them could not be given (it was
    /// unreachable, slow or full): the next pass tries again, as for stranded ones.
    pub(crate) short: usize,
}

/// Most keys per `Lookup` a pass sends.
const MOVE_BATCH: usize = 1024;

/// One pass over the pinned objects: each goes to the serving nodes that own it under the
/// current view, and is dropped here once every owner holds it and this node is not one of
/// them ([`kvpool::placement::routing`] decides which). Objects are sent one at a time, each
/// in its turn among this node's bulk transfers at background priority (`bulk`), so moves never
/// crowd out the clients' traffic and count against `--bulk-rate`.
pub(crate) async fn move_pass(
    pool: &Pool,
    m: &Membership,
    repl: &Replication,
    (creds, bulk): (&PeerAuth, &Bulk),
    timeout: Duration,
    started: Instant,
) -> MovePass {
    let view = m.view();
    let mut out = MovePass::default();
    let mut peers = Peers::new(&view, creds, m.me(), timeout);
    let moving = Moving {
        pool,
        m,
        bulk,
        started,
        view: &view,
    };
    for (ns, &r) in repl.pinned.iter().enumerate() {
        let ns = ns as u32;
        let Ok(keys) = pool.pinned_keys(ns) else {
            continue;
        };
        moving
            .keys(&mut peers, (ns, r as usize), &keys, &mut out)
            .await;
    }
    out
}

/// [`move_pass`] for the pinned objects of `keys` in namespace `ns` (`pinned_replicas` `r`)
/// alone, now: what a `Move` asks of this node, from an owner that lacks them while the
/// cluster settles.
pub(crate) async fn move_now(
    pool: &Pool,
    m: &Membership,
    (ns, r, keys): (u32, usize, Vec<Vec<u8>>),
    (creds, bulk): (&PeerAuth, &Bulk),
    timeout: Duration,
    started: Instant,
) {
    let pinned = |k: &Vec<u8>| matches!(pool.provenance(ns, k), Ok(Some((_, true))));
    let keys: Vec<Vec<u8>> = keys.into_iter().filter(pinned).collect();
    if keys.is_empty() {
        return;
    }
    let view = m.view();
    let mut out = MovePass::default();
    let mut peers = Peers::new(&view, creds, m.me(), timeout);
    let moving = Moving {
        pool,
        m,
        bulk,
        started,
        view: &view,
    };
    moving.keys(&mut peers, (ns, r), &keys, &mut out).await;
    if out != MovePass::default() {
        tracing::debug!(
            copied = out.copied,
            handed_off = out.handed_off,
            stranded = out.stranded,
            "moved pinned objects an owner asked for"
        );
    }
}

/// What moving pinned objects under one view needs.
struct Moving<'a> {
    pool: &'a Pool,
    m: &'a Membership,
    bulk: &'a Bulk,
    started: Instant,
    /// The view the owners are found in.
    view: &'a ClusterView,
}

impl Moving<'_> {
    /// Moves the pinned objects of `keys` (of namespace `ns`, each to live on `r` owners):
    /// copied to the owners that lack them, dropped here once every owner holds them if this
    /// node owns none of them. Counts what it did in `out`.
    async fn keys(
        &self,
        peers: &mut Peers<'_>,
        (ns, r): (u32, usize),
        keys: &[Vec<u8>],
        out: &mut MovePass,
    ) {
        let plan = routing::plan(self.view, NodeId(self.m.me()), keys, r);
        let mut confirmed = vec![0usize; keys.len()];
        let mut failed = vec![false; keys.len()];
        let mut exact = vec![Exact::Unseen; keys.len()];
        for (owner, idx) in &plan.to {
            let Some(p) = peers.get(owner.0).await else {
                idx.iter().for_each(|&i| failed[i] = true);
                continue;
            };
            let copy = Copy {
                pool: self.pool,
                bulk: self.bulk,
                ns,
                keys,
                started: self.started,
                view: self.view.stamp(),
            };
            for chunk in idx.chunks(MOVE_BATCH) {
                let seen = (&mut confirmed[..], &mut failed[..], &mut exact[..]);
                copy.to(p, chunk, seen, out).await;
            }
        }
        for (i, k) in keys.iter().enumerate() {
            match plan.outcome(i, confirmed[i], failed[i]) {
                Outcome::Keep if failed[i] => out.short += 1,
                Outcome::Keep => {}
                Outcome::Stranded => out.stranded += 1,
                Outcome::HandOff => self.hand_off(ns, k, exact[i], out),
            }
        }
    }

    /// Drops this node's copy of `key`: every owner holds it and this node is not one.
    fn hand_off(&self, ns: u32, key: &[u8], exact: Exact, out: &mut MovePass) {
        match exact {
            // Every owner holds exactly this node's latest write of the key: dropped only
            // while it is still that write, and then this node no longer needs its record of
            // the write to refuse vouching for the owners' copies (a drain back to it can
            // serve them as previous owners' without a miss).
            Exact::Generation(g) => {
                if self.pool.remove_generation(ns, key, g).unwrap_or(false) {
                    out.handed_off += 1;
                    self.m.forget_write(ns, key);
                }
            }
            Exact::Unseen | Exact::Differs => {
                if self.pool.remove(ns, key).unwrap_or(false) {
                    out.handed_off += 1;
                }
            }
        }
    }
}

/// What the owners of a key hold, against this node's copy, as a pass learns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exact {
    /// No owner confirmed yet.
    Unseen,
    /// Every owner that confirmed holds the bytes of this node's copy of this generation
    /// (sent by this pass, or found with the same checksum).
    Generation(u64),
    /// An owner holds other bytes (an older or newer write), or this node's copy changed
    /// between owners.
    Differs,
}

impl Exact {
    fn saw(&mut self, generation: Option<u64>) {
        *self = match (*self, generation) {
            (Exact::Unseen, Some(g)) => Exact::Generation(g),
            (Exact::Generation(h), Some(g)) if h == g => Exact::Generation(g),
            _ => Exact::Differs,
        };
    }
}

/// Connections to the nodes of one view, opened on first use: the mover's to the owners of one
/// pass, or a read's to the holders it asks while the cluster settles.
pub(crate) struct Peers<'a> {
    view: &'a ClusterView,
    creds: &'a PeerAuth,
    me: u32,
    timeout: Duration,
    /// Per node: its connection, or None when it could not be reached this pass.
    open: HashMap<u32, Option<Peer>>,
}

impl<'a> Peers<'a> {
    pub(crate) fn new(
        view: &'a ClusterView,
        creds: &'a PeerAuth,
        me: u32,
        timeout: Duration,
    ) -> Self {
        Peers {
            view,
            creds,
            me,
            timeout,
            open: HashMap::new(),
        }
    }

    /// The connection to `node`, opened now if it is not yet; None when it could not be.
    pub(crate) async fn get(&mut self, node: u32) -> Option<&mut Peer> {
        if !self.open.contains_key(&node) {
            let p = match self.view.node(NodeId(node)) {
                Some(n) => Peer::connect(&n.tcp, self.creds, self.me, self.timeout)
                    .await
                    .ok(),
                None => None,
            };
            self.open.insert(node, p);
        }
        self.open.get_mut(&node).and_then(Option::as_mut)
    }
}

/// Copies of one namespace's pinned objects to their owners.
struct Copy<'a> {
    pool: &'a Pool,
    bulk: &'a Bulk,
    ns: u32,
    keys: &'a [Vec<u8>],
    started: Instant,
    /// Stamp of the view the pass plans by.
    view: u64,
}

impl Copy<'_> {
    /// Asks owner `p` which of the keys at `chunk` it lacks and sends those, counting each key
    /// the owner holds afterwards in `confirmed` and each it could not be given in `failed`.
    async fn to(
        &self,
        p: &mut Peer,
        chunk: &[usize],
        (confirmed, failed, exact): (&mut [usize], &mut [bool], &mut [Exact]),
        out: &mut MovePass,
    ) {
        let lookup = Op::Lookup {
            ns: self.ns,
            keys: chunk.iter().map(|&i| self.keys[i].clone()).collect(),
            lease_ms: 0,
        };
        // Routed by the pass's view: an owner whose view differs answers `WrongView` (a copy
        // sent now could be dated by a view in which it is no owner, and dropped as not
        // continuous at its first routed read: the next pass tries again), and a copy the
        // owner may not serve as the owner's is not counted as there.
        let present: Vec<Option<LocatedWire>> = match p.call_in_view(self.view, lookup, &[]).await {
            Ok(Reply::Located(l)) if l.len() == chunk.len() => l,
            _ => {
                chunk.iter().for_each(|&i| failed[i] = true);
                return;
            }
        };
        for (&i, have) in chunk.iter().zip(present) {
            let now = self.started.elapsed().as_millis() as u64;
            let obj = self.pool.get_ref(self.ns, &self.keys[i], now).ok();
            if let Some(have) = have {
                confirmed[i] += 1;
                let same = obj.as_ref().filter(|o| o.checksum() == have.checksum);
                exact[i].saw(same.map(|o| o.generation()));
                continue;
            }
            let Some(obj) = obj else {
                continue; // removed meanwhile
            };
            let sent = send_copy(self.bulk, p, 0, (self.ns, &self.keys[i], true), &obj).await;
            match sent {
                Ok(Reply::Done) => {
                    confirmed[i] += 1;
                    exact[i].saw(Some(obj.generation()));
                    out.copied += 1;
                }
                Ok(_) | Err(_) => failed[i] = true,
            }
        }
    }
}

/// Sends `obj` to peer `p` as its copy of `key` (`Put`, stamped with `view`, 0 for none), in
/// its turn among this node's bulk transfers at background priority.
pub(crate) async fn send_copy(
    bulk: &Bulk,
    p: &mut Peer,
    view: u64,
    (ns, key, pin): (u32, &[u8], bool),
    obj: &kvpool::pool::ObjectRef<'_>,
) -> Result<Reply, PeerError> {
    let put = Op::Put {
        ns,
        key: key.to_vec(),
        checksum: obj.checksum(),
        pin,
    };
    let len = obj.bytes().len() as u64;
    let mut turn = bulk.admit(CLUSTER_NS, Priority::Background, len, None).ok();
    let payload = [obj.bytes()];
    let call = p.call_in_view(view, put, &payload);
    match turn.as_mut() {
        Some(t) => {
            let grant = t.chunk(len).await;
            crate::bulk::under(grant, bulk.hold(), call).await
        }
        None => call.await,
    }
}

/// What the mover needs.
pub(crate) struct Mover {
    pub(crate) pool: Arc<Pool>,
    /// This node's bulk scheduler: moves take their turns in it.
    pub(crate) bulk: Arc<Bulk>,
    pub(crate) m: Arc<Membership>,
    pub(crate) repl: Replication,
    pub(crate) creds: PeerAuth,
    pub(crate) timing: Timing,
    pub(crate) started: Instant,
    /// Longest a drain waits for pinned objects to find a new home (and unpinned ones are
    /// handed over).
    pub(crate) drain_timeout: Duration,
    /// Unpinned objects handed to their new owners on a change (`[cluster] handover`), and
    /// what a pass may send; None: off.
    pub(crate) handover: Option<Budget>,
    /// Where the handover's counts go.
    pub(crate) metrics: Arc<Metrics>,
}

impl Mover {
    /// One pass of [`move_pass`] with this node's settings.
    async fn pass(&self) -> MovePass {
        let timeout = self.timing.heartbeat * 4;
        move_pass(
            &self.pool,
            &self.m,
            &self.repl,
            (&self.creds, &self.bulk),
            timeout,
            self.started,
        )
        .await
    }

    /// One handover pass (unpinned objects), stopping at `until`; nothing when off.
    async fn hand_over(&self, until: Option<Instant>) -> HandoverPass {
        let Some(budget) = &self.handover else {
            return HandoverPass::default();
        };
        let out = handover_pass(
            &self.pool,
            &self.m,
            (&self.creds, &self.bulk),
            (budget, self.timing.heartbeat * 4, until),
            self.started,
        )
        .await;
        self.metrics.handover_pass(&out);
        if !out.is_empty() {
            tracing::info!(
                handed = out.handed,
                bytes = out.bytes,
                dropped = out.dropped,
                kept = out.kept,
                "handed unpinned objects to their new owners"
            );
        }
        out
    }
}

/// Runs the mover: a pass after every view change (and every few seconds while objects are
/// stranded or short of copies), and the drain when asked for. Returns when `stop` fires or the node has left.
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
                short = pass.short,
                "moved pinned objects"
            );
        }
        let handed = mv.hand_over(None).await;
        // Until every pinned object here is where it belongs (and every unpinned one that can
        // be handed over is), a pass every few seconds.
        pending = pass.stranded > 0 || pass.short > 0 || handed.kept > 0;
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
    // Then the unpinned objects, hottest first, until the deadline: what is left is lost.
    loop {
        let handed = mv.hand_over(Some(deadline)).await;
        if handed.kept == 0 || Instant::now() >= deadline {
            if handed.kept > 0 {
                tracing::warn!(
                    kept = handed.kept,
                    "drain timeout: leaving with unpinned objects not handed over"
                );
            }
            break;
        }
        tokio::time::sleep(mv.timing.heartbeat).await;
    }
    mv.m.set_state(NodeState::Down);
    announce(&mv.m, &mv.creds, mv.timing.heartbeat * 4).await;
    tracing::info!("drained: leaving the cluster");
    mv.m.left.send_replace(true);
}
