//! The disk tier under DRAM (`[disk]`, docs/OPERATIONS.md): the node's
//! [`DiskStore`](kvpool::disk::DiskStore), opened at start when `disk.path` is set, its index
//! rebuilt from the region files (docs/ARCHITECTURE.md, "Disk store"), and the demotion of
//! what DRAM evicts to it.
//!
//! **Demotion.** The tier is the pool's [`EvictionObserver`]: the pool shows it each evicted
//! object under the object's index shard lock, just before freeing its block. An object the
//! admission filter (`disk.admit`) takes is copied into a queue bounded in bytes
//! (`disk.queue`), and one writer thread drains the queue into the store
//! (`insert_prehashed`, with the checksum the pool verified at commit). The bytes are copied
//! rather than the block held until written: the eviction is making room for an allocation
//! that needs the block now, and a held block would also be memory outside every quota. A
//! full queue drops the write and counts it, so an eviction (and the put or get behind it)
//! never waits for the disk: its cost is one copy of the value, only for admitted objects
//! while the queue has room.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvpool::disk::{DiskStore, Insert};
use kvpool::EvictionObserver;

use crate::config::{DiskAdmit, DiskSettings};

/// The node's disk tier: its store, what it admits, and the queue of objects on their way.
pub(crate) struct DiskTier {
    /// The store of region files.
    pub(crate) store: DiskStore,
    /// Which evicted objects are worth a disk write.
    admit: DiskAdmit,
    /// Most bytes of values waiting in `queue`.
    bound: u64,
    /// Bytes of values waiting in `queue` or being written, reserved before they are copied.
    queued_bytes: AtomicU64,
    queue: Mutex<Queue>,
    /// Signalled when the queue gains an object or closes.
    ready: Condvar,
    counters: Counters,
}

/// An evicted object on its way to disk: a copy, since its block is freed once the pool has
/// shown it.
struct Demotion {
    ns: u32,
    key: Box<[u8]>,
    value: Vec<u8>,
    checksum: u64,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Demotion>,
    /// No more demotions are taken; the writer exits once the queue is empty.
    closed: bool,
}

#[derive(Default)]
struct Counters {
    demoted: AtomicU64,
    demoted_bytes: AtomicU64,
    not_admitted: AtomicU64,
    queue_drops: AtomicU64,
    write_failures: AtomicU64,
}

/// What demotion did, since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DemoteStats {
    /// Evicted objects written to the store.
    pub(crate) demoted: u64,
    /// Value bytes of those.
    pub(crate) demoted_bytes: u64,
    /// Evicted objects the admission filter declined.
    pub(crate) not_admitted: u64,
    /// Admitted objects dropped because the queue was full (or closed).
    pub(crate) queue_drops: u64,
    /// Objects the store refused (too large for a region, or the write failed).
    pub(crate) write_failures: u64,
    /// Value bytes waiting in the queue or being written now.
    pub(crate) queued_bytes: u64,
}

impl DiskTier {
    /// Opens the store `settings` describe (creating its directory if missing), reading every
    /// record back to rebuild its index, logs what it found, and starts the writer thread that
    /// drains the demotion queue. The caller makes it the pool's eviction observer.
    pub(crate) fn open(settings: &DiskSettings) -> anyhow::Result<Arc<DiskTier>> {
        let started = Instant::now();
        let dir = &settings.store.dir;
        let store = DiskStore::open(&settings.store)
            .with_context(|| format!("opening the disk tier in {}", dir.display()))?;
        let s = store.stats();
        tracing::info!(
            dir = %dir.display(),
            capacity = s.capacity,
            objects = s.objects,
            bytes = s.bytes,
            checksum_failures = s.checksum_failures,
            torn_regions = s.torn,
            io_errors = s.io_errors,
            millis = started.elapsed().as_millis() as u64,
            "disk tier ready"
        );
        let tier = Arc::new(DiskTier {
            store,
            admit: settings.admit,
            bound: settings.queue,
            queued_bytes: AtomicU64::new(0),
            queue: Mutex::default(),
            ready: Condvar::new(),
            counters: Counters::default(),
        });
        let writer = tier.clone();
        std::thread::Builder::new()
            .name("kvpool-demote".into())
            .spawn(move || writer.write_demotions())
            .context("starting the disk tier's writer thread")?;
        Ok(tier)
    }

    /// Takes no more demotions; the writer finishes what is queued, then exits.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// [`DiskTier::close`], then waits at most `within` for the writer to write what is queued
    /// and makes it durable: whether all of it was. For a shutdown, so that a restart finds
    /// what was on its way.
    pub(crate) fn finish(&self, within: Duration) -> bool {
        self.close();
        let deadline = Instant::now() + within;
        while self.queued_bytes.load(Ordering::Relaxed) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.store.sync()
    }

    /// What demotion did.
    pub(crate) fn demote_stats(&self) -> DemoteStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DemoteStats {
            demoted: get(&c.demoted),
            demoted_bytes: get(&c.demoted_bytes),
            not_admitted: get(&c.not_admitted),
            queue_drops: get(&c.queue_drops),
            write_failures: get(&c.write_failures),
            queued_bytes: get(&self.queued_bytes),
        }
    }

    /// The writer thread: writes queued objects to the store, oldest first, until the queue
    /// is closed and empty.
    fn write_demotions(&self) {
        loop {
            let d = {
                let mut q = self.lock();
                loop {
                    if let Some(d) = q.items.pop_front() {
                        break d;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let len = d.value.len() as u64;
            let c = &self.counters;
            match self
                .store
                .insert_prehashed(d.ns, &d.key, &d.value, d.checksum)
            {
                Insert::Written => {
                    c.demoted.fetch_add(1, Ordering::Relaxed);
                    c.demoted_bytes.fetch_add(len, Ordering::Relaxed);
                }
                _ => {
                    c.write_failures.fetch_add(1, Ordering::Relaxed);
                }
            }
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding it leaves a queue that is still a queue.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl EvictionObserver for DiskTier {
    fn evicted(&self, ns: u32, key: &[u8], value: &[u8], checksum: u64, accessed: bool) {
        let c = &self.counters;
        if self.admit == DiskAdmit::ReadOnce && !accessed {
            c.not_admitted.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Reserve the bytes first: a full queue costs no copy.
        let len = value.len() as u64;
        let before = self.queued_bytes.fetch_add(len, Ordering::Relaxed);
        if before.saturating_add(len) > self.bound {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            c.queue_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let d = Demotion {
            ns,
            key: key.into(),
            value: value.to_vec(),
            checksum,
        };
        let mut q = self.lock();
        if q.closed {
            drop(q);
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            c.queue_drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.items.push_back(d);
        drop(q);
        self.ready.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use kvpool::disk::Get;
    use kvpool::pool::{NamespaceConfig, DEFAULT_NAMESPACE};
    use kvpool::segment::{Backing, HugePages};
    use kvpool::{Pool, PoolConfig};

    use super::*;
    use crate::config::Config;

    /// A fresh directory for one test's store.
    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvpool-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// A tier of 8 MiB in regions of 1 MiB in `dir`.
    fn settings(dir: &Path, queue: &str, admit: &str) -> DiskSettings {
        let toml = format!(
            "[disk]\npath = \"{}\"\ncapacity = \"8MiB\"\nregion_size = \"1MiB\"\n\
             queue = \"{queue}\"\nadmit = \"{admit}\"",
            dir.display()
        );
        Config::from_toml(&toml)
            .unwrap()
            .disk_tier()
            .unwrap()
            .unwrap()
    }

    /// A pool of one 2 MiB segment: 64 KiB values start being evicted after about thirty.
    fn small_pool() -> Pool {
        let cfg = PoolConfig {
            segment_size: 2 << 20,
            backing: Backing::Anonymous,
            huge_pages: HugePages::Off,
            namespaces: vec![NamespaceConfig::unlimited(DEFAULT_NAMESPACE)],
            ..PoolConfig::default()
        };
        Pool::new(&cfg, [3; 16]).unwrap()
    }

    fn value(id: u32) -> Vec<u8> {
        (0..64 << 10)
            .map(|i| (i as u32 ^ id.wrapping_mul(31)) as u8)
            .collect()
    }

    /// Waits until the writer has taken everything queued.
    fn settle(tier: &DiskTier) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while tier.demote_stats().queued_bytes > 0 {
            assert!(Instant::now() < deadline, "the writer is stuck");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn the_tier_opens_from_its_settings_and_finds_what_it_held() {
        let dir = dir("disk-tier-open");
        let settings = settings(&dir, "1MiB", "all");
        let tier = DiskTier::open(&settings).unwrap();
        assert_eq!(tier.admit, DiskAdmit::All);
        assert_eq!(tier.store.stats().capacity, 8 << 20);
        assert_eq!(tier.store.insert(0, b"block", b"bytes"), Insert::Written);
        assert!(tier.store.sync());
        tier.close();
        drop(tier);

        let again = DiskTier::open(&settings).unwrap();
        assert_eq!(
            again.store.stats().objects,
            1,
            "the index is rebuilt at open"
        );
        let mut buf = [0u8; 16];
        assert_eq!(again.store.get(0, b"block", &mut buf), Get::Hit { len: 5 });
        assert_eq!(&buf[..5], b"bytes");
        again.close();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn evicted_objects_are_written_to_the_store() {
        let dir = dir("disk-tier-demote");
        let tier = DiskTier::open(&settings(&dir, "64MiB", "all")).unwrap();
        let pool = small_pool();
        assert!(pool.observe_evictions(tier.clone()));
        for i in 0..60u32 {
            pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
        }
        settle(&tier);
        let evictions = pool.stats().evictions;
        assert!(evictions >= 20, "{evictions}");
        let s = tier.demote_stats();
        assert_eq!(s.demoted, evictions, "{s:?}");
        assert_eq!(s.demoted_bytes, evictions * (64 << 10));
        assert_eq!((s.queue_drops, s.not_admitted, s.write_failures), (0, 0, 0));
        let mut buf = vec![0u8; 64 << 10];
        let mut on_disk = 0;
        for i in 0..60u32 {
            let key = i.to_le_bytes();
            if pool.get(0, &key, 0).is_ok() {
                continue;
            }
            assert_eq!(
                tier.store.get(0, &key, &mut buf),
                Get::Hit { len: 64 << 10 },
                "evicted key {i}"
            );
            assert_eq!(buf, value(i));
            on_disk += 1;
        }
        assert_eq!(on_disk, evictions);

        let ledger = crate::ledger::Ledger::new(&crate::ledger::Bounds::none(), &[1 << 20]);
        let page = crate::metrics::Metrics::default()
            .render(&pool, &ledger, Some(&tier), false)
            .unwrap();
        let line = format!("kvpool_disk_demotions_total{{node=\"0\"}} {evictions}\n");
        assert!(page.contains(&line), "{page}");
        assert!(page.contains("kvpool_disk_capacity_bytes{node=\"0\"} 8388608\n"));
        assert!(tier.finish(Duration::from_secs(20)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn read_once_admits_only_what_was_read_and_a_full_queue_drops() {
        let dir = dir("disk-tier-admit");
        let tier = DiskTier::open(&settings(&dir, "1MiB", "read-once")).unwrap();
        let pool = small_pool();
        assert!(pool.observe_evictions(tier.clone()));
        for i in 0..150u32 {
            pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
            if i % 3 == 0 {
                assert!(pool.get_ref(0, &i.to_le_bytes(), 0).is_ok());
            }
        }
        settle(&tier);
        let s = tier.demote_stats();
        let evictions = pool.stats().evictions;
        assert_eq!(
            s.demoted + s.not_admitted + s.queue_drops,
            evictions,
            "{s:?}"
        );
        assert!(s.demoted > 0 && s.not_admitted > 0, "{s:?}");
        for i in 0..150u32 {
            if tier.store.contains(0, &i.to_le_bytes()) {
                assert_eq!(i % 3, 0, "key {i} was never read");
            }
        }

        // A queue smaller than one value takes nothing, and says so; the eviction goes on.
        let small = dir.join("small");
        let full = DiskTier::open(&settings(&small, "1KiB", "all")).unwrap();
        full.evicted(
            0,
            b"k",
            &value(1),
            kvpool::checksum::checksum(&value(1)),
            true,
        );
        full.evicted(0, b"k", b"tiny", kvpool::checksum::checksum(b"tiny"), false);
        settle(&full);
        let s = full.demote_stats();
        assert_eq!((s.queue_drops, s.demoted), (1, 1), "{s:?}");
        let mut buf = [0u8; 8];
        assert_eq!(full.store.get(0, b"k", &mut buf), Get::Hit { len: 4 });
        full.close();
        full.evicted(0, b"late", b"tiny", 0, true);
        assert_eq!(
            full.demote_stats().queue_drops,
            2,
            "a closed tier takes nothing"
        );
        tier.close();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
