//! `s3fifo`: S3-FIFO (Yang et al., SOSP'23) with an adaptive small-queue share.
//!
//! New objects enter the *small* FIFO. When the small FIFO is over its share, its oldest object
//! leaves: to the *main* FIFO if it was touched since it came in, otherwise out (its fingerprint
//! goes to the small ghost list). The main FIFO evicts its oldest object unless it was touched,
//! in which case it goes round again with one touch fewer (at most 3 are counted). An object
//! re-inserted while its fingerprint is in a ghost list goes straight to main, and moves the
//! small FIFO's share: towards more room for newcomers when the small ghost hit (they were
//! evicted too early), towards less when the main ghost hit.
//!
//! With [`S3FifoConfig::main_lru`] (the `s3fifo-lru` policy, kvpool's default) the main queue is
//! kept in recency order instead: a touched object moves to its back at once, and main evicts its
//! least recently used object. Small, ghosts and the adaptive share are unchanged. Prefix
//! workloads need it: a conversation or an agent rereads all its blocks on every turn, so they
//! collect the maximum count, then the conversation ends and they are dead; the paper's main FIFO
//! gives each of them `max_freq` more rounds, crowding out the live conversations (2 to 3 points
//! below LRU on such workloads, where recency order loses nothing). The small FIFO still keeps
//! the blocks seen once from flushing main, which is most of what S3-FIFO wins on scans.
//!
//! A sharded index runs one instance per shard, built together by [`S3Fifo::shards`]: they share
//! the queue lengths, the ghost lengths and the small FIFO's target through atomics, so the
//! namespace adapts as one policy over all its objects (a shard alone sees a few dozen objects
//! and would swing its target by whole percents on every ghost hit) and every shard evicts from
//! the FIFO the namespace as a whole is evicting from. Queues and ghosts stay per shard: a key's
//! object and its ghost live in the shard of its key. A ghost entry ages by the evictions of the
//! whole namespace (a shared sequence number), not of its shard, so the shards' ghosts together
//! remember exactly the fingerprints one ghost list would; aging them per shard blurs the edge
//! of the window, which on the public trace costs half a point at 1 000 blocks in 8 shards.

use std::collections::{HashMap, VecDeque};

use super::list::{Links, List};
use super::{Eviction, Handle, Insert, OUT_OF_TURN, SCAN};
use crate::paged::Paged;
use crate::sync::{Arc, AtomicU64, Ordering::Relaxed};

/// Parameters of [`S3Fifo`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct S3FifoConfig {
    /// Initial share of the small FIFO. Default 0.5.
    pub small_share: f64,
    /// Each ghost list remembers this many times as many fingerprints as objects are held.
    /// Default 2.
    pub ghost_factor: f64,
    /// Touches counted per object. Default 3.
    pub max_freq: u8,
    /// Keep the main queue in recency order: an object touched in main moves to its back at
    /// once, and main evicts its least recently used object. Off (the paper's S3-FIFO: main is
    /// a FIFO in which touched objects go round again, up to `max_freq` times) for `s3fifo`, on
    /// for `s3fifo-lru`. See [`S3Fifo`] for why.
    pub main_lru: bool,
}

impl Default for S3FifoConfig {
    fn default() -> Self {
        S3FifoConfig {
            small_share: 0.5,
            ghost_factor: 2.0,
            max_freq: 3,
            main_lru: false,
        }
    }
}

const SMALL: u8 = 0;
const MAIN: u8 = 1;

/// Adaptive S3-FIFO.
#[derive(Debug)]
pub struct S3Fifo {
    cfg: S3FifoConfig,
    links: Links,
    small: List,
    main: List,
    freq: Paged<u8>,
    fingerprint: Paged<u64>,
    /// When each object entered its current place in its FIFO (insertion, promotion to main,
    /// or another round in main): the FIFO order, in pool-wide ticks.
    stamp: Paged<u64>,
    ghost_small: Ghost,
    ghost_main: Ghost,
    /// What the instances over the other shards of the namespace see too.
    shared: Arc<Shared>,
}

/// The state the S3-FIFO instances of one namespace share across index shards: totals over all
/// of them, updated with relaxed atomics (a stale read only delays a decision by an eviction).
#[derive(Debug)]
struct Shared {
    small: AtomicU64,
    main: AtomicU64,
    /// Per ghost list (small, main): fingerprints remembered, and fingerprints ever pushed (the
    /// sequence number entries age by).
    ghost_len: [AtomicU64; 2],
    ghost_seq: [AtomicU64; 2],
    /// Target length of the small FIFO over all shards, in objects; [`UNSET`] until the first
    /// eviction fixes it from `small_share`.
    target: AtomicU64,
}

const UNSET: u64 = u64::MAX;

impl Shared {
    fn new() -> Self {
        Shared {
            small: AtomicU64::new(0),
            main: AtomicU64::new(0),
            ghost_len: [AtomicU64::new(0), AtomicU64::new(0)],
            ghost_seq: [AtomicU64::new(0), AtomicU64::new(0)],
            target: AtomicU64::new(UNSET),
        }
    }

    fn queue(&self, id: u8) -> &AtomicU64 {
        if id == SMALL {
            &self.small
        } else {
            &self.main
        }
    }

    /// Objects held over all shards.
    fn len(&self) -> u64 {
        self.small.load(Relaxed) + self.main.load(Relaxed)
    }

    /// The small FIFO's target, or what the first eviction will fix it to.
    fn target(&self, small_share: f64) -> u64 {
        match self.target.load(Relaxed) {
            UNSET => ((self.len() as f64) * small_share).max(1.0) as u64,
            t => t,
        }
    }

    /// Moves the target by `f`, which sees the current target (half the objects while unset)
    /// and the number of objects.
    fn steer(&self, f: impl Fn(u64, u64) -> u64) {
        let len = self.len().max(1);
        let _ = self.target.fetch_update(Relaxed, Relaxed, |t| {
            Some(f(if t == UNSET { len / 2 } else { t }, len))
        });
    }

    /// The FIFO the namespace evicts from now.
    fn turn(&self, small_share: f64) -> u8 {
        let small = self.small.load(Relaxed);
        if small > 0 && (small >= self.target(small_share) || self.main.load(Relaxed) == 0) {
            SMALL
        } else {
            MAIN
        }
    }
}

impl Default for S3Fifo {
    fn default() -> Self {
        S3Fifo::new(S3FifoConfig::default())
    }
}

impl S3Fifo {
    /// An empty policy over a whole namespace.
    pub fn new(cfg: S3FifoConfig) -> Self {
        S3Fifo::with_shared(cfg, Arc::new(Shared::new()))
    }

    /// `n` empty instances for the `n` shards of one namespace, adapting together.
    pub fn shards(cfg: S3FifoConfig, n: usize) -> Vec<S3Fifo> {
        let shared = Arc::new(Shared::new());
        (0..n)
            .map(|_| S3Fifo::with_shared(cfg, Arc::clone(&shared)))
            .collect()
    }

    fn with_shared(cfg: S3FifoConfig, shared: Arc<Shared>) -> Self {
        S3Fifo {
            cfg,
            links: Links::default(),
            small: List::new(SMALL),
            main: List::new(MAIN),
            freq: Paged::default(),
            fingerprint: Paged::default(),
            stamp: Paged::default(),
            ghost_small: Ghost::default(),
            ghost_main: Ghost::default(),
            shared,
        }
    }

    /// How many of the namespace's latest evictions from one FIFO its ghost list remembers.
    fn ghost_cap(&self) -> u64 {
        ((self.shared.len() as f64) * self.cfg.ghost_factor).ceil() as u64
    }

    fn ghost(&mut self, id: u8) -> &mut Ghost {
        if id == SMALL {
            &mut self.ghost_small
        } else {
            &mut self.ghost_main
        }
    }

    /// The FIFO this shard evicts from next, and whether that is the namespace's turn: when
    /// this shard holds nothing in the FIFO the namespace evicts from, it offers the other one,
    /// out of turn.
    fn next_queue(&self) -> Option<(u8, bool)> {
        let turn = self.shared.turn(self.cfg.small_share);
        let other = if turn == SMALL { MAIN } else { SMALL };
        if self.list(turn).len() > 0 {
            Some((turn, true))
        } else if self.list(other).len() > 0 {
            Some((other, false))
        } else {
            None
        }
    }

    /// The object to evict under S3-FIFO's rules; see [`Stop`] for why there may be none.
    fn scan(
        &mut self,
        evictable: &mut dyn FnMut(Handle) -> bool,
        tick: u64,
        bound: u64,
    ) -> Result<Handle, Stop> {
        // Promotions and second chances are bounded by the freq counters; the budget bounds
        // them further, and skipping unevictable objects (moved to the back) too.
        let mut queue = None;
        for _ in 0..SCAN * 4 {
            let (id, _) = self.next_queue().ok_or(Stop::Budget)?;
            // `bound` ranks a candidate of the FIFO the scan began in: when the namespace turns
            // to the other FIFO, the candidates of every shard must be compared afresh.
            if self.peek_stamp().ok_or(Stop::Budget)? > bound
                || (bound != u64::MAX && *queue.get_or_insert(id) != id)
            {
                return Err(Stop::Bound);
            }
            let h = self.list(id).front().ok_or(Stop::Budget)?;
            let i = h as usize;
            if !evictable(h) {
                self.stamp[i] = tick;
                self.move_to_back(id, h);
            } else if self.freq[i] > 0 {
                self.stamp[i] = tick;
                if id == SMALL {
                    self.freq[i] = 0;
                    self.unlink(SMALL, h);
                    self.push(MAIN, h);
                } else {
                    self.freq[i] -= 1;
                    self.move_to_back(MAIN, h);
                }
            } else {
                self.unlink(id, h);
                let fp = self.fingerprint[i];
                self.remember(id, fp);
                return Ok(h);
            }
        }
        Err(Stop::Budget)
    }

    fn list(&self, id: u8) -> &List {
        if id == SMALL {
            &self.small
        } else {
            &self.main
        }
    }

    fn list_mut(&mut self, id: u8) -> &mut List {
        if id == SMALL {
            &mut self.small
        } else {
            &mut self.main
        }
    }

    /// Appends `h` to FIFO `id`, counting it in the namespace's totals.
    fn push(&mut self, id: u8, h: Handle) {
        let mut list = *self.list(id);
        self.links.push_back(&mut list, h);
        *self.list_mut(id) = list;
        self.shared.queue(id).fetch_add(1, Relaxed);
    }

    /// Takes `h` out of FIFO `id`, counting it out of the namespace's totals.
    fn unlink(&mut self, id: u8, h: Handle) {
        let mut list = *self.list(id);
        self.links.remove(&mut list, h);
        *self.list_mut(id) = list;
        self.shared.queue(id).fetch_sub(1, Relaxed);
    }

    fn move_to_back(&mut self, id: u8, h: Handle) {
        let mut list = *self.list(id);
        self.links.move_to_back(&mut list, h);
        *self.list_mut(id) = list;
    }

    /// Puts the fingerprint of an object evicted from FIFO `id` in that FIFO's ghost list.
    fn remember(&mut self, id: u8, fp: u64) {
        let cap = self.ghost_cap();
        let seq = self.shared.ghost_seq[id as usize].fetch_add(1, Relaxed) + 1;
        let ghost = self.ghost(id);
        let before = ghost.len() as u64;
        ghost.push(fp, seq);
        ghost.expire(seq, cap);
        let after = ghost.len() as u64;
        self.count_ghosts(id, before, after);
    }

    /// Forgets `fp` from ghost list `id`; true when it was there.
    fn recall(&mut self, id: u8, fp: u64) -> bool {
        let cap = self.ghost_cap();
        let now = self.shared.ghost_seq[id as usize].load(Relaxed);
        let ghost = self.ghost(id);
        let before = ghost.len() as u64;
        let hit = ghost.take(fp, now, cap);
        // Other shards' evictions aged this list since it last expired anything.
        ghost.expire(now, cap);
        let after = ghost.len() as u64;
        self.count_ghosts(id, before, after);
        hit
    }

    fn count_ghosts(&self, id: u8, before: u64, after: u64) {
        let total = &self.shared.ghost_len[id as usize];
        if after > before {
            total.fetch_add(after - before, Relaxed);
        } else if after < before {
            total.fetch_sub(before - after, Relaxed);
        }
    }
}

impl Eviction for S3Fifo {
    fn insert(&mut self, h: Handle, info: Insert) {
        let i = h as usize;
        self.freq.grow_to(i + 1, 0);
        self.fingerprint.grow_to(i + 1, 0);
        self.freq[i] = 0;
        self.fingerprint[i] = info.fingerprint;
        super::set_stamp(&mut self.stamp, h, info.tick);
        let ghost = if self.recall(SMALL, info.fingerprint) {
            Some(SMALL)
        } else if self.recall(MAIN, info.fingerprint) {
            Some(MAIN)
        } else {
            None
        };
        let s = &self.shared;
        let small_ghosts = s.ghost_len[SMALL as usize].load(Relaxed);
        let main_ghosts = s.ghost_len[MAIN as usize].load(Relaxed);
        match ghost {
            Some(SMALL) => {
                // Evicted from small too early: give newcomers more room.
                let step = (main_ghosts / small_ghosts.max(1)).max(1);
                s.steer(|t, len| (t + step).min(len));
                self.push(MAIN, h);
            }
            Some(_) => {
                let step = (small_ghosts / main_ghosts.max(1)).max(1);
                s.steer(|t, _| t.saturating_sub(step).max(1));
                self.push(MAIN, h);
            }
            None => self.push(SMALL, h),
        }
    }

    fn access(&mut self, h: Handle, tick: u64) {
        if self.cfg.main_lru && self.links.list_of(h) == Some(MAIN) {
            self.stamp[h as usize] = tick;
            self.move_to_back(MAIN, h);
            return;
        }
        if let Some(f) = self.freq.get_mut(h as usize) {
            *f = (*f + 1).min(self.cfg.max_freq);
        }
    }

    fn remove(&mut self, h: Handle) {
        if let Some(id) = self.links.list_of(h) {
            self.unlink(id, h);
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle> {
        self.victim_below(evictable, tick, u64::MAX)
    }

    fn victim_below(
        &mut self,
        evictable: &mut dyn FnMut(Handle) -> bool,
        tick: u64,
        bound: u64,
    ) -> Option<Handle> {
        let first = ((self.shared.len() as f64) * self.cfg.small_share).max(1.0) as u64;
        let _ = self
            .shared
            .target
            .compare_exchange(UNSET, first, Relaxed, Relaxed);
        match self.scan(evictable, tick, bound) {
            Ok(h) => return Some(h),
            Err(Stop::Bound) => return None,
            Err(Stop::Budget) => {}
        }
        // Out of budget: take the first evictable object in plain FIFO order. With main in
        // recency order, main first: its front is its least recently used object, a victim
        // S3-FIFO could pick, while the budget may have run out promoting a long run of reused
        // objects at the small FIFO's head (a large cache, read back in bursts), the next of
        // which is no victim of S3-FIFO at all. Evicting it cost `s3fifo-lru` up to 1.2 points
        // against LRU at 10 000–30 000 blocks (docs/EVICTION.md); the promotions done stay
        // done, so the next eviction goes on from there.
        let order = if self.cfg.main_lru {
            [MAIN, SMALL]
        } else {
            [SMALL, MAIN]
        };
        for id in order {
            for _ in 0..SCAN.min(self.list(id).len()) {
                let h = self.list(id).front()?;
                if evictable(h) {
                    self.unlink(id, h);
                    return Some(h);
                }
                self.stamp[h as usize] = tick;
                self.move_to_back(id, h);
            }
        }
        None
    }

    fn peek_stamp(&self) -> Option<u64> {
        let (id, in_turn) = self.next_queue()?;
        let h = self.list(id).front()?;
        let stamp = self.stamp[h as usize];
        Some(if in_turn { stamp } else { stamp | OUT_OF_TURN })
    }

    /// Objects that proved their reuse (in the main queue, or read again in the small one)
    /// above the rest, each by its last stamp.
    fn worth(&self, h: Handle) -> u64 {
        let i = h as usize;
        let stamp = self.stamp.get(i).copied().unwrap_or(0);
        let reused =
            self.links.list_of(h) == Some(MAIN) || self.freq.get(i).is_some_and(|&f| f > 0);
        stamp | (u64::from(reused) << 62)
    }

    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }
}

/// Why a scan found no victim.
enum Stop {
    /// The next object ranks above the caller's bound: another shard's candidate goes first.
    Bound,
    /// Nothing evictable within the scan budget (or nothing at all).
    Budget,
}

/// The fingerprints of the latest evictions from one FIFO, with membership tests. Entries carry
/// the sequence number of their eviction; one is remembered while fewer than `cap` evictions
/// came after it. The sequence is the namespace's, so the ghost lists of all its shards together
/// remember the latest `cap`.
#[derive(Debug, Default)]
struct Ghost {
    order: VecDeque<(u64, u64)>,
    latest: HashMap<u64, u64>,
}

impl Ghost {
    /// Fingerprints held (some may have aged out since the last [`Ghost::expire`]).
    fn len(&self) -> usize {
        self.latest.len()
    }

    fn push(&mut self, fp: u64, seq: u64) {
        self.order.push_back((fp, seq));
        self.latest.insert(fp, seq);
    }

    /// Drops the entries `cap` or more evictions older than `now`. An entry aging out never
    /// removes a later push of the same fingerprint.
    fn expire(&mut self, now: u64, cap: u64) {
        while let Some(&(fp, seq)) = self.order.front() {
            if seq + cap.max(1) > now {
                break;
            }
            self.order.pop_front();
            if self.latest.get(&fp) == Some(&seq) {
                self.latest.remove(&fp);
            }
        }
    }

    /// Forgets `fp`; true when it was remembered and not yet aged out.
    fn take(&mut self, fp: u64, now: u64, cap: u64) -> bool {
        self.latest
            .remove(&fp)
            .is_some_and(|seq| seq + cap.max(1) > now)
    }
}
