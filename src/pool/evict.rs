//! Eviction: making room for an allocation by taking victims from the namespace's policy,
//! sampled across the index shards so they together follow one order.

use std::sync::atomic::Ordering;

use std::sync::MutexGuard;

use crate::sync::lock;

use super::index::{Entry, Shard};
use super::{Claim, Millis, Pool, Victim};

/// Shards whose next victims an eviction compares.
const EVICTION_SAMPLES: usize = 8;

/// Samples an eviction takes before it takes a victim from any shard (see `Pool::evict_one`).
const EVICTION_ROUNDS: usize = 16;

impl Pool {
    /// Evicts one object: from namespace `only` if given, else from any. False when nothing is
    /// evictable.
    ///
    /// Each shard's policy orders only its own objects, so which shard gives up a victim decides
    /// how close the pool comes to its policy applied to all objects at once. Every candidate
    /// carries the logical time the policy ranks it by (its last access for LRU, its entry into
    /// its FIFO for S3-FIFO); eviction looks at the next victim of [`EVICTION_SAMPLES`] shards
    /// (starting with `near`, the shard the new object goes to) and evicts from the shard whose
    /// candidate is oldest, as Redis samples for its LRU. That shard's policy may spare its
    /// candidate (S3-FIFO promotes touched objects); it stops once its next one is younger than
    /// the runner-up's, and the pool samples again, up to [`EVICTION_ROUNDS`] times, so that the
    /// shards together take their steps in one order. Then any shard will do.
    fn evict_one(&self, only: Option<u32>, near: usize, now: Millis) -> bool {
        let mask = self.shards.len() - 1;
        let nns = self.namespaces.len();
        let start = self.evict_cursor.fetch_add(1, Ordering::Relaxed);
        let tries = if only.is_some() { 1 } else { nns };
        for j in 0..tries {
            let ns = only.map_or((start + j) % nns, |n| n as usize);
            let mut first = None;
            for round in 0..EVICTION_ROUNDS {
                // The best candidate of the sample and the runner-up's stamp.
                let mut best: Option<(u64, usize)> = None;
                let mut bound = u64::MAX;
                let base = start.wrapping_mul(7) + near + round * EVICTION_SAMPLES;
                for k in 0..EVICTION_SAMPLES.min(mask + 1) {
                    let s = if k == 0 && round == 0 {
                        near
                    } else {
                        (base + k) & mask
                    };
                    let Some(stamp) = lock(&self.shards[s]).ns[ns].next_victim_stamp() else {
                        continue;
                    };
                    match best {
                        Some((_, bs)) if bs == s => {}
                        Some((b, _)) if b <= stamp => bound = bound.min(stamp),
                        _ => {
                            bound = best.map_or(bound, |(b, _)| bound.min(b));
                            best = Some((stamp, s));
                        }
                    }
                }
                let Some((_, s)) = best else { break };
                first.get_or_insert(s);
                let mut shard = lock(&self.shards[s]);
                let tick = self.tick();
                let mut claim = None;
                let seen = &mut |key: &[u8], e: &Entry| claim = self.show_victim(ns, key, e);
                if let Some(e) = shard.ns[ns].victim_below(now, tick, bound, seen) {
                    self.retire_victim(shard, ns, e, claim);
                    return true;
                }
            }
            // Then every shard, in case the sampled ones hold nothing evictable.
            let order = first
                .into_iter()
                .chain((0..=mask).map(|i| (start + i) & mask));
            for s in order {
                let mut shard = lock(&self.shards[s]);
                let tick = self.tick();
                let mut claim = None;
                let seen = &mut |key: &[u8], e: &Entry| claim = self.show_victim(ns, key, e);
                if let Some(e) = shard.ns[ns].victim(now, tick, seen) {
                    self.retire_victim(shard, ns, e, claim);
                    return true;
                }
            }
        }
        false
    }

    /// Evicts one object to make room for namespace `ns`: its own first; then, if `shared`, one
    /// of a namespace without a reservation (which lives in unreserved memory). Namespaces with
    /// a reservation lose objects only to their own allocations. False when nothing is
    /// evictable.
    pub(super) fn evict_for(&self, ns: u32, shared: bool, near: usize, now: Millis) -> bool {
        if self.evict_one(Some(ns), near, now) {
            return true;
        }
        if !shared {
            return false;
        }
        let n = self.namespaces.len();
        let start = self.evict_cursor.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| (start + i) % n)
            .filter(|&j| j != ns as usize && !self.namespaces[j].reserved)
            .any(|j| self.evict_one(Some(j as u32), near, now))
    }

    /// Shows a victim, its key still indexed and its block still allocated, to the tier under
    /// DRAM, if there is one (its claim on the bytes, if it wants them), then to the observer.
    fn show_victim(&self, ns: usize, key: &[u8], e: &Entry) -> Option<Claim> {
        let claim = self.claim_victim(ns, key, e);
        self.observe_removed(ns as u32, key);
        claim
    }

    /// The tier under DRAM's claim on a victim's bytes, if it wants them.
    fn claim_victim(&self, ns: usize, key: &[u8], e: &Entry) -> Option<Claim> {
        self.lower.get()?.evicting(&Victim {
            ns: ns as u32,
            key,
            len: e.len,
            checksum: e.checksum,
            generation: e.generation,
            accessed: e.accessed,
        })
    }

    /// Takes victim `e` out of the pool: out of the index and the journal under its shard's
    /// lock (`shard`, released here), then, with no lock held, its bytes handed to the tier
    /// under DRAM if it claimed them (`claim`), then its block freed.
    fn retire_victim(
        &self,
        mut shard: MutexGuard<'_, Shard>,
        ns: usize,
        e: Entry,
        claim: Option<Claim>,
    ) {
        self.namespaces[ns].objects.fetch_sub(1, Ordering::Relaxed);
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        let Some(claim) = claim else {
            self.retire_entry(&mut shard, ns as u32, e);
            return;
        };
        // A victim is evictable: no reader holds it (`readers == 0`), so nothing parks it.
        self.journal(|j| j.gone(e.generation));
        drop(shard);
        let seg = &self.segments[e.segment as usize].segment;
        // SAFETY: the range was bounds-checked when allocated. The block stays allocated until
        // `free_block` below, after this slice's last use. Nothing reads it as an object any
        // more (it left the index under the shard lock, with no reader: `readers == 0`) and
        // nothing in this process writes it (a committed object has no pending entry, so
        // `begin_write_range` refuses it, and the block is not free to be allocated again).
        let value = unsafe { seg.data(e.offset, e.len) };
        if let Some(t) = self.lower.get() {
            t.demote(claim, value);
        }
        self.free_block(ns as u32, e.segment, e.offset, e.generation, e.pinned);
    }
}
