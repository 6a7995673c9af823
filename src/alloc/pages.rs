//! Page-run heap: free runs of whole pages in TLSF segregated lists, with
//! boundary tags so a freed run merges with both neighbours in O(1).
//!
//! Only run boundaries carry meaning: the first page of every run says what the
//! run is, the last page of a multi-page free run points back to its head, and
//! every other page is `Interior`. Each operation moves a constant number of
//! boundaries, so this stays exact without touching the pages in between.

/// "No page": list terminator and empty list head.
pub(super) const NIL: u32 = u32::MAX;

/// log2 of the number of second-level lists per power of two.
const SL_BITS: u32 = 4;
const SL_COUNT: usize = 1 << SL_BITS;
/// Enough first-level lists for runs (and rounded requests) up to 2^33 pages.
const FL_COUNT: usize = 30;
/// Runs peeked in a request's own list when good-fit rounding finds nothing.
/// Keeps an exact fit (e.g. the whole capacity) reachable at constant cost.
const EXACT_PEEK: usize = 8;

/// What a page is, as far as the allocator needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Not the boundary of any run and not part of a slab.
    Interior,
    /// First page of a free run; `len` pages, linked in a TLSF list.
    FreeHead,
    /// Last page of a free run longer than one page; `head` is its first page.
    FreeTail,
    /// First page of a live large block of `len` pages.
    Large,
    /// First page of a slab of `len` pages (class, counters and list links here).
    SlabHead,
    /// Any other page of a slab; `head` is the slab's first page.
    SlabMember,
}

/// Per-page metadata; slab fields are only meaningful on slab pages.
#[derive(Clone, Copy, Debug)]
pub(super) struct PageMeta {
    pub(super) kind: Kind,
    /// Slab head: size class index.
    pub(super) class: u8,
    /// Slab head: bit r set when slab page r's bitmap region has a free slot.
    pub(super) nonfull: u16,
    /// Run head / slab head: length in pages.
    pub(super) len: u32,
    /// Free tail / slab page: the run's first page.
    pub(super) head: u32,
    /// Free head: TLSF list links. Slab head: partial-slab list links.
    pub(super) prev: u32,
    pub(super) next: u32,
    /// Slab head: live slots.
    pub(super) used: u32,
    /// Slab page: bit g set when word group g of this page's region has a free slot.
    pub(super) summary: u64,
}

impl PageMeta {
    const INTERIOR: PageMeta = PageMeta {
        kind: Kind::Interior,
        class: 0,
        nonfull: 0,
        len: 0,
        head: NIL,
        prev: NIL,
        next: NIL,
        used: 0,
        summary: 0,
    };
}

/// Free page runs of one segment.
#[derive(Debug)]
pub(super) struct PageHeap {
    pub(super) meta: Vec<PageMeta>,
    fl_bitmap: u32,
    sl_bitmap: [u16; FL_COUNT],
    heads: [u32; FL_COUNT * SL_COUNT],
    free_pages: u64,
}

impl PageHeap {
    /// A heap of `pages` pages (`1..u32::MAX`), all in one free run.
    pub(super) fn new(pages: u32) -> PageHeap {
        let mut heap = PageHeap {
            meta: vec![PageMeta::INTERIOR; pages as usize],
            fl_bitmap: 0,
            sl_bitmap: [0; FL_COUNT],
            heads: [NIL; FL_COUNT * SL_COUNT],
            free_pages: 0,
        };
        heap.set_free(0, pages);
        heap.free_pages = u64::from(pages);
        heap
    }

    /// Pages in free runs.
    #[cfg(test)]
    pub(super) fn free_pages(&self) -> u64 {
        self.free_pages
    }

    /// Takes `n` pages from a free run; the head page comes back `Interior` for
    /// the caller to mark. Good fit: a run from a list whose every run fits.
    pub(super) fn alloc_run(&mut self, n: u32) -> Option<u32> {
        let h = self.find_fit(n)?;
        let len = self.meta[h as usize].len;
        self.unlink(h);
        self.meta[h as usize].kind = Kind::Interior;
        if len > n {
            self.set_free(h + n, len - n);
        } else if n > 1 {
            self.meta[(h + n - 1) as usize].kind = Kind::Interior;
        }
        self.free_pages -= u64::from(n);
        Some(h)
    }

    /// Returns pages `h..h + n` (all of them already `Interior` but the head)
    /// and merges them with free neighbours.
    pub(super) fn free_run(&mut self, h: u32, n: u32) {
        self.meta[h as usize].kind = Kind::Interior;
        self.free_pages += u64::from(n);
        let (mut start, mut len) = (h, n);
        let right = h + n;
        if (right as usize) < self.meta.len() && self.meta[right as usize].kind == Kind::FreeHead {
            len += self.absorb(right);
        }
        if h > 0 {
            let left = &self.meta[(h - 1) as usize];
            let left_head = match left.kind {
                Kind::FreeHead => h - 1,
                Kind::FreeTail => left.head,
                _ => NIL,
            };
            if left_head != NIL {
                len += self.absorb(left_head);
                start = left_head;
            }
        }
        self.set_free(start, len);
    }

    /// Length in pages of the longest free run. Walks one list: not for hot paths.
    pub(super) fn largest_free_run(&self) -> u32 {
        if self.fl_bitmap == 0 {
            return 0;
        }
        let fl = 31 - self.fl_bitmap.leading_zeros();
        let sl = 15 - self.sl_bitmap[fl as usize].leading_zeros();
        let mut h = self.heads[fl as usize * SL_COUNT + sl as usize];
        let mut best = 0;
        while h != NIL {
            best = best.max(self.meta[h as usize].len);
            h = self.meta[h as usize].next;
        }
        best
    }

    /// Head of every free run in list order, for consistency checks.
    #[cfg(test)]
    pub(super) fn listed_runs(&self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for (i, &head) in self.heads.iter().enumerate() {
            let mut h = head;
            while h != NIL {
                let len = self.meta[h as usize].len;
                assert_eq!(mapping(u64::from(len)), (i / SL_COUNT, i % SL_COUNT));
                assert_ne!(self.sl_bitmap[i / SL_COUNT] & (1 << (i % SL_COUNT)), 0);
                out.push((h, len));
                h = self.meta[h as usize].next;
            }
        }
        out
    }

    /// Takes free run `h` out of its list and clears its boundary marks.
    fn absorb(&mut self, h: u32) -> u32 {
        let len = self.meta[h as usize].len;
        self.unlink(h);
        self.meta[h as usize].kind = Kind::Interior;
        self.meta[(h + len - 1) as usize].kind = Kind::Interior;
        len
    }

    fn find_fit(&self, n: u32) -> Option<u32> {
        let n = u64::from(n);
        let (fl, sl) = mapping(round_to_list(n));
        if let Some(i) = self.first_nonempty(fl, sl) {
            return Some(self.heads[i]);
        }
        // Rounding skipped n's own list, whose runs may still be long enough.
        let (fl, sl) = mapping(n);
        let mut h = self.heads[fl * SL_COUNT + sl];
        for _ in 0..EXACT_PEEK {
            if h == NIL {
                break;
            }
            if u64::from(self.meta[h as usize].len) >= n {
                return Some(h);
            }
            h = self.meta[h as usize].next;
        }
        None
    }

    fn first_nonempty(&self, fl: usize, sl: usize) -> Option<usize> {
        if fl >= FL_COUNT {
            return None;
        }
        let here = u32::from(self.sl_bitmap[fl]) & (!0u32 << sl);
        if here != 0 {
            return Some(fl * SL_COUNT + here.trailing_zeros() as usize);
        }
        let above = self.fl_bitmap & (!0u32).checked_shl(fl as u32 + 1).unwrap_or(0);
        if above == 0 {
            return None;
        }
        let fl = above.trailing_zeros() as usize;
        Some(fl * SL_COUNT + self.sl_bitmap[fl].trailing_zeros() as usize)
    }

    /// Marks `h..h + n` as one free run and lists it.
    fn set_free(&mut self, h: u32, n: u32) {
        if n > 1 {
            let tail = &mut self.meta[(h + n - 1) as usize];
            tail.kind = Kind::FreeTail;
            tail.head = h;
        }
        let (fl, sl) = mapping(u64::from(n));
        let i = fl * SL_COUNT + sl;
        let old = self.heads[i];
        let m = &mut self.meta[h as usize];
        m.kind = Kind::FreeHead;
        m.len = n;
        m.prev = NIL;
        m.next = old;
        if old != NIL {
            self.meta[old as usize].prev = h;
        }
        self.heads[i] = h;
        self.sl_bitmap[fl] |= 1 << sl;
        self.fl_bitmap |= 1 << fl;
    }

    fn unlink(&mut self, h: u32) {
        let PageMeta {
            prev, next, len, ..
        } = self.meta[h as usize];
        if next != NIL {
            self.meta[next as usize].prev = prev;
        }
        if prev != NIL {
            self.meta[prev as usize].next = next;
            return;
        }
        let (fl, sl) = mapping(u64::from(len));
        self.heads[fl * SL_COUNT + sl] = next;
        if next == NIL {
            self.sl_bitmap[fl] &= !(1 << sl);
            if self.sl_bitmap[fl] == 0 {
                self.fl_bitmap &= !(1 << fl);
            }
        }
    }
}

/// TLSF list of a run of `n >= 1` pages: exact below 16, then 16 lists per
/// power of two.
fn mapping(n: u64) -> (usize, usize) {
    if n < SL_COUNT as u64 {
        return (0, n as usize);
    }
    let f = n.ilog2();
    (
        (f - SL_BITS + 1) as usize,
        (n >> (f - SL_BITS)) as usize - SL_COUNT,
    )
}

/// Smallest length whose list holds only runs of at least `n` pages.
fn round_to_list(n: u64) -> u64 {
    if n < SL_COUNT as u64 {
        return n;
    }
    n + (1 << (n.ilog2() - SL_BITS)) - 1
}
