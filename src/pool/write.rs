//! Writing a pending allocation: memory and quota reserved for a key ([`Pool::alloc`]), its
//! bytes written under disjoint claims ([`Pool::begin_write_range`]), and the one-step put.

use std::sync::atomic::Ordering;

use crate::addr::GlobalAddr;
use crate::checksum::checksum;
use crate::error::{AddrFault, PoolError};
use crate::segment::Segment;
use crate::seqlock;

use super::pending::Pending;
use super::{Commit, Millis, Pool};

/// Bounds the work of one allocation under memory pressure.
const MAX_EVICTIONS_PER_ALLOC: usize = 4096;

impl Pool {
    /// Reserves memory for a `len`-byte value of `key` and returns the address to write it to.
    /// The object stays invisible until [`Pool::commit`]. Evicts (LRU, skipping pinned, leased
    /// and in-use objects) when the namespace's quota or the pool is full.
    pub fn alloc(
        &self,
        ns: u32,
        key: &[u8],
        len: u64,
        pin: bool,
        now: Millis,
    ) -> Result<GlobalAddr, PoolError> {
        self.alloc_in_chain(ns, key, len, pin, 0, now)
    }

    /// [`Pool::alloc`] for block `depth` of a prefix chain (0 for its first block): the
    /// namespace's eviction policy may use the depth (`prefix-aware` evicts deep blocks first).
    pub fn alloc_in_chain(
        &self,
        ns: u32,
        key: &[u8],
        len: u64,
        pin: bool,
        depth: u32,
        now: Millis,
    ) -> Result<GlobalAddr, PoolError> {
        let space = self.ns(ns)?;
        self.check_key(key)?;
        let segments = self.ns_segments[ns as usize].clone();
        let own = segments.start != 0;
        let size = self
            .alloc_lock(segments.start)
            .reserved_size(len)
            .ok_or(PoolError::TooLarge)?;
        let mut evicted = 0;
        let near = self.shard_of(key);
        // Room within the namespace's limit: made by evicting its own objects, or, for a
        // namespace sharing the unreserved memory, those of the others sharing it. Never from a
        // namespace's reservation on behalf of another.
        while !self.reserve(space, size) {
            let shared = !space.reserved;
            if evicted >= MAX_EVICTIONS_PER_ALLOC || !self.evict_for(ns, shared, near, now) {
                return Err(if space.reserved {
                    PoolError::QuotaExceeded
                } else {
                    PoolError::PoolFull
                });
            }
            evicted += 1;
        }
        // Every namespace within its limit fits in the pool, so this fails only when the free
        // memory is too scattered (or held in slabs of other sizes): then the namespace's own
        // objects go first, then (in the common segments) those in unreserved memory.
        let (segment, block) = loop {
            if let Some(found) = self.try_allocate(segments.clone(), len) {
                break found;
            }
            if evicted >= MAX_EVICTIONS_PER_ALLOC || !self.evict_for(ns, !own, near, now) {
                self.unreserve(space, size);
                return Err(PoolError::PoolFull);
            }
            evicted += 1;
        };
        debug_assert_eq!(block.size, size);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let word = self.segments[segment]
            .segment
            .version(block.offset)
            .expect("granule aligned");
        seqlock::begin(word, generation);
        self.pending_lock(generation).by_generation.insert(
            generation,
            Pending {
                ns,
                key: key.into(),
                segment: segment as u16,
                offset: block.offset,
                len,
                size,
                deadline: now.saturating_add(self.pending_timeout),
                pin,
                depth,
                claims: Default::default(),
                committing: false,
                cancelled: false,
            },
        );
        Ok(self.address(segment as u16, block.offset, len, generation))
    }

    /// Opens a whole pending allocation for writing (see [`Pool::begin_write_range`]).
    pub fn begin_write(&self, addr: &GlobalAddr) -> Result<PendingWrite<'_>, PoolError> {
        self.begin_write_range(addr, 0, addr.len)
    }

    /// Opens bytes `[offset, offset + len)` of a pending allocation for writing. While the
    /// returned guard lives the allocation can't be reclaimed, committed or aborted, and no other
    /// write may open a range that overlaps this one: such a write gets [`AddrFault::Busy`], so
    /// two writers never hold the same bytes.
    pub fn begin_write_range(
        &self,
        addr: &GlobalAddr,
        offset: u64,
        len: u64,
    ) -> Result<PendingWrite<'_>, PoolError> {
        let seg = self.check_addr(addr)?;
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= addr.len)
            .ok_or(AddrFault::OutOfBounds)?;
        let mut p = self.pending_lock(addr.generation);
        let Some(entry) = p.by_generation.get_mut(&addr.generation) else {
            drop(p);
            return Err(self.gone(addr));
        };
        if entry.offset != addr.offset || entry.len != addr.len || entry.committing {
            return Err(AddrFault::NotWritable.into());
        }
        if entry.cancelled {
            return Err(PoolError::Cancelled);
        }
        if !entry.claims.try_claim(offset, end) {
            return Err(AddrFault::Busy.into());
        }
        Ok(PendingWrite {
            pool: self,
            segment: &seg.segment,
            addr: *addr,
            start: offset,
            end,
            deadline: entry.deadline,
        })
    }

    /// One-sided write of `bytes` at `offset` inside a pending allocation. Fails with
    /// [`AddrFault::Busy`] while another write holds an overlapping range.
    pub fn write(&self, addr: &GlobalAddr, offset: u64, bytes: &[u8]) -> Result<(), PoolError> {
        let mut w = self.begin_write_range(addr, offset, bytes.len() as u64)?;
        w.bytes_mut().copy_from_slice(bytes);
        Ok(())
    }

    /// Stores `value` under `key` in one step (alloc, copy, commit).
    pub fn put(
        &self,
        ns: u32,
        key: &[u8],
        value: &[u8],
        pin: bool,
        now: Millis,
    ) -> Result<GlobalAddr, PoolError> {
        let addr = self.alloc(ns, key, value.len() as u64, pin, now)?;
        self.write(&addr, 0, value)?;
        self.commit(Commit::new(&addr, checksum(value)))?;
        Ok(addr)
    }

    /// Is the allocation of `generation` still pending (neither committed, aborted, cancelled
    /// and freed, nor reaped)? A server counts a connection's allocations with it.
    pub fn is_pending(&self, generation: u64) -> bool {
        self.pending_lock(generation)
            .by_generation
            .contains_key(&generation)
    }

    /// Allocates `len` bytes in one of `segments`, trying them round robin.
    fn try_allocate(
        &self,
        segments: std::ops::Range<usize>,
        len: u64,
    ) -> Option<(usize, crate::alloc::Block)> {
        let n = segments.len().max(1);
        let start = self.segment_cursor.fetch_add(1, Ordering::Relaxed) % n;
        let found = (0..n)
            .map(|i| segments.start + (start + i) % n)
            .find_map(|s| self.alloc_lock(s).allocate(len).map(|b| (s, b)));
        if let Some((s, b)) = &found {
            // Before anyone writes the block, outside the allocator's lock.
            if self.segments[*s].segment.back_block(b.offset, b.size) {
                if let Some(w) = self.prefault.get() {
                    w.wake();
                }
            }
        }
        found
    }
}

/// An open write of a range of a pending allocation (see [`Pool::begin_write_range`]).
pub struct PendingWrite<'a> {
    pool: &'a Pool,
    segment: &'a Segment,
    pub(super) addr: GlobalAddr,
    /// The claimed range, in bytes from the allocation's start.
    pub(super) start: u64,
    pub(super) end: u64,
    deadline: Millis,
}

impl PendingWrite<'_> {
    /// The claimed bytes, for filling in place (for instance straight from a socket).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: in bounds: check_addr put the allocation inside the segment and
        // begin_write_range put [start, end) inside the allocation. Exclusive: this guard holds
        // the claim on [start, end) in the allocation's pending entry, granted under the pending
        // table's lock only because no other claim overlapped it, and released only when the
        // guard drops; the slice borrows the guard mutably, so it is the only slice of these
        // bytes in this process. The memory stays allocated meanwhile: commit, abort and reap
        // refuse an allocation with a claim, and it is not in the index, so nothing reads it
        // as an object (one-sided reads see the busy version word and copy through raw pointers
        // only to discard what they copied).
        unsafe {
            self.segment
                .data_mut(self.addr.offset + self.start, self.end - self.start)
        }
    }

    /// When the allocation is reclaimed if not committed, on the pool's clock: a write still
    /// open then should give up (drop this guard) so the reaper can take it.
    pub fn deadline(&self) -> Millis {
        self.deadline
    }
}

impl Drop for PendingWrite<'_> {
    fn drop(&mut self) {
        if let Some(p) = self
            .pool
            .pending_lock(self.addr.generation)
            .by_generation
            .get_mut(&self.addr.generation)
        {
            p.claims.release(self.start, self.end);
        }
    }
}
