//! Handoff notifications (docs/HANDOFF.md): connections that watch keys (`Watch`) or key
//! prefixes (`Subscribe`) are sent an event when one is committed, or when its producer posts a
//! tombstone (`Fail`), so a consumer learns of a handoff's blocks without polling.
//!
//! The pool tells [`Watches`] of every commit (it is the pool's [`CommitObserver`]), with the
//! key's index shard locked: a consumer that reads the key after the event finds it. The
//! registry's own lock is taken under the shard's and never the other way round (a `Watch`
//! registers first, then looks the keys up), and with nothing watched or failed a commit costs
//! two atomic loads.
//!
//! Each watching connection has a bounded channel of events. A connection that does not read
//! them fast enough loses the ones that do not fit and is sent one `Lagged` event instead: it
//! must check what it watches again. Memory is bounded: keys watched per connection
//! (`max_watches_per_connection`), prefixes per connection (the same bound), and tombstones
//! (at most [`MAX_TOMBSTONES`], each kept `tombstone_ms`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvpool::protocol::ErrorCode;
use kvpool::{CommitObserver, Millis};
use tokio::sync::mpsc;

/// Events waiting to be written to one connection before it counts as lagging.
const EVENTS_PER_CONNECTION: usize = 4096;

/// Tombstones kept at most (the oldest go first).
pub(crate) const MAX_TOMBSTONES: usize = 1 << 16;

/// Longest reason kept with a tombstone, bytes.
pub(crate) const MAX_REASON: usize = 1024;

/// Longest prefix a connection may subscribe to, bytes.
pub(crate) const MAX_PREFIX: usize = 256;

/// What a watching connection is told.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) ns: u32,
    pub(crate) key: Box<[u8]>,
    pub(crate) code: ErrorCode,
    pub(crate) reason: String,
}

/// A namespace and key as one byte string: the namespace id's 4 little-endian bytes, then the
/// key. Maps of them are looked up by a slice built on the stack (see [`on_stack`]), so a commit
/// allocates nothing to find its watchers.
type NsKey = Box<[u8]>;

/// A leased key: its namespace and its bytes (handed back as they are when the lease lapses).
type LeaseKey = (u32, Box<[u8]>);

fn ns_key(ns: u32, key: &[u8]) -> NsKey {
    [&ns.to_le_bytes()[..], key].concat().into_boxed_slice()
}

/// Runs `f` on `ns` and `key` as one [`NsKey`] slice, built in a stack buffer (keys the pool
/// accepts fit; a longer one, which no commit has, is built on the heap).
fn on_stack<R>(ns: u32, key: &[u8], f: impl FnOnce(&[u8]) -> R) -> R {
    let mut buf = [0u8; 4 + kvpool::MAX_KEY_LEN];
    match buf.get_mut(4..4 + key.len()) {
        Some(dst) => {
            dst.copy_from_slice(key);
            buf[..4].copy_from_slice(&ns.to_le_bytes());
            f(&buf[..4 + key.len()])
        }
        None => f(&ns_key(ns, key)),
    }
}

struct Sink {
    tx: mpsc::Sender<Event>,
    lagged: Arc<AtomicBool>,
}

impl Sink {
    fn send(&self, ns: u32, key: &[u8], code: ErrorCode, reason: &str) {
        let ev = Event {
            ns,
            key: key.into(),
            code,
            reason: reason.to_owned(),
        };
        if self.tx.try_send(ev).is_err() {
            self.lagged.store(true, Ordering::Release);
        }
    }
}

/// Most objects under a handoff lease at once, per node (an `Expire` beyond it is refused).
pub(crate) const MAX_LEASES: usize = 1 << 20;

#[derive(Default)]
struct Inner {
    /// Handoff leases: per key, when it lapses.
    leases: HashMap<LeaseKey, Millis>,
    /// The leases by lapse time (entries of renewed or ended leases stay until they come up,
    /// and are skipped then).
    lease_order: std::collections::BTreeMap<(Millis, u64), LeaseKey>,
    lease_seq: u64,
    next_id: u64,
    sinks: HashMap<u64, Sink>,
    /// Watched keys and the connections watching each.
    keys: HashMap<NsKey, Vec<u64>>,
    /// Subscriptions: (connection, namespace, prefix).
    prefixes: Vec<(u64, u32, Box<[u8]>)>,
    /// Tombstones: reason and when it lapses.
    tombstones: HashMap<NsKey, (String, Millis)>,
    /// Tombstones in the order they were posted, to drop the oldest first.
    tomb_order: VecDeque<(NsKey, Millis)>,
}

/// The node's watches and tombstones.
pub(crate) struct Watches {
    /// Watched keys plus subscriptions, over every connection.
    active: AtomicUsize,
    /// Tombstones held.
    tombs: AtomicUsize,
    tombstone_ms: Millis,
    inner: Mutex<Inner>,
}

/// One connection's place in the registry: its events, and its watches, all ended on drop.
pub(crate) struct Registration {
    watches: Arc<Watches>,
    id: u64,
    pub(crate) rx: mpsc::Receiver<Event>,
    lagged: Arc<AtomicBool>,
    /// Keys and prefixes this connection watches.
    pub(crate) watched: usize,
}

impl Registration {
    /// Whether events were dropped since the last call (and clears it).
    pub(crate) fn take_lagged(&self) -> bool {
        self.lagged.swap(false, Ordering::AcqRel)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.watches.forget(self.id);
    }
}

impl Watches {
    pub(crate) fn new(tombstone_ms: Millis) -> Watches {
        Watches {
            active: AtomicUsize::new(0),
            tombs: AtomicUsize::new(0),
            tombstone_ms,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new connection's registration (made on its first watch).
    pub(crate) fn register(self: &Arc<Self>) -> Registration {
        let (tx, rx) = mpsc::channel(EVENTS_PER_CONNECTION);
        let lagged = Arc::new(AtomicBool::new(false));
        let mut inner = self.lock();
        inner.next_id += 1;
        let id = inner.next_id;
        inner.sinks.insert(
            id,
            Sink {
                tx,
                lagged: lagged.clone(),
            },
        );
        Registration {
            watches: self.clone(),
            id,
            rx,
            lagged,
            watched: 0,
        }
    }

    /// Watches `key` for `r` (no-op when it already does); returns whether it is new.
    pub(crate) fn watch(&self, r: &mut Registration, ns: u32, key: &[u8]) -> bool {
        let mut inner = self.lock();
        let conns = inner.keys.entry(ns_key(ns, key)).or_default();
        if conns.contains(&r.id) {
            return false;
        }
        conns.push(r.id);
        r.watched += 1;
        self.active.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Stops `r` watching `key`; returns whether it did.
    pub(crate) fn unwatch(&self, r: &mut Registration, ns: u32, key: &[u8]) -> bool {
        let mut inner = self.lock();
        let k = ns_key(ns, key);
        let Some(conns) = inner.keys.get_mut(&k) else {
            return false;
        };
        let Some(i) = conns.iter().position(|c| *c == r.id) else {
            return false;
        };
        conns.swap_remove(i);
        if conns.is_empty() {
            inner.keys.remove(&k);
        }
        r.watched -= 1;
        self.active.fetch_sub(1, Ordering::AcqRel);
        true
    }

    /// Subscribes `r` to every key of `ns` starting with `prefix`.
    pub(crate) fn subscribe(&self, r: &mut Registration, ns: u32, prefix: &[u8]) {
        let mut inner = self.lock();
        if inner
            .prefixes
            .iter()
            .any(|(c, n, p)| *c == r.id && *n == ns && &**p == prefix)
        {
            return;
        }
        inner.prefixes.push((r.id, ns, prefix.into()));
        r.watched += 1;
        self.active.fetch_add(1, Ordering::AcqRel);
    }

    /// Sends one event to `r`'s connection alone (a tombstone found by its `Watch`, with its
    /// reason).
    pub(crate) fn tell_one(
        &self,
        r: &Registration,
        ns: u32,
        key: &[u8],
        code: ErrorCode,
        reason: &str,
    ) {
        if let Some(s) = self.lock().sinks.get(&r.id) {
            s.send(ns, key, code, reason);
        }
    }

    /// Ends every watch of connection `id`.
    fn forget(&self, id: u64) {
        let mut inner = self.lock();
        inner.sinks.remove(&id);
        let mut ended = 0;
        inner.keys.retain(|_, conns| {
            let before = conns.len();
            conns.retain(|c| *c != id);
            ended += before - conns.len();
            !conns.is_empty()
        });
        let before = inner.prefixes.len();
        inner.prefixes.retain(|(c, ..)| *c != id);
        ended += before - inner.prefixes.len();
        self.active.fetch_sub(ended, Ordering::AcqRel);
    }

    /// The reason of `key`'s tombstone, if it has one still in force at `now`.
    pub(crate) fn tombstone(&self, ns: u32, key: &[u8], now: Millis) -> Option<String> {
        if self.tombs.load(Ordering::Acquire) == 0 {
            return None;
        }
        let inner = self.lock();
        let (reason, until) = on_stack(ns, key, |k| inner.tombstones.get(k))?;
        (*until > now).then(|| reason.clone())
    }

    /// Posts a tombstone for `key` (replacing an older one) and tells its watchers.
    pub(crate) fn fail(&self, ns: u32, key: &[u8], reason: &str, now: Millis) {
        let reason = cut(reason, MAX_REASON);
        let until = now.saturating_add(self.tombstone_ms);
        let mut inner = self.lock();
        let k = ns_key(ns, key);
        // Lapsed ones first, then the oldest while over the bound.
        while let Some((old, at)) = inner.tomb_order.front() {
            let lapsed = *at <= now;
            let over = inner.tombstones.len() >= MAX_TOMBSTONES
                || inner.tomb_order.len() >= 2 * MAX_TOMBSTONES;
            if !lapsed && !over {
                break;
            }
            let old = old.clone();
            let at = *at;
            inner.tomb_order.pop_front();
            if inner.tombstones.get(&old).is_some_and(|(_, u)| *u == at) {
                inner.tombstones.remove(&old);
            }
        }
        inner
            .tombstones
            .insert(k.clone(), (reason.to_owned(), until));
        inner.tomb_order.push_back((k, until));
        self.tombs.store(inner.tombstones.len(), Ordering::Release);
        inner.tell(ns, key, ErrorCode::Failed, reason);
    }
}

impl Inner {
    /// Sends the event to every connection watching `key` or a prefix of it.
    fn tell(&self, ns: u32, key: &[u8], code: ErrorCode, reason: &str) {
        if let Some(conns) = on_stack(ns, key, |k| self.keys.get(k)) {
            for c in conns {
                if let Some(s) = self.sinks.get(c) {
                    s.send(ns, key, code, reason);
                }
            }
        }
        for (c, n, p) in &self.prefixes {
            if *n == ns && key.starts_with(p) {
                if let Some(s) = self.sinks.get(c) {
                    s.send(ns, key, code, reason);
                }
            }
        }
    }
}

impl CommitObserver for Watches {
    fn committed(&self, ns: u32, key: &[u8]) {
        if self.active.load(Ordering::Acquire) == 0 && self.tombs.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut inner = self.lock();
        if self.tombs.load(Ordering::Acquire) > 0
            && on_stack(ns, key, |k| inner.tombstones.remove(k)).is_some()
        {
            // The producer wrote it after all: the tombstone is over.
            self.tombs.store(inner.tombstones.len(), Ordering::Release);
        }
        inner.tell(ns, key, ErrorCode::Ok, "");
    }
}

impl Watches {
    /// Leases `key` until `until` (replacing its lease), whether or not it is written yet;
    /// `until` None ends the lease. False when the node holds [`MAX_LEASES`] already.
    pub(crate) fn lease(&self, ns: u32, key: &[u8], until: Option<Millis>) -> bool {
        let mut inner = self.lock();
        let k: LeaseKey = (ns, key.into());
        let Some(until) = until else {
            inner.leases.remove(&k);
            return true;
        };
        if !inner.leases.contains_key(&k)
            && (inner.leases.len() >= MAX_LEASES || inner.lease_order.len() >= 2 * MAX_LEASES)
        {
            return false;
        }
        inner.lease_seq += 1;
        let seq = inner.lease_seq;
        inner.leases.insert(k.clone(), until);
        inner.lease_order.insert((until, seq), k);
        true
    }

    /// The leases lapsed by `now`, taken out: (namespace, key) of each object to remove.
    pub(crate) fn lapsed(&self, now: Millis) -> Vec<(u32, Box<[u8]>)> {
        let mut inner = self.lock();
        let mut out = Vec::new();
        while let Some(entry) = inner.lease_order.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((at, _), k) = entry.remove_entry();
            // Only if this entry is the key's current lease (not one renewed or ended since).
            if inner.leases.get(&k) == Some(&at) {
                inner.leases.remove(&k);
                out.push(k);
            }
        }
        out
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn watchers_hear_commits_and_tombstones_until_they_go() {
        let w = Arc::new(Watches::new(1000));
        let mut a = w.register();
        let mut b = w.register();
        assert!(w.watch(&mut a, 0, b"k"));
        assert!(
            !w.watch(&mut a, 0, b"k"),
            "a second watch of a key is the same"
        );
        w.subscribe(&mut b, 0, b"k");
        w.committed(0, b"k");
        w.committed(1, b"k"); // another namespace
        w.committed(0, b"other");
        let ev = a.rx.recv().await.unwrap();
        assert_eq!((ev.ns, &*ev.key, ev.code), (0, &b"k"[..], ErrorCode::Ok));
        assert_eq!(b.rx.recv().await.unwrap().code, ErrorCode::Ok);
        assert!(a.rx.try_recv().is_err() && b.rx.try_recv().is_err());

        w.fail(0, b"k", "prefill died", 10);
        let ev = a.rx.recv().await.unwrap();
        assert_eq!(
            (ev.code, ev.reason.as_str()),
            (ErrorCode::Failed, "prefill died")
        );
        assert_eq!(w.tombstone(0, b"k", 500).as_deref(), Some("prefill died"));
        assert_eq!(w.tombstone(0, b"k", 1010), None, "lapsed");
        w.committed(0, b"k");
        assert_eq!(w.tombstone(0, b"k", 500), None, "a commit ends it");
        assert_eq!(a.rx.recv().await.unwrap().code, ErrorCode::Ok);

        assert!(w.unwatch(&mut a, 0, b"k"));
        drop(b);
        assert_eq!(w.active.load(Ordering::Acquire), 0);
        w.committed(0, b"k");
        assert!(a.rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn keys_of_every_length_are_found_and_namespaces_kept_apart() {
        let w = Arc::new(Watches::new(1000));
        let mut a = w.register();
        let long = vec![b'x'; kvpool::MAX_KEY_LEN + 1]; // looked up on the heap
        for key in [&b""[..], b"k", &[b'y'; kvpool::MAX_KEY_LEN], &long] {
            assert!(w.watch(&mut a, 7, key));
            w.committed(8, key);
            w.committed(7, key);
            let ev = a.rx.recv().await.unwrap();
            assert_eq!((ev.ns, &*ev.key), (7, key));
            assert!(a.rx.try_recv().is_err());
        }
    }

    #[tokio::test]
    async fn a_slow_reader_lags_instead_of_growing_memory() {
        let w = Arc::new(Watches::new(1000));
        let mut a = w.register();
        w.subscribe(&mut a, 0, b"");
        for i in 0..EVENTS_PER_CONNECTION + 10 {
            w.committed(0, format!("k{i}").as_bytes());
        }
        assert!(a.take_lagged());
        assert!(!a.take_lagged());
        let mut n = 0;
        while a.rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(n, EVENTS_PER_CONNECTION);
    }

    #[test]
    fn leases_lapse_once_unless_renewed_or_ended() {
        let w = Watches::new(1000);
        assert!(w.lease(0, b"a", Some(100)));
        assert!(w.lease(0, b"b", Some(100)));
        assert!(w.lease(0, b"c", Some(100)));
        assert!(w.lease(0, b"b", Some(300))); // renewed
        assert!(w.lease(0, b"c", None)); // ended
        assert!(w.lapsed(99).is_empty());
        assert_eq!(w.lapsed(100), vec![(0, Box::from(&b"a"[..]))]);
        assert!(w.lapsed(200).is_empty());
        assert_eq!(w.lapsed(1000), vec![(0, Box::from(&b"b"[..]))]);
        assert!(w.lock().lease_order.is_empty() && w.lock().leases.is_empty());
    }

    #[test]
    fn tombstones_are_bounded_and_reasons_cut() {
        let w = Watches::new(1_000_000);
        for i in 0..MAX_TOMBSTONES + 5 {
            w.fail(0, format!("k{i}").as_bytes(), &"x".repeat(2000), 1);
        }
        assert_eq!(w.lock().tombstones.len(), MAX_TOMBSTONES);
        assert_eq!(w.tombstone(0, b"k0", 2), None, "the oldest went first");
        let r = w.tombstone(0, format!("k{}", MAX_TOMBSTONES + 4).as_bytes(), 2);
        assert_eq!(r.map(|r| r.len()), Some(MAX_REASON));
    }
}
