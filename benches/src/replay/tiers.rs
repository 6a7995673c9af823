//! A simulated disk tier under a simulated DRAM one (docs/EVICTION.md, "Two tiers").
//!
//! - An unpinned block the DRAM policy evicts is *demoted*: written to disk if the admission
//!   filter ([`Admit`]) lets it, unless a copy is still there.
//! - The disk tier is a FIFO log of blocks: when full, the oldest write goes. A real SSD tier
//!   appends to regions and reclaims the oldest region whole, so it never rewrites a block in
//!   place to keep it; a hit does not move a block in the log.
//! - A request's hits are the leading run of its blocks present in either tier; a block read
//!   from disk is *promoted*: the request stores it into DRAM like every block it holds, and the
//!   disk copy stays until the log reclaims it (so demoting it again writes nothing).

use std::collections::{HashSet, VecDeque};

use serde::Serialize;

use super::cache::BlockCache;

/// Which evicted blocks are worth a disk write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Admit {
    /// Every block DRAM evicts.
    #[default]
    All,
    /// Only blocks read at least once since they last came into DRAM (a DRAM hit, or the disk
    /// hit that promoted them): a block never reused is never written.
    ReadOnce,
}

/// What the two tiers did over a replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierStats {
    /// Hits served from DRAM.
    pub dram_hits: u64,
    /// Hits served from disk (each one block read from disk).
    pub disk_hits: u64,
    /// Blocks written to disk.
    pub disk_writes: u64,
    /// Evicted blocks the admission filter kept off the disk.
    pub disk_refused: u64,
}

impl TierStats {
    /// Both tiers' figures summed (caches side by side).
    pub fn sum(self, o: TierStats) -> TierStats {
        TierStats {
            dram_hits: self.dram_hits + o.dram_hits,
            disk_hits: self.disk_hits + o.disk_hits,
            disk_writes: self.disk_writes + o.disk_writes,
            disk_refused: self.disk_refused + o.disk_refused,
        }
    }
}

/// A DRAM cache (any policy that reports its evictions) over a FIFO disk tier of
/// `disk_capacity` blocks.
pub struct TwoTier {
    dram: Box<dyn BlockCache>,
    disk: Fifo,
    admit: Admit,
    /// DRAM blocks read since they came in: what `Admit::ReadOnce` admits.
    read: HashSet<u64>,
    stats: TierStats,
}

impl TwoTier {
    /// `dram` over a disk of `disk_capacity` blocks; fails if `dram` cannot report evictions.
    pub fn new(
        mut dram: Box<dyn BlockCache>,
        disk_capacity: usize,
        admit: Admit,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            dram.log_evictions(),
            "this policy cannot have a disk tier under it"
        );
        Ok(TwoTier {
            dram,
            disk: Fifo::new(disk_capacity),
            admit,
            read: HashSet::new(),
            stats: TierStats::default(),
        })
    }

    /// Blocks on disk now.
    pub fn disk_len(&self) -> usize {
        self.disk.set.len()
    }

    fn in_dram(&mut self, b: u64) -> anyhow::Result<bool> {
        Ok(self.dram.lookup(&[b])? == 1)
    }

    /// Writes what DRAM just evicted to disk, as the filter admits.
    fn demote(&mut self) -> anyhow::Result<()> {
        for v in self.dram.take_evicted() {
            let was_read = self.read.remove(&v);
            if self.disk.contains(v) || self.in_dram(v)? {
                continue; // still on disk, or back in DRAM within the same request
            }
            if self.admit == Admit::ReadOnce && !was_read {
                self.stats.disk_refused += 1;
                continue;
            }
            if self.disk.push(v) {
                self.stats.disk_writes += 1;
            }
        }
        Ok(())
    }
}

impl BlockCache for TwoTier {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        let mut run = self.dram.lookup(blocks)?;
        while run < blocks.len()
            && (self.disk.contains(blocks[run]) || self.in_dram(blocks[run])?)
        {
            run += 1;
        }
        Ok(run)
    }

    fn store(&mut self, blocks: &[u64], next_use: &[u64]) -> anyhow::Result<()> {
        let run = self.lookup(blocks)?;
        let mut from_disk = Vec::new();
        for &b in &blocks[..run] {
            if self.in_dram(b)? {
                self.stats.dram_hits += 1;
            } else {
                self.stats.disk_hits += 1;
                from_disk.push(b);
            }
            self.read.insert(b);
        }
        self.dram.store(blocks, next_use)?;
        self.demote()?;
        for b in from_disk {
            if !self.in_dram(b)? {
                self.read.remove(&b); // a DRAM with no room did not take it
            }
        }
        Ok(())
    }

    fn tiers(&self) -> Option<TierStats> {
        Some(self.stats)
    }
}

/// The disk tier: a log of blocks, oldest reclaimed first.
struct Fifo {
    order: VecDeque<u64>,
    set: HashSet<u64>,
    capacity: usize,
}

impl Fifo {
    fn new(capacity: usize) -> Self {
        Fifo {
            order: VecDeque::new(),
            set: HashSet::new(),
            capacity,
        }
    }

    fn contains(&self, b: u64) -> bool {
        self.set.contains(&b)
    }

    /// Appends `b`, reclaiming the oldest blocks to make room; false if the tier holds nothing.
    fn push(&mut self, b: u64) -> bool {
        if self.capacity == 0 {
            return false;
        }
        while self.set.len() >= self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        self.order.push_back(b);
        self.set.insert(b);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::cache::{Lru, Order, PoolPolicy};
    use kvpool::eviction::PolicyKind;

    fn lru_over_disk(dram: usize, disk: usize, admit: Admit) -> TwoTier {
        TwoTier::new(Box::new(Lru::new(dram)), disk, admit).unwrap()
    }

    /// Replays `requests` (lookup, then store) and returns the hits of each.
    fn drive(c: &mut dyn BlockCache, requests: &[&[u64]]) -> Vec<usize> {
        requests
            .iter()
            .map(|r| {
                let hits = c.lookup(r).unwrap();
                c.store(r, &vec![u64::MAX; r.len()]).unwrap();
                hits
            })
            .collect()
    }

    #[test]
    fn a_block_evicted_from_dram_then_requested_is_a_disk_hit() {
        let mut c = lru_over_disk(2, 10, Admit::All);
        assert_eq!(drive(&mut c, &[&[1, 2], &[3, 4]]), [0, 0]);
        assert_eq!(c.disk_len(), 2, "1 and 2 went to disk");
        assert_eq!(drive(&mut c, &[&[1, 2]]), [2]);
        let s = c.tiers().unwrap();
        assert_eq!((s.dram_hits, s.disk_hits), (0, 2));
        assert_eq!(s.disk_writes, 4, "promoting 1 and 2 demoted 3 and 4");
        // Promoted: 1 and 2 hit from DRAM now.
        assert_eq!(drive(&mut c, &[&[1, 2]]), [2]);
        assert_eq!(c.tiers().unwrap().dram_hits, 2);
        // Their disk copies stayed, so evicting them again writes nothing.
        drive(&mut c, &[&[6, 7]]);
        assert_eq!(c.tiers().unwrap().disk_writes, 4);
        assert_eq!(drive(&mut c, &[&[1, 2, 3, 4, 6]]), [5]);
    }

    #[test]
    fn read_once_admission_refuses_a_never_read_block() {
        let mut c = lru_over_disk(2, 10, Admit::ReadOnce);
        drive(&mut c, &[&[1, 2], &[1], &[3, 4]]);
        let s = c.tiers().unwrap();
        assert_eq!(
            (s.disk_writes, s.disk_refused),
            (1, 1),
            "1 was read, 2 never"
        );
        assert_eq!(drive(&mut c, &[&[1], &[2]]), [1, 0]);
    }

    #[test]
    fn the_disk_tier_never_exceeds_its_capacity() {
        let mut c = lru_over_disk(3, 5, Admit::All);
        for i in 0..200u64 {
            let r: Vec<u64> = (0..1 + i % 7).map(|j| (i * 31 + j * 17) % 50).collect();
            drive(&mut c, &[&r]);
            assert!(c.disk_len() <= 5);
        }
        assert_eq!(c.disk_len(), 5);
    }

    #[test]
    fn the_disk_tier_is_first_in_first_out() {
        let mut c = lru_over_disk(1, 2, Admit::All);
        drive(&mut c, &[&[1], &[2], &[3]]);
        assert!(c.disk.contains(1) && c.disk.contains(2));
        assert_eq!(drive(&mut c, &[&[1]]), [1]);
        // Promoting 1 demoted 3, and the oldest write went, though it was just read.
        assert!(!c.disk.contains(1) && c.disk.contains(2) && c.disk.contains(3));
    }

    #[test]
    fn with_no_disk_the_hits_are_dram_only() {
        let requests: Vec<Vec<u64>> = (0..300u64)
            .map(|i| (0..1 + i % 9).map(|j| (i / 3 + j * 5) % 40).collect())
            .collect();
        let refs: Vec<&[u64]> = requests.iter().map(Vec::as_slice).collect();
        for order in [Order::PresentFirst, Order::RequestOrder] {
            let dram = || PoolPolicy::new(PolicyKind::S3FifoLru, 8).with_order(order);
            let alone = drive(&mut dram(), &refs);
            let mut two = TwoTier::new(Box::new(dram()), 0, Admit::All).unwrap();
            assert_eq!(drive(&mut two, &refs), alone, "{order:?}");
            let alone = drive(&mut Lru::new(8).with_order(order), &refs);
            let lru = Box::new(Lru::new(8).with_order(order));
            let mut two = TwoTier::new(lru, 0, Admit::All).unwrap();
            assert_eq!(drive(&mut two, &refs), alone, "{order:?}");
            let s = two.tiers().unwrap();
            assert_eq!((s.disk_hits, s.disk_writes), (0, 0));
        }
    }

    #[test]
    fn a_policy_that_cannot_report_evictions_gets_no_disk() {
        let belady = Box::new(crate::replay::cache::Belady::new(4));
        assert!(TwoTier::new(belady, 10, Admit::All).is_err());
    }

    proptest::proptest! {
        /// Whatever the requests: the tiers' hits sum to the replay's, the disk stays within its
        /// capacity, a disk hits at least what DRAM alone does, and a disk of no blocks changes
        /// nothing.
        #[test]
        fn tiers_add_up_and_stay_within_capacity(
            requests in proptest::collection::vec(
                proptest::collection::vec(0u64..60, 1..12), 1..80),
            dram in 0usize..12,
            disk in 0usize..30,
            read_once in proptest::bool::ANY,
            request_order in proptest::bool::ANY,
        ) {
            let admit = if read_once { Admit::ReadOnce } else { Admit::All };
            let order = if request_order { Order::RequestOrder } else { Order::PresentFirst };
            let refs: Vec<&[u64]> = requests.iter().map(Vec::as_slice).collect();
            let lru = Box::new(Lru::new(dram).with_order(order));
            let mut two = TwoTier::new(lru, disk, admit).unwrap();
            let mut alone = Lru::new(dram).with_order(order);
            let mut total = 0;
            for r in &refs {
                // DRAM holds the same blocks with or without a disk under it (it stores every
                // block of every request alike), so a disk can only lengthen the run.
                let (hits, dram_only) = (drive(&mut two, &[r])[0], drive(&mut alone, &[r])[0]);
                proptest::prop_assert!(hits >= dram_only);
                proptest::prop_assert!(disk > 0 || hits == dram_only);
                proptest::prop_assert!(two.disk_len() <= disk);
                total += hits as u64;
            }
            let s = two.tiers().unwrap();
            proptest::prop_assert_eq!(s.dram_hits + s.disk_hits, total);
        }
    }
}
