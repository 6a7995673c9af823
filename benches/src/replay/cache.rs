//! What a replay drives: something that holds blocks. The simulated policies live here; the
//! real pool (in-process or daemons) is in `pool_engine.rs`; clusters of either in `cluster.rs`.

use std::collections::{BinaryHeap, HashMap, HashSet};

use kvpool::eviction::{Eviction, Handle, Insert, PolicyKind};
use lru::LruCache;
use serde::Serialize;

use super::tiers::TierStats;

/// The order in which a request's blocks reach the policy when they are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// Every present block is touched first, then the missing ones are inserted: the node's
    /// order, where a request's reads (`BatchGet`) come before its writes (`put_many`).
    #[default]
    PresentFirst,
    /// Block by block from the first to the last: each touched if present, inserted if not, so
    /// an insertion can evict a block that the same request touches or reads further on.
    RequestOrder,
}

/// A cache of blocks, as the replay sees it.
pub trait BlockCache {
    /// Length of the leading run of `blocks` that is present. Changes nothing.
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize>;

    /// Stores a request's blocks in the cache's [`Order`] (by default: first touches the present
    /// ones, then inserts the missing ones), evicting as the policy says. `next_use[i]` is the position of
    /// the next access of `blocks[i]` in the whole trace (`u64::MAX`: never), for offline
    /// policies; online ones ignore it.
    fn store(&mut self, blocks: &[u64], next_use: &[u64]) -> anyhow::Result<()>;

    /// Starts recording the blocks this cache evicts, for a tier below it to take; false where
    /// the cache cannot (it then never evicts, or decides alone what it keeps).
    fn log_evictions(&mut self) -> bool {
        false
    }

    /// The blocks evicted since the last call, in the order they went.
    fn take_evicted(&mut self) -> Vec<u64> {
        Vec::new()
    }

    /// Hits tier by tier and what the lower tier wrote, for caches with tiers.
    fn tiers(&self) -> Option<TierStats> {
        None
    }
}

/// Where a cache records its victims once a tier below it asks for them.
#[derive(Default)]
struct EvictionLog(Option<Vec<u64>>);

impl EvictionLog {
    fn push(&mut self, block: u64) {
        if let Some(log) = &mut self.0 {
            log.push(block);
        }
    }

    fn start(&mut self) -> bool {
        self.0.get_or_insert_with(Vec::new);
        true
    }

    fn take(&mut self) -> Vec<u64> {
        self.0.as_mut().map(std::mem::take).unwrap_or_default()
    }
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
    order: Order,
    evicted: EvictionLog,
}

impl Lru {
    /// An LRU of `capacity` blocks, storing present blocks first.
    pub fn new(capacity: usize) -> Self {
        Lru {
            cache: LruCache::unbounded(),
            capacity,
            order: Order::default(),
            evicted: EvictionLog::default(),
        }
    }

    /// The same, storing a request's blocks in `order`.
    pub fn with_order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    fn insert(&mut self, b: u64) {
        if self.capacity == 0 || self.cache.contains(&b) {
            return;
        }
        if self.cache.len() >= self.capacity {
            if let Some((victim, ())) = self.cache.pop_lru() {
                self.evicted.push(victim);
            }
        }
        self.cache.put(b, ());
    }
}

impl BlockCache for Lru {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        Ok(blocks.iter().take_while(|b| self.cache.contains(b)).count())
    }

    fn store(&mut self, blocks: &[u64], _: &[u64]) -> anyhow::Result<()> {
        match self.order {
            Order::PresentFirst => {
                for b in blocks {
                    self.cache.promote(b);
                }
                for &b in blocks {
                    self.insert(b);
                }
            }
            Order::RequestOrder => {
                for &b in blocks {
                    if self.cache.get(&b).is_none() {
                        self.insert(b);
                    }
                }
            }
        }
        Ok(())
    }

    fn log_evictions(&mut self) -> bool {
        self.evicted.start()
    }

    fn take_evicted(&mut self) -> Vec<u64> {
        self.evicted.take()
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
    order: Order,
    evicted: EvictionLog,
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
            order: Order::default(),
            evicted: EvictionLog::default(),
        }
    }

    /// The same, storing a request's blocks in `order`.
    pub fn with_order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Touches `b` if present; says whether it was.
    fn touch(&mut self, b: u64) -> bool {
        let Some(&h) = self.handles.get(&b) else {
            return false;
        };
        self.tick += 1;
        self.policy.access(h, self.tick);
        true
    }

    /// Inserts `b`, `depth` blocks from its request's root, unless present.
    fn insert(&mut self, depth: usize, b: u64) {
        if self.capacity == 0 || self.handles.contains_key(&b) {
            return;
        }
        if self.handles.len() >= self.capacity {
            self.tick += 1;
            let Some(v) = self.policy.victim(&mut |_| true, self.tick) else {
                return;
            };
            let victim = self.blocks[v as usize];
            self.handles.remove(&victim);
            self.evicted.push(victim);
            self.free.push(v);
        }
        let h = self.free.pop().unwrap_or(self.blocks.len() as Handle);
        if h as usize == self.blocks.len() {
            self.blocks.push(b);
        } else {
            self.blocks[h as usize] = b;
        }
        self.handles.insert(b, h);
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
}

impl BlockCache for PoolPolicy {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        Ok(blocks
            .iter()
            .take_while(|b| self.handles.contains_key(b))
            .count())
    }

    fn store(&mut self, blocks: &[u64], _: &[u64]) -> anyhow::Result<()> {
        match self.order {
            Order::PresentFirst => {
                // Touched tail first, as the node reads a batch (`BatchGet`, `Lookup`).
                for &b in blocks.iter().rev() {
                    self.touch(b);
                }
                // Stored tail first, as the client sends a batch (`Client::put_many`).
                for (depth, &b) in blocks.iter().enumerate().rev() {
                    self.insert(depth, b);
                }
            }
            Order::RequestOrder => {
                for (depth, &b) in blocks.iter().enumerate() {
                    if !self.touch(b) {
                        self.insert(depth, b);
                    }
                }
            }
        }
        Ok(())
    }

    fn log_evictions(&mut self) -> bool {
        self.evicted.start()
    }

    fn take_evicted(&mut self) -> Vec<u64> {
        self.evicted.take()
    }
}

/// Belady's MIN with bypass: on a miss with the cache full, evict the block used farthest in
/// the future, or don't store the new block at all when it is used later still. The offline
/// optimum for block hits: the floor under which no online policy's misses can go.
pub struct Belady {
    next: HashMap<u64, u64>,
    heap: BinaryHeap<(u64, u64)>,
    capacity: usize,
    order: Order,
}

impl Belady {
    /// Belady over `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Belady {
            next: HashMap::new(),
            heap: BinaryHeap::new(),
            capacity,
            order: Order::default(),
        }
    }

    /// The same, storing a request's blocks in `order`.
    pub fn with_order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Notes the next use `n` of `b` if present; says whether it was.
    fn touch(&mut self, b: u64, n: u64) -> bool {
        let Some(v) = self.next.get_mut(&b) else {
            return false;
        };
        *v = n;
        self.heap.push((n, b));
        true
    }

    /// Stores `b`, next used at `n`, unless present or needed later than everything cached.
    fn insert(&mut self, b: u64, n: u64) {
        if self.capacity == 0 || self.next.contains_key(&b) {
            return;
        }
        if self.next.len() >= self.capacity {
            let Some((far, victim)) = self.farthest() else {
                return;
            };
            if far <= n {
                return; // bypass: the newcomer is needed last
            }
            self.heap.pop();
            self.next.remove(&victim);
        }
        self.next.insert(b, n);
        self.heap.push((n, b));
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
        match self.order {
            Order::PresentFirst => {
                for (&b, &n) in blocks.iter().zip(next_use) {
                    self.touch(b, n);
                }
                for (&b, &n) in blocks.iter().zip(next_use) {
                    self.insert(b, n);
                }
            }
            Order::RequestOrder => {
                for (&b, &n) in blocks.iter().zip(next_use) {
                    if !self.touch(b, n) {
                        self.insert(b, n);
                    }
                }
            }
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
