//! Namespaces: tenants and models, each with a byte quota; part of every object's identity.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::eviction::PolicyKind;

/// The namespace every pool has.
pub const DEFAULT_NAMESPACE: &str = "default";

/// A namespace as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceConfig {
    /// Name clients use (a tenant, a model, or both: `"acme/llama3-8b"`).
    pub name: String,
    /// Most bytes (of reserved memory, pinned objects included) the namespace may hold on this
    /// node; `None` for no limit but the pool's size.
    pub quota_bytes: Option<u64>,
    /// Eviction policy of the namespace's objects. Default [`PolicyKind::S3FifoLru`].
    pub eviction: PolicyKind,
}

impl NamespaceConfig {
    /// A namespace with no quota and the default eviction policy.
    pub fn unlimited(name: &str) -> Self {
        NamespaceConfig {
            name: name.to_string(),
            quota_bytes: None,
            eviction: PolicyKind::default(),
        }
    }
}

/// Live accounting of one namespace.
#[derive(Debug)]
pub(crate) struct Namespace {
    pub(crate) name: String,
    pub(crate) quota: u64,
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
    pub(crate) fn new(cfg: &NamespaceConfig) -> Self {
        Namespace {
            name: cfg.name.clone(),
            quota: cfg.quota_bytes.unwrap_or(u64::MAX),
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
