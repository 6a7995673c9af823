//! Which of this node's objects it may still serve as an owner or replica: what keeps an old
//! copy from an *earlier* ownership from shadowing a write that another node acknowledged
//! meanwhile.
//!
//! A node that owned a key, lost it (a node joined and took it, or the others marked this
//! node down while it was cut off) and got it back still holds the copy from its first
//! ownership; the key's owner in between may have acknowledged a newer write. So an object is
//! served by a routed read (a request stamped with the view it was routed by) only when it is
//! *continuous*: this node was among the key's first `replicas` owners in every view it adopted
//! since it allocated the object. Objects carry their allocation's generation (a counter that
//! grows with every allocation), and every adopted view is kept with the generation mark it
//! was adopted at, so the view current at each object's write is known exactly.
//!
//! Views this node never adopted: between two views it adopted the cluster may have passed
//! through others (gossip skips states). Only a node itself raises its record's epoch, and
//! others may only mark that record down, so a node whose epoch is unchanged between the two
//! served in between only if it served in one of them; one that appeared, or whose epoch moved,
//! may have served at an epoch this node never saw (see `may_have_served_between`, which
//! also uses the order of a node's own states to leave out a draining node leaving). Each
//! transition is checked against a hypothetical view in which all of those nodes serve:
//! ranking among more nodes only ranks this node lower, so continuity there implies it in
//! every view in between. This node's own record changes only here, so it is in the
//! hypothetical view only when it served in both.
//!
//! A node that learns the others marked it down (it refutes that) was cut off: its views then
//! tell nothing of what the others did, so every object it holds becomes suspect (the *floor*).
//! The history keeps the last [`HISTORY`] views; objects older than the oldest kept one are
//! suspect too. Suspect objects are misses; the caller removes them.
//!
//! A restarting node owns its keys like a serving one (they stay its own while it is away), so
//! here it counts as serving: its copies stay continuous across a restart in place, and no
//! other node's copy of its keys is.
//!
//! The same views say where a pinned object this node lacks may still be while the cluster
//! settles ([`History::holders`]): a node that became one of a key's owners gets the key's
//! pinned object from the movers of the nodes that held it, after each of them adopts the view,
//! so a read routed to it by the new view can come first.

use std::collections::VecDeque;

use super::{ClusterView, NodeInfo, NodeState};
use crate::addr::NodeId;

/// Views kept: objects allocated before the oldest of them are never served again as an
/// owner's copy.
pub const HISTORY: usize = 64;

/// One adopted view, as far as ownership goes.
#[derive(Clone, Debug)]
struct Adopted {
    /// Its place in the order of adoption: 1 for the first view, one more for each after.
    seq: u64,
    /// The pool's generation mark when this node adopted the view: objects with a generation
    /// from here on (up to the next entry's mark) were allocated while it was current.
    mark: u64,
    /// The view's owning nodes, serving or restarting (all marked serving).
    serving: ClusterView,
    /// The hypothetical view of the transition into this view (see the module docs).
    between: ClusterView,
    /// The view itself, whole (the records a handover is judged by).
    whole: ClusterView,
}

/// The views this node adopted, and the floor below which every object is suspect.
#[derive(Debug)]
pub struct History {
    me: NodeId,
    views: VecDeque<Adopted>,
    /// The last adopted view, whole (to find the records that changed).
    last: Option<ClusterView>,
    /// Objects with a lower generation are suspect.
    floor: u64,
    /// Views adopted so far (the last one's `seq`).
    adopted: u64,
}

impl History {
    /// An empty history of node `me`.
    pub fn new(me: NodeId) -> History {
        History {
            me,
            views: VecDeque::new(),
            last: None,
            floor: 0,
            adopted: 0,
        }
    }

    /// How many views this node has adopted: the `seq` of the current one, by which
    /// [`History::holders`] is told where the settling began.
    pub fn adopted(&self) -> u64 {
        self.adopted
    }

    /// Records that this node adopted `view` when the pool's generation mark was `mark`.
    pub fn adopt(&mut self, view: &ClusterView, mark: u64) {
        let serving = serving_of(view.nodes.iter().filter(|n| n.state.owns()));
        let between = match &self.last {
            None => serving.clone(),
            Some(prev) => self.between(prev, view),
        };
        self.adopted += 1;
        self.views.push_back(Adopted {
            seq: self.adopted,
            mark,
            serving,
            between,
            whole: view.clone(),
        });
        if self.views.len() > HISTORY {
            self.views.pop_front();
            if let Some(oldest) = self.views.front() {
                self.floor = self.floor.max(oldest.mark);
            }
        }
        self.last = Some(view.clone());
    }

    /// Makes every object allocated before `mark` suspect: the others marked this node down.
    pub fn fence(&mut self, mark: u64) {
        self.floor = self.floor.max(mark);
    }

    /// True when an object of `key` allocated at `generation` may be served by a routed read:
    /// this node was among the key's first `replicas` owners in every view since.
    pub fn continuous(&self, key: &[u8], generation: u64, replicas: usize) -> bool {
        if generation < self.floor {
            return false;
        }
        // The view current at the allocation: the last one adopted at or before it.
        let at = self.views.partition_point(|a| a.mark <= generation);
        let Some(first) = at.checked_sub(1) else {
            return false;
        };
        let r = replicas.max(1);
        let owns = |v: &ClusterView| match r {
            1 => v.owner(key) == Some(self.me),
            _ => v.owners(key, r).contains(&self.me),
        };
        owns(&self.views[first].serving)
            && self.views.iter().skip(first + 1).all(|a| owns(&a.between))
    }

    /// The nodes that may hold a pinned object of `key` that this node, one of its first
    /// `replicas` owners now, lacks because it took the key over in a view adopted at or after
    /// `since` (a `seq`, see [`History::adopted`]): its other owners now, then every node
    /// among the key's first `replicas` owners in those views, in the views before them and in
    /// the transitions' hypothetical views, the latest first. Empty when this node does not own
    /// the key now, or owned it before `since` and through every transition since: then every
    /// write of the key went to it as an owner, and a miss here is a miss.
    ///
    /// A node that becomes an owner gets the key's pinned object from the movers of the nodes
    /// that held it, each once it has adopted the view, and a read routed by the new view may
    /// come first: these are the nodes to ask for it.
    pub fn holders(&self, key: &[u8], replicas: usize, since: u64) -> Vec<NodeId> {
        let r = replicas.max(1);
        let Some(now) = self.views.back().map(|a| a.serving.owners(key, r)) else {
            return Vec::new();
        };
        // The transitions into the views adopted since `since` (the first view has none).
        let from = self.views.partition_point(|a| a.seq < since).max(1);
        if !now.contains(&self.me) || from >= self.views.len() {
            return Vec::new();
        }
        let mut kept = true;
        let mut earlier = Vec::new();
        for i in (from..self.views.len()).rev() {
            let across = self.views[i].between.owners(key, r);
            let before = self.views[i - 1].serving.owners(key, r);
            kept &= across.contains(&self.me) && before.contains(&self.me);
            earlier.extend(across.into_iter().chain(before));
        }
        if kept {
            return Vec::new();
        }
        let mut out: Vec<NodeId> = Vec::new();
        for n in now.into_iter().chain(earlier) {
            if n != self.me && !out.contains(&n) {
                out.push(n);
            }
        }
        out
    }

    /// The node that took `key` over directly from this node, when this node's object of it,
    /// allocated at `generation`, was the owner's copy up to the handover: what the mover may
    /// hand an unpinned object to after a drain or a join (one owner per key). `None` unless
    /// all of this holds:
    ///
    /// - the object was continuous (see [`History::continuous`], one replica) from its
    ///   allocation up to the transition `j` in which this node stopped owning the key;
    /// - across that transition nobody but this node and the new owner `o` can have owned the
    ///   key: in its hypothetical view, with this node added as serving, the two highest
    ///   ranked for the key are this node and `o`, and one of the two kept the same serving
    ///   record on both sides of it (this node during a join, `o` during this node's drain), so
    ///   in every view in between one of them served and owned the key;
    /// - `o` owned the key in every transition since, and owns it now.
    ///
    /// Then the writes of the key acknowledged anywhere are this object's and, after it, only
    /// `o`'s: `o` refuses the copy when it has acknowledged one (it does not vouch for it).
    pub fn handed_to(&self, key: &[u8], generation: u64) -> Option<NodeId> {
        if generation < self.floor {
            return None;
        }
        let first = self
            .views
            .partition_point(|a| a.mark <= generation)
            .checked_sub(1)?;
        let mine = |v: &ClusterView| v.owner(key) == Some(self.me);
        if !mine(&self.views[first].serving) {
            return None;
        }
        let j = (first + 1..self.views.len()).find(|&i| !mine(&self.views[i].between))?;
        let (prev, lost) = (&self.views[j - 1].whole, &self.views[j]);
        let o = lost.serving.owner(key)?;
        let me_before = prev
            .node(self.me)
            .filter(|n| n.state == NodeState::Serving)?;
        let mut across = lost.between.clone();
        if across.node(self.me).is_none() {
            across.nodes.push(me_before.clone());
        }
        let mut top = across.owners(key, 2);
        top.sort();
        let mut want = vec![self.me, o];
        want.sort();
        let steady = |id: NodeId| {
            prev.node(id)
                .is_some_and(|n| n.state == NodeState::Serving && lost.whole.node(id) == Some(n))
        };
        let kept = (top == want && (steady(self.me) || steady(o)))
            && self
                .views
                .iter()
                .skip(j + 1)
                .all(|a| a.between.owner(key) == Some(o))
            && self.views.back()?.serving.owner(key) == Some(o);
        kept.then_some(o)
    }

    /// The hypothetical view of the transition `prev` → `next`: every node serving in either,
    /// and every other node that may have served in a view between them
    /// (`may_have_served_between`), as serving; this node only when it served in both.
    fn between(&self, prev: &ClusterView, next: &ClusterView) -> ClusterView {
        let me = self.me.0;
        let serves = |v: &ClusterView| v.node(self.me).is_some_and(|n| n.state.owns());
        let both = serves(prev) && serves(next);
        let mut nodes: Vec<NodeInfo> = Vec::new();
        for n in prev.nodes.iter().chain(next.nodes.iter()) {
            let wanted = if n.id == me {
                both
            } else {
                let id = NodeId(n.id);
                may_have_served_between(prev.node(id), next.node(id))
            };
            if !wanted {
                continue;
            }
            // The larger capacity of the two records ranks the node higher: the cautious one.
            match nodes.iter_mut().find(|m| m.id == n.id) {
                Some(m) => m.capacity = m.capacity.max(n.capacity),
                None => nodes.push(n.clone()),
            }
        }
        serving_of(nodes.iter())
    }
}

/// Whether a node whose record was `prev` in one adopted view and `next` in the next may have
/// been serving in between, in a view this node never adopted. Each epoch of a node has one
/// record that only the node itself writes, which others may only mark down at that epoch; a
/// node process goes joining → serving → draining → down (or serving → restarting, which
/// owns keys as serving does, and the next process resumes from restarting to serving or
/// joining), raising its epoch at each step and to refute being marked down (keeping its
/// state), and a new process starts joining at an epoch above its last record.
fn may_have_served_between(prev: Option<&NodeInfo>, next: Option<&NodeInfo>) -> bool {
    use NodeState::{Down, Joining};
    match (prev, next) {
        (Some(p), _) if p.state.owns() => true,
        (_, Some(n)) if n.state.owns() => true,
        // Appeared: its earlier records are unseen, unless this is a new node's first one.
        (None, Some(n)) => n.state == Down || n.epoch > 1,
        // Vanished (a view from etcd): its later records are unseen.
        (Some(_), None) => true,
        (None, None) => false,
        (Some(p), Some(n)) => match n.epoch.saturating_sub(p.epoch) {
            0 => false,
            // One step: the record at the new epoch, if it was marked down since, may have
            // been the step from joining to serving, or from down (state unknown) back up.
            1 => n.state == Down && matches!(p.state, Joining | Down),
            _ => true,
        },
    }
}

/// A view of `nodes`, every one of them serving.
fn serving_of<'a>(nodes: impl Iterator<Item = &'a NodeInfo>) -> ClusterView {
    ClusterView::from_nodes(
        nodes
            .map(|n| NodeInfo {
                state: NodeState::Serving,
                ..n.clone()
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::placement::test_record as rec;

    fn view(recs: &[(u32, NodeState, u64)]) -> ClusterView {
        ClusterView::from_nodes(recs.iter().map(|&(i, s, e)| rec(i, s, e)).collect())
    }

    use NodeState::{Down, Joining, Serving};

    /// Keys that node `a` owns among `ids` and node `b` owns once it serves too.
    fn keys_moving(a: u32, b: u32, ids: &[u32]) -> Vec<Vec<u8>> {
        let with: Vec<_> = ids.iter().map(|&i| (i, Serving, 1)).collect();
        let without: Vec<_> = ids
            .iter()
            .filter(|&&i| i != b)
            .map(|&i| (i, Serving, 1))
            .collect();
        let (with, without) = (view(&with), view(&without));
        (0..400u32)
            .map(|i| i.to_le_bytes().to_vec())
            .filter(|k| without.owner(k) == Some(NodeId(a)) && with.owner(k) == Some(NodeId(b)))
            .collect()
    }

    /// Node 2 joins nodes 0 and 1 and goes down again, as node 0 adopts it: with 0 and 1 at
    /// mark 1, 2 joining at 10, serving at 11, down at 12.
    fn node_2_joins_and_goes() -> [(ClusterView, u64); 4] {
        [
            (view(&[(0, Serving, 1), (1, Serving, 1)]), 1),
            (
                view(&[(0, Serving, 1), (1, Serving, 1), (2, Joining, 1)]),
                10,
            ),
            (
                view(&[(0, Serving, 1), (1, Serving, 1), (2, Serving, 2)]),
                11,
            ),
            (view(&[(0, Serving, 1), (1, Serving, 1), (2, Down, 2)]), 12),
        ]
    }

    #[test]
    fn an_object_is_continuous_while_ownership_stays() {
        let mut h = History::new(NodeId(0));
        h.adopt(&view(&[(0, Serving, 1), (1, Serving, 1)]), 1);
        let v = view(&[(0, Serving, 1), (1, Serving, 1)]);
        let mine: Vec<Vec<u8>> = (0..100u32)
            .map(|i| i.to_le_bytes().to_vec())
            .filter(|k| v.owner(k) == Some(NodeId(0)))
            .collect();
        assert!(!mine.is_empty());
        assert!(mine.iter().all(|k| h.continuous(k, 5, 1)));
        // Node 1 is marked down and comes back (refuting, a higher epoch): node 0 owned its
        // keys throughout.
        h.adopt(&view(&[(0, Serving, 1), (1, Down, 1)]), 10);
        h.adopt(&view(&[(0, Serving, 1), (1, Serving, 2)]), 20);
        assert!(mine.iter().all(|k| h.continuous(k, 5, 1)));
        // Keys of node 1 written here while it was down were not continuous.
        let theirs: Vec<Vec<u8>> = (0..100u32)
            .map(|i| i.to_le_bytes().to_vec())
            .filter(|k| v.owner(k) == Some(NodeId(1)))
            .collect();
        assert!(theirs.iter().all(|k| !h.continuous(k, 15, 1)));
    }

    #[test]
    fn ownership_that_went_away_and_came_back_is_not_continuous() {
        let keys = keys_moving(0, 2, &[0, 1, 2]);
        assert!(!keys.is_empty());
        let mut h = History::new(NodeId(0));
        // v0 written here at generation 5, after the first view.
        for (v, mark) in node_2_joins_and_goes() {
            h.adopt(&v, mark);
        }
        for k in &keys {
            assert!(!h.continuous(k, 5, 1), "node 2 owned it in between");
            // A write taken after ownership came back is fine.
            assert!(h.continuous(k, 12, 1));
        }
    }

    #[test]
    fn an_unseen_view_with_a_node_serving_breaks_continuity() {
        let keys = keys_moving(0, 2, &[0, 1, 2]);
        let mut h = History::new(NodeId(0));
        h.adopt(
            &view(&[(0, Serving, 1), (1, Serving, 1), (2, Joining, 1)]),
            1,
        );
        // This node never saw node 2 serving (epoch 2), only it being down afterwards.
        h.adopt(&view(&[(0, Serving, 1), (1, Serving, 1), (2, Down, 2)]), 10);
        assert!(keys.iter().all(|k| !h.continuous(k, 5, 1)));
        // A node marked down at an unchanged epoch hides nothing.
        let all = view(&[(0, Serving, 1), (1, Serving, 1), (2, Serving, 1)]);
        let mine: Vec<Vec<u8>> = (0..100u32)
            .map(|i| i.to_le_bytes().to_vec())
            .filter(|k| all.owner(k) == Some(NodeId(0)))
            .collect();
        let mut h = History::new(NodeId(0));
        h.adopt(&all, 1);
        h.adopt(&view(&[(0, Serving, 1), (1, Serving, 1), (2, Down, 1)]), 10);
        assert!(mine.iter().all(|k| h.continuous(k, 5, 1)));
    }

    #[test]
    fn which_unseen_records_may_have_served() {
        let may = |p: Option<(NodeState, u64)>, n: Option<(NodeState, u64)>| {
            let p = p.map(|(s, e)| rec(1, s, e));
            let n = n.map(|(s, e)| rec(1, s, e));
            may_have_served_between(p.as_ref(), n.as_ref())
        };
        use NodeState::Draining;
        // A new node's first record hides nothing; a later or a down one may.
        assert!(!may(None, Some((Joining, 1))));
        assert!(may(None, Some((Joining, 4))));
        assert!(may(None, Some((Down, 1))));
        // Marked down at the same epoch: nothing in between.
        assert!(!may(Some((Joining, 1)), Some((Down, 1))));
        assert!(!may(Some((Down, 3)), Some((Down, 3))));
        // Joining, then down one epoch later: it may have served at that epoch.
        assert!(may(Some((Joining, 1)), Some((Down, 2))));
        assert!(!may(Some((Joining, 1)), Some((Draining, 2))));
        // A draining node leaving, or refuting, never served again.
        assert!(!may(Some((Draining, 3)), Some((Down, 4))));
        assert!(!may(Some((Draining, 3)), Some((Draining, 4))));
        // Down, then down again one epoch later: a new process may have come up.
        assert!(may(Some((Down, 3)), Some((Down, 4))));
        // Epochs skipped, or a record gone: unknown.
        assert!(may(Some((Draining, 3)), Some((Down, 5))));
        assert!(may(Some((Joining, 1)), None));
    }

    #[test]
    fn replicas_count_the_first_owners_only() {
        let v = view(&[(0, Serving, 1), (1, Serving, 1), (2, Serving, 1)]);
        let mut h = History::new(NodeId(0));
        h.adopt(&v, 1);
        for i in 0..100u32 {
            let k = i.to_le_bytes();
            let rank = v
                .owners(&k, 3)
                .iter()
                .position(|&o| o == NodeId(0))
                .unwrap();
            assert_eq!(h.continuous(&k, 1, 1), rank == 0);
            assert_eq!(h.continuous(&k, 1, 2), rank <= 1);
        }
    }

    #[test]
    fn fencing_and_pruning_make_older_objects_suspect() {
        let v = view(&[(0, Serving, 1)]);
        let mut h = History::new(NodeId(0));
        h.adopt(&v, 0);
        assert!(h.continuous(b"k", 3, 1));
        h.fence(4);
        assert!(!h.continuous(b"k", 3, 1));
        assert!(h.continuous(b"k", 4, 1));
        for i in 0..HISTORY as u64 {
            h.adopt(&view(&[(0, Serving, i + 2)]), 100 + i);
        }
        assert!(!h.continuous(b"k", 50, 1), "older than every kept view");
        assert!(h.continuous(b"k", 100 + HISTORY as u64, 1));
        // Before any view: nothing is known.
        assert!(!History::new(NodeId(0)).continuous(b"k", 1, 1));
    }

    #[test]
    fn this_node_not_serving_breaks_continuity() {
        let mut h = History::new(NodeId(0));
        h.adopt(&view(&[(0, Serving, 1)]), 0);
        h.adopt(&view(&[(0, NodeState::Draining, 2)]), 5);
        h.adopt(&view(&[(0, Serving, 3)]), 6);
        assert!(!h.continuous(b"k", 1, 1));
        assert!(h.continuous(b"k", 6, 1));
    }

    /// Keys among the first 600 that `owner` owns in `v`.
    fn keys_of(v: &ClusterView, owner: u32) -> Vec<Vec<u8>> {
        (0..600u32)
            .map(|i| i.to_le_bytes().to_vec())
            .filter(|k| v.owner(k) == Some(NodeId(owner)))
            .collect()
    }

    #[test]
    fn a_drain_hands_each_key_to_its_new_owner() {
        let before = view(&[(0, Serving, 1), (1, Serving, 1), (2, Serving, 1)]);
        let after = view(&[
            (0, NodeState::Draining, 2),
            (1, Serving, 1),
            (2, Serving, 1),
        ]);
        let mut h = History::new(NodeId(0));
        h.adopt(&before, 1);
        h.adopt(&after, 10);
        let mine = keys_of(&before, 0);
        assert!(!mine.is_empty());
        for k in &mine {
            assert_eq!(h.handed_to(k, 5), after.owner(k), "to the key's owner now");
            // Written after the handover (a peer's copy here, say): not this node's to give.
            assert_eq!(h.handed_to(k, 10), None);
        }
        // Keys this node never owned are not handed anywhere.
        for k in keys_of(&before, 1) {
            assert_eq!(h.handed_to(&k, 5), None);
        }
        // A later view that leaves the key with its new owner keeps the handover valid; one in
        // which another node may have owned it in between does not.
        let mut later = History::new(NodeId(0));
        later.adopt(&before, 1);
        later.adopt(&after, 10);
        later.adopt(
            &view(&[
                (0, NodeState::Draining, 2),
                (1, Serving, 1),
                (2, Serving, 1),
                (3, Joining, 1),
            ]),
            11,
        );
        assert!(mine.iter().all(|k| later.handed_to(k, 5) == after.owner(k)));
        later.adopt(
            &view(&[
                (0, NodeState::Draining, 2),
                (1, Serving, 1),
                (2, Serving, 1),
                (3, Serving, 2),
            ]),
            12,
        );
        let now = view(&[(1, Serving, 1), (2, Serving, 1), (3, Serving, 2)]);
        for k in &mine {
            let expect = (now.owner(k) == after.owner(k)).then(|| now.owner(k).unwrap());
            assert_eq!(later.handed_to(k, 5), expect);
        }
    }

    #[test]
    fn a_node_that_took_keys_over_asks_the_nodes_that_held_them_while_it_settles() {
        let keys: Vec<Vec<u8>> = (0..200u32).map(|i| i.to_le_bytes().to_vec()).collect();
        // Node 1 joins node 0; every pinned object (2 replicas) lives on both once it serves.
        let joining = view(&[(0, Serving, 1), (1, Joining, 1)]);
        let both = view(&[(0, Serving, 1), (1, Serving, 2)]);
        let mut joiner = History::new(NodeId(1));
        joiner.adopt(&view(&[(1, Joining, 1)]), 0);
        joiner.adopt(&joining, 3);
        joiner.adopt(&both, 3);
        assert_eq!(joiner.adopted(), 3);
        for k in &keys {
            // The settling began with the view that brought node 0 in.
            assert_eq!(joiner.holders(k, 2, 2), vec![NodeId(0)]);
            // With one replica, only the keys it owns now.
            let mine = both.owner(k) == Some(NodeId(1));
            assert_eq!(
                joiner.holders(k, 1, 2),
                mine.then_some(NodeId(0)).into_iter().collect::<Vec<_>>()
            );
            // No change since the view it asks from: nothing to ask for.
            assert!(joiner.holders(k, 2, 4).is_empty());
        }
        // Node 0 owned every key throughout: a miss there is a miss.
        let mut first = History::new(NodeId(0));
        first.adopt(&view(&[(0, Serving, 1)]), 0);
        first.adopt(&joining, 3);
        first.adopt(&both, 3);
        assert!(keys.iter().all(|k| first.holders(k, 2, 2).is_empty()));
        assert!(keys.iter().all(|k| first.holders(k, 1, 2).is_empty()));
        // Node 2 joins the two: its other owner now first, then the owners before it.
        let three = view(&[(0, Serving, 1), (1, Serving, 2), (2, Serving, 2)]);
        let mut third = History::new(NodeId(2));
        third.adopt(&view(&[(2, Joining, 1)]), 0);
        third.adopt(
            &view(&[(0, Serving, 1), (1, Serving, 2), (2, Joining, 1)]),
            5,
        );
        third.adopt(&three, 5);
        for k in &keys {
            let owners = three.owners(k, 2);
            let asked = third.holders(k, 2, 2);
            if !owners.contains(&NodeId(2)) {
                assert!(asked.is_empty(), "not an owner of it");
                continue;
            }
            let other = owners.iter().find(|&&o| o != NodeId(2)).copied();
            assert_eq!(asked.first().copied(), other);
            let mut sorted = asked.clone();
            sorted.sort();
            assert_eq!(sorted, vec![NodeId(0), NodeId(1)], "both held it before");
        }
    }

    #[test]
    fn a_join_hands_the_joiner_its_keys() {
        let keys = keys_moving(0, 2, &[0, 1, 2]);
        assert!(!keys.is_empty());
        let mut h = History::new(NodeId(0));
        let [two, joining, serving, down] = node_2_joins_and_goes();
        h.adopt(&two.0, two.1);
        h.adopt(&joining.0, joining.1);
        assert!(
            keys.iter().all(|k| h.handed_to(k, 5).is_none()),
            "2 not serving yet"
        );
        h.adopt(&serving.0, serving.1);
        assert!(keys.iter().all(|k| h.handed_to(k, 5) == Some(NodeId(2))));
        // Ownership that went away and came back: the copy is older than node 2's time.
        h.adopt(&down.0, down.1);
        assert!(keys.iter().all(|k| h.handed_to(k, 5).is_none()));
    }

    #[test]
    fn no_handover_when_a_third_node_may_have_owned_the_key_in_between() {
        // Node 0 drains while node 3 joins, both seen in one step: in a view between them
        // neither served, and node 1 or 2 may have taken writes of 0's keys.
        let before = view(&[(0, Serving, 1), (1, Serving, 1), (2, Serving, 1)]);
        let after = view(&[
            (0, NodeState::Draining, 2),
            (1, Serving, 1),
            (2, Serving, 1),
            (3, Serving, 2),
        ]);
        let mut h = History::new(NodeId(0));
        h.adopt(&before, 1);
        h.adopt(&after, 10);
        let to_3: Vec<_> = keys_of(&before, 0)
            .into_iter()
            .filter(|k| after.owner(k) == Some(NodeId(3)))
            .collect();
        assert!(!to_3.is_empty());
        assert!(to_3.iter().all(|k| h.handed_to(k, 5).is_none()));
        // Fenced: nothing held before is this node's to give.
        let mut f = History::new(NodeId(0));
        f.adopt(&before, 1);
        f.adopt(
            &view(&[
                (0, NodeState::Draining, 2),
                (1, Serving, 1),
                (2, Serving, 1),
            ]),
            10,
        );
        f.fence(11);
        assert!(keys_of(&before, 0)
            .iter()
            .all(|k| f.handed_to(k, 5).is_none()));
    }
}
