//! The pool: segments, their allocators, the object index, and every operation on objects.
//!
//! This is the node's whole state machine, with no sockets and no clock: callers pass `now`
//! (milliseconds on any monotonic clock of theirs). It is `Sync`; the daemon shares one `Pool`
//! between all connections.
//!
//! Locks, always taken in this order and never the other way: an index shard, then a
//! segment's allocator. The pending tables are never held while taking another lock (they are
//! taken under an index shard's lock by commits and cancels, and under the recent cancels'
//! lock by cancels).
//!
//! An object's life: [`Pool::alloc`] reserves memory and quota and returns a signed address of a
//! *pending* object (invisible to readers); the bytes are written (by the daemon from a socket,
//! by one-sided writes, or by a same-host client straight into the mapping); [`Pool::commit`]
//! checks the checksum and makes it visible atomically, replacing any older object of the same
//! key. Pending objects not committed by their deadline are reclaimed by [`Pool::reap`].
//!
//! Each job has its file: config.rs (the configuration), layout.rs and open.rs (the memory laid
//! out, the pool opened in its steps), write.rs (allocations and their writers), commit.rs (the
//! one commit operation), cancel.rs (abort, cancel, reap), read.rs (reads, holds, leases,
//! one-sided reads), pins.rs, remove.rs (removal and the retirement every departure ends in),
//! evict.rs, namespace.rs (tenants and their limits); the index (index.rs, keys.rs), the
//! pending tables (pending.rs), scans, statistics and recovery beside them. This file holds
//! the pool's state and the helpers every job shares.

mod cancel;
mod commit;
mod config;
mod evict;
mod index;
mod keys;
mod layout;
mod namespace;
mod open;
mod pending;
mod pins;
mod prefault;
mod read;
mod recency;
mod recover;
mod remove;
mod scan;
mod stats;
mod write;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::addr::{GlobalAddr, MacKey, NodeId, Place};
use crate::alloc::Allocator;
use crate::error::{AddrFault, PoolError, MAX_KEY_LEN};
use crate::journal::{Journal, SharedJournal};
use crate::segment::Segment;
use crate::sync::lock;
use index::Shard;
use namespace::Namespace;
use pending::{PendingShard, RecentCancels};

pub use commit::Commit;
pub use config::{default_dir, PoolConfig};
pub use namespace::{NamespaceConfig, DEFAULT_NAMESPACE};
pub use pins::Unpinned;
pub use read::{Located, ObjectRef};
pub use recency::recency_file_name;
pub use recover::Recovery;
pub use scan::ScanPage;
pub use stats::{NamespaceStats, PoolStats, SegmentStats};
pub use write::PendingWrite;

/// Milliseconds on the caller's monotonic clock.
pub type Millis = u64;

/// The node's memory pool.
pub struct Pool {
    node: NodeId,
    /// This life of the node: stamped on every address, refused on any other's.
    incarnation: u64,
    mac: MacKey,
    segments: Vec<SegmentSlot>,
    shards: Box<[Mutex<Shard>]>,
    pending: Box<[Mutex<PendingShard>]>,
    /// Allocations cancelled lately, for a clear error to their late commits.
    cancelled: Mutex<RecentCancels>,
    namespaces: Vec<Namespace>,
    /// Per namespace, the segments it allocates from: the common ones (which start at 0), or
    /// its own.
    ns_segments: Vec<std::ops::Range<usize>>,
    next_generation: AtomicU64,
    segment_cursor: AtomicUsize,
    evict_cursor: AtomicUsize,
    /// Logical time: one tick per insert or access, to compare objects of different shards.
    clock: AtomicU64,
    pending_timeout: Millis,
    /// [`PoolConfig::max_key_len`], within 1 to [`MAX_KEY_LEN`].
    max_key_len: usize,
    max_lease: Millis,
    counters: stats::Counters,
    /// Bytes held by the namespaces without a reservation, which share `unreserved`.
    shared_used: AtomicU64,
    unreserved: u64,
    /// Told of every commit (see [`Pool::observe`]).
    observer: std::sync::OnceLock<Arc<dyn CommitObserver>>,
    /// The tier under DRAM (see [`Pool::set_lower_tier`]).
    lower: std::sync::OnceLock<Arc<dyn LowerTier>>,
    /// The index journal, for file-backed segments (see [`crate::journal`]). Locked under an
    /// index shard's lock, never the other way; compacted without either.
    journal: Option<SharedJournal>,
    /// What was recovered of the previous life at start-up.
    recovery: Recovery,
    /// The prefaulting thread, once started ([`Pool::start_prefaulting`]).
    prefault: std::sync::OnceLock<prefault::Wake>,
}

/// Told of every object that becomes visible (see [`Pool::observe`]).
pub trait CommitObserver: Send + Sync {
    /// `key` of namespace `ns` was just committed. Called with the key's index shard locked,
    /// so any reader that looks the key up after this call returns finds the object; it must
    /// be quick and must never call into the pool.
    fn committed(&self, ns: u32, key: &[u8]);

    /// `key` of namespace `ns` just left the index: removed, cancelled, expired or evicted
    /// (not replaced: a newer commit of the key is [`CommitObserver::committed`]). Called
    /// with the key's index shard locked, under the same rules; the default does nothing.
    fn removed(&self, ns: u32, key: &[u8]) {
        let _ = (ns, key);
    }
}

/// A tier under DRAM (see [`Pool::set_lower_tier`]): shown every object the pool evicts, told
/// of every commit and removal so that it never keeps a copy that DRAM has replaced, and asked
/// whether it holds a key so that lookups see both tiers. Every call but
/// [`LowerTier::demote`] is made with the key's index shard locked: each must be quick (a
/// decision, index updates) and must never call into the pool.
pub trait LowerTier: Send + Sync {
    /// Unpinned `victim` is being evicted (still indexed, under its shard lock): the tier's
    /// claim on its bytes, if it wants them. Everything the pool tells the tier of the key
    /// after this call (a commit, a removal) comes after the claim.
    fn evicting(&self, victim: &Victim<'_>) -> Option<Claim>;
    /// The bytes of a victim `claim` was given for, once it left the index, with no lock
    /// held; its block is freed once this returns, so a tier that keeps them copies them.
    fn demote(&self, claim: Claim, value: &[u8]);
    /// `key` of namespace `ns` was just committed with a value whose xxh3-64 is `checksum`:
    /// a copy of another value is stale from now on.
    fn committed(&self, ns: u32, key: &[u8], checksum: u64);
    /// `key` of namespace `ns` is being removed (whether or not DRAM holds it): whether the
    /// tier held it.
    fn removed(&self, ns: u32, key: &[u8]) -> bool;
    /// Whether the tier holds `key` of namespace `ns` (not read: a read of it may still miss).
    fn holds(&self, ns: u32, key: &[u8]) -> bool;
    /// `key` of namespace `ns` is being removed only as the object of `generation` (a TTL or
    /// a hand-over, not a newer write): the tier forgets its copy of that generation, and says
    /// whether DRAM's object, of generation `in_dram`, is the one it brought up from that copy
    /// (so the pool removes it too: the same object, moved between tiers).
    fn removed_generation(
        &self,
        ns: u32,
        key: &[u8],
        generation: u64,
        in_dram: Option<u64>,
    ) -> bool;
}

/// A tier's claim on an evicted object's bytes (see [`LowerTier::evicting`]): whatever the
/// tier needs to find its own record of the claim again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim(pub u64);

/// An object being evicted, as a [`LowerTier`] is shown it.
#[derive(Clone, Copy, Debug)]
pub struct Victim<'a> {
    /// Namespace id.
    pub ns: u32,
    /// Key.
    pub key: &'a [u8],
    /// Value length.
    pub len: u64,
    /// The value's xxh3-64, as checked at commit.
    pub checksum: u64,
    /// The object's generation.
    pub generation: u64,
    /// Whether it was read since it was committed (existence and prefix lookups do not
    /// count).
    pub accessed: bool,
}

struct SegmentSlot {
    segment: Segment,
    alloc: Mutex<Allocator>,
}

impl Pool {
    /// What was recovered of the previous life of this node at start-up (all zero when there
    /// was none, or the segments are anonymous).
    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    /// This pool's node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// This pool's incarnation: nonzero, different at every start, stamped on every address.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The id of the namespace called `name`.
    pub fn namespace_id(&self, name: &str) -> Option<u32> {
        self.namespaces
            .iter()
            .position(|n| n.name == name)
            .map(|i| i as u32)
    }

    /// Every namespace, as (name, id).
    pub fn namespaces(&self) -> Vec<(String, u32)> {
        self.namespaces
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i as u32))
            .collect()
    }

    /// The segments, for same-host clients that map them.
    pub fn segments(&self) -> impl Iterator<Item = &Segment> {
        self.segments.iter().map(|s| &s.segment)
    }

    /// Largest value this pool can ever hold (in its largest segment).
    pub fn max_value_len(&self) -> u64 {
        self.segments
            .iter()
            .map(|s| s.segment.data_len())
            .max()
            .unwrap_or(0)
    }

    /// The namespace whose own segment `segment` is; None for a common segment (or none).
    pub fn segment_owner(&self, segment: u32) -> Option<u32> {
        self.ns_segments
            .iter()
            .position(|r| r.start != 0 && r.contains(&(segment as usize)))
            .map(|ns| ns as u32)
    }

    /// The namespaces that keep their objects in the common segments.
    pub fn common_namespaces(&self) -> impl Iterator<Item = u32> + '_ {
        self.ns_segments
            .iter()
            .enumerate()
            .filter(|(_, r)| r.start == 0)
            .map(|(i, _)| i as u32)
    }

    /// Refuses a namespace id this pool does not have (`UnknownNamespace`).
    pub fn check_namespace(&self, ns: u32) -> Result<(), PoolError> {
        self.ns(ns).map(|_| ())
    }

    /// Sets the observer told of every commit (once; a second call is refused and returns
    /// false).
    pub fn observe(&self, observer: Arc<dyn CommitObserver>) -> bool {
        self.observer.set(observer).is_ok()
    }

    /// Sets the tier under DRAM (once; a second call is refused and returns false): shown
    /// every evicted object, told of every commit and removal, and asked by lookups.
    pub fn set_lower_tier(&self, tier: Arc<dyn LowerTier>) -> bool {
        self.lower.set(tier).is_ok()
    }

    /// Refuses a key this pool does not take: empty, or longer than its
    /// [`PoolConfig::max_key_len`].
    pub fn check_key(&self, key: &[u8]) -> Result<(), PoolError> {
        if key.len() > self.max_key_len {
            self.counters.long_keys.fetch_add(1, Ordering::Relaxed);
            return Err(PoolError::BadKey);
        }
        if key.is_empty() {
            return Err(PoolError::BadKey);
        }
        Ok(())
    }

    /// Longest key this pool takes ([`PoolConfig::max_key_len`]).
    pub fn max_key_len(&self) -> usize {
        self.max_key_len
    }

    /// Keys refused so far for being longer than [`Pool::max_key_len`].
    pub fn long_keys_refused(&self) -> u64 {
        self.counters.long_keys.load(Ordering::Relaxed)
    }

    /// The generation the next allocation gets: every object allocated before this call has a
    /// lower one, every object allocated after it this one or higher.
    pub fn generation_mark(&self) -> u64 {
        self.next_generation.load(Ordering::SeqCst)
    }

    /// Checks an address's node, segment, key and bounds without touching the object, so a
    /// caller can size a buffer for a one-sided read before making it.
    pub fn verify_addr(&self, addr: &GlobalAddr) -> Result<(), PoolError> {
        self.check_addr(addr).map(|_| ()).map_err(Into::into)
    }

    /// A snapshot of occupancy, fragmentation and counters.
    pub fn stats(&self) -> PoolStats {
        stats::collect(self)
    }

    fn ns(&self, ns: u32) -> Result<&Namespace, PoolError> {
        self.namespaces
            .get(ns as usize)
            .ok_or(PoolError::UnknownNamespace)
    }

    /// Counts a read of namespace `ns` that found nothing, for a caller that judged the miss
    /// itself without reading (a prefix read that found its run's end quietly).
    pub fn count_miss(&self, ns: u32) -> Result<(), PoolError> {
        self.ns(ns)?;
        self.count_read(ns, false);
        Ok(())
    }

    /// Counts a read of namespace `ns` that found its object (`hit`) or not.
    fn count_read(&self, ns: u32, hit: bool) {
        let space = &self.namespaces[ns as usize];
        if hit { &space.hits } else { &space.misses }.fetch_add(1, Ordering::Relaxed);
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        (xxhash_rust::xxh3::xxh3_64(key) as usize) & (self.shards.len() - 1)
    }

    fn shard_lock(&self, key: &[u8]) -> MutexGuard<'_, Shard> {
        lock(&self.shards[self.shard_of(key)])
    }

    fn pending_lock(&self, generation: u64) -> MutexGuard<'_, PendingShard> {
        lock(&self.pending[(generation as usize) & (self.pending.len() - 1)])
    }

    fn alloc_lock(&self, segment: usize) -> MutexGuard<'_, Allocator> {
        lock(&self.segments[segment].alloc)
    }

    /// Tells the observer, if any, that `key` of `ns` left the index (under its shard lock).
    fn observe_removed(&self, ns: u32, key: &[u8]) {
        if let Some(o) = self.observer.get() {
            o.removed(ns, key);
        }
    }

    /// The signed address of this life's object at `offset` of `segment`.
    fn address(&self, segment: u16, offset: u64, len: u64, generation: u64) -> GlobalAddr {
        let place = Place {
            incarnation: self.incarnation,
            segment: segment as u32,
            offset,
            len,
            generation,
        };
        self.mac.address(self.node, place)
    }

    fn check_addr(&self, addr: &GlobalAddr) -> Result<&SegmentSlot, AddrFault> {
        if addr.node != self.node {
            return Err(AddrFault::WrongNode);
        }
        if addr.incarnation != self.incarnation {
            return Err(AddrFault::WrongIncarnation);
        }
        let seg = self
            .segments
            .get(addr.segment as usize)
            .ok_or(AddrFault::NoSegment)?;
        if !self.mac.verify(addr) {
            return Err(AddrFault::WrongKey);
        }
        if !seg.segment.in_bounds(addr.offset, addr.len) {
            return Err(AddrFault::OutOfBounds);
        }
        Ok(seg)
    }

    /// Appends to the journal, if any. Called under the index shard lock of the key concerned,
    /// so the records of one key are in the order of its changes.
    fn journal(&self, f: impl FnOnce(&mut Journal)) {
        if let Some(j) = &self.journal {
            j.with(f);
        }
    }

    /// What the index journal holds and has done; None for anonymous segments, which keep
    /// none.
    pub fn journal_stats(&self) -> Option<crate::journal::JournalStats> {
        self.journal.as_ref().map(SharedJournal::stats)
    }

    /// Waits until no compaction of the journal is under way or due (for tests, which stop a
    /// pool by forgetting it and start the next on the same files).
    #[cfg(test)]
    pub(crate) fn settle_journal(&self) {
        if let Some(j) = &self.journal {
            j.settle();
        }
    }
}

/// Refuses a key that no pool takes (empty, or longer than [`crate::MAX_KEY_LEN`]); a pool
/// may take less ([`Pool::check_key`]).
pub fn check_key(key: &[u8]) -> Result<(), PoolError> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(PoolError::BadKey);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_cancel;
#[cfg(test)]
mod tests_recover;
#[cfg(test)]
mod tests_reservations;
#[cfg(test)]
mod tests_writers;
