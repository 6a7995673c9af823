use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::alloc::AllocConfig;
use crate::checksum::checksum;
use crate::error::AddrFault;
use crate::eviction::PolicyKind;
use crate::segment::{Backing, HugePages};

fn cfg(segment_size: u64) -> PoolConfig {
    PoolConfig {
        segment_size,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        shards: 4,
        // LRU, so the tests below can say exactly what goes first.
        namespaces: vec![
            NamespaceConfig {
                eviction: PolicyKind::Lru,
                ..NamespaceConfig::unlimited(DEFAULT_NAMESPACE)
            },
            NamespaceConfig {
                name: "small".into(),
                quota_bytes: Some(256 << 10),
                eviction: PolicyKind::Lru,
                own_segment: false,
            },
        ],
        ..PoolConfig::default()
    }
}

fn pool(segment_size: u64) -> Pool {
    Pool::new(&cfg(segment_size), [9; 16]).unwrap()
}

fn value(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

#[test]
fn every_policy_evicts_within_quota_and_spares_pins() {
    for policy in PolicyKind::ALL {
        let c = PoolConfig {
            namespaces: vec![NamespaceConfig {
                name: DEFAULT_NAMESPACE.into(),
                quota_bytes: Some(1 << 20),
                eviction: policy,
                own_segment: false,
            }],
            ..cfg(4 << 20)
        };
        let p = Pool::new(&c, [1; 16]).unwrap();
        p.put(0, b"pinned", &value(0, 64 << 10), true, 0).unwrap();
        for i in 0..200u32 {
            let depth = i % 8;
            let a = p
                .alloc_in_chain(0, &i.to_le_bytes(), 64 << 10, false, depth, 0)
                .unwrap();
            p.write(&a, 0, &value(i, 64 << 10)).unwrap();
            p.commit(Commit::new(&a, checksum(&value(i, 64 << 10))))
                .unwrap();
            // Re-read a hot set so frequency-aware policies have something to keep.
            for hot in 0..4u32 {
                let _ = p.get(0, &hot.to_le_bytes(), 0);
            }
        }
        let s = p.stats();
        assert!(s.namespaces[0].used_bytes <= 1 << 20, "{policy}: {s:?}");
        assert_eq!(s.objects, 16, "{policy}: the quota holds 16 blocks");
        assert_eq!(
            p.get(0, b"pinned", 0).unwrap(),
            value(0, 64 << 10),
            "{policy}"
        );
        assert!(s.evictions >= 180, "{policy}");
        // Whatever is present reads back exactly.
        for i in 0..200u32 {
            if let Ok(v) = p.get(0, &i.to_le_bytes(), 0) {
                assert_eq!(v, value(i, 64 << 10), "{policy}");
            }
        }
    }
}

#[test]
fn index_entries_stay_small() {
    // Pools hold millions of objects; docs/ARCHITECTURE.md quotes this size.
    assert!(std::mem::size_of::<index::Entry>() <= 48);
}

#[test]
fn put_get_remove_round_trip() {
    let p = pool(4 << 20);
    let v = value(1, 10_000);
    p.put(0, b"k", &v, false, 0).unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), v);
    let r = p.get_ref(0, b"k", 0).unwrap();
    assert_eq!(r.checksum(), checksum(&v));
    drop(r);
    assert!(p.remove(0, b"k").unwrap());
    assert!(!p.remove(0, b"k").unwrap());
    assert_eq!(p.get(0, b"k", 0), Err(PoolError::NotFound));
    assert_eq!(p.stats().used_bytes(), 0);
    let s = p.stats();
    assert_eq!((s.hits, s.misses), (2, 1));
}

#[test]
fn bad_keys_and_namespaces_are_refused() {
    let p = pool(4 << 20);
    assert_eq!(p.put(0, b"", b"x", false, 0), Err(PoolError::BadKey));
    assert_eq!(p.put(0, &[1; 257], b"x", false, 0), Err(PoolError::BadKey));
    assert!(p.put(0, &[1; 256], b"x", false, 0).is_ok());
    assert_eq!(
        p.put(7, b"k", b"x", false, 0),
        Err(PoolError::UnknownNamespace)
    );
    assert_eq!(p.get(7, b"k", 0), Err(PoolError::UnknownNamespace));
    assert_eq!(
        p.alloc(0, b"k", 5 << 20, false, 0),
        Err(PoolError::TooLarge)
    );
}

#[test]
fn pending_objects_are_invisible_until_commit_and_checksums_are_enforced() {
    let p = pool(4 << 20);
    p.put(0, b"k", b"old", false, 0).unwrap();
    let a = p.alloc(0, b"k", 3, false, 0).unwrap();
    p.write(&a, 0, b"new").unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), b"old");
    assert_eq!(
        p.commit(Commit::new(&a, checksum(b"bad"))),
        Err(PoolError::ChecksumMismatch)
    );
    assert_eq!(
        p.get(0, b"k", 0).unwrap(),
        b"old",
        "a failed commit leaves the old value"
    );
    let a = p.alloc(0, b"k", 3, false, 0).unwrap();
    p.write(&a, 1, b"ew").unwrap();
    p.write(&a, 0, b"n").unwrap();
    assert_eq!(p.write(&a, 2, b"xx"), Err(AddrFault::OutOfBounds.into()));
    p.commit(Commit::new(&a, checksum(b"new"))).unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), b"new");
    assert_eq!(
        p.write(&a, 0, b"x"),
        Err(AddrFault::NotWritable.into()),
        "committed objects are immutable"
    );
    assert_eq!(
        p.commit(Commit::new(&a, checksum(b"new"))),
        Err(AddrFault::NotWritable.into())
    );
    assert_eq!(p.stats().objects, 1);
}

#[test]
fn conditional_commits_check_presence_and_release_what_they_refuse() {
    let p = pool(4 << 20);
    let staged = |key: &[u8], v: &[u8]| {
        let a = p.alloc(0, key, v.len() as u64, false, 0).unwrap();
        p.write(&a, 0, v).unwrap();
        a
    };
    let used = p.stats().used_bytes();
    // Only if present: refused for a missing key, and its memory is given back.
    let a = staged(b"k", b"xx");
    assert_eq!(
        p.commit(Commit::new(&a, checksum(b"xx")).when_present(Some(true))),
        Ok(false)
    );
    assert_eq!(p.stats().used_bytes(), used);
    assert_eq!(p.get(0, b"k", 0), Err(PoolError::NotFound));
    // Only if absent: the first wins, the second is refused and the first value stays.
    let a = staged(b"k", b"v1");
    let b = staged(b"k", b"v2");
    assert_eq!(
        p.commit(Commit::new(&a, checksum(b"v1")).when_present(Some(false))),
        Ok(true)
    );
    assert_eq!(
        p.commit(Commit::new(&b, checksum(b"v2")).when_present(Some(false))),
        Ok(false)
    );
    assert_eq!(p.get(0, b"k", 0).unwrap(), b"v1");
    let a = staged(b"k", b"v3");
    assert_eq!(
        p.commit(Commit::new(&a, checksum(b"v3")).when_present(Some(true))),
        Ok(true)
    );
    assert_eq!(p.get(0, b"k", 0).unwrap(), b"v3");
    assert_eq!(p.stats().objects, 1);
}

#[test]
fn commit_all_is_all_or_nothing() {
    let p = pool(4 << 20);
    p.put(0, b"b", b"old", false, 0).unwrap();
    let used = p.stats().used_bytes();
    let stage = |key: &[u8], v: &[u8]| {
        let a = p.alloc(0, key, v.len() as u64, false, 0).unwrap();
        p.write(&a, 0, v).unwrap();
        (a, checksum(v))
    };
    // One bad checksum in the middle: nothing is committed, every allocation is released.
    let mut items = vec![stage(b"a", b"1"), stage(b"b", b"2"), stage(b"c", b"3")];
    items[1].1 ^= 1;
    assert_eq!(
        p.commit(Commit::all(&items)),
        Err(PoolError::ChecksumMismatch)
    );
    assert_eq!(p.stats().used_bytes(), used);
    assert_eq!(p.get(0, b"a", 0), Err(PoolError::NotFound));
    assert_eq!(p.get(0, b"b", 0).unwrap(), b"old");
    assert_eq!(p.get(0, b"c", 0), Err(PoolError::NotFound));
    // All good: all visible; a key given twice keeps its last value.
    let items: Vec<_> = (0..32u32)
        .map(|i| stage(format!("k{}", i % 30).as_bytes(), &value(i, 100)))
        .collect();
    p.commit(Commit::all(&items)).unwrap();
    for i in 0..30u32 {
        let last = if i < 2 { i + 30 } else { i };
        assert_eq!(
            p.get(0, format!("k{i}").as_bytes(), 0).unwrap(),
            value(last, 100)
        );
    }
    assert_eq!(p.stats().objects, 31);
}

#[test]
fn abandoned_allocations_are_reaped_after_their_deadline() {
    let p = pool(4 << 20);
    let a = p.alloc(0, b"k", 1000, false, 100).unwrap();
    assert_eq!(p.reap(100 + 29_999), 0);
    {
        let _w = p.begin_write(&a).unwrap();
        assert_eq!(p.reap(200_000), 0, "an open write keeps the allocation");
    }
    assert_eq!(p.reap(200_000), 1);
    assert_eq!(p.stats().used_bytes(), 0);
    assert_eq!(
        p.commit(Commit::new(&a, 0)),
        Err(AddrFault::NotWritable.into())
    );
}

#[test]
fn eviction_makes_room_lru_first() {
    let p = pool(2 << 20);
    for i in 0..100u32 {
        p.put(0, &i.to_le_bytes(), &value(i, 64 << 10), false, i as u64)
            .unwrap();
        // keep key 0 hot
        assert!(p.get_ref(0, &0u32.to_le_bytes(), i as u64).is_ok());
    }
    let s = p.stats();
    assert!(s.evictions >= 60, "{s:?}");
    assert!(s.used_bytes() <= s.capacity());
    assert_eq!(
        p.get(0, &0u32.to_le_bytes(), 0).unwrap(),
        value(0, 64 << 10)
    );
    assert_eq!(
        p.get(0, &99u32.to_le_bytes(), 0).unwrap(),
        value(99, 64 << 10)
    );
    assert_eq!(p.get(0, &1u32.to_le_bytes(), 0), Err(PoolError::NotFound));
}

/// Records what the pool shows it of its evictions.
#[derive(Default)]
struct Evictions(
    std::sync::Mutex<Vec<(u32, Vec<u8>, bool)>>,
    /// Victims whose bytes were handed over.
    std::sync::atomic::AtomicU64,
);

impl LowerTier for Evictions {
    fn evicting(&self, v: &Victim<'_>) -> Option<Claim> {
        let id = u32::from_le_bytes(v.key.try_into().unwrap());
        assert_eq!(v.len, 64 << 10);
        assert_eq!(v.checksum, checksum(&value_of(id)));
        self.0
            .lock()
            .unwrap()
            .push((v.ns, v.key.to_vec(), v.accessed));
        Some(Claim(u64::from(id)))
    }

    fn demote(&self, claim: Claim, value: &[u8]) {
        let id = u32::try_from(claim.0).unwrap();
        assert_eq!(value, value_of(id), "the victim's bytes, still in memory");
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn committed(&self, _: u32, _: &[u8], _: u64) {}

    fn removed(&self, _: u32, _: &[u8]) -> bool {
        false
    }

    fn holds(&self, _: u32, _: &[u8]) -> bool {
        false
    }

    fn removed_generation(&self, _: u32, _: &[u8], _: u64, _: Option<u64>) -> bool {
        false
    }
}

fn value_of(id: u32) -> Vec<u8> {
    value(id, 64 << 10)
}

#[test]
fn evictions_are_shown_with_their_bytes_before_they_are_freed() {
    let p = pool(2 << 20);
    let seen = Arc::new(Evictions::default());
    assert!(p.set_lower_tier(seen.clone()));
    assert!(!p.set_lower_tier(seen.clone()), "set once");
    for i in 0..100u32 {
        p.put(0, &i.to_le_bytes(), &value_of(i), false, 0).unwrap();
        if i % 2 == 0 {
            assert!(p.get_ref(0, &i.to_le_bytes(), 0).is_ok());
        }
    }
    p.remove(0, &99u32.to_le_bytes()).unwrap();
    let seen_all = seen.clone();
    let seen = seen.0.lock().unwrap();
    assert_eq!(
        seen.len() as u64,
        p.stats().evictions,
        "every eviction, and no removal"
    );
    assert!(seen.len() >= 60);
    let handed = p.stats().evictions;
    assert_eq!(
        seen_all.1.load(std::sync::atomic::Ordering::Relaxed),
        handed
    );
    for (ns, key, accessed) in seen.iter() {
        let id = u32::from_le_bytes(key[..].try_into().unwrap());
        assert_eq!((*ns, *accessed), (0, id % 2 == 0), "key {id}");
    }
}

#[test]
fn pins_survive_pressure_and_a_pool_of_pins_is_full() {
    let p = pool(1 << 20);
    p.put(0, b"pinned", &value(7, 64 << 10), true, 0).unwrap();
    for i in 0..64u32 {
        p.put(0, &i.to_le_bytes(), &value(i, 64 << 10), false, 0)
            .unwrap();
    }
    assert_eq!(p.get(0, b"pinned", 0).unwrap(), value(7, 64 << 10));
    assert_eq!(p.stats().namespaces[0].pinned_bytes, 64 << 10);
    // `small` reserves 256 KiB of the 1 MiB, so `default` holds at most 12 blocks.
    for i in 0..11u32 {
        p.put(0, &(1000 + i).to_le_bytes(), &value(i, 64 << 10), true, 0)
            .unwrap();
    }
    assert_eq!(
        p.put(0, b"one more", &value(0, 64 << 10), false, 0),
        Err(PoolError::PoolFull)
    );
    assert!(p.set_pinned(0, b"pinned", false).unwrap());
    p.put(0, b"one more", &value(0, 64 << 10), false, 0)
        .unwrap();
    assert_eq!(
        p.get(0, b"pinned", 0),
        Err(PoolError::NotFound),
        "unpinned, it was the only victim"
    );
}

#[test]
fn leases_hold_off_eviction_until_they_end() {
    let p = pool(1 << 20);
    p.put(0, b"leased", &value(1, 512 << 10), false, 0).unwrap();
    let loc = p.lookup(0, b"leased", 1_000, 0).unwrap().unwrap();
    assert_eq!(
        p.put(0, b"big", &value(2, 768 << 10), false, 10),
        Err(PoolError::PoolFull)
    );
    let mut buf = vec![0; 512 << 10];
    p.read(&loc.addr, 0, &mut buf).unwrap();
    assert_eq!(buf, value(1, 512 << 10));
    p.put(0, b"big", &value(2, 768 << 10), false, 1_000)
        .unwrap();
    assert_eq!(p.read(&loc.addr, 0, &mut buf), Err(AddrFault::Stale.into()));
}

#[test]
fn quotas_evict_within_their_namespace_only() {
    let p = pool(4 << 20);
    p.put(0, b"other", &value(3, 64 << 10), false, 0).unwrap();
    for i in 0..10u32 {
        p.put(1, &i.to_le_bytes(), &value(i, 64 << 10), false, 0)
            .unwrap();
    }
    let s = p.stats();
    assert!(s.namespaces[1].used_bytes <= 256 << 10);
    assert_eq!(s.namespaces[1].objects, 4);
    assert!(p.get(0, b"other", 0).is_ok());
    p.put(1, b"pin", &value(0, 64 << 10), true, 0).unwrap();
    let mut pinned = 1;
    for i in 0..10u32 {
        pinned += p.set_pinned(1, &i.to_le_bytes(), true).unwrap() as usize;
    }
    assert_eq!(pinned, 4, "sharded LRU kept some three of the ten");
    assert_eq!(
        p.put(1, b"x", &value(0, 64 << 10), false, 0),
        Err(PoolError::QuotaExceeded)
    );
}

#[test]
fn namespaces_are_disjoint() {
    let p = pool(4 << 20);
    p.put(0, b"k", b"zero", false, 0).unwrap();
    p.put(1, b"k", b"one", false, 0).unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), b"zero");
    assert_eq!(p.get(1, b"k", 0).unwrap(), b"one");
    p.remove(1, b"k").unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), b"zero");
    assert_eq!(p.namespace_id("small"), Some(1));
    assert_eq!(p.namespace_id("nope"), None);
}

#[test]
fn removed_objects_stay_readable_until_their_readers_leave() {
    let p = pool(1 << 20);
    let v = value(5, 300 << 10);
    p.put(0, b"k", &v, false, 0).unwrap();
    let r = p.get_ref(0, b"k", 0).unwrap();
    p.put(0, b"k", &value(6, 300 << 10), false, 0).unwrap(); // replaced
    assert!(p.remove(0, b"k").unwrap());
    // Under pressure the zombie's memory can't be taken.
    for i in 0..8u32 {
        let _ = p.put(0, &i.to_le_bytes(), &value(i, 300 << 10), false, 0);
    }
    assert_eq!(r.bytes(), &v[..]);
    let used_before = p.stats().used_bytes();
    drop(r);
    assert!(
        p.stats().used_bytes() < used_before,
        "the last reader frees the zombie"
    );
}

#[test]
fn a_prehashed_commit_compares_the_writer_s_hash_with_the_checksum_given() {
    let p = pool(1 << 20);
    let v = value(3, 100 << 10);
    let used = p.stats().used_bytes();
    let a = p.alloc(0, b"k", v.len() as u64, false, 0).unwrap();
    p.write(&a, 0, &v).unwrap();
    assert_eq!(
        p.commit(Commit::prehashed(&a, checksum(&v), checksum(&v) ^ 1)),
        Err(PoolError::ChecksumMismatch)
    );
    assert_eq!(
        p.stats().used_bytes(),
        used,
        "a refused commit releases the allocation"
    );
    assert!(p.get(0, b"k", 0).is_err());
    let a = p.alloc(0, b"k", v.len() as u64, false, 0).unwrap();
    p.write(&a, 0, &v).unwrap();
    p.commit(Commit::prehashed(&a, checksum(&v), checksum(&v)))
        .unwrap();
    assert_eq!(p.get(0, b"k", 0).unwrap(), v);
    assert!(
        p.commit(Commit::prehashed(&a, checksum(&v), checksum(&v)))
            .is_err(),
        "committed once only"
    );
}

#[test]
fn held_objects_keep_their_memory_until_every_hold_ends() {
    let p = pool(1 << 20);
    let v = value(7, 300 << 10);
    p.put(0, b"k", &v, false, 0).unwrap();
    let a = p.hold(0, b"k").unwrap().expect("present").addr;
    let b = p.hold(0, b"k").unwrap().expect("present").addr;
    assert_eq!(a.generation, b.generation);
    assert_eq!(p.hold(0, b"absent").unwrap(), None);
    // Eviction passes it by, a removal parks it: its bytes stay where the holder maps them.
    for i in 0..8u32 {
        let _ = p.put(0, &i.to_le_bytes(), &value(i, 300 << 10), false, 0);
    }
    assert!(p.remove(0, b"k").unwrap());
    for i in 8..16u32 {
        let _ = p.put(0, &i.to_le_bytes(), &value(i, 300 << 10), false, 0);
    }
    let mut buf = vec![0u8; v.len()];
    p.read(&a, 0, &mut buf).unwrap();
    assert_eq!(buf, v);
    let used = p.stats().used_bytes();
    p.unhold(0, b"k", a.generation).unwrap();
    p.read(&a, 0, &mut buf).unwrap();
    assert_eq!(p.stats().used_bytes(), used, "one hold is left");
    p.unhold(0, b"k", a.generation).unwrap();
    assert!(p.stats().used_bytes() < used, "the last hold frees it");
    assert!(p.read(&a, 0, &mut buf).is_err(), "and its address is stale");
}

#[test]
fn one_sided_reads_check_key_bounds_and_generation() {
    let p = pool(4 << 20);
    let v = value(9, 4096);
    let a = p.put(0, b"k", &v, false, 0).unwrap();
    let mut buf = vec![0u8; 100];
    p.read(&a, 1000, &mut buf).unwrap();
    assert_eq!(buf, &v[1000..1100]);
    let e = |f: AddrFault| Err(PoolError::BadAddress(f));
    assert_eq!(
        p.read(
            &GlobalAddr {
                key: a.key ^ 1,
                ..a
            },
            0,
            &mut buf
        ),
        e(AddrFault::WrongKey)
    );
    assert_eq!(
        p.read(
            &GlobalAddr {
                len: a.len + 100,
                ..a
            },
            0,
            &mut buf
        ),
        e(AddrFault::WrongKey)
    );
    assert_eq!(p.read(&a, 4000, &mut buf), e(AddrFault::OutOfBounds));
    assert_eq!(
        p.read(
            &GlobalAddr {
                node: NodeId(5),
                ..a
            },
            0,
            &mut buf
        ),
        e(AddrFault::WrongNode)
    );
    assert_eq!(
        p.read(&GlobalAddr { segment: 9, ..a }, 0, &mut buf),
        e(AddrFault::NoSegment)
    );
    p.remove(0, b"k").unwrap();
    assert_eq!(p.read(&a, 0, &mut buf), e(AddrFault::Stale));
    let b = p.put(0, b"k2", &value(1, 4096), false, 0).unwrap();
    assert_eq!(b.offset, a.offset, "same block reused");
    assert_eq!(
        p.read(&a, 0, &mut buf),
        e(AddrFault::Stale),
        "a reused block is not the old object"
    );
    let pending = p.alloc(0, b"k3", 10, false, 0).unwrap();
    assert_eq!(
        p.read(&pending, 0, &mut buf[..10]),
        e(AddrFault::Stale),
        "pending objects are unreadable"
    );
}

#[test]
fn addresses_of_another_incarnation_are_refused() {
    // Two lives of the same node on the same memory layout: the restarted one hands out the
    // same segment and offset, but never an address the first one's holders could use.
    let first = pool(4 << 20);
    let second = Pool::new(&cfg(4 << 20), [10; 16]).unwrap();
    assert!(first.incarnation() != 0 && second.incarnation() != 0);
    assert_ne!(first.incarnation(), second.incarnation());
    let a = first.put(0, b"k", &value(1, 4096), false, 0).unwrap();
    let b = second.put(0, b"k", &value(2, 4096), false, 0).unwrap();
    assert_eq!((a.segment, a.offset), (b.segment, b.offset), "same place");
    assert_eq!(a.incarnation, first.incarnation());
    assert_eq!(b.incarnation, second.incarnation());
    assert_ne!(a.generation, b.generation, "generations start apart");
    let mut buf = vec![0u8; 16];
    let wrong = Err(PoolError::BadAddress(AddrFault::WrongIncarnation));
    assert_eq!(second.read(&a, 0, &mut buf), wrong);
    assert_eq!(second.verify_addr(&a), wrong);
    assert_eq!(second.write(&a, 0, &buf), wrong);
    assert_eq!(second.commit(Commit::new(&a, 0)).map(drop), wrong);
    // Restamping the incarnation breaks the memory key.
    let forged = GlobalAddr {
        incarnation: second.incarnation(),
        ..a
    };
    assert_eq!(
        second.read(&forged, 0, &mut buf),
        Err(PoolError::BadAddress(AddrFault::WrongKey))
    );
    second.read(&b, 0, &mut buf).unwrap();
    assert_eq!(buf, value(2, 16));
}

#[test]
fn exists_prefix_counts_the_leading_run() {
    let p = pool(4 << 20);
    for k in [b"a", b"b", b"d"] {
        p.put(0, k, b"v", false, 0).unwrap();
    }
    let keys: [&[u8]; 4] = [b"a", b"b", b"c", b"d"];
    assert_eq!(p.exists_prefix(0, keys), Ok(2));
    assert_eq!(p.exists_prefix(0, [&b"c"[..]]), Ok(0));
    assert_eq!(
        p.exists_prefix(0, [&b"a"[..], &b""[..]]),
        Err(PoolError::BadKey)
    );
}

#[test]
fn file_backed_pools_publish_their_segments() {
    let dir = std::env::temp_dir().join(format!("kvpool-pool-test-{}", std::process::id()));
    let c = PoolConfig {
        backing: Backing::File(dir.clone()),
        segments: 2,
        ..cfg(2 << 20)
    };
    let p = Pool::new(&c, [1; 16]).unwrap();
    let paths: Vec<_> = p
        .segments()
        .map(|s| s.path().unwrap().to_path_buf())
        .collect();
    assert_eq!(paths.len(), 2);
    assert!(paths.iter().all(|p| p.exists()));
    p.put(0, b"kept", b"across a clean stop", false, 0).unwrap();
    // A clean stop keeps the files (retired) for the next life, which recovers the object.
    drop(p);
    assert!(paths.iter().all(|p| p.exists()));
    let p = Pool::new(&c, [2; 16]).unwrap();
    assert_eq!(p.recovery().recovered, 1);
    assert_eq!(p.get(0, b"kept", 0).unwrap(), b"across a clean stop");
    drop(p);
    let _ = std::fs::remove_dir_all(dir);
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, u16),
    Get(u8),
    Remove(u8),
    Exists(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..32, 0u16..5000).prop_map(|(k, l)| Op::Put(k, l)),
        (0u8..32).prop_map(Op::Get),
        (0u8..32).prop_map(Op::Remove),
        (0u8..32).prop_map(Op::Exists),
    ]
}

proptest! {
    /// With room for everything, the pool behaves exactly like a map, and its accounting is
    /// exact after every operation.
    #[test]
    fn behaves_like_a_map(ops in proptest::collection::vec(op(), 1..200)) {
        let p = pool(8 << 20);
        let mut model: HashMap<u8, Vec<u8>> = HashMap::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Put(k, l) => {
                    let v = value(i as u32, l as usize);
                    p.put(0, &[k], &v, false, 0).unwrap();
                    model.insert(k, v);
                }
                Op::Get(k) => prop_assert_eq!(p.get(0, &[k], 0).ok(), model.get(&k).cloned()),
                Op::Remove(k) => prop_assert_eq!(p.remove(0, &[k]).unwrap(), model.remove(&k).is_some()),
                Op::Exists(k) => prop_assert_eq!(p.exists_prefix(0, [&[k][..]]).unwrap(), model.contains_key(&k) as usize),
            }
            let s = p.stats();
            prop_assert_eq!(s.objects, model.len() as u64);
            let reserved: u64 = model.values().map(|v| p.alloc_lock(0).reserved_size(v.len() as u64).unwrap()).sum();
            prop_assert_eq!(s.used_bytes(), reserved);
            prop_assert_eq!(s.namespaces[0].used_bytes, reserved);
        }
    }
}

/// Hits of a namespace of `capacity` small objects in a pool of `shards` index shards, over
/// a skewed set of recurring keys mixed with keys seen once.
fn hits_with_shards(policy: PolicyKind, shards: usize, capacity: u64) -> u64 {
    let len = 512;
    let reserved = crate::alloc::Allocator::new(8 << 20, AllocConfig::default())
        .unwrap()
        .reserved_size(len)
        .unwrap();
    let c = PoolConfig {
        shards,
        namespaces: vec![NamespaceConfig {
            name: DEFAULT_NAMESPACE.into(),
            quota_bytes: Some(capacity * reserved),
            eviction: policy,
            own_segment: false,
        }],
        ..cfg(8 << 20)
    };
    let p = Pool::new(&c, [3; 16]).unwrap();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut fresh = 1u64 << 40;
    let mut hits = 0;
    for _ in 0..30_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = if x % 3 == 0 {
            fresh += 1;
            fresh
        } else {
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            (u * u * 2000.0) as u64
        };
        match p.get_ref(0, &key.to_le_bytes(), 0) {
            Ok(_) => hits += 1,
            Err(_) => {
                let v = value(key as u32, len as usize);
                p.put(0, &key.to_le_bytes(), &v, false, 0).unwrap();
            }
        }
    }
    hits
}

#[test]
fn shards_of_one_namespace_evict_as_one_policy() {
    // Each of 32 shards holds about 8 of the 250 objects: alone, its S3-FIFO would adapt on a
    // handful of ghost hits and evict from its own queues out of step with the others.
    let capacity = 250;
    for policy in PolicyKind::ALL {
        let one = hits_with_shards(policy, 1, capacity);
        let many = hits_with_shards(policy, 32, capacity);
        println!("{policy}: 1 shard {one}, 32 shards {many}");
        assert!(
            many + 30_000 / 100 >= one,
            "{policy}: 32 shards hit {many}, one shard {one}"
        );
    }
}

#[test]
fn unpinned_objects_come_hottest_first_without_the_pinned() {
    for policy in PolicyKind::ALL {
        let c = PoolConfig {
            namespaces: vec![NamespaceConfig {
                eviction: policy,
                ..NamespaceConfig::unlimited(DEFAULT_NAMESPACE)
            }],
            ..cfg(4 << 20)
        };
        let p = Pool::new(&c, [1; 16]).unwrap();
        p.put(0, b"pinned", &value(0, 100), true, 0).unwrap();
        for i in 0..8u32 {
            p.put(0, &i.to_le_bytes(), &value(i, 100 + i as usize), false, 0)
                .unwrap();
        }
        // Keys 5 and 2 read again, 2 last: the two hottest.
        for _ in 0..2 {
            p.get(0, &5u32.to_le_bytes(), 0).unwrap();
            p.get(0, &2u32.to_le_bytes(), 0).unwrap();
        }
        let all = p.unpinned_objects(0, |_| true).unwrap();
        assert_eq!(
            all.len(),
            8,
            "{policy}: every unpinned object, no pinned one"
        );
        let first: BTreeSetOf = all[..2].iter().map(|u| u.key.clone()).collect();
        let want: BTreeSetOf = [2u32, 5].iter().map(|i| i.to_le_bytes().to_vec()).collect();
        assert_eq!(first, want, "{policy}: the objects read again come first");
        for u in &all {
            let i = u32::from_le_bytes(u.key[..4].try_into().unwrap());
            assert_eq!(u.len, 100 + u64::from(i));
            assert_eq!(
                Some((u.generation, false)),
                p.provenance(0, &u.key).unwrap()
            );
        }
        let picked = p.unpinned_objects(0, |k| k[0] % 2 == 0).unwrap();
        assert_eq!(picked.len(), 4, "{policy}: only what pick accepts");
    }
}

type BTreeSetOf = std::collections::BTreeSet<Vec<u8>>;
