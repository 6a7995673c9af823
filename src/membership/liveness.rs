//! Liveness under static membership: the peers watched and heartbeated, what they and the
//! peers relaying their hearings said, and the ticks that turn a joining node serving and mark
//! a silent peer down.

use std::collections::BTreeSet;

use crate::addr::NodeId;
use crate::placement::{ClusterView, NodeState};
use crate::pool::Millis;
use crate::protocol::Heard;

use super::{Membership, Step, Timing};

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
pub(super) struct Watched {
    hearing: Hearing,
    /// The node the view places at the address, whether that node's record was up, restarting
    /// or down, and the tick that first saw it so: the node's silence counts only from then. A
    /// peer address watched long before its node started (a static peer that starts later)
    /// must not have its node marked down the moment the node's own gossip brings it into the
    /// view, nor may a restarted node that was down; a restarting node is held for the restart
    /// window from then.
    placed: Option<(u32, Presence, Millis)>,
}

/// How a watched node's record stood.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Presence {
    Up,
    Restarting,
    Down,
}

impl Presence {
    fn of(state: NodeState) -> Presence {
        match state {
            NodeState::Down => Presence::Down,
            NodeState::Restarting => Presence::Restarting,
            _ => Presence::Up,
        }
    }
}

impl Membership {
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

    /// Time passes (the heartbeats call this every heartbeat): a node resuming a restart in
    /// place decides once every node that owned keys when it left answered it (or is down) or
    /// its window ended ([`Membership::resume`]); a joining node that has pulled its peers'
    /// views for two heartbeats since the first tick turns serving; a peer address silent for
    /// `down_after` has its node (as the view knows the address) marked down, unless a peer
    /// relayed a hearing of that node within `down_after`. Silence is counted from the later
    /// of the address's last answer (or the start of watching it) and the first tick that saw
    /// its node in the view, up, at that address. A restarting node is marked down
    /// `restart_window` after the first tick that saw it restarting, whatever it answers.
    pub fn tick(&mut self, now: Millis, timing: Timing, mark: u64) -> Step {
        let mut step = Step::default();
        let first = *self.first_tick.get_or_insert(now);
        if let Some(r) = &self.resume {
            if now >= r.until || self.heard_from_owners(&r.departed) {
                step = self.resume(now, None, mark);
            }
        }
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
                let presence = Presence::of(n.state);
                let since = match w.placed {
                    Some((id, was, since)) if id == n.id && was == presence => since,
                    _ => now,
                };
                let quiet = w.hearing.at().max(since);
                let heard_of = relayed.get(&n.id).copied();
                let down = match presence {
                    Presence::Up => {
                        now.saturating_sub(quiet) >= timing.down_after
                            && heard_of.is_none_or(|at| now.saturating_sub(at) >= timing.down_after)
                    }
                    Presence::Restarting => now.saturating_sub(since) >= timing.restart_window,
                    Presence::Down => false,
                };
                // Marked down below: seen down from here, so coming back up restarts the count.
                w.placed = Some(if down {
                    (n.id, Presence::Down, now)
                } else {
                    (n.id, presence, since)
                });
                down.then_some(n.id)
            })
            .collect();
        for id in silent {
            step.changed |= self.mark_down(id, mark).changed;
        }
        step
    }

    /// Whether every other node that owned keys in `departed` answered this process's
    /// heartbeats, or is down in the view now: its view is then as new as theirs.
    fn heard_from_owners(&self, departed: &ClusterView) -> bool {
        departed
            .nodes
            .iter()
            .filter(|n| n.id != self.me && n.state.owns())
            .all(|n| match self.view.node(NodeId(n.id)) {
                Some(c) if c.state == NodeState::Down => true,
                Some(c) => self
                    .heard
                    .get(&c.tcp)
                    .is_some_and(|w| matches!(w.hearing, Hearing::Answered(_))),
                None => false,
            })
    }
}
