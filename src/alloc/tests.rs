//! Unit tests and the structural consistency check shared with the model test.

use super::pages::{Kind, NIL};
use super::*;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

pub(super) fn small_config() -> AllocConfig {
    AllocConfig {
        page_size: 4 * KIB,
        granule: 64,
    }
}

/// Walks every page and asserts the documented invariants, the free lists, the
/// slab hints and that the counters agree with the metadata.
pub(super) fn check_internal(a: &Allocator) {
    let meta = &a.heap.meta;
    let page = a.page_size();
    let (mut free_pages, mut slab_pages, mut slab_free, mut used, mut live) = (0, 0, 0, 0, 0);
    let mut runs = Vec::new();
    let mut partial_expected = vec![0usize; a.slabs.class_count()];
    let mut prev_free = false;
    let mut p = 0usize;
    while p < meta.len() {
        let m = meta[p];
        let len = m.len as usize;
        assert!(len >= 1 && p + len <= meta.len(), "page {p}: bad len {len}");
        match m.kind {
            Kind::FreeHead => {
                assert!(!prev_free, "adjacent free runs at page {p}");
                let inner = &meta[p + 1..(p + len - 1).max(p + 1)];
                assert!(
                    inner.iter().all(|q| q.kind == Kind::Interior),
                    "free run {p}"
                );
                if len > 1 {
                    assert_eq!(meta[p + len - 1].kind, Kind::FreeTail);
                    assert_eq!(meta[p + len - 1].head as usize, p);
                }
                runs.push((p as u32, len as u32));
                free_pages += len as u64;
            }
            Kind::Large => {
                let inner = &meta[p + 1..p + len];
                assert!(
                    inner.iter().all(|q| q.kind == Kind::Interior),
                    "large block {p}"
                );
                used += len as u64 * page;
                live += 1;
            }
            Kind::SlabHead => {
                let c = m.class as usize;
                let info = a.slabs.info(c);
                assert_eq!(len as u32, info.pages);
                for (q, page) in meta.iter().enumerate().skip(p).take(len) {
                    let want = if q == p {
                        Kind::SlabHead
                    } else {
                        Kind::SlabMember
                    };
                    assert_eq!(page.kind, want);
                    assert_eq!(page.head as usize, p);
                }
                let n = a.slabs.count_live(p as u32, c);
                assert_eq!(n, m.used, "slab {p} live count");
                a.slabs.check_hints(&a.heap, p as u32, c);
                if n == 0 {
                    assert_eq!(a.slabs.cached(c) as usize, p, "empty slab {p} not cached");
                } else if n < info.slots {
                    partial_expected[c] += 1;
                }
                used += u64::from(n) * info.size;
                live += u64::from(n);
                slab_pages += len as u64;
                slab_free += u64::from(info.slots - n) * info.size;
            }
            other => panic!("page {p} starts a run but is {other:?}"),
        }
        prev_free = m.kind == Kind::FreeHead;
        p += len;
    }
    for (c, &expected) in partial_expected.iter().enumerate() {
        let mut h = a.slabs.partial_head(c);
        let mut n = 0;
        while h != NIL {
            let m = meta[h as usize];
            assert_eq!(m.kind, Kind::SlabHead);
            assert_eq!(m.class as usize, c);
            assert!(m.used > 0 && m.used < a.slabs.info(c).slots);
            n += 1;
            h = m.next;
        }
        assert_eq!(n, expected, "partial list of class {c}");
    }
    let mut listed = a.heap.listed_runs();
    listed.sort_unstable();
    assert_eq!(listed, runs, "free lists disagree with the pages");
    assert_eq!(a.heap.free_pages(), free_pages);
    let largest = runs.iter().map(|r| u64::from(r.1)).max().unwrap_or(0);
    let s = a.stats();
    assert_eq!(s.used_bytes, used);
    assert_eq!(s.live_blocks, live);
    assert_eq!(s.free_bytes, s.capacity - used);
    assert_eq!(s.largest_free_run, largest * page);
    assert_eq!(s.slab_bytes, slab_pages * page);
    assert_eq!(s.slab_free_bytes, slab_free);
}

/// Allocates `len` until the pool is full, checking alignment and bounds.
fn fill(a: &mut Allocator, len: u64) -> Vec<Block> {
    let mut blocks = Vec::new();
    while let Some(b) = a.allocate(len) {
        assert_eq!(b.offset % a.granule(), 0);
        assert!(b.offset + b.size <= a.capacity());
        blocks.push(b);
    }
    blocks
}

fn free_all(a: &mut Allocator, blocks: &[Block]) {
    for b in blocks {
        assert_eq!(a.free(b.offset), Ok(*b));
    }
    assert_eq!(a.stats().used_bytes, 0);
}

#[test]
fn config_validation() {
    let bad = [
        (4 * KIB, 32),
        (4 * KIB, 96),
        (3000, 64),
        (256, 64),
        (32 * MIB, 512),
    ];
    for (page_size, granule) in bad {
        let cfg = AllocConfig { page_size, granule };
        assert!(
            matches!(Allocator::new(MIB, cfg), Err(AllocError::BadConfig(_))),
            "{cfg:?}"
        );
    }
    assert!(matches!(
        Allocator::new(60 * KIB, AllocConfig::default()),
        Err(AllocError::BadConfig(_))
    ));
    let a = Allocator::new(10 * MIB + 5, AllocConfig::default()).unwrap();
    assert_eq!(a.capacity(), 10 * MIB);
    assert_eq!((a.page_size(), a.granule()), (64 * KIB, 512));
    let a = Allocator::new(
        16 * MIB,
        AllocConfig {
            page_size: 16 * MIB,
            granule: 64,
        },
    )
    .unwrap();
    assert_eq!(a.capacity(), 16 * MIB);
    assert!(!AllocError::NotAllocated { offset: 3 }
        .to_string()
        .is_empty());
}

#[test]
fn fill_free_refill_across_classes() {
    let mut a = Allocator::new(MIB, small_config()).unwrap();
    for len in [100, 3000, 4096, 1, 20_000, 100, 700, 3000] {
        let blocks = fill(&mut a, len);
        let size = a.reserved_size(len).unwrap();
        assert!(blocks.iter().all(|b| b.size == size));
        // Every class wastes under 1/64 of a slab, so the pool fills almost entirely.
        let used = blocks.len() as u64 * size;
        assert!(
            used * 64 >= a.capacity() * 63 || a.capacity() - used < 16 * a.page_size(),
            "{len}"
        );
        check_internal(&a);
        free_all(&mut a, &blocks);
        check_internal(&a);
    }
    assert_eq!(fill(&mut a, 128).len() as u64, MIB / 128);
}

#[test]
fn capacity_sized_allocation() {
    for (cap, cfg) in [
        (1000 * 64 * KIB, AllocConfig::default()),
        (MIB, small_config()),
    ] {
        let mut a = Allocator::new(cap, cfg).unwrap();
        assert_eq!(a.reserved_size(cap + 1), None);
        assert_eq!(a.allocate(cap + 1), None);
        let b = a.allocate(cap).unwrap();
        assert_eq!(
            b,
            Block {
                offset: 0,
                size: cap
            }
        );
        assert_eq!(a.allocate(1), None);
        a.free(0).unwrap();
        // Leave cached empty slabs behind: the next whole-capacity request reclaims them.
        let small: Vec<_> = (1..40).map(|i| a.allocate(i * 300).unwrap()).collect();
        free_all(&mut a, &small);
        let s = a.stats();
        assert!(s.slab_bytes > 0 && s.slab_free_bytes > 0 && s.slab_free_bytes <= s.slab_bytes);
        assert_eq!(s.free_bytes, cap);
        assert_eq!(
            a.allocate(cap),
            Some(Block {
                offset: 0,
                size: cap
            })
        );
        assert_eq!(a.stats().slab_bytes, 0);
        a.free(0).unwrap();
        assert_eq!(a.stats().largest_free_run, cap);
        check_internal(&a);
    }
}

#[test]
fn trim_restores_one_run() {
    let mut a = Allocator::new(64 * MIB, AllocConfig::default()).unwrap();
    let blocks: Vec<_> = (0..500).map(|i| a.allocate(1 + i * 97).unwrap()).collect();
    free_all(&mut a, &blocks);
    let s = a.stats();
    assert_eq!(s.free_bytes, a.capacity());
    assert_eq!(a.trim(), s.slab_bytes);
    let s = a.stats();
    assert_eq!((s.slab_bytes, s.largest_free_run), (0, a.capacity()));
    assert_eq!(s.external_fragmentation(), 0.0);
    check_internal(&a);
}

#[test]
fn waste_bounds() {
    let a = Allocator::new(64 * MIB, AllocConfig::default()).unwrap();
    assert_eq!(a.reserved_size(2 * MIB), Some(2 * MIB));
    let odd = a.reserved_size(1_124_147).unwrap();
    assert!((1_124_147..1_124_147 + 64 * KIB).contains(&odd));
    assert_eq!(a.reserved_size(0), Some(512));
    for cfg in [
        AllocConfig::default(),
        small_config(),
        AllocConfig {
            page_size: 512,
            granule: 64,
        },
    ] {
        let a = Allocator::new(64 * MIB, cfg).unwrap();
        let g = cfg.granule;
        for len in 1..=cfg.page_size {
            let size = a.reserved_size(len).unwrap();
            let bound = (len + len.div_ceil(4)).div_ceil(g) * g;
            assert!(size >= len && size <= bound, "{cfg:?} len {len} -> {size}");
            assert_eq!(size % g, 0);
        }
    }
}

#[test]
fn bogus_frees_are_errors() {
    let mut a = Allocator::new(MIB, small_config()).unwrap();
    let small = a.allocate(100).unwrap();
    let large = a.allocate(3 * 4096).unwrap();
    let before = a.stats();
    let not = |offset| Err(AllocError::NotAllocated { offset });
    assert_eq!(a.free(small.offset + 64), not(small.offset + 64));
    assert_eq!(
        a.free(small.offset + small.size),
        not(small.offset + small.size)
    );
    assert_eq!(a.free(large.offset + 4096), not(large.offset + 4096));
    assert_eq!(a.free(large.offset + 64), not(large.offset + 64));
    assert_eq!(a.free(a.capacity() - 4096), not(a.capacity() - 4096));
    let out = Err(AllocError::OutOfRange {
        offset: MIB,
        capacity: MIB,
    });
    assert_eq!(a.free(MIB), out);
    assert_eq!(a.stats(), before);
    assert_eq!(a.free(small.offset), Ok(small));
    assert_eq!(a.free(small.offset), not(small.offset));
    assert_eq!(a.free(large.offset), Ok(large));
    assert_eq!(a.free(large.offset), not(large.offset));
    assert_eq!(a.block_at(large.offset), None);
    check_internal(&a);
}

#[test]
fn slab_tail_waste_is_never_handed_out() {
    // 320-byte slots: three 4 KiB pages hold 38 of them and 128 spare bytes.
    let mut a = Allocator::new(MIB, small_config()).unwrap();
    let blocks: Vec<_> = (0..38).map(|_| a.allocate(300).unwrap()).collect();
    assert!(blocks.iter().all(|b| b.size == 320 && b.offset < 3 * 4096));
    assert_eq!(a.stats().slab_bytes, 3 * 4096);
    assert_eq!(a.stats().slab_free_bytes, 0);
    let tail = 38 * 320;
    assert_eq!(a.block_at(tail), None);
    assert_eq!(a.free(tail), Err(AllocError::NotAllocated { offset: tail }));
    // Slots on pages after the head still resolve to their slab.
    for b in &blocks {
        assert_eq!(a.block_at(b.offset), Some(*b));
    }
    let next = a.allocate(300).unwrap();
    assert!(next.offset >= 3 * 4096);
    assert_eq!(a.stats().slab_bytes, 6 * 4096);
    check_internal(&a);
}

#[test]
fn large_pages_coalesce_in_any_order() {
    let mut a = Allocator::new(MIB, small_config()).unwrap();
    let blocks = fill(&mut a, 3 * 4096);
    assert_eq!(blocks.len(), 256 / 3);
    for b in blocks
        .iter()
        .step_by(2)
        .chain(blocks.iter().skip(1).step_by(2))
    {
        a.free(b.offset).unwrap();
        check_internal(&a);
    }
    assert_eq!(a.stats().largest_free_run, MIB);
}
