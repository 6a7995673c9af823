//! Membership without I/O: one node's view of the cluster and every rule that changes it. The
//! daemon carries the messages (gossip, etcd watches, heartbeats) and the clock readings in, and
//! acts on what comes out; nothing here touches a socket or reads a clock.
//!
//! - **Records and merges** are [`ClusterView`]'s ([`crate::placement`]): a node's record has an
//!   epoch only that node raises; a higher epoch wins, and at equal epochs `Down` wins. Merging
//!   is commutative, associative and idempotent, so gossip in any order converges.
//! - **Refuting**: a node that finds a record of itself at least as new as its own but different
//!   (marked down, or left by an earlier run) raises its epoch above it. A node told it was
//!   marked down is also *fenced*: what the others did meanwhile is unknown to it, so the objects
//!   it holds are no longer served as an owner's copy ([`History::fence`]).
//! - **Liveness** (static membership): a peer address not heard from for `down_after` has its
//!   node marked down, unless another peer said it heard that node directly within
//!   `down_after` ([`Membership::relayed`]): a link that only this node lost (a partial or
//!   asymmetric partition) then does not mark a live node down, which would fence it and make
//!   the view flap as it refutes. Only direct hearings are relayed, never relayed ones, so a
//!   dead node stops being vouched for `down_after` after its last answer, as before. A node
//!   starts `joining`, and turns `serving` two heartbeats after its first
//!   [`Membership::tick`] (the heartbeats' start), having pulled its peers' views.
//! - **etcd** ([`Source::Etcd`]): the view is replaced wholesale by the one derived from etcd's
//!   records and leases ([`EtcdRecords`]); versions are etcd revisions, kept moving forward by
//!   changes made here before etcd has them; gossip from other nodes is answered, not merged.
//!   This node's own record is kept as it last set it, except while etcd holds no lease of it:
//!   the others have it down then, and so does its own view ([`Membership::lapse`]) until it
//!   registers again ([`Membership::reinstated`]). Else a node whose lease etcd revoked or let
//!   expire would go on serving its keys by a view only it holds while the others' owners take
//!   writes of them.
//! - **History**: every adopted view is recorded with the pool's generation mark, which says
//!   which objects this node may still serve as their owner ([`crate::placement::history`]).

mod etcd;
mod liveness;

use std::collections::HashMap;

use crate::addr::NodeId;
use crate::placement::history::History;
use crate::placement::{ClusterView, NodeInfo, NodeState};
use crate::pool::Millis;
use liveness::Watched;

pub use etcd::EtcdRecords;

/// Where the view comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Heartbeats between the nodes, carrying their views.
    Gossip,
    /// etcd: the view is replaced wholesale by the one derived from etcd, and gossip from other
    /// nodes is ignored.
    Etcd,
}

/// Heartbeat timing, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Between two heartbeats to a peer.
    pub heartbeat: Millis,
    /// A peer silent this long is marked down.
    pub down_after: Millis,
    /// A peer restarting in place is marked down this long after it was first seen
    /// restarting, unless it came back (see [`Membership::resuming`]).
    pub restart_window: Millis,
}

/// What a step did to the view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Step {
    /// The view changed (a new stamp to route by; wake whoever waits on changes).
    pub changed: bool,
    /// This node learnt it was marked down: every object held so far became suspect.
    pub fenced: bool,
    /// A restart in place was decided: `Ok` resumed (the objects kept are served again),
    /// `Err` with why not (they are suspect, and the node joins afresh).
    pub resumed: Option<Result<(), &'static str>>,
}

/// The restart in place a node is resuming from (see [`Membership::resuming`]).
#[derive(Clone, Debug)]
struct Resume {
    /// The previous process's last view, its own record restarting.
    departed: ClusterView,
    /// This process's own record (addresses, capacity), which replaces the departed one at
    /// the decision.
    fresh: NodeInfo,
    /// On the clock of [`Membership::tick`]: from here on, too late to resume.
    until: Millis,
}

/// One node's membership state.
#[derive(Debug)]
pub struct Membership {
    me: u32,
    source: Source,
    view: ClusterView,
    history: History,
    /// The first tick (the heartbeats' start): joining lasts two heartbeats from here.
    first_tick: Option<Millis>,
    /// Per peer address, when it last answered (or when watching it began), and which node the
    /// view places there since when.
    heard: HashMap<String, Watched>,
    /// Per node, the latest time another peer said it heard that node directly.
    relayed: HashMap<u32, Millis>,
    /// Set while this node resumes a restart in place.
    resume: Option<Resume>,
    /// With etcd, while etcd holds no lease of this node: its own record as it set it (its
    /// view has it down meanwhile, as the others' do).
    lapsed: Option<NodeInfo>,
}

impl Membership {
    /// A node whose own record is `me`, alone in its view.
    pub fn new(me: NodeInfo, source: Source) -> Membership {
        let id = me.id;
        let view = ClusterView::from_nodes(vec![me]);
        let mut history = History::new(NodeId(id));
        history.adopt(&view, 0);
        Membership {
            me: id,
            source,
            view,
            history,
            first_tick: None,
            heard: HashMap::new(),
            relayed: HashMap::new(),
            resume: None,
            lapsed: None,
        }
    }

    /// A node resuming a restart in place: `departed` is its previous process's last view,
    /// holding this node's own record as that process left it (restarting); `me` is this
    /// process's record (its addresses and capacity, taken at the decision), and `until` is
    /// when, on the clock of [`Membership::tick`], its restart window ends (less a margin for
    /// the others' clocks). The objects this process recovered are dated in that view, in
    /// which this node owns its keys; they are served again once the node finds that nothing
    /// can have moved its keys while it was away ([`Membership::tick`] with static
    /// membership, [`Membership::resume`] with etcd). Otherwise they are fenced, and the node
    /// joins afresh. None when `departed` holds no restarting record of `me`.
    pub fn resuming(
        departed: ClusterView,
        me: NodeInfo,
        source: Source,
        until: Millis,
    ) -> Option<Membership> {
        let mine = departed.node(NodeId(me.id))?;
        if mine.state != NodeState::Restarting {
            return None;
        }
        let mut history = History::new(NodeId(me.id));
        history.adopt(&departed, 0);
        Some(Membership {
            me: me.id,
            source,
            view: departed.clone(),
            history,
            first_tick: None,
            heard: HashMap::new(),
            relayed: HashMap::new(),
            resume: Some(Resume {
                departed,
                fresh: me,
                until,
            }),
            lapsed: None,
        })
    }

    /// True while this node resumes a restart in place (undecided yet).
    pub fn is_resuming(&self) -> bool {
        self.resume.is_some()
    }

    /// Decides a restart in place at `now`, with `theirs`, the others' record of this node
    /// (with etcd: the one etcd holds; with gossip, what merges brought is judged as it
    /// arrives): resumed when the restart window is still open, the others still hold this
    /// node's record as restarting at the epoch it left with, and every other record is the
    /// one it left with or was only marked down since (a node that disappears from a
    /// rendezvous ranking never moves keys between the others). Anything else (a node that
    /// joined, came back, or changed its capacity) may have taken some of this node's keys
    /// and acknowledged writes of them while it was away. Resuming turns it serving; not
    /// resuming fences every object held so far and turns it joining.
    pub fn resume(&mut self, now: Millis, theirs: Option<&NodeInfo>, mark: u64) -> Step {
        let Some(r) = self.resume.take() else {
            return Step::default();
        };
        let mine = r.departed.node(NodeId(self.me));
        let verdict = if now >= r.until {
            Err("its restart window passed")
        } else if theirs.is_some_and(|t| Some(t) != mine) {
            Err("the others no longer hold it as restarting")
        } else {
            unchanged_while_away(&r.departed, &self.view, self.me)
        };
        let state = match verdict {
            Ok(()) => NodeState::Serving,
            Err(_) => {
                self.fence(mark);
                NodeState::Joining
            }
        };
        let me = self.me;
        let changed = self.apply(false, mark, |v| {
            let Some(epoch) = v.node(NodeId(me)).map(|n| n.epoch) else {
                return false;
            };
            v.offer(&NodeInfo {
                state,
                epoch: epoch + 1,
                ..r.fresh
            })
        });
        let mut step = Step {
            changed,
            fenced: verdict.is_err(),
            resumed: None,
        };
        step.resumed = Some(verdict);
        step
    }

    /// Gives up resuming (told this node was marked down meanwhile; it is fenced already):
    /// joins afresh.
    fn abandon_resume(&mut self, mark: u64, why: &'static str) -> Step {
        let Some(r) = self.resume.take() else {
            return Step::default();
        };
        let me = self.me;
        let changed = self.apply(false, mark, |v| {
            let Some(epoch) = v.node(NodeId(me)).map(|n| n.epoch) else {
                return false;
            };
            v.offer(&NodeInfo {
                state: NodeState::Joining,
                epoch: epoch + 1,
                ..r.fresh
            })
        });
        Step {
            changed,
            fenced: true,
            resumed: Some(Err(why)),
        }
    }

    /// This node's id.
    pub fn me(&self) -> u32 {
        self.me
    }

    /// Where the view comes from.
    pub fn source(&self) -> Source {
        self.source
    }

    /// The current view.
    pub fn view(&self) -> &ClusterView {
        &self.view
    }

    /// This node's own record, as it last set it.
    pub fn my_record(&self) -> Option<&NodeInfo> {
        self.view.node(NodeId(self.me))
    }

    /// This node's own state (`Down` once it has no record).
    pub fn my_state(&self) -> NodeState {
        self.my_record().map_or(NodeState::Down, |n| n.state)
    }

    /// True when some other node is serving: leaving then means draining first.
    pub fn has_serving_peers(&self) -> bool {
        self.view
            .nodes
            .iter()
            .any(|n| n.id != self.me && n.state == NodeState::Serving)
    }

    /// True when this node's object of `key`, allocated at `generation`, may be served by a
    /// routed read: this node was among its first `replicas` owners in every view since.
    pub fn continuous(&self, key: &[u8], generation: u64, replicas: usize) -> bool {
        self.history.continuous(key, generation, replicas)
    }

    /// How many views this node has adopted (see [`History::adopted`]).
    pub fn adopted(&self) -> u64 {
        self.history.adopted()
    }

    /// The nodes that may hold a pinned object of `key` that this node, an owner now, lacks
    /// because it took the key over in a view adopted at or after `since` (see
    /// [`History::holders`]).
    pub fn holders(&self, key: &[u8], replicas: usize, since: u64) -> Vec<NodeId> {
        self.history.holders(key, replicas, since)
    }

    /// The node that took `key` over directly from this node, when this node's object of it
    /// allocated at `generation` was the owner's copy up to then (see
    /// [`crate::placement::history::History::handed_to`]).
    pub fn handed_to(&self, key: &[u8], generation: u64) -> Option<crate::NodeId> {
        self.history.handed_to(key, generation)
    }

    /// Merges a peer's view (gossip), refuting any record of this node in it that is at least
    /// as new as its own and differs. `mark`: the pool's generation mark now. With etcd
    /// membership, gossip is answered, not merged.
    pub fn merge(&mut self, other: &ClusterView, mark: u64) -> Step {
        if self.source == Source::Etcd {
            return Step::default();
        }
        let fenced = self.fence_if_down(other, mark);
        let me = self.me;
        let changed = self.apply(false, mark, |v| {
            let mut changed = v.merge(other, me);
            if let Some(theirs) = other.node(NodeId(me)) {
                changed |= refute(v, me, theirs);
            }
            changed
        });
        let mut step = Step {
            changed,
            fenced,
            resumed: None,
        };
        if fenced {
            let a = self.abandon_resume(mark, "it was marked down while away");
            step.changed |= a.changed;
            step.resumed = a.resumed;
        }
        step
    }

    /// Replaces the view with one derived elsewhere (etcd), keeping this node's own record as
    /// this node last set it: its changes reach the others by being published. Except when
    /// `view` has this node down while it is not (etcd holds no lease of it): then this node
    /// [lapses](Membership::lapse) to that record.
    pub fn replace(&mut self, view: ClusterView, mark: u64) -> Step {
        let fenced = self.fence_if_down(&view, mark);
        let me = self.me;
        let theirs = view.node(NodeId(me)).cloned();
        match &theirs {
            Some(t) if t.state == NodeState::Down => self.note_lapse(t),
            // Registered again: the record etcd shows is the one this node put there, and is
            // taken like a lapsed one.
            Some(t) if self.lapsed.as_ref().is_some_and(|l| t.epoch > l.epoch) => {
                self.lapsed = None;
                return self.take(view, theirs, true, fenced, mark);
            }
            _ => {}
        }
        let lapsed = self.lapsed.is_some();
        self.take(view, theirs, lapsed, fenced, mark)
    }

    /// [`Membership::replace`]'s install of `view`, whose record of this node is `theirs`:
    /// with `as_shown`, that record is this node's in its view (lapsed, or just registered
    /// again); else this node's own record stays as it set it.
    fn take(
        &mut self,
        mut view: ClusterView,
        theirs: Option<NodeInfo>,
        as_shown: bool,
        fenced: bool,
        mark: u64,
    ) -> Step {
        let me = self.me;
        let changed = self.apply(true, mark, |v| {
            view.nodes.retain(|n| n.id != me);
            let mine = match (as_shown, theirs) {
                (true, Some(t)) => Some(t),
                _ => v.node(NodeId(me)).cloned(),
            };
            if let Some(mine) = mine {
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
        Step {
            changed,
            fenced,
            resumed: None,
        }
    }

    /// With etcd: etcd holds no lease of this node any more (it was revoked, or expired), so
    /// the others have it down, `shown` being their record of it (state down). Its own view
    /// takes that record too, so that it routes, and takes requests, by the view the others
    /// hold: it owns no key until it registers again ([`Membership::reinstated`]). Its own
    /// record is kept aside meanwhile. The caller fences it (what the others did meanwhile is
    /// unknown to it).
    pub fn lapse(&mut self, shown: &NodeInfo, mark: u64) -> Step {
        if self.source != Source::Etcd || shown.id != self.me {
            return Step::default();
        }
        let shown = NodeInfo {
            state: NodeState::Down,
            ..shown.clone()
        };
        self.note_lapse(&shown);
        let changed = self.lapsed.is_some() && self.apply(false, mark, |v| put_record(v, shown));
        Step {
            changed,
            ..Step::default()
        }
    }

    /// Sets aside this node's own record, once, when `shown` (a record of it) has it down and
    /// it did not put itself down (shutting down).
    fn note_lapse(&mut self, shown: &NodeInfo) {
        if self.source != Source::Etcd || self.lapsed.is_some() || shown.state != NodeState::Down {
            return;
        }
        if let Some(mine) = self.my_record().filter(|m| m.state != NodeState::Down) {
            self.lapsed = Some(mine.clone());
        }
    }

    /// True while etcd holds no lease of this node ([`Membership::lapse`]).
    pub fn lapsed(&self) -> bool {
        self.lapsed.is_some()
    }

    /// The record this node registers again with after a [lapse](Membership::lapse): its own
    /// record as it set it, at an epoch above any it had. Its view takes it when etcd shows it
    /// ([`Membership::replace`]), as the others' views do, not before: a node that served its
    /// keys again before the others see it back would take writes of them that the others'
    /// owners also take.
    pub fn reinstated(&self) -> Option<NodeInfo> {
        let saved = self.lapsed.as_ref()?;
        let now = self.my_record().map_or(0, |n| n.epoch);
        Some(NodeInfo {
            epoch: now.max(saved.epoch) + 1,
            ..saved.clone()
        })
    }

    /// Raises this node's epoch above `theirs`, a record of this node found elsewhere (left by
    /// an earlier run), when that is at least as new as this node's own and differs.
    pub fn outrank(&mut self, theirs: &NodeInfo, mark: u64) -> Step {
        let me = self.me;
        let changed = self.apply(false, mark, |v| refute(v, me, theirs));
        Step {
            changed,
            ..Step::default()
        }
    }

    /// Changes this node's own state, raising its epoch. While [lapsed](Membership::lapse),
    /// the record set aside changes, and is published when the node registers again.
    pub fn set_state(&mut self, state: NodeState, mark: u64) -> Step {
        if let Some(saved) = self.lapsed.as_mut() {
            if saved.state != state {
                saved.state = state;
                saved.epoch += 1;
            }
            return Step::default();
        }
        let me = self.me;
        let changed = self.apply(false, mark, |v| {
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
        Step {
            changed,
            ..Step::default()
        }
    }

    /// Marks a peer down (it stopped answering). This node never marks itself down.
    pub fn mark_down(&mut self, id: u32, mark: u64) -> Step {
        let changed = id != self.me && self.apply(false, mark, |v| v.mark_down(id));
        Step {
            changed,
            ..Step::default()
        }
    }

    /// The fence for being told this node is down: every object held so far becomes suspect.
    pub fn fence(&mut self, mark: u64) {
        self.history.fence(mark);
    }

    /// Applies `f` to the view; `from_etcd`: `f` installs a view derived from etcd, at its
    /// revision. A change is recorded in the history at `mark`. True when the view changed.
    fn apply(
        &mut self,
        from_etcd: bool,
        mark: u64,
        f: impl FnOnce(&mut ClusterView) -> bool,
    ) -> bool {
        let before = self.view.version;
        if !f(&mut self.view) {
            return false;
        }
        if self.source == Source::Etcd {
            // Versions are etcd revisions; a change made here before etcd has it, or a wiped
            // etcd starting its revisions again, still moves the version forward.
            self.view.version = if from_etcd {
                self.view.version.max(before + 1)
            } else {
                before + 1
            };
        }
        self.history.adopt(&self.view, mark);
        true
    }

    /// Fences this node when `other` holds a record of it marked down. True when it did.
    fn fence_if_down(&mut self, other: &ClusterView, mark: u64) -> bool {
        let down = other
            .node(NodeId(self.me))
            .is_some_and(|n| n.state == NodeState::Down);
        if down {
            self.fence(mark);
        }
        down
    }
}

/// Whether every record of `now` but node `me`'s is the one `departed` holds, or that record
/// only marked down since (same epoch): then nothing that took keys over can have happened in
/// between (see [`Membership::resume`]).
fn unchanged_while_away(
    departed: &ClusterView,
    now: &ClusterView,
    me: u32,
) -> Result<(), &'static str> {
    let ids = departed.nodes.iter().chain(now.nodes.iter()).map(|n| n.id);
    for id in ids.filter(|&id| id != me) {
        let (d, c) = (departed.node(NodeId(id)), now.node(NodeId(id)));
        let kept = match (d, c) {
            (Some(d), Some(c)) => {
                (d.epoch, d.state, d.capacity) == (c.epoch, c.state, c.capacity)
                    || (d.epoch == c.epoch && c.state == NodeState::Down)
            }
            (None, None) => true,
            _ => false,
        };
        if !kept {
            return Err("the cluster changed while it was away");
        }
    }
    Ok(())
}

/// Raises node `me`'s epoch above `theirs` when that record of it is at least as new as its own
/// and differs (marked down, or from an earlier run). True when the view changed.
/// Puts `rec` in place of its node's record, whatever the epochs (only this node's own record,
/// which it alone writes). True when that changed the view.
fn put_record(v: &mut ClusterView, rec: NodeInfo) -> bool {
    match v.nodes.binary_search_by_key(&rec.id, |n| n.id) {
        Ok(i) if v.nodes[i] == rec => false,
        Ok(i) => {
            v.nodes[i] = rec;
            true
        }
        Err(i) => {
            v.nodes.insert(i, rec);
            true
        }
    }
}

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

#[cfg(test)]
mod tests;
