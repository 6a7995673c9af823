//! Namespaces: tenants and models, each with a byte quota; part of every object's identity.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::PoolError;
use crate::eviction::PolicyKind;

use super::Pool;

/// The namespace every pool has.
pub const DEFAULT_NAMESPACE: &str = "default";

/// A namespace as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceConfig {
    /// Name clients use (a tenant, a model, or both: `"acme/llama3-8b"`).
    pub name: String,
    /// Bytes of the pool reserved for the namespace on this node, and the most it may hold
    /// (in allocator blocks: pinned and pending objects included). Nobody else can take
    /// reserved memory: eviction on behalf of another namespace never touches it. `None`: no
    /// reservation; the namespace shares the memory no namespace reserved with the other
    /// namespaces without one, up to all of it.
    pub quota_bytes: Option<u64>,
    /// Eviction policy of the namespace's objects. Default [`PolicyKind::S3FifoLru`].
    pub eviction: PolicyKind,
    /// Keep the namespace's objects in a segment of its own, of its reservation's size (which
    /// it then needs), carved out of the pool's memory: a same-host client is handed the
    /// segments of the namespaces it authenticated for only, so a tenant whose namespace has a
    /// segment of its own never has another tenant's bytes in its address space, nor they its.
    /// Default false: the namespace shares the pool's common segments.
    pub own_segment: bool,
}

impl NamespaceConfig {
    /// A namespace with no reservation (sharing the unreserved memory) and the default eviction
    /// policy.
    pub fn unlimited(name: &str) -> Self {
        NamespaceConfig {
            name: name.to_string(),
            quota_bytes: None,
            eviction: PolicyKind::default(),
            own_segment: false,
        }
    }
}

/// Live accounting of one namespace.
#[derive(Debug)]
pub(crate) struct Namespace {
    pub(crate) name: String,
    /// Its limit: its reservation, or (when it has none) the unreserved memory it shares.
    pub(crate) quota: u64,
    /// True when `quota` is a reservation of its own; false when it shares unreserved memory.
    pub(crate) reserved: bool,
    pub(crate) used: AtomicU64,
    pub(crate) pinned: AtomicU64,
    pub(crate) objects: AtomicU64,
    /// Reads that found their object / did not.
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    /// Blocks asked for by prefix lookups, and how many of them matched.
    pub(crate) prefix_blocks: AtomicU64,
    pub(crate) prefix_hits: AtomicU64,
}

impl Namespace {
    /// `unreserved`: the memory no namespace reserved, the limit of one without a reservation.
    pub(crate) fn new(cfg: &NamespaceConfig, unreserved: u64) -> Self {
        Namespace {
            name: cfg.name.clone(),
            quota: cfg.quota_bytes.unwrap_or(unreserved),
            reserved: cfg.quota_bytes.is_some(),
            used: AtomicU64::new(0),
            pinned: AtomicU64::new(0),
            objects: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            prefix_blocks: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
        }
    }

    /// Reserves `size` bytes of quota; false when that would exceed it.
    pub(crate) fn try_reserve(&self, size: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                cur.checked_add(size).filter(|&n| n <= self.quota)
            })
            .is_ok()
    }

    pub(crate) fn unreserve(&self, size: u64) {
        self.used.fetch_sub(size, Ordering::AcqRel);
    }
}

impl Pool {
    /// Takes `size` bytes of `space`'s limit; false when that would exceed it.
    pub(super) fn reserve(&self, space: &Namespace, size: u64) -> bool {
        if space.reserved {
            return space.try_reserve(size);
        }
        let shared = self
            .shared_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                cur.checked_add(size).filter(|&n| n <= self.unreserved)
            });
        if shared.is_err() {
            return false;
        }
        // Its own use never exceeds the shared use, which is within `unreserved`.
        space.used.fetch_add(size, Ordering::AcqRel);
        true
    }

    pub(super) fn unreserve(&self, space: &Namespace, size: u64) {
        space.unreserve(size);
        if !space.reserved {
            self.shared_used.fetch_sub(size, Ordering::AcqRel);
        }
    }

    /// The memory namespace `ns` may use: its quota, or, for one without a quota, the memory
    /// no namespace reserved, which it shares with the others without one.
    pub fn namespace_capacity(&self, ns: u32) -> Result<u64, PoolError> {
        Ok(self.ns(ns)?.quota)
    }
}
