//! Failed authentications, rate-limited per peer address and across the node.
//!
//! Per address: a peer may fail `burst` times in a row, then once more per `refill`; beyond
//! that its attempts are refused unchecked (the right token too, or the refusal would still
//! answer guesses) until it has waited. Over TCP and RESP the peer is its IP address (QUIC's
//! too); every Unix-socket client shares one bucket.
//!
//! Across the node: at most `per_second` failures per second are checked, a second's worth in a
//! burst, however many addresses they come from. While that budget is spent, an attempt is
//! checked only when its address has no failure outstanding (every failure paid back, one per
//! `refill`, or none at all); the others are refused unchecked. So a flood of guesses from many
//! addresses is checked at the budget's rate plus one guess per address per `refill`, and never
//! locks out a client that has not failed: its address has nothing outstanding.
//!
//! Memory is bounded: at most `MAX_PEERS` addresses are tracked; past that, buckets that have
//! fully refilled are dropped (at most once per refill), and otherwise a new address shares one
//! overflow bucket, so a flood of addresses throttles itself rather than growing the map.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MAX_PEERS: usize = 16 << 10;

/// Where a peer (or the node, for its budget) stands.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    /// Failures not yet paid back.
    spent: u32,
    /// When the last one was paid back (or the first counted).
    since: Instant,
}

impl Bucket {
    fn new(now: Instant) -> Bucket {
        Bucket {
            spent: 0,
            since: now,
        }
    }

    /// Pays back what `refill` has earned by `now`.
    fn settle(&mut self, now: Instant, refill: Duration) {
        if self.spent == 0 || refill.is_zero() {
            self.spent = 0;
            self.since = now;
            return;
        }
        let earned = now.saturating_duration_since(self.since).as_nanos() / refill.as_nanos();
        let earned = u32::try_from(earned).unwrap_or(u32::MAX);
        if earned >= self.spent {
            self.spent = 0;
            self.since = now;
        } else {
            self.spent -= earned;
            self.since += refill * earned;
        }
    }

    /// How long from `now` until `n` more failures are paid back.
    fn paid_back_in(&self, n: u32, now: Instant, refill: Duration) -> Duration {
        self.since
            .checked_add(refill.saturating_mul(n))
            .map_or(Duration::MAX, |t| t.saturating_duration_since(now))
    }
}

/// Why an attempt was refused unchecked, and when to try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Throttled {
    /// How long until an attempt from the same address would be checked.
    pub(crate) wait: Duration,
    /// The node-wide budget was spent (and the address had failed recently), rather than the
    /// address's own allowance.
    pub(crate) node_wide: bool,
}

/// The node's record of failed authentications of one kind (tokens: `[limits] auth_failures`,
/// `auth_failure_refill_ms`, `auth_failures_per_second`; cluster proofs:
/// `cluster_auth_failures_per_second`).
pub(crate) struct AuthFailures {
    /// Failures in a row one address may have outstanding; 0: no per-address limit.
    burst: u32,
    refill: Duration,
    /// Failures checked per second across the node; 0: no node-wide budget.
    per_second: u32,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    peers: HashMap<Option<IpAddr>, Bucket>,
    overflow: Option<Bucket>,
    pruned: Option<Instant>,
    /// The node-wide budget: `spent` failures of `per_second`, paid back one per
    /// `1 s / per_second`.
    node: Option<Bucket>,
}

impl AuthFailures {
    /// `burst` failures in a row per address, then one per `refill` (`burst` 0: no per-address
    /// limit), and at most `per_second` failures checked per second across the node (0: no
    /// such budget).
    pub(crate) fn new(burst: u32, refill: Duration, per_second: u32) -> AuthFailures {
        AuthFailures {
            burst,
            refill,
            per_second,
            state: Mutex::default(),
        }
    }

    /// Ok when an attempt of `peer` may be checked now.
    pub(crate) fn check(&self, peer: Option<IpAddr>, now: Instant) -> Result<(), Throttled> {
        if self.burst == 0 && self.per_second == 0 {
            return Ok(());
        }
        let mut guard = self.lock();
        let st = &mut *guard;
        let node_spent = self.node_spent(st, now);
        let node_room = st.node.map_or(Duration::ZERO, |n| {
            n.paid_back_in(1, now, self.node_refill())
        });
        let b = match st.peers.get_mut(&peer) {
            Some(b) => b,
            None => match st.overflow.as_mut() {
                Some(b) if st.peers.len() >= MAX_PEERS => b,
                // Never failed (or paid back and forgotten): always checked.
                _ => return Ok(()),
            },
        };
        b.settle(now, self.refill);
        if self.burst > 0 && b.spent >= self.burst {
            return Err(Throttled {
                wait: b.paid_back_in(1, now, self.refill),
                node_wide: false,
            });
        }
        if node_spent && b.spent > 0 {
            let fresh_in = b.paid_back_in(b.spent, now, self.refill);
            return Err(Throttled {
                wait: node_room.min(fresh_in),
                node_wide: true,
            });
        }
        Ok(())
    }

    /// `peer` failed to authenticate (a wrong token, a wrong proof).
    pub(crate) fn failed(&self, peer: Option<IpAddr>, now: Instant) {
        if self.burst == 0 && self.per_second == 0 {
            return;
        }
        let refill = self.refill;
        let mut guard = self.lock();
        let st = &mut *guard;
        if self.per_second > 0 {
            let node_refill = self.node_refill();
            let node = st.node.get_or_insert(Bucket::new(now));
            node.settle(now, node_refill);
            node.spent = node.spent.saturating_add(1).min(self.per_second);
        }
        // Pruning scans every bucket: at most once per refill, so that a flood of new
        // addresses costs a scan per refill, not one per failure.
        let due = st
            .pruned
            .is_none_or(|p| now.saturating_duration_since(p) >= refill);
        if !st.peers.contains_key(&peer) && st.peers.len() >= MAX_PEERS && due {
            st.pruned = Some(now);
            st.peers.retain(|_, b| {
                b.settle(now, refill);
                b.spent > 0
            });
        }
        let b = if st.peers.len() < MAX_PEERS || st.peers.contains_key(&peer) {
            st.peers.entry(peer).or_insert(Bucket::new(now))
        } else {
            st.overflow.get_or_insert(Bucket::new(now))
        };
        b.settle(now, refill);
        b.spent = b.spent.saturating_add(1);
    }

    /// Whether the node-wide budget is spent at `now`.
    fn node_spent(&self, st: &mut State, now: Instant) -> bool {
        let refill = self.node_refill();
        match st.node.as_mut() {
            Some(node) if self.per_second > 0 => {
                node.settle(now, refill);
                node.spent >= self.per_second
            }
            _ => false,
        }
    }

    /// How long the node-wide budget takes to earn back one failure.
    fn node_refill(&self) -> Duration {
        Duration::from_secs(1) / self.per_second.max(1)
    }

    /// Addresses tracked now (tests).
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.lock().peers.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding it cannot leave a bucket half-updated in a way that matters.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u32) -> Option<IpAddr> {
        Some(IpAddr::V4(std::net::Ipv4Addr::from(n)))
    }

    #[test]
    fn a_peer_gets_its_burst_then_one_try_per_refill() {
        let f = AuthFailures::new(3, Duration::from_secs(1), 0);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(f.check(ip(1), t0).is_ok());
            f.failed(ip(1), t0);
        }
        let refused = f.check(ip(1), t0).unwrap_err();
        assert_eq!(refused.wait, Duration::from_secs(1));
        assert!(!refused.node_wide);
        assert!(f.check(ip(2), t0).is_ok(), "other peers are not affected");
        assert!(f.check(None, t0).is_ok());
        let t1 = t0 + Duration::from_millis(1500);
        assert!(f.check(ip(1), t1).is_ok(), "one try earned");
        f.failed(ip(1), t1);
        assert_eq!(
            f.check(ip(1), t1).unwrap_err().wait,
            Duration::from_millis(500),
            "the next one is due a full refill after the last paid back"
        );
        let later = t0 + Duration::from_secs(10);
        assert!(f.check(ip(1), later).is_ok());
        for _ in 0..3 {
            f.failed(ip(1), later);
        }
        assert!(f.check(ip(1), later).is_err(), "a full bucket again");
    }

    #[test]
    fn zero_burst_is_off() {
        let f = AuthFailures::new(0, Duration::from_secs(1), 0);
        let t = Instant::now();
        for _ in 0..100 {
            f.failed(ip(1), t);
        }
        assert!(f.check(ip(1), t).is_ok());
    }

    #[test]
    fn a_flood_of_addresses_is_bounded_and_still_throttled() {
        let f = AuthFailures::new(2, Duration::from_secs(60), 0);
        let t = Instant::now();
        for n in 0..(MAX_PEERS as u32 + 1000) {
            f.failed(ip(n), t);
            f.failed(ip(n), t);
        }
        assert_eq!(f.tracked(), MAX_PEERS);
        assert!(f.check(ip(5), t).is_err(), "a tracked address");
        assert!(
            f.check(ip(MAX_PEERS as u32 + 10), t).is_err(),
            "an address in the overflow bucket"
        );
        // Once the tracked buckets have refilled, new addresses get buckets of their own.
        let later = t + Duration::from_secs(3600);
        f.failed(ip(u32::MAX), later);
        assert!(f.check(ip(u32::MAX), later).is_ok());
        assert!(f.tracked() < MAX_PEERS);
    }

    /// Tries `attempts` authentications of `peer` at `now`, each a failure when checked;
    /// returns how many were checked.
    fn guess(f: &AuthFailures, peer: Option<IpAddr>, attempts: u32, now: Instant) -> u32 {
        let mut checked = 0;
        for _ in 0..attempts {
            if f.check(peer, now).is_ok() {
                f.failed(peer, now);
                checked += 1;
            }
        }
        checked
    }

    #[test]
    fn a_flood_from_many_addresses_is_checked_within_the_node_budget() {
        // Each address may fail 10 times in a row; the node checks 20 failures a second.
        let f = AuthFailures::new(10, Duration::from_secs(60), 20);
        let t = Instant::now();
        let checked: u32 = (1..=40).map(|a| guess(&f, ip(a), 10, t)).sum();
        // The budget's 20, then only each address's first failure (it had none outstanding).
        assert_eq!(
            checked,
            20 + (40 - 2),
            "20 from the first two addresses, 1 from the rest"
        );
        let refused = f.check(ip(7), t).unwrap_err();
        assert!(refused.node_wide);
        assert_eq!(
            refused.wait,
            Duration::from_millis(50),
            "one failure earned back"
        );
        // An address that never failed is checked, and admitted with the right token.
        assert!(f.check(ip(1000), t).is_ok());
        assert!(
            f.check(None, t).is_ok(),
            "the Unix socket's clients had not failed"
        );
        // A second later the budget is whole again: 20 more are checked, from any address.
        let later = t + Duration::from_secs(1);
        let checked: u32 = (1..=40).map(|a| guess(&f, ip(a), 10, later)).sum();
        assert_eq!(checked, 20);
    }

    #[test]
    fn with_the_budget_spent_an_address_is_checked_again_once_its_failures_are_paid_back() {
        let f = AuthFailures::new(10, Duration::from_secs(1), 5);
        let t = Instant::now();
        assert_eq!(guess(&f, ip(1), 5, t), 5, "the budget");
        assert!(f.check(ip(1), t).unwrap_err().node_wide);
        // Others keep the budget spent; ip(1)'s 5 failures are paid back one a second.
        let spend = |at: Instant| {
            for a in 100..120 {
                guess(&f, ip(a), 1, at);
            }
        };
        let t4 = t + Duration::from_secs(4);
        spend(t4);
        let refused = f.check(ip(1), t4).unwrap_err();
        assert!(refused.node_wide);
        let t5 = t + Duration::from_secs(5);
        spend(t5);
        assert!(f.check(ip(1), t5).is_ok(), "nothing outstanding: checked");
        f.failed(ip(1), t5);
        assert!(f.check(ip(1), t5).is_err(), "one failure outstanding again");
    }

    #[test]
    fn a_budget_without_a_per_address_limit_still_spares_a_fresh_address() {
        // ClusterAuth's: no per-address allowance, 20 failed proofs a second.
        let f = AuthFailures::new(0, Duration::from_secs(1), 20);
        let t = Instant::now();
        assert_eq!(
            guess(&f, ip(1), 200, t),
            20,
            "one peer: the budget, then nothing"
        );
        assert!(f.check(ip(2), t).is_ok(), "a peer that never failed");
        let off = AuthFailures::new(0, Duration::from_secs(1), 0);
        assert_eq!(guess(&off, ip(1), 200, t), 200, "both limits off");
    }

    #[test]
    fn past_the_tracked_addresses_the_overflow_bucket_decides_freshness() {
        let f = AuthFailures::new(0, Duration::from_secs(60), 1);
        let t = Instant::now();
        for n in 0..(MAX_PEERS as u32 + 1) {
            f.failed(ip(n), t);
        }
        assert_eq!(f.tracked(), MAX_PEERS);
        // An untracked address shares the overflow bucket, which has a failure outstanding.
        assert!(f.check(ip(u32::MAX - 1), t).unwrap_err().node_wide);
    }
}
