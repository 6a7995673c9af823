//! A full disk (`ENOSPC`) and a failing one (`EIO`) under a node's disk tier: demotions and
//! reads fail into counters and misses, and DRAM goes on serving.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvpool::disk::{FileRegions, RegionIo};
use kvpool::pool::{NamespaceConfig, DEFAULT_NAMESPACE};
use kvpool::segment::{Backing, HugePages};
use kvpool::{LowerTier, Pool, PoolConfig};

use super::tests::{dir, settings, settle, value};
use super::DiskTier;
use crate::cluster::Continuity;

/// Region files whose writes fail with `ENOSPC` and reads with `EIO` while told to.
struct Failing {
    inner: FileRegions,
    full: Arc<AtomicBool>,
    broken: Arc<AtomicBool>,
}

impl RegionIo for Failing {
    fn read_at(&self, region: u32, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if self.broken.load(Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.read_at(region, offset, buf)
    }

    fn write_at(&self, region: u32, offset: u64, buf: &[u8]) -> io::Result<()> {
        if self.full.load(Ordering::Relaxed) {
            // As a disk filling up mid-write: part of the record lands first.
            self.inner.write_at(region, offset, &buf[..buf.len() / 2])?;
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.inner.write_at(region, offset, buf)
    }

    fn sync(&self, region: u32) -> io::Result<()> {
        self.inner.sync(region)
    }

    fn truncate(&self, region: u32, len: u64) -> io::Result<()> {
        self.inner.truncate(region, len)
    }

    fn len(&self, region: u32) -> io::Result<u64> {
        self.inner.len(region)
    }
}

/// A pool of 2 MiB (about thirty 64 KiB values) under a tier whose disk fails on command.
fn failing_tier(name: &str) -> (Arc<DiskTier>, Pool, Arc<AtomicBool>, Arc<AtomicBool>) {
    let dir = dir(name);
    let settings = settings(&dir, "64MiB", "all");
    let (full, broken) = (Arc::default(), Arc::<AtomicBool>::default());
    let io = Failing {
        inner: FileRegions::open(&dir, 8).unwrap(),
        full: Arc::clone(&full),
        broken: Arc::clone(&broken),
    };
    let tier = DiskTier::open_with(&settings, Box::new(io)).unwrap();
    let cfg = PoolConfig {
        segment_size: 2 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        namespaces: vec![NamespaceConfig::unlimited(DEFAULT_NAMESPACE)],
        ..PoolConfig::default()
    };
    let pool = Pool::new(&cfg, [3; 16]).unwrap();
    tier.attach(&pool).unwrap();
    (tier, pool, full, broken)
}

#[test]
fn a_full_disk_turns_demotions_into_counted_failures_and_dram_goes_on() {
    let (tier, pool, full, _) = failing_tier("disk-tier-enospc");
    full.store(true, Ordering::Relaxed);
    for i in 0..100u32 {
        pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
    }
    settle(&tier);
    let s = tier.stats();
    assert!(s.write_failures > 0, "{s:?}");
    assert!(s.io_errors > 0, "{s:?}");
    assert_eq!((s.demoted, s.objects), (0, 0), "{s:?}");
    // DRAM serves what it holds; what it evicted is a miss, never a half-written record.
    let mut served = 0;
    for i in 0..100u32 {
        let key = i.to_le_bytes();
        if let Ok(v) = pool.get(0, &key, 0) {
            assert_eq!(v, value(i));
            served += 1;
        } else {
            assert!(!tier.promote(&pool, (0, &key), 0, |_| Continuity::Continuous));
        }
    }
    assert!(served > 10, "{served}");
    // Once the disk has room again, demotions land again.
    full.store(false, Ordering::Relaxed);
    for i in 100..160u32 {
        pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
    }
    settle(&tier);
    assert!(tier.stats().demoted > 0, "{:?}", tier.stats());
    tier.close();
}

#[test]
fn a_failing_disk_turns_reads_into_misses_and_drops_the_copies() {
    let (tier, pool, _, broken) = failing_tier("disk-tier-eio");
    for i in 0..60u32 {
        pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
    }
    settle(&tier);
    let on_disk = tier.stats().objects;
    assert!(on_disk > 10, "{:?}", tier.stats());
    broken.store(true, Ordering::Relaxed);
    let mut missed = 0;
    for i in 0..60u32 {
        let key = i.to_le_bytes();
        if pool.provenance(0, &key).unwrap().is_some() {
            continue;
        }
        assert!(!tier.promote(&pool, (0, &key), 0, |_| Continuity::Continuous));
        assert!(
            !tier.holds(0, &key),
            "a copy that cannot be read is dropped"
        );
        missed += 1;
    }
    // Each attempt to bring a key up allocates in DRAM, which may push another key down, so
    // more keys may miss than were on disk at first.
    assert!(missed >= on_disk, "{missed} {on_disk}");
    let s = tier.stats();
    assert!(s.io_errors >= on_disk, "{s:?}");
    assert_eq!(s.promoted, 0, "{s:?}");
    // DRAM still serves everything it holds, and takes new values.
    broken.store(false, Ordering::Relaxed);
    pool.put(0, b"after", &value(99), false, 0).unwrap();
    assert_eq!(pool.get(0, b"after", 0).unwrap(), value(99));
    tier.close();
}
