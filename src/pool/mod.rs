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

mod index;
mod keys;
mod namespace;
mod pending;
mod recover;
mod scan;
mod stats;

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::addr::{GlobalAddr, MacKey, NodeId, Place};
use crate::alloc::{AllocConfig, Allocator};
use crate::checksum::checksum;
use crate::error::{AddrFault, PoolError, MAX_KEY_LEN};
use crate::journal::{Journal, Record, SharedJournal};
use crate::segment::{Backing, HugePages, Segment, SegmentSpec, LAYOUT_VERSION};
use crate::seqlock;
use crate::sync::lock;
use index::{Entry, Shard, Zombie};
use namespace::Namespace;
pub use namespace::{NamespaceConfig, DEFAULT_NAMESPACE};
use pending::{Pending, PendingShard, RecentCancels};
pub use recover::Recovery;
pub use scan::ScanPage;
pub use stats::{NamespaceStats, PoolStats, SegmentStats};

/// Milliseconds on the caller's monotonic clock.
pub type Millis = u64;

/// How to build a pool. Every default is right for one node on a laptop.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// This node's id. Default 0.
    pub node: NodeId,
    /// Bytes of each segment's data area. Default 1 GiB.
    pub segment_size: u64,
    /// Number of segments. Default 1.
    pub segments: u32,
    /// Where segment memory comes from. Default: files in `/dev/shm/kvpool-<node>`.
    pub backing: Backing,
    /// Huge page policy. Default [`HugePages::Auto`].
    pub huge_pages: HugePages,
    /// Fault every page in at start. Default false.
    pub prefault: bool,
    /// Allocator geometry. Default 64 KiB pages, 512 B granule.
    pub alloc: AllocConfig,
    /// Index shards (rounded up to a power of two). Default 1: one eviction domain, so every
    /// policy behaves exactly as the harness simulates it. With more shards the policy instances
    /// of a namespace share their state and victims are compared across shards, which keeps
    /// every policy within a fifth of a point of one domain on the public trace at 64 shards,
    /// though up to a point below it on Mooncake's synthetic trace when a namespace holds only a
    /// few blocks a shard (docs/BENCHMARKS.md); raise it where index lock contention is measured.
    pub shards: usize,
    /// How long an allocation may stay uncommitted before it is reclaimed. Default 30 s.
    pub pending_timeout_ms: Millis,
    /// Longest lease a reader may take. Default 30 s.
    pub max_lease_ms: Millis,
    /// Longest key, in bytes: 1 to [`MAX_KEY_LEN`] (a larger value, or 0, is taken as
    /// [`MAX_KEY_LEN`]). A longer key is refused with [`PoolError::BadKey`] by every call that
    /// takes one. Default [`MAX_KEY_LEN`].
    pub max_key_len: usize,
    /// Namespaces; `default` is added when missing.
    pub namespaces: Vec<NamespaceConfig>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            node: NodeId(0),
            segment_size: 1 << 30,
            segments: 1,
            backing: Backing::File(default_dir(NodeId(0))),
            huge_pages: HugePages::Auto,
            prefault: false,
            alloc: AllocConfig::default(),
            shards: 1,
            pending_timeout_ms: 30_000,
            max_lease_ms: 30_000,
            max_key_len: MAX_KEY_LEN,
            namespaces: vec![NamespaceConfig::unlimited(DEFAULT_NAMESPACE)],
        }
    }
}

/// The default segment directory of a node: `/dev/shm/kvpool-<node>`.
pub fn default_dir(node: NodeId) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/dev/shm/kvpool-{}", node.0))
}

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

/// A committed object as found by a lookup: where it is and its checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Located {
    /// Its signed address.
    pub addr: GlobalAddr,
    /// xxh3-64 of its bytes.
    pub checksum: u64,
}

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
    /// The index journal, for file-backed segments (see [`crate::journal`]). Locked under an
    /// index shard's lock, never the other way; compacted without either.
    journal: Option<SharedJournal>,
    /// What was recovered of the previous life at start-up.
    recovery: Recovery,
}

/// Told of every object that becomes visible (see [`Pool::observe`]).
pub trait CommitObserver: Send + Sync {
    /// `key` of namespace `ns` was just committed. Called with the key's index shard locked,
    /// so any reader that looks the key up after this call returns finds the object; it must
    /// be quick and must never call into the pool.
    fn committed(&self, ns: u32, key: &[u8]);
}

/// A commit, as [`Pool::commit`] takes it: which pending allocations it makes visible, where
/// the hash their checksums are checked against comes from, and on what condition.
#[must_use = "a commit does nothing until it is passed to Pool::commit"]
pub struct Commit<'a> {
    objects: Objects<'a>,
    /// Commit only when the key's presence is this (None: always).
    present: Option<bool>,
}

/// What a [`Commit`] makes visible.
enum Objects<'a> {
    /// One allocation, sealed by its address; `hashed`: its writer's hash of its bytes, or
    /// None to hash them at commit.
    One {
        addr: GlobalAddr,
        checksum: u64,
        hashed: Option<u64>,
    },
    /// The allocation a write claim holds whole, with its writer's hash.
    Claimed {
        write: PendingWrite<'a>,
        checksum: u64,
        hashed: u64,
    },
    /// Several allocations, all or none, each hashed at commit.
    All(&'a [(GlobalAddr, u64)]),
}

impl<'a> Commit<'a> {
    /// Commits the pending allocation `addr` once its bytes, hashed at commit, match
    /// `checksum` (xxh3-64).
    pub fn new(addr: &GlobalAddr, checksum: u64) -> Self {
        Self::of(Objects::One {
            addr: *addr,
            checksum,
            hashed: None,
        })
    }

    /// [`Commit::new`] for a writer of this process that hashed the bytes as it wrote them
    /// into the allocation (the daemon receiving a put from a socket checks each piece while
    /// it is still in cache): `hashed` is that xxh3, compared with `checksum` instead of
    /// hashing the object again. Only for an allocation whose address was never handed out,
    /// written whole under one write claim by the caller, so the bytes hashed are the bytes
    /// committed.
    pub fn prehashed(addr: &GlobalAddr, checksum: u64, hashed: u64) -> Self {
        Self::of(Objects::One {
            addr: *addr,
            checksum,
            hashed: Some(hashed),
        })
    }

    /// Commits the allocation `write` holds whole, which its caller filled and hashed
    /// (`hashed`, the xxh3 of the bytes it wrote) under that claim: the claim turns into the
    /// commit's seal under one lock of the pending table, so no other write can land between
    /// the bytes hashed and the bytes committed, although the address was handed out. A claim
    /// on part of the allocation is refused (`NotWritable`) and released.
    pub fn claimed(write: PendingWrite<'a>, checksum: u64, hashed: u64) -> Self {
        Self::of(Objects::Claimed {
            write,
            checksum,
            hashed,
        })
    }

    /// Commits several pending allocations at once (Redis's `MSET`): all or none. `items`:
    /// (address, checksum); a key given twice keeps its last value. The objects are inserted
    /// with the index shards of all their keys locked, so a reader of any key sees either none
    /// of the batch or, from then on, all of it.
    pub fn all(items: &'a [(GlobalAddr, u64)]) -> Self {
        Self::of(Objects::All(items))
    }

    /// Commits only when the key's presence is `present` (`Some(false)`: only if absent,
    /// Redis's `SET NX`; `Some(true)`: only if present, `SET XX`; `None`, the default:
    /// always); for [`Commit::all`], only when every key's is. The condition is checked and
    /// the objects inserted under one lock of their keys' index shards, so no other commit of
    /// those keys comes between.
    pub fn when_present(self, present: Option<bool>) -> Self {
        Commit { present, ..self }
    }

    fn of(objects: Objects<'a>) -> Self {
        Commit {
            objects,
            present: None,
        }
    }
}

struct SegmentSlot {
    segment: Segment,
    alloc: Mutex<Allocator>,
}

/// Shards whose next victims an eviction compares.
const EVICTION_SAMPLES: usize = 8;

/// Samples an eviction takes before it takes a victim from any shard (see `Pool::evict_one`).
const EVICTION_ROUNDS: usize = 16;

/// Bounds the work of one allocation under memory pressure.
const MAX_EVICTIONS_PER_ALLOC: usize = 4096;

/// The pool's segments: their data sizes and owners, and each namespace's segments.
struct SegmentPlan {
    /// Per segment id: (data bytes asked for, the namespace whose own it is).
    segments: Vec<(u64, Option<u32>)>,
    /// Per namespace id.
    ns_segments: Vec<std::ops::Range<usize>>,
}

/// Lays out the pool's memory (`segments` × `segment_size`): a segment of its own for each
/// namespace that asks for one, of its reservation rounded up to whole pages, first, and what
/// is left split evenly among the common segments (ids `0..segments`, then the namespaces' own
/// in namespace order). Without such namespaces, exactly the configured segments.
fn plan_segments(cfg: &PoolConfig, ns: &[NamespaceConfig]) -> Result<SegmentPlan, String> {
    let page = cfg.alloc.page_size.max(1);
    let total = cfg
        .segment_size
        .checked_mul(u64::from(cfg.segments))
        .ok_or("the pool's memory overflows")?;
    // (data bytes, namespace) of each own segment, in namespace order.
    let mut own = Vec::new();
    for (id, n) in ns.iter().enumerate().filter(|(_, n)| n.own_segment) {
        let quota = n.quota_bytes.ok_or_else(|| {
            format!(
                "namespace {:?} asks for a segment of its own but has no quota to size it",
                n.name
            )
        })?;
        own.push((
            quota.div_ceil(page).saturating_mul(page).max(page),
            id as u32,
        ));
    }
    let taken = own
        .iter()
        .try_fold(0u64, |a, &(b, _)| a.checked_add(b))
        .unwrap_or(u64::MAX);
    let common = total.saturating_sub(taken) / u64::from(cfg.segments);
    if common < page {
        return Err(format!(
            "the namespaces' own segments ({taken} bytes) leave nothing of the pool's \
             {total} bytes for the common segments: lower their quotas or add memory"
        ));
    }
    let commons = cfg.segments as usize;
    let segments: Vec<(u64, Option<u32>)> = (0..commons)
        .map(|_| (common, None))
        .chain(own.iter().map(|&(size, n)| (size, Some(n))))
        .collect();
    let ns_segments = (0..ns.len())
        .map(|i| match own.iter().position(|&(_, n)| n as usize == i) {
            Some(k) => commons + k..commons + k + 1,
            None => 0..commons,
        })
        .collect();
    if segments.len() > u16::MAX as usize {
        return Err(format!("{} segments are more than 65535", segments.len()));
    }
    Ok(SegmentPlan {
        segments,
        ns_segments,
    })
}

impl Pool {
    /// Creates the segments and the index. With file-backed segments, the objects a previous
    /// life of this node left in the directory are recovered first (see [`Pool::recovery`]),
    /// and from then on every change of the index is journaled so the next life can recover
    /// this one's. `secret` keys the memory keys of every address
    /// this pool hands out; the daemon draws it from the OS at start-up. The pool's incarnation
    /// (see [`crate::addr`]) is derived from it, so it is as random and as fresh as the secret.
    pub fn new(cfg: &PoolConfig, secret: [u8; 16]) -> io::Result<Pool> {
        let mac = MacKey::new(secret);
        let incarnation = mac.incarnation();
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if cfg.segments == 0 || cfg.segments > u16::MAX as u32 {
            return Err(invalid(format!(
                "segments must be 1..=65535, not {}",
                cfg.segments
            )));
        }
        // The previous life's journal and segments, mapped before the new files replace them.
        let previous = match &cfg.backing {
            Backing::File(dir) => Some(recover::Previous::open(dir, cfg.node)),
            Backing::Anonymous => None,
        };
        let mut ns_cfg = cfg.namespaces.clone();
        if !ns_cfg.iter().any(|n| n.name == DEFAULT_NAMESPACE) {
            ns_cfg.insert(0, NamespaceConfig::unlimited(DEFAULT_NAMESPACE));
        }
        for (i, n) in ns_cfg.iter().enumerate() {
            if n.name.is_empty() || ns_cfg[..i].iter().any(|m| m.name == n.name) {
                return Err(invalid(format!(
                    "namespace name {:?} is empty or repeated",
                    n.name
                )));
            }
        }
        let layout = plan_segments(cfg, &ns_cfg).map_err(invalid)?;
        let mut segments = Vec::new();
        for (id, &(size, _)) in layout.segments.iter().enumerate() {
            let alloc = Allocator::new(size, cfg.alloc)
                .map_err(|e| invalid(format!("segment size {size}: {e}")))?;
            let spec = SegmentSpec {
                node: cfg.node,
                id: id as u32,
                data_len: alloc.capacity(),
                granule: alloc.granule(),
                backing: cfg.backing.clone(),
                huge_pages: cfg.huge_pages,
                prefault: cfg.prefault,
                incarnation,
            };
            let mut segment = Segment::create(&spec)?;
            segment.keep_file_on_drop();
            segments.push(SegmentSlot {
                segment,
                alloc: Mutex::new(alloc),
            });
        }
        // Reservations are promises of memory: together they must fit in the pool. A segment
        // of a namespace's own is its reservation; the others' come out of the common segments.
        let capacity: u64 = segments.iter().map(|s| lock(&s.alloc).capacity()).sum();
        let shared_capacity: u64 = segments
            .iter()
            .zip(&layout.segments)
            .filter(|(_, (_, owner))| owner.is_none())
            .map(|(s, _)| lock(&s.alloc).capacity())
            .sum();
        let reserved = ns_cfg
            .iter()
            .filter(|n| !n.own_segment)
            .filter_map(|n| n.quota_bytes)
            .try_fold(0u64, u64::checked_add)
            .filter(|&r| r <= shared_capacity)
            .ok_or_else(|| {
                invalid(format!(
                    "namespace quotas reserve more than the pool's {capacity} bytes \
                     ({}): lower them or add memory",
                    ns_cfg
                        .iter()
                        .filter_map(|n| Some(format!("{} {}", n.name, n.quota_bytes?)))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        let unreserved = shared_capacity - reserved;
        let namespaces: Vec<Namespace> = ns_cfg
            .iter()
            .map(|n| Namespace::new(n, unreserved))
            .collect();
        let nshards = cfg.shards.clamp(1, 1 << 16).next_power_of_two();
        // Per namespace, one policy instance per shard, built together so they share state.
        let mut policies: Vec<_> = ns_cfg
            .iter()
            .map(|n| n.eviction.build_shards(nshards).into_iter())
            .collect();
        let journal = match &cfg.backing {
            Backing::File(dir) => {
                let names: Vec<String> = ns_cfg.iter().map(|n| n.name.clone()).collect();
                Some(SharedJournal::new(Journal::create(
                    dir,
                    cfg.node,
                    LAYOUT_VERSION,
                    &names,
                )?))
            }
            Backing::Anonymous => None,
        };
        let mut pool = Pool {
            node: cfg.node,
            incarnation,
            mac,
            segments,
            shards: (0..nshards)
                .map(|_| {
                    let ns = policies
                        .iter_mut()
                        .map(|p| p.next().expect("one per shard"));
                    Mutex::new(Shard::new(ns.collect()))
                })
                .collect(),
            pending: (0..nshards)
                .map(|_| Mutex::new(PendingShard::default()))
                .collect(),
            cancelled: Mutex::default(),
            namespaces,
            ns_segments: layout.ns_segments,
            // Generations start at a point drawn with the incarnation (below 2^40, leaving 2^62
            // for this life), so even the version words of a dead daemon's segment file would
            // not recognise this life's generations.
            next_generation: AtomicU64::new((incarnation >> 24) | 1),
            segment_cursor: AtomicUsize::new(0),
            evict_cursor: AtomicUsize::new(0),
            clock: AtomicU64::new(0),
            pending_timeout: cfg.pending_timeout_ms,
            max_key_len: match cfg.max_key_len {
                0 => MAX_KEY_LEN,
                n => n.min(MAX_KEY_LEN),
            },
            max_lease: cfg.max_lease_ms,
            counters: stats::Counters::default(),
            observer: std::sync::OnceLock::new(),
            shared_used: AtomicU64::new(0),
            unreserved,
            journal,
            recovery: Recovery::default(),
        };
        if let Some(prev) = previous {
            pool.journal(Journal::hold);
            pool.recovery = pool.recover(prev);
            pool.journal(Journal::release);
        }
        if let Backing::File(dir) = &cfg.backing {
            // (After recovery, which read them.)
            crate::segment::remove_beyond(dir, cfg.node, pool.segments.len() as u32);
        }
        Ok(pool)
    }

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

    // ----- two-phase put -----

    /// Reserves memory for a `len`-byte value of `key` and returns the address to write it to.
    /// The object stays invisible until [`Pool::commit`]. Evicts (LRU, skipping pinned, leased
    /// and in-use objects) when the namespace's quota or the pool is full.
    pub fn alloc(
        &self,
        ns: u32,
        key: &[u8],
        len: u64,
        pin: bool,
        now: Millis,
    ) -> Result<GlobalAddr, PoolError> {
        self.alloc_in_chain(ns, key, len, pin, 0, now)
    }

    /// [`Pool::alloc`] for block `depth` of a prefix chain (0 for its first block): the
    /// namespace's eviction policy may use the depth (`prefix-aware` evicts deep blocks first).
    pub fn alloc_in_chain(
        &self,
        ns: u32,
        key: &[u8],
        len: u64,
        pin: bool,
        depth: u32,
        now: Millis,
    ) -> Result<GlobalAddr, PoolError> {
        let space = self.ns(ns)?;
        self.check_key(key)?;
        let segments = self.ns_segments[ns as usize].clone();
        let own = segments.start != 0;
        let size = self
            .alloc_lock(segments.start)
            .reserved_size(len)
            .ok_or(PoolError::TooLarge)?;
        let mut evicted = 0;
        let near = self.shard_of(key);
        // Room within the namespace's limit: made by evicting its own objects, or, for a
        // namespace sharing the unreserved memory, those of the others sharing it. Never from a
        // namespace's reservation on behalf of another.
        while !self.reserve(space, size) {
            let shared = !space.reserved;
            if evicted >= MAX_EVICTIONS_PER_ALLOC || !self.evict_for(ns, shared, near, now) {
                return Err(if space.reserved {
                    PoolError::QuotaExceeded
                } else {
                    PoolError::PoolFull
                });
            }
            evicted += 1;
        }
        // Every namespace within its limit fits in the pool, so this fails only when the free
        // memory is too scattered (or held in slabs of other sizes): then the namespace's own
        // objects go first, then (in the common segments) those in unreserved memory.
        let (segment, block) = loop {
            if let Some(found) = self.try_allocate(segments.clone(), len) {
                break found;
            }
            if evicted >= MAX_EVICTIONS_PER_ALLOC || !self.evict_for(ns, !own, near, now) {
                self.unreserve(space, size);
                return Err(PoolError::PoolFull);
            }
            evicted += 1;
        };
        debug_assert_eq!(block.size, size);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let word = self.segments[segment]
            .segment
            .version(block.offset)
            .expect("granule aligned");
        seqlock::begin(word, generation);
        self.pending_lock(generation).by_generation.insert(
            generation,
            Pending {
                ns,
                key: key.into(),
                segment: segment as u16,
                offset: block.offset,
                len,
                size,
                deadline: now.saturating_add(self.pending_timeout),
                pin,
                depth,
                claims: Default::default(),
                committing: false,
                cancelled: false,
            },
        );
        Ok(self.address(segment as u16, block.offset, len, generation))
    }

    /// Opens a whole pending allocation for writing (see [`Pool::begin_write_range`]).
    pub fn begin_write(&self, addr: &GlobalAddr) -> Result<PendingWrite<'_>, PoolError> {
        self.begin_write_range(addr, 0, addr.len)
    }

    /// Opens bytes `[offset, offset + len)` of a pending allocation for writing. While the
    /// returned guard lives the allocation can't be reclaimed, committed or aborted, and no other
    /// write may open a range that overlaps this one: such a write gets [`AddrFault::Busy`], so
    /// two writers never hold the same bytes.
    pub fn begin_write_range(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        len: u64,
    ) -> Result<PendingWrite<'_>, PoolError> {
        let seg = self.check_addr(addr)?;
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= addr.len)
            .ok_or(AddrFault::OutOfBounds)?;
        let mut p = self.pending_lock(addr.generation);
        let Some(entry) = p.by_generation.get_mut(&addr.generation) else {
            drop(p);
            return Err(self.gone(addr));
        };
        if entry.offset != addr.offset || entry.len != addr.len || entry.committing {
            return Err(AddrFault::NotWritable.into());
        }
        if entry.cancelled {
            return Err(PoolError::Cancelled);
        }
        if !entry.claims.try_claim(offset, end) {
            return Err(AddrFault::Busy.into());
        }
        Ok(PendingWrite {
            pool: self,
            segment: &seg.segment,
            addr: *addr,
            start: offset,
            end,
            deadline: entry.deadline,
        })
    }

    /// One-sided write of `bytes` at `offset` inside a pending allocation. Fails with
    /// [`AddrFault::Busy`] while another write holds an overlapping range.
    pub fn write(&self, addr: &GlobalAddr, offset: u64, bytes: &[u8]) -> Result<(), PoolError> {
        let mut w = self.begin_write_range(addr, offset, bytes.len() as u64)?;
        w.bytes_mut().copy_from_slice(bytes);
        Ok(())
    }

    /// Makes pending objects visible, as `c` says (see [`Commit`]): each checked against its
    /// checksum (xxh3-64), and, under a condition on the key's presence, inserted only when it
    /// holds. Returns whether it committed: false only when the condition did not hold, and
    /// then every allocation is released and the index is untouched. On a checksum mismatch
    /// (or any other failure) the allocations are released, the old objects stay, and the
    /// error is returned.
    pub fn commit(&self, c: Commit<'_>) -> Result<bool, PoolError> {
        match c.objects {
            Objects::One {
                addr,
                checksum,
                hashed,
            } => {
                let (near, seg) = self.seal(&addr)?;
                match hashed {
                    None => self.check_sealed(&addr, seg, checksum)?,
                    Some(hashed) => self.check_prehashed(&addr, checksum, hashed)?,
                }
                self.publish_if(near, &addr, checksum, c.present)
            }
            Objects::Claimed {
                write,
                checksum,
                hashed,
            } => {
                let addr = write.addr;
                let near = self.seal_claimed(write)?;
                self.check_prehashed(&addr, checksum, hashed)?;
                self.publish_if(near, &addr, checksum, c.present)
            }
            Objects::All(items) => self.commit_all(items, c.present),
        }
    }

    /// The end of a checked commit of the sealed `addr`: takes it out of the pending table
    /// and publishes it under its key's index-shard lock (shard `near`), only when the key's
    /// presence is `present` (None: always); otherwise releases the allocation.
    fn publish_if(
        &self,
        near: usize,
        addr: &GlobalAddr,
        checksum: u64,
        present: Option<bool>,
    ) -> Result<bool, PoolError> {
        let mut shard = lock(&self.shards[near]);
        let p = self.take_sealed(addr)?;
        if present.is_some_and(|want| shard.ns[p.ns as usize].contains(&p.key) != want) {
            drop(shard);
            self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
            return Ok(false);
        }
        self.publish(&mut shard, p, addr, checksum);
        Ok(true)
    }

    /// [`Commit::all`]: every checksum is checked first; on any failure every allocation is
    /// released and the error returned. The objects are then taken out of their pending tables
    /// with the index shards of all their keys locked (in shard order, so two of these never
    /// deadlock); when `present` is given and any key's presence differs, all are released and
    /// nothing is inserted; otherwise all are inserted before the locks are let go.
    fn commit_all(
        &self,
        items: &[(GlobalAddr, u64)],
        present: Option<bool>,
    ) -> Result<bool, PoolError> {
        let sealed = self.seal_all(items)?;
        let mut order: Vec<usize> = sealed.iter().map(|(shard, ..)| *shard).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&i| lock(&self.shards[i])).collect();
        // All taken out first: one cancelled (`take_sealed` freed it) releases the others.
        let mut taken = Vec::with_capacity(sealed.len());
        let mut failed = None;
        for (shard, addr, sum) in sealed {
            match self.take_sealed(addr) {
                Ok(p) => taken.push((shard, p, addr, sum)),
                Err(e) => failed = Some(e),
            }
        }
        let guard_of = |shard: usize| {
            order
                .binary_search(&shard)
                .expect("every key's shard is locked")
        };
        let refused = present.is_some_and(|want| {
            taken.iter().any(|(shard, p, ..)| {
                guards[guard_of(*shard)].ns[p.ns as usize].contains(&p.key) != want
            })
        });
        if failed.is_some() || refused {
            for (_, p, addr, _) in taken {
                self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
            }
            return failed.map_or(Ok(false), Err);
        }
        for (shard, p, addr, sum) in taken {
            let g = guard_of(shard);
            self.publish(&mut guards[g], p, addr, sum);
        }
        Ok(true)
    }

    /// Seals and checks every one of `items` (address, checksum) for `commit_all`:
    /// (the shard of its key, its address, its checksum). On the first failure the ones
    /// sealed are released, the ones not reached aborted, and the error returned.
    fn seal_all<'i>(
        &self,
        items: &'i [(GlobalAddr, u64)],
    ) -> Result<Vec<(usize, &'i GlobalAddr, u64)>, PoolError> {
        let mut sealed = Vec::with_capacity(items.len());
        for (i, (addr, sum)) in items.iter().enumerate() {
            let checked = self
                .seal(addr)
                .and_then(|(near, seg)| self.check_sealed(addr, seg, *sum).map(|()| near));
            match checked {
                Ok(near) => sealed.push((near, addr, *sum)),
                Err(e) => {
                    for (_, addr, _) in sealed {
                        self.drop_sealed(addr);
                    }
                    // The ones not reached are still pending: give them back too.
                    for (addr, _) in &items[i + 1..] {
                        let _ = self.abort(addr);
                    }
                    return Err(e);
                }
            }
        }
        Ok(sealed)
    }

    /// Turns the claim of `w`, which must cover its whole allocation, into the commit's seal
    /// under one lock of the pending table, so no other write can land between the bytes its
    /// writer hashed and the bytes committed. A claim on part of the allocation is refused
    /// (`NotWritable`) and released. Returns the index shard of the key.
    fn seal_claimed(&self, w: PendingWrite<'_>) -> Result<usize, PoolError> {
        let addr = w.addr;
        let whole = w.start == 0 && w.end == addr.len;
        let mut pending = self.pending_lock(addr.generation);
        let Some(p) = pending.by_generation.get_mut(&addr.generation) else {
            drop(pending);
            std::mem::forget(w); // its claim went with the entry
            return Err(self.gone(&addr));
        };
        p.claims.release(w.start, w.end);
        std::mem::forget(w); // released above, under this lock
        if !whole {
            return Err(AddrFault::NotWritable.into());
        }
        self.seal_locked(pending, &addr)
    }

    /// Checks the hash a writer took of a sealed allocation's bytes as it wrote them against
    /// `checksum_given`; on a mismatch the allocation is released.
    fn check_prehashed(
        &self,
        addr: &GlobalAddr,
        checksum_given: u64,
        hashed: u64,
    ) -> Result<(), PoolError> {
        if hashed != checksum_given {
            self.drop_sealed(addr);
            return Err(PoolError::ChecksumMismatch);
        }
        Ok(())
    }

    /// Seals a pending allocation for its commit: no write may open in it from now on, and
    /// abort and the reaper leave it alone; it stays in its pending table, where a
    /// [`Pool::cancel`] of its key still finds it, until [`Pool::take_sealed`] takes it out
    /// under its key's index-shard lock. Returns that shard and the segment. Refused while a
    /// write is open (`Busy`), once cancelled, and for an address that is not pending.
    fn seal(&self, addr: &GlobalAddr) -> Result<(usize, &SegmentSlot), PoolError> {
        let seg = self.check_addr(addr)?;
        let pending = self.pending_lock(addr.generation);
        match pending.by_generation.get(&addr.generation) {
            Some(p) if p.offset == addr.offset && p.len == addr.len && !p.committing => {}
            Some(p) if p.offset == addr.offset && p.len == addr.len => {
                return Err(AddrFault::Busy.into())
            }
            Some(_) => return Err(AddrFault::NotWritable.into()),
            None => {
                drop(pending);
                return Err(self.gone(addr));
            }
        }
        let near = self.seal_locked(pending, addr)?;
        Ok((near, seg))
    }

    /// Seals the pending allocation of `addr`, present in the locked table `pending`: refused
    /// while a write claim or another commit holds it; one a cancel doomed is released (unless
    /// a write still holds it) and refused. Returns the index shard of its key.
    fn seal_locked(
        &self,
        mut pending: MutexGuard<'_, PendingShard>,
        addr: &GlobalAddr,
    ) -> Result<usize, PoolError> {
        let p = pending
            .by_generation
            .get_mut(&addr.generation)
            .expect("the caller found it in this locked table");
        if p.cancelled {
            // Doomed by a cancel while a write held it: released now, unless one still does.
            if p.claims.is_empty() {
                let p = pending.by_generation.remove(&addr.generation);
                drop(pending);
                if let Some(p) = p {
                    self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
                }
            }
            return Err(PoolError::Cancelled);
        }
        if !p.claims.is_empty() || p.committing {
            return Err(AddrFault::Busy.into());
        }
        p.committing = true;
        Ok(self.shard_of(&p.key))
    }

    /// Why an address has no pending allocation: [`PoolError::Cancelled`] when a cancel took
    /// it lately, else not writable (committed, aborted or reclaimed).
    fn gone(&self, addr: &GlobalAddr) -> PoolError {
        if lock(&self.cancelled).contains(addr.generation) {
            PoolError::Cancelled
        } else {
            AddrFault::NotWritable.into()
        }
    }

    /// Checks that a sealed allocation's bytes hash to `checksum_given`; on a mismatch it is
    /// released.
    fn check_sealed(
        &self,
        addr: &GlobalAddr,
        seg: &SegmentSlot,
        checksum_given: u64,
    ) -> Result<(), PoolError> {
        // SAFETY: in bounds: check_addr in seal put the address inside the segment and the
        // pending entry matched it. No slice of this process writes it: seal found no write
        // claim and marked it committing under its pending table's lock, and begin_write_range
        // refuses a committing allocation; abort, the reaper and cancel leave a committing
        // allocation's memory alone, and it is not in the index, so nothing else frees it
        // before take_sealed or drop_sealed. (A same-host client may still store into its own
        // mapping of these pages; that can only change the checksum, which is why commit
        // checks it.)
        let bytes = unsafe { seg.segment.data(addr.offset, addr.len) };
        if checksum(bytes) != checksum_given {
            self.drop_sealed(addr);
            return Err(PoolError::ChecksumMismatch);
        }
        Ok(())
    }

    /// Releases a sealed allocation that will not be committed.
    fn drop_sealed(&self, addr: &GlobalAddr) {
        let p = self
            .pending_lock(addr.generation)
            .by_generation
            .remove(&addr.generation);
        if let Some(p) = p {
            self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
        }
    }

    /// Takes a sealed allocation out of its pending table for its commit; the caller holds
    /// its key's index-shard lock, so a [`Pool::cancel`] of the key either came before (and
    /// marked it: then it is released here and the commit fails with
    /// [`PoolError::Cancelled`]) or comes after the commit and removes the object.
    fn take_sealed(&self, addr: &GlobalAddr) -> Result<Pending, PoolError> {
        let p = self
            .pending_lock(addr.generation)
            .by_generation
            .remove(&addr.generation);
        // Only its commit takes a sealed allocation out.
        let p = p.ok_or(AddrFault::NotWritable)?;
        if p.cancelled {
            self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
            return Err(PoolError::Cancelled);
        }
        Ok(p)
    }

    /// Makes a taken pending object visible: its version word published, then its entry in
    /// the index (under `shard`, the lock of its key's shard), retiring the object it replaces.
    fn publish(&self, shard: &mut Shard, p: Pending, addr: &GlobalAddr, checksum_given: u64) {
        let seg = &self.segments[p.segment as usize];
        let word = seg.segment.version(p.offset).expect("granule aligned");
        seqlock::publish(word, addr.generation);
        let entry = Entry {
            offset: p.offset,
            len: p.len,
            generation: addr.generation,
            checksum: checksum_given,
            lease_until: 0,
            segment: p.segment,
            readers: 0,
            pinned: p.pin,
        };
        let space = &self.namespaces[p.ns as usize];
        if p.pin {
            space.pinned.fetch_add(p.size, Ordering::Relaxed);
        }
        self.journal(|j| {
            j.commit(&Record {
                ns: p.ns,
                segment: p.segment,
                offset: p.offset,
                len: p.len,
                checksum: checksum_given,
                generation: addr.generation,
                pinned: p.pin,
                depth: p.depth,
                key: &p.key,
            })
        });
        if let Some(o) = self.observer.get() {
            // Still under the shard's lock: a reader told of the commit finds the object.
            o.committed(p.ns, &p.key);
        }
        match shard.ns[p.ns as usize].insert(&p.key, entry, p.depth, self.tick()) {
            Some(old) => self.retire_entry(shard, p.ns, old),
            None => {
                space.objects.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.counters.commits.fetch_add(1, Ordering::Relaxed);
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

    /// Is the allocation of `generation` still pending (neither committed, aborted, cancelled
    /// and freed, nor reaped)? A server counts a connection's allocations with it.
    pub fn is_pending(&self, generation: u64) -> bool {
        self.pending_lock(generation)
            .by_generation
            .contains_key(&generation)
    }

    /// Gives a pending allocation back without committing it.
    pub fn abort(&self, addr: &GlobalAddr) -> Result<(), PoolError> {
        self.check_addr(addr)?;
        let p = {
            let mut pending = self.pending_lock(addr.generation);
            match pending.by_generation.get(&addr.generation) {
                Some(p) if p.offset == addr.offset && p.claims.is_empty() && !p.committing => {}
                Some(_) => return Err(AddrFault::Busy.into()),
                None => return Err(AddrFault::NotWritable.into()),
            }
            pending
                .by_generation
                .remove(&addr.generation)
                .expect("checked above")
        };
        self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
        Ok(())
    }

    /// Aborts a request's blocks on this node (`Cancel`): for each of `keys` of namespace `ns`,
    /// every pending allocation (a reservation, a put or alloc still being written) and the
    /// committed object, pinned or not. Returns how many of both it freed or doomed.
    ///
    /// An allocation with a write open or a commit under way can't be freed under its writer:
    /// it is marked, so its commit fails with [`PoolError::Cancelled`] and releases it (as do
    /// an abort, or the reaper at its next round); every other one is freed at once. The keys'
    /// index shards stay locked from the look at the pending tables to the removal of the
    /// objects, and a commit takes its allocation out of its table only under its key's shard
    /// lock (`take_sealed`), so no allocation of these keys is committed after this
    /// returns. Pending allocations are kept by generation, not by key: this walks every
    /// pending table once for the whole batch, O(pending allocations + keys), with each table
    /// locked only while it is walked; the put path pays nothing for it.
    pub fn cancel(&self, ns: u32, keys: &[&[u8]]) -> Result<u64, PoolError> {
        let space = self.ns(ns)?;
        for key in keys {
            self.check_key(key)?;
        }
        let mut order: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&i| lock(&self.shards[i])).collect();
        let wanted: std::collections::HashSet<&[u8]> = keys.iter().copied().collect();
        let mut n = 0u64;
        let mut freed = Vec::new();
        // Held across the walk, so a commit that finds its allocation gone finds why.
        let mut recent = lock(&self.cancelled);
        for table in self.pending.iter() {
            let mut table = lock(table);
            table.by_generation.retain(|&generation, p| {
                if p.ns != ns || p.cancelled || !wanted.contains(&*p.key) {
                    return true;
                }
                n += 1;
                recent.note(generation);
                if p.claims.is_empty() && !p.committing {
                    freed.push((generation, p.segment, p.offset, p.pin));
                    return false;
                }
                p.cancelled = true;
                p.deadline = 0;
                true
            });
        }
        drop(recent);
        for (generation, segment, offset, pin) in freed {
            self.free_block(ns, segment, offset, generation, pin);
        }
        for key in wanted {
            let g = order
                .binary_search(&self.shard_of(key))
                .expect("every key's shard is locked");
            let shard = &mut *guards[g];
            if let Some(e) = shard.ns[ns as usize].remove(key) {
                space.objects.fetch_sub(1, Ordering::Relaxed);
                self.retire_entry(shard, ns, e);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Reclaims allocations left uncommitted past their deadline; returns how many.
    pub fn reap(&self, now: Millis) -> usize {
        let mut expired = Vec::new();
        for p in self.pending.iter() {
            lock(p).take_expired(now, &mut expired);
        }
        for (generation, p) in &expired {
            self.free_block(p.ns, p.segment, p.offset, *generation, p.pin);
        }
        self.counters
            .reaped
            .fetch_add(expired.len() as u64, Ordering::Relaxed);
        expired.len()
    }

    /// Stores `value` under `key` in one step (alloc, copy, commit).
    pub fn put(
        &self,
        ns: u32,
        key: &[u8],
        value: &[u8],
        pin: bool,
        now: Millis,
    ) -> Result<GlobalAddr, PoolError> {
        let addr = self.alloc(ns, key, value.len() as u64, pin, now)?;
        self.write(&addr, 0, value)?;
        self.commit(Commit::new(&addr, checksum(value)))?;
        Ok(addr)
    }

    // ----- reads -----

    /// Finds a committed object and holds it for reading: until the returned reference is
    /// dropped the memory can't be evicted or reused, so its bytes can be streamed as they are.
    pub fn get_ref<'a>(
        &'a self,
        ns: u32,
        key: &'a [u8],
        _now: Millis,
    ) -> Result<ObjectRef<'a>, PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let Some(e) = shard.ns[ns as usize].get(key, self.tick()) else {
            self.count_read(ns, false);
            return Err(PoolError::NotFound);
        };
        if e.readers == u16::MAX {
            // So many concurrent readers of one object: let this one miss rather than wrap.
            self.count_read(ns, false);
            return Err(PoolError::NotFound);
        }
        e.readers += 1;
        let e = *e;
        drop(shard);
        self.count_read(ns, true);
        Ok(ObjectRef {
            pool: self,
            ns,
            key,
            entry: e,
        })
    }

    /// Finds a committed object and holds it for a reader outside the daemon (a same-host
    /// process that maps its memory): until [`Pool::unhold`] with the generation of the
    /// returned address, the object is neither evicted nor its memory reused; a removal or an
    /// overwrite takes it out of the index at once but parks its memory (see
    /// [`Pool::get_ref`]). None when absent, or held by `u16::MAX` readers already.
    pub fn hold(&self, ns: u32, key: &[u8]) -> Result<Option<Located>, PoolError> {
        self.locate_with(ns, key, |e| {
            if e.readers == u16::MAX {
                return false;
            }
            e.readers += 1;
            true
        })
    }

    /// Finds a committed object, counting the read, and lets `take` mark its entry (under the
    /// shard's lock); an object `take` refuses counts as a miss.
    fn locate_with(
        &self,
        ns: u32,
        key: &[u8],
        take: impl FnOnce(&mut index::Entry) -> bool,
    ) -> Result<Option<Located>, PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let found = shard.ns[ns as usize]
            .get(key, self.tick())
            .and_then(|e| take(e).then_some(*e));
        drop(shard);
        self.count_read(ns, found.is_some());
        Ok(found.map(|e| Located {
            addr: self.address(e.segment, e.offset, e.len, e.generation),
            checksum: e.checksum,
        }))
    }

    /// Ends one [`Pool::hold`] of generation `generation` of `key`: frees the memory when the
    /// object was removed meanwhile and this was its last reader.
    pub fn unhold(&self, ns: u32, key: &[u8], generation: u64) -> Result<(), PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        self.release_reader(ns, key, generation);
        Ok(())
    }

    /// Copies an object's bytes into `dst` (which must be at least as long); returns its length.
    pub fn get_into(
        &self,
        ns: u32,
        key: &[u8],
        dst: &mut [u8],
        now: Millis,
    ) -> Result<usize, PoolError> {
        let r = self.get_ref(ns, key, now)?;
        let bytes = r.bytes();
        let out = dst.get_mut(..bytes.len()).ok_or(AddrFault::OutOfBounds)?;
        out.copy_from_slice(bytes);
        Ok(bytes.len())
    }

    /// The object's bytes, copied.
    pub fn get(&self, ns: u32, key: &[u8], now: Millis) -> Result<Vec<u8>, PoolError> {
        Ok(self.get_ref(ns, key, now)?.bytes().to_vec())
    }

    /// Length of the leading run of `keys` that are present (what prefix lookups need),
    /// counted in the namespace's prefix statistics. Does not change recency.
    pub fn exists_prefix<'k>(
        &self,
        ns: u32,
        keys: impl IntoIterator<Item = &'k [u8]>,
    ) -> Result<usize, PoolError> {
        let space = self.ns(ns)?;
        let mut keys = keys.into_iter();
        let mut asked = 0;
        let n = self.present_prefix(ns, keys.by_ref().inspect(|_| asked += 1))?;
        asked += keys.count();
        space
            .prefix_blocks
            .fetch_add(asked as u64, Ordering::Relaxed);
        space.prefix_hits.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// [`Pool::exists_prefix`] without counting anything: the length of the leading run of
    /// `keys` that are present. Takes keys up to the first absent one. Does not change recency.
    pub fn present_prefix<'k>(
        &self,
        ns: u32,
        keys: impl IntoIterator<Item = &'k [u8]>,
    ) -> Result<usize, PoolError> {
        self.ns(ns)?;
        let mut n = 0;
        for key in keys {
            self.check_key(key)?;
            if !self.shard_lock(key).ns[ns as usize].contains(key) {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Finds an object for one-sided reads and leases it for `lease_ms` (capped by the pool's
    /// maximum; 0 takes no lease): eviction won't recycle it before the lease ends.
    pub fn lookup(
        &self,
        ns: u32,
        key: &[u8],
        lease_ms: Millis,
        now: Millis,
    ) -> Result<Option<Located>, PoolError> {
        let max_lease = self.max_lease;
        self.locate_with(ns, key, |e| {
            if lease_ms > 0 {
                e.lease_until = e
                    .lease_until
                    .max(now.saturating_add(lease_ms.min(max_lease)));
            }
            true
        })
    }

    /// Ends the lease on an object (leases are per object, not per holder). Returns whether the
    /// object exists.
    pub fn release(&self, ns: u32, key: &[u8]) -> Result<bool, PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        Ok(shard.ns[ns as usize]
            .peek_mut(key)
            .map(|e| e.lease_until = 0)
            .is_some())
    }

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

    /// Removes an object. Returns whether it existed. Readers still streaming it finish first.
    pub fn remove(&self, ns: u32, key: &[u8]) -> Result<bool, PoolError> {
        let space = self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let Some(e) = shard.ns[ns as usize].remove(key) else {
            return Ok(false);
        };
        space.objects.fetch_sub(1, Ordering::Relaxed);
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
    /// of the key is left alone). Returns whether it removed it.
    pub fn remove_generation(
        &self,
        ns: u32,
        key: &[u8],
        generation: u64,
    ) -> Result<bool, PoolError> {
        let space = self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        if shard.ns[ns as usize].peek(key).map(|e| e.generation) != Some(generation) {
            return Ok(false);
        }
        let Some(e) = shard.ns[ns as usize].remove(key) else {
            return Ok(false);
        };
        space.objects.fetch_sub(1, Ordering::Relaxed);
        self.retire_entry(&mut shard, ns, e);
        Ok(true)
    }

    /// The generation the next allocation gets: every object allocated before this call has a
    /// lower one, every object allocated after it this one or higher.
    pub fn generation_mark(&self) -> u64 {
        self.next_generation.load(Ordering::SeqCst)
    }

    /// One-sided read: copies `dst.len()` bytes at `offset` of the object at `addr` into `dst`.
    /// Never touches the index: checks node, segment, memory key and bounds, then copies under
    /// the object's version word, so a read that raced with eviction and reuse is reported as
    /// [`AddrFault::Stale`] instead of returning foreign bytes.
    pub fn read(&self, addr: &GlobalAddr, offset: u64, dst: &mut [u8]) -> Result<(), PoolError> {
        let seg = self.check_addr(addr)?;
        let at = addr
            .sub_range(offset, dst.len() as u64)
            .ok_or(AddrFault::OutOfBounds)?;
        let word = seg
            .segment
            .version(addr.offset)
            .ok_or(AddrFault::OutOfBounds)?;
        if !seqlock::read_begin(word, addr.generation) {
            return Err(AddrFault::Stale.into());
        }
        seg.segment.copy_out_racy(at, dst);
        if !seqlock::read_validate(word, addr.generation) {
            return Err(AddrFault::Stale.into());
        }
        Ok(())
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

    // ----- internals -----

    fn ns(&self, ns: u32) -> Result<&Namespace, PoolError> {
        self.namespaces
            .get(ns as usize)
            .ok_or(PoolError::UnknownNamespace)
    }

    /// The memory namespace `ns` may use: its quota, or, for one without a quota, the memory
    /// no namespace reserved, which it shares with the others without one.
    pub fn namespace_capacity(&self, ns: u32) -> Result<u64, PoolError> {
        Ok(self.ns(ns)?.quota)
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

    /// Allocates `len` bytes in one of `segments`, trying them round robin.
    fn try_allocate(
        &self,
        segments: std::ops::Range<usize>,
        len: u64,
    ) -> Option<(usize, crate::alloc::Block)> {
        let n = segments.len().max(1);
        let start = self.segment_cursor.fetch_add(1, Ordering::Relaxed) % n;
        let found = (0..n)
            .map(|i| segments.start + (start + i) % n)
            .find_map(|s| self.alloc_lock(s).allocate(len).map(|b| (s, b)));
        if let Some((s, b)) = &found {
            // Before anyone writes the block, outside the allocator's lock.
            self.segments[*s]
                .segment
                .back_with_huge_pages(b.offset, b.size);
        }
        found
    }

    /// Evicts one object: from namespace `only` if given, else from any. False when nothing is
    /// evictable.
    ///
    /// Each shard's policy orders only its own objects, so which shard gives up a victim decides
    /// how close the pool comes to its policy applied to all objects at once. Every candidate
    /// carries the logical time the policy ranks it by (its last access for LRU, its entry into
    /// its FIFO for S3-FIFO); eviction looks at the next victim of [`EVICTION_SAMPLES`] shards
    /// (starting with `near`, the shard the new object goes to) and evicts from the shard whose
    /// candidate is oldest, as Redis samples for its LRU. That shard's policy may spare its
    /// candidate (S3-FIFO promotes touched objects); it stops once its next one is younger than
    /// the runner-up's, and the pool samples again, up to [`EVICTION_ROUNDS`] times, so that the
    /// shards together take their steps in one order. Then any shard will do.
    fn evict_one(&self, only: Option<u32>, near: usize, now: Millis) -> bool {
        let mask = self.shards.len() - 1;
        let nns = self.namespaces.len();
        let start = self.evict_cursor.fetch_add(1, Ordering::Relaxed);
        let tries = if only.is_some() { 1 } else { nns };
        for j in 0..tries {
            let ns = only.map_or((start + j) % nns, |n| n as usize);
            let mut first = None;
            for round in 0..EVICTION_ROUNDS {
                // The best candidate of the sample and the runner-up's stamp.
                let mut best: Option<(u64, usize)> = None;
                let mut bound = u64::MAX;
                let base = start.wrapping_mul(7) + near + round * EVICTION_SAMPLES;
                for k in 0..EVICTION_SAMPLES.min(mask + 1) {
                    let s = if k == 0 && round == 0 {
                        near
                    } else {
                        (base + k) & mask
                    };
                    let Some(stamp) = lock(&self.shards[s]).ns[ns].next_victim_stamp() else {
                        continue;
                    };
                    match best {
                        Some((_, bs)) if bs == s => {}
                        Some((b, _)) if b <= stamp => bound = bound.min(stamp),
                        _ => {
                            bound = best.map_or(bound, |(b, _)| bound.min(b));
                            best = Some((stamp, s));
                        }
                    }
                }
                let Some((_, s)) = best else { break };
                first.get_or_insert(s);
                let mut shard = lock(&self.shards[s]);
                if let Some(e) = shard.ns[ns].victim_below(now, self.tick(), bound) {
                    self.retire_victim(&mut shard, ns, e);
                    return true;
                }
            }
            // Then every shard, in case the sampled ones hold nothing evictable.
            let order = first
                .into_iter()
                .chain((0..=mask).map(|i| (start + i) & mask));
            for s in order {
                let mut shard = lock(&self.shards[s]);
                if let Some(e) = shard.ns[ns].victim(now, self.tick()) {
                    self.retire_victim(&mut shard, ns, e);
                    return true;
                }
            }
        }
        false
    }

    /// Takes `size` bytes of `space`'s limit; false when that would exceed it.
    fn reserve(&self, space: &Namespace, size: u64) -> bool {
        if space.reserved {
            return space.try_reserve(size);
        }
        let shared = self
            .shared_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                cur.checked_add(size).filter(|&n| n <= self.unreserved)
            });
        if shared.is_err() {
            return false;
        }
        // Its own use never exceeds the shared use, which is within `unreserved`.
        space.used.fetch_add(size, Ordering::AcqRel);
        true
    }

    fn unreserve(&self, space: &Namespace, size: u64) {
        space.unreserve(size);
        if !space.reserved {
            self.shared_used.fetch_sub(size, Ordering::AcqRel);
        }
    }

    /// Evicts one object to make room for namespace `ns`: its own first; then, if `shared`, one
    /// of a namespace without a reservation (which lives in unreserved memory). Namespaces with
    /// a reservation lose objects only to their own allocations. False when nothing is
    /// evictable.
    fn evict_for(&self, ns: u32, shared: bool, near: usize, now: Millis) -> bool {
        if self.evict_one(Some(ns), near, now) {
            return true;
        }
        if !shared {
            return false;
        }
        let n = self.namespaces.len();
        let start = self.evict_cursor.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| (start + i) % n)
            .filter(|&j| j != ns as usize && !self.namespaces[j].reserved)
            .any(|j| self.evict_one(Some(j as u32), near, now))
    }

    fn retire_victim(&self, shard: &mut Shard, ns: usize, e: Entry) {
        self.namespaces[ns].objects.fetch_sub(1, Ordering::Relaxed);
        self.retire_entry(shard, ns as u32, e);
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
    }

    /// Frees an object that just left the index, or parks it until its readers are done.
    fn retire_entry(&self, shard: &mut Shard, ns: u32, e: Entry) {
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

    fn free_block(&self, ns: u32, segment: u16, offset: u64, generation: u64, pinned: bool) {
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

    fn release_reader(&self, ns: u32, key: &[u8], generation: u64) {
        let zombie = self
            .shard_lock(key)
            .release_reader(ns as usize, key, generation);
        if let Some(z) = zombie {
            self.free_block(z.ns, z.segment, z.offset, z.generation, z.pinned);
        }
    }
}

/// A committed object held for reading (see [`Pool::get_ref`]).
pub struct ObjectRef<'a> {
    pool: &'a Pool,
    ns: u32,
    key: &'a [u8],
    entry: Entry,
}

impl ObjectRef<'_> {
    /// The object's bytes, straight from segment memory.
    pub fn bytes(&self) -> &[u8] {
        let seg = &self.pool.segments[self.entry.segment as usize].segment;
        // SAFETY: the range was bounds-checked when allocated; this reference's reader count
        // keeps the block from being freed (eviction refuses it, removal parks it as a zombie),
        // and nothing in this process writes a committed object: it has no pending entry, so
        // `begin_write_range` refuses it.
        unsafe { seg.data(self.entry.offset, self.entry.len) }
    }

    /// The object's generation (see [`Pool::provenance`]).
    pub fn generation(&self) -> u64 {
        self.entry.generation
    }

    /// True when the object is pinned.
    pub fn pinned(&self) -> bool {
        self.entry.pinned
    }

    /// xxh3-64 of the bytes, as checked at commit.
    pub fn checksum(&self) -> u64 {
        self.entry.checksum
    }

    /// The object's signed address.
    pub fn addr(&self) -> GlobalAddr {
        let e = &self.entry;
        self.pool.address(e.segment, e.offset, e.len, e.generation)
    }
}

impl Drop for ObjectRef<'_> {
    fn drop(&mut self) {
        self.pool
            .release_reader(self.ns, self.key, self.entry.generation);
    }
}

/// An open write of a range of a pending allocation (see [`Pool::begin_write_range`]).
pub struct PendingWrite<'a> {
    pool: &'a Pool,
    segment: &'a Segment,
    addr: GlobalAddr,
    /// The claimed range, in bytes from the allocation's start.
    start: u64,
    end: u64,
    deadline: Millis,
}

impl PendingWrite<'_> {
    /// The claimed bytes, for filling in place (for instance straight from a socket).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: in bounds: check_addr put the allocation inside the segment and
        // begin_write_range put [start, end) inside the allocation. Exclusive: this guard holds
        // the claim on [start, end) in the allocation's pending entry, granted under the pending
        // table's lock only because no other claim overlapped it, and released only when the
        // guard drops; the slice borrows the guard mutably, so it is the only slice of these
        // bytes in this process. The memory stays allocated meanwhile: commit, abort and reap
        // refuse an allocation with a claim, and it is not in the index, so nothing reads it
        // as an object (one-sided reads see the busy version word and copy through raw pointers
        // only to discard what they copied).
        unsafe {
            self.segment
                .data_mut(self.addr.offset + self.start, self.end - self.start)
        }
    }

    /// When the allocation is reclaimed if not committed, on the pool's clock: a write still
    /// open then should give up (drop this guard) so the reaper can take it.
    pub fn deadline(&self) -> Millis {
        self.deadline
    }
}

impl Drop for PendingWrite<'_> {
    fn drop(&mut self) {
        if let Some(p) = self
            .pool
            .pending_lock(self.addr.generation)
            .by_generation
            .get_mut(&self.addr.generation)
        {
            p.claims.release(self.start, self.end);
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
