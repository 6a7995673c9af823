//! The disk tier under DRAM (`[disk]`, docs/OPERATIONS.md): the node's
//! [`DiskStore`](kvpool::disk::DiskStore), opened at start when `disk.path` is set, its index
//! rebuilt from the region files (docs/ARCHITECTURE.md, "Disk tier"), and what moves objects
//! between it and DRAM.
//!
//! **Demotion.** The tier is the pool's [`LowerTier`]: the pool shows it each evicted object
//! under the object's index shard lock. An object the admission filter (`disk.admit`) and its
//! namespace's shares of the disk and the queue take is reserved a place in a queue bounded in
//! bytes (`disk.queue`) there and then; once the object has left the index, the pool hands its
//! bytes over with no lock held, they are copied into the queue, and the block is freed. One
//! writer thread (`writer.rs`) drains the queue into the store, with the checksum the pool
//! verified at commit. The bytes are copied rather
//! than the block held until written: the eviction is making room for an allocation that
//! needs the block now, and a held block would also be memory outside every quota. A full
//! queue drops the write and counts it, so an eviction (and the put or get behind it) never
//! waits for the disk: its cost is one copy of the value, only for admitted objects while the
//! queue has room. An object whose value is already on disk (it was promoted and not changed
//! since) is not written again.
//!
//! **One value per key.** The pool tells the tier of every commit and removal of a key, under
//! the key's shard lock: a disk copy or a queued demotion of another value is forgotten at
//! once (so no read finds it from then on) and a tombstone is queued ahead of every demotion,
//! so that the copy stays gone after a restart. A copy of the value just committed is kept:
//! DRAM and disk then hold the same bytes, and the next eviction costs no write.
//!
//! **Promotion** (`promote.rs`): a read that misses DRAM and finds the key on disk reads the
//! copy straight into a fresh DRAM allocation, verifies it, and commits it there, only while
//! the key is still absent from DRAM and the copy still the disk's; the read is then served
//! from DRAM as any other.

mod promote;
mod writer;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_faults;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvpool::disk::{DiskStore, IoEngine, RegionIo};
use kvpool::protocol::{DiskTierStats, KvEventKind, KvTier};
use kvpool::{Claim, LowerTier, Pool, Victim};

use crate::config::{DiskAdmit, DiskSettings};
use writer::{Demotion, Job, Queue};

/// The node's disk tier: its store, what it admits, and the queue of objects on their way.
pub(crate) struct DiskTier {
    /// The store of region files.
    pub(crate) store: DiskStore<Box<dyn RegionIo>>,
    /// Which evicted objects are worth a disk write.
    admit: DiskAdmit,
    /// Most bytes of values waiting in `queue`.
    bound: u64,
    /// Per namespace id, the most disk bytes its objects may take and the most bytes of its
    /// demotions the queue may hold (None: the whole tier and the whole queue).
    shares: OnceLock<Vec<Option<Share>>>,
    /// Bytes of values waiting in `queue` or being written, reserved before they are copied.
    queued_bytes: AtomicU64,
    queue: Mutex<Queue>,
    /// Signalled when the queue gains a job or closes.
    ready: Condvar,
    counters: Counters,
    /// Told of every copy indexed and forgotten (KV events), once set.
    events: OnceLock<Arc<crate::events::EventHub>>,
}

/// A namespace's share of the tier: its quota's share of DRAM.
#[derive(Clone, Copy, Debug)]
struct Share {
    disk: u64,
    queue: u64,
}

#[derive(Default)]
struct Counters {
    demoted: AtomicU64,
    demoted_bytes: AtomicU64,
    already_on_disk: AtomicU64,
    not_admitted: AtomicU64,
    share_refused: AtomicU64,
    queue_drops: AtomicU64,
    write_failures: AtomicU64,
    withdrawn: AtomicU64,
    forgotten: AtomicU64,
    promoted: AtomicU64,
    promoted_bytes: AtomicU64,
    promotion_failures: AtomicU64,
}

impl DiskTier {
    /// Opens the store `settings` describe (creating its directory if missing), reading every
    /// record's header back to rebuild its index, logs what it found, and starts the writer
    /// thread that drains the demotion queue. The caller makes it the pool's lower tier.
    pub(crate) fn open(settings: &DiskSettings) -> anyhow::Result<Arc<DiskTier>> {
        let dir = &settings.store.dir;
        // Checked before the files are opened: opening deletes region files past the count.
        let regions = settings
            .store
            .checked_regions()
            .with_context(|| format!("opening the disk tier in {}", dir.display()))?;
        let io = match settings.io.open(dir, regions) {
            Err(e) if e.kind() == std::io::ErrorKind::Unsupported => {
                tracing::warn!(
                    dir = %dir.display(),
                    error = %e,
                    "the disk tier's file system refuses O_DIRECT: reading and writing it \
                     through the page cache instead (disk.io = \"buffered\")"
                );
                IoEngine::Buffered.open(dir, regions)
            }
            opened => opened,
        };
        let io =
            io.with_context(|| format!("opening the disk tier's files in {}", dir.display()))?;
        DiskTier::open_with(settings, io)
    }

    /// [`DiskTier::open`] over the regions of `io`.
    pub(crate) fn open_with(
        settings: &DiskSettings,
        io: Box<dyn RegionIo>,
    ) -> anyhow::Result<Arc<DiskTier>> {
        let started = Instant::now();
        let dir = &settings.store.dir;
        let store = DiskStore::open_with(&settings.store, io)
            .with_context(|| format!("opening the disk tier in {}", dir.display()))?;
        let s = store.stats();
        tracing::info!(
            dir = %dir.display(),
            capacity = s.capacity,
            io = %settings.io,
            objects = s.objects,
            bytes = s.bytes,
            torn_regions = s.torn,
            from_checkpoint = store.opened_from_checkpoint(),
            io_errors = s.io_errors,
            millis = started.elapsed().as_millis() as u64,
            "disk tier ready"
        );
        let tier = Arc::new(DiskTier {
            store,
            admit: settings.admit,
            bound: settings.queue,
            shares: OnceLock::new(),
            queued_bytes: AtomicU64::new(0),
            queue: Mutex::default(),
            ready: Condvar::new(),
            counters: Counters::default(),
            events: OnceLock::new(),
        });
        let writer = tier.clone();
        std::thread::Builder::new()
            .name("kvpool-demote".into())
            .spawn(move || writer.write_jobs())
            .context("starting the disk tier's writer thread")?;
        Ok(tier)
    }

    /// Makes the tier `pool`'s lower tier, and gives each namespace with a quota the same
    /// share of the disk and of the demotion queue as its quota is of DRAM (a namespace
    /// without one may fill the tier and the queue).
    pub(crate) fn attach(self: &Arc<Self>, pool: &Pool) -> anyhow::Result<()> {
        let stats = pool.stats();
        let dram = stats.capacity().max(1);
        let disk = self.store.stats().capacity;
        let part = |of: u64, q: u64| (u128::from(of) * u128::from(q) / u128::from(dram)) as u64;
        let mut shares = Vec::new();
        for n in &stats.namespaces {
            let id = n.id as usize;
            if shares.len() <= id {
                shares.resize(id + 1, None);
            }
            let q = n.quota_bytes;
            shares[id] = (q != u64::MAX && q < dram).then(|| Share {
                disk: part(disk, q),
                queue: part(self.bound, q),
            });
        }
        let _ = self.shares.set(shares);
        anyhow::ensure!(
            pool.set_lower_tier(self.clone()),
            "the pool already has a tier under it"
        );
        Ok(())
    }

    /// Publishes the tier's KV events to `events` from now on: a copy indexed (a demotion
    /// written) is stored on disk; a copy forgotten, or gone with its region, removed.
    pub(crate) fn publish_to(&self, events: Arc<crate::events::EventHub>) {
        let hub = events.clone();
        self.store.on_dropped(Box::new(move |ns, key| {
            hub.publish(ns, KvEventKind::Removed, KvTier::Disk, key);
        }));
        let _ = self.events.set(events);
    }

    /// Publishes a KV event of the disk tier, if anyone listens.
    fn publish(&self, ns: u32, kind: KvEventKind, key: &[u8]) {
        if let Some(e) = self.events.get() {
            e.publish(ns, kind, KvTier::Disk, key);
        }
    }

    /// Takes no more demotions; the writer finishes what is queued, then exits.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// [`DiskTier::close`], then waits at most `within` for the writer to write what is queued,
    /// makes it durable and saves the store's index beside it: whether all of that was done.
    /// For a shutdown, so that a restart finds what was on its way, and loads the index
    /// instead of reading every record back.
    pub(crate) fn finish(&self, within: Duration) -> bool {
        self.close();
        let deadline = Instant::now() + within;
        while !self.lock().drained() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.store.checkpoint()
    }

    /// The store's counters and occupancy, and what moved objects in and out of it.
    pub(crate) fn stats(&self) -> DiskTierStats {
        let s = self.store.stats();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskTierStats {
            capacity: s.capacity,
            objects: s.objects,
            bytes: s.bytes,
            hits: s.hits,
            misses: s.misses,
            bytes_read: s.bytes_read,
            bytes_written: s.bytes_written,
            checksum_failures: s.checksum_failures,
            io_errors: s.io_errors,
            regions_dropped: s.regions_dropped,
            evicted: s.evicted,
            torn: s.torn,
            demoted: get(&c.demoted),
            demoted_bytes: get(&c.demoted_bytes),
            already_on_disk: get(&c.already_on_disk),
            not_admitted: get(&c.not_admitted),
            share_refused: get(&c.share_refused),
            queue_drops: get(&c.queue_drops),
            write_failures: get(&c.write_failures),
            withdrawn: get(&c.withdrawn),
            forgotten: get(&c.forgotten),
            promoted: get(&c.promoted),
            promoted_bytes: get(&c.promoted_bytes),
            promotion_failures: get(&c.promotion_failures),
            queued_bytes: get(&self.queued_bytes),
        }
    }

    /// Forgets every object of namespace `ns` on disk or on its way there (`Clear`); how many
    /// keys it held.
    pub(crate) fn clear(&self, ns: u32) -> u64 {
        let mut cleared = self
            .lock()
            .pending
            .remove(&ns)
            .map_or(0, |p| p.len() as u64);
        for key in self.store.keys(ns) {
            cleared += u64::from(self.forget(ns, &key, None));
        }
        cleared
    }

    /// Forgets `(ns, key)`'s copy on disk, which a read found it may not serve.
    pub(crate) fn removed_broken(&self, ns: u32, key: &[u8]) {
        self.forget(ns, key, None);
    }

    /// Forgets `(ns, key)`'s copy on disk and any demotion of it on its way there, unless its
    /// value is the one whose xxh3-64 is `keep`; a forgotten copy gets a tombstone, written
    /// ahead of every queued demotion. Whether there was anything to forget.
    fn forget(&self, ns: u32, key: &[u8], keep: Option<u64>) -> bool {
        let mut forgot = {
            let mut q = self.lock();
            if keep.is_none() {
                q.unpromote(ns, key);
            }
            q.cancel(ns, key, keep)
        };
        // Not under the queue's lock: the writer takes the index before the queue.
        if self.store.forget(ns, key, keep) {
            forgot = true;
            self.publish(ns, KvEventKind::Removed, key);
            self.lock().jobs.push_front(Job::Tombstone {
                ns,
                key: key.into(),
            });
            self.ready.notify_one();
        }
        if forgot {
            self.counters.forgotten.fetch_add(1, Ordering::Relaxed);
        }
        forgot
    }

    /// Namespace `ns`'s share of the tier (None: the whole of it).
    fn share(&self, ns: u32) -> Option<Share> {
        self.shares
            .get()
            .and_then(|s| s.get(ns as usize).copied().flatten())
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding it leaves a queue that is still a queue.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl LowerTier for DiskTier {
    fn evicting(&self, v: &Victim<'_>) -> Option<Claim> {
        let c = &self.counters;
        let origin = {
            let mut q = self.lock();
            let from = q.promotion(v.ns, v.key);
            q.unpromote(v.ns, v.key);
            from.and_then(|(dram, origin)| (dram == v.generation).then_some(origin))
        };
        // An object brought up from disk goes back down as the object it was.
        let generation = origin.unwrap_or(v.generation);
        let on_disk = self.store.lookup(v.ns, v.key);
        if on_disk.is_some_and(|f| f.checksum == v.checksum) {
            c.already_on_disk.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if on_disk.is_some() {
            // Another value's copy, left by a tombstone a crash lost: never served over this one.
            self.forget(v.ns, v.key, None);
        }
        if self.admit == DiskAdmit::ReadOnce && !v.accessed {
            c.not_admitted.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let len = v.len;
        // Read before the queue is locked: the writer takes the index, then the queue.
        let on_disk = self.store.namespace_bytes(v.ns);
        // Reserve the bytes first: a full queue costs no copy.
        let before = self.queued_bytes.fetch_add(len, Ordering::Relaxed);
        if before.saturating_add(len) > self.bound {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            c.queue_drops.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut q = self.lock();
        let queued = q.ns_queued.get(&v.ns).copied().unwrap_or(0);
        // A namespace's demotions stay within its share of the disk, and of the queue, so one
        // that evicts without end never crowds another's out.
        let share = self.share(v.ns);
        let over_disk =
            share.is_some_and(|s| on_disk.saturating_add(queued).saturating_add(len) > s.disk);
        let over_queue = share.is_some_and(|s| queued.saturating_add(len) > s.queue);
        if q.closed || over_disk || over_queue {
            drop(q);
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            let counter = if over_disk {
                &c.share_refused
            } else {
                &c.queue_drops
            };
            counter.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        // Reserved now, under the key's shard lock, so a commit or removal of the key that
        // follows finds it (and withdraws it) even before its bytes are copied.
        let ticket = q.reserve(Demotion {
            ns: v.ns,
            key: v.key.into(),
            value: Vec::new(),
            len,
            checksum: v.checksum,
            generation,
            ticket: 0,
        });
        Some(Claim(ticket))
    }

    fn demote(&self, claim: Claim, value: &[u8]) {
        let mut buf = self.lock().buffer(value.len());
        // Copied with no lock held: the pool's index and the queue are free meanwhile.
        buf.extend_from_slice(value);
        self.lock().fill(claim.0, buf);
        self.ready.notify_one();
    }

    fn committed(&self, ns: u32, key: &[u8], checksum: u64) {
        self.forget(ns, key, Some(checksum));
    }

    fn removed(&self, ns: u32, key: &[u8]) -> bool {
        self.forget(ns, key, None)
    }

    fn holds(&self, ns: u32, key: &[u8]) -> bool {
        self.store.lookup(ns, key).is_some()
    }

    fn removed_generation(
        &self,
        ns: u32,
        key: &[u8],
        generation: u64,
        in_dram: Option<u64>,
    ) -> bool {
        let promoted = {
            let mut q = self.lock();
            let from = q.promotion(ns, key);
            let same =
                from.is_some_and(|(dram, origin)| Some(dram) == in_dram && origin == generation);
            if same {
                q.unpromote(ns, key);
            }
            same
        };
        if self
            .store
            .lookup(ns, key)
            .is_some_and(|f| f.generation == generation)
        {
            self.forget(ns, key, None);
        }
        promoted
    }
}

impl Queue {
    /// Forgets that DRAM's object of `(ns, key)` was brought up from disk.
    /// DRAM's object of `(ns, key)` brought up from disk: its generation there and its own.
    pub(super) fn promotion(&self, ns: u32, key: &[u8]) -> Option<(u64, u64)> {
        self.promoted.get(&ns).and_then(|k| k.get(key)).copied()
    }

    pub(super) fn unpromote(&mut self, ns: u32, key: &[u8]) {
        if let Some(keys) = self.promoted.get_mut(&ns) {
            keys.remove(key);
            if keys.is_empty() {
                self.promoted.remove(&ns);
            }
        }
    }

    /// No job left, and nothing being written.
    fn drained(&self) -> bool {
        self.jobs.is_empty() && self.pending.values().all(HashMap::is_empty)
    }
}
