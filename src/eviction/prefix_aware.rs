//! `prefix-aware`: LRU that evicts the deepest blocks of a prefix chain first.
//!
//! A KV block is only useful while every block before it in its chain is cached: a lookup stops
//! at the first missing block. So among the coldest objects, this policy evicts the one deepest
//! in its chain, and a chain shrinks from its end instead of losing its head (which plain LRU
//! does, since a request touches its blocks head first). Depth is intrinsic to a block (its
//! position in the chain), so the policy needs no parent pointers and works in every shard of a
//! sharded index, where a block's parent usually lives in another shard.

use super::list::{Links, List};
use super::{Eviction, Handle, Insert, SCAN};

/// Leaves-first LRU.
#[derive(Debug)]
pub struct PrefixAware {
    links: Links,
    order: List,
    depth: Vec<u32>,
    stamp: Vec<u64>,
}

impl Default for PrefixAware {
    fn default() -> Self {
        PrefixAware {
            links: Links::default(),
            order: List::new(0),
            depth: Vec::new(),
            stamp: Vec::new(),
        }
    }
}

impl Eviction for PrefixAware {
    fn insert(&mut self, h: Handle, info: Insert) {
        if self.depth.len() <= h as usize {
            self.depth.resize(h as usize + 1, 0);
        }
        self.depth[h as usize] = info.depth;
        super::set_stamp(&mut self.stamp, h, info.tick);
        self.links.push_back(&mut self.order, h);
    }

    fn access(&mut self, h: Handle, tick: u64) {
        if self.links.list_of(h).is_some() {
            self.stamp[h as usize] = tick;
            self.links.move_to_back(&mut self.order, h);
        }
    }

    fn remove(&mut self, h: Handle) {
        if self.links.list_of(h).is_some() {
            self.links.remove(&mut self.order, h);
        }
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle> {
        // The cold window: up to SCAN evictable objects from the LRU end; unevictable ones are
        // moved to the hot end as in LRU. The deepest of the window goes.
        let mut window: [Handle; SCAN] = [0; SCAN];
        let mut n = 0;
        let mut cursor = self.order.front();
        let mut looked = 0;
        while let Some(h) = cursor {
            if n == SCAN || looked == SCAN * 2 {
                break;
            }
            looked += 1;
            cursor = self.links.next(h);
            if evictable(h) {
                window[n] = h;
                n += 1;
            } else {
                self.stamp[h as usize] = tick;
                self.links.move_to_back(&mut self.order, h);
            }
        }
        let victim = window[..n]
            .iter()
            .copied()
            // Deepest first; among equals the coldest (min_by_key keeps the first).
            .min_by_key(|&h| std::cmp::Reverse(self.depth[h as usize]))?;
        self.links.remove(&mut self.order, victim);
        Some(victim)
    }

    fn peek_stamp(&self) -> Option<u64> {
        self.order.front().map(|h| self.stamp[h as usize])
    }

    fn len(&self) -> usize {
        self.order.len()
    }
}
