//! `prefix-aware`: LRU that evicts the deepest blocks of a prefix chain first.
//!
//! A KV block is only useful while every block before it in its chain is cached: a lookup stops
//! at the first missing block. So among the coldest objects, this policy evicts the one deepest
//! in its chain, and a chain shrinks from its end instead of losing its head (which plain LRU
//! does, since a request touches its blocks head first). Depth is intrinsic to a block (its
//! position in the chain), so the policy needs no parent pointers and works in every shard of a
//! sharded index, where a block's parent usually lives in another shard.
//!
//! The window the deepest block is chosen from is the [`SCAN`] coldest objects of the namespace.
//! A shard holds its share of them: with `n` shards, about `SCAN / n` of its own coldest (at
//! least one), which the instances compute from an object count they share. A fixed window of
//! [`SCAN`] per shard would reach `n` times deeper into recency and evict recently used blocks.

use super::{Eviction, Handle, Insert, Lru, SCAN};
use crate::paged::Paged;
use crate::sync::{Arc, AtomicU64, Ordering::Relaxed};

/// Leaves-first LRU: [`Lru`]'s order, with its own choice of victim.
#[derive(Debug, Default)]
pub struct PrefixAware {
    lru: Lru,
    depth: Paged<u32>,
    /// Objects held over all the shards of the namespace.
    total: Arc<AtomicU64>,
}

impl PrefixAware {
    /// `n` empty instances for the `n` shards of one namespace.
    pub fn shards(n: usize) -> Vec<PrefixAware> {
        let total = Arc::new(AtomicU64::new(0));
        (0..n)
            .map(|_| PrefixAware {
                total: Arc::clone(&total),
                ..PrefixAware::default()
            })
            .collect()
    }

    /// This shard's part of the namespace's cold window.
    fn window(&self) -> usize {
        let total = self.total.load(Relaxed).max(1) as usize;
        (SCAN * self.lru.len()).div_ceil(total).clamp(1, SCAN)
    }
}

impl Eviction for PrefixAware {
    fn insert(&mut self, h: Handle, info: Insert) {
        self.depth.grow_to(h as usize + 1, 0);
        self.depth[h as usize] = info.depth;
        self.lru.insert(h, info);
        self.total.fetch_add(1, Relaxed);
    }

    fn access(&mut self, h: Handle, tick: u64) {
        self.lru.access(h, tick);
    }

    fn remove(&mut self, h: Handle) {
        if self.lru.holds(h) {
            self.total.fetch_sub(1, Relaxed);
        }
        self.lru.remove(h);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle> {
        // The cold window: up to `window` evictable objects from the LRU end; unevictable ones
        // are moved to the hot end as in LRU. The deepest of the window goes.
        let want = self.window();
        let lru = &mut self.lru;
        let mut window: [Handle; SCAN] = [0; SCAN];
        let mut n = 0;
        let mut cursor = lru.order.front();
        let mut looked = 0;
        while let Some(h) = cursor {
            if n == want || looked == SCAN * 2 {
                break;
            }
            looked += 1;
            cursor = lru.links.next(h);
            if evictable(h) {
                window[n] = h;
                n += 1;
            } else {
                lru.stamp[h as usize] = tick;
                lru.links.move_to_back(&mut lru.order, h);
            }
        }
        // Deepest first; among equals the coldest (min_by_key keeps the first).
        let victim = window[..n]
            .iter()
            .copied()
            .min_by_key(|&h| std::cmp::Reverse(self.depth[h as usize]))?;
        lru.links.remove(&mut lru.order, victim);
        self.total.fetch_sub(1, Relaxed);
        Some(victim)
    }

    fn peek_stamp(&self) -> Option<u64> {
        self.lru.peek_stamp()
    }

    fn worth(&self, h: Handle) -> u64 {
        self.lru.worth(h)
    }

    fn len(&self) -> usize {
        self.lru.len()
    }
}
