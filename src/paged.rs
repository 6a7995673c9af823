//! A vector kept in fixed-size pages, for the per-object tables of the index and the eviction
//! policies (indexed by handle, millions long).
//!
//! A `Vec` doubles its capacity when it fills: right after a doubling half of it is reserve,
//! and at 10 million objects the index's vectors held 1.68 times what they used (the bench
//! counted 167 bytes of heap per object, 117 of them in use). A paged vector reserves at most
//! one page beyond what it holds, and growing it never moves (nor copies) what it holds, so no
//! insert pays for copying a gigabyte under the shard's lock. Only the first page grows as a
//! `Vec` does, so that a small pool (a test, a namespace with a few objects) stays small.

use std::ops::{Index, IndexMut};

/// Entries per page: a power of two, so an index splits with a shift and a mask.
const PAGE: usize = 4096;

/// A growable array of `T` in pages of [`PAGE`] entries. Every page but the last is full.
#[derive(Clone, Debug)]
pub(crate) struct Paged<T> {
    pages: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Paged<T> {
    fn default() -> Self {
        Paged {
            pages: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Paged<T> {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Entry `i`, if `i < len`.
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        self.pages.get(i / PAGE)?.get(i % PAGE)
    }

    /// Entry `i`, if `i < len`.
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.pages.get_mut(i / PAGE)?.get_mut(i % PAGE)
    }

    /// Appends `v`; its index is the old `len`.
    pub(crate) fn push(&mut self, v: T) {
        match self.pages.last_mut() {
            Some(page) if page.len() < PAGE => {
                if page.len() == page.capacity() {
                    // Double as a Vec would, but never past a page.
                    let want = (page.capacity() * 2).clamp(4, PAGE);
                    page.reserve_exact(want - page.len());
                }
                page.push(v);
            }
            _ => {
                let cap = if self.pages.is_empty() { 4 } else { PAGE };
                let mut page = Vec::with_capacity(cap);
                page.push(v);
                self.pages.push(page);
            }
        }
        self.len += 1;
    }

    /// The entries `from..to` (clamped to `len`), in order.
    #[cfg_attr(
        loom,
        expect(
            dead_code,
            reason = "only the pool walks a table, and loom builds leave it out"
        )
    )]
    pub(crate) fn range(&self, from: usize, to: usize) -> impl Iterator<Item = &T> {
        let to = to.min(self.len);
        (from..to).map(move |i| &self[i])
    }

    /// Every entry, in order.
    #[cfg_attr(
        loom,
        expect(
            dead_code,
            reason = "only the pool walks a table, and loom builds leave it out"
        )
    )]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.pages.iter().flatten()
    }
}

impl<T: Clone> Paged<T> {
    /// Appends copies of `v` until `len >= n` (never shrinks).
    pub(crate) fn grow_to(&mut self, n: usize, v: T) {
        while self.len < n {
            self.push(v.clone());
        }
    }
}

impl<T> Index<usize> for Paged<T> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        &self.pages[i / PAGE][i % PAGE]
    }
}

impl<T> IndexMut<usize> for Paged<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.pages[i / PAGE][i % PAGE]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_vec_across_pages() {
        let mut p = Paged::default();
        let mut v = Vec::new();
        for i in 0..3 * PAGE + 17 {
            p.push(i as u64 * 7);
            v.push(i as u64 * 7);
        }
        assert_eq!(p.len(), v.len());
        assert!(p.iter().eq(v.iter()));
        assert!(p
            .range(PAGE - 3, 2 * PAGE + 5)
            .eq(v[PAGE - 3..2 * PAGE + 5].iter()));
        assert!(p
            .range(v.len() - 2, v.len() + 10)
            .eq(v[v.len() - 2..].iter()));
        assert_eq!(p.get(v.len()), None);
        p[PAGE] = 1;
        *p.get_mut(2 * PAGE + 1).expect("present") = 2;
        assert_eq!((p[PAGE], p[2 * PAGE + 1]), (1, 2));
        p.grow_to(5 * PAGE, 9);
        assert_eq!((p.len(), p[5 * PAGE - 1]), (5 * PAGE, 9));
        p.grow_to(10, 3);
        assert_eq!(p.len(), 5 * PAGE);
    }

    proptest::proptest! {
        /// Pushes, growth and writes across pages agree with a `Vec` after every step.
        #[test]
        fn behaves_like_a_vec(ops in proptest::collection::vec((0u8..4, 0usize..3 * PAGE, proptest::prelude::any::<u32>()), 1..200)) {
            let mut p = Paged::default();
            let mut v: Vec<u32> = Vec::new();
            for (kind, at, x) in ops {
                match kind {
                    0 => {
                        p.push(x);
                        v.push(x);
                    }
                    1 => {
                        p.grow_to(at, x);
                        if v.len() < at {
                            v.resize(at, x);
                        }
                    }
                    2 if !v.is_empty() => {
                        let i = at % v.len();
                        p[i] = x;
                        v[i] = x;
                    }
                    _ => {
                        if let Some(e) = p.get_mut(at) {
                            *e = x;
                        }
                        if let Some(e) = v.get_mut(at) {
                            *e = x;
                        }
                    }
                }
                proptest::prop_assert_eq!(p.len(), v.len());
                proptest::prop_assert_eq!(p.get(at), v.get(at));
                proptest::prop_assert_eq!(p.get(v.len()), None);
                proptest::prop_assert!(p.iter().eq(v.iter()));
                proptest::prop_assert!(p.range(at / 2, at).eq(v[(at / 2).min(v.len())..at.min(v.len())].iter()));
            }
        }
    }

    #[test]
    fn reserves_at_most_a_page() {
        let mut p = Paged::default();
        for i in 0..PAGE * 5 / 2 {
            p.push(i as u32);
            let reserved: usize = p.pages.iter().map(Vec::capacity).sum();
            assert!(
                reserved - p.len() < PAGE,
                "{reserved} reserved for {}",
                p.len()
            );
            assert!(p.pages.iter().all(|pg| pg.capacity() <= PAGE));
        }
        // A small table stays small.
        let mut small = Paged::default();
        small.push(1u8);
        assert_eq!(small.pages[0].capacity(), 4);
    }
}
