//! What a replay drives: something that holds blocks. The simulated policies live here; the
//! real pool (in-process or daemons) is in `pool_engine.rs`; clusters of either in `cluster.rs`.

use std::collections::{BinaryHeap, HashMap, HashSet};

use kvpool::eviction::{Eviction, Handle, Insert, PolicyKind};
use lru::LruCache;

/// A cache of blocks, as the replay sees it.
pub trait BlockCache {
    /// Length of the leading run of `blocks` that is present. Changes nothing.
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize>;

    /// Stores a request's blocks: first touches the present ones (in order), then inserts the
    /// missing ones (in order), evicting as the policy says. `next_use[i]` is the position of
    /// the next access of `blocks[i]` in the whole trace (`u64::MAX`: never), for offline
    /// policies; online ones ignore it.
    fn store(&mut self, blocks: &[u64], next_use: &[u64]) -> anyhow::Result<()>;
}

/// Every block ever stored stays: the ceiling of any policy.
#[derive(Default)]
pub struct Unbounded {
    set: HashSet<u64>,
}

impl BlockCache for Unbounded {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        Ok(blocks.iter().take_while(|b| self.set.contains(b)).count())
    }

    fn store(&mut self, blocks: &[u64], _: &[u64]) -> anyhow::Result<()> {
        self.set.extend(blocks.iter().copied());
        Ok(())
    }
}

/// Least recently used, exactly.
pub struct Lru {
    cache: LruCache<u64, ()>,
    capacity: usize,
}

impl Lru {
    /// An LRU of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Lru {
            cache: LruCache::unbounded(),
            capacity,
        }
    }
}

impl BlockCache for Lru {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        Ok(blocks.iter().take_while(|b| self.cache.contains(b)).count())
    }

    fn store(&mut self, blocks: &[u64], _: &[u64]) -> anyhow::Result<()> {
        for b in blocks {
            self.cache.promote(b);
        }
        for b in blocks {
            if self.capacity == 0 || self.cache.contains(b) {
                continue;
            }
            if self.cache.len() >= self.capacity {
                self.cache.pop_lru();
            }
            self.cache.put(*b, ());
        }
        Ok(())
    }
}

/// Any of the pool's own eviction policies (`kvpool::eviction`), over block ids: the very code
/// the daemon runs, so simulated and real hit rates can only differ by the pool's sharding.
pub struct PoolPolicy {
    policy: Box<dyn Eviction>,
    handles: HashMap<u64, Handle>,
    blocks: Vec<u64>,
    free: Vec<Handle>,
    capacity: usize,
    tick: u64,
}

impl PoolPolicy {
    /// `kind` over `capacity` blocks.
    pub fn new(kind: PolicyKind, capacity: usize) -> Self {
        PoolPolicy::with_policy(kind.build(), capacity)
    }

    /// `policy` (a configured instance) over `capacity` blocks.
    pub fn with_policy(policy: Box<dyn Eviction>, capacity: usize) -> Self {
        PoolPolicy {
            policy,
            handles: HashMap::new(),
            blocks: Vec::new(),
            free: Vec::new(),
            capacity,
            tick: 0,
        }
    }
}

impl BlockCache for PoolPolicy {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        Ok(blocks
            .iter()
            .take_while(|b| self.handles.contains_key(b))
            .count())
    }

    fn store(&mut self, blocks: &[u64], _: &[u64]) -> anyhow::Result<()> {
        // Touched tail first, as the node reads a batch (`BatchGet`, `Lookup`).
        for b in blocks.iter().rev() {
            if let Some(&h) = self.handles.get(b) {
                self.tick += 1;
                self.policy.access(h, self.tick);
            }
        }
        // Stored tail first, as the client sends a batch (`Client::put_many`).
        for (depth, b) in blocks.iter().enumerate().rev() {
            if self.capacity == 0 || self.handles.contains_key(b) {
                continue;
            }
            if self.handles.len() >= self.capacity {
                self.tick += 1;
                let Some(v) = self.policy.victim(&mut |_| true, self.tick) else {
                    continue;
                };
                self.handles.remove(&self.blocks[v as usize]);
                self.free.push(v);
            }
            let h = self.free.pop().unwrap_or(self.blocks.len() as Handle);
            if h as usize == self.blocks.len() {
                self.blocks.push(*b);
            } else {
                self.blocks[h as usize] = *b;
            }
            self.handles.insert(*b, h);
            let fingerprint = xxhash_rust::xxh3::xxh3_64(&b.to_le_bytes());
            self.tick += 1;
            self.policy.insert(
                h,
                Insert {
                    fingerprint,
                    depth: depth as u32,
                    tick: self.tick,
                },
            );
        }
        Ok(())
    }
}

/// Belady's MIN with bypass: on a miss with the cache full, evict the block used farthest in
/// the future, or don't store the new block at all when it is used later still. The offline
/// optimum for block hits: the floor under which no online policy's misses can go.
pub struct Belady {
    next: HashMap<u64, u64>,
    heap: BinaryHeap<(u64, u64)>,
    capacity: usize,
}

impl Belady {
    /// Belady over `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Belady {
            next: HashMap::new(),
            heap: BinaryHeap::new(),
            capacity,
        }
    }

    /// The cached block with the farthest next use (dropping stale heap entries).
    fn farthest(&mut self) -> Option<(u64, u64)> {
        while let Some(&(n, b)) = self.heap.peek() {
            if self.next.get(&b) == Some(&n) {
                return Some((n, b));
            }
            self.heap.pop();
        }
        None
    }
}

impl BlockCache for Belady {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        Ok(blocks
            .iter()
            .take_while(|b| self.next.contains_key(b))
            .count())
    }

    fn store(&mut self, blocks: &[u64], next_use: &[u64]) -> anyhow::Result<()> {
        for (b, &n) in blocks.iter().zip(next_use) {
            if let Some(v) = self.next.get_mut(b) {
                *v = n;
                self.heap.push((n, *b));
            }
        }
        for (b, &n) in blocks.iter().zip(next_use) {
            if self.capacity == 0 || self.next.contains_key(b) {
                continue;
            }
            if self.next.len() >= self.capacity {
                let Some((far, victim)) = self.farthest() else {
                    continue;
                };
                if far <= n {
                    continue; // bypass: the newcomer is needed last
                }
                self.heap.pop();
                self.next.remove(&victim);
            }
            self.next.insert(*b, n);
            self.heap.push((n, *b));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recent_and_touches_hits() {
        let mut c = Lru::new(3);
        c.store(&[1, 2, 3], &[0; 3]).unwrap();
        c.store(&[1], &[0]).unwrap(); // 2 is now coldest
        c.store(&[4], &[0]).unwrap();
        assert_eq!(c.lookup(&[1, 3, 4]).unwrap(), 3);
        assert_eq!(c.lookup(&[2]).unwrap(), 0);
    }

    #[test]
    fn belady_keeps_what_is_needed_soonest_and_bypasses() {
        let mut c = Belady::new(2);
        c.store(&[1, 2], &[10, 5]).unwrap();
        c.store(&[3], &[20]).unwrap(); // needed later than both: bypassed
        assert_eq!(c.lookup(&[3]).unwrap(), 0);
        c.store(&[4], &[7]).unwrap(); // evicts 1 (next use 10)
        assert_eq!(c.lookup(&[2, 4]).unwrap(), 2);
        assert_eq!(c.lookup(&[1]).unwrap(), 0);
    }
}
