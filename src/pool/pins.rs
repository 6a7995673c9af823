//! Pins: objects eviction never takes, and the snapshots of a namespace's pinned and unpinned
//! objects that moving objects between nodes needs.

use std::sync::atomic::Ordering;

use crate::error::PoolError;
use crate::sync::lock;

use super::Pool;

/// An unpinned object as [`Pool::unpinned_objects`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unpinned {
    /// Its key.
    pub key: Vec<u8>,
    /// The generation of its allocation.
    pub generation: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Its eviction policy's [`crate::eviction::Eviction::worth`] (higher: hotter).
    pub worth: u64,
}

impl Pool {
    /// Pins (or unpins) an object: pinned objects are never evicted and count against the
    /// namespace's quota like any other. Returns whether the object exists.
    pub fn set_pinned(&self, ns: u32, key: &[u8], pinned: bool) -> Result<bool, PoolError> {
        let space = self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let Some(e) = shard.ns[ns as usize].peek_mut(key) else {
            return Ok(false);
        };
        if e.pinned != pinned {
            e.pinned = pinned;
            let generation = e.generation;
            self.journal(|j| j.pin(generation, pinned));
            let size = self
                .alloc_lock(e.segment as usize)
                .block_at(e.offset)
                .map_or(0, |b| b.size);
            if pinned {
                space.pinned.fetch_add(size, Ordering::Relaxed);
            } else {
                space.pinned.fetch_sub(size, Ordering::Relaxed);
            }
        }
        Ok(true)
    }

    /// The keys of namespace `ns`'s pinned objects: a snapshot, one shard locked at a time (for
    /// moving weights between nodes).
    pub fn pinned_keys(&self, ns: u32) -> Result<Vec<Vec<u8>>, PoolError> {
        self.ns(ns)?;
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            out.extend(
                lock(shard).ns[ns as usize]
                    .pinned_keys()
                    .map(<[u8]>::to_vec),
            );
        }
        Ok(out)
    }

    /// The unpinned objects of namespace `ns` whose key `pick` accepts, hottest first (by their
    /// eviction policy's [`crate::eviction::Eviction::worth`]): a snapshot, one shard locked at
    /// a time, for handing objects to their new owners when the cluster changes. `pick` runs
    /// under a shard's lock: it must be cheap.
    pub fn unpinned_objects(
        &self,
        ns: u32,
        mut pick: impl FnMut(&[u8]) -> bool,
    ) -> Result<Vec<Unpinned>, PoolError> {
        self.ns(ns)?;
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            lock(shard).ns[ns as usize].unpinned(&mut |key, e, worth| {
                if pick(key) {
                    out.push(Unpinned {
                        key: key.to_vec(),
                        generation: e.generation,
                        len: e.len,
                        worth,
                    });
                }
            });
        }
        // Ticks are pool-wide, so worths compare across shards.
        out.sort_by_key(|u| std::cmp::Reverse(u.worth));
        Ok(out)
    }
}
