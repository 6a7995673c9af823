//! Size-class allocator of byte offsets inside one memory segment.
//!
//! The allocator hands out `[offset, offset + size)` ranges of a segment it
//! never touches: it owns no memory and uses no `unsafe`. Callers wrap it in a
//! lock, so every method takes `&mut self`.
//!
//! # Design
//!
//! The segment is cut into pages (`page_size`, 64 KiB by default). Per-page
//! metadata, free-list heads and the slot bitmap are all allocated in
//! [`Allocator::new`]; [`Allocator::allocate`] and [`Allocator::free`] never
//! allocate and run in constant time (fixed-width bitmap scans, a bounded
//! number of list operations, never a walk over blocks or pages).
//!
//! * **Large blocks** (above the largest small class, just under a page) take
//!   a run of whole pages from a TLSF-style heap: free runs sit in two-level
//!   segregated lists (log2, then 16 subdivisions) found through bitmaps. A
//!   request takes a run from a list whose runs are all long enough and the
//!   rest is split off; a freed run merges with free neighbours through
//!   boundary tags, so freeing everything leaves one run of the whole capacity.
//! * **Small blocks** use geometric size classes (multiples of the granule,
//!   four per power of two, at most 25% internal waste). A slab is a run of
//!   1..=16 pages picked per class to keep tail waste small; its slots are
//!   tracked by a bitmap, and partially full slabs of each class are linked
//!   through the page metadata. An emptied slab goes back to the page heap,
//!   except that one empty slab per class is kept to avoid churn. Cached slabs
//!   count as free, and are given back whenever a page request would
//!   otherwise fail (or on [`Allocator::trim`]).
//!
//! # Invariants
//!
//! * Every block offset is a multiple of `granule` (slabs start on page
//!   boundaries and class sizes are granule multiples); blocks never overlap
//!   and lie inside `[0, capacity)`.
//! * A page's kind is exact at every run boundary: heads of free runs, large
//!   blocks and slabs, tails of free runs, and every slab page; all others are
//!   `Interior`. So a bogus offset (double free, interior, unallocated) is
//!   always recognised and rejected instead of corrupting state.
//! * No two free runs are adjacent.
//! * Statistics are maintained exactly on every operation.

mod classes;
mod pages;
mod slab;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_model;

use classes::Classes;
use pages::{Kind, PageHeap};
use slab::Slabs;

/// Geometry of an [`Allocator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocConfig {
    /// Page size in bytes: a power of two, at least `8 * granule`, at most 16 MiB.
    /// Large blocks are whole pages; slabs are 1..=16 pages.
    pub page_size: u64,
    /// Alignment and smallest block size in bytes: a power of two, at least 64.
    pub granule: u64,
}

impl Default for AllocConfig {
    fn default() -> AllocConfig {
        AllocConfig {
            page_size: 64 * 1024,
            granule: 512,
        }
    }
}

impl AllocConfig {
    /// Checks the constraints documented on the fields.
    pub fn validate(&self) -> Result<(), AllocError> {
        if !self.granule.is_power_of_two() || self.granule < 64 {
            return Err(AllocError::BadConfig(
                "granule must be a power of two >= 64",
            ));
        }
        if !self.page_size.is_power_of_two() {
            return Err(AllocError::BadConfig("page_size must be a power of two"));
        }
        if self.page_size < 8 * self.granule {
            return Err(AllocError::BadConfig(
                "page_size must be at least 8 granules",
            ));
        }
        if self.page_size > 16 << 20 {
            return Err(AllocError::BadConfig("page_size must be at most 16 MiB"));
        }
        Ok(())
    }
}

/// A reserved range of the segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Start of the block, a multiple of the granule.
    pub offset: u64,
    /// Bytes reserved, at least the requested length.
    pub size: u64,
}

/// Errors reported by the allocator.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The configuration or capacity is unusable.
    #[error("bad allocator configuration: {0}")]
    BadConfig(&'static str),
    /// The offset is not the start of a live block (double free, interior
    /// offset, or never allocated).
    #[error("offset {offset} is not the start of a live block")]
    NotAllocated {
        /// The offending offset.
        offset: u64,
    },
    /// The offset lies beyond the managed capacity.
    #[error("offset {offset} is outside the allocator's capacity of {capacity} bytes")]
    OutOfRange {
        /// The offending offset.
        offset: u64,
        /// The allocator's capacity.
        capacity: u64,
    },
}

/// An exact snapshot of the allocator's occupancy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Managed bytes (a multiple of the page size).
    pub capacity: u64,
    /// Sum of the sizes of live blocks.
    pub used_bytes: u64,
    /// `capacity - used_bytes`, including free slots and cached empty slabs.
    pub free_bytes: u64,
    /// Number of live blocks.
    pub live_blocks: u64,
    /// Longest run of free pages, in bytes (cached empty slabs excluded).
    pub largest_free_run: u64,
    /// Bytes of pages owned by slabs, cached empty slabs included.
    pub slab_bytes: u64,
    /// Bytes of free slots inside those slabs.
    pub slab_free_bytes: u64,
}

impl AllocStats {
    /// `1 - largest_free_run / free_bytes`: 0 when free space is one run (or
    /// there is none), close to 1 when it is scattered.
    pub fn external_fragmentation(&self) -> f64 {
        if self.free_bytes == 0 {
            return 0.0;
        }
        1.0 - self.largest_free_run as f64 / self.free_bytes as f64
    }
}

/// Allocator of granule-aligned byte ranges inside one segment.
pub struct Allocator {
    config: AllocConfig,
    capacity: u64,
    page_shift: u32,
    heap: PageHeap,
    slabs: Slabs,
    used_bytes: u64,
    live_blocks: u64,
}

impl std::fmt::Debug for Allocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator")
            .field("config", &self.config)
            .field("capacity", &self.capacity)
            .field("used_bytes", &self.used_bytes)
            .field("live_blocks", &self.live_blocks)
            .finish_non_exhaustive()
    }
}

impl Allocator {
    /// An allocator for `capacity` bytes rounded down to a whole number of
    /// pages. Fails on an invalid config, on less than one page, or on more
    /// than `u32::MAX - 1` pages. All metadata is allocated here.
    pub fn new(capacity: u64, config: AllocConfig) -> Result<Allocator, AllocError> {
        config.validate()?;
        let pages = capacity / config.page_size;
        if pages == 0 {
            return Err(AllocError::BadConfig("capacity is smaller than one page"));
        }
        let pages = u32::try_from(pages)
            .ok()
            .filter(|&p| p < u32::MAX)
            .ok_or(AllocError::BadConfig("capacity has too many pages"))?;
        let classes = Classes::new(config.page_size, config.granule, u64::from(pages));
        Ok(Allocator {
            config,
            capacity: u64::from(pages) * config.page_size,
            page_shift: config.page_size.trailing_zeros(),
            heap: PageHeap::new(pages),
            slabs: Slabs::new(classes, pages, config.page_size, config.granule),
            used_bytes: 0,
            live_blocks: 0,
        })
    }

    /// Reserves at least `len` bytes (0 counts as 1); `None` when there is no room.
    pub fn allocate(&mut self, len: u64) -> Option<Block> {
        let len = len.max(1);
        let block = if let Some(c) = self.slabs.class_for(len) {
            let offset = self.slabs.allocate(&mut self.heap, c)?;
            Block {
                offset,
                size: self.slabs.class_size(c),
            }
        } else {
            let pages = self.pages_for(len)?;
            let h = match self.heap.alloc_run(pages) {
                Some(h) => h,
                None if self.slabs.trim(&mut self.heap) > 0 => self.heap.alloc_run(pages)?,
                None => return None,
            };
            let m = &mut self.heap.meta[h as usize];
            m.kind = Kind::Large;
            m.len = pages;
            Block {
                offset: u64::from(h) << self.page_shift,
                size: u64::from(pages) << self.page_shift,
            }
        };
        self.used_bytes += block.size;
        self.live_blocks += 1;
        Some(block)
    }

    /// Frees the live block starting at `offset` and returns it. Anything else
    /// (double free, interior or out-of-range offset) is an error and changes
    /// nothing.
    pub fn free(&mut self, offset: u64) -> Result<Block, AllocError> {
        let block = match self.locate(offset)? {
            Found::Large { page, pages } => {
                self.heap.free_run(page, pages);
                Block {
                    offset,
                    size: u64::from(pages) << self.page_shift,
                }
            }
            Found::Slot { head, slot, class } => Block {
                offset,
                size: self.slabs.free(&mut self.heap, head, slot, class),
            },
        };
        self.used_bytes -= block.size;
        self.live_blocks -= 1;
        Ok(block)
    }

    /// The live block starting exactly at `offset`, if any.
    pub fn block_at(&self, offset: u64) -> Option<Block> {
        let size = match self.locate(offset).ok()? {
            Found::Large { pages, .. } => u64::from(pages) << self.page_shift,
            Found::Slot { class, .. } => self.slabs.class_size(class),
        };
        Some(Block { offset, size })
    }

    /// Bytes `allocate(len)` would reserve, `None` if that exceeds the capacity.
    pub fn reserved_size(&self, len: u64) -> Option<u64> {
        let len = len.max(1);
        match self.slabs.class_for(len) {
            Some(c) => Some(self.slabs.class_size(c)),
            None => self.pages_for(len).map(|p| u64::from(p) << self.page_shift),
        }
    }

    /// Gives cached empty slabs back to the page heap so that free space is as
    /// contiguous as possible; returns the bytes released. Page requests do
    /// this by themselves when they would otherwise fail.
    pub fn trim(&mut self) -> u64 {
        self.slabs.trim(&mut self.heap) << self.page_shift
    }

    /// An exact snapshot of occupancy. Finding the longest free run may walk
    /// one free list, so this is not meant for the allocation hot path.
    pub fn stats(&self) -> AllocStats {
        AllocStats {
            capacity: self.capacity,
            used_bytes: self.used_bytes,
            free_bytes: self.capacity - self.used_bytes,
            live_blocks: self.live_blocks,
            largest_free_run: u64::from(self.heap.largest_free_run()) << self.page_shift,
            slab_bytes: self.slabs.slab_pages << self.page_shift,
            slab_free_bytes: self.slabs.free_slot_bytes,
        }
    }

    /// Managed bytes: the requested capacity rounded down to whole pages.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Alignment and smallest block size.
    pub fn granule(&self) -> u64 {
        self.config.granule
    }

    /// Page size: the unit of large blocks and slabs.
    pub fn page_size(&self) -> u64 {
        self.config.page_size
    }

    /// Pages for a large request of `len` bytes, `None` beyond the capacity.
    fn pages_for(&self, len: u64) -> Option<u32> {
        if len > self.capacity {
            return None;
        }
        Some(len.div_ceil(self.config.page_size) as u32)
    }

    fn locate(&self, offset: u64) -> Result<Found, AllocError> {
        if offset >= self.capacity {
            return Err(AllocError::OutOfRange {
                offset,
                capacity: self.capacity,
            });
        }
        let page = (offset >> self.page_shift) as u32;
        let m = &self.heap.meta[page as usize];
        let found = match m.kind {
            Kind::Large if offset & (self.config.page_size - 1) == 0 => {
                Some(Found::Large { page, pages: m.len })
            }
            Kind::SlabHead | Kind::SlabMember => {
                self.slabs
                    .find(&self.heap, m.head, offset)
                    .map(|(slot, class)| Found::Slot {
                        head: m.head,
                        slot,
                        class,
                    })
            }
            _ => None,
        };
        found.ok_or(AllocError::NotAllocated { offset })
    }
}

/// Where a live block sits.
enum Found {
    Large { page: u32, pages: u32 },
    Slot { head: u32, slot: u32, class: usize },
}
