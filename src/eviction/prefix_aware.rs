//! `prefix-aware`: LRU that evicts the deepest blocks of a prefix chain first.
//!
//! A KV block is only useful while every block before it in its chain is cached: a lookup stops
//! at the first missing block. So among the coldest objects, this policy evicts the one deepest
//! in its chain, and a chain shrinks from its end instead of losing its head (which plain LRU
//! does, since a request touches its blocks head first). Depth is intrinsic to a block (its
//! position in the chain), so the policy needs no parent pointers and works in every shard of a
//! sharded index, where a block's parent usually lives in another shard.

use super::{Eviction, Handle, Insert, Lru, SCAN};

/// Leaves-first LRU: [`Lru`]'s order, with its own choice of victim.
#[derive(Debug, Default)]
pub struct PrefixAware {
    lru: Lru,
    depth: Vec<u32>,
}

impl Eviction for PrefixAware {
    fn insert(&mut self, h: Handle, info: Insert) {
        if self.depth.len() <= h as usize {
            self.depth.resize(h as usize + 1, 0);
        }
        self.depth[h as usize] = info.depth;
        self.lru.insert(h, info);
    }

    fn access(&mut self, h: Handle, tick: u64) {
        self.lru.access(h, tick);
    }

    fn remove(&mut self, h: Handle) {
        self.lru.remove(h);
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle> {
        // The cold window: up to SCAN evictable objects from the LRU end; unevictable ones are
        // moved to the hot end as in LRU. The deepest of the window goes.
        let lru = &mut self.lru;
        let mut window: [Handle; SCAN] = [0; SCAN];
        let mut n = 0;
        let mut cursor = lru.order.front();
        let mut looked = 0;
        while let Some(h) = cursor {
            if n == SCAN || looked == SCAN * 2 {
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
        Some(victim)
    }

    fn peek_stamp(&self) -> Option<u64> {
        self.lru.peek_stamp()
    }

    fn len(&self) -> usize {
        self.lru.len()
    }
}
