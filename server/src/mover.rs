//! The mover: after every view change, pinned objects (model weights) are copied to the
//! serving nodes that own them and dropped here once every owner holds them; unpinned ones are
//! handed over (`handover`); a drain moves everything it can off before the node leaves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::placement::routing::{self, Outcome};
use kvpool::placement::{ClusterView, NodeState};
use kvpool::protocol::{LocatedWire, Op, Reply};
use kvpool::{NodeId, Pool};
use tokio::sync::watch;

use crate::bulk::Bulk;
use crate::cluster::{announce, Cluster, Timing};
use crate::handover::{handover_pass, Budget, HandoverPass};
use crate::metrics::Metrics;
use crate::peer::{Peer, PeerAuth};
use crate::peers::{send_copy, Peers};

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
    m: &Cluster,
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
    m: &Cluster,
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
    m: &'a Cluster,
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

/// What the mover needs.
pub(crate) struct Mover {
    pub(crate) pool: Arc<Pool>,
    /// This node's bulk scheduler: moves take their turns in it.
    pub(crate) bulk: Arc<Bulk>,
    pub(crate) m: Arc<Cluster>,
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
        self.metrics.handover_pass(
            out.handed as u64,
            out.bytes,
            out.dropped as u64,
            out.kept as u64,
        );
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
pub(crate) async fn run(mv: Mover, mut stop: watch::Receiver<bool>) {
    let mut changed = mv.m.subscribe();
    let mut drain = mv.m.drain_asked();
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
    mv.m.mark_left();
}
