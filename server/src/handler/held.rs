//! What one connection holds apart from its account in the ledger: the objects it holds
//! (`Hold`) and the allocations its `Alloc`s made that may still be pending. Each ends, or is
//! forgotten, when the connection closes.

use std::collections::HashMap;

use crate::ledger::{Account, Resource};

/// Everything one connection holds, each released when the connection closes (in this order:
/// its holds end, then its account in the ledger settles what is left).
pub(super) struct Holdings<'a> {
    /// The objects this connection holds (`Hold`); ended when the connection is dropped.
    pub(super) holds: Holds<'a>,
    /// What this connection holds, in the resource ledger: its holds, watches and pending
    /// allocations, charged as they are taken; settled when the connection is dropped.
    pub(super) account: Account,
    /// What this connection watches (`Watch`, `Subscribe`) and its events; ended on drop.
    pub(super) watching: Option<crate::watch::Registration>,
    /// This connection's KV event subscriptions (`KvEvents`) and their queue; ended on drop.
    pub(super) kv_events: Option<crate::events::Subscription>,
    /// The staging area this connection asked for (`Staging`), retired when it closes.
    pub(super) staging: Option<crate::staging::Held>,
    /// The allocations this connection's `Alloc`s made that may still be pending.
    pub(super) pending: PendingAllocs,
}

/// The objects one connection holds, one entry per hold (namespace, key, generation, length);
/// every hold ends when this is dropped, however the connection ends (the connection's
/// [`crate::ledger::Account`] gives their charges back at the same time).
pub(super) struct Holds<'a> {
    pub(super) pool: &'a kvpool::Pool,
    pub(super) held: Vec<(u32, Box<[u8]>, u64, u64)>,
}

impl Holds<'_> {
    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Ends the last `n` holds taken, crediting their bytes back to `account`.
    pub(super) fn end_last(&mut self, n: usize, account: &mut Account) {
        let from = self.held.len().saturating_sub(n);
        for (ns, key, generation, len) in self.held.split_off(from) {
            let _ = self.pool.unhold(ns, &key, generation);
            account.release(ns, Resource::HeldBytes, len);
            account.release(ns, Resource::Holds, 1);
        }
    }
}

impl Drop for Holds<'_> {
    fn drop(&mut self) {
        for (ns, key, generation, _) in self.held.drain(..) {
            let _ = self.pool.unhold(ns, &key, generation);
        }
    }
}

/// The allocations one connection's `Alloc`s made that may still be pending, each with the
/// view stamp its `Alloc` was routed by (0 for a direct one) and its namespace, charged to
/// the connection's account (`max_pending_per_connection`, `max_pending_per_namespace`).
/// Those committed or aborted over this connection leave at once; the others (committed
/// elsewhere, cancelled, reaped) when an `Alloc` would pass a bound. A `Commit` over this
/// connection that carries no stamp of its own is judged by the one noted here.
#[derive(Default)]
pub(super) struct PendingAllocs {
    by_generation: HashMap<u64, (u64, u32)>,
}

impl PendingAllocs {
    /// Charges `n` allocations in `ns`; when a bound refuses them, forgets first those no
    /// longer pending and tries again, so the usual `Alloc` pays nothing for the walk.
    pub(super) fn admit(
        &mut self,
        account: &mut Account,
        pool: &kvpool::Pool,
        ns: u32,
        n: u64,
    ) -> Result<(), crate::ledger::Refused> {
        if account.charge(ns, Resource::Pending, n).is_ok() {
            return Ok(());
        }
        self.by_generation.retain(|&g, &mut (_, ns)| {
            let live = pool.is_pending(g);
            if !live {
                account.release(ns, Resource::Pending, 1);
            }
            live
        });
        account.charge(ns, Resource::Pending, n)
    }

    /// Notes an allocation made (its charge taken by [`PendingAllocs::admit`]).
    pub(super) fn note(&mut self, generation: u64, stamp: u64, ns: u32) {
        self.by_generation.insert(generation, (stamp, ns));
    }

    /// The view stamp generation `generation`'s `Alloc` was routed by (0: none, or not made
    /// here).
    pub(super) fn stamp(&self, generation: u64) -> u64 {
        self.by_generation.get(&generation).map_or(0, |&(s, _)| s)
    }

    /// Forgets an allocation committed or aborted, crediting its charge back.
    pub(super) fn forget(&mut self, account: &mut Account, generation: u64) {
        if let Some((_, ns)) = self.by_generation.remove(&generation) {
            account.release(ns, Resource::Pending, 1);
        }
    }
}
