//! Promotion: a disk copy read straight into a fresh DRAM allocation, verified, and committed
//! there while the key is still absent from DRAM and the copy still the disk's.

use std::sync::atomic::Ordering;

use kvpool::disk::Get;
use kvpool::{Commit, Millis, Pool};

use super::DiskTier;
use crate::cluster::Continuity;

impl DiskTier {
    /// Brings `(ns, key)`'s disk copy up into `pool`, if the disk has one and `judge` (the
    /// continuity of an object of the copy's generation, as the read is routed) lets it be
    /// served: whether DRAM may now hold the key (the caller reads it there again; a commit
    /// that lost to another of the key counts, since the key is then in DRAM). A copy judged
    /// broken is forgotten; a read that fails or mismatches drops the copy (the store counts
    /// it); a DRAM allocation refused (quota, memory) leaves the copy where it is. Blocks the
    /// calling thread for the disk read.
    pub(crate) fn promote(
        &self,
        pool: &Pool,
        (ns, key): (u32, &[u8]),
        now: Millis,
        judge: impl FnOnce(u64) -> Continuity,
    ) -> bool {
        let Some(found) = self.store.lookup(ns, key) else {
            return false;
        };
        match judge(found.generation) {
            Continuity::Continuous => {}
            Continuity::Broken => {
                self.forget(ns, key, None);
                return false;
            }
            Continuity::Moved => return false,
        }
        let c = &self.counters;
        let Ok(addr) = pool.alloc_in_chain(ns, key, found.value_len, false, 0, now) else {
            c.promotion_failures.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        let mut w = match pool.begin_write(&addr) {
            Ok(w) => w,
            Err(_) => {
                let _ = pool.abort(&addr);
                c.promotion_failures.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        };
        if self.store.read_found(ns, key, &found, w.bytes_mut())
            != (Get::Hit {
                len: found.value_len as usize,
            })
        {
            drop(w);
            let _ = pool.abort(&addr);
            return false;
        }
        // The store verified the bytes against `found.checksum`. Asked under the key's shard
        // lock, which every commit and removal of the key takes before it tells this tier: a
        // removal or a newer value that forgot the copy since it was read keeps it out of DRAM.
        let still = || self.store.holds(ns, key, found.seq);
        let commit = Commit::claimed(w, found.checksum, found.checksum)
            .when_present(Some(false))
            .when(&still);
        // Noted before the commit, so that an eviction right after it finds the note: still the
        // object it was on disk, which a removal of that generation (a TTL) finds in DRAM.
        self.lock()
            .promoted
            .entry(ns)
            .or_default()
            .insert(key.into(), (addr.generation, found.generation));
        let committed = pool.commit(commit);
        if !matches!(committed, Ok(true)) {
            let mut q = self.lock();
            if q.promoted
                .get(&ns)
                .and_then(|k| k.get(key))
                .is_some_and(|&(d, _)| d == addr.generation)
            {
                q.unpromote(ns, key);
            }
        }
        match committed {
            Ok(true) => {
                c.promoted.fetch_add(1, Ordering::Relaxed);
                c.promoted_bytes
                    .fetch_add(found.value_len, Ordering::Relaxed);
                true
            }
            Ok(false) => true,
            Err(_) => {
                c.promotion_failures.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }
}
