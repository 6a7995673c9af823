use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn ins(fp: u64) -> Insert {
    Insert {
        fingerprint: fp,
        depth: 0,
        tick: 0,
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert,
    Access(usize),
    Remove(usize),
    /// Victim, with objects whose handle is divisible by `n` refused.
    Victim(u32),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(
        prop_oneof![
            3 => Just(Op::Insert),
            2 => (0usize..64).prop_map(Op::Access),
            1 => (0usize..64).prop_map(Op::Remove),
            2 => (2u32..6).prop_map(Op::Victim),
        ],
        1..400,
    )
}

proptest! {
    /// Every policy holds exactly the objects inserted and not yet removed or evicted, never
    /// evicts what it was told it may not, and never hands out an object twice.
    #[test]
    fn policies_track_exactly_their_objects(ops in ops(), which in 0usize..3) {
        let mut p = PolicyKind::ALL[which].build();
        let mut live: BTreeSet<u32> = BTreeSet::new();
        let mut free: Vec<u32> = Vec::new();
        let mut next = 0u32;
        for op in ops {
            match op {
                Op::Insert => {
                    let h = free.pop().unwrap_or_else(|| { next += 1; next - 1 });
                    p.insert(h, Insert { fingerprint: h as u64 * 31 % 7, depth: h % 5, tick: 0 });
                    live.insert(h);
                }
                Op::Access(i) => {
                    if let Some(&h) = live.iter().nth(i % live.len().max(1)) {
                        p.access(h, 0);
                    }
                }
                Op::Remove(i) => {
                    if let Some(&h) = live.iter().nth(i % live.len().max(1)) {
                        p.remove(h);
                        live.remove(&h);
                        free.push(h);
                    }
                }
                Op::Victim(n) => {
                    let v = p.victim(&mut |h| h % n != 0, 0);
                    if let Some(h) = v {
                        prop_assert!(h % n != 0, "evicted a protected object");
                        prop_assert!(live.remove(&h), "evicted an object it did not hold");
                        free.push(h);
                    } else {
                        // Nothing evictable within the scan budget: there may be evictable
                        // objects beyond it, but not among few objects.
                        prop_assert!(live.len() > SCAN || live.iter().all(|h| h % n == 0), "{live:?}");
                    }
                }
            }
            prop_assert_eq!(p.len(), live.len());
        }
        // Drain: everything comes out exactly once.
        let mut out = BTreeSet::new();
        while let Some(h) = p.victim(&mut |_| true, 0) {
            prop_assert!(out.insert(h));
        }
        prop_assert_eq!(out, live);
    }
}

#[test]
fn lru_evicts_least_recent_and_skips_protected() {
    let mut p = Lru::default();
    for h in 0..4 {
        p.insert(h, ins(h as u64));
    }
    p.access(0, 9);
    assert_eq!(p.victim(&mut |_| true, 0), Some(1));
    assert_eq!(p.victim(&mut |h| h != 2, 0), Some(3));
    assert_eq!(
        p.victim(&mut |_| true, 0),
        Some(0),
        "2 was moved to the hot end when skipped"
    );
    assert_eq!(p.victim(&mut |_| false, 0), None);
    assert_eq!(p.len(), 1);
}

#[test]
fn prefix_aware_shrinks_chains_from_their_end() {
    let mut p = PrefixAware::default();
    // A chain of 4 blocks, touched head first like a request does.
    for h in 0..4 {
        p.insert(
            h,
            Insert {
                fingerprint: h as u64,
                depth: h,
                tick: h as u64,
            },
        );
    }
    assert_eq!(p.victim(&mut |_| true, 0), Some(3));
    assert_eq!(p.victim(&mut |_| true, 0), Some(2));
    let mut lru = Lru::default();
    for h in 0..4 {
        lru.insert(h, ins(h as u64));
    }
    assert_eq!(
        lru.victim(&mut |_| true, 0),
        Some(0),
        "plain LRU loses the head, killing the chain"
    );
}

#[test]
fn s3fifo_resists_scans() {
    // 100 objects read over and over, then a scan of 10 000 objects seen once: the hot set
    // survives in the main FIFO while the scan churns through the small one.
    let mut p = S3Fifo::default();
    let capacity = 200;
    let mut resident = BTreeSet::new();
    let mut next = 0u32;
    let mut handle_of = std::collections::HashMap::new();
    let mut touch = |p: &mut S3Fifo, key: u64, resident: &mut BTreeSet<u32>| {
        if let Some(&h) = handle_of.get(&key) {
            if resident.contains(&h) {
                p.access(h, 0);
                return;
            }
        }
        if resident.len() >= capacity {
            let v = p.victim(&mut |_| true, 0).unwrap();
            resident.remove(&v);
        }
        let h = next;
        next += 1;
        handle_of.insert(key, h);
        p.insert(h, ins(key));
        resident.insert(h);
    };
    for _ in 0..5 {
        for k in 0..100 {
            touch(&mut p, k, &mut resident);
        }
    }
    for k in 1000..11_000 {
        touch(&mut p, k, &mut resident);
    }
    let hot_left = (0..100u64)
        .filter(|k| resident.contains(&handle_of[k]))
        .count();
    assert!(
        hot_left >= 90,
        "only {hot_left} of the hot set survived the scan"
    );
}

#[test]
fn names_round_trip() {
    for k in PolicyKind::ALL {
        assert_eq!(k.name().parse::<PolicyKind>(), Ok(k));
    }
    assert!("mru".parse::<PolicyKind>().is_err());
    assert_eq!(PolicyKind::default(), PolicyKind::S3Fifo);
}
