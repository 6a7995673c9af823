//! What a client remembers of where same-host objects are: (namespace, key) → address and
//! checksum, filled by its lookups and its own puts, so that a repeated get copies straight out
//! of the mapping without a lookup round trip.
//!
//! An entry is only a hint. The copy is validated against the object's version word as the
//! *current* value of its key (`seqlock::read_begin_current`): an object that was evicted,
//! removed, overwritten or moved away has a retired or detached word, so its entry reads as
//! stale, is dropped, and the key is looked up as before. A stale entry is a miss of this index,
//! never other bytes.
//!
//! The node does not see reads served this way, so they are reported to it in batches (a
//! lookup of the keys, whose answer is not needed) of [`TOUCH_BATCH`] reads, or fewer once the
//! oldest is [`TOUCH_WITHIN`] old: its eviction policy and hit counters then still count them.
//! A report goes out in the background, one at a time: the read that fills a batch does not
//! wait for the node's answer, and reads made while a report is on its way
//! join the next one (at most [`TOUCH_BACKLOG`] of them wait; beyond that the oldest go
//! unreported, as a report that fails does). A call's reads are noted from its last key to its
//! first and go in one report, which is reversed before it is sent: the node takes a `Lookup`
//! from its last key to its first, so it sees the calls in the order they were made, each tail
//! first, as it would have read them (docs/EVICTION.md, "tail first").

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::located::Located;

/// Reads served from the index are reported to the node once this many have gathered, or
/// once the oldest of them is [`TOUCH_WITHIN`] old. A report wakes the client's runtime, the
/// node and the runtime again, on the cores the readers copy on: at 256 reads a report, four
/// readers on two cores lost about a tenth of their throughput to it (BENCHMARKS.md).
pub(crate) const TOUCH_BATCH: usize = 4096;

/// The longest a read served from the index waits to be reported (checked at the next read;
/// a client that stops reading reports what it has at its next read).
pub(crate) const TOUCH_WITHIN: Duration = Duration::from_millis(100);

/// Reads waiting for a report while one is on its way, at most: a node that answers slowly
/// costs the client no more memory than this (24 bytes each, the key shared with its entry).
pub(crate) const TOUCH_BACKLOG: usize = 2 * TOUCH_BATCH;

/// Reads served from the index that the node is to be told of: (namespace, key) each, the key
/// shared with its entry.
pub(crate) type Reads = Vec<(u32, Arc<[u8]>)>;

/// The index's memory: a hash map of its entries, with eviction by *second chance* (CLOCK)
/// instead of a least-recently-used list. A read only sets its entry's `referenced` flag, in
/// the entry it has just read: no list node to follow and relink, which was a cache miss or two
/// per key out of cache, about 0.05× of a batched same-host get of 64 KiB values (BENCHMARKS.md).
/// Room is made by going round the entries in the order they came in: one read since it last
/// came round stays for another round, one not read goes.
pub(crate) struct SeenIndex {
    /// By a hash of (namespace, key); the entry keeps the key to tell collisions apart.
    map: HashMap<u64, Seen, BuildHasherDefault<Slot>>,
    /// Most entries kept (0: none).
    cap: usize,
    /// The entries in the order they came in (or came round), each with the stamp its entry
    /// had when queued: an item whose entry is gone or was replaced since is skipped.
    order: VecDeque<(u64, u64)>,
    /// The next entry's stamp.
    stamp: u64,
    /// Keys read through the index that the node has not been told of yet.
    /// Each key shares its entry's bytes: a read served from the index allocates nothing.
    touched: Vec<(u32, Arc<[u8]>)>,
    /// A report is on its way to the node.
    reporting: bool,
    /// When the oldest read in `touched` was made.
    since: Option<Instant>,
}

struct Seen {
    ns: u32,
    /// Its place in `order` (see [`SeenIndex::order`]).
    stamp: u64,
    /// Read since it last came round.
    referenced: bool,
    key: Arc<[u8]>,
    at: Located,
}

/// The map's hasher: its keys are [`slot`]s, xxh3 hashes already, used as they are (the
/// default SipHash over them was about 1 000 instructions of an 8-key batched get).
#[derive(Default)]
pub(crate) struct Slot(u64);

impl Hasher for Slot {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed (`write_u64`); anything else is folded in byte by byte, so
        // the hasher stays correct if the key type ever changes.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

fn slot(ns: u32, key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, u64::from(ns))
}

impl SeenIndex {
    /// An index of at most `entries` keys (0: none is remembered).
    pub(crate) fn new(entries: usize) -> SeenIndex {
        SeenIndex {
            map: HashMap::default(),
            cap: entries,
            order: VecDeque::new(),
            stamp: 0,
            touched: Vec::new(),
            reporting: false,
            since: None,
        }
    }

    /// Where `key` was last found, and the entry's copy of the key, which a read served from
    /// the index passes to [`SeenIndex::touch`].
    pub(crate) fn get(&mut self, ns: u32, key: &[u8]) -> Option<(Located, Arc<[u8]>)> {
        let s = self.map.get_mut(&slot(ns, key))?;
        if s.ns != ns || *s.key != *key {
            return None;
        }
        s.referenced = true;
        Some((s.at, Arc::clone(&s.key)))
    }

    pub(crate) fn insert(&mut self, ns: u32, key: &[u8], at: Located) {
        if self.cap == 0 {
            return;
        }
        let h = slot(ns, key);
        if let Some(s) = self.map.get_mut(&h) {
            // The key again (or another with the same hash, which takes its place): it keeps
            // the entry's place in the round.
            if s.ns != ns || *s.key != *key {
                s.ns = ns;
                s.key = key.into();
            }
            s.at = at;
            s.referenced = true;
            return;
        }
        while self.map.len() >= self.cap {
            self.evict_one();
        }
        let stamp = self.stamp;
        self.stamp += 1;
        let seen = Seen {
            ns,
            stamp,
            referenced: false,
            key: key.into(),
            at,
        };
        self.map.insert(h, seen);
        self.order.push_back((h, stamp));
        if self.order.len() > 2 * self.cap + 64 {
            // Items of entries forgotten or replaced since: dropped, so `order` stays within
            // twice the entries.
            let map = &self.map;
            self.order
                .retain(|(h, st)| map.get(h).is_some_and(|s| s.stamp == *st));
        }
    }

    /// Makes room for one entry: the first in the round not read since it last came round.
    fn evict_one(&mut self) {
        while let Some((h, st)) = self.order.pop_front() {
            let Some(s) = self.map.get_mut(&h).filter(|s| s.stamp == st) else {
                continue;
            };
            if s.referenced {
                s.referenced = false;
                self.order.push_back((h, st));
            } else {
                self.map.remove(&h);
                return;
            }
        }
        // Unreachable while every entry has its item in `order`; a safe way out regardless.
        self.map.clear();
    }

    /// Forgets `key` if the entry is still the one that was found stale.
    pub(crate) fn forget(&mut self, ns: u32, key: &[u8], at: &Located) {
        let h = slot(ns, key);
        if self
            .map
            .get(&h)
            .is_some_and(|s| s.ns == ns && *s.key == *key && s.at.addr == at.addr)
        {
            self.map.remove(&h);
        }
    }

    /// Notes a read served from the index; returns the batch to report once it is full, or its
    /// oldest read [`TOUCH_WITHIN`] old, and no report is on its way (the caller sends it,
    /// then calls [`SeenIndex::reported`]). `key` is the entry's own copy, from
    /// [`SeenIndex::get`]: a read allocates nothing.
    pub(crate) fn touch(&mut self, ns: u32, key: Arc<[u8]>) -> Option<Reads> {
        self.touch_at(ns, [key], Instant::now)
    }

    /// [`SeenIndex::touch`] for the reads of one call, in the order the node should see them:
    /// they go in one report, never split between two.
    pub(crate) fn touch_all(
        &mut self,
        ns: u32,
        keys: impl IntoIterator<Item = Arc<[u8]>>,
    ) -> Option<Reads> {
        self.touch_at(ns, keys, Instant::now)
    }

    /// [`SeenIndex::touch_all`] with the clock passed in (`now` is read only when the batch is
    /// short of full: at most once per call while it is small, then once per 64 reads).
    fn touch_at(
        &mut self,
        ns: u32,
        keys: impl IntoIterator<Item = Arc<[u8]>>,
        now: impl Fn() -> Instant,
    ) -> Option<Reads> {
        let had = self.touched.len();
        for key in keys {
            if self.touched.len() >= TOUCH_BACKLOG {
                // The node has not answered the last report for a while: the oldest batch's
                // worth of reads waiting go unreported.
                self.touched.drain(..TOUCH_BATCH);
            }
            self.touched.push((ns, key));
        }
        let n = self.touched.len();
        if n == 0 {
            return None;
        }
        if had == 0 {
            self.since = Some(now());
        }
        if self.reporting {
            return None;
        }
        let due = n >= TOUCH_BATCH
            || ((n < 64 || n / 64 != had / 64)
                && self
                    .since
                    .is_some_and(|t| now().saturating_duration_since(t) >= TOUCH_WITHIN));
        if !due {
            return None;
        }
        self.reporting = true;
        self.since = None;
        Some(std::mem::take(&mut self.touched))
    }

    /// The report [`SeenIndex::touch`] handed out is done (sent, failed or abandoned).
    pub(crate) fn reported(&mut self) {
        self.reporting = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool::{GlobalAddr, NodeId};

    fn at(offset: u64) -> Located {
        Located {
            addr: GlobalAddr {
                node: NodeId(1),
                incarnation: 1,
                segment: 0,
                offset,
                len: 10,
                generation: offset + 1,
                key: 0,
            },
            checksum: offset,
        }
    }

    #[test]
    fn entries_are_per_namespace_and_key_and_bounded() {
        let mut s = SeenIndex::new(2);
        s.insert(0, b"a", at(1));
        s.insert(1, b"a", at(2));
        assert_eq!(s.get(0, b"a").map(|(l, _)| l.checksum), Some(1));
        assert_eq!(s.get(1, b"a").map(|(l, _)| l.checksum), Some(2));
        s.insert(0, b"b", at(3));
        assert_eq!(s.get(0, b"a"), None, "the first in the round went: both were read since they came in, so it came round twice");
        assert_eq!(s.get(1, b"a").map(|(l, _)| l.checksum), Some(2));
        assert_eq!(s.get(0, b"c"), None);
    }

    #[test]
    fn forgetting_a_stale_entry_keeps_a_newer_one() {
        let mut s = SeenIndex::new(8);
        s.insert(0, b"k", at(1));
        s.insert(0, b"k", at(2));
        s.forget(0, b"k", &at(1));
        assert_eq!(s.get(0, b"k").map(|(l, _)| l.checksum), Some(2));
        s.forget(0, b"k", &at(2));
        assert_eq!(s.get(0, b"k"), None);
    }

    #[test]
    fn an_index_of_no_entries_remembers_nothing_and_touches_come_in_batches() {
        let mut s = SeenIndex::new(0);
        s.insert(0, b"k", at(1));
        assert_eq!(s.get(0, b"k"), None);
        // One instant throughout: only the count can make a batch due.
        let t0 = Instant::now();
        for i in 0..TOUCH_BATCH - 1 {
            assert!(s
                .touch_at(0, [Arc::from(&i.to_le_bytes()[..])], || t0)
                .is_none());
        }
        assert_eq!(
            s.touch_at(0, [Arc::from(&b"last"[..])], || t0)
                .map(|b| b.len()),
            Some(TOUCH_BATCH)
        );
    }

    #[test]
    fn a_batch_short_of_full_goes_once_its_oldest_read_is_old_enough() {
        let mut s = SeenIndex::new(8);
        let t0 = Instant::now();
        let key = |i: u32| Arc::from(&i.to_le_bytes()[..]);
        assert!(s.touch_at(0, [key(1)], || t0).is_none());
        let soon = t0 + TOUCH_WITHIN / 2;
        assert!(s.touch_at(0, [key(2)], || soon).is_none(), "not yet due");
        let late = t0 + TOUCH_WITHIN;
        let batch = s.touch_at(0, [key(3)], || late).expect("due by age");
        assert_eq!(batch.len(), 3);
        // The next batch's age counts from its own first read, and waits for the report.
        assert!(s.touch_at(0, [key(4)], || late).is_none());
        let later = late + 2 * TOUCH_WITHIN;
        assert!(
            s.touch_at(0, [key(5)], || later).is_none(),
            "one report at a time"
        );
        s.reported();
        let next = s
            .touch_at(0, [key(6)], || later)
            .expect("due once the report is done");
        assert_eq!(next.len(), 3);
    }

    #[test]
    fn one_calls_reads_go_in_one_report_in_the_order_given() {
        let mut s = SeenIndex::new(8);
        let t0 = Instant::now();
        let key = |i: u32| Arc::<[u8]>::from(&i.to_le_bytes()[..]);
        assert!(s.touch_at(0, [key(3), key(2)], || t0).is_none());
        let late = t0 + TOUCH_WITHIN;
        let batch = s
            .touch_at(1, [key(9), key(8), key(7)], || late)
            .expect("due by age");
        let got: Vec<(u32, Arc<[u8]>)> = vec![
            (0, key(3)),
            (0, key(2)),
            (1, key(9)),
            (1, key(8)),
            (1, key(7)),
        ];
        assert_eq!(
            batch, got,
            "the whole call, after the earlier one, as given"
        );
    }

    #[test]
    fn one_report_at_a_time_and_a_bounded_backlog_meanwhile() {
        let mut s = SeenIndex::new(8);
        let mut n = 0u32;
        let t0 = Instant::now();
        let mut touch = |s: &mut SeenIndex| {
            n += 1;
            s.touch_at(0, [Arc::from(&n.to_le_bytes()[..])], || t0)
        };
        let first: Vec<_> = (0..TOUCH_BATCH).filter_map(|_| touch(&mut s)).collect();
        assert_eq!(first.len(), 1, "a full batch is handed out");
        // While it is on its way, reads wait: none is handed out, at most the backlog is kept.
        for _ in 0..3 * TOUCH_BACKLOG {
            assert!(touch(&mut s).is_none());
        }
        s.reported();
        let next = touch(&mut s).expect("the backlog goes with the next read");
        assert!((TOUCH_BACKLOG - TOUCH_BATCH..=TOUCH_BACKLOG).contains(&next.len()));
        let newest = (3 * TOUCH_BACKLOG + TOUCH_BATCH + 1) as u32;
        assert!(
            next.iter().any(|(_, k)| k[..] == newest.to_le_bytes()),
            "the newest read is kept, the oldest went"
        );
        assert!(!next
            .iter()
            .any(|(_, k)| k[..] == (TOUCH_BATCH as u32 + 1).to_le_bytes()));
        assert!(touch(&mut s).is_none(), "again one report at a time");
    }

    proptest::proptest! {
        /// Against a model (a map of what was inserted and not forgotten): a get returns
        /// either nothing or exactly the latest location inserted for that key, never another
        /// key's or an older one; the just-inserted key is always found; at most `cap` entries
        /// are kept; and with room for every key, nothing is ever lost.
        #[test]
        fn the_index_returns_the_latest_location_or_nothing(
            cap in 1usize..12,
            ops in proptest::collection::vec((0u8..3, 0u32..2, 0u8..20, 0u64..1000), 1..400),
        ) {
            for roomy in [false, true] {
                let cap = if roomy { 64 } else { cap };
                let mut s = SeenIndex::new(cap);
                let mut model: std::collections::HashMap<(u32, u8), Located> = Default::default();
                for &(op, ns, k, v) in &ops {
                    let key = [k];
                    match op {
                        0 => {
                            s.insert(ns, &key, at(v));
                            model.insert((ns, k), at(v));
                            proptest::prop_assert_eq!(s.get(ns, &key).map(|(l, _)| l), Some(at(v)));
                        }
                        1 => {
                            let got = s.get(ns, &key).map(|(l, _)| l);
                            let want = model.get(&(ns, k)).copied();
                            if roomy {
                                proptest::prop_assert_eq!(got, want);
                            } else if got.is_some() {
                                proptest::prop_assert_eq!(got, want, "a wrong location");
                            }
                        }
                        _ => {
                            // Forget with the stale location the model holds (a no-op when
                            // the index holds another).
                            if let Some(l) = model.remove(&(ns, k)) {
                                s.forget(ns, &key, &l);
                            }
                            proptest::prop_assert_eq!(s.get(ns, &key).map(|(l, _)| l), None);
                        }
                    }
                    proptest::prop_assert!(s.map.len() <= cap);
                    proptest::prop_assert!(s.order.len() <= 2 * cap + 64);
                }
            }
        }
    }
}
