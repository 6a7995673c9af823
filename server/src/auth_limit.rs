//! Failed authentications, rate-limited per peer address: a peer may fail `burst` times in a
//! row, then once more per `refill`; beyond that its attempts are refused unchecked (the right
//! token too, or the refusal would still answer guesses) until it has waited. Over TCP and RESP
//! the peer is its IP address (QUIC's too); every Unix-socket client shares one bucket.
//!
//! Memory is bounded: at most `MAX_PEERS` addresses are tracked; past that, buckets that have
//! fully refilled are dropped (at most once per refill), and otherwise a new address shares one
//! overflow bucket, so a flood of addresses throttles itself rather than growing the map.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MAX_PEERS: usize = 16 << 10;

/// Where a peer stands.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    /// Failures not yet paid back.
    spent: u32,
    /// When the last one was paid back (or the first counted).
    since: Instant,
}

impl Bucket {
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
}

/// The node's record of failed authentications (`[limits] auth_failures`,
/// `auth_failure_refill_ms`).
pub(crate) struct AuthFailures {
    burst: u32,
    refill: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    peers: HashMap<Option<IpAddr>, Bucket>,
    overflow: Option<Bucket>,
    pruned: Option<Instant>,
}

impl AuthFailures {
    /// `burst` failures in a row, then one per `refill`; `burst` 0 turns the limit off.
    pub(crate) fn new(burst: u32, refill: Duration) -> AuthFailures {
        AuthFailures {
            burst,
            refill,
            state: Mutex::default(),
        }
    }

    /// Ok when `peer` may try to authenticate now; Err(how long until it may).
    pub(crate) fn check(&self, peer: Option<IpAddr>, now: Instant) -> Result<(), Duration> {
        if self.burst == 0 {
            return Ok(());
        }
        let mut guard = self.lock();
        let st = &mut *guard;
        let b = match st.peers.get_mut(&peer) {
            Some(b) => b,
            None => match st.overflow.as_mut() {
                Some(b) if st.peers.len() >= MAX_PEERS => b,
                _ => return Ok(()),
            },
        };
        b.settle(now, self.refill);
        if b.spent < self.burst {
            return Ok(());
        }
        Err((b.since + self.refill).saturating_duration_since(now))
    }

    /// `peer` presented a wrong token.
    pub(crate) fn failed(&self, peer: Option<IpAddr>, now: Instant) {
        if self.burst == 0 {
            return;
        }
        let refill = self.refill;
        let mut guard = self.lock();
        let st = &mut *guard;
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
        let fresh = Bucket {
            spent: 0,
            since: now,
        };
        let b = if st.peers.len() < MAX_PEERS || st.peers.contains_key(&peer) {
            st.peers.entry(peer).or_insert(fresh)
        } else {
            st.overflow.get_or_insert(fresh)
        };
        b.settle(now, refill);
        b.spent = b.spent.saturating_add(1);
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
        let f = AuthFailures::new(3, Duration::from_secs(1));
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(f.check(ip(1), t0).is_ok());
            f.failed(ip(1), t0);
        }
        let wait = f.check(ip(1), t0).unwrap_err();
        assert_eq!(wait, Duration::from_secs(1));
        assert!(f.check(ip(2), t0).is_ok(), "other peers are not affected");
        assert!(f.check(None, t0).is_ok());
        let t1 = t0 + Duration::from_millis(1500);
        assert!(f.check(ip(1), t1).is_ok(), "one try earned");
        f.failed(ip(1), t1);
        assert_eq!(
            f.check(ip(1), t1).unwrap_err(),
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
        let f = AuthFailures::new(0, Duration::from_secs(1));
        let t = Instant::now();
        for _ in 0..100 {
            f.failed(ip(1), t);
        }
        assert!(f.check(ip(1), t).is_ok());
    }

    #[test]
    fn a_flood_of_addresses_is_bounded_and_still_throttled() {
        let f = AuthFailures::new(2, Duration::from_secs(60));
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
}
