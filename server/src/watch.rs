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
//! must check what it watches again. Memory is bounded through the resource ledger: keys and
//! prefixes watched per connection and per namespace (charged by the handler), handoff leases
//! and tombstones per namespace (charged here, each tombstone kept `tombstone_ms`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvpool::protocol::ErrorCode;
use kvpool::{CommitObserver, Millis};

use crate::ledger::{Ledger, Refused, Resource};
use tokio::sync::mpsc;

/// Events waiting to be written to one connection before it counts as lagging.
const EVENTS_PER_CONNECTION: usize = 4096;

/// Heap bytes one watch takes besides its key (the table entries, the connection list, the
/// key's reference count), for [`crate::trim`].
const WATCH_OVERHEAD: usize = 128;

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

/// A connection's subscription to a prefix: (connection, prefix).
type Subscription = (u64, Box<[u8]>);

/// When a lease or tombstone lapses, made unique by a sequence number: its place in the
/// order they lapse in.
type Lapse = (Millis, u64);

#[derive(Default)]
struct Inner {
    /// Handoff leases: per key, when it lapses.
    leases: HashMap<LeaseKey, Lapse>,
    /// The leases by lapse time: exactly one entry per lease.
    lease_order: BTreeMap<Lapse, LeaseKey>,
    /// Numbers leases' and tombstones' lapses.
    seq: u64,
    next_id: u64,
    sinks: HashMap<u64, Sink>,
    /// Watched keys and the connections watching each (each connection's registration holds
    /// the same keys, to end its watches without walking everyone's).
    keys: HashMap<Arc<[u8]>, Vec<u64>>,
    /// Subscriptions by namespace.
    prefixes: HashMap<u32, Vec<Subscription>>,
    /// Tombstones: reason and when it lapses.
    tombstones: HashMap<NsKey, (String, Lapse)>,
    /// The tombstones by lapse time: exactly one entry per tombstone.
    tomb_order: BTreeMap<Lapse, NsKey>,
}

impl Inner {
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Takes connection `id` off the watchers of `k`.
    fn end_watch(&mut self, k: &[u8], id: u64) {
        if let Some(conns) = self.keys.get_mut(k) {
            conns.retain(|c| *c != id);
            if conns.is_empty() {
                self.keys.remove(k);
            }
        }
    }
}

/// The namespace of an [`NsKey`].
fn ns_of(k: &[u8]) -> u32 {
    let mut id = [0u8; 4];
    id.copy_from_slice(&k[..4]);
    u32::from_le_bytes(id)
}

/// The node's watches, handoff leases and tombstones.
pub(crate) struct Watches {
    /// Watched keys plus subscriptions, over every connection.
    active: AtomicUsize,
    /// Tombstones held.
    tombs: AtomicUsize,
    tombstone_ms: Millis,
    /// Where leases and tombstones are charged, per namespace.
    ledger: Arc<Ledger>,
    /// Told of the memory a connection's watches free when it closes.
    trim: Arc<crate::trim::Trim>,
    inner: Mutex<Inner>,
}

/// One connection's place in the registry: its events, and its watches, all ended on drop.
pub(crate) struct Registration {
    watches: Arc<Watches>,
    id: u64,
    pub(crate) rx: mpsc::Receiver<Event>,
    lagged: Arc<AtomicBool>,
    /// The keys it watches (as [`NsKey`]s).
    keys: HashSet<Arc<[u8]>>,
    /// The namespace of each prefix it subscribed to.
    subscribed: Vec<u32>,
}

impl Registration {
    /// Whether events were dropped since the last call (and clears it).
    pub(crate) fn take_lagged(&self) -> bool {
        self.lagged.swap(false, Ordering::AcqRel)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let keys = std::mem::take(&mut self.keys);
        let subscribed = std::mem::take(&mut self.subscribed);
        self.watches.forget(self.id, keys, subscribed);
    }
}

impl Watches {
    pub(crate) fn new(
        tombstone_ms: Millis,
        ledger: Arc<Ledger>,
        trim: Arc<crate::trim::Trim>,
    ) -> Watches {
        Watches {
            active: AtomicUsize::new(0),
            tombs: AtomicUsize::new(0),
            tombstone_ms,
            ledger,
            trim,
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
            keys: HashSet::new(),
            subscribed: Vec::new(),
        }
    }

    /// Watches `key` for `r` (no-op when it already does); returns whether it is new.
    pub(crate) fn watch(&self, r: &mut Registration, ns: u32, key: &[u8]) -> bool {
        if on_stack(ns, key, |k| r.keys.contains(k)) {
            return false;
        }
        let mut inner = self.lock();
        let k: Arc<[u8]> = match on_stack(ns, key, |k| inner.keys.get_key_value(k)) {
            Some((k, _)) => k.clone(),
            None => ns_key(ns, key).into(),
        };
        inner.keys.entry(k.clone()).or_default().push(r.id);
        r.keys.insert(k);
        self.active.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Stops `r` watching `key`; returns whether it did.
    pub(crate) fn unwatch(&self, r: &mut Registration, ns: u32, key: &[u8]) -> bool {
        let Some(k) = on_stack(ns, key, |k| r.keys.take(k)) else {
            return false;
        };
        self.lock().end_watch(&k, r.id);
        self.active.fetch_sub(1, Ordering::AcqRel);
        true
    }

    /// Subscribes `r` to every key of `ns` starting with `prefix`; returns whether it is new.
    pub(crate) fn subscribe(&self, r: &mut Registration, ns: u32, prefix: &[u8]) -> bool {
        let mut inner = self.lock();
        let subs = inner.prefixes.entry(ns).or_default();
        if subs.iter().any(|(c, p)| *c == r.id && &**p == prefix) {
            return false;
        }
        subs.push((r.id, prefix.into()));
        r.subscribed.push(ns);
        self.active.fetch_add(1, Ordering::AcqRel);
        true
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

    /// Ends every watch of connection `id`: its `keys` and its subscriptions in
    /// `subscribed`, walking only those.
    fn forget(&self, id: u64, keys: HashSet<Arc<[u8]>>, mut subscribed: Vec<u32>) {
        let mut inner = self.lock();
        inner.sinks.remove(&id);
        for k in &keys {
            inner.end_watch(k, id);
        }
        let mut ended = keys.len();
        subscribed.sort_unstable();
        subscribed.dedup();
        for ns in subscribed {
            if let Some(subs) = inner.prefixes.get_mut(&ns) {
                let before = subs.len();
                subs.retain(|(c, _)| *c != id);
                ended += before - subs.len();
                if subs.is_empty() {
                    inner.prefixes.remove(&ns);
                }
            }
        }
        self.active.fetch_sub(ended, Ordering::AcqRel);
        // The table keeps the room it grew to: give it back once it is mostly empty, so that a
        // crowd of watchers that came and went leaves no memory behind.
        if inner.keys.capacity() > 4 * inner.keys.len().max(1024) {
            inner.keys.shrink_to_fit();
        }
        drop(inner);
        // About what each watch took: its key, the key's entry and the registration's.
        let freed: usize = keys.iter().map(|k| k.len() + WATCH_OVERHEAD).sum();
        drop(keys);
        self.trim.released(freed as u64);
    }

    /// The reason of `key`'s tombstone, if it has one still in force at `now`.
    pub(crate) fn tombstone(&self, ns: u32, key: &[u8], now: Millis) -> Option<String> {
        if self.tombs.load(Ordering::Acquire) == 0 {
            return None;
        }
        let inner = self.lock();
        let (reason, (until, _)) = on_stack(ns, key, |k| inner.tombstones.get(k))?;
        (*until > now).then(|| reason.clone())
    }

    /// Posts a tombstone for each of `keys` (replacing an older one) and tells their
    /// watchers; refused whole when the namespace would hold more than its bound.
    pub(crate) fn fail<'k>(
        &self,
        ns: u32,
        keys: impl Iterator<Item = &'k [u8]> + Clone,
        reason: &str,
        now: Millis,
    ) -> Result<(), Refused> {
        let reason = cut(reason, MAX_REASON);
        let until = now.saturating_add(self.tombstone_ms);
        let mut inner = self.lock();
        self.prune_tombstones(&mut inner, now);
        let fresh = keys
            .clone()
            .filter(|k| on_stack(ns, k, |k| !inner.tombstones.contains_key(k)))
            .count();
        self.ledger
            .charge_namespace(ns, Resource::Tombstones, fresh as u64)?;
        let mut added = 0;
        for key in keys {
            let seq = inner.next_seq();
            let k = ns_key(ns, key);
            let stone = (reason.to_owned(), (until, seq));
            match inner.tombstones.insert(k.clone(), stone) {
                Some((_, old)) => drop(inner.tomb_order.remove(&old)),
                None => added += 1,
            }
            inner.tomb_order.insert((until, seq), k);
            inner.tell(ns, key, ErrorCode::Failed, reason);
        }
        // A key named twice was counted twice.
        let extra = fresh as u64 - added;
        self.ledger
            .release_namespace(ns, Resource::Tombstones, extra);
        self.tombs.store(inner.tombstones.len(), Ordering::Release);
        Ok(())
    }

    /// Drops the tombstones lapsed by `now`.
    fn prune_tombstones(&self, inner: &mut Inner, now: Millis) {
        while let Some(entry) = inner.tomb_order.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let k = entry.remove();
            inner.tombstones.remove(&k);
            self.ledger
                .release_namespace(ns_of(&k), Resource::Tombstones, 1);
        }
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
        for (c, p) in self.prefixes.get(&ns).into_iter().flatten() {
            if key.starts_with(p) {
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
        if self.tombs.load(Ordering::Acquire) > 0 {
            if let Some((_, lapse)) = on_stack(ns, key, |k| inner.tombstones.remove(k)) {
                // The producer wrote it after all: the tombstone is over.
                inner.tomb_order.remove(&lapse);
                self.ledger.release_namespace(ns, Resource::Tombstones, 1);
                self.tombs.store(inner.tombstones.len(), Ordering::Release);
            }
        }
        inner.tell(ns, key, ErrorCode::Ok, "");
    }
}

impl Watches {
    /// Leases each of `keys` until `until` (replacing its lease), whether or not it is
    /// written yet; `until` None ends their leases. Refused whole when the new leases would
    /// take the namespace past its bound.
    pub(crate) fn lease<'k>(
        &self,
        ns: u32,
        keys: impl Iterator<Item = &'k [u8]> + Clone,
        until: Option<Millis>,
    ) -> Result<(), Refused> {
        let mut inner = self.lock();
        let Some(until) = until else {
            for key in keys {
                if let Some(lapse) = inner.leases.remove(&(ns, key.into())) {
                    inner.lease_order.remove(&lapse);
                    self.ledger.release_namespace(ns, Resource::Leases, 1);
                }
            }
            return Ok(());
        };
        let fresh = keys
            .clone()
            .filter(|k| !inner.leases.contains_key(&(ns, Box::from(*k))))
            .count();
        self.ledger
            .charge_namespace(ns, Resource::Leases, fresh as u64)?;
        let mut added = 0;
        for key in keys {
            let k: LeaseKey = (ns, key.into());
            let seq = inner.next_seq();
            match inner.leases.insert(k.clone(), (until, seq)) {
                Some(old) => drop(inner.lease_order.remove(&old)),
                None => added += 1,
            }
            inner.lease_order.insert((until, seq), k);
        }
        // A key named twice was counted twice.
        let extra = fresh as u64 - added;
        self.ledger.release_namespace(ns, Resource::Leases, extra);
        Ok(())
    }

    /// The leases lapsed by `now`, taken out: (namespace, key) of each object to remove.
    pub(crate) fn lapsed(&self, now: Millis) -> Vec<(u32, Box<[u8]>)> {
        let mut inner = self.lock();
        let mut out = Vec::new();
        while let Some(entry) = inner.lease_order.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let k = entry.remove();
            inner.leases.remove(&k);
            self.ledger.release_namespace(k.0, Resource::Leases, 1);
            out.push(k);
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

    fn one(key: &[u8]) -> impl Iterator<Item = &[u8]> + Clone {
        std::iter::once(key)
    }

    fn watches(tombstone_ms: Millis, per_namespace: u64) -> Watches {
        let bounds = crate::ledger::Bounds::uniform(0, per_namespace);
        let ledger = Ledger::new(&bounds, &[1 << 20, 1 << 20]);
        Watches::new(tombstone_ms, ledger, Default::default())
    }

    #[tokio::test]
    async fn watchers_hear_commits_and_tombstones_until_they_go() {
        let w = Arc::new(watches(1000, 100));
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

        w.fail(0, [&b"k"[..]].into_iter(), "prefill died", 10)
            .unwrap();
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
        let w = Arc::new(watches(1000, 100));
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
        let w = Arc::new(watches(1000, 100));
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
        let w = watches(1000, 3);
        w.lease(0, one(b"a"), Some(100)).unwrap();
        w.lease(0, one(b"b"), Some(100)).unwrap();
        w.lease(0, one(b"c"), Some(100)).unwrap();
        w.lease(0, one(b"b"), Some(300)).unwrap(); // renewed: still one lease
        w.lease(1, one(b"a"), Some(100)).unwrap(); // another namespace's bound
        let e = w.lease(0, one(b"d"), Some(100)).unwrap_err();
        assert_eq!(e.limit, crate::ledger::Limit::LeasesPerNamespace);
        w.lease(0, one(b"c"), None).unwrap(); // ended: its room is free again
        w.lease(0, one(b"d"), Some(100)).unwrap();
        w.lease(0, one(b"d"), None).unwrap();
        assert!(w.lapsed(99).is_empty());
        assert_eq!(
            w.lapsed(100),
            vec![(0, Box::from(&b"a"[..])), (1, Box::from(&b"a"[..]))]
        );
        assert!(w.lapsed(200).is_empty());
        assert_eq!(w.lapsed(1000), vec![(0, Box::from(&b"b"[..]))]);
        assert!(w.lock().lease_order.is_empty() && w.lock().leases.is_empty());
        assert_eq!(w.ledger.total(Resource::Leases), 0);
    }

    #[test]
    fn a_key_named_twice_in_one_request_is_charged_once() {
        let w = watches(1000, 10);
        let twice = [&b"a"[..], b"a", b"b"];
        w.lease(0, twice.iter().copied(), Some(100)).unwrap();
        w.fail(0, twice.iter().copied(), "x", 1).unwrap();
        assert_eq!(w.ledger.total(Resource::Leases), 2);
        assert_eq!(w.ledger.total(Resource::Tombstones), 2);
        w.lease(0, twice.iter().copied(), None).unwrap();
        assert_eq!(w.ledger.total(Resource::Leases), 0);
    }

    #[test]
    fn renewing_a_lease_or_a_tombstone_takes_no_more_room() {
        let w = watches(1_000_000, 2);
        for at in 0..1000 {
            w.lease(0, one(b"a"), Some(10 + at)).unwrap();
            w.fail(0, [&b"t"[..]].into_iter(), "again", at).unwrap();
        }
        let inner = w.lock();
        assert_eq!((inner.lease_order.len(), inner.tomb_order.len()), (1, 1));
    }

    #[test]
    fn tombstones_are_bounded_per_namespace_and_reasons_cut() {
        let w = watches(1000, 4);
        let keys = |from: usize, to: usize| {
            (from..to)
                .map(|i| format!("k{i}").into_bytes())
                .collect::<Vec<_>>()
        };
        let four = keys(0, 4);
        w.fail(0, four.iter().map(|k| &k[..]), &"x".repeat(2000), 1)
            .unwrap();
        let two = keys(4, 6);
        let e = w
            .fail(0, two.iter().map(|k| &k[..]), "more", 1)
            .unwrap_err();
        assert_eq!(e.limit, crate::ledger::Limit::TombstonesPerNamespace);
        assert_eq!(w.tombstone(0, b"k4", 2), None, "refused whole");
        assert_eq!(w.tombstone(0, b"k0", 2).map(|r| r.len()), Some(MAX_REASON));
        // Another namespace has room of its own; a commit, or time, frees a namespace's.
        w.fail(1, two.iter().map(|k| &k[..]), "other", 1).unwrap();
        w.committed(0, b"k0");
        w.fail(0, [&b"k4"[..]].into_iter(), "more", 1).unwrap();
        w.fail(0, two.iter().map(|k| &k[..]), "later", 2000)
            .unwrap();
        assert_eq!(w.tombstone(0, b"k1", 2000), None, "lapsed");
        assert_eq!(
            w.ledger.total(Resource::Tombstones),
            2,
            "the lapsed ones left"
        );
    }
}
