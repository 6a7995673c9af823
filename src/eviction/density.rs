//! `hit-density`: evict the block with the lowest expected hits per unit of cache time.
//!
//! The policy learns online, per *class* of block, how many hits a block of that class still
//! gets and how long it still stays, as a function of its *age* (ticks since its last
//! reference), the way LHD (Beckmann et al., NSDI'18) ranks objects. For each class it keeps two
//! histograms over age: references (a hit at that age) and evictions (the block left at that
//! age). From them, the hit density at age `a` is
//!
//! ```text
//!   density(a) = Σ_{x ≥ a} hits(x) / Σ_{x ≥ a} (hits(x) + evictions(x)) · (x − a + 1)
//! ```
//!
//! the chance of a further hit over the cache time it would still take up. Every block takes one
//! slot, so this is hits per byte-time. The victim is the lowest-density block of a random sample
//! ([`DensityConfig::sample`] blocks); among equals, the oldest, then the deepest in its prefix
//! chain (a chain shrinks from its tail: the trait gives no parent pointers, so depth stands for
//! leafness).
//!
//! A block's class groups what the index knows of it, each feature in a few buckets:
//!
//! - how often it was referenced (1, 2, 3–4, 5–8, more), counting the references before an
//!   eviction when a *ghost* of its fingerprint is still remembered: the fingerprints and counts
//!   of the latest evictions, up to [`DensityConfig::ghost_factor`] × the blocks held, so that a
//!   prefix that returns after being evicted is recognised as the popular prefix it is;
//! - the gap between its last two references (none yet, short, medium, long, in age bins);
//! - its depth in its prefix chain (0, 1–3, 4–15, deeper).
//!
//! The request's input and output lengths and whether a block is a prompt's partial last block
//! don't reach the policy through [`Eviction`] (the index sees keys, depths and ticks); a partial
//! last block is unique to its request and shows up as a block referenced once.
//!
//! Cost: O(1) per access and insertion; a victim looks at `sample` blocks; every
//! [`RECOMPUTE`] events the density tables are rebuilt from the histograms (classes × age bins),
//! and the histograms decay, so the policy follows a changing workload. State per block: 32
//! bytes. The instances over the shards of one namespace share the histograms and the tables
//! through atomics, so each shard ranks its blocks with what the whole namespace learned.

use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};

use super::{Eviction, Handle, Insert};
use crate::sync::{Arc, AtomicU64, Ordering::Relaxed};

/// Parameters of [`Density`]. The feature switches exist for the ablation in docs/EVICTION.md;
/// the defaults turn every feature on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DensityConfig {
    /// Blocks compared per eviction. Default 32.
    pub sample: usize,
    /// The ghost history remembers this many evicted fingerprints per block held (at most 16).
    /// Default 8.
    pub ghost_factor: u32,
    /// Classify by reference count. Default on.
    pub refs: bool,
    /// Classify by the gap between the last two references. Default on.
    pub gap: bool,
    /// Classify by depth in the prefix chain. Default on.
    pub depth: bool,
    /// Remember evicted fingerprints and their counts. Default on.
    pub ghost: bool,
    /// Rank by age within a class (off: one age bin, a class's density alone). Default on.
    pub age: bool,
}

impl Default for DensityConfig {
    fn default() -> Self {
        DensityConfig {
            sample: 32,
            ghost_factor: 8,
            refs: true,
            gap: true,
            depth: true,
            ghost: true,
            age: true,
        }
    }
}

/// Blocks [`Eviction::peek_stamp`] ranks when the namespace is not split (all, when fewer).
const PEEK: usize = 16;
/// Age bins per class.
const BINS: usize = 64;
const REF_CLASSES: usize = 5;
const GAP_CLASSES: usize = 4;
const DEPTH_CLASSES: usize = 4;
const CLASSES: usize = REF_CLASSES * GAP_CLASSES * DEPTH_CLASSES;
/// Events (hits and evictions, over the namespace) between rebuilds of the density tables.
pub(crate) const RECOMPUTE: u64 = 1024;
/// One event in a histogram, in fixed point, so decay keeps fractions.
const ONE: u64 = 256;
/// Pseudo-events of the namespace-wide histogram mixed into each class's (a class seen rarely
/// ranks like the average block until it has its own evidence).
const PRIOR: f64 = 4.0;

/// Per block, indexed by handle: 32 bytes.
#[derive(Clone, Copy, Debug, Default)]
struct Meta {
    fingerprint: u64,
    /// Tick of the last reference (insertion or access).
    last: u64,
    /// Index in [`Density::members`]; `u32::MAX` when not held.
    pos: u32,
    depth: u32,
    refs: u16,
    /// Gap bucket of the last two references (0: referenced once).
    gap: u8,
}

const NOT_HELD: u32 = u32::MAX;

/// Eviction rank, lowest first: density, then age and depth, the older and deeper first.
type Rank = (f64, Reverse<u64>, Reverse<u32>);
const _: () = assert!(std::mem::size_of::<Meta>() <= 32);

/// Hit density ranking over sampled blocks.
#[derive(Debug)]
pub struct Density {
    cfg: DensityConfig,
    meta: Vec<Meta>,
    /// The blocks held, in no order: what victims are sampled from.
    members: Vec<Handle>,
    ghost: Ghost,
    rng: u64,
    shared: Arc<Shared>,
}

/// What the instances over the shards of one namespace learn together.
#[derive(Debug)]
struct Shared {
    /// `[class][bin]` fixed-point counts of hits, then of evictions.
    hits: Box<[AtomicU64]>,
    evictions: Box<[AtomicU64]>,
    /// `[class][bin]` hit density, as `f64` bits.
    density: Box<[AtomicU64]>,
    /// log2 of the ticks per age bin.
    shift: AtomicU64,
    events: AtomicU64,
    /// Blocks held over all shards.
    len: AtomicU64,
    /// Evictions ever, the sequence ghost entries age by.
    ghost_seq: AtomicU64,
    /// The latest tick any instance saw: ages in [`Eviction::peek_stamp`] are taken against
    /// it, so a shard that was not touched for a while doesn't offer its blocks as younger.
    now: AtomicU64,
}

impl Shared {
    fn new() -> Self {
        let table = || (0..CLASSES * BINS).map(|_| AtomicU64::new(0)).collect();
        Shared {
            hits: table(),
            evictions: table(),
            density: table(),
            shift: AtomicU64::new(0),
            events: AtomicU64::new(0),
            len: AtomicU64::new(0),
            ghost_seq: AtomicU64::new(0),
            now: AtomicU64::new(0),
        }
    }

    /// Counts one event and rebuilds the tables every [`RECOMPUTE`] events.
    fn record(&self, table: &[AtomicU64], class: usize, bin: usize) {
        table[class * BINS + bin].fetch_add(ONE, Relaxed);
        if (self.events.fetch_add(1, Relaxed) + 1) % RECOMPUTE == 0 {
            self.recompute();
        }
    }

    /// Rebuilds every class's density from its histograms (smoothed towards the namespace's),
    /// decays the histograms by 1/8, and doubles the bin width when more than 1 % of the events
    /// fall in the last bin (ages the bins can't tell apart).
    fn recompute(&self) {
        let get = |t: &[AtomicU64], i: usize| t[i].load(Relaxed) as f64;
        let mut global_h = [0.0f64; BINS];
        let mut global_e = [0.0f64; BINS];
        for c in 0..CLASSES {
            for b in 0..BINS {
                global_h[b] += get(&self.hits, c * BINS + b);
                global_e[b] += get(&self.evictions, c * BINS + b);
            }
        }
        let total: f64 = global_h.iter().chain(&global_e).sum();
        if total == 0.0 {
            return;
        }
        for c in 0..CLASSES {
            // PRIOR events' worth of the global shape.
            let w = PRIOR * ONE as f64 / total;
            let (mut hits, mut events, mut life) = (0.0, 0.0, 0.0);
            for b in (0..BINS).rev() {
                let h = get(&self.hits, c * BINS + b) + w * global_h[b];
                let e = get(&self.evictions, c * BINS + b) + w * global_e[b];
                hits += h;
                events += h + e;
                life += events;
                let d = if life > 0.0 { hits / life } else { 0.0 };
                self.density[c * BINS + b].store(d.to_bits(), Relaxed);
            }
        }
        for t in [&self.hits, &self.evictions] {
            for x in t.iter() {
                let v = x.load(Relaxed);
                x.store(v - v / 8, Relaxed);
            }
        }
        let last = global_h[BINS - 1] + global_e[BINS - 1];
        if last > total / 100.0 && self.shift.load(Relaxed) < 40 {
            self.shift.fetch_add(1, Relaxed);
            for t in [&self.hits, &self.evictions] {
                for c in 0..CLASSES {
                    let row = &t[c * BINS..(c + 1) * BINS];
                    for b in 0..BINS / 2 {
                        let v = row[2 * b].load(Relaxed) + row[2 * b + 1].load(Relaxed);
                        row[b].store(v, Relaxed);
                    }
                    // The ages past the old last bin straddle the new upper half: start it
                    // afresh rather than pile them into one bin (which would keep it over 1 %
                    // and double the width again on every rebuild).
                    for x in &row[BINS / 2..] {
                        x.store(0, Relaxed);
                    }
                }
            }
        }
    }
}

impl Default for Density {
    fn default() -> Self {
        Density::new(DensityConfig::default())
    }
}

impl Density {
    /// An empty policy over a whole namespace.
    pub fn new(cfg: DensityConfig) -> Self {
        Density::with_shared(cfg, Arc::new(Shared::new()), 0)
    }

    /// `n` empty instances for the `n` shards of one namespace, learning together.
    pub fn shards(cfg: DensityConfig, n: usize) -> Vec<Density> {
        let shared = Arc::new(Shared::new());
        (0..n)
            .map(|i| Density::with_shared(cfg, Arc::clone(&shared), i as u64))
            .collect()
    }

    fn with_shared(cfg: DensityConfig, shared: Arc<Shared>, seed: u64) -> Self {
        Density {
            cfg,
            meta: Vec::new(),
            members: Vec::new(),
            ghost: Ghost::default(),
            rng: 0x9e37_79b9_7f4a_7c15 ^ seed.wrapping_mul(0xff51_afd7_ed55_8ccd),
            shared,
        }
    }

    fn held(&self, h: Handle) -> bool {
        self.meta.get(h as usize).is_some_and(|m| m.pos != NOT_HELD)
    }

    fn bin(&self, age: u64) -> usize {
        if !self.cfg.age {
            return 0;
        }
        ((age >> self.shared.shift.load(Relaxed)) as usize).min(BINS - 1)
    }

    fn class(&self, m: &Meta) -> usize {
        let refs = if !self.cfg.refs {
            0
        } else {
            match m.refs {
                0 | 1 => 0,
                2 => 1,
                3..=4 => 2,
                5..=8 => 3,
                _ => 4,
            }
        };
        let gap = if self.cfg.gap { m.gap as usize } else { 0 };
        let depth = if !self.cfg.depth {
            0
        } else {
            match m.depth {
                0 => 0,
                1..=3 => 1,
                4..=15 => 2,
                _ => 3,
            }
        };
        (refs * GAP_CLASSES + gap) * DEPTH_CLASSES + depth
    }

    /// The gap bucket of a reference `age` ticks after the previous one.
    fn gap_class(&self, age: u64) -> u8 {
        match self.bin(age) {
            b if b < BINS / 16 => 1,
            b if b < BINS / 4 => 2,
            _ => 3,
        }
    }

    /// Eviction rank of `h` at `now`: lower goes first.
    /// Equal densities (one class and age bin, or nothing learned yet) go oldest first, and at
    /// equal ages (blocks stored by one operation) deepest first. Depth must not override age:
    /// evicting the deepest of a coarse age bin takes the tails of the requests just stored (in
    /// the design runs, 5 points of chat's 31 % at 200 blocks).
    fn rank(&self, h: Handle, now: u64) -> Rank {
        let m = &self.meta[h as usize];
        let age = now.saturating_sub(m.last);
        let d =
            f64::from_bits(self.shared.density[self.class(m) * BINS + self.bin(age)].load(Relaxed));
        (d, Reverse(age), Reverse(m.depth))
    }

    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// Takes `h` out of the members (swap-remove, O(1)).
    fn unlink(&mut self, h: Handle) {
        let pos = self.meta[h as usize].pos as usize;
        let last = self.members.pop().expect("held");
        if last != h {
            self.members[pos] = last;
            self.meta[last as usize].pos = pos as u32;
        }
        self.meta[h as usize].pos = NOT_HELD;
        self.shared.len.fetch_sub(1, Relaxed);
    }

    /// The reference count `h` holds (tests).
    #[cfg(test)]
    pub(super) fn ghost_refs(&self, h: Handle) -> Option<u16> {
        self.held(h).then(|| self.meta[h as usize].refs)
    }

    /// Ghost entries held (tests).
    #[cfg(test)]
    pub(super) fn ghost_len(&self) -> usize {
        self.ghost.order.len().max(self.ghost.latest.len())
    }

    /// With the namespace split over shards, how many of this shard's blocks a victim is
    /// chosen among: its share of [`DensityConfig::sample`], as the pool compares the candidates
    /// of up to 8 shards (`None`: the whole namespace is here, sample at random).
    fn window(&self) -> Option<usize> {
        let n = self.members.len();
        let total = self.shared.len.load(Relaxed).max(1) as usize;
        if n == 0 || n >= total {
            return None;
        }
        let shards = (total / n).clamp(1, 8);
        Some(self.cfg.sample.div_ceil(shards).clamp(1, n))
    }

    /// Block `k` of a window of `w`: evenly spaced from a random start that moves on after
    /// every victim.
    fn windowed(&self, k: usize, w: usize) -> Handle {
        let n = self.members.len();
        let stride = (n / w).max(1);
        self.members[(self.rng as usize % n + k * stride) % n]
    }

    fn ghost_cap(&self) -> u64 {
        self.shared.len.load(Relaxed).max(1) * u64::from(self.cfg.ghost_factor.min(16))
    }
}

impl Eviction for Density {
    fn insert(&mut self, h: Handle, info: Insert) {
        let i = h as usize;
        if self.meta.len() <= i {
            self.meta.resize(
                i + 1,
                Meta {
                    pos: NOT_HELD,
                    ..Meta::default()
                },
            );
        }
        self.shared.now.fetch_max(info.tick, Relaxed);
        let mut refs = 1u16;
        if self.cfg.ghost {
            let now = self.shared.ghost_seq.load(Relaxed);
            let cap = self.ghost_cap();
            if let Some(r) = self.ghost.take(info.fingerprint, now, cap) {
                refs = r.saturating_add(1);
            }
            self.ghost.expire(now, cap);
        }
        self.meta[i] = Meta {
            fingerprint: info.fingerprint,
            last: info.tick,
            pos: self.members.len() as u32,
            depth: info.depth,
            refs,
            gap: 0,
        };
        self.members.push(h);
        self.shared.len.fetch_add(1, Relaxed);
    }

    fn access(&mut self, h: Handle, tick: u64) {
        if !self.held(h) {
            return;
        }
        self.shared.now.fetch_max(tick, Relaxed);
        let m = self.meta[h as usize];
        let age = tick.saturating_sub(m.last);
        self.shared
            .record(&self.shared.hits, self.class(&m), self.bin(age));
        let gap = self.gap_class(age);
        let m = &mut self.meta[h as usize];
        m.refs = m.refs.saturating_add(1);
        m.gap = gap;
        m.last = tick;
    }

    fn remove(&mut self, h: Handle) {
        if self.held(h) {
            self.unlink(h);
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle> {
        self.shared.now.fetch_max(tick, Relaxed);
        let n = self.members.len();
        let mut best: Option<(Handle, _)> = None;
        let consider = |this: &Self, h: Handle, best: &mut Option<(Handle, _)>| {
            let r = this.rank(h, tick);
            if best.as_ref().is_none_or(|(_, b)| r < *b) {
                *best = Some((h, r));
            }
        };
        if let Some(w) = self.window() {
            // A shard of a split namespace: its share of the sample, the blocks peek_stamp
            // ranked, so the pool's choice of shard and the shard's choice agree.
            for k in 0..w {
                let h = self.windowed(k, w);
                if evictable(h) {
                    consider(self, h, &mut best);
                }
            }
            self.next_random();
        } else if n <= self.cfg.sample {
            // Few enough to look at every one.
            for k in 0..n {
                let h = self.members[k];
                if evictable(h) {
                    consider(self, h, &mut best);
                }
            }
        } else {
            for _ in 0..self.cfg.sample {
                let k = (self.next_random() % n as u64) as usize;
                let h = self.members[k];
                if evictable(h) {
                    consider(self, h, &mut best);
                }
            }
        }
        if best.is_none() && n > 0 {
            // Everything sampled is pinned or being read: walk on from a random point.
            let start = (self.next_random() % n as u64) as usize;
            for k in 0..(super::SCAN * 4).min(n) {
                let h = self.members[(start + k) % n];
                if evictable(h) {
                    consider(self, h, &mut best);
                    break;
                }
            }
        }
        let (h, _) = best?;
        let m = self.meta[h as usize];
        let age = tick.saturating_sub(m.last);
        self.shared
            .record(&self.shared.evictions, self.class(&m), self.bin(age));
        self.unlink(h);
        if self.cfg.ghost {
            let seq = self.shared.ghost_seq.fetch_add(1, Relaxed) + 1;
            let cap = self.ghost_cap();
            self.ghost.push(m.fingerprint, m.refs, seq);
            self.ghost.expire(seq, cap);
        }
        Some(h)
    }

    /// The lowest rank among up to `PEEK` blocks, as one number that compares across the
    /// shards of a namespace (they share the density tables and the clock): the density's bits,
    /// then the age.
    fn peek_stamp(&self) -> Option<u64> {
        let n = self.members.len();
        if n == 0 {
            return None;
        }
        let now = self.shared.now.load(Relaxed);
        let w = self.window().unwrap_or(PEEK.min(n));
        (0..w)
            .map(|k| {
                let h = self.windowed(k, w);
                let (d, Reverse(age), _) = self.rank(h, now);
                (u64::from((d as f32).to_bits()) << 20) | (0xF_FFFF - age.min(0xF_FFFF))
            })
            .min()
    }

    fn worth(&self, h: Handle) -> u64 {
        self.meta.get(h as usize).map_or(0, |m| m.last)
    }

    fn len(&self) -> usize {
        self.members.len()
    }
}

/// Fingerprints and reference counts of the latest evictions of the namespace: an entry is
/// remembered while fewer than `cap` evictions (of any shard) came after it.
#[derive(Debug, Default)]
struct Ghost {
    order: VecDeque<(u64, u64)>,
    latest: HashMap<u64, (u64, u16)>,
}

impl Ghost {
    fn push(&mut self, fp: u64, refs: u16, seq: u64) {
        self.order.push_back((fp, seq));
        self.latest.insert(fp, (seq, refs));
    }

    fn expire(&mut self, now: u64, cap: u64) {
        while let Some(&(fp, seq)) = self.order.front() {
            if seq + cap.max(1) > now {
                break;
            }
            self.order.pop_front();
            if self.latest.get(&fp).is_some_and(|e| e.0 == seq) {
                self.latest.remove(&fp);
            }
        }
    }

    /// Forgets `fp`; its reference count when it was remembered and not yet aged out.
    fn take(&mut self, fp: u64, now: u64, cap: u64) -> Option<u16> {
        self.latest
            .remove(&fp)
            .filter(|(seq, _)| seq + cap.max(1) > now)
            .map(|e| e.1)
    }
}
