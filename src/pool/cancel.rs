//! Pending allocations given back without a commit: by their writer ([`Pool::abort`]), by a
//! request's cancel ([`Pool::cancel`]), or past their deadline by the reaper ([`Pool::reap`]).

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use crate::addr::GlobalAddr;
use crate::error::{AddrFault, PoolError};
use crate::sync::lock;

use super::index::Shard;
use super::{Millis, Pool};

impl Pool {
    /// Gives a pending allocation back without committing it.
    pub fn abort(&self, addr: &GlobalAddr) -> Result<(), PoolError> {
        self.check_addr(addr)?;
        let p = {
            let mut pending = self.pending_lock(addr.generation);
            match pending.by_generation.get(&addr.generation) {
                Some(p) if p.offset == addr.offset && p.claims.is_empty() && !p.committing => {}
                Some(_) => return Err(AddrFault::Busy.into()),
                None => return Err(AddrFault::NotWritable.into()),
            }
            pending
                .by_generation
                .remove(&addr.generation)
                .expect("checked above")
        };
        self.free_block(p.ns, p.segment, p.offset, addr.generation, p.pin);
        Ok(())
    }

    /// Aborts a request's blocks on this node (`Cancel`): for each of `keys` of namespace `ns`,
    /// every pending allocation (a reservation, a put or alloc still being written) and the
    /// committed object, pinned or not. Returns how many of both it freed or doomed.
    ///
    /// An allocation with a write open or a commit under way can't be freed under its writer:
    /// it is marked, so its commit fails with [`PoolError::Cancelled`] and releases it (as do
    /// an abort, or the reaper at its next round); every other one is freed at once. The keys'
    /// index shards stay locked from the look at the pending tables to the removal of the
    /// objects, and a commit takes its allocation out of its table only under its key's shard
    /// lock (`take_sealed`), so no allocation of these keys is committed after this
    /// returns. Pending allocations are kept by generation, not by key: this walks every
    /// pending table once for the whole batch, O(pending allocations + keys), with each table
    /// locked only while it is walked; the put path pays nothing for it.
    pub fn cancel(&self, ns: u32, keys: &[&[u8]]) -> Result<u64, PoolError> {
        let space = self.ns(ns)?;
        for key in keys {
            self.check_key(key)?;
        }
        let mut order: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&i| lock(&self.shards[i])).collect();
        let wanted: std::collections::HashSet<&[u8]> = keys.iter().copied().collect();
        let mut n = 0u64;
        let mut freed = Vec::new();
        // Held across the walk, so a commit that finds its allocation gone finds why.
        let mut recent = lock(&self.cancelled);
        for table in self.pending.iter() {
            let mut table = lock(table);
            table.by_generation.retain(|&generation, p| {
                if p.ns != ns || p.cancelled || !wanted.contains(&*p.key) {
                    return true;
                }
                n += 1;
                recent.note(generation);
                if p.claims.is_empty() && !p.committing {
                    freed.push((generation, p.segment, p.offset, p.pin));
                    return false;
                }
                p.cancelled = true;
                p.deadline = 0;
                true
            });
        }
        drop(recent);
        for (generation, segment, offset, pin) in freed {
            self.free_block(ns, segment, offset, generation, pin);
        }
        for key in wanted {
            let g = order
                .binary_search(&self.shard_of(key))
                .expect("every key's shard is locked");
            let shard = &mut *guards[g];
            let below = self.lower.get().is_some_and(|t| t.removed(ns, key));
            n += u64::from(below);
            if let Some(e) = shard.ns[ns as usize].remove(key) {
                space.objects.fetch_sub(1, Ordering::Relaxed);
                self.observe_removed(ns, key);
                self.retire_entry(shard, ns, e);
                n += u64::from(!below);
            }
        }
        Ok(n)
    }

    /// Reclaims allocations left uncommitted past their deadline; returns how many.
    pub fn reap(&self, now: Millis) -> usize {
        let mut expired = Vec::new();
        for p in self.pending.iter() {
            lock(p).take_expired(now, &mut expired);
        }
        for (generation, p) in &expired {
            self.free_block(p.ns, p.segment, p.offset, *generation, p.pin);
        }
        self.counters
            .reaped
            .fetch_add(expired.len() as u64, Ordering::Relaxed);
        expired.len()
    }
}
