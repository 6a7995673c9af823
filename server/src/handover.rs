//! Handover: when the cluster changes, this node hands the unpinned objects (KV blocks) it no
//! longer owns to the node that took each key over, the hottest ones within the budget, so a
//! drain or a join does not cost the cache its share of the keys (see docs/RELIABILITY.md,
//! "Elastic").
//!
//! A pass lists the unpinned objects of every namespace with one copy per key (`replicas =
//! 1`) whose key another node owns now, keeps those that
//! [`kvpool::placement::history::History::handed_to`] says went straight from this node to
//! that owner (the object was the owner's copy up to the handover, and no third node can have
//! owned the key in between), asks each new owner which of them it lacks (`Lookup`, routed by
//! the pass's view), and sends those (`Put`, routed too, at background priority in this node's
//! bulk scheduler). The receiver commits such a copy only while the key is absent there and it
//! has acknowledged no write or remove of it (`Superseded` otherwise, see
//! `handler::data`), so an older copy never replaces a newer value. This node drops its copy
//! once the owner holds the key (the exact generation sent, or a value of its own), and keeps
//! it when the owner could not be reached, for the next pass. Pinned objects are the mover's
//! ([`crate::mover::move_pass`]).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvpool::pool::Unpinned;
use kvpool::protocol::{ErrorCode, LocatedWire, Op, Reply};
use kvpool::{NodeId, Pool};

use crate::bulk::Bulk;
use crate::cluster::Cluster;
use crate::peer::{Peer, PeerAuth, PeerError};
use crate::peers::send_copy;

/// What handover passes may do (`[cluster] handover`).
#[derive(Clone, Debug)]
pub(crate) struct Budget {
    /// Per namespace id: copies of each unpinned object (only namespaces with one take part).
    pub(crate) replicas: Vec<u32>,
    /// Most bytes one pass sends (0: no limit).
    pub(crate) max_bytes: u64,
}

/// Outcome of one handover pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct HandoverPass {
    /// Objects sent to their new owner, which took them.
    pub(crate) handed: usize,
    /// Their bytes.
    pub(crate) bytes: u64,
    /// Objects dropped here because the new owner already held the key (or refused the copy:
    /// it has a newer value or a newer remove).
    pub(crate) dropped: usize,
    /// Objects kept here: the owner was unreachable, full or slow, or the pass ran out of time
    /// or budget. The next pass tries again.
    pub(crate) kept: usize,
}

impl HandoverPass {
    /// True when nothing was done or left.
    pub(crate) fn is_empty(&self) -> bool {
        *self == HandoverPass::default()
    }
}

/// Most keys per `Lookup` a pass sends.
const BATCH: usize = 512;

/// One handover pass (see the module docs): each call to a new owner bounded by `timeout`,
/// nothing sent after `until` (a drain's deadline). `started` is the daemon's clock origin.
pub(crate) async fn handover_pass(
    pool: &Pool,
    m: &Cluster,
    (creds, bulk): (&PeerAuth, &Bulk),
    (budget, timeout, until): (&Budget, Duration, Option<Instant>),
    started: Instant,
) -> HandoverPass {
    let view = m.view();
    let me = NodeId(m.me());
    let mut out = HandoverPass::default();
    let mut left = match budget.max_bytes {
        0 => u64::MAX,
        b => b,
    };
    let mut peers: HashMap<NodeId, Option<Peer>> = HashMap::new();
    for (ns, &r) in budget.replicas.iter().enumerate() {
        let ns = ns as u32;
        if r != 1 {
            continue;
        }
        let Ok(objects) = pool.unpinned_objects(ns, |k| view.owner(k) != Some(me)) else {
            continue;
        };
        // Per new owner, hottest first, within the byte budget.
        let mut by_owner: HashMap<NodeId, Vec<Unpinned>> = HashMap::new();
        for o in objects {
            let Some(to) = m.handed_to(&o.key, o.generation) else {
                continue;
            };
            if o.len > left {
                out.kept += 1;
                continue;
            }
            left -= o.len;
            by_owner.entry(to).or_default().push(o);
        }
        for (to, mut objects) in by_owner {
            if let Entry::Vacant(e) = peers.entry(to) {
                let p = match view.node(to) {
                    Some(n) => Peer::connect(&n.tcp, creds, me.0, timeout).await.ok(),
                    None => None,
                };
                e.insert(p);
            }
            let Some(p) = peers.get_mut(&to).and_then(Option::as_mut) else {
                out.kept += objects.len();
                continue;
            };
            let send = Send {
                pool,
                m,
                bulk,
                ns,
                stamp: view.stamp(),
                started,
                until,
            };
            // Chosen hottest first, sent coldest first: the owner files each copy as its most
            // recent object, so the hottest, sent last, is the last its LRU end reaches (after
            // a join this kept 1 and 4.3 points more hits in minutes 2 and 3, RELIABILITY.md).
            // A drain (`until`) sends hottest first: running out of time then costs the
            // coldest, and its order made no measurable difference to the hit rate.
            if until.is_none() {
                objects.reverse();
            }
            let mut chunks = objects.chunks(BATCH);
            for chunk in chunks.by_ref() {
                if send.chunk(p, chunk, &mut out).await.is_err() {
                    // The connection broke: what is left waits for the next pass.
                    peers.insert(to, None);
                    break;
                }
            }
            out.kept += chunks.map(<[Unpinned]>::len).sum::<usize>();
        }
    }
    out
}

/// Sends one namespace's objects to one new owner.
struct Send<'a> {
    pool: &'a Pool,
    m: &'a Cluster,
    bulk: &'a Bulk,
    ns: u32,
    /// The stamp of the pass's view: every call is routed by it.
    stamp: u64,
    started: Instant,
    until: Option<Instant>,
}

impl Send<'_> {
    async fn chunk(
        &self,
        p: &mut Peer,
        chunk: &[Unpinned],
        out: &mut HandoverPass,
    ) -> Result<(), PeerError> {
        if self.until.is_some_and(|t| Instant::now() >= t) {
            out.kept += chunk.len();
            return Ok(());
        }
        let lookup = Op::Lookup {
            ns: self.ns,
            keys: chunk.iter().map(|o| o.key.clone()).collect(),
            lease_ms: 0,
        };
        let present: Vec<Option<LocatedWire>> = match p.call_in_view(self.stamp, lookup, &[]).await
        {
            Ok(Reply::Located(l)) if l.len() == chunk.len() => l,
            Ok(_) | Err(PeerError::Server { .. }) => {
                // Another view there, or an error: nothing is sent by a view it does not hold.
                out.kept += chunk.len();
                return Ok(());
            }
            Err(e) => {
                out.kept += chunk.len();
                return Err(e);
            }
        };
        for (i, (o, have)) in chunk.iter().zip(present).enumerate() {
            if have.is_some() {
                self.drop_here(o, false);
                out.dropped += 1;
                continue;
            }
            if self.until.is_some_and(|t| Instant::now() >= t) {
                out.kept += 1;
                continue;
            }
            let sent = match self.put(p, o).await {
                Ok(s) => s,
                Err(e) => {
                    out.kept += chunk.len() - i;
                    return Err(e);
                }
            };
            match sent {
                Sent::Taken => {
                    self.drop_here(o, true);
                    out.handed += 1;
                    out.bytes += o.len;
                }
                Sent::Refused => {
                    self.drop_here(o, false);
                    out.dropped += 1;
                }
                Sent::Gone => {}
                Sent::NotNow => out.kept += 1,
            }
        }
        Ok(())
    }

    /// Sends `o`'s bytes, if it is still the object listed, at background priority.
    async fn put(&self, p: &mut Peer, o: &Unpinned) -> Result<Sent, PeerError> {
        let now = self.started.elapsed().as_millis() as u64;
        let Ok(obj) = self.pool.get_ref(self.ns, &o.key, now) else {
            return Ok(Sent::Gone); // evicted or removed meanwhile
        };
        if obj.generation() != o.generation {
            return Ok(Sent::Gone); // rewritten here: not this pass's to judge
        }
        let reply = send_copy(self.bulk, p, self.stamp, (self.ns, &o.key, false), &obj).await;
        Ok(match reply {
            Ok(Reply::Done) => Sent::Taken,
            Err(PeerError::Server {
                code: ErrorCode::Superseded,
                ..
            }) => Sent::Refused,
            Err(PeerError::Server { .. }) | Ok(_) => Sent::NotNow,
            Err(e) => return Err(e),
        })
    }

    /// Drops this node's copy of `o` (only that generation: a newer write here stays). With
    /// `exact`, the owner holds exactly that write, so this node need not remember having
    /// taken it (see [`crate::written`]).
    fn drop_here(&self, o: &Unpinned, exact: bool) {
        if self
            .pool
            .remove_generation(self.ns, &o.key, o.generation)
            .unwrap_or(false)
            && exact
        {
            self.m.forget_write(self.ns, &o.key);
        }
    }
}

/// What became of one copy sent.
enum Sent {
    /// The owner committed it.
    Taken,
    /// The owner holds the key or a newer write or remove of it.
    Refused,
    /// This node's object changed or went away before it was sent.
    Gone,
    /// The owner could not take it now (full, another view, a transient error).
    NotNow,
}
