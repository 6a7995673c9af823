//! Committing: pending allocations made visible by the one [`Pool::commit`], which takes what
//! varies as a [`Commit`] (one allocation or several, where the hash checked against the
//! checksum comes from, the condition on the key's presence, a write claim turned into the
//! seal).

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use crate::addr::GlobalAddr;
use crate::checksum::checksum;
use crate::error::{AddrFault, PoolError};
use crate::journal::Record;
use crate::seqlock;
use crate::sync::lock;

use super::index::{Entry, Shard};
use super::pending::{Pending, PendingShard};
use super::{PendingWrite, Pool, SegmentSlot};

/// A commit, as [`Pool::commit`] takes it: which pending allocations it makes visible, where
/// the hash their checksums are checked against comes from, and on what condition.
#[must_use = "a commit does nothing until it is passed to Pool::commit"]
pub struct Commit<'a> {
    objects: Objects<'a>,
    /// Commit only when the key's presence is this (None: always).
    present: Option<bool>,
    /// Commit only when this says so, asked under the key's index-shard lock.
    guard: Option<&'a (dyn Fn() -> bool + Sync)>,
}

/// What a [`Commit`] makes visible.
enum Objects<'a> {
    /// One allocation, sealed by its address; `hashed`: its writer's hash of its bytes, or
    /// None to hash them at commit.
    One {
        addr: GlobalAddr,
        checksum: u64,
        hashed: Option<u64>,
    },
    /// The allocation a write claim holds whole, with its writer's hash.
    Claimed {
        write: PendingWrite<'a>,
        checksum: u64,
        hashed: u64,
    },
    /// Several allocations, all or none, each hashed at commit.
    All(&'a [(GlobalAddr, u64)]),
}

impl<'a> Commit<'a> {
    /// Commits the pending allocation `addr` once its bytes, hashed at commit, match
    /// `checksum` (xxh3-64).
    pub fn new(addr: &GlobalAddr, checksum: u64) -> Self {
        Self::of(Objects::One {
            addr: *addr,
            checksum,
            hashed: None,
        })
    }

    /// [`Commit::new`] for a writer of this process that hashed the bytes as it wrote them
    /// into the allocation (the daemon receiving a put from a socket checks each piece while
    /// it is still in cache): `hashed` is that xxh3, compared with `checksum` instead of
    /// hashing the object again. Only for an allocation whose address was never handed out,
    /// written whole under one write claim by the caller, so the bytes hashed are the bytes
    /// committed.
    pub fn prehashed(addr: &GlobalAddr, checksum: u64, hashed: u64) -> Self {
        Self::of(Objects::One {
            addr: *addr,
            checksum,
            hashed: Some(hashed),
        })
    }

    /// Commits the allocation `write` holds whole, which its caller filled and hashed
    /// (`hashed`, the xxh3 of the bytes it wrote) under that claim: the claim turns into the
    /// commit's seal under one lock of the pending table, so no other write can land between
    /// the bytes hashed and the bytes committed, although the address was handed out. A claim
    /// on part of the allocation is refused (`NotWritable`) and released.
    pub fn claimed(write: PendingWrite<'a>, checksum: u64, hashed: u64) -> Self {
        Self::of(Objects::Claimed {
            write,
            checksum,
            hashed,
        })
    }

    /// Commits several pending allocations at once (Redis's `MSET`): all or none. `items`:
    /// (address, checksum); a key given twice keeps its last value. The objects are inserted
    /// with the index shards of all their keys locked, so a reader of any key sees either none
    /// of the batch or, from then on, all of it.
    pub fn all(items: &'a [(GlobalAddr, u64)]) -> Self {
        Self::of(Objects::All(items))
    }

    /// Commits only when the key's presence is `present` (`Some(false)`: only if absent,
    /// Redis's `SET NX`; `Some(true)`: only if present, `SET XX`; `None`, the default:
    /// always); for [`Commit::all`], only when every key's is. The condition is checked and
    /// the objects inserted under one lock of their keys' index shards, so no other commit of
    /// those keys comes between.
    pub fn when_present(self, present: Option<bool>) -> Self {
        Commit { present, ..self }
    }

    /// Commits only when `guard` says so, asked with the key's index shard locked together
    /// with the presence condition, so that whatever else takes that lock (every commit and
    /// removal of the key, and what the pool tells its tier below of them) is ordered before
    /// or after the answer and the insert together. For one object; [`Commit::all`] ignores
    /// it. `guard` must not call into the pool.
    pub fn when(self, guard: &'a (dyn Fn() -> bool + Sync)) -> Self {
        Commit {
            guard: Some(guard),
            ..self
        }
    }

    fn of(objects: Objects<'a>) -> Self {
        Commit {
            objects,
            present: None,
            guard: None,
        }
    }
}

impl Pool {
    /// Makes pending objects visible, as `c` says (see [`Commit`]): each checked against its
    /// checksum (xxh3-64), and, under a condition on the key's presence, inserted only when it
    /// holds. Returns whether it committed: false only when the condition did not hold, and
    /// then every allocation is released and the index is untouched. On a checksum mismatch
    /// (or any other failure) the allocations are released, the old objects stay, and the
    /// error is returned.
    pub fn commit(&self, c: Commit<'_>) -> Result<bool, PoolError> {
        match c.objects {
            Objects::One {
                addr,
                checksum,
                hashed,
            } => {
                let (near, seg) = self.seal(&addr)?;
                match hashed {
                    None => self.check_sealed(&addr, seg, checksum)?,
                    Some(hashed) => self.check_prehashed(&addr, checksum, hashed)?,
                }
                self.publish_if(near, &addr, checksum, (c.present, c.guard))
            }
            Objects::Claimed {
                write,
                checksum,
                hashed,
            } => {
                let addr = write.addr;
                let near = self.seal_claimed(write)?;
                self.check_prehashed(&addr, checksum, hashed)?;
                self.publish_if(near, &addr, checksum, (c.present, c.guard))
            }
            Objects::All(items) => self.commit_all(items, c.present),
        }
    }

    /// The end of a checked commit of the sealed `addr`: takes it out of the pending table
    /// and publishes it under its key's index-shard lock (shard `near`), only when the key's
    /// presence is `present` (None: always) and `guard`, if any, agrees; otherwise releases
    /// the allocation.
    fn publish_if(
        &self,
        near: usize,
        addr: &GlobalAddr,
        checksum: u64,
        (present, guard): (Option<bool>, Option<&(dyn Fn() -> bool + Sync)>),
    ) -> Result<bool, PoolError> {
        let mut shard = lock(&self.shards[near]);
        let p = self.take_sealed(addr)?;
        let refused = present.is_some_and(|want| shard.ns[p.ns as usize].contains(&p.key) != want)
            || guard.is_some_and(|g| !g());
        if refused {
            drop(shard);
            self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
            return Ok(false);
        }
        self.publish(&mut shard, p, addr, checksum);
        Ok(true)
    }

    /// [`Commit::all`]: every checksum is checked first; on any failure every allocation is
    /// released and the error returned. The objects are then taken out of their pending tables
    /// with the index shards of all their keys locked (in shard order, so two of these never
    /// deadlock); when `present` is given and any key's presence differs, all are released and
    /// nothing is inserted; otherwise all are inserted before the locks are let go.
    fn commit_all(
        &self,
        items: &[(GlobalAddr, u64)],
        present: Option<bool>,
    ) -> Result<bool, PoolError> {
        let sealed = self.seal_all(items)?;
        let mut order: Vec<usize> = sealed.iter().map(|(shard, ..)| *shard).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&i| lock(&self.shards[i])).collect();
        // All taken out first: one cancelled (`take_sealed` freed it) releases the others.
        let mut taken = Vec::with_capacity(sealed.len());
        let mut failed = None;
        for (shard, addr, sum) in sealed {
            match self.take_sealed(addr) {
                Ok(p) => taken.push((shard, p, addr, sum)),
                Err(e) => failed = Some(e),
            }
        }
        let guard_of = |shard: usize| {
            order
                .binary_search(&shard)
                .expect("every key's shard is locked")
        };
        let refused = present.is_some_and(|want| {
            taken.iter().any(|(shard, p, ..)| {
                guards[guard_of(*shard)].ns[p.ns as usize].contains(&p.key) != want
            })
        });
        if failed.is_some() || refused {
            for (_, p, addr, _) in taken {
                self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
            }
            return failed.map_or(Ok(false), Err);
        }
        for (shard, p, addr, sum) in taken {
            let g = guard_of(shard);
            self.publish(&mut guards[g], p, addr, sum);
        }
        Ok(true)
    }

    /// Seals and checks every one of `items` (address, checksum) for `commit_all`:
    /// (the shard of its key, its address, its checksum). On the first failure the ones
    /// sealed are released, the ones not reached aborted, and the error returned.
    fn seal_all<'i>(
        &self,
        items: &'i [(GlobalAddr, u64)],
    ) -> Result<Vec<(usize, &'i GlobalAddr, u64)>, PoolError> {
        let mut sealed = Vec::with_capacity(items.len());
        for (i, (addr, sum)) in items.iter().enumerate() {
            let checked = self
                .seal(addr)
                .and_then(|(near, seg)| self.check_sealed(addr, seg, *sum).map(|()| near));
            match checked {
                Ok(near) => sealed.push((near, addr, *sum)),
                Err(e) => {
                    for (_, addr, _) in sealed {
                        self.drop_sealed(addr);
                    }
                    // The ones not reached are still pending: give them back too.
                    for (addr, _) in &items[i + 1..] {
                        let _ = self.abort(addr);
                    }
                    return Err(e);
                }
            }
        }
        Ok(sealed)
    }

    /// Turns the claim of `w`, which must cover its whole allocation, into the commit's seal
    /// under one lock of the pending table, so no other write can land between the bytes its
    /// writer hashed and the bytes committed. A claim on part of the allocation is refused
    /// (`NotWritable`) and released. Returns the index shard of the key.
    fn seal_claimed(&self, w: PendingWrite<'_>) -> Result<usize, PoolError> {
        let addr = w.addr;
        let whole = w.start == 0 && w.end == addr.len;
        let mut pending = self.pending_lock(addr.generation);
        let Some(p) = pending.by_generation.get_mut(&addr.generation) else {
            drop(pending);
            std::mem::forget(w); // its claim went with the entry
            return Err(self.gone(&addr));
        };
        p.claims.release(w.start, w.end);
        std::mem::forget(w); // released above, under this lock
        if !whole {
            return Err(AddrFault::NotWritable.into());
        }
        self.seal_locked(pending, &addr)
    }

    /// Checks the hash a writer took of a sealed allocation's bytes as it wrote them against
    /// `checksum_given`; on a mismatch the allocation is released.
    fn check_prehashed(
        &self,
        addr: &GlobalAddr,
        checksum_given: u64,
        hashed: u64,
    ) -> Result<(), PoolError> {
        if hashed != checksum_given {
            self.drop_sealed(addr);
            return Err(PoolError::ChecksumMismatch);
        }
        Ok(())
    }

    /// Seals a pending allocation for its commit: no write may open in it from now on, and
    /// abort and the reaper leave it alone; it stays in its pending table, where a
    /// [`Pool::cancel`] of its key still finds it, until [`Pool::take_sealed`] takes it out
    /// under its key's index-shard lock. Returns that shard and the segment. Refused while a
    /// write is open (`Busy`), once cancelled, and for an address that is not pending.
    fn seal(&self, addr: &GlobalAddr) -> Result<(usize, &SegmentSlot), PoolError> {
        let seg = self.check_addr(addr)?;
        let pending = self.pending_lock(addr.generation);
        match pending.by_generation.get(&addr.generation) {
            Some(p) if p.offset == addr.offset && p.len == addr.len && !p.committing => {}
            Some(p) if p.offset == addr.offset && p.len == addr.len => {
                return Err(AddrFault::Busy.into())
            }
            Some(_) => return Err(AddrFault::NotWritable.into()),
            None => {
                drop(pending);
                return Err(self.gone(addr));
            }
        }
        let near = self.seal_locked(pending, addr)?;
        Ok((near, seg))
    }

    /// Seals the pending allocation of `addr`, present in the locked table `pending`: refused
    /// while a write claim or another commit holds it; one a cancel doomed is released (unless
    /// a write still holds it) and refused. Returns the index shard of its key.
    fn seal_locked(
        &self,
        mut pending: MutexGuard<'_, PendingShard>,
        addr: &GlobalAddr,
    ) -> Result<usize, PoolError> {
        let p = pending
            .by_generation
            .get_mut(&addr.generation)
            .expect("the caller found it in this locked table");
        if p.cancelled {
            // Doomed by a cancel while a write held it: released now, unless one still does.
            if p.claims.is_empty() {
                let p = pending.by_generation.remove(&addr.generation);
                drop(pending);
                if let Some(p) = p {
                    self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
                }
            }
            return Err(PoolError::Cancelled);
        }
        if !p.claims.is_empty() || p.committing {
            return Err(AddrFault::Busy.into());
        }
        p.committing = true;
        Ok(self.shard_of(&p.key))
    }

    /// Why an address has no pending allocation: [`PoolError::Cancelled`] when a cancel took
    /// it lately, else not writable (committed, aborted or reclaimed).
    pub(super) fn gone(&self, addr: &GlobalAddr) -> PoolError {
        if lock(&self.cancelled).contains(addr.generation) {
            PoolError::Cancelled
        } else {
            AddrFault::NotWritable.into()
        }
    }

    /// Checks that a sealed allocation's bytes hash to `checksum_given`; on a mismatch it is
    /// released.
    fn check_sealed(
        &self,
        addr: &GlobalAddr,
        seg: &SegmentSlot,
        checksum_given: u64,
    ) -> Result<(), PoolError> {
        // SAFETY: in bounds: check_addr in seal put the address inside the segment and the
        // pending entry matched it. No slice of this process writes it: seal found no write
        // claim and marked it committing under its pending table's lock, and begin_write_range
        // refuses a committing allocation; abort, the reaper and cancel leave a committing
        // allocation's memory alone, and it is not in the index, so nothing else frees it
        // before take_sealed or drop_sealed. (A same-host client may still store into its own
        // mapping of these pages; that can only change the checksum, which is why commit
        // checks it.)
        let bytes = unsafe { seg.segment.data(addr.offset, addr.len) };
        if checksum(bytes) != checksum_given {
            self.drop_sealed(addr);
            return Err(PoolError::ChecksumMismatch);
        }
        Ok(())
    }

    /// Releases a sealed allocation that will not be committed.
    fn drop_sealed(&self, addr: &GlobalAddr) {
        let p = self
            .pending_lock(addr.generation)
            .by_generation
            .remove(&addr.generation);
        if let Some(p) = p {
            self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
        }
    }

    /// Takes a sealed allocation out of its pending table for its commit; the caller holds
    /// its key's index-shard lock, so a [`Pool::cancel`] of the key either came before (and
    /// marked it: then it is released here and the commit fails with
    /// [`PoolError::Cancelled`]) or comes after the commit and removes the object.
    fn take_sealed(&self, addr: &GlobalAddr) -> Result<Pending, PoolError> {
        let p = self
            .pending_lock(addr.generation)
            .by_generation
            .remove(&addr.generation);
        // Only its commit takes a sealed allocation out.
        let p = p.ok_or(AddrFault::NotWritable)?;
        if p.cancelled {
            self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
            return Err(PoolError::Cancelled);
        }
        Ok(p)
    }

    /// Makes a taken pending object visible: its version word published, then its entry in
    /// the index (under `shard`, the lock of its key's shard), retiring the object it replaces.
    fn publish(&self, shard: &mut Shard, p: Pending, addr: &GlobalAddr, checksum_given: u64) {
        let seg = &self.segments[p.segment as usize];
        let word = seg.segment.version(p.offset).expect("granule aligned");
        seqlock::publish(word, addr.generation);
        let entry = Entry {
            offset: p.offset,
            len: p.len,
            generation: addr.generation,
            checksum: checksum_given,
            lease_until: 0,
            segment: p.segment,
            readers: 0,
            pinned: p.pin,
            accessed: false,
        };
        let space = &self.namespaces[p.ns as usize];
        if p.pin {
            space.pinned.fetch_add(p.size, Ordering::Relaxed);
        }
        self.journal(|j| {
            j.commit(&Record {
                ns: p.ns,
                segment: p.segment,
                offset: p.offset,
                len: p.len,
                checksum: checksum_given,
                generation: addr.generation,
                pinned: p.pin,
                depth: p.depth,
                key: &p.key,
            })
        });
        if let Some(o) = self.observer.get() {
            // Still under the shard's lock: a reader told of the commit finds the object.
            o.committed(p.ns, &p.key);
        }
        if let Some(t) = self.lower.get() {
            t.committed(p.ns, &p.key, checksum_given);
        }
        match shard.ns[p.ns as usize].insert(&p.key, entry, p.depth, self.tick()) {
            Some(old) => self.retire_entry(shard, p.ns, old),
            None => {
                space.objects.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.counters.commits.fetch_add(1, Ordering::Relaxed);
    }
}
