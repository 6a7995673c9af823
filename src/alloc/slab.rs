//! Slabs: runs of 1..=16 pages cut into equal slots of one size class.
//!
//! Slot bits live in one bitmap with a fixed region of `words_per_page` words
//! per page (one bit per granule, rounded up to a word), so a slab's slots are
//! simply bits `0..slots` starting at its head page's region and no bitmap is
//! ever allocated after construction. A set bit is a live slot; a slab going
//! back to the page heap is empty, hence its region is all zero again.
//!
//! Finding a free slot is three fixed-width scans: the head's `nonfull` mask
//! picks a page region, that page's `summary` picks a group of words, and at
//! most `group_words` words are read (one word for pages up to 4096 granules).

use super::classes::{ClassInfo, Classes};
use super::pages::{Kind, PageHeap, NIL};

/// All slab state except the per-page fields, which live in the page heap.
#[derive(Debug)]
pub(super) struct Slabs {
    classes: Classes,
    /// Per class: head of the list of slabs with both free and live slots.
    partial: Vec<u32>,
    /// Per class: one empty slab kept to avoid churn at a slab boundary.
    cached: Vec<u32>,
    bitmap: Vec<u64>,
    words_per_page: u32,
    group_words: u32,
    page_shift: u32,
    /// Pages owned by slabs, cached ones included.
    pub(super) slab_pages: u64,
    /// Bytes of free slots in those slabs.
    pub(super) free_slot_bytes: u64,
}

impl Slabs {
    pub(super) fn new(classes: Classes, pages: u32, page_size: u64, granule: u64) -> Slabs {
        let words_per_page = (page_size / granule).div_ceil(64) as u32;
        let n = classes.count();
        Slabs {
            classes,
            partial: vec![NIL; n],
            cached: vec![NIL; n],
            bitmap: vec![0; pages as usize * words_per_page as usize],
            words_per_page,
            group_words: words_per_page.div_ceil(64),
            page_shift: page_size.trailing_zeros(),
            slab_pages: 0,
            free_slot_bytes: 0,
        }
    }

    /// The class serving `len` bytes, `None` for page-sized lengths.
    #[inline]
    pub(super) fn class_for(&self, len: u64) -> Option<usize> {
        self.classes.index_for(len)
    }

    /// Bytes reserved by a block of class `c`.
    #[inline]
    pub(super) fn class_size(&self, c: usize) -> u64 {
        self.classes.get(c).size
    }

    /// Takes a slot of class `c`, returning its byte offset.
    pub(super) fn allocate(&mut self, heap: &mut PageHeap, c: usize) -> Option<u64> {
        let info = *self.classes.get(c);
        let mut h = self.partial[c];
        if h == NIL {
            h = self.cached[c];
            if h != NIL {
                self.cached[c] = NIL;
            } else {
                h = self.create(heap, c, &info)?;
            }
            self.push_partial(heap, c, h);
        }
        let slot = self.take_slot(heap, h, &info)?;
        let m = &mut heap.meta[h as usize];
        m.used += 1;
        if m.used == info.slots {
            self.remove_partial(heap, c, h);
        }
        self.free_slot_bytes -= info.size;
        Some((u64::from(h) << self.page_shift) + u64::from(slot) * info.size)
    }

    /// The live slot starting exactly at `offset` in slab `h`, with its class.
    pub(super) fn find(&self, heap: &PageHeap, h: u32, offset: u64) -> Option<(u32, usize)> {
        let c = heap.meta[h as usize].class as usize;
        let info = self.classes.get(c);
        let rel = offset - (u64::from(h) << self.page_shift);
        if rel % info.size != 0 || rel / info.size >= u64::from(info.slots) {
            return None;
        }
        let slot = (rel / info.size) as u32;
        let word = self.bitmap[self.word_index(h, slot / 64)];
        (word & (1 << (slot % 64)) != 0).then_some((slot, c))
    }

    /// Frees live `slot` of slab `h` (class `c`), returning the block size.
    pub(super) fn free(&mut self, heap: &mut PageHeap, h: u32, slot: u32, c: usize) -> u64 {
        let info = *self.classes.get(c);
        let w = slot / 64;
        let wi = self.word_index(h, w);
        self.bitmap[wi] &= !(1 << (slot % 64));
        let region = w / self.words_per_page;
        let group = (w % self.words_per_page) / self.group_words;
        heap.meta[(h + region) as usize].summary |= 1 << group;
        let m = &mut heap.meta[h as usize];
        m.nonfull |= 1 << region;
        let was_full = m.used == info.slots;
        m.used -= 1;
        let now_empty = m.used == 0;
        self.free_slot_bytes += info.size;
        if now_empty {
            if !was_full {
                self.remove_partial(heap, c, h);
            }
            if self.cached[c] == NIL {
                self.cached[c] = h;
            } else {
                self.release(heap, h, &info);
            }
        } else if was_full {
            self.push_partial(heap, c, h);
        }
        info.size
    }

    /// Gives every cached empty slab back to the page heap; returns the pages freed.
    pub(super) fn trim(&mut self, heap: &mut PageHeap) -> u64 {
        let mut pages = 0;
        for c in 0..self.cached.len() {
            let h = self.cached[c];
            if h != NIL {
                self.cached[c] = NIL;
                let info = *self.classes.get(c);
                self.release(heap, h, &info);
                pages += u64::from(info.pages);
            }
        }
        pages
    }

    /// Live-slot count of slab `h` according to the bitmap, for consistency checks.
    #[cfg(test)]
    pub(super) fn count_live(&self, h: u32, c: usize) -> u32 {
        let info = self.classes.get(c);
        (0..info.words)
            .map(|w| (self.bitmap[self.word_index(h, w)] & !info.word_mask(w)).count_ones())
            .for_each(|stray| assert_eq!(stray, 0, "bit beyond the last slot"));
        (0..info.words)
            .map(|w| self.bitmap[self.word_index(h, w)].count_ones())
            .sum()
    }

    /// Cached empty slab of class `c`, if any.
    #[cfg(test)]
    pub(super) fn cached(&self, c: usize) -> u32 {
        self.cached[c]
    }

    /// Geometry of class `c`.
    #[cfg(test)]
    pub(super) fn info(&self, c: usize) -> ClassInfo {
        *self.classes.get(c)
    }

    /// Number of size classes.
    #[cfg(test)]
    pub(super) fn class_count(&self) -> usize {
        self.classes.count()
    }

    /// Head of class `c`'s partial list.
    #[cfg(test)]
    pub(super) fn partial_head(&self, c: usize) -> u32 {
        self.partial[c]
    }

    /// Asserts that the `nonfull` and `summary` hints of slab `h` are exact.
    #[cfg(test)]
    pub(super) fn check_hints(&self, heap: &PageHeap, h: u32, c: usize) {
        let info = self.classes.get(c);
        let mut nonfull = 0u16;
        for r in 0..info.pages {
            let mut summary = 0u64;
            for w in r * self.words_per_page..((r + 1) * self.words_per_page).min(info.words) {
                let free = !self.bitmap[self.word_index(h, w)] & info.word_mask(w);
                if free != 0 {
                    summary |= 1 << ((w % self.words_per_page) / self.group_words);
                }
            }
            assert_eq!(
                heap.meta[(h + r) as usize].summary,
                summary,
                "slab {h} page {r}"
            );
            if summary != 0 {
                nonfull |= 1 << r;
            }
        }
        assert_eq!(heap.meta[h as usize].nonfull, nonfull, "slab {h}");
    }

    #[inline]
    fn word_index(&self, h: u32, w: u32) -> usize {
        h as usize * self.words_per_page as usize + w as usize
    }

    /// Carves a new slab for class `c` out of the page heap.
    fn create(&mut self, heap: &mut PageHeap, c: usize, info: &ClassInfo) -> Option<u32> {
        let h = match heap.alloc_run(info.pages) {
            Some(h) => h,
            None if self.trim(heap) > 0 => heap.alloc_run(info.pages)?,
            None => return None,
        };
        let bits_per_page = self.words_per_page * 64;
        let mut nonfull = 0u16;
        for r in 0..info.pages {
            let m = &mut heap.meta[(h + r) as usize];
            m.kind = Kind::SlabMember;
            m.head = h;
            let slots_here = info
                .slots
                .saturating_sub(r * bits_per_page)
                .min(bits_per_page);
            let groups = slots_here.div_ceil(64).div_ceil(self.group_words);
            m.summary = low_bits(groups);
            if groups > 0 {
                nonfull |= 1 << r;
            }
        }
        let m = &mut heap.meta[h as usize];
        m.kind = Kind::SlabHead;
        m.class = c as u8;
        m.len = info.pages;
        m.used = 0;
        m.nonfull = nonfull;
        self.slab_pages += u64::from(info.pages);
        self.free_slot_bytes += u64::from(info.slots) * info.size;
        Some(h)
    }

    /// Returns empty slab `h` to the page heap.
    fn release(&mut self, heap: &mut PageHeap, h: u32, info: &ClassInfo) {
        for r in 0..info.pages {
            heap.meta[(h + r) as usize].kind = Kind::Interior;
        }
        heap.free_run(h, info.pages);
        self.slab_pages -= u64::from(info.pages);
        self.free_slot_bytes -= u64::from(info.slots) * info.size;
    }

    /// Marks and returns a free slot of slab `h`, which must have one.
    fn take_slot(&mut self, heap: &mut PageHeap, h: u32, info: &ClassInfo) -> Option<u32> {
        let region = heap.meta[h as usize].nonfull.trailing_zeros();
        let summary = heap.meta[(h + region) as usize].summary;
        let group = summary.trailing_zeros();
        let first = region * self.words_per_page + group * self.group_words;
        let end = (first + self.group_words).min(info.words);
        let base = self.word_index(h, 0);
        for w in first..end {
            let free = !self.bitmap[base + w as usize] & info.word_mask(w);
            if free == 0 {
                continue;
            }
            let bit = free.trailing_zeros();
            self.bitmap[base + w as usize] |= 1 << bit;
            // Words before w in the group were full, so only those after it matter.
            let group_full =
                (w..end).all(|v| !self.bitmap[base + v as usize] & info.word_mask(v) == 0);
            if group_full {
                let page = &mut heap.meta[(h + region) as usize];
                page.summary &= !(1 << group);
                if page.summary == 0 {
                    heap.meta[h as usize].nonfull &= !(1 << region);
                }
            }
            return Some(w * 64 + bit);
        }
        debug_assert!(false, "slab {h} listed as partial has no free slot");
        None
    }

    fn push_partial(&mut self, heap: &mut PageHeap, c: usize, h: u32) {
        let old = self.partial[c];
        heap.meta[h as usize].prev = NIL;
        heap.meta[h as usize].next = old;
        if old != NIL {
            heap.meta[old as usize].prev = h;
        }
        self.partial[c] = h;
    }

    fn remove_partial(&mut self, heap: &mut PageHeap, c: usize, h: u32) {
        let (prev, next) = (heap.meta[h as usize].prev, heap.meta[h as usize].next);
        if next != NIL {
            heap.meta[next as usize].prev = prev;
        }
        if prev != NIL {
            heap.meta[prev as usize].next = next;
        } else {
            self.partial[c] = next;
        }
    }
}

/// A mask of the `n <= 64` lowest bits.
fn low_bits(n: u32) -> u64 {
    if n >= 64 {
        !0
    } else {
        (1u64 << n) - 1
    }
}
