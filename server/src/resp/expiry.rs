//! `SET ... EX|PX`: keys removed at their deadline.
//!
//! The pool keeps no per-object TTL (KV blocks are evicted, not expired), so the door keeps the
//! deadlines: a table ordered by deadline, and one task that sleeps until the earliest and
//! removes that key's object, for every reader (native and Python clients included). Each entry
//! names the generation it was set for, so a later write of the key (a SET without EX, a native
//! put) is never removed by an older deadline: like Redis, a new SET clears the TTL. The table
//! is bounded (`resp.max_expiring_keys`): a SET with EX beyond it is refused, never silently
//! kept forever.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kvpool::{Millis, Pool};
use tokio::sync::{watch, Notify};

/// One deadline.
#[derive(Debug)]
struct Entry {
    ns: u32,
    key: Box<[u8]>,
    generation: u64,
}

/// The deadlines of the keys set with a TTL.
#[derive(Debug)]
pub(crate) struct Expiry {
    /// (deadline on the pool's clock, sequence) → the object to remove then.
    table: Mutex<BTreeMap<(Millis, u64), Entry>>,
    seq: std::sync::atomic::AtomicU64,
    max: usize,
    /// Wakes the sweeper when an earlier deadline arrives.
    changed: Notify,
}

/// The table is full.
#[derive(Debug, thiserror::Error)]
#[error("too many keys with a TTL pending (resp.max_expiring_keys = {0})")]
pub(crate) struct Full(pub(crate) usize);

impl Expiry {
    pub(crate) fn new(max: usize) -> Self {
        Expiry {
            table: Mutex::new(BTreeMap::new()),
            seq: Default::default(),
            max,
            changed: Notify::new(),
        }
    }

    /// Removes `key`'s object of `generation` at `at` (the pool's clock).
    pub(crate) fn add(&self, ns: u32, key: &[u8], generation: u64, at: Millis) -> Result<(), Full> {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if t.len() >= self.max {
            return Err(Full(self.max));
        }
        let earliest = t.keys().next().is_none_or(|&(first, _)| at < first);
        t.insert(
            (at, seq),
            Entry {
                ns,
                key: key.into(),
                generation,
            },
        );
        drop(t);
        if earliest {
            self.changed.notify_one();
        }
        Ok(())
    }

    /// Takes every entry due at `now`; returns the next deadline.
    fn due(&self, now: Millis, out: &mut Vec<Entry>) -> Option<Millis> {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(first) = t.first_entry() {
            if first.key().0 > now {
                return Some(first.key().0);
            }
            out.push(first.remove());
        }
        None
    }

    /// Entries pending (for `INFO`).
    pub(crate) fn len(&self) -> usize {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Removes expired keys until shutdown. `now` is the pool's clock; `at` turns one of its
/// instants into tokio's.
pub(crate) async fn sweeper(
    expiry: Arc<Expiry>,
    pool: Arc<Pool>,
    now: impl Fn() -> Millis,
    at: impl Fn(Millis) -> tokio::time::Instant,
    mut stop: watch::Receiver<bool>,
) {
    let mut due = Vec::new();
    loop {
        let next = expiry.due(now(), &mut due);
        for e in due.drain(..) {
            // Only the object the TTL was set on: a newer write of the key stays.
            let _ = pool.remove_generation(e.ns, &e.key, e.generation);
        }
        let sleep = async {
            match next {
                Some(t) => tokio::time::sleep_until(at(t)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            _ = expiry.changed.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_in_deadline_order_and_bounded() {
        let e = Expiry::new(3);
        e.add(0, b"b", 1, 20).unwrap();
        e.add(0, b"a", 2, 10).unwrap();
        e.add(0, b"c", 3, 30).unwrap();
        assert!(e.add(0, b"d", 4, 5).is_err(), "over the bound");
        let mut out = Vec::new();
        assert_eq!(e.due(20, &mut out), Some(30));
        let keys: Vec<&[u8]> = out.iter().map(|x| &*x.key).collect();
        assert_eq!(keys, [b"a".as_slice(), b"b"]);
        assert_eq!(e.len(), 1);
    }
}
