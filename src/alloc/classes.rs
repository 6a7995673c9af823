//! The small size classes and the slab geometry chosen for each.
//!
//! Classes are counted in granules: 1, 2, 3, 4, then four per power of two
//! (5, 6, 7, 8, 10, 12, 14, 16, 20, ...). Within a power of two the step is a
//! quarter of its base, so a length just above one class lands in the next and
//! wastes at most 25%. Every class smaller than a page is a slab class; lengths
//! above the largest of them are served as whole pages.

/// Most pages one slab may span: the slab head tracks its pages in a `u16` mask.
pub(super) const MAX_SLAB_PAGES: u64 = 16;

/// Tail waste (as a fraction of the slab, 1/N) below which fewer pages win over
/// an even smaller waste: bigger slabs strand more memory when barely used.
const GOOD_ENOUGH_WASTE: u64 = 64;

/// Geometry of one size class.
#[derive(Clone, Copy, Debug)]
pub(super) struct ClassInfo {
    /// Bytes reserved per block.
    pub(super) size: u64,
    /// Pages per slab.
    pub(super) pages: u32,
    /// Blocks per slab.
    pub(super) slots: u32,
    /// Bitmap words that hold the slots' bits.
    pub(super) words: u32,
    /// Bits of the last of those words that belong to real slots.
    pub(super) last_mask: u64,
}

impl ClassInfo {
    /// Bits of slab-relative bitmap word `w` that correspond to real slots.
    #[inline]
    pub(super) fn word_mask(&self, w: u32) -> u64 {
        if w + 1 == self.words {
            self.last_mask
        } else {
            !0
        }
    }
}

/// The table of small classes for one configuration.
#[derive(Debug)]
pub(super) struct Classes {
    infos: Vec<ClassInfo>,
    granule_shift: u32,
    max_small: u64,
}

impl Classes {
    /// Builds every class below `page_size`; slabs never span more than
    /// `total_pages` so each class can be allocated on an empty allocator.
    pub(super) fn new(page_size: u64, granule: u64, total_pages: u64) -> Classes {
        let max_pages = MAX_SLAB_PAGES.min(total_pages).max(1);
        let mut infos = Vec::new();
        let mut index = 0;
        loop {
            let size = granules_of(index) * granule;
            if size >= page_size {
                break;
            }
            let pages = pages_for_class(size, page_size, max_pages);
            let slots = pages * page_size / size;
            let words = slots.div_ceil(64);
            let tail = slots % 64;
            infos.push(ClassInfo {
                size,
                pages: pages as u32,
                slots: slots as u32,
                words: words as u32,
                last_mask: if tail == 0 { !0 } else { (1u64 << tail) - 1 },
            });
            index += 1;
        }
        // page_size >= 8 * granule guarantees at least the classes 1..=7 granules.
        let max_small = infos.last().map_or(0, |c| c.size);
        Classes {
            infos,
            granule_shift: granule.trailing_zeros(),
            max_small,
        }
    }

    /// The class serving `len` bytes (`len >= 1`), or `None` for page-sized lengths.
    #[inline]
    pub(super) fn index_for(&self, len: u64) -> Option<usize> {
        if len > self.max_small {
            return None;
        }
        let g = (len + (1 << self.granule_shift) - 1) >> self.granule_shift;
        if g <= 4 {
            return Some(g as usize - 1);
        }
        let e = (g - 1).ilog2() - 2;
        let q = (g - 1) >> e;
        Some(4 + 4 * e as usize + (q as usize - 4))
    }

    /// Geometry of class `index`.
    #[inline]
    pub(super) fn get(&self, index: usize) -> &ClassInfo {
        &self.infos[index]
    }

    /// Number of classes.
    pub(super) fn count(&self) -> usize {
        self.infos.len()
    }
}

/// Size of class `index` in granules.
fn granules_of(index: usize) -> u64 {
    if index < 4 {
        return index as u64 + 1;
    }
    let e = (index - 4) / 4;
    let q = 4 + (index - 4) % 4;
    (q as u64 + 1) << e
}

/// Fewest pages whose tail waste is small enough, else the least wasteful count.
fn pages_for_class(size: u64, page_size: u64, max_pages: u64) -> u64 {
    let mut best = 1;
    let mut best_waste = page_size % size;
    for k in 1..=max_pages {
        let bytes = k * page_size;
        let waste = bytes % size;
        if waste * GOOD_ENOUGH_WASTE <= bytes {
            return k;
        }
        // Compare waste fractions without division: waste/bytes < best_waste/(best*page).
        if waste * best * page_size < best_waste * bytes {
            best = k;
            best_waste = waste;
        }
    }
    best
}
