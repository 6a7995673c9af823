//! `s3fifo`: S3-FIFO (Yang et al., SOSP'23) with an adaptive small-queue share.
//!
//! New objects enter the *small* FIFO. When the small FIFO is over its share, its oldest object
//! leaves: to the *main* FIFO if it was touched since it came in, otherwise out (its fingerprint
//! goes to the small ghost list). The main FIFO evicts its oldest object unless it was touched,
//! in which case it goes round again with one touch fewer (at most 3 are counted). An object
//! re-inserted while its fingerprint is in a ghost list goes straight to main, and moves the
//! small FIFO's share: towards more room for newcomers when the small ghost hit (they were
//! evicted too early), towards less when the main ghost hit.

use std::collections::{HashMap, VecDeque};

use super::list::{Links, List};
use super::{Eviction, Handle, Insert, SCAN};

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
}

impl Default for S3FifoConfig {
    fn default() -> Self {
        S3FifoConfig {
            small_share: 0.5,
            ghost_factor: 2.0,
            max_freq: 3,
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
    freq: Vec<u8>,
    fingerprint: Vec<u64>,
    /// When each object entered its current place in its FIFO (insertion, promotion to main,
    /// or another round in main): the FIFO order, in pool-wide ticks.
    stamp: Vec<u64>,
    ghost_small: Ghost,
    ghost_main: Ghost,
    /// Target length of the small FIFO, in objects; `None` until the first eviction fixes it
    /// from `small_share`.
    target: Option<usize>,
}

impl Default for S3Fifo {
    fn default() -> Self {
        S3Fifo::new(S3FifoConfig::default())
    }
}

impl S3Fifo {
    /// An empty policy.
    pub fn new(cfg: S3FifoConfig) -> Self {
        S3Fifo {
            cfg,
            links: Links::default(),
            small: List::new(SMALL),
            main: List::new(MAIN),
            freq: Vec::new(),
            fingerprint: Vec::new(),
            stamp: Vec::new(),
            ghost_small: Ghost::default(),
            ghost_main: Ghost::default(),
            target: None,
        }
    }

    fn ghost_cap(&self) -> usize {
        ((self.len() as f64) * self.cfg.ghost_factor).ceil() as usize
    }

    fn evict_from_small(&self, target: usize) -> bool {
        self.small.len() > 0 && (self.small.len() >= target || self.main.len() == 0)
    }

    /// The object to evict under S3-FIFO's rules, or None when the scan budget ran out.
    fn scan(
        &mut self,
        evictable: &mut dyn FnMut(Handle) -> bool,
        target: usize,
        tick: u64,
    ) -> Option<Handle> {
        // Promotions and second chances are bounded by the freq counters; the budget bounds
        // them further, and skipping unevictable objects (moved to the back) too.
        for _ in 0..SCAN * 4 {
            if self.evict_from_small(target) {
                let h = self.small.front()?;
                if !evictable(h) {
                    self.stamp[h as usize] = tick;
                    self.links.move_to_back(&mut self.small, h);
                } else if self.freq[h as usize] > 0 {
                    self.freq[h as usize] = 0;
                    self.stamp[h as usize] = tick;
                    self.links.remove(&mut self.small, h);
                    self.links.push_back(&mut self.main, h);
                } else {
                    self.links.remove(&mut self.small, h);
                    let cap = self.ghost_cap();
                    self.ghost_small.push(self.fingerprint[h as usize], cap);
                    return Some(h);
                }
            } else {
                let h = self.main.front()?;
                if !evictable(h) {
                    self.stamp[h as usize] = tick;
                    self.links.move_to_back(&mut self.main, h);
                } else if self.freq[h as usize] > 0 {
                    self.freq[h as usize] -= 1;
                    self.stamp[h as usize] = tick;
                    self.links.move_to_back(&mut self.main, h);
                } else {
                    self.links.remove(&mut self.main, h);
                    let cap = self.ghost_cap();
                    self.ghost_main.push(self.fingerprint[h as usize], cap);
                    return Some(h);
                }
            }
        }
        None
    }

    fn list_mut(&mut self, id: u8) -> &mut List {
        if id == SMALL {
            &mut self.small
        } else {
            &mut self.main
        }
    }
}

impl Eviction for S3Fifo {
    fn insert(&mut self, h: Handle, info: Insert) {
        let i = h as usize;
        if self.freq.len() <= i {
            self.freq.resize(i + 1, 0);
            self.fingerprint.resize(i + 1, 0);
        }
        self.freq[i] = 0;
        self.fingerprint[i] = info.fingerprint;
        super::set_stamp(&mut self.stamp, h, info.tick);
        let len = self.len().max(1);
        if self.ghost_small.take(info.fingerprint) {
            // Evicted from small too early: give newcomers more room.
            let step = (self.ghost_main.len() / self.ghost_small.len().max(1)).max(1);
            self.target = Some((self.target.unwrap_or(len / 2) + step).min(len));
            self.links.push_back(&mut self.main, h);
        } else if self.ghost_main.take(info.fingerprint) {
            let step = (self.ghost_small.len() / self.ghost_main.len().max(1)).max(1);
            self.target = Some(self.target.unwrap_or(len / 2).saturating_sub(step).max(1));
            self.links.push_back(&mut self.main, h);
        } else {
            self.links.push_back(&mut self.small, h);
        }
    }

    fn access(&mut self, h: Handle, _tick: u64) {
        if let Some(f) = self.freq.get_mut(h as usize) {
            *f = (*f + 1).min(self.cfg.max_freq);
        }
    }

    fn remove(&mut self, h: Handle) {
        if let Some(id) = self.links.list_of(h) {
            let mut list = *self.list_mut(id);
            self.links.remove(&mut list, h);
            *self.list_mut(id) = list;
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle> {
        let target = *self
            .target
            .get_or_insert(((self.len() as f64) * self.cfg.small_share).max(1.0) as usize);
        if let Some(h) = self.scan(evictable, target, tick) {
            return Some(h);
        }
        // Out of budget: take the first evictable object in plain FIFO order, small first.
        for id in [SMALL, MAIN] {
            let mut list = *self.list_mut(id);
            let mut found = None;
            for _ in 0..SCAN.min(list.len()) {
                let h = list.front()?;
                if evictable(h) {
                    self.links.remove(&mut list, h);
                    found = Some(h);
                    break;
                }
                self.stamp[h as usize] = tick;
                self.links.move_to_back(&mut list, h);
            }
            *self.list_mut(id) = list;
            if found.is_some() {
                return found;
            }
        }
        None
    }

    fn peek_stamp(&self) -> Option<u64> {
        let target = self
            .target
            .unwrap_or(((self.len() as f64) * self.cfg.small_share).max(1.0) as usize);
        let h = if self.evict_from_small(target) {
            self.small.front()
        } else {
            self.main.front()
        }?;
        Some(self.stamp[h as usize])
    }

    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }
}

/// A bounded FIFO of fingerprints with membership tests. Each entry carries a sequence number
/// so that an entry aging out never removes a later push of the same fingerprint.
#[derive(Debug, Default)]
struct Ghost {
    order: VecDeque<(u64, u64)>,
    latest: HashMap<u64, u64>,
    seq: u64,
}

impl Ghost {
    /// Fingerprints remembered.
    fn len(&self) -> usize {
        self.latest.len()
    }

    fn push(&mut self, fp: u64, cap: usize) {
        self.seq += 1;
        self.order.push_back((fp, self.seq));
        self.latest.insert(fp, self.seq);
        while self.order.len() > cap.max(1) {
            let (old, seq) = self.order.pop_front().expect("non-empty");
            if self.latest.get(&old) == Some(&seq) {
                self.latest.remove(&old);
            }
        }
    }

    /// Forgets `fp`; true when it was remembered.
    fn take(&mut self, fp: u64) -> bool {
        self.latest.remove(&fp).is_some()
    }
}
