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
//! - **History**: every adopted view is recorded with the pool's generation mark, which says
//!   which objects this node may still serve as their owner ([`crate::placement::history`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::addr::NodeId;
use crate::placement::history::History;
use crate::placement::{ClusterView, NodeInfo, NodeState};
use crate::pool::Millis;
use crate::protocol::Heard;

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
}

/// What a step did to the view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Step {
    /// The view changed (a new stamp to route by; wake whoever waits on changes).
    pub changed: bool,
    /// This node learnt it was marked down: every object held so far became suspect.
    pub fenced: bool,
}

/// The last sign of life of a peer address.
#[derive(Clone, Copy, Debug)]
enum Hearing {
    /// Never answered; watched since then.
    Watched(Millis),
    /// Last answered then: a hearing that heartbeats relay.
    Answered(Millis),
}

impl Hearing {
    fn at(self) -> Millis {
        match self {
            Hearing::Watched(t) | Hearing::Answered(t) => t,
        }
    }
}

/// What this node knows of one watched peer address.
#[derive(Clone, Copy, Debug)]
struct Watched {
    hearing: Hearing,
    /// The node the view places at the address, whether that node's record was up (not down),
    /// and the tick that first saw it so: the node's silence counts only from then. A peer
    /// address watched long before its node started (a static peer that starts later) must not
    /// have its node marked down the moment the node's own gossip brings it into the view, nor
    /// may a restarted node that was down.
    placed: Option<(u32, bool, Millis)>,
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
        Step { changed, fenced }
    }

    /// Replaces the view with one derived elsewhere (etcd), keeping this node's own record as
    /// this node last set it: its changes reach the others by being published.
    pub fn replace(&mut self, mut view: ClusterView, mark: u64) -> Step {
        let fenced = self.fence_if_down(&view, mark);
        let me = self.me;
        let changed = self.apply(true, mark, |v| {
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
        Step { changed, fenced }
    }

    /// Raises this node's epoch above `theirs`, a record of this node found elsewhere (left by
    /// an earlier run), when that is at least as new as this node's own and differs.
    pub fn outrank(&mut self, theirs: &NodeInfo, mark: u64) -> Step {
        let me = self.me;
        let changed = self.apply(false, mark, |v| refute(v, me, theirs));
        Step {
            changed,
            fenced: false,
        }
    }

    /// Changes this node's own state, raising its epoch.
    pub fn set_state(&mut self, state: NodeState, mark: u64) -> Step {
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
            fenced: false,
        }
    }

    /// Marks a peer down (it stopped answering). This node never marks itself down.
    pub fn mark_down(&mut self, id: u32, mark: u64) -> Step {
        let changed = id != self.me && self.apply(false, mark, |v| v.mark_down(id));
        Step {
            changed,
            fenced: false,
        }
    }

    /// The fence for being told this node is down: every object held so far becomes suspect.
    pub fn fence(&mut self, mark: u64) {
        self.history.fence(mark);
    }

    /// The addresses to heartbeat: the configured `peers` and every other node in the view
    /// with an address, never this node's own, each once.
    pub fn heartbeat_targets(&self, peers: &[String]) -> Vec<String> {
        let mine = self.my_record().map(|n| n.tcp.as_str()).unwrap_or("");
        let mut seen = BTreeSet::new();
        peers
            .iter()
            .map(String::as_str)
            .chain(
                self.view
                    .nodes
                    .iter()
                    .filter(|n| n.id != self.me)
                    .map(|n| n.tcp.as_str()),
            )
            .filter(|a| !a.is_empty() && *a != mine)
            .filter(|a| seen.insert(*a))
            .map(str::to_string)
            .collect()
    }

    /// The addresses of the other nodes to tell about a change at once, when leaving: every
    /// node in the view that is not down.
    pub fn announce_targets(&self) -> Vec<String> {
        self.view
            .nodes
            .iter()
            .filter(|n| n.id != self.me && n.state != NodeState::Down && !n.tcp.is_empty())
            .map(|n| n.tcp.clone())
            .collect()
    }

    /// Starts watching the peer at `addr` at `now`: silent from here for `down_after`, it is
    /// marked down.
    pub fn watch(&mut self, addr: &str, now: Millis) {
        self.heard.entry(addr.to_string()).or_insert(Watched {
            hearing: Hearing::Watched(now),
            placed: None,
        });
    }

    /// Stops watching the peer at `addr` (it turned out to be this node under another name).
    pub fn forget(&mut self, addr: &str) {
        self.heard.remove(addr);
    }

    /// The peer at `addr` answered a heartbeat at `now`; its answer was its view, merged here.
    pub fn heard(&mut self, addr: &str, view: &ClusterView, now: Millis, mark: u64) -> Step {
        let answered = Hearing::Answered(now);
        self.heard
            .entry(addr.to_string())
            .and_modify(|w| w.hearing = answered)
            .or_insert(Watched {
                hearing: answered,
                placed: None,
            });
        self.merge(view, mark)
    }

    /// The nodes this node heard from directly within `down_after` before `now`, with how
    /// long ago: what its heartbeats relay to its peers.
    pub fn heard_directly(&self, now: Millis, down_after: Millis) -> Vec<Heard> {
        let mut out: Vec<Heard> = self
            .heard
            .iter()
            .filter_map(|(addr, w)| {
                let Hearing::Answered(at) = w.hearing else {
                    return None;
                };
                let age_ms = now.saturating_sub(at);
                let n = self.view.nodes.iter().find(|n| n.tcp == *addr)?;
                (age_ms < down_after && n.id != self.me).then_some(Heard { node: n.id, age_ms })
            })
            .collect();
        // Two addresses of one node: its latest hearing.
        out.sort_unstable_by_key(|h| (h.node, h.age_ms));
        out.dedup_by_key(|h| h.node);
        out
    }

    /// A peer relayed at `now` the nodes it heard from directly (its
    /// [`Membership::heard_directly`]): none of them is marked down for silence here until
    /// `down_after` after that hearing. Entries about this node, or about a node not in the
    /// view, are ignored (so what is kept is bounded by the view).
    pub fn relayed(&mut self, heard: &[Heard], now: Millis) {
        let known = |id: u32| id != self.me && self.view.node(NodeId(id)).is_some();
        for h in heard.iter().filter(|h| known(h.node)) {
            let at = now.saturating_sub(h.age_ms);
            let e = self.relayed.entry(h.node).or_insert(at);
            *e = (*e).max(at);
        }
    }

    /// Time passes (the heartbeats call this every heartbeat): a joining node that has pulled
    /// its peers' views for two heartbeats since the first tick turns serving; a peer address
    /// silent for `down_after` has its node (as the view knows the address) marked down, unless
    /// a peer relayed a hearing of that node within `down_after`. Silence is counted from the
    /// later of the address's last answer (or the start of watching it) and the first tick
    /// that saw its node in the view, up, at that address.
    pub fn tick(&mut self, now: Millis, timing: Timing, mark: u64) -> Step {
        let mut step = Step::default();
        let first = *self.first_tick.get_or_insert(now);
        if self.my_state() == NodeState::Joining
            && now.saturating_sub(first) >= timing.heartbeat.saturating_mul(2)
        {
            step.changed |= self.set_state(NodeState::Serving, mark).changed;
        }
        let (view, relayed) = (&self.view, &self.relayed);
        let silent: Vec<u32> = self
            .heard
            .iter_mut()
            .filter_map(|(addr, w)| {
                let n = view.nodes.iter().find(|n| n.tcp == *addr)?;
                let up = n.state != NodeState::Down;
                let since = match w.placed {
                    Some((id, was_up, since)) if id == n.id && was_up == up => since,
                    _ => now,
                };
                let quiet = w.hearing.at().max(since);
                let heard_of = relayed.get(&n.id).copied();
                let down = up
                    && now.saturating_sub(quiet) >= timing.down_after
                    && heard_of.is_none_or(|at| now.saturating_sub(at) >= timing.down_after);
                // Marked down below: seen down from here, so coming back up restarts the count.
                w.placed = Some(if down {
                    (n.id, false, now)
                } else {
                    (n.id, up, since)
                });
                down.then_some(n.id)
            })
            .collect();
        for id in silent {
            step.changed |= self.mark_down(id, mark).changed;
        }
        step
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

/// Raises node `me`'s epoch above `theirs` when that record of it is at least as new as its own
/// and differs (marked down, or from an earlier run). True when the view changed.
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

/// The cluster as etcd holds it: every node's record and which nodes hold a live lease, at
/// the last revision seen. The etcd gateway feeds it key changes; [`EtcdRecords::view`] is
/// what every node derives alike.
#[derive(Clone, Debug, Default)]
pub struct EtcdRecords {
    records: BTreeMap<u32, NodeInfo>,
    alive: BTreeSet<u32>,
    /// The etcd revision of the last change seen.
    pub revision: u64,
}

impl EtcdRecords {
    /// Node `id`'s record changed: `Some` the new one, `None` deleted (or unreadable).
    pub fn set_record(&mut self, id: u32, rec: Option<NodeInfo>) {
        match rec {
            Some(r) if r.id == id => {
                self.records.insert(id, r);
            }
            _ => {
                self.records.remove(&id);
            }
        }
    }

    /// Node `id`'s lease appeared or went.
    pub fn set_alive(&mut self, id: u32, alive: bool) {
        if alive {
            self.alive.insert(id);
        } else {
            self.alive.remove(&id);
        }
    }

    /// The view: every record, down where its node holds no lease, at the revision seen.
    pub fn view(&self) -> ClusterView {
        ClusterView {
            version: self.revision,
            nodes: self
                .records
                .values()
                .map(|n| {
                    let mut n = n.clone();
                    if !self.alive.contains(&n.id) {
                        n.state = NodeState::Down;
                    }
                    n
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    use crate::placement::test_record as rec;

    const TIMING: Timing = Timing {
        heartbeat: 100,
        down_after: 1000,
    };

    #[derive(Clone, Debug)]
    enum Event {
        /// Node i changes its own state.
        SetState(usize, NodeState),
        /// Node i stops hearing from node j and marks it down.
        MarkDown(usize, usize),
        /// Node i heartbeats node j: j merges i's view, i merges j's answer.
        Gossip(usize, usize),
    }

    fn events(n: usize) -> impl Strategy<Value = Vec<Event>> {
        let state = prop_oneof![
            Just(NodeState::Joining),
            Just(NodeState::Serving),
            Just(NodeState::Draining),
        ];
        let ev = prop_oneof![
            (0..n, state).prop_map(|(i, s)| Event::SetState(i, s)),
            (0..n, 0..n).prop_map(|(i, j)| Event::MarkDown(i, j)),
            (0..n, 0..n).prop_map(|(i, j)| Event::Gossip(i, j)),
            (0..n, 0..n).prop_map(|(i, j)| Event::Gossip(i, j)),
        ];
        proptest::collection::vec(ev, 0..40)
    }

    fn gossip(nodes: &mut [Membership], i: usize, j: usize, fenced: &mut [bool]) {
        if i == j {
            return;
        }
        let vi = nodes[i].view().clone();
        fenced[j] |= nodes[j].merge(&vi, 0).fenced;
        let vj = nodes[j].view().clone();
        fenced[i] |= nodes[i].merge(&vj, 0).fenced;
    }

    proptest! {
        /// Whatever happened before, a few rounds of gossip between live nodes leave every node
        /// with the same records; a node marked down refutes it (and was fenced when told); and
        /// every record is the newest any node wrote.
        #[test]
        fn gossip_converges_and_live_nodes_refute_being_down(script in events(4)) {
            let n = 4;
            let mut nodes: Vec<Membership> = (0..n)
                .map(|i| Membership::new(rec(i as u32, NodeState::Serving, 1), Source::Gossip))
                .collect();
            let mut fenced = vec![false; n];
            let mut marked = vec![false; n];
            for ev in script {
                match ev {
                    Event::SetState(i, s) => {
                        let _ = nodes[i].set_state(s, 0);
                    }
                    Event::MarkDown(i, j) => {
                        if i != j && nodes[i].view().node(NodeId(j as u32)).is_some() {
                            marked[j] |= nodes[i].mark_down(j as u32, 0).changed;
                        }
                    }
                    Event::Gossip(i, j) => gossip(&mut nodes, i, j, &mut fenced),
                }
            }
            for _ in 0..3 {
                for i in 0..n {
                    for j in 0..n {
                        gossip(&mut nodes, i, j, &mut fenced);
                    }
                }
            }
            let first = nodes[0].view().clone();
            for m in &nodes {
                prop_assert_eq!(&m.view().nodes, &first.nodes);
                prop_assert_eq!(m.view().stamp(), first.stamp());
            }
            for (i, m) in nodes.iter().enumerate() {
                let mine = m.my_record().unwrap();
                prop_assert!(mine.state != NodeState::Down, "node {} refuted", i);
                prop_assert_eq!(first.node(NodeId(i as u32)), Some(mine), "its own record won");
                if marked[i] {
                    prop_assert!(fenced[i] || mine.epoch > 1, "told it was down, node {} fenced", i);
                }
            }
        }

        /// Merging the others' records is a join: any order, any repetition, the same result.
        #[test]
        fn merges_commute_and_repeat_harmlessly(
            a in proptest::collection::vec((1u32..5, 1u64..4, any::<bool>()), 0..6),
            b in proptest::collection::vec((1u32..5, 1u64..4, any::<bool>()), 0..6),
        ) {
            let mk = |recs: &[(u32, u64, bool)]| {
                let mut v = ClusterView::default();
                for &(id, e, down) in recs {
                    let s = if down { NodeState::Down } else { NodeState::Serving };
                    let _ = v.offer(&NodeInfo { capacity: id as u64, ..rec(id, s, e) });
                }
                v
            };
            let (va, vb) = (mk(&a), mk(&b));
            let me = || Membership::new(rec(0, NodeState::Serving, 1), Source::Gossip);
            let (mut ab, mut ba) = (me(), me());
            let _ = ab.merge(&va, 0);
            let _ = ab.merge(&vb, 0);
            let _ = ba.merge(&vb, 0);
            let _ = ba.merge(&va, 0);
            prop_assert_eq!(&ab.view().nodes, &ba.view().nodes);
            let again = ab.merge(&va, 0);
            prop_assert!(!again.changed, "idempotent");
        }
    }

    #[test]
    fn joining_turns_serving_after_two_heartbeats() {
        let mut m = Membership::new(rec(1, NodeState::Joining, 1), Source::Gossip);
        assert!(!m.tick(1000, TIMING, 0).changed);
        assert!(!m.tick(1199, TIMING, 0).changed);
        assert_eq!(m.my_state(), NodeState::Joining);
        assert!(m.tick(1200, TIMING, 0).changed);
        assert_eq!(m.my_state(), NodeState::Serving);
        assert_eq!(m.my_record().unwrap().epoch, 2);
    }

    #[test]
    fn a_silent_peer_is_marked_down_and_a_heard_one_is_not() {
        let mut m = Membership::new(rec(1, NodeState::Serving, 1), Source::Gossip);
        let peers = ClusterView::from_nodes(vec![
            rec(2, NodeState::Serving, 1),
            rec(3, NodeState::Serving, 1),
        ]);
        assert!(m.merge(&peers, 0).changed);
        assert_eq!(
            m.heartbeat_targets(&["n2".into(), "x".into()]),
            ["n2", "x", "n3"]
        );
        m.watch("n2", 0);
        m.watch("n3", 0);
        // The heartbeats tick from the start: nodes 2 and 3 are in the view, up, since 0.
        assert!(!m.tick(0, TIMING, 0).changed);
        assert!(m.heard("n2", &peers, 900, 0) == Step::default());
        let step = m.tick(1000, TIMING, 0);
        assert!(step.changed);
        let state = |m: &Membership, id| m.view().node(NodeId(id)).unwrap().state;
        assert_eq!(state(&m, 3), NodeState::Down);
        assert_eq!(state(&m, 2), NodeState::Serving);
        assert!(!m.tick(1001, TIMING, 0).changed, "down once");
        assert_eq!(m.announce_targets(), ["n2"]);
    }

    #[test]
    fn a_peer_another_still_hears_is_not_marked_down_until_that_hearing_is_old() {
        // Node 1 lost its link to node 3; node 2 still hears 3 and relays that.
        let mut m = Membership::new(rec(1, NodeState::Serving, 1), Source::Gossip);
        let peers = ClusterView::from_nodes(vec![
            rec(2, NodeState::Serving, 1),
            rec(3, NodeState::Serving, 1),
        ]);
        let _ = m.merge(&peers, 0);
        m.watch("n2", 0);
        m.watch("n3", 0);
        // The heartbeats tick from the start: nodes 2 and 3 are in the view, up, since 0.
        assert!(!m.tick(0, TIMING, 0).changed);
        assert_eq!(
            m.heard_directly(500, 1000),
            [],
            "watched, never heard: nothing to relay"
        );
        let _ = m.heard("n2", &peers, 900, 0);
        assert_eq!(
            m.heard_directly(1000, 1000),
            [Heard {
                node: 2,
                age_ms: 100
            }]
        );
        // Node 2 heard 3 at 800; what it says about node 1 is ignored.
        let relayed = [
            Heard {
                node: 3,
                age_ms: 100,
            },
            Heard { node: 1, age_ms: 0 },
        ];
        m.relayed(&relayed, 900);
        // An older hearing relayed later does not move it back.
        m.relayed(
            &[Heard {
                node: 3,
                age_ms: 900,
            }],
            950,
        );
        let state = |m: &Membership, id| m.view().node(NodeId(id)).unwrap().state;
        assert!(!m.tick(1000, TIMING, 0).changed, "silent here, heard by 2");
        assert!(!m.tick(1799, TIMING, 0).changed);
        assert_eq!(state(&m, 3), NodeState::Serving);
        assert!(
            m.tick(1800, TIMING, 0).changed,
            "no hearing of 3 within down_after"
        );
        assert_eq!(state(&m, 3), NodeState::Down);
        assert_eq!(state(&m, 2), NodeState::Serving);
        assert_eq!(m.heard_directly(1900, 1000), [], "2's answer is old now");
    }

    #[test]
    fn a_node_that_appears_late_at_a_watched_address_gets_its_full_down_after() {
        // Node 1 has watched its static peer "n2" since 0, but node 2 starts at 5 000 and its
        // own gossip brings it into node 1's view before node 1's heartbeat reaches it.
        let mut m = Membership::new(rec(1, NodeState::Serving, 1), Source::Gossip);
        m.watch("n2", 0);
        assert!(!m.tick(0, TIMING, 0).changed);
        assert!(!m.tick(4_900, TIMING, 0).changed, "no node at n2 yet");
        let joined = ClusterView::from_nodes(vec![rec(2, NodeState::Joining, 1)]);
        assert!(m.merge(&joined, 0).changed);
        let state = |m: &Membership| m.view().node(NodeId(2)).unwrap().state;
        assert!(
            !m.tick(5_000, TIMING, 0).changed,
            "silence counts from here"
        );
        assert!(!m.tick(5_999, TIMING, 0).changed);
        assert_eq!(state(&m), NodeState::Joining);
        assert!(
            m.tick(6_000, TIMING, 0).changed,
            "silent for down_after since it appeared"
        );
        assert_eq!(state(&m), NodeState::Down);
        // It restarts and refutes (a higher epoch, up again): a fresh down_after from the tick
        // that sees it up, although its address has been silent all along.
        let back = ClusterView::from_nodes(vec![rec(2, NodeState::Joining, 3)]);
        assert!(m.merge(&back, 0).changed);
        assert_eq!(state(&m), NodeState::Joining);
        assert!(!m.tick(7_000, TIMING, 0).changed);
        assert!(!m.tick(7_999, TIMING, 0).changed);
        assert!(m.tick(8_000, TIMING, 0).changed);
        assert_eq!(state(&m), NodeState::Down);
        // Heard, it stays up.
        let again = ClusterView::from_nodes(vec![rec(2, NodeState::Serving, 5)]);
        let _ = m.merge(&again, 0);
        let _ = m.heard("n2", &again, 9_000, 0);
        assert!(!m.tick(9_000, TIMING, 0).changed);
        assert!(!m.tick(9_999, TIMING, 0).changed);
        assert_eq!(state(&m), NodeState::Serving);
    }

    #[test]
    fn told_it_is_down_a_node_refutes_and_is_fenced() {
        let mut m = Membership::new(rec(1, NodeState::Serving, 3), Source::Gossip);
        let theirs = ClusterView::from_nodes(vec![rec(1, NodeState::Down, 3)]);
        let step = m.merge(&theirs, 50);
        assert!(step.changed && step.fenced);
        let mine = m.my_record().unwrap();
        assert_eq!((mine.state, mine.epoch), (NodeState::Serving, 4));
        // An object allocated before the fence is no longer this node's to serve.
        assert!(!m.continuous(b"k", 10, 1));
        assert!(m.continuous(b"k", 60, 1));
    }

    #[test]
    fn etcd_views_replace_ignore_gossip_and_keep_versions_moving() {
        let mut m = Membership::new(rec(1, NodeState::Serving, 2), Source::Etcd);
        let mut etcd = EtcdRecords::default();
        etcd.set_record(1, Some(rec(1, NodeState::Joining, 1)));
        etcd.set_record(2, Some(rec(2, NodeState::Serving, 1)));
        etcd.set_record(3, Some(rec(4, NodeState::Serving, 1)));
        etcd.set_alive(2, true);
        etcd.revision = 40;
        let v = etcd.view();
        assert_eq!(v.nodes.len(), 2, "a record naming another node is dropped");
        assert!(m.replace(v.clone(), 0).changed);
        assert_eq!(m.view().version, 40);
        assert_eq!(
            m.my_record().unwrap().state,
            NodeState::Serving,
            "own record kept"
        );
        let gossip = ClusterView::from_nodes(vec![rec(5, NodeState::Serving, 9)]);
        assert_eq!(m.merge(&gossip, 0), Step::default());
        assert!(m.set_state(NodeState::Draining, 0).changed);
        assert_eq!(m.view().version, 41, "a change made here moves the version");
        etcd.revision = 10; // a wiped etcd starts again
        etcd.set_alive(2, false);
        assert!(m.replace(etcd.view(), 0).changed);
        assert_eq!(m.view().version, 42);
        assert_eq!(m.view().node(NodeId(2)).unwrap().state, NodeState::Down);
    }
}
