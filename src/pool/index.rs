//! One shard of the object index: per namespace, an LRU of committed objects, plus the objects
//! that were removed while still being read ("zombies", freed when their last reader leaves).

use lru::LruCache;

use crate::error::MAX_KEY_LEN;
use crate::pool::Millis;

/// What the index knows of one committed object. Kept small: pools hold millions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) generation: u64,
    pub(crate) checksum: u64,
    /// End of the current lease (ms on the pool's clock); eviction skips the object until then.
    pub(crate) lease_until: Millis,
    pub(crate) segment: u16,
    /// Daemon-side readers streaming the bytes right now (zero-copy sends).
    pub(crate) readers: u16,
    pub(crate) pinned: bool,
}

impl Entry {
    pub(crate) fn evictable(&self, now: Millis) -> bool {
        self.readers == 0 && !self.pinned && self.lease_until <= now
    }
}

/// An object removed from the index while readers still stream it.
#[derive(Debug)]
pub(crate) struct Zombie {
    pub(crate) ns: u32,
    pub(crate) segment: u16,
    pub(crate) offset: u64,
    pub(crate) generation: u64,
    pub(crate) readers: u16,
    pub(crate) pinned: bool,
}

/// One shard: an LRU per namespace.
pub(crate) struct Shard {
    pub(crate) lrus: Vec<LruCache<Box<[u8]>, Entry>>,
    pub(crate) zombies: Vec<Zombie>,
}

/// How many entries eviction looks at from the cold end of one LRU before giving up on it.
const EVICTION_SCAN: usize = 16;

impl Shard {
    pub(crate) fn new(namespaces: usize) -> Self {
        Shard {
            lrus: (0..namespaces).map(|_| LruCache::unbounded()).collect(),
            zombies: Vec::new(),
        }
    }

    /// Removes the least recently used evictable object of namespace `ns`. Objects at the cold
    /// end that can't be evicted (pinned, leased, being read) are moved to the hot end so the
    /// next scan does not meet them again; the scan is bounded.
    pub(crate) fn pop_victim(&mut self, ns: usize, now: Millis) -> Option<Entry> {
        let lru = &mut self.lrus[ns];
        let mut key = [0u8; MAX_KEY_LEN];
        for _ in 0..EVICTION_SCAN.min(lru.len()) {
            let (k, e) = lru.peek_lru()?;
            if e.evictable(now) {
                return lru.pop_lru().map(|(_, e)| e);
            }
            let n = k.len();
            key[..n].copy_from_slice(k);
            lru.promote(&key[..n]);
        }
        None
    }

    /// Drops one reader of generation `generation` of `key`; returns the zombie to free when
    /// that was the last reader of a removed object.
    pub(crate) fn release_reader(
        &mut self,
        ns: usize,
        key: &[u8],
        generation: u64,
    ) -> Option<Zombie> {
        if let Some(e) = self.lrus[ns].peek_mut(key) {
            if e.generation == generation {
                e.readers = e.readers.saturating_sub(1);
                return None;
            }
        }
        let i = self
            .zombies
            .iter()
            .position(|z| z.generation == generation)?;
        let z = &mut self.zombies[i];
        z.readers = z.readers.saturating_sub(1);
        (z.readers == 0).then(|| self.zombies.swap_remove(i))
    }
}
