//! Reading committed objects: held by reference while streamed ([`Pool::get_ref`]), copied,
//! held or leased for readers outside the daemon, probed as a prefix run, and one-sided reads
//! by address under the object's version word.

use std::sync::atomic::Ordering;

use crate::addr::GlobalAddr;
use crate::error::{AddrFault, PoolError};
use crate::seqlock;

use super::index::{self, Entry};
use super::{Millis, Pool};

/// A committed object as found by a lookup: where it is and its checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Located {
    /// Its signed address.
    pub addr: GlobalAddr,
    /// xxh3-64 of its bytes.
    pub checksum: u64,
}

impl Pool {
    /// Finds a committed object and holds it for reading: until the returned reference is
    /// dropped the memory can't be evicted or reused, so its bytes can be streamed as they are.
    pub fn get_ref<'a>(
        &'a self,
        ns: u32,
        key: &'a [u8],
        _now: Millis,
    ) -> Result<ObjectRef<'a>, PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let Some(e) = shard.ns[ns as usize].get(key, self.tick()) else {
            self.count_read(ns, false);
            return Err(PoolError::NotFound);
        };
        if e.readers == u16::MAX {
            // So many concurrent readers of one object: let this one miss rather than wrap.
            self.count_read(ns, false);
            return Err(PoolError::NotFound);
        }
        e.readers += 1;
        let e = *e;
        drop(shard);
        self.count_read(ns, true);
        Ok(ObjectRef {
            pool: self,
            ns,
            key,
            entry: e,
        })
    }

    /// Finds a committed object and holds it for a reader outside the daemon (a same-host
    /// process that maps its memory): until [`Pool::unhold`] with the generation of the
    /// returned address, the object is neither evicted nor its memory reused; a removal or an
    /// overwrite takes it out of the index at once but parks its memory (see
    /// [`Pool::get_ref`]). None when absent, or held by `u16::MAX` readers already.
    pub fn hold(&self, ns: u32, key: &[u8]) -> Result<Option<Located>, PoolError> {
        self.locate_with(ns, key, |e| {
            if e.readers == u16::MAX {
                return false;
            }
            e.readers += 1;
            true
        })
    }

    /// Finds a committed object, counting the read, and lets `take` mark its entry (under the
    /// shard's lock); an object `take` refuses counts as a miss.
    fn locate_with(
        &self,
        ns: u32,
        key: &[u8],
        take: impl FnOnce(&mut index::Entry) -> bool,
    ) -> Result<Option<Located>, PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        let found = shard.ns[ns as usize]
            .get(key, self.tick())
            .and_then(|e| take(e).then_some(*e));
        drop(shard);
        self.count_read(ns, found.is_some());
        Ok(found.map(|e| Located {
            addr: self.address(e.segment, e.offset, e.len, e.generation),
            checksum: e.checksum,
        }))
    }

    /// Ends one [`Pool::hold`] of generation `generation` of `key`: frees the memory when the
    /// object was removed meanwhile and this was its last reader.
    pub fn unhold(&self, ns: u32, key: &[u8], generation: u64) -> Result<(), PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        self.release_reader(ns, key, generation);
        Ok(())
    }

    /// Copies an object's bytes into `dst` (which must be at least as long); returns its length.
    pub fn get_into(
        &self,
        ns: u32,
        key: &[u8],
        dst: &mut [u8],
        now: Millis,
    ) -> Result<usize, PoolError> {
        let r = self.get_ref(ns, key, now)?;
        let bytes = r.bytes();
        let out = dst.get_mut(..bytes.len()).ok_or(AddrFault::OutOfBounds)?;
        out.copy_from_slice(bytes);
        Ok(bytes.len())
    }

    /// The object's bytes, copied.
    pub fn get(&self, ns: u32, key: &[u8], now: Millis) -> Result<Vec<u8>, PoolError> {
        Ok(self.get_ref(ns, key, now)?.bytes().to_vec())
    }

    /// Length of the leading run of `keys` that are present (what prefix lookups need),
    /// counted in the namespace's prefix statistics. Does not change recency.
    pub fn exists_prefix<'k>(
        &self,
        ns: u32,
        keys: impl IntoIterator<Item = &'k [u8]>,
    ) -> Result<usize, PoolError> {
        let space = self.ns(ns)?;
        let mut keys = keys.into_iter();
        let mut asked = 0;
        let n = self.present_prefix(ns, keys.by_ref().inspect(|_| asked += 1))?;
        asked += keys.count();
        space
            .prefix_blocks
            .fetch_add(asked as u64, Ordering::Relaxed);
        space.prefix_hits.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// [`Pool::exists_prefix`] without counting anything: the length of the leading run of
    /// `keys` that are present, in DRAM or in the tier under it. Takes keys up to the first
    /// absent one. Does not change recency.
    pub fn present_prefix<'k>(
        &self,
        ns: u32,
        keys: impl IntoIterator<Item = &'k [u8]>,
    ) -> Result<usize, PoolError> {
        self.ns(ns)?;
        let mut n = 0;
        for key in keys {
            self.check_key(key)?;
            let shard = self.shard_lock(key);
            let here = shard.ns[ns as usize].contains(key)
                || self.lower.get().is_some_and(|t| t.holds(ns, key));
            if !here {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Finds an object for one-sided reads and leases it for `lease_ms` (capped by the pool's
    /// maximum; 0 takes no lease): eviction won't recycle it before the lease ends.
    pub fn lookup(
        &self,
        ns: u32,
        key: &[u8],
        lease_ms: Millis,
        now: Millis,
    ) -> Result<Option<Located>, PoolError> {
        let max_lease = self.max_lease;
        self.locate_with(ns, key, |e| {
            if lease_ms > 0 {
                e.lease_until = e
                    .lease_until
                    .max(now.saturating_add(lease_ms.min(max_lease)));
            }
            true
        })
    }

    /// Ends the lease on an object (leases are per object, not per holder). Returns whether the
    /// object exists.
    pub fn release(&self, ns: u32, key: &[u8]) -> Result<bool, PoolError> {
        self.ns(ns)?;
        self.check_key(key)?;
        let mut shard = self.shard_lock(key);
        Ok(shard.ns[ns as usize]
            .peek_mut(key)
            .map(|e| e.lease_until = 0)
            .is_some())
    }

    /// One-sided read: copies `dst.len()` bytes at `offset` of the object at `addr` into `dst`.
    /// Never touches the index: checks node, segment, memory key and bounds, then copies under
    /// the object's version word, so a read that raced with eviction and reuse is reported as
    /// [`AddrFault::Stale`] instead of returning foreign bytes.
    pub fn read(&self, addr: &GlobalAddr, offset: u64, dst: &mut [u8]) -> Result<(), PoolError> {
        let seg = self.check_addr(addr)?;
        let at = addr
            .sub_range(offset, dst.len() as u64)
            .ok_or(AddrFault::OutOfBounds)?;
        let word = seg
            .segment
            .version(addr.offset)
            .ok_or(AddrFault::OutOfBounds)?;
        if !seqlock::read_begin(word, addr.generation) {
            return Err(AddrFault::Stale.into());
        }
        seg.segment.copy_out_racy(at, dst);
        if !seqlock::read_validate(word, addr.generation) {
            return Err(AddrFault::Stale.into());
        }
        Ok(())
    }

    fn release_reader(&self, ns: u32, key: &[u8], generation: u64) {
        let zombie = self
            .shard_lock(key)
            .release_reader(ns as usize, key, generation);
        if let Some(z) = zombie {
            self.free_block(z.ns, z.segment, z.offset, z.generation, z.pinned);
        }
    }
}

/// A committed object held for reading (see [`Pool::get_ref`]).
pub struct ObjectRef<'a> {
    pool: &'a Pool,
    ns: u32,
    key: &'a [u8],
    entry: Entry,
}

impl ObjectRef<'_> {
    /// The object's bytes, straight from segment memory.
    pub fn bytes(&self) -> &[u8] {
        let seg = &self.pool.segments[self.entry.segment as usize].segment;
        // SAFETY: the range was bounds-checked when allocated; this reference's reader count
        // keeps the block from being freed (eviction refuses it, removal parks it as a zombie),
        // and nothing in this process writes a committed object: it has no pending entry, so
        // `begin_write_range` refuses it.
        unsafe { seg.data(self.entry.offset, self.entry.len) }
    }

    /// The object's generation (see [`Pool::provenance`]).
    pub fn generation(&self) -> u64 {
        self.entry.generation
    }

    /// True when the object is pinned.
    pub fn pinned(&self) -> bool {
        self.entry.pinned
    }

    /// xxh3-64 of the bytes, as checked at commit.
    pub fn checksum(&self) -> u64 {
        self.entry.checksum
    }

    /// The object's signed address.
    pub fn addr(&self) -> GlobalAddr {
        let e = &self.entry;
        self.pool.address(e.segment, e.offset, e.len, e.generation)
    }
}

impl Drop for ObjectRef<'_> {
    fn drop(&mut self) {
        self.pool
            .release_reader(self.ns, self.key, self.entry.generation);
    }
}
