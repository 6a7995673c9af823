//! Eviction policies: which object goes when memory is needed.
//!
//! A policy orders the objects of one namespace in one index shard, named by small integer
//! [`Handle`]s that the shard assigns (and reuses after removal). Each policy is a data
//! structure over vectors indexed by handle, so no operation allocates beyond growing them. The
//! shard asks [`Eviction::victim`] for a candidate and says, through `evictable`, which objects
//! may not go now (pinned, leased, being read); the policy must skip those and keep the scan
//! bounded.
//!
//! A sharded index builds a namespace's instances together ([`PolicyKind::build_shards`]); they
//! share what the policy learns through atomics and rank their next victims by ticks that mean
//! the same in every shard ([`Eviction::peek_stamp`], [`Eviction::victim_below`]), so that the
//! shards evict as one policy over all the objects would.
//!
//! Named implementations, chosen per namespace in the daemon's config (`eviction = "..."`):
//!
//! - [`Lru`] (`lru`): least recently used, the baseline;
//! - [`PrefixAware`] (`prefix-aware`): LRU that evicts deeper blocks of a prefix chain before
//!   their ancestors, as SGLang's radix cache evicts leaves first: a block is worthless once a
//!   block before it is gone;
//! - [`S3Fifo`] (`s3fifo`): an adaptive S3-FIFO. New objects enter a small FIFO and only move to
//!   the main FIFO if touched again before they leave it, so the blocks seen once (76 % of them
//!   in the public conversation trace) can't flush the reused ones; ghost lists of recently
//!   evicted fingerprints steer the small FIFO's share, as ARC steers its target;
//! - `s3fifo-lru` (the default): the same with its main queue in recency order
//!   ([`S3FifoConfig::main_lru`]), so that blocks reread many times and then never again (a
//!   finished conversation) leave as soon as LRU would drop them. Never more than a point below
//!   LRU on any workload measured, where `s3fifo` loses up to 2.5;
//! - [`Density`] (`hit-density`): evicts the block of lowest expected hits per unit of cache
//!   time, learned online per class of block (reference count, gap between references, depth)
//!   as a function of age, with a ghost history of evicted prefixes; docs/EVICTION.md.
//!
//! docs/BENCHMARKS.md has each policy's hit rate against LRU and Belady's optimum.

mod density;
mod list;
mod lru;
mod prefix_aware;
mod s3fifo;

use std::fmt;
use std::str::FromStr;

use crate::paged::Paged;

pub use density::{Density, DensityConfig};
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
    /// [`Eviction::victim`] for a sharded index, where `bound` is the [`Eviction::peek_stamp`]
    /// of the best candidate of the other shards sampled: `None` as soon as the object to look
    /// at next ranks above `bound`, because a scan that spared objects (S3-FIFO promoting or
    /// re-queueing touched ones) reached objects younger than the other shard's candidate, which
    /// one policy over all the objects would have looked at first. The caller samples again.
    /// The default ignores `bound`: policies whose first candidate is their victim don't need it.
    fn victim_below(
        &mut self,
        evictable: &mut dyn FnMut(Handle) -> bool,
        tick: u64,
        bound: u64,
    ) -> Option<Handle> {
        let _ = bound;
        self.victim(evictable, tick)
    }
    /// The age of the object [`Eviction::victim`] would consider first, as the logical time the
    /// policy ranks it by (last access for LRU, entry into its queue for S3-FIFO): a sharded
    /// index evicts from the shard whose next victim is oldest. Ticks come from one pool-wide
    /// counter, so they compare across shards. A candidate that is next in its shard but not in
    /// its namespace's order (S3-FIFO: from the FIFO the namespace is not evicting from) carries
    /// [`OUT_OF_TURN`], so that every candidate in turn goes first.
    fn peek_stamp(&self) -> Option<u64>;
    /// How much the policy would rather keep `h` than the other objects it holds, as a number
    /// that only orders them (higher: kept longer; recency first). What the cluster's
    /// handover goes by to choose the hottest objects to hand to their new owners.
    fn worth(&self, h: Handle) -> u64;
    /// Objects held.
    fn len(&self) -> usize;
    /// True when no object is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Records `tick` for handle `h`, growing the table as needed.
fn set_stamp(stamps: &mut Paged<u64>, h: Handle, tick: u64) {
    stamps.grow_to(h as usize + 1, 0);
    stamps[h as usize] = tick;
}

/// Set in a [`Eviction::peek_stamp`] whose candidate is out of its namespace's turn. Ticks
/// never come near it (one per operation; 2^63 operations take centuries).
pub const OUT_OF_TURN: u64 = 1 << 63;

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
    /// [`S3Fifo`] with its default configuration: the paper's main FIFO.
    S3Fifo,
    /// [`S3Fifo`] with its main queue in recency order ([`S3FifoConfig::main_lru`]); the
    /// default policy.
    #[default]
    S3FifoLru,
    /// [`Density`] with its default configuration.
    HitDensity,
}

impl PolicyKind {
    /// Every policy.
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::Lru,
        PolicyKind::PrefixAware,
        PolicyKind::S3Fifo,
        PolicyKind::S3FifoLru,
        PolicyKind::HitDensity,
    ];

    /// The name used in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::PrefixAware => "prefix-aware",
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::S3FifoLru => "s3fifo-lru",
            PolicyKind::HitDensity => "hit-density",
        }
    }

    /// A fresh instance, over all the objects of a namespace.
    pub fn build(self) -> Box<dyn Eviction> {
        self.build_shards(1).pop().expect("one instance")
    }

    /// `n` fresh instances, one per shard of a sharded index, over the objects of one namespace.
    /// They share what the policy learns (S3-FIFO's queue lengths and target, prefix-aware's
    /// object count), so `n` shards behave as one policy as far as a shard can see.
    pub fn build_shards(self, n: usize) -> Vec<Box<dyn Eviction>> {
        fn boxed<E: Eviction + 'static>(v: Vec<E>) -> Vec<Box<dyn Eviction>> {
            v.into_iter()
                .map(|e| Box::new(e) as Box<dyn Eviction>)
                .collect()
        }
        match self {
            PolicyKind::Lru => boxed((0..n).map(|_| Lru::default()).collect()),
            PolicyKind::PrefixAware => boxed(PrefixAware::shards(n)),
            PolicyKind::S3Fifo => boxed(S3Fifo::shards(S3FifoConfig::default(), n)),
            PolicyKind::S3FifoLru => boxed(S3Fifo::shards(
                S3FifoConfig {
                    main_lru: true,
                    ghost_factor: 4.0,
                    ..S3FifoConfig::default()
                },
                n,
            )),
            PolicyKind::HitDensity => boxed(Density::shards(DensityConfig::default(), n)),
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
            .ok_or_else(|| {
                format!("unknown eviction policy {s:?} (lru, prefix-aware, s3fifo, s3fifo-lru, hit-density)")
            })
    }
}

#[cfg(test)]
mod tests;
