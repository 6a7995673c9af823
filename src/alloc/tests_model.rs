//! Property test: random allocate/free sequences checked against a map model.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::tests::{check_internal, small_config};
use super::{AllocConfig, AllocError, Allocator, Block};

/// One step; the numbers are mapped onto the allocator's geometry when run.
#[derive(Clone, Debug)]
enum Op {
    /// Allocate a length of the given shape.
    Alloc(Shape, u64),
    /// Free the live block picked by the number (skipped when none is live).
    Free(u64),
    /// Free an offset that is not a live block start.
    Bogus(Bogus, u64),
}

#[derive(Clone, Copy, Debug)]
enum Shape {
    Tiny,
    Small,
    PageEdge,
    MultiPage,
    Huge,
}

#[derive(Clone, Copy, Debug)]
enum Bogus {
    Anywhere,
    Interior,
    DoubleFree,
}

fn op() -> impl Strategy<Value = Op> {
    let shape = prop_oneof![
        Just(Shape::Tiny),
        Just(Shape::Small),
        Just(Shape::PageEdge),
        Just(Shape::MultiPage),
        Just(Shape::Huge),
    ];
    let bogus = prop_oneof![
        Just(Bogus::Anywhere),
        Just(Bogus::Interior),
        Just(Bogus::DoubleFree)
    ];
    prop_oneof![
        6 => (shape, any::<u64>()).prop_map(|(s, n)| Op::Alloc(s, n)),
        4 => any::<u64>().prop_map(Op::Free),
        1 => (bogus, any::<u64>()).prop_map(|(b, n)| Op::Bogus(b, n)),
    ]
}

fn len_for(a: &Allocator, shape: Shape, n: u64) -> u64 {
    let (g, p) = (a.granule(), a.page_size());
    match shape {
        Shape::Tiny => n % (2 * g + 1),
        Shape::Small => n % (p + 1),
        Shape::PageEdge => ((1 + n % 3) * p + (n >> 8) % 5).saturating_sub(2),
        Shape::MultiPage => 1 + n % (8 * p),
        Shape::Huge => 1 + n % (a.capacity() + p),
    }
}

/// Asserts that the allocator and the model agree on everything observable.
fn check(a: &Allocator, model: &BTreeMap<u64, u64>) {
    let mut end = 0;
    for (&offset, &size) in model {
        assert!(offset >= end, "block {offset} overlaps the previous one");
        assert_eq!(offset % a.granule(), 0);
        end = offset + size;
        assert!(end <= a.capacity());
        assert_eq!(a.block_at(offset), Some(Block { offset, size }));
    }
    let s = a.stats();
    assert_eq!(s.used_bytes, model.values().sum::<u64>());
    assert_eq!(s.live_blocks, model.len() as u64);
    assert_eq!(s.free_bytes, s.capacity - s.used_bytes);
    check_internal(a);
}

fn nth_live(model: &BTreeMap<u64, u64>, n: u64) -> Option<(u64, u64)> {
    let i = (n % model.len().max(1) as u64) as usize;
    model.iter().nth(i).map(|(&o, &s)| (o, s))
}

fn run(capacity: u64, config: AllocConfig, ops: &[Op]) {
    let mut a = Allocator::new(capacity, config).unwrap();
    let mut model = BTreeMap::new();
    let mut last_freed = None;
    for op in ops {
        match *op {
            Op::Alloc(shape, n) => {
                let len = len_for(&a, shape, n);
                let before = a.stats();
                match a.allocate(len) {
                    Some(b) => {
                        assert!(b.size >= len.max(1));
                        assert_eq!(a.reserved_size(len), Some(b.size));
                        assert!(
                            model.insert(b.offset, b.size).is_none(),
                            "{b:?} handed out twice"
                        );
                    }
                    None => {
                        let fits = a.reserved_size(len).is_some();
                        assert!(!(model.is_empty() && fits), "empty allocator refused {len}");
                        assert_eq!(a.stats().used_bytes, before.used_bytes);
                    }
                }
            }
            Op::Free(n) => {
                if let Some((offset, size)) = nth_live(&model, n) {
                    assert_eq!(a.free(offset), Ok(Block { offset, size }));
                    model.remove(&offset);
                    last_freed = Some(offset);
                }
            }
            Op::Bogus(kind, n) => {
                let offset = match kind {
                    Bogus::Anywhere => n % (a.capacity() + 2 * a.page_size()),
                    Bogus::Interior => match nth_live(&model, n) {
                        Some((o, s)) if s > 1 => o + 1 + (n >> 32) % (s - 1),
                        _ => continue,
                    },
                    Bogus::DoubleFree => match last_freed {
                        Some(o) => o,
                        None => continue,
                    },
                };
                if model.contains_key(&offset) {
                    continue;
                }
                let before = a.stats();
                let err = a.free(offset).unwrap_err();
                assert!(matches!(
                    err,
                    AllocError::NotAllocated { .. } | AllocError::OutOfRange { .. }
                ));
                assert_eq!(a.stats(), before);
                assert_eq!(a.block_at(offset), None);
            }
        }
        check(&a, &model);
    }
    for (&offset, &size) in &model {
        assert_eq!(a.free(offset), Ok(Block { offset, size }));
    }
    model.clear();
    check(&a, &model);
    let s = a.stats();
    assert_eq!(s.free_bytes, s.capacity);
    // Only cached empty slabs may remain, and a whole-capacity request reclaims them.
    assert_eq!(s.slab_free_bytes, s.slab_bytes - slab_tail_waste(&a));
    let whole = a
        .allocate(a.capacity())
        .expect("whole capacity after freeing everything");
    assert_eq!(
        whole,
        Block {
            offset: 0,
            size: a.capacity()
        }
    );
    a.free(0).unwrap();
    let s = a.stats();
    assert_eq!((s.largest_free_run, s.slab_bytes), (s.capacity, 0));
    check(&a, &model);
}

/// Bytes at the end of the cached empty slabs that hold no slot.
fn slab_tail_waste(a: &Allocator) -> u64 {
    let classes = a.slabs.class_count();
    (0..classes)
        .filter(|&c| a.slabs.cached(c) != super::pages::NIL)
        .map(|c| {
            let info = a.slabs.info(c);
            u64::from(info.pages) * a.page_size() - u64::from(info.slots) * info.size
        })
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn small_pages(ops in prop::collection::vec(op(), 1..300)) {
        run(1 << 20, small_config(), &ops);
    }

    #[test]
    fn tiny_pool(ops in prop::collection::vec(op(), 1..300)) {
        // 37 pages of 512 B: slabs are capped by the pool and fill it quickly.
        run(37 * 512 + 100, AllocConfig { page_size: 512, granule: 64 }, &ops);
    }

    #[test]
    fn wide_pages(ops in prop::collection::vec(op(), 1..150)) {
        // 8192 granules per page: summary bits cover two bitmap words each.
        run(8 << 20, AllocConfig { page_size: 512 << 10, granule: 64 }, &ops);
    }

    #[test]
    fn default_config(ops in prop::collection::vec(op(), 1..300)) {
        run((16 << 20) + 300_000, AllocConfig::default(), &ops);
    }
}
