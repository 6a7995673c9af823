//! Objects leaving the index: removed by key (or by key and generation), and the retirement
//! every departure ends in: the memory freed at once, or parked until its readers are done.

use std::sync::atomic::Ordering;

use crate::error::PoolError;
use crate::seqlock;
use crate::sync::lock;

use super::index::{Entry, Shard, Zombie};
use super::Pool;

impl Pool {
    /// Removes an object, from the tier under DRAM too. Returns whether it existed (in
    /// either). Readers still streaming it finish first.
    pub fn remove(&self, ns: u32, key: &[u8]) -> Result<bool, PoolError> {
        let space = self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let below = self.lower.get().is_some_and(|t| t.removed(ns, key));
        let Some(e) = shard.ns[ns as usize].remove(key) else {
            return Ok(below);
        };
        space.objects.fetch_sub(1, Ordering::Relaxed);
        self.observe_removed(ns, key);
        self.retire_entry(&mut shard, ns, e);
        Ok(true)
    }

    /// The generation and pinned flag of the object under `key` (None when absent), without
    /// counting a read or touching the eviction order. Generations grow with every allocation
    /// (see [`Pool::generation_mark`]), so they order an object's writes against other events.
    pub fn provenance(&self, ns: u32, key: &[u8]) -> Result<Option<(u64, bool)>, PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        let shard = self.shard_lock(key);
        Ok(shard.ns[ns as usize]
            .peek(key)
            .map(|e| (e.generation, e.pinned)))
    }

    /// Removes the object under `key` only while it is generation `generation` (a newer write
    /// of the key is left alone), in DRAM and in the tier under it (where an object keeps the
    /// generation it was written with, and one brought back up from it counts as that object).
    /// Returns whether it removed it from DRAM.
    pub fn remove_generation(
        &self,
        ns: u32,
        key: &[u8],
        generation: u64,
    ) -> Result<bool, PoolError> {
        let space = self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let in_dram = shard.ns[ns as usize].peek(key).map(|e| e.generation);
        let promoted = self
            .lower
            .get()
            .is_some_and(|t| t.removed_generation(ns, key, generation, in_dram));
        if in_dram != Some(generation) && !promoted {
            return Ok(false);
        }
        let Some(e) = shard.ns[ns as usize].remove(key) else {
            return Ok(false);
        };
        space.objects.fetch_sub(1, Ordering::Relaxed);
        self.observe_removed(ns, key);
        self.retire_entry(&mut shard, ns, e);
        Ok(true)
    }

    /// Frees an object that just left the index, or parks it until its readers are done.
    pub(super) fn retire_entry(&self, shard: &mut Shard, ns: u32, e: Entry) {
        self.journal(|j| j.gone(e.generation));
        if e.readers > 0 {
            // Its holders read on; a same-host client's cached lookup of the key must not.
            if let Some(word) = self.segments[e.segment as usize].segment.version(e.offset) {
                seqlock::detach(word, e.generation);
            }
            shard.zombies.push(Zombie {
                ns,
                segment: e.segment,
                offset: e.offset,
                generation: e.generation,
                readers: e.readers,
                pinned: e.pinned,
            });
        } else {
            self.free_block(ns, e.segment, e.offset, e.generation, e.pinned);
        }
    }

    pub(super) fn free_block(
        &self,
        ns: u32,
        segment: u16,
        offset: u64,
        generation: u64,
        pinned: bool,
    ) {
        let slot = &self.segments[segment as usize];
        if let Some(word) = slot.segment.version(offset) {
            seqlock::retire(word, generation);
        }
        let Ok(block) = lock(&slot.alloc).free(offset) else {
            debug_assert!(false, "freeing a block that is not allocated");
            return;
        };
        let space = &self.namespaces[ns as usize];
        self.unreserve(space, block.size);
        if pinned {
            space.pinned.fetch_sub(block.size, Ordering::Relaxed);
        }
    }
}
