use std::path::{Path, PathBuf};

use kvpool::disk::{Get, Insert};
use kvpool::pool::{NamespaceConfig, DEFAULT_NAMESPACE};
use kvpool::segment::{Backing, HugePages};
use kvpool::{Pool, PoolConfig};

use super::*;
use crate::cluster::Continuity;
use crate::config::Config;

/// A fresh directory for one test's store.
pub(super) fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvpool-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A tier of 8 MiB in regions of 1 MiB in `dir`.
pub(super) fn settings(dir: &Path, queue: &str, admit: &str) -> DiskSettings {
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

/// A pool of one 2 MiB segment: 64 KiB values start being evicted after about thirty, least
/// recently used first.
fn small_pool() -> Pool {
    let cfg = PoolConfig {
        segment_size: 2 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        namespaces: vec![NamespaceConfig {
            eviction: kvpool::eviction::PolicyKind::Lru,
            ..NamespaceConfig::unlimited(DEFAULT_NAMESPACE)
        }],
        ..PoolConfig::default()
    };
    Pool::new(&cfg, [3; 16]).unwrap()
}

pub(super) fn value(id: u32) -> Vec<u8> {
    (0..64 << 10)
        .map(|i| (i as u32 ^ id.wrapping_mul(31)) as u8)
        .collect()
}

/// An eviction of `key` of the default namespace as the pool makes one: shown to the tier,
/// then, if it claimed them, its bytes handed over.
fn evict(tier: &DiskTier, key: &[u8], value: &[u8], accessed: bool) {
    let victim = Victim {
        ns: 0,
        key,
        len: value.len() as u64,
        checksum: kvpool::checksum::checksum(value),
        generation: 1,
        accessed,
    };
    if let Some(claim) = tier.evicting(&victim) {
        tier.demote(claim, value);
    }
}

/// Waits until the writer has done everything queued.
pub(super) fn settle(tier: &DiskTier) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tier.lock().drained() || tier.stats().queued_bytes > 0 {
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
    tier.attach(&pool).unwrap();
    for i in 0..60u32 {
        pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
    }
    settle(&tier);
    let evictions = pool.stats().evictions;
    assert!(evictions >= 20, "{evictions}");
    let s = tier.stats();
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
    tier.attach(&pool).unwrap();
    for i in 0..150u32 {
        pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
        if i % 3 == 0 {
            assert!(pool.get_ref(0, &i.to_le_bytes(), 0).is_ok());
        }
    }
    settle(&tier);
    let s = tier.stats();
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
    evict(&full, b"k", &value(1), true);
    evict(&full, b"k", b"tiny", false);
    settle(&full);
    let s = full.stats();
    assert_eq!((s.queue_drops, s.demoted), (1, 1), "{s:?}");
    let mut buf = [0u8; 8];
    assert_eq!(full.store.get(0, b"k", &mut buf), Get::Hit { len: 4 });
    full.close();
    evict(&full, b"late", b"tiny", true);
    assert_eq!(full.stats().queue_drops, 2, "a closed tier takes nothing");
    tier.close();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tier of `settings` under a fresh small pool, every eviction admitted.
fn tier_under_pool(name: &str) -> (PathBuf, Arc<DiskTier>, Pool) {
    let dir = dir(name);
    let tier = DiskTier::open(&settings(&dir, "64MiB", "all")).unwrap();
    let pool = small_pool();
    tier.attach(&pool).unwrap();
    (dir, tier, pool)
}

/// Puts keys from `from` on until the pool has evicted `key`, and lets the writer take what
/// was demoted.
fn push_out(pool: &Pool, tier: &DiskTier, key: &[u8], from: u32) -> u32 {
    let mut i = from;
    while pool.provenance(0, key).unwrap().is_some() {
        pool.put(0, &i.to_le_bytes(), &value(i), false, 0).unwrap();
        i += 1;
    }
    settle(tier);
    i
}

fn continuous(_: u64) -> Continuity {
    Continuity::Continuous
}

#[test]
fn a_disk_hit_is_promoted_into_dram_and_its_next_eviction_writes_nothing() {
    let (dir, tier, pool) = tier_under_pool("disk-tier-promote");
    pool.put(0, b"k", &value(7), false, 0).unwrap();
    let next = push_out(&pool, &tier, b"k", 1000);
    // Pushed out with its neighbours: "k" went first.
    assert!(pool.get_ref(0, b"k", 0).is_err());
    assert!(tier.holds(0, b"k"), "on disk");
    assert!(
        pool.present_prefix(0, [&b"k"[..]]).unwrap() == 1,
        "lookups see the disk"
    );
    assert!(tier.promote(&pool, (0, b"k"), 0, continuous));
    assert_eq!(pool.get(0, b"k", 0).unwrap(), value(7));
    let s = tier.stats();
    assert_eq!((s.promoted, s.promoted_bytes), (1, 64 << 10), "{s:?}");
    assert!(
        tier.holds(0, b"k"),
        "the copy stays: DRAM holds the same value"
    );
    // Evicted again unchanged: nothing more is written.
    let written = tier.stats().demoted;
    let demoted_k = |t: &DiskTier| t.stats().already_on_disk;
    push_out(&pool, &tier, b"k", next);
    assert!(demoted_k(&tier) >= 1);
    assert!(tier.stats().demoted >= written);
    let mut buf = vec![0u8; 64 << 10];
    assert_eq!(
        tier.store.get(0, b"k", &mut buf),
        Get::Hit { len: 64 << 10 }
    );
    assert_eq!(buf, value(7));
    // A copy a routed read may not serve is forgotten, not promoted.
    assert!(!tier.promote(&pool, (0, b"k"), 0, |_| Continuity::Broken));
    assert!(!tier.holds(0, b"k"));
    tier.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_new_value_or_a_removal_forgets_the_disk_copy_for_good() {
    let (dir, tier, pool) = tier_under_pool("disk-tier-forget");
    pool.put(0, b"new", &value(1), false, 0).unwrap();
    pool.put(0, b"gone", &value(2), false, 0).unwrap();
    pool.put(0, b"same", &value(3), false, 0).unwrap();
    push_out(&pool, &tier, b"same", 100);
    for key in [&b"new"[..], b"gone", b"same"] {
        assert!(tier.holds(0, key), "{key:?} on disk");
    }
    // A new value: the disk copy is forgotten at once, so no read finds the old one.
    pool.put(0, b"new", &value(11), false, 0).unwrap();
    assert!(!tier.holds(0, b"new"));
    // The same value again: the copy is still good, and kept.
    pool.put(0, b"same", &value(3), false, 0).unwrap();
    assert!(tier.holds(0, b"same"));
    // A key only on disk is removed, and the removal says it was there.
    assert!(pool.remove(0, b"gone").unwrap());
    assert!(!tier.holds(0, b"gone"));
    assert!(!tier.promote(&pool, (0, b"gone"), 0, continuous));
    assert!(tier.stats().forgotten >= 2);
    assert!(tier.finish(Duration::from_secs(20)));
    drop(tier);
    // Their tombstones keep them gone after a restart.
    let again = DiskTier::open(&settings(&dir, "64MiB", "all")).unwrap();
    assert!(!again.holds(0, b"new"));
    assert!(!again.holds(0, b"gone"));
    assert!(again.holds(0, b"same"));
    again.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_demotion_of_a_key_written_meanwhile_is_never_indexed() {
    let dir = dir("disk-tier-withdrawn");
    let settings = settings(&dir, "64MiB", "all");
    let tier = DiskTier::open(&settings).unwrap();
    // Queued, and the key committed anew while the writer may be taking it: whichever comes
    // first, the old value is not on disk afterwards, nor after a restart.
    let old = value(1);
    evict(&tier, b"k", &old, true);
    tier.committed(0, b"k", kvpool::checksum::checksum(&value(2)));
    settle(&tier);
    assert!(!tier.holds(0, b"k"));
    let s = tier.stats();
    // Forgotten once (queued or indexed); withdrawn too unless it was written first.
    assert_eq!(s.forgotten, 1, "{s:?}");
    assert_eq!(s.withdrawn + s.demoted, 1, "{s:?}");
    // Two demotions of one key: only the later one is written.
    evict(&tier, b"twice", &value(3), true);
    evict(&tier, b"twice", &value(4), true);
    settle(&tier);
    let mut buf = vec![0u8; 64 << 10];
    assert_eq!(
        tier.store.get(0, b"twice", &mut buf),
        Get::Hit { len: 64 << 10 }
    );
    assert_eq!(buf, value(4));
    assert!(tier.finish(Duration::from_secs(20)));
    drop(tier);
    let again = DiskTier::open(&settings).unwrap();
    assert!(!again.holds(0, b"k"));
    assert!(again.holds(0, b"twice"));
    again.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_namespace_with_a_quota_takes_only_its_share_of_the_disk() {
    let dir = dir("disk-tier-share");
    let tier = DiskTier::open(&settings(&dir, "64MiB", "all")).unwrap();
    let cfg = PoolConfig {
        segment_size: 2 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        namespaces: vec![
            NamespaceConfig::unlimited(DEFAULT_NAMESPACE),
            NamespaceConfig {
                quota_bytes: Some(512 << 10),
                ..NamespaceConfig::unlimited("small")
            },
        ],
        ..PoolConfig::default()
    };
    let pool = Pool::new(&cfg, [3; 16]).unwrap();
    tier.attach(&pool).unwrap();
    // A quarter of DRAM: a quarter of the 8 MiB tier, 2 MiB, about thirty 64 KiB records.
    for i in 0..200u32 {
        pool.put(1, &i.to_le_bytes(), &value(i), false, 0).unwrap();
    }
    settle(&tier);
    let s = tier.stats();
    assert!(s.share_refused > 0, "{s:?}");
    let share = tier.share(1).unwrap().disk;
    assert!(
        tier.store.namespace_bytes(1) <= share,
        "{} {share}",
        tier.store.namespace_bytes(1)
    );
    assert!(tier.store.namespace_bytes(1) > 1 << 20);
    tier.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tenant_evicting_without_end_never_crowds_another_off_the_disk() {
    let dir = dir("disk-tier-crowd");
    let tier = DiskTier::open(&settings(&dir, "1MiB", "all")).unwrap();
    let quota = |name: &str| NamespaceConfig {
        quota_bytes: Some(512 << 10),
        eviction: kvpool::eviction::PolicyKind::Lru,
        ..NamespaceConfig::unlimited(name)
    };
    let cfg = PoolConfig {
        segment_size: 2 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        namespaces: vec![
            NamespaceConfig::unlimited(DEFAULT_NAMESPACE),
            quota("a"),
            quota("b"),
        ],
        ..PoolConfig::default()
    };
    let pool = Arc::new(Pool::new(&cfg, [3; 16]).unwrap());
    tier.attach(&pool).unwrap();
    // Tenant A evicts as fast as it can put, the whole time.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                pool.put(1, &i.to_le_bytes(), &value(i), false, 0).unwrap();
                i += 1;
            }
        })
    };
    // Tenant B puts at its own pace, within its share of the queue (each put after its last
    // demotion landed): every one of its evictions reaches the disk.
    let b_keys = 24u32;
    let deadline = Instant::now() + Duration::from_secs(30);
    for i in 0..b_keys {
        pool.put(2, &i.to_le_bytes(), &value(i + 1000), false, 0)
            .unwrap();
        while tier.lock().ns_queued.get(&2).is_some_and(|&n| n > 0) {
            assert!(Instant::now() < deadline, "the writer is stuck");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // A, meanwhile, ran into its shares.
    while tier.stats().queue_drops + tier.stats().share_refused == 0 {
        assert!(Instant::now() < deadline, "A was never held back");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    settle(&tier);
    let mut buf = vec![0u8; 64 << 10];
    let mut on_disk = 0;
    for i in 0..b_keys {
        let key = i.to_le_bytes();
        if pool.provenance(2, &key).unwrap().is_some() {
            continue;
        }
        assert_eq!(
            tier.store.get(2, &key, &mut buf),
            Get::Hit { len: 64 << 10 },
            "B's {i} {:?}",
            tier.stats(),
        );
        assert_eq!(buf, value(i + 1000));
        on_disk += 1;
    }
    assert!(on_disk > 10, "{on_disk}");
    tier.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_removal_of_a_generation_reaches_its_copy_on_disk_and_the_copy_brought_up() {
    let (dir, tier, pool) = tier_under_pool("disk-tier-generation");
    pool.put(0, b"ttl", &value(5), false, 0).unwrap();
    pool.put(0, b"up", &value(6), false, 0).unwrap();
    let gen = |key: &[u8]| pool.provenance(0, key).unwrap().unwrap().0;
    let (ttl, up) = (gen(b"ttl"), gen(b"up"));
    push_out(&pool, &tier, b"up", 100);
    assert!(tier.holds(0, b"ttl") && tier.holds(0, b"up"));
    // A TTL set on the object lapses while it is on disk: the copy goes.
    assert!(!pool.remove_generation(0, b"ttl", ttl).unwrap());
    assert!(!tier.holds(0, b"ttl"));
    // Brought up, it is a new allocation but the same object: a removal of the generation
    // it was written with removes it from DRAM and from disk.
    assert!(tier.promote(&pool, (0, b"up"), 0, continuous));
    assert_ne!(gen(b"up"), up);
    assert!(pool.remove_generation(0, b"up", up).unwrap());
    assert!(pool.provenance(0, b"up").unwrap().is_none());
    assert!(!tier.holds(0, b"up"));
    // A newer write of the key is left alone by an older generation's removal.
    pool.put(0, b"up", &value(7), false, 0).unwrap();
    assert!(!pool.remove_generation(0, b"up", up).unwrap());
    assert_eq!(pool.get(0, b"up", 0).unwrap(), value(7));
    tier.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_tier_publishes_copies_indexed_and_those_its_dropped_regions_took() {
    let dir = dir("disk-tier-events");
    let tier = DiskTier::open(&settings(&dir, "64MiB", "all")).unwrap();
    let hub = crate::events::EventHub::new(1, Default::default());
    tier.publish_to(hub.clone());
    let mut sub = hub.subscriber();
    sub.add(0, b"");
    // 8 MiB of 1 MiB regions: 200 values of 64 KiB make it drop its oldest regions.
    let (mut stored, mut removed) = (std::collections::HashSet::new(), Vec::new());
    for i in 0..200u32 {
        evict(&tier, &i.to_le_bytes(), &value(i), true);
        settle(&tier);
        while let Some(b) = sub.take() {
            assert_eq!(b.dropped, 0);
            for e in b.events {
                assert_eq!(e.tier, kvpool::protocol::KvTier::Disk);
                match e.kind {
                    kvpool::protocol::KvEventKind::Stored => assert!(stored.insert(e.key)),
                    _ => removed.push(e.key),
                }
            }
        }
    }
    let s = tier.stats();
    assert_eq!(stored.len() as u64, s.demoted, "{s:?}");
    assert!(s.regions_dropped > 0 && s.evicted > 0, "{s:?}");
    assert_eq!(
        removed.len() as u64,
        s.evicted,
        "one removal per object a region took"
    );
    for key in &removed {
        assert!(stored.contains(key) && tier.store.lookup(0, key).is_none());
    }
    assert!(tier.finish(Duration::from_secs(20)));
    let _ = std::fs::remove_dir_all(&dir);
}
