//! Allocations that are being written and not yet committed: invisible to readers, reclaimed
//! when abandoned past their deadline.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::claims::WriteClaims;
use crate::pool::Millis;

/// One uncommitted allocation.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) ns: u32,
    pub(crate) key: Box<[u8]>,
    pub(crate) segment: u16,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) size: u64,
    pub(crate) deadline: Millis,
    pub(crate) pin: bool,
    /// Position in its prefix chain, for the eviction policy.
    pub(crate) depth: u32,
    /// Ranges that open writes are copying into right now; the reaper, commit and abort leave
    /// the block alone meanwhile.
    pub(crate) claims: WriteClaims,
    /// A commit has sealed it (no write may open) and is checking its bytes; it leaves the
    /// table only under its key's index-shard lock (see `Pool::seal`).
    pub(crate) committing: bool,
    /// Its key was cancelled (`Pool::cancel`) while a write or a commit held it: it can never
    /// be committed, and whoever touches it next (its commit, an abort, the reaper) frees it.
    pub(crate) cancelled: bool,
}

/// Pending allocations of one shard, by generation.
#[derive(Default)]
pub(crate) struct PendingShard {
    pub(crate) by_generation: HashMap<u64, Pending>,
}

impl PendingShard {
    /// Takes out every allocation past its deadline that no write or commit is using.
    pub(crate) fn take_expired(&mut self, now: Millis, out: &mut Vec<(u64, Pending)>) {
        let expired: Vec<u64> = self
            .by_generation
            .iter()
            .filter(|(_, p)| p.deadline <= now && p.claims.is_empty() && !p.committing)
            .map(|(&g, _)| g)
            .collect();
        for g in expired {
            if let Some(p) = self.by_generation.remove(&g) {
                out.push((g, p));
            }
        }
    }
}

/// Generations of the allocations cancelled lately, so that a commit or write arriving after
/// its allocation was cancelled and freed is told why ([`crate::PoolError::Cancelled`]) rather
/// than that the address is not writable. The last [`RECENT_CANCELS`] only.
#[derive(Default)]
pub(crate) struct RecentCancels {
    set: HashSet<u64>,
    order: VecDeque<u64>,
}

/// How many cancelled generations [`RecentCancels`] remembers (8 bytes each, twice).
pub(crate) const RECENT_CANCELS: usize = 1 << 14;

impl RecentCancels {
    pub(crate) fn note(&mut self, generation: u64) {
        if !self.set.insert(generation) {
            return;
        }
        self.order.push_back(generation);
        while self.order.len() > RECENT_CANCELS {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    pub(crate) fn contains(&self, generation: u64) -> bool {
        self.set.contains(&generation)
    }
}
