//! Eviction policies: which object goes when memory is needed.
//!
//! A policy orders the objects of one namespace in one index shard, named by small integer
//! [`Handle`]s that the shard assigns (and reuses after removal). Each policy is a data
//! structure over vectors indexed by handle, so no operation allocates beyond growing them. The
//! shard asks [`Eviction::victim`] for a candidate and says, through `evictable`, which objects
//! may not go now (pinned, leased, being read); the policy must skip those and keep the scan
//! bounded.
//!
//! Named implementations, chosen per namespace in the daemon's config (`eviction = "..."`):
//!
//! - [`Lru`] (`lru`): least recently used, the baseline;
//! - [`PrefixAware`] (`prefix-aware`): LRU that evicts deeper blocks of a prefix chain before
//!   their ancestors, as SGLang's radix cache evicts leaves first: a block is worthless once a
//!   block before it is gone;
//! - [`S3Fifo`] (`s3fifo`, the default): an adaptive S3-FIFO. New objects enter a small FIFO and
//!   only move to the main FIFO if touched again before they leave it, so the blocks seen once
//!   (76 % of them in the public conversation trace) can't flush the reused ones; ghost lists of
//!   recently evicted fingerprints steer the small FIFO's share, as ARC steers its target.
//!
//! docs/BENCHMARKS.md has each policy's hit rate against LRU and Belady's optimum.

mod list;
mod lru;
mod prefix_aware;
mod s3fifo;

use std::fmt;
use std::str::FromStr;

pub use lru::Lru;
pub use prefix_aware::PrefixAware;
pub use s3fifo::{S3Fifo, S3FifoConfig};

/// An object, as the index shard names it to the policy.
pub type Handle = u32;

/// What a policy learns of an object when it is inserted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Insert {
    /// A 64-bit hash of the object's key: stable across removal and re-insertion, unlike the
    /// handle (ghost lists remember these).
    pub fingerprint: u64,
    /// Position of the block in its prefix chain (0 for the first block, or for objects that
    /// are not part of a chain).
    pub depth: u32,
    /// Logical time of the insertion (see [`Eviction::peek_stamp`]).
    pub tick: u64,
}

/// An eviction policy over the objects of one namespace in one shard.
pub trait Eviction: Send + fmt::Debug {
    /// A new object (not currently held by the policy).
    fn insert(&mut self, h: Handle, info: Insert);
    /// The object was read or written again, at logical time `tick`.
    fn access(&mut self, h: Handle, tick: u64);
    /// The object left for another reason than eviction (removed, replaced).
    fn remove(&mut self, h: Handle);
    /// Picks and forgets the next object to evict, skipping those `evictable` refuses; `None`
    /// when a bounded scan found nothing evictable. `tick` is the logical time now.
    fn victim(&mut self, evictable: &mut dyn FnMut(Handle) -> bool, tick: u64) -> Option<Handle>;
    /// The age of the object [`Eviction::victim`] would consider first, as the logical time the
    /// policy ranks it by (last access for LRU, entry into its queue for S3-FIFO): a sharded
    /// index evicts from the shard whose next victim is oldest. Ticks come from one pool-wide
    /// counter, so they compare across shards.
    fn peek_stamp(&self) -> Option<u64>;
    /// Objects held.
    fn len(&self) -> usize;
    /// True when no object is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Records `tick` for handle `h`, growing the table as needed.
fn set_stamp(stamps: &mut Vec<u64>, h: Handle, tick: u64) {
    if stamps.len() <= h as usize {
        stamps.resize(h as usize + 1, 0);
    }
    stamps[h as usize] = tick;
}

/// How many objects a victim scan looks at before giving up (or, for S3-FIFO, before falling
/// back to plain FIFO order).
pub(crate) const SCAN: usize = 16;

/// The policies, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    /// [`Lru`].
    Lru,
    /// [`PrefixAware`].
    PrefixAware,
    /// [`S3Fifo`] with its default configuration; the default policy.
    #[default]
    S3Fifo,
}

impl PolicyKind {
    /// Every policy.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Lru, PolicyKind::PrefixAware, PolicyKind::S3Fifo];

    /// The name used in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::PrefixAware => "prefix-aware",
            PolicyKind::S3Fifo => "s3fifo",
        }
    }

    /// A fresh instance.
    pub fn build(self) -> Box<dyn Eviction> {
        match self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::PrefixAware => Box::new(PrefixAware::default()),
            PolicyKind::S3Fifo => Box::new(S3Fifo::default()),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown eviction policy {s:?} (lru, prefix-aware, s3fifo)"))
    }
}

#[cfg(test)]
mod tests;
