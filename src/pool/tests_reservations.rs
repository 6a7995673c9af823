//! Quotas are reservations: checked against a model under random operations.

use std::io;

use proptest::prelude::*;

use super::*;
use crate::checksum::checksum;
use crate::eviction::PolicyKind;
use crate::segment::{Backing, HugePages};

const BLOCK: u64 = 64 << 10;

/// `default` and `c` share the memory nobody reserved; `a` and `b` reserve theirs, `b` as a
/// segment of its own (so the model holds for both kinds of reservation).
fn pool() -> Pool {
    let ns = |name: &str, quota: Option<u64>| NamespaceConfig {
        name: name.into(),
        quota_bytes: quota,
        eviction: PolicyKind::Lru,
        own_segment: name == "b",
    };
    let cfg = PoolConfig {
        segment_size: 2 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        shards: 4,
        namespaces: vec![
            ns(DEFAULT_NAMESPACE, None),
            ns("a", Some(8 * BLOCK)),
            ns("b", Some(12 * BLOCK)),
            ns("c", None),
        ],
        ..PoolConfig::default()
    };
    Pool::new(&cfg, [3; 16]).unwrap()
}

const RESERVED: [bool; 4] = [false, true, true, false];

#[derive(Clone, Debug)]
enum Op {
    /// Put a fresh key (one block), pinned or not.
    Put { ns: u32, pin: bool },
    /// Allocate a fresh key and leave it pending.
    Alloc { ns: u32, pin: bool },
    /// Commit the oldest pending allocation.
    Commit,
    /// Abort the oldest pending allocation.
    Abort,
    /// Unpin one of a namespace's pinned objects.
    Unpin { ns: u32, pick: usize },
    /// Remove one of a namespace's objects.
    Remove { ns: u32, pick: usize },
    /// Cancel one of a namespace's keys, pending or committed, pinned or not.
    Cancel { ns: u32, pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let ns = 0..4u32;
    prop_oneof![
        6 => (ns.clone(), any::<bool>()).prop_map(|(ns, pin)| Op::Put { ns, pin }),
        2 => (ns.clone(), any::<bool>()).prop_map(|(ns, pin)| Op::Alloc { ns, pin }),
        1 => Just(Op::Commit),
        1 => Just(Op::Abort),
        1 => (ns.clone(), any::<usize>()).prop_map(|(ns, pick)| Op::Unpin { ns, pick }),
        1 => (ns.clone(), any::<usize>()).prop_map(|(ns, pick)| Op::Remove { ns, pick }),
        1 => (ns, any::<usize>()).prop_map(|(ns, pick)| Op::Cancel { ns, pick }),
    ]
}

/// What the pool must hold, per namespace.
#[derive(Default)]
struct Model {
    /// Pinned objects: never evicted.
    pinned: [Vec<Vec<u8>>; 4],
    /// Unpinned objects: present unless evicted for their own namespace (or, for namespaces
    /// without a reservation, for another such namespace).
    unpinned: [Vec<Vec<u8>>; 4],
    /// Pending allocations, oldest first: (namespace, key, pin, address).
    pending: Vec<(u32, Vec<u8>, bool, GlobalAddr)>,
}

impl Model {
    /// Blocks held by `ns` that no eviction can free (pinned and pending).
    fn held(&self, ns: usize) -> u64 {
        self.pinned[ns].len() as u64
            + self.pending.iter().filter(|p| p.0 as usize == ns).count() as u64
    }

    /// Whether an allocation of one more block for `ns` must succeed (it fails exactly when
    /// not): within a reservation, or within the unreserved memory with every sharer.
    fn fits(&self, ns: usize, quota: u64, unreserved: u64) -> bool {
        if RESERVED[ns] {
            (self.held(ns) + 1) * BLOCK <= quota
        } else {
            let shared: u64 = (0..4).filter(|&n| !RESERVED[n]).map(|n| self.held(n)).sum();
            (shared + 1) * BLOCK <= unreserved
        }
    }

    fn refused(ns: usize) -> PoolError {
        if RESERVED[ns] {
            PoolError::QuotaExceeded
        } else {
            PoolError::PoolFull
        }
    }
}

fn present(p: &Pool, ns: u32, key: &[u8]) -> bool {
    p.exists_prefix(ns, [key]).unwrap() == 1
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn reservations_hold_against_every_other_namespace(ops in proptest::collection::vec(op(), 1..300)) {
        let p = pool();
        let s = p.stats();
        let quotas: Vec<u64> = s.namespaces.iter().map(|n| n.quota_bytes).collect();
        let unreserved = s.capacity() - 20 * BLOCK;
        prop_assert_eq!(quotas[0], unreserved, "default's limit is the unreserved memory");
        let mut m = Model::default();
        let mut next = 0u32;
        for (now, op) in ops.into_iter().enumerate() {
            let now = now as u64;
            let mut fresh = || { next += 1; next.to_le_bytes().to_vec() };
            let acted = match op {
                Op::Put { ns, pin } => {
                    let n = ns as usize;
                    let key = fresh();
                    let fits = m.fits(n, quotas[n], unreserved);
                    let r = p.put(ns, &key, &[ns as u8; BLOCK as usize], pin, now);
                    if fits {
                        prop_assert!(r.is_ok(), "{:?} within its limit: {:?}", op, r);
                        if pin { m.pinned[n].push(key) } else { m.unpinned[n].push(key) }
                    } else {
                        prop_assert_eq!(r.err(), Some(Model::refused(n)));
                    }
                    Some(n)
                }
                Op::Alloc { ns, pin } => {
                    let n = ns as usize;
                    let key = fresh();
                    let fits = m.fits(n, quotas[n], unreserved);
                    match p.alloc(ns, &key, BLOCK, pin, now) {
                        Ok(a) => {
                            prop_assert!(fits);
                            m.pending.push((ns, key, pin, a));
                        }
                        Err(e) => {
                            prop_assert!(!fits, "{:?}", e);
                            prop_assert_eq!(e, Model::refused(n));
                        }
                    }
                    Some(n)
                }
                Op::Commit | Op::Abort if m.pending.is_empty() => None,
                Op::Commit => {
                    let (ns, key, pin, a) = m.pending.remove(0);
                    let v = vec![ns as u8; BLOCK as usize];
                    p.write(&a, 0, &v).unwrap();
                    p.commit(Commit::new(&a, checksum(&v))).unwrap();
                    let n = ns as usize;
                    if pin { m.pinned[n].push(key) } else { m.unpinned[n].push(key) }
                    None
                }
                Op::Abort => {
                    let (_, _, _, a) = m.pending.remove(0);
                    p.abort(&a).unwrap();
                    None
                }
                Op::Unpin { ns, pick } => {
                    let n = ns as usize;
                    if !m.pinned[n].is_empty() {
                        let key = m.pinned[n].swap_remove(pick % m.pinned[n].len());
                        prop_assert!(p.set_pinned(ns, &key, false).unwrap());
                        m.unpinned[n].push(key);
                    }
                    None
                }
                Op::Remove { ns, pick } => {
                    let n = ns as usize;
                    if !m.unpinned[n].is_empty() {
                        let key = m.unpinned[n].swap_remove(pick % m.unpinned[n].len());
                        let _ = p.remove(ns, &key).unwrap();
                    }
                    None
                }
                Op::Cancel { ns, pick } => {
                    let n = ns as usize;
                    let mine: Vec<usize> = (0..m.pending.len()).filter(|&i| m.pending[i].0 == ns).collect();
                    let all = mine.len() + m.pinned[n].len() + m.unpinned[n].len();
                    if all > 0 {
                        let i = pick % all;
                        let key = if i < mine.len() {
                            m.pending.remove(mine[i]).1
                        } else if i < mine.len() + m.pinned[n].len() {
                            m.pinned[n].swap_remove(i - mine.len())
                        } else {
                            m.unpinned[n].swap_remove(i - mine.len() - m.pinned[n].len())
                        };
                        prop_assert_eq!(p.cancel(ns, &[&key]), Ok(1));
                        prop_assert!(!present(&p, ns, &key));
                    }
                    None
                }
            };
            // Who may have lost unpinned objects to this operation: the namespace that
            // allocated, and, if it has no reservation, the others without one.
            for (n, &reserved) in RESERVED.iter().enumerate() {
                for key in &m.pinned[n] {
                    prop_assert!(present(&p, n as u32, key), "pinned object of {} gone", n);
                }
                let may_lose = acted.is_some_and(|a| a == n || (!RESERVED[a] && !reserved));
                if may_lose {
                    m.unpinned[n].retain(|k| present(&p, n as u32, k));
                }
                for key in &m.unpinned[n] {
                    prop_assert!(present(&p, n as u32, key), "object of {} evicted for another namespace", n);
                }
            }
            let s = p.stats();
            for (ns, &quota) in s.namespaces.iter().zip(&quotas) {
                prop_assert!(ns.used_bytes <= quota);
            }
            let shared: u64 = (0..4).filter(|&n| !RESERVED[n]).map(|n| s.namespaces[n].used_bytes).sum();
            prop_assert!(shared <= unreserved);
        }
    }
}

#[test]
fn reservations_beyond_the_pool_are_refused_at_start() {
    let cfg = PoolConfig {
        segment_size: 2 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        namespaces: vec![
            NamespaceConfig {
                quota_bytes: Some(1 << 20),
                ..NamespaceConfig::unlimited("a")
            },
            NamespaceConfig {
                quota_bytes: Some((1 << 20) + 1),
                ..NamespaceConfig::unlimited("b")
            },
        ],
        ..PoolConfig::default()
    };
    let e = Pool::new(&cfg, [0; 16]).err().expect("over-reserved");
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("reserve more than"), "{e}");
}

/// In the pool: filling and pinning `default`, and leaving allocations of
/// another tenant pending, never costs `b` its objects or its puts.
#[test]
fn default_and_pending_allocations_leave_a_reservation_alone() {
    let p = pool();
    let v = vec![7u8; BLOCK as usize];
    for i in 0..6u32 {
        p.put(2, &i.to_le_bytes(), &v, false, 0).unwrap();
    }
    // Write far more than the pool into default.
    for i in 0..100u32 {
        p.put(0, &i.to_le_bytes(), &v, false, 0).unwrap();
    }
    for i in 0..6u32 {
        assert_eq!(
            p.get(2, &i.to_le_bytes(), 0).unwrap(),
            v,
            "b keeps its objects"
        );
    }
    // Pin all of default's share, and leave `a`'s whole reservation pending.
    let mut pinned = 0;
    for i in 1000..1100u32 {
        match p.put(0, &i.to_le_bytes(), &v, true, 0) {
            Ok(_) => pinned += 1,
            Err(e) => {
                assert_eq!(e, PoolError::PoolFull);
                break;
            }
        }
    }
    assert!(pinned >= 12, "{pinned}");
    for i in 0..8u32 {
        p.alloc(1, &i.to_le_bytes(), BLOCK, false, 0).unwrap();
    }
    assert_eq!(
        p.alloc(1, b"more", BLOCK, false, 0),
        Err(PoolError::QuotaExceeded)
    );
    // b still has its reservation: 12 blocks, new ones evicting only its own.
    for i in 100..130u32 {
        p.put(2, &i.to_le_bytes(), &v, false, 0)
            .unwrap_or_else(|e| panic!("b's put {i}: {e}"));
    }
    assert_eq!(p.stats().namespaces[2].objects, 12);
}

/// A namespace with a segment of its own allocates only there, and nobody else does; the
/// common segments hold what is left of the pool's memory.
#[test]
fn own_segments_hold_their_namespace_only() {
    let own = |name: &str, quota: u64| NamespaceConfig {
        quota_bytes: Some(quota),
        own_segment: true,
        ..NamespaceConfig::unlimited(name)
    };
    let cfg = PoolConfig {
        segment_size: 1 << 20,
        segments: 2,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        // 100 KiB rounds up to two pages.
        namespaces: vec![
            own("a", 4 * BLOCK),
            own("b", 100 << 10),
            NamespaceConfig::unlimited("c"),
        ],
        ..PoolConfig::default()
    };
    let p = Pool::new(&cfg, [5; 16]).unwrap();
    let (a, b) = (p.namespace_id("a").unwrap(), p.namespace_id("b").unwrap());
    let sizes: Vec<u64> = p.segments().map(|s| s.data_len()).collect();
    assert_eq!(
        sizes,
        [
            (1 << 20) - 3 * BLOCK,
            (1 << 20) - 3 * BLOCK,
            4 * BLOCK,
            2 * BLOCK
        ]
    );
    assert_eq!(
        (0..4).map(|s| p.segment_owner(s)).collect::<Vec<_>>(),
        [None, None, Some(a), Some(b)]
    );
    assert_eq!(p.common_namespaces().collect::<Vec<_>>(), [0, 3]);
    // Each namespace's objects land in its segments, whoever fills the pool meanwhile.
    for i in 0..64u32 {
        for ns in [0, a, b, 3] {
            let addr = p
                .put(ns, &i.to_le_bytes(), &[ns as u8; 20 << 10], false, i as u64)
                .unwrap();
            let owner = p.segment_owner(addr.segment);
            assert_eq!(owner, (ns == a || ns == b).then_some(ns), "ns {ns}");
        }
    }
    let s = p.stats();
    assert!(s.namespaces[a as usize].used_bytes <= 4 * BLOCK);
    assert!(s.namespaces[b as usize].used_bytes <= 2 * BLOCK);
    // A value larger than the namespace's segment is too large for it, not for the pool.
    assert_eq!(
        p.put(b, b"big", &vec![0; 3 * BLOCK as usize], false, 99)
            .err(),
        Some(PoolError::TooLarge)
    );
    p.put(0, b"big", &vec![0; 3 * BLOCK as usize], false, 99)
        .unwrap();
}

#[test]
fn own_segments_need_a_quota_and_room() {
    let base = PoolConfig {
        segment_size: 1 << 20,
        backing: Backing::Anonymous,
        huge_pages: HugePages::Off,
        ..PoolConfig::default()
    };
    let no_quota = PoolConfig {
        namespaces: vec![NamespaceConfig {
            own_segment: true,
            ..NamespaceConfig::unlimited("a")
        }],
        ..base.clone()
    };
    let e = Pool::new(&no_quota, [0; 16]).err().expect("no quota");
    assert!(e.to_string().contains("no quota"), "{e}");
    let all = PoolConfig {
        namespaces: vec![NamespaceConfig {
            quota_bytes: Some(1 << 20),
            own_segment: true,
            ..NamespaceConfig::unlimited("a")
        }],
        ..base
    };
    let e = Pool::new(&all, [0; 16]).err().expect("nothing left");
    assert!(e.to_string().contains("leave nothing"), "{e}");
}
