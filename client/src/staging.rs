//! A same-host writer's staging area: where values go when the node maps its segments
//! read-only (`memory.same_host_writes`, docs/SECURITY.md "Same host"). The client copies each
//! value into a range of the area and names the range in `CommitStaged`; the node copies it
//! into the value's allocation and commits it. Ranges are handed out first-fit to the calls of
//! every thread at once and given back after their commit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use memmap2::MmapRaw;

use crate::conn::Conn;

/// Ranges are handed out in multiples of this (so a free list of a busy area stays short).
const GRAIN: u64 = 4096;

pub(crate) struct StagingArea {
    /// The node's name for it.
    pub(crate) id: u64,
    map: MmapRaw,
    free: FreeList,
    /// The node retired it (the connection that holds it closed): none of it may be used.
    retired: AtomicBool,
    /// The connection the area lives as long as; never used for requests.
    _holder: Mutex<Conn>,
}

/// A range of the area, given back by [`StagingArea::give_back`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) start: u64,
    len: u64,
}

/// Free ranges `(start, len)`, sorted by start, never adjacent.
struct FreeList(Mutex<Vec<(u64, u64)>>);

impl FreeList {
    fn new(len: u64) -> FreeList {
        FreeList(Mutex::new(vec![(0, len)]))
    }

    /// A range of at least `len` bytes (a multiple of [`GRAIN`]), first fit.
    fn take(&self, len: u64) -> Option<Range> {
        let want = len.max(1).div_ceil(GRAIN).checked_mul(GRAIN)?;
        let mut free = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.iter().position(|&(_, l)| l >= want)?;
        let (start, l) = free[i];
        if l == want {
            free.remove(i);
        } else {
            free[i] = (start + want, l - want);
        }
        Some(Range { start, len: want })
    }

    fn give_back(&self, r: Range) {
        let mut free = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.partition_point(|&(s, _)| s < r.start);
        free.insert(i, (r.start, r.len));
        // Merge with the next, then with the previous.
        if i + 1 < free.len() && free[i].0 + free[i].1 == free[i + 1].0 {
            free[i].1 += free[i + 1].1;
            free.remove(i + 1);
        }
        if i > 0 && free[i - 1].0 + free[i - 1].1 == free[i].0 {
            free[i - 1].1 += free[i].1;
            free.remove(i);
        }
    }
}

impl StagingArea {
    /// The area of `id`, mapped from `file` (`len` bytes), alive while `holder` is open.
    pub(crate) fn new(
        id: u64,
        len: u64,
        file: &std::fs::File,
        holder: Conn,
    ) -> std::io::Result<StagingArea> {
        let map = memmap2::MmapOptions::new()
            .len(len as usize)
            .map_raw(file)?;
        Ok(StagingArea {
            id,
            map,
            free: FreeList::new(len),
            retired: AtomicBool::new(false),
            _holder: Mutex::new(holder),
        })
    }

    /// False once the node said it retired the area.
    pub(crate) fn usable(&self) -> bool {
        !self.retired.load(Ordering::Acquire)
    }

    /// Marks the area retired: later puts go over the socket.
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// A free range of at least `len` bytes, if there is one now.
    pub(crate) fn take(&self, len: u64) -> Option<Range> {
        self.usable().then(|| self.free.take(len)).flatten()
    }

    /// Gives `r` back.
    pub(crate) fn give_back(&self, r: Range) {
        self.free.give_back(r);
    }

    /// Copies `src` to the start of `r` (taken for at least its length).
    pub(crate) fn fill(&self, r: Range, src: &[u8]) {
        assert!(src.len() as u64 <= r.len, "a value larger than its range");
        // SAFETY: `r` lies inside the mapping (the free list carves ranges out of [0, len))
        // and was taken by this caller alone: no other thread of this process copies into it
        // until it is given back. The mapping is read-write and lives as long as `self`. The
        // node only reads it; a raw copy of plain bytes asserts nothing about other processes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(r.start as usize),
                src.len(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random takes and gives against the invariants: ranges stay inside the area, never
    /// overlap, and everything given back merges into one range again.
    #[test]
    fn ranges_never_overlap_and_merge_back() {
        let len = 64 * GRAIN;
        let list = FreeList::new(len);
        let mut taken: Vec<Range> = Vec::new();
        let mut seed = 7u64;
        for round in 0..5000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if seed % 3 != 0 || taken.is_empty() {
                let want = 1 + (seed >> 33) % (8 * GRAIN);
                if let Some(r) = list.take(want) {
                    assert!(r.len >= want && r.start + r.len <= len);
                    for o in &taken {
                        assert!(
                            r.start + r.len <= o.start || o.start + o.len <= r.start,
                            "round {round}: {r:?} overlaps {o:?}"
                        );
                    }
                    taken.push(r);
                }
            } else {
                let i = (seed >> 40) as usize % taken.len();
                list.give_back(taken.swap_remove(i));
            }
        }
        for r in taken.drain(..) {
            list.give_back(r);
        }
        assert_eq!(*list.0.lock().unwrap(), vec![(0, len)]);
        assert!(list.take(len + 1).is_none(), "nothing larger than the area");
    }
}
