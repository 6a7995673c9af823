//! The index shard against a model: random operations on keys of every size class (keys that
//! are prefixes of each other, keys that reuse a freed cell of their class with another length),
//! checked against a `HashMap` after every step, and a run long enough to cross pages.

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;

use super::*;
use crate::eviction::{PolicyKind, SCAN};

/// Key lengths at and around the size classes' edges, up to the longest key.
const LENS: [usize; 13] = [1, 2, 7, 8, 9, 15, 16, 17, 24, 25, 100, 255, 256];

/// Key `id`: one of three fill bytes repeated to one of [`LENS`], so the keys of one fill are
/// prefixes of each other and share their size class with keys one byte longer or shorter.
fn key(id: u8) -> Vec<u8> {
    let id = id as usize % (LENS.len() * 3);
    vec![b'a' + (id % 3) as u8; LENS[id / 3]]
}

fn entry(generation: u64, pinned: bool) -> Entry {
    Entry {
        offset: generation * 512,
        len: generation,
        generation,
        checksum: !generation,
        lease_until: 0,
        segment: 0,
        readers: 0,
        pinned,
        accessed: false,
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u8, bool),
    Remove(u8),
    Get(u8),
    Victim,
    Scan(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u8..(LENS.len() * 3) as u8;
    prop_oneof![
        4 => (id.clone(), prop::bool::weighted(0.1)).prop_map(|(k, p)| Op::Insert(k, p)),
        2 => id.clone().prop_map(Op::Remove),
        3 => id.prop_map(Op::Get),
        1 => Just(Op::Victim),
        1 => (1u8..8).prop_map(Op::Scan),
    ]
}

/// Every key a scan in steps of `budget` slots visits, checking that it visits each once.
fn scanned(idx: &NsIndex, budget: usize) -> BTreeSet<Vec<u8>> {
    let (mut seen, mut from) = (BTreeSet::new(), Some(0));
    while let Some(at) = from {
        let (looked, next) = idx.scan(at, budget, &mut |k| {
            assert!(seen.insert(k.to_vec()), "{k:?} visited twice");
        });
        assert!(looked <= budget);
        from = next;
    }
    seen
}

/// The index holds exactly the model's objects.
fn check(idx: &NsIndex, model: &HashMap<Vec<u8>, Entry>) {
    for id in 0..(LENS.len() * 3) as u8 {
        let k = key(id);
        let got = idx.peek(&k).map(|e| e.generation);
        assert_eq!(got, model.get(&k).map(|e| e.generation), "key {k:?}");
    }
    let pinned: BTreeSet<Vec<u8>> = idx.pinned_keys().map(<[u8]>::to_vec).collect();
    let want: BTreeSet<Vec<u8>> = model
        .iter()
        .filter(|(_, e)| e.pinned)
        .map(|(k, _)| k.clone())
        .collect();
    assert_eq!(pinned, want);
}

proptest! {
    /// Inserts, replacements, removals, evictions and scans agree with a map after every step.
    #[test]
    fn behaves_like_a_map(ops in proptest::collection::vec(op(), 1..300)) {
        let mut idx = NsIndex::new(PolicyKind::Lru.build());
        let mut model: HashMap<Vec<u8>, Entry> = HashMap::new();
        let mut seen: Option<(Vec<u8>, u64)> = None;
        for (tick, op) in ops.into_iter().enumerate() {
            let tick = tick as u64 + 1;
            match op {
                Op::Insert(id, pinned) => {
                    let e = entry(tick, pinned);
                    let old = idx.insert(&key(id), e, 0, tick).map(|e| e.generation);
                    prop_assert_eq!(old, model.insert(key(id), e).map(|e| e.generation));
                }
                Op::Remove(id) => {
                    let old = idx.remove(&key(id)).map(|e| e.generation);
                    prop_assert_eq!(old, model.remove(&key(id)).map(|e| e.generation));
                }
                Op::Get(id) => {
                    let got = idx.get(&key(id), tick).map(|e| (e.generation, e.offset, e.checksum));
                    let want = model.get(&key(id)).map(|e| (e.generation, e.offset, e.checksum));
                    prop_assert_eq!(got, want);
                }
                Op::Victim => match idx.victim(0, tick, &mut |k, e| seen = Some((k.to_vec(), e.generation))) {
                    Some(v) => {
                        prop_assert!(!v.pinned);
                        let k = model
                            .iter()
                            .find(|(_, e)| e.generation == v.generation)
                            .map(|(k, _)| k.clone());
                        prop_assert!(k.is_some(), "evicted an object the model lacks");
                        prop_assert_eq!(seen.take(), Some((k.clone().unwrap_or_default(), v.generation)), "the victim shown is the one taken");
                        model.remove(&k.unwrap_or_default());
                    }
                    None => {
                        // LRU gives up after SCAN pinned objects in a row.
                        let pinned = model.values().filter(|e| e.pinned).count();
                        prop_assert!(pinned >= SCAN.min(model.len()));
                    }
                },
                Op::Scan(budget) => {
                    let want: BTreeSet<Vec<u8>> = model.keys().cloned().collect();
                    prop_assert_eq!(scanned(&idx, budget as usize), want);
                }
            }
            check(&idx, &model);
        }
    }
}

/// Tens of thousands of objects, across many pages of slots and key cells, removed and
/// re-inserted with other lengths: every lookup still finds its own key's object.
#[test]
fn churn_across_pages() {
    let mut idx = NsIndex::new(PolicyKind::S3FifoLru.build());
    let mut model: HashMap<Vec<u8>, u64> = HashMap::new();
    let name = |i: u64| {
        // Lengths 6 to 40 bytes: several classes, cells reused by keys of other lengths.
        let mut k = format!("blk{i}:").into_bytes();
        k.resize(6 + (i * 7 % 35) as usize, b'x');
        k
    };
    for i in 0..30_000u64 {
        let k = name(i);
        idx.insert(&k, entry(i + 1, false), 0, i);
        model.insert(k, i + 1);
        if i % 3 == 2 {
            let gone = name(i / 2);
            assert_eq!(idx.remove(&gone).map(|e| e.generation), model.remove(&gone));
        }
    }
    for (k, generation) in &model {
        assert_eq!(idx.peek(k).map(|e| e.generation), Some(*generation));
    }
    for i in 0..30_000u64 {
        let k = name(i);
        assert_eq!(idx.peek(&k).map(|e| e.generation), model.get(&k).copied());
    }
    assert_eq!(scanned(&idx, 1000).len(), model.len());
}

/// What an object costs in the index's own tables (the policy's come on top).
#[test]
fn a_slot_is_small() {
    assert!(std::mem::size_of::<Slot>() <= 56);
}
