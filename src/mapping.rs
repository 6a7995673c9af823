//! Segment mappings placed for huge pages, and the huge-page backing of a segment's data area.
//!
//! A value a node sends over a socket is copied by the kernel out of the segment, and one a
//! same-host client reads is copied out of its own mapping: with normal pages, every 4 KiB of
//! it is a TLB entry to find, and on a virtual machine a TLB miss walks two page tables. On this
//! project's VM type, a node whose segment was backed by 2 MiB pages served 64 KiB gets over
//! loopback TCP at twice the rate of one on 4 KiB pages
//! (docs/BENCHMARKS.md, "What the design choices are worth").
//!
//! The default segment is a file on `/dev/shm`, so that same-host clients can map it, and most
//! kernels never give a tmpfs file transparent huge pages on their own (`shmem_enabled` is
//! `never` and `/dev/shm` is mounted without `huge=`). `MADV_COLLAPSE` (Linux 6.1) collapses a
//! range of a file mapping into huge pages whatever those settings say, unless they are `deny`.
//! Two things make it work here:
//!
//! * the file is mapped at a 2 MiB-aligned address ([`AlignedMap`]): a huge page can only be
//!   mapped where the address and the file offset agree modulo 2 MiB, and the data area starts
//!   at a 2 MiB file offset (`DATA_ALIGN` in `segment`);
//! * each 2 MiB region of the data area is collapsed once, when the allocator first hands out a
//!   block in it ([`HugeRegions::back`]), so memory is committed as it is used, as with normal
//!   pages, rather than all of it at start.
//!
//! Collapsing is best effort: a kernel without `MADV_COLLAPSE`, a region the kernel can't find a
//! huge page for, or settings that deny it leave the region on normal pages, which work the
//! same, only slower. The kernel collapses a region that other threads or processes are
//! reading and writing safely (khugepaged does the same to live memory), so no caller waits for
//! anything but its own collapse.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;

/// Size of a huge page (x86-64 and arm64 with 4 KiB base pages): the unit collapsed.
pub const HUGE_PAGE: u64 = 2 << 20;

/// `madvise` advice to collapse a range into huge pages now (Linux 6.1; not yet in `libc`).
const MADV_COLLAPSE: libc::c_int = 25;

/// `madvise` advice to fault a range in for writing, without changing a byte (Linux 5.14).
pub(crate) const MADV_POPULATE_WRITE: libc::c_int = 23;

/// A mapping whose bytes `[base, base + len)` stay mapped while it is borrowed.
///
/// # Safety
/// Implementations must return a base pointer to a mapping at least `mapped_len` bytes long,
/// page aligned, that stays mapped for as long as the implementing value lives.
pub unsafe trait Mapped {
    /// The first mapped byte (page aligned).
    fn base(&self) -> *mut u8;
    /// Bytes mapped from `base`.
    fn mapped_len(&self) -> usize;
}

// SAFETY: an `MmapRaw` owns its mapping, page aligned, until it is dropped.
unsafe impl Mapped for MmapRaw {
    fn base(&self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn mapped_len(&self) -> usize {
        self.len()
    }
}

/// A shared mapping of a file's first `len` bytes at a [`HUGE_PAGE`]-aligned address;
/// unmapped when dropped.
pub struct AlignedMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; what may be read or written
// through it concurrently is the owner's contract (the segment's), as for `MmapRaw`.
unsafe impl Send for AlignedMap {}
// SAFETY: as above.
unsafe impl Sync for AlignedMap {}

// SAFETY: `ptr` is the start of a mapping of `len` bytes (page aligned, since it is
// `HUGE_PAGE` aligned) that only `Drop` unmaps.
unsafe impl Mapped for AlignedMap {
    fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn mapped_len(&self) -> usize {
        self.len
    }
}

impl AlignedMap {
    /// Maps `file`'s first `len` bytes (`len` > 0) shared, read-write or read-only, at an
    /// address that is a multiple of [`HUGE_PAGE`], faulting them all in first with `populate`.
    pub fn map_shared(
        file: &File,
        len: u64,
        writable: bool,
        populate: bool,
    ) -> io::Result<AlignedMap> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("mapping too long"))?;
        let huge = HUGE_PAGE as usize;
        let span = len
            .checked_add(huge)
            .filter(|_| len > 0)
            .ok_or_else(|| io::Error::other("mapping length out of range"))?;
        let reserved = reserve(span)?;
        let start = reserved as usize;
        let aligned = start.next_multiple_of(huge);
        let flags =
            libc::MAP_SHARED | libc::MAP_FIXED | if populate { libc::MAP_POPULATE } else { 0 };
        let prot = match writable {
            true => libc::PROT_READ | libc::PROT_WRITE,
            false => libc::PROT_READ,
        };
        // SAFETY: `[aligned, aligned + len)` lies inside the reservation made above (`aligned`
        // is less than one huge page past its start, and the reservation is `len` plus one huge
        // page long), which this function owns, so MAP_FIXED replaces nothing of anyone else's.
        let mapped = unsafe {
            libc::mmap(
                aligned as *mut libc::c_void,
                len,
                prot,
                flags,
                file.as_raw_fd(),
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // SAFETY: the whole reservation is still ours and unused.
            unsafe { libc::munmap(reserved, span) };
            return Err(e);
        }
        // Give back the reservation's unused head and tail (the mapping's end rounded up to a
        // page, as the kernel maps whole pages).
        let end = (aligned + len).next_multiple_of(page_size());
        // SAFETY: both ranges are parts of the reservation outside the file mapping, page
        // aligned, and used by nothing.
        unsafe {
            if aligned > start {
                libc::munmap(reserved, aligned - start);
            }
            if start + span > end {
                libc::munmap(end as *mut libc::c_void, start + span - end);
            }
        }
        Ok(AlignedMap {
            ptr: NonNull::new(mapped as *mut u8).ok_or_else(|| io::Error::other("null mapping"))?,
            len,
        })
    }

    /// Advises the kernel to back the mapping with transparent huge pages where its settings
    /// allow (`MADV_HUGEPAGE`); false when it refused the advice.
    pub fn advise_huge(&self) -> bool {
        // SAFETY: the range is this value's own mapping; advice changes no contents.
        unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_HUGEPAGE) == 0 }
    }
}

impl Drop for AlignedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping is this value's and nothing borrows it any more (borrows of its
        // bytes are tied to `&self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Reserves `len` bytes of address space, mapped with no access (so nothing can be read or
/// written there), for a caller to map files into with `MAP_FIXED`; the caller unmaps it.
pub fn reserve(len: usize) -> io::Result<*mut libc::c_void> {
    // SAFETY: a fresh anonymous mapping placed by the kernel; it replaces nothing.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    match base {
        libc::MAP_FAILED => Err(io::Error::last_os_error()),
        base => Ok(base),
    }
}

/// The system's page size (4096 when it can't be read).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Which 2 MiB regions of a data area have been collapsed into huge pages (or tried), so each
/// is collapsed once, when first used.
pub struct HugeRegions {
    /// One bit per region: set once its collapse was started.
    tried: Box<[AtomicU64]>,
    /// Regions the kernel collapsed.
    collapsed: AtomicU64,
    /// Regions it did not (no `MADV_COLLAPSE`, no huge page to be had, settings that deny it).
    refused: AtomicU64,
}

impl HugeRegions {
    /// For a data area of `data_len` bytes.
    pub fn new(data_len: u64) -> HugeRegions {
        let regions = data_len.div_ceil(HUGE_PAGE);
        HugeRegions {
            tried: (0..regions.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            collapsed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Collapses into huge pages each region of `[offset, offset + len)` not tried before; the
    /// data area starts at `data` (a [`HUGE_PAGE`]-aligned address) and is `data_len` bytes.
    /// A region past the data area's last whole huge page is left alone.
    ///
    /// # Safety
    /// `[data, data + data_len)` must be mapped for the duration of the call.
    pub unsafe fn back(&self, data: *mut u8, data_len: u64, offset: u64, len: u64) {
        let last = offset.saturating_add(len.max(1)) - 1;
        for region in offset / HUGE_PAGE..=last / HUGE_PAGE {
            let start = region * HUGE_PAGE;
            if start + HUGE_PAGE > data_len {
                break;
            }
            let (word, bit) = ((region / 64) as usize, 1u64 << (region % 64));
            let Some(w) = self.tried.get(word) else { break };
            if w.load(Ordering::Relaxed) & bit != 0 || w.fetch_or(bit, Ordering::Relaxed) & bit != 0
            {
                continue;
            }
            // The kernel collapses only a region with a page in it: the region's first page is
            // faulted in first (a page of a file's hole reads as zeros either way).
            // SAFETY: the region lies inside the mapped data area (checked above, and by the
            // caller's contract), and neither advice changes a byte of it.
            let ok = unsafe {
                let at = data.add(start as usize).cast();
                libc::madvise(at, 4096, MADV_POPULATE_WRITE);
                libc::madvise(at, HUGE_PAGE as usize, MADV_COLLAPSE) == 0
            };
            let counter = if ok { &self.collapsed } else { &self.refused };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Regions collapsed into huge pages, and regions tried that the kernel did not collapse.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.collapsed.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

/// How far the allocator has reached into a data area, and how far ahead of it a background
/// thread has faulted the area in (`Segment::prefault_next`), so that a burst of fresh
/// allocations (a model being published) writes into memory that is already there instead of
/// taking a page fault, and a zeroed page, per 4 KiB (or a collapse per 2 MiB) on its way.
///
/// The window ahead is bounded twice: by the configured bytes, and by the bytes the allocator
/// has reached so far, so an idle node commits nothing beyond what it used and a busy one at
/// most twice that.
#[derive(Default)]
pub struct Frontier {
    /// One past the highest 2 MiB region a block was allocated in.
    reached: AtomicU64,
    /// The next region the prefaulting thread looks at (only that thread moves it).
    next: AtomicU64,
    /// Regions the prefaulting thread faulted in.
    prefaulted: AtomicU64,
}

impl Frontier {
    /// A block `[offset, offset + len)` was allocated; true when it reached a region no block
    /// had reached before (the prefaulting thread may have work).
    pub fn reach(&self, offset: u64, len: u64) -> bool {
        let end = offset.saturating_add(len.max(1)).div_ceil(HUGE_PAGE);
        self.reached.fetch_max(end, Ordering::AcqRel) < end
    }

    /// The next region to fault in, ahead of the allocator by at most `window` bytes and by
    /// at most the regions it reached, among the data area's `regions`; None when there is
    /// nothing to do now. Taking it moves past it: each region is handed out once.
    pub fn take_next(&self, window: u64, regions: u64) -> Option<u64> {
        let reached = self.reached.load(Ordering::Acquire);
        let ahead = (window / HUGE_PAGE).min(reached);
        let r = self.next.load(Ordering::Relaxed).max(reached);
        if r >= reached + ahead || r >= regions {
            return None;
        }
        self.next.store(r + 1, Ordering::Relaxed);
        self.prefaulted.fetch_add(1, Ordering::Relaxed);
        Some(r)
    }

    /// Regions faulted in ahead of the allocator so far.
    pub fn prefaulted(&self) -> u64 {
        self.prefaulted.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Takes every region the frontier hands out now.
    fn drain(f: &Frontier, window: u64, regions: u64) -> Vec<u64> {
        std::iter::from_fn(|| f.take_next(window, regions)).collect()
    }

    #[test]
    fn an_untouched_area_is_never_prefaulted() {
        let f = Frontier::default();
        assert_eq!(drain(&f, 256 * MIB, 512), Vec::<u64>::new());
        assert_eq!(f.prefaulted(), 0);
    }

    #[test]
    fn the_window_is_bounded_by_what_was_reached_and_by_its_bytes() {
        let f = Frontier::default();
        // A block in region 0 only: one region ahead (no more than was reached).
        assert!(f.reach(4096, 8192));
        assert_eq!(drain(&f, 256 * MIB, 512), vec![1]);
        // The same region again: nothing new reached, nothing to do.
        assert!(!f.reach(0, 4096));
        assert_eq!(drain(&f, 256 * MIB, 512), Vec::<u64>::new());
        // Blocks up to 16 MiB: regions 8..16 ahead (region 1 was done already, the ones below
        // the frontier are the allocations' own).
        assert!(f.reach(8 * MIB, 8 * MIB));
        assert_eq!(drain(&f, 256 * MIB, 512), (8..16).collect::<Vec<_>>());
        // Far in: the window's 128 regions, not the 200 reached.
        assert!(f.reach(0, 400 * MIB));
        assert_eq!(drain(&f, 256 * MIB, 512), (200..328).collect::<Vec<_>>());
        assert_eq!(f.prefaulted(), 1 + 8 + 128);
    }

    #[test]
    fn the_window_stops_at_the_area_and_a_zero_window_does_nothing() {
        let f = Frontier::default();
        assert!(f.reach(0, 6 * MIB));
        assert_eq!(drain(&f, 0, 8), Vec::<u64>::new());
        assert_eq!(drain(&f, 256 * MIB, 8), vec![3, 4, 5]);
        // A block ending exactly on a region's end reaches only that region.
        assert!(!f.reach(4 * MIB, 2 * MIB));
    }
}
