//! The routing plan of one request, without I/O: the view it is routed by (and the one before
//! it, for a while after the view changed), the nodes a write goes to, the nodes a read asks in
//! their order, and what each answer means for the next step. Every speaker that reaches other
//! nodes for a client (the client library, the daemon's RESP door forwarding keys owned
//! elsewhere) routes by this plan; its shell only carries the requests.
//!
//! - [`Routes`]: the view requests are routed by, the previous one and when it was replaced
//!   ([`Routes::adopt`]); the owners a write goes to ([`Routes::writes`]), the nodes a remove
//!   reaches ([`Routes::removes`]), the nodes a namespace is cleared on ([`Routes::everyone`]).
//! - [`ReadPlan`]: the nodes one key's read asks in turn: its owner, its next replicas when one
//!   can't be reached, and, while the view changes, its previous owner, whose copy counts only
//!   when the key's current owners vouch for it.
//! - [`WriteCodes`]: one code per item from the answers of every owner it went to.
//! - [`ViewRetry`]: a node answered that the view changed: refresh it and route again, a
//!   bounded number of times.
//!
//! Time is passed in: a [`Routes`] remembers the caller's `Instant` of a change and is asked
//! with the caller's `now`.

use std::time::{Duration, Instant};

use crate::addr::NodeId;
use crate::placement::{routing, ClusterView, NodeState};
use crate::protocol::ErrorCode;

/// How long after the view changed a miss is looked up on the key's previous owner, unless the
/// speaker is told otherwise (the client's `fallback_window`).
pub const FALLBACK_WINDOW: Duration = Duration::from_secs(60);

/// Attempts of one routed call while nodes answer that the view changed (`WrongView`).
pub const VIEW_ATTEMPTS: u32 = 5;

/// The view requests are routed by, and the one before it.
#[derive(Clone, Debug)]
pub struct Routes {
    /// The view requests are routed by.
    pub view: ClusterView,
    /// Its [`ClusterView::stamp`], which every routed request carries.
    pub stamp: u64,
    /// The previous view and when it was replaced: misses consult its owners for a while.
    pub prev: Option<(ClusterView, Instant)>,
}

impl Routes {
    /// Routes by `view`, with no previous view.
    pub fn new(view: ClusterView) -> Routes {
        Routes {
            stamp: view.stamp(),
            view,
            prev: None,
        }
    }

    /// The routes once `v` is adopted at `now`, or None when `v` is the current view or older.
    /// The current view becomes the previous one when any of its nodes was serving (a view
    /// nobody served by holds nothing to look up), else the previous one stays.
    pub fn adopt(&self, v: ClusterView, now: Instant) -> Option<Routes> {
        let stamp = v.stamp();
        if stamp == self.stamp || v.version < self.view.version {
            return None;
        }
        let served = self
            .view
            .nodes
            .iter()
            .any(|n| n.state == NodeState::Serving);
        let prev = match served {
            true => Some((self.view.clone(), now)),
            false => self.prev.clone(),
        };
        Some(Routes {
            view: v,
            stamp,
            prev,
        })
    }

    /// The previous view, while `now` is less than `window` after it was replaced.
    pub fn fallback(&self, now: Instant, window: Duration) -> Option<&ClusterView> {
        self.prev
            .as_ref()
            .filter(|(_, since)| now.saturating_duration_since(*since) < window)
            .map(|(v, _)| v)
    }

    /// The node that owned `key` under `fallback` (the previous view, when it is still
    /// consulted), when that is not its owner now and the current view does not have it down
    /// ([`routing::previous_owner`]).
    pub fn previous_owner(&self, key: &[u8], fallback: Option<&ClusterView>) -> Option<NodeId> {
        routing::previous_owner(fallback?, &self.view, key)
    }

    /// The `k`-th of the first `replicas` owners of `key` (the owner itself for 0, found
    /// without ranking every node).
    pub fn owner_at(&self, key: &[u8], k: usize, replicas: usize) -> Option<NodeId> {
        match k {
            0 => self.view.owner(key),
            _ => self.view.owners(key, replicas).get(k).copied(),
        }
    }

    /// The nodes a write of `key` goes to, routed by [`Routes::stamp`]: its first `replicas`
    /// (at least 1) owners.
    pub fn writes(&self, key: &[u8], replicas: usize) -> Vec<NodeId> {
        self.view.owners(key, replicas.max(1))
    }

    /// The nodes a remove of `key` goes to, each with the stamp it is sent with: its first
    /// `replicas` owners routed by the view, and its previous owner (under `fallback`) on
    /// purpose (stamp 0), so no copy a read could still be served survives the remove.
    pub fn removes(
        &self,
        key: &[u8],
        replicas: usize,
        fallback: Option<&ClusterView>,
    ) -> Vec<(NodeId, u64)> {
        let mut to: Vec<(NodeId, u64)> = self
            .view
            .owners(key, replicas)
            .into_iter()
            .map(|o| (o, self.stamp))
            .collect();
        if let Some(p) = self.previous_owner(key, fallback) {
            to.push((p, 0));
        }
        to
    }

    /// The owners of `key` (among the first `replicas`) that must vouch for the copy on its
    /// previous owner `prev` before that copy is served: every one but `prev` itself.
    pub fn vouchers(&self, key: &[u8], replicas: usize, prev: NodeId) -> Vec<NodeId> {
        let mut owners = self.view.owners(key, replicas);
        owners.retain(|o| *o != prev);
        owners
    }

    /// Every node of the view that is not down: where a namespace is cleared (on purpose,
    /// stamp 0).
    pub fn everyone(&self) -> Vec<NodeId> {
        self.view
            .nodes
            .iter()
            .filter(|n| n.state != NodeState::Down)
            .map(|n| NodeId(n.id))
            .collect()
    }
}

/// What a node answered one key's read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// The value is there (from a previous owner: and its owners vouched for it).
    Hit,
    /// It is not (from a previous owner: or its owners did not vouch for it).
    Miss,
    /// The node could not be reached: its keys are misses for now.
    Unreachable,
}

/// The next step of one key's read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Ask `node`, sending `stamp` (the view's; 0: on purpose).
    Ask {
        /// The node.
        node: NodeId,
        /// The stamp the request carries.
        stamp: u64,
    },
    /// Ask the key's previous owner `node` on purpose (stamp 0) and, at the same time, ask
    /// every node of `vouchers` to vouch for its copy (`Op::Vouch`): the copy counts as a
    /// [`Heard::Hit`] only when each of them vouched. A voucher that does not answer vouches
    /// for nothing: a miss, never a stale value.
    AskPrevious {
        /// The previous owner.
        node: NodeId,
        /// The current owners that must vouch.
        vouchers: Vec<NodeId>,
    },
    /// The last answer was a hit: the read is served.
    Hit,
    /// Nothing more to ask: a miss.
    Miss,
}

/// Where a read is in its plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Owners,
    Previous,
    Again,
}

/// The nodes one key's read asks in turn, and what each answer leads to. Three shapes, one per
/// kind of read: [`ReadPlan::one`], [`ReadPlan::batched`], [`ReadPlan::presence`]. Start with
/// [`ReadPlan::first`], then pass each answer to [`ReadPlan::next`] until it says
/// [`Step::Hit`] or [`Step::Miss`]. Nodes are found as they are needed: the owner without
/// ranking every node, the next replicas and the previous owner only when asked for.
#[derive(Clone, Debug)]
pub struct ReadPlan<'a> {
    routes: &'a Routes,
    key: &'a [u8],
    fallback: Option<&'a ClusterView>,
    /// Replicas reads consult (the vouchers among them).
    replicas: usize,
    /// How many of them are asked in turn while they can't be reached.
    asked: usize,
    /// A miss on any owner (not only the first) goes on to the previous owner.
    previous_after_any: bool,
    /// After the previous owner, the owners are asked once more: a key handed over between
    /// the two lookups is on its owner by then (a mover drops its copy only once the owner
    /// holds it), so a key in flight is never a miss.
    again: bool,
    at: usize,
    phase: Phase,
}

impl<'a> ReadPlan<'a> {
    /// A single key's read (a get): its owner, then its next replicas (of `replicas`) while
    /// they can't be reached; a miss on the owner itself goes on to the previous owner (under
    /// `fallback`), a miss anywhere else is the answer.
    pub fn one(
        routes: &'a Routes,
        key: &'a [u8],
        replicas: usize,
        fallback: Option<&'a ClusterView>,
    ) -> ReadPlan<'a> {
        ReadPlan::shaped(routes, key, fallback, (replicas, replicas), false, false)
    }

    /// A key of a batched read: as [`ReadPlan::one`], but a miss on any replica goes on to the
    /// previous owner, and a miss there asks the owners once more.
    pub fn batched(
        routes: &'a Routes,
        key: &'a [u8],
        replicas: usize,
        fallback: Option<&'a ClusterView>,
    ) -> ReadPlan<'a> {
        ReadPlan::shaped(routes, key, fallback, (replicas, replicas), true, true)
    }

    /// A key's presence: its owner only (one that can't be reached holds nothing), then the
    /// previous owner, then the owner once more; `replicas` are the owners that vouch.
    pub fn presence(
        routes: &'a Routes,
        key: &'a [u8],
        replicas: usize,
        fallback: Option<&'a ClusterView>,
    ) -> ReadPlan<'a> {
        ReadPlan::shaped(routes, key, fallback, (replicas, 1), true, true)
    }

    fn shaped(
        routes: &'a Routes,
        key: &'a [u8],
        fallback: Option<&'a ClusterView>,
        (replicas, asked): (usize, usize),
        previous_after_any: bool,
        again: bool,
    ) -> ReadPlan<'a> {
        ReadPlan {
            routes,
            key,
            fallback,
            replicas: replicas.max(1),
            asked: asked.max(1),
            previous_after_any,
            again,
            at: 0,
            phase: Phase::Owners,
        }
    }

    /// The first step: the owner, or a miss when no node serves.
    pub fn first(&mut self) -> Step {
        self.at = 0;
        self.phase = Phase::Owners;
        self.ask_owner()
    }

    /// The step after the answer `heard` to the last one.
    pub fn next(&mut self, heard: Heard) -> Step {
        match (self.phase, heard) {
            (_, Heard::Hit) => Step::Hit,
            (Phase::Owners, Heard::Miss) if self.at == 0 || self.previous_after_any => {
                let r = self.routes;
                match r.previous_owner(self.key, self.fallback) {
                    Some(node) => {
                        self.phase = Phase::Previous;
                        Step::AskPrevious {
                            node,
                            vouchers: r.vouchers(self.key, self.replicas, node),
                        }
                    }
                    None => Step::Miss,
                }
            }
            (Phase::Owners | Phase::Again, Heard::Miss) => Step::Miss,
            (Phase::Owners | Phase::Again, Heard::Unreachable) => {
                self.at += 1;
                self.ask_owner()
            }
            (Phase::Previous, Heard::Miss | Heard::Unreachable) if self.again => {
                self.phase = Phase::Again;
                self.at = 0;
                self.ask_owner()
            }
            (Phase::Previous, _) => Step::Miss,
        }
    }

    fn ask_owner(&self) -> Step {
        let owner = match self.at < self.asked {
            true => self.routes.owner_at(self.key, self.at, self.replicas),
            false => None,
        };
        match owner {
            Some(node) => Step::Ask {
                node,
                stamp: self.routes.stamp,
            },
            None => Step::Miss,
        }
    }
}

/// One code per item of a write that went to several owners: stored once is stored;
/// otherwise the first owner's refusal; [`ErrorCode::Unavailable`] when no owner answered.
#[derive(Clone, Debug)]
pub struct WriteCodes(Vec<Option<ErrorCode>>);

/// An owner refused a write because the view changed while its value streamed in: the write
/// goes again by the new view (values stored are stored again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewChanged;

impl WriteCodes {
    /// Codes for `items` items, none heard yet.
    pub fn new(items: usize) -> WriteCodes {
        WriteCodes(vec![None; items])
    }

    /// An owner answered `code` for item `i` ([`ErrorCode::Unavailable`] for an owner that
    /// could not be reached).
    pub fn heard(&mut self, i: usize, code: ErrorCode) {
        let c = &mut self.0[i];
        if code == ErrorCode::Ok || c.is_none() {
            *c = Some(code);
        }
    }

    /// Each item's code, or [`ViewChanged`] when one of them was refused so.
    pub fn finish(self) -> Result<Vec<ErrorCode>, ViewChanged> {
        let codes: Vec<ErrorCode> = self
            .0
            .into_iter()
            .map(|c| c.unwrap_or(ErrorCode::Unavailable))
            .collect();
        match codes.contains(&ErrorCode::WrongView) {
            true => Err(ViewChanged),
            false => Ok(codes),
        }
    }
}

/// The attempts of one routed call while nodes answer that the view changed.
#[derive(Clone, Copy, Debug, Default)]
pub struct ViewRetry {
    attempt: u32,
}

impl ViewRetry {
    /// No attempt retried yet.
    pub fn new() -> ViewRetry {
        ViewRetry::default()
    }

    /// After a `WrongView`: true to route again (after refreshing the view), false once
    /// [`VIEW_ATTEMPTS`] attempts were made.
    pub fn again(&mut self) -> bool {
        if self.attempt + 1 >= VIEW_ATTEMPTS {
            return false;
        }
        self.attempt += 1;
        true
    }

    /// How long to wait before routing again when the refresh found no newer view (the nodes
    /// don't agree yet: gossip needs a moment); longer with every attempt.
    pub fn pause(&self) -> Duration {
        Duration::from_millis(20 << self.attempt)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::placement::NodeInfo;

    fn view(ids: &[u32]) -> ClusterView {
        ClusterView::from_nodes(ids.iter().map(|&i| NodeInfo::serving(i, 1 << 30)).collect())
    }

    fn down(mut v: ClusterView, id: u32) -> ClusterView {
        v.mark_down(id);
        v
    }

    /// Routes by `now` that replaced `before` at `t`.
    fn changed(before: &[u32], now: &[u32], t: Instant) -> Routes {
        Routes::new(view(before)).adopt(view(now), t).unwrap()
    }

    /// A key whose owner differs between the two views.
    fn moved_key(r: &Routes) -> Vec<u8> {
        let (prev, _) = r.prev.as_ref().unwrap();
        (0u32..)
            .map(|i| format!("k{i}").into_bytes())
            .find(|k| prev.owner(k) != r.view.owner(k))
            .unwrap()
    }

    #[test]
    fn a_newer_view_is_adopted_and_the_old_one_kept_as_previous() {
        let t = Instant::now();
        let r = Routes::new(view(&[0, 1]));
        assert!(r.adopt(view(&[0, 1]), t).is_none(), "the same view");
        let r2 = r.adopt(view(&[0, 1, 2]), t).unwrap();
        assert_eq!(r2.stamp, view(&[0, 1, 2]).stamp());
        assert_eq!(r2.prev.as_ref().unwrap().0, view(&[0, 1]));
        assert!(r2.adopt(r.view.clone(), t).is_none(), "an older view");
    }

    #[test]
    fn a_view_nobody_served_by_is_not_kept_as_previous() {
        let t = Instant::now();
        let empty = Routes::new(ClusterView::default());
        let r = empty.adopt(view(&[0]), t).unwrap();
        assert!(r.prev.is_none());
    }

    #[test]
    fn the_previous_view_is_consulted_within_the_window_only() {
        let t = Instant::now();
        let r = changed(&[0, 1], &[0, 1, 2], t);
        let w = Duration::from_secs(60);
        assert!(r.fallback(t + Duration::from_secs(59), w).is_some());
        assert!(r.fallback(t + Duration::from_secs(60), w).is_none());
    }

    #[test]
    fn a_read_asks_the_owner_then_on_a_miss_the_previous_owner_with_vouchers() {
        let t = Instant::now();
        let r = changed(&[0, 1], &[0, 1, 2], t);
        let key = moved_key(&r);
        let fb = r.fallback(t, FALLBACK_WINDOW);
        let prev = r.previous_owner(&key, fb).unwrap();
        let mut p = ReadPlan::one(&r, &key, 1, fb);
        let owner = r.view.owner(&key).unwrap();
        assert_eq!(
            p.first(),
            Step::Ask {
                node: owner,
                stamp: r.stamp
            }
        );
        assert_eq!(
            p.next(Heard::Miss),
            Step::AskPrevious {
                node: prev,
                vouchers: vec![owner]
            }
        );
        assert_eq!(
            p.next(Heard::Miss),
            Step::Miss,
            "a single read asks no more"
        );
        let mut b = ReadPlan::batched(&r, &key, 1, fb);
        b.first();
        b.next(Heard::Miss);
        assert_eq!(
            b.next(Heard::Miss),
            Step::Ask {
                node: owner,
                stamp: r.stamp
            },
            "a batched read asks the owner once more"
        );
        assert_eq!(b.next(Heard::Miss), Step::Miss);
    }

    #[test]
    fn an_unreachable_owner_passes_the_read_to_the_next_replica() {
        let r = Routes::new(view(&[0, 1, 2]));
        let owners = r.view.owners(b"k", 2);
        let mut p = ReadPlan::one(&r, b"k", 2, None);
        p.first();
        assert_eq!(
            p.next(Heard::Unreachable),
            Step::Ask {
                node: owners[1],
                stamp: r.stamp
            }
        );
        assert_eq!(p.next(Heard::Unreachable), Step::Miss);
        let mut presence = ReadPlan::presence(&r, b"k", 2, None);
        presence.first();
        assert_eq!(presence.next(Heard::Unreachable), Step::Miss);
    }

    #[test]
    fn a_down_node_is_no_previous_owner() {
        let t = Instant::now();
        let r = changed(&[0, 1], &[0, 1, 2], t);
        let key = moved_key(&r);
        let before = r.prev.as_ref().unwrap().0.owner(&key).unwrap();
        let r2 = Routes {
            view: down(r.view.clone(), before.0),
            ..r.clone()
        };
        assert_eq!(
            r2.previous_owner(&key, r2.fallback(t, FALLBACK_WINDOW)),
            None
        );
    }

    #[test]
    fn removes_reach_the_owners_by_the_view_and_the_previous_owner_on_purpose() {
        let t = Instant::now();
        let r = changed(&[0, 1], &[0, 1, 2], t);
        let key = moved_key(&r);
        let fb = r.fallback(t, FALLBACK_WINDOW);
        let to = r.removes(&key, 2, fb);
        let owners = r.view.owners(&key, 2);
        assert_eq!(to.len(), owners.len() + 1);
        assert!(to[..owners.len()].iter().all(|&(_, s)| s == r.stamp));
        assert_eq!(to.last(), Some(&(r.previous_owner(&key, fb).unwrap(), 0)));
    }

    #[test]
    fn write_codes_say_stored_once_is_stored() {
        let mut c = WriteCodes::new(3);
        c.heard(0, ErrorCode::PoolFull);
        c.heard(0, ErrorCode::Ok);
        c.heard(1, ErrorCode::PoolFull);
        c.heard(1, ErrorCode::QuotaExceeded);
        assert_eq!(
            c.clone().finish(),
            Ok(vec![
                ErrorCode::Ok,
                ErrorCode::PoolFull,
                ErrorCode::Unavailable
            ])
        );
        c.heard(2, ErrorCode::WrongView);
        assert_eq!(c.finish(), Err(ViewChanged));
    }

    #[test]
    fn a_changing_view_is_retried_a_bounded_number_of_times() {
        let mut r = ViewRetry::new();
        let mut pauses = Vec::new();
        while r.again() {
            pauses.push(r.pause());
        }
        assert_eq!(pauses.len() as u32, VIEW_ATTEMPTS - 1);
        assert!(pauses.windows(2).all(|w| w[0] < w[1]));
    }

    /// Any sequence of answers ends the plan: at most every owner twice and the previous owner
    /// once, then a hit or a miss, and every node asked is one the views name for the key.
    fn answers() -> impl Strategy<Value = Vec<Heard>> {
        proptest::collection::vec(
            prop_oneof![
                Just(Heard::Hit),
                Just(Heard::Miss),
                Just(Heard::Unreachable)
            ],
            0..12,
        )
    }

    proptest! {
        #[test]
        fn every_plan_ends_and_asks_only_the_keys_nodes(
            nodes in 1u32..6,
            added in 1u32..3,
            replicas in 1usize..4,
            key in proptest::collection::vec(any::<u8>(), 1..16),
            heard in answers(),
            shape in 0u8..3,
        ) {
            let t = Instant::now();
            let before: Vec<u32> = (0..nodes).collect();
            let after: Vec<u32> = (0..nodes + added).collect();
            let r = changed(&before, &after, t);
            let fb = r.fallback(t, FALLBACK_WINDOW);
            let mut p = match shape {
                0 => ReadPlan::one(&r, &key, replicas, fb),
                1 => ReadPlan::batched(&r, &key, replicas, fb),
                _ => ReadPlan::presence(&r, &key, replicas, fb),
            };
            let owners = r.view.owners(&key, replicas);
            let prev = r.previous_owner(&key, fb);
            let mut step = p.first();
            let mut asked = 0;
            let mut heard = heard.into_iter();
            loop {
                match &step {
                    Step::Ask { node, stamp } => {
                        prop_assert!(owners.contains(node));
                        prop_assert_eq!(*stamp, r.stamp);
                    }
                    Step::AskPrevious { node, vouchers } => {
                        prop_assert_eq!(Some(*node), prev);
                        prop_assert!(!vouchers.contains(node));
                    }
                    Step::Hit | Step::Miss => break,
                }
                asked += 1;
                prop_assert!(asked <= 2 * owners.len() + 1);
                step = p.next(heard.next().unwrap_or(Heard::Unreachable));
            }
        }
    }
}
