//! The resource ledger: everything a peer can make the node hold, counted in one place.
//!
//! A peer can make the node keep things beyond the objects it stores: pending allocations,
//! objects held for same-host views (and their bytes), watched keys, subscribed prefixes,
//! handoff leases, tombstones, staging areas. Each is bounded per connection where a
//! connection owns it, and per namespace always, so that a tenant at its bound is refused
//! ([`Refused`]: `LimitExceeded`, naming the setting, counted in
//! `kvpool_limit_refusals_total`) while every other tenant keeps its own room. Staging areas
//! name no namespace: they are bounded per token (the tenant that asked for them).
//!
//! A connection's share is an [`Account`]: charged as the connection takes something,
//! credited as it gives it back, and settled when the connection closes, so whatever the
//! connection still held is returned to its namespaces at once, however the connection ended.
//! Leases and tombstones outlive their connection (a producer's lease is for its consumer);
//! they are charged to their namespace alone ([`Ledger::charge_namespace`]) and credited
//! when they lapse or end. The tables themselves stay with the features that use them
//! (`watch.rs`, the handler's holds, the pool's pending table); the ledger only counts and
//! refuses, and the metrics page shows its totals (`kvpool_resources`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a peer can make the node hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Resource {
    /// Allocations made and not yet committed or aborted.
    Pending,
    /// Objects held for same-host views (`Hold`).
    Holds,
    /// Bytes of the objects held (a held object's memory is neither evicted nor reused, even
    /// once it is removed or replaced).
    HeldBytes,
    /// Watched keys.
    Watches,
    /// Subscribed prefixes (every commit in the namespace is matched against them).
    Subscriptions,
    /// Handoff leases (`Expire`).
    Leases,
    /// Tombstones (`Fail`, `Cancel`).
    Tombstones,
    /// KV event subscriptions (`KvEvents`); each subscribed connection also has one queue of
    /// events, of bounded size.
    KvEvents,
}

/// Every resource, in the order of the arrays below.
pub(crate) const RESOURCES: [Resource; 8] = [
    Resource::Pending,
    Resource::Holds,
    Resource::HeldBytes,
    Resource::Watches,
    Resource::Subscriptions,
    Resource::Leases,
    Resource::Tombstones,
    Resource::KvEvents,
];

impl Resource {
    fn index(self) -> usize {
        self as usize
    }

    /// Its name on the metrics page.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Resource::Pending => "pending",
            Resource::Holds => "holds",
            Resource::HeldBytes => "held_bytes",
            Resource::Watches => "watches",
            Resource::Subscriptions => "subscriptions",
            Resource::Leases => "leases",
            Resource::Tombstones => "tombstones",
            Resource::KvEvents => "kv_event_subscriptions",
        }
    }

    /// What one unit is, for a refusal's message.
    fn noun(self) -> &'static str {
        match self {
            Resource::Pending => "pending allocations",
            Resource::Holds => "held objects",
            Resource::HeldBytes => "bytes of held objects",
            Resource::Watches => "watched keys",
            Resource::Subscriptions => "subscribed prefixes",
            Resource::Leases => "handoff leases",
            Resource::Tombstones => "tombstones",
            Resource::KvEvents => "KV event subscriptions",
        }
    }
}

/// A bound on what a peer controls (`[limits]` and `[listen]`), as labelled on
/// `kvpool_limit_refusals_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Limit {
    /// `listen.max_connections_per_peer`: a connection (or QUIC stream) closed on arrival.
    ConnectionsPerPeer,
    /// `limits.max_connections_per_token`: a `Hello` or RESP `AUTH` refused.
    ConnectionsPerToken,
    /// `limits.max_pending_per_connection`: an `Alloc` refused whole.
    PendingPerConnection,
    /// `limits.max_pending_per_namespace`: an `Alloc` refused whole.
    PendingPerNamespace,
    /// `limits.max_holds_per_connection`: a `Hold` refused whole.
    HoldsPerConnection,
    /// `limits.max_holds_per_namespace`: a `Hold` refused whole.
    HoldsPerNamespace,
    /// `limits.max_held_share`: a `Hold` refused whole.
    HeldShare,
    /// `limits.max_watches_per_connection`: a `Watch` refused whole.
    WatchesPerConnection,
    /// `limits.max_watches_per_namespace`: a `Watch` refused whole.
    WatchesPerNamespace,
    /// `limits.max_subscriptions_per_connection`: a `Subscribe` refused.
    SubscriptionsPerConnection,
    /// `limits.max_subscriptions_per_namespace`: a `Subscribe` refused.
    SubscriptionsPerNamespace,
    /// `limits.max_leases_per_namespace`: an `Expire` refused.
    LeasesPerNamespace,
    /// `limits.max_tombstones_per_namespace`: a `Fail` or `Cancel` refused.
    TombstonesPerNamespace,
    /// `limits.max_event_subscriptions_per_connection`: a `KvEvents` refused.
    EventSubscriptionsPerConnection,
    /// `limits.max_event_subscriptions_per_namespace`: a `KvEvents` refused.
    EventSubscriptionsPerNamespace,
    /// `limits.max_staging_per_token`: a `Staging` refused.
    StagingPerToken,
    /// `limits.max_batch`: a batch refused whole.
    Batch,
    /// `limits.max_key_len`: a key refused (counted by the pool's check, `Pool::check_key`).
    KeyLength,
}

impl Limit {
    /// Every limit, in the order of its discriminant.
    pub(crate) const ALL: [Limit; 18] = [
        Limit::ConnectionsPerPeer,
        Limit::ConnectionsPerToken,
        Limit::PendingPerConnection,
        Limit::PendingPerNamespace,
        Limit::HoldsPerConnection,
        Limit::HoldsPerNamespace,
        Limit::HeldShare,
        Limit::WatchesPerConnection,
        Limit::WatchesPerNamespace,
        Limit::SubscriptionsPerConnection,
        Limit::SubscriptionsPerNamespace,
        Limit::LeasesPerNamespace,
        Limit::TombstonesPerNamespace,
        Limit::EventSubscriptionsPerConnection,
        Limit::EventSubscriptionsPerNamespace,
        Limit::StagingPerToken,
        Limit::Batch,
        Limit::KeyLength,
    ];

    /// Its label on `kvpool_limit_refusals_total`, and the setting that sets it.
    pub(crate) fn names(self) -> (&'static str, &'static str) {
        match self {
            Limit::ConnectionsPerPeer => {
                ("connections_per_peer", "listen.max_connections_per_peer")
            }
            Limit::ConnectionsPerToken => {
                ("connections_per_token", "limits.max_connections_per_token")
            }
            Limit::PendingPerConnection => (
                "pending_per_connection",
                "limits.max_pending_per_connection",
            ),
            Limit::PendingPerNamespace => {
                ("pending_per_namespace", "limits.max_pending_per_namespace")
            }
            Limit::HoldsPerConnection => {
                ("holds_per_connection", "limits.max_holds_per_connection")
            }
            Limit::HoldsPerNamespace => ("holds_per_namespace", "limits.max_holds_per_namespace"),
            Limit::HeldShare => ("held_share", "limits.max_held_share"),
            Limit::WatchesPerConnection => (
                "watches_per_connection",
                "limits.max_watches_per_connection",
            ),
            Limit::WatchesPerNamespace => {
                ("watches_per_namespace", "limits.max_watches_per_namespace")
            }
            Limit::SubscriptionsPerConnection => (
                "subscriptions_per_connection",
                "limits.max_subscriptions_per_connection",
            ),
            Limit::SubscriptionsPerNamespace => (
                "subscriptions_per_namespace",
                "limits.max_subscriptions_per_namespace",
            ),
            Limit::LeasesPerNamespace => {
                ("leases_per_namespace", "limits.max_leases_per_namespace")
            }
            Limit::TombstonesPerNamespace => (
                "tombstones_per_namespace",
                "limits.max_tombstones_per_namespace",
            ),
            Limit::EventSubscriptionsPerConnection => (
                "event_subscriptions_per_connection",
                "limits.max_event_subscriptions_per_connection",
            ),
            Limit::EventSubscriptionsPerNamespace => (
                "event_subscriptions_per_namespace",
                "limits.max_event_subscriptions_per_namespace",
            ),
            Limit::StagingPerToken => ("staging_per_token", "limits.max_staging_per_token"),
            Limit::Batch => ("batch", "limits.max_batch"),
            Limit::KeyLength => ("key_length", "limits.max_key_len"),
        }
    }

    /// The bound on `r` per connection (`true`) or per namespace.
    fn of(r: Resource, per_connection: bool) -> Limit {
        match (r, per_connection) {
            (Resource::Pending, true) => Limit::PendingPerConnection,
            (Resource::Pending, false) => Limit::PendingPerNamespace,
            (Resource::Holds, true) => Limit::HoldsPerConnection,
            (Resource::Holds, false) => Limit::HoldsPerNamespace,
            (Resource::HeldBytes, _) => Limit::HeldShare,
            (Resource::Watches, true) => Limit::WatchesPerConnection,
            (Resource::Watches, false) => Limit::WatchesPerNamespace,
            (Resource::Subscriptions, true) => Limit::SubscriptionsPerConnection,
            (Resource::Subscriptions, false) => Limit::SubscriptionsPerNamespace,
            (Resource::Leases, _) => Limit::LeasesPerNamespace,
            (Resource::Tombstones, _) => Limit::TombstonesPerNamespace,
            (Resource::KvEvents, true) => Limit::EventSubscriptionsPerConnection,
            (Resource::KvEvents, false) => Limit::EventSubscriptionsPerNamespace,
        }
    }
}

/// A charge refused at a bound: `LimitExceeded` for the peer, with this as its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("this {scope} would hold more than {bound} {noun} ({})", limit.names().1)]
pub(crate) struct Refused {
    /// The bound met.
    pub(crate) limit: Limit,
    scope: &'static str,
    bound: u64,
    noun: &'static str,
}

impl Refused {
    fn new(resource: Resource, per_connection: bool, bound: u64) -> Refused {
        Refused {
            limit: Limit::of(resource, per_connection),
            scope: if per_connection {
                "connection"
            } else {
                "namespace"
            },
            bound,
            noun: resource.noun(),
        }
    }
}

/// The bounds, as configured (`[limits]`); 0 means none.
#[derive(Clone, Debug)]
pub(crate) struct Bounds {
    /// Per connection, by resource.
    pub(crate) per_connection: [u64; RESOURCES.len()],
    /// Per namespace, by resource; [`Resource::HeldBytes`] is set per namespace from
    /// `held_share`.
    pub(crate) per_namespace: [u64; RESOURCES.len()],
    /// Share of a namespace's memory (its quota, or the unreserved memory it shares) that
    /// holds may keep at once.
    pub(crate) held_share: f64,
    /// Bytes of staging areas one token may hold at once.
    pub(crate) staging_per_token: u64,
}

impl Bounds {
    /// No bounds at all.
    #[cfg(test)]
    pub(crate) fn none() -> Bounds {
        Bounds::uniform(0, 0)
    }

    /// The same bound on every resource per connection, and on every one per namespace
    /// (holds may take all of a namespace's memory; staging is unbounded per token).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn uniform(per_connection: u64, per_namespace: u64) -> Bounds {
        Bounds {
            per_connection: [per_connection; RESOURCES.len()],
            per_namespace: [per_namespace; RESOURCES.len()],
            held_share: 1.0,
            staging_per_token: 0,
        }
    }
}

/// One namespace's totals and bounds.
struct NsAccount {
    used: [AtomicU64; RESOURCES.len()],
    bound: [u64; RESOURCES.len()],
}

/// The node's ledger.
pub(crate) struct Ledger {
    per_connection: [u64; RESOURCES.len()],
    namespaces: Vec<NsAccount>,
    staging_per_token: u64,
    /// Staging bytes per token (the SHA-256 digest it authenticated with).
    staging: Mutex<HashMap<[u8; 32], u64>>,
}

impl Ledger {
    /// A ledger for namespaces `0..capacities.len()`, each of the memory in `capacities`
    /// (its quota, or the unreserved memory it shares).
    pub(crate) fn new(bounds: &Bounds, capacities: &[u64]) -> Arc<Ledger> {
        let namespaces = capacities
            .iter()
            .map(|&cap| {
                let mut bound = bounds.per_namespace;
                bound[Resource::HeldBytes.index()] =
                    ((cap as f64 * bounds.held_share) as u64).max(1);
                NsAccount {
                    used: Default::default(),
                    bound,
                }
            })
            .collect();
        Arc::new(Ledger {
            per_connection: bounds.per_connection,
            namespaces,
            staging_per_token: bounds.staging_per_token,
            staging: Mutex::new(HashMap::new()),
        })
    }

    /// A new connection's account, empty.
    pub(crate) fn account(self: &Arc<Self>) -> Account {
        Account {
            ledger: self.clone(),
            used: [0; RESOURCES.len()],
            by_ns: HashMap::new(),
        }
    }

    /// Charges `n` of `r` to namespace `ns` alone (a lease, a tombstone: nobody's connection
    /// owns it). An unknown namespace is charged nothing (the pool refuses it anyway).
    pub(crate) fn charge_namespace(&self, ns: u32, r: Resource, n: u64) -> Result<(), Refused> {
        let Some(a) = self.namespaces.get(ns as usize) else {
            return Ok(());
        };
        let bound = a.bound[r.index()];
        let used = &a.used[r.index()];
        let ok = used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                let next = cur.checked_add(n)?;
                (bound == 0 || next <= bound).then_some(next)
            })
            .is_ok();
        match ok {
            true => Ok(()),
            false => Err(Refused::new(r, false, bound)),
        }
    }

    /// Credits `n` of `r` back to namespace `ns`.
    pub(crate) fn release_namespace(&self, ns: u32, r: Resource, n: u64) {
        if let Some(a) = self.namespaces.get(ns as usize) {
            let _ = a.used[r.index()].fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                Some(cur.saturating_sub(n))
            });
        }
    }

    /// What every namespace holds of `r` together.
    pub(crate) fn total(&self, r: Resource) -> u64 {
        self.namespaces
            .iter()
            .map(|a| a.used[r.index()].load(Ordering::Acquire))
            .sum()
    }

    /// What namespace `ns` holds of `r`.
    #[cfg(test)]
    pub(crate) fn used(&self, ns: u32, r: Resource) -> u64 {
        self.namespaces
            .get(ns as usize)
            .map_or(0, |a| a.used[r.index()].load(Ordering::Acquire))
    }

    /// Charges `bytes` of staging to the token of digest `owner`.
    pub(crate) fn charge_staging(&self, owner: &[u8; 32], bytes: u64) -> Result<(), Refused> {
        let mut held = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let cur = held.get(owner).copied().unwrap_or(0);
        let bound = self.staging_per_token;
        if bound != 0 && cur.saturating_add(bytes) > bound {
            return Err(Refused {
                limit: Limit::StagingPerToken,
                scope: "token",
                bound,
                noun: "bytes of staging areas",
            });
        }
        held.insert(*owner, cur + bytes);
        Ok(())
    }

    /// Credits `bytes` of staging back to the token of digest `owner`.
    pub(crate) fn release_staging(&self, owner: &[u8; 32], bytes: u64) {
        let mut held = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cur) = held.get_mut(owner) {
            *cur = cur.saturating_sub(bytes);
            if *cur == 0 {
                held.remove(owner);
            }
        }
    }
}

/// One connection's share of the ledger: settled (everything credited back) on drop.
pub(crate) struct Account {
    ledger: Arc<Ledger>,
    /// The connection's totals, by resource.
    used: [u64; RESOURCES.len()],
    /// What it holds in each namespace, to credit back.
    by_ns: HashMap<u32, [u64; RESOURCES.len()]>,
}

impl Account {
    /// Charges `n` of `r` in namespace `ns` to this connection: refused whole when either the
    /// connection's bound or the namespace's would be passed.
    pub(crate) fn charge(&mut self, ns: u32, r: Resource, n: u64) -> Result<(), Refused> {
        let bound = self.ledger.per_connection[r.index()];
        if bound != 0 && self.used[r.index()].saturating_add(n) > bound {
            return Err(Refused::new(r, true, bound));
        }
        self.ledger.charge_namespace(ns, r, n)?;
        self.used[r.index()] += n;
        self.by_ns.entry(ns).or_default()[r.index()] += n;
        Ok(())
    }

    /// Credits `n` of `r` in namespace `ns` back (at most what was charged there).
    pub(crate) fn release(&mut self, ns: u32, r: Resource, n: u64) {
        let Some(held) = self.by_ns.get_mut(&ns) else {
            return;
        };
        let n = n.min(held[r.index()]);
        held[r.index()] -= n;
        self.used[r.index()] -= n;
        self.ledger.release_namespace(ns, r, n);
        if held.iter().all(|&v| v == 0) {
            self.by_ns.remove(&ns);
        }
    }

    /// What this connection holds of `r`, over every namespace.
    #[cfg(test)]
    pub(crate) fn used(&self, r: Resource) -> u64 {
        self.used[r.index()]
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        for (ns, held) in self.by_ns.drain() {
            for r in RESOURCES {
                self.ledger.release_namespace(ns, r, held[r.index()]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds() -> Bounds {
        let mut b = Bounds::none();
        b.per_connection[Resource::Watches.index()] = 10;
        b.per_namespace[Resource::Watches.index()] = 15;
        b.per_namespace[Resource::Leases.index()] = 3;
        b.held_share = 0.5;
        b.staging_per_token = 100;
        b
    }

    #[test]
    fn a_connection_meets_its_own_bound_then_its_namespaces() {
        let l = Ledger::new(&bounds(), &[1000, 1000]);
        let mut a = l.account();
        let mut b = l.account();
        a.charge(0, Resource::Watches, 10).unwrap();
        let e = a.charge(0, Resource::Watches, 1).unwrap_err();
        assert_eq!(e.limit, Limit::WatchesPerConnection);
        b.charge(0, Resource::Watches, 5).unwrap();
        let e = b.charge(0, Resource::Watches, 1).unwrap_err();
        assert_eq!(e.limit, Limit::WatchesPerNamespace);
        let msg = e.to_string();
        assert!(msg.contains("15 watched keys"), "{msg}");
        assert!(msg.contains("limits.max_watches_per_namespace"), "{msg}");
        // Another namespace is untouched by both.
        b.charge(1, Resource::Watches, 5).unwrap();
        assert_eq!(l.total(Resource::Watches), 20);
        b.release(0, Resource::Watches, 2);
        a.charge(0, Resource::Watches, 0).unwrap();
        drop(a);
        assert_eq!(l.used(0, Resource::Watches), 3, "a's watches went with it");
        drop(b);
        assert_eq!(l.total(Resource::Watches), 0);
    }

    #[test]
    fn a_refused_charge_takes_nothing_and_releases_never_underflow() {
        let l = Ledger::new(&bounds(), &[1000]);
        l.charge_namespace(0, Resource::Leases, 3).unwrap();
        assert!(l.charge_namespace(0, Resource::Leases, 1).is_err());
        assert_eq!(l.used(0, Resource::Leases), 3);
        l.release_namespace(0, Resource::Leases, 10);
        assert_eq!(l.used(0, Resource::Leases), 0);
        let mut a = l.account();
        a.release(0, Resource::Holds, 5);
        assert_eq!(a.used(Resource::Holds), 0);
        // Unknown namespaces are not the ledger's to refuse.
        l.charge_namespace(9, Resource::Leases, 100).unwrap();
    }

    #[test]
    fn held_bytes_are_a_share_of_each_namespaces_memory() {
        let l = Ledger::new(&bounds(), &[1000, 64]);
        let mut a = l.account();
        a.charge(0, Resource::HeldBytes, 500).unwrap();
        assert!(a.charge(0, Resource::HeldBytes, 1).is_err());
        a.charge(1, Resource::HeldBytes, 32).unwrap();
        let e = a.charge(1, Resource::HeldBytes, 1).unwrap_err();
        assert_eq!(e.limit, Limit::HeldShare);
    }

    #[test]
    fn every_limit_sits_at_its_index_and_names_its_setting() {
        for (i, l) in Limit::ALL.into_iter().enumerate() {
            assert_eq!(l as usize, i);
            let (label, setting) = l.names();
            assert!(setting.contains(label.split('_').next().unwrap()), "{l:?}");
        }
    }

    #[test]
    fn staging_is_bounded_per_token() {
        let l = Ledger::new(&bounds(), &[1000]);
        l.charge_staging(&[1; 32], 60).unwrap();
        let e = l.charge_staging(&[1; 32], 60).unwrap_err();
        assert_eq!(e.limit, Limit::StagingPerToken);
        l.charge_staging(&[2; 32], 60).unwrap();
        l.release_staging(&[1; 32], 60);
        l.charge_staging(&[1; 32], 100).unwrap();
    }
}
