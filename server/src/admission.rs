//! Who gets a connection: the open-file limit and the descriptors kept in reserve, caps on
//! connections per peer address and per token, and what an accept loop does when accepting
//! fails (back off, and say so in the log at a bounded rate).

use std::collections::HashMap;
use std::hash::Hash;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Raises the soft open-file limit to the hard one; returns the soft limit now in force.
pub(crate) fn raise_fd_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, exclusively borrowed rlimit for getrlimit to fill in.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur >= lim.rlim_max {
        return Ok(lim.rlim_cur);
    }
    // An unlimited hard limit is not a valid soft one for descriptors: the kernel caps it at
    // fs.nr_open.
    let target = if lim.rlim_max == libc::RLIM_INFINITY {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
            .unwrap_or(1 << 20)
    } else {
        lim.rlim_max
    };
    let raised = libc::rlimit {
        rlim_cur: target,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: `raised` is a valid rlimit that setrlimit only reads.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(target)
}

/// The most connections the open-file limit allows once `reserve` descriptors are kept for
/// everything else (segments, cluster links, etcd, metrics): `configured`, or less. Never below
/// half the limit, so a small limit with a large reserve still serves.
pub(crate) fn connection_cap(configured: usize, fd_limit: u64, reserve: u64) -> usize {
    let room = fd_limit.saturating_sub(reserve).max(fd_limit / 2).max(1);
    configured
        .min(usize::try_from(room).unwrap_or(usize::MAX))
        .max(1)
}

/// Open connections per key (a peer's IP address, or an authenticated token's digest), capped.
pub(crate) struct Counts<K: Hash + Eq + Clone> {
    max: usize,
    open: Mutex<HashMap<K, usize>>,
}

/// One counted connection; uncounted when dropped.
pub(crate) struct Slot<K: Hash + Eq + Clone> {
    counts: Arc<Counts<K>>,
    key: K,
}

/// Connections per peer IP address (`listen.max_connections_per_peer`).
pub(crate) type PeerCounts = Counts<IpAddr>;
/// Connections per authenticated token, by its SHA-256 digest
/// (`limits.max_connections_per_token`). An entry lives while a connection holds its slot, so
/// the map never holds more entries than there are open connections.
pub(crate) type TokenCounts = Counts<[u8; 32]>;
/// One connection counted against its token.
pub(crate) type TokenSlot = Slot<[u8; 32]>;

impl<K: Hash + Eq + Clone> Counts<K> {
    /// `max` connections per key; 0 for no cap.
    pub(crate) fn new(max: usize) -> Arc<Counts<K>> {
        Arc::new(Counts {
            max,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// The cap (0: none).
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Counts a new connection of `key`, or `None` when that key is at its cap.
    pub(crate) fn enter(self: &Arc<Self>, key: K) -> Option<Slot<K>> {
        if self.max == 0 {
            return Some(Slot {
                counts: self.clone(),
                key,
            });
        }
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(key.clone()).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(Slot {
            counts: self.clone(),
            key,
        })
    }
}

impl<K: Hash + Eq + Clone> Slot<K> {
    /// What this slot is counted under.
    pub(crate) fn key(&self) -> &K {
        &self.key
    }
}

impl<K: Hash + Eq + Clone> Drop for Slot<K> {
    fn drop(&mut self) {
        if self.counts.max == 0 {
            return;
        }
        let mut open = self.counts.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// Shortest and longest pause after a failed accept.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one log line per this period about failed accepts (or refused peers).
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(5);

/// Failed accepts: how long to pause before the next (doubling while they keep failing, so a
/// listener out of descriptors waits instead of spinning) and when to say so in the log.
pub(crate) struct AcceptErrors {
    backoff: Duration,
    log: LogLimiter,
}

impl Default for AcceptErrors {
    fn default() -> Self {
        AcceptErrors {
            backoff: BACKOFF_MIN,
            log: LogLimiter::new(LOG_EVERY),
        }
    }
}

impl AcceptErrors {
    /// An accept succeeded: the next failure pauses briefly again.
    pub(crate) fn succeeded(&mut self) {
        self.backoff = BACKOFF_MIN;
    }

    /// An accept failed with `e`: logs (rate-limited) and returns how long to pause.
    pub(crate) fn failed(&mut self, e: &io::Error, listener: &str, now: Instant) -> Duration {
        self.log(e, listener, now);
        let pause = self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        pause
    }

    /// An accept failed with `e` (out of descriptors) and a connection was closed to make
    /// room: logged (rate-limited) like any failure, but the next accept is not held back.
    pub(crate) fn made_room(&mut self, e: &io::Error, listener: &str, now: Instant) {
        self.log(e, listener, now);
        self.backoff = BACKOFF_MIN;
    }

    fn log(&mut self, e: &io::Error, listener: &str, now: Instant) {
        if let Some(suppressed) = self.log.allow(now) {
            tracing::warn!(
                error = %e,
                listener,
                "accept failed ({suppressed} more since the last report)"
            );
        }
    }
}

/// Lets one event through per period and counts the rest.
pub(crate) struct LogLimiter {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl LogLimiter {
    pub(crate) fn new(every: Duration) -> LogLimiter {
        LogLimiter {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(events suppressed since the last one let through)` when this one may be logged.
    pub(crate) fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_keeps_the_reserve_and_never_raises() {
        assert_eq!(connection_cap(1024, 20_000, 64), 1024);
        assert_eq!(connection_cap(1024, 1024, 64), 960);
        assert_eq!(connection_cap(1024, 100, 64), 50, "half the limit at least");
        assert_eq!(connection_cap(1024, 0, 64), 1);
    }

    #[test]
    fn peers_are_capped_per_address_and_slots_come_back() {
        let c = PeerCounts::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let s1 = c.enter(a).unwrap();
        let _s2 = c.enter(a).unwrap();
        assert!(c.enter(a).is_none());
        let _s3 = c.enter(b).unwrap();
        drop(s1);
        assert!(c.enter(a).is_some());
        let open = PeerCounts::new(0);
        let all: Vec<_> = (0..1000).map(|_| open.enter(a).unwrap()).collect();
        assert_eq!(all.len(), 1000);
    }

    #[test]
    fn failures_back_off_and_are_logged_once_per_period() {
        let mut e = AcceptErrors::default();
        let err = io::Error::from_raw_os_error(libc::EMFILE);
        let t0 = Instant::now();
        let pauses: Vec<_> = (0..10).map(|_| e.failed(&err, "tcp", t0)).collect();
        assert_eq!(pauses[0], BACKOFF_MIN);
        assert!(pauses.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*pauses.last().unwrap(), BACKOFF_MAX);
        e.succeeded();
        assert_eq!(e.failed(&err, "tcp", t0), BACKOFF_MIN);

        let mut l = LogLimiter::new(LOG_EVERY);
        assert_eq!(l.allow(t0), Some(0));
        for _ in 0..1000 {
            assert_eq!(l.allow(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(l.allow(t0 + LOG_EVERY), Some(1000));
    }
}
