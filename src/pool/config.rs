//! How a pool is configured: plain data, every default documented, and what a pool refuses
//! of it.

use std::io;

use crate::addr::NodeId;
use crate::alloc::AllocConfig;
#[cfg(doc)]
use crate::error::PoolError;
use crate::error::MAX_KEY_LEN;
use crate::segment::{Backing, HugePages};

use super::namespace::{NamespaceConfig, DEFAULT_NAMESPACE};
use super::Millis;

/// How to build a pool. Every default is right for one node on a laptop.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// This node's id. Default 0.
    pub node: NodeId,
    /// Bytes of each segment's data area. Default 1 GiB.
    pub segment_size: u64,
    /// Number of segments. Default 1.
    pub segments: u32,
    /// Where segment memory comes from. Default: files in `/dev/shm/kvpool-<node>`.
    pub backing: Backing,
    /// Huge page policy. Default [`HugePages::Auto`].
    pub huge_pages: HugePages,
    /// Fault every page in at start. Default false.
    pub prefault: bool,
    /// Allocator geometry. Default 64 KiB pages, 512 B granule.
    pub alloc: AllocConfig,
    /// Index shards (rounded up to a power of two). Default 1: one eviction domain, so every
    /// policy behaves exactly as the harness simulates it. With more shards the policy instances
    /// of a namespace share their state and victims are compared across shards, which keeps
    /// every policy within a fifth of a point of one domain on the public trace at 64 shards,
    /// though up to a point below it on Mooncake's synthetic trace when a namespace holds only a
    /// few blocks a shard (docs/BENCHMARKS.md); raise it where index lock contention is measured.
    pub shards: usize,
    /// How long an allocation may stay uncommitted before it is reclaimed. Default 30 s.
    pub pending_timeout_ms: Millis,
    /// Longest lease a reader may take. Default 30 s.
    pub max_lease_ms: Millis,
    /// Longest key, in bytes: 1 to [`MAX_KEY_LEN`] (a larger value, or 0, is taken as
    /// [`MAX_KEY_LEN`]). A longer key is refused with [`PoolError::BadKey`] by every call that
    /// takes one. Default [`MAX_KEY_LEN`].
    pub max_key_len: usize,
    /// Namespaces; `default` is added when missing.
    pub namespaces: Vec<NamespaceConfig>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            node: NodeId(0),
            segment_size: 1 << 30,
            segments: 1,
            backing: Backing::File(default_dir(NodeId(0))),
            huge_pages: HugePages::Auto,
            prefault: false,
            alloc: AllocConfig::default(),
            shards: 1,
            pending_timeout_ms: 30_000,
            max_lease_ms: 30_000,
            max_key_len: MAX_KEY_LEN,
            namespaces: vec![NamespaceConfig::unlimited(DEFAULT_NAMESPACE)],
        }
    }
}

/// The default segment directory of a node: `/dev/shm/kvpool-<node>`.
pub fn default_dir(node: NodeId) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/dev/shm/kvpool-{}", node.0))
}

/// The namespaces of `cfg`, `default` first when it lacks one; refused when a name is empty
/// or repeated.
pub(super) fn namespaces_of(cfg: &PoolConfig) -> io::Result<Vec<NamespaceConfig>> {
    let mut ns_cfg = cfg.namespaces.clone();
    if !ns_cfg.iter().any(|n| n.name == DEFAULT_NAMESPACE) {
        ns_cfg.insert(0, NamespaceConfig::unlimited(DEFAULT_NAMESPACE));
    }
    for (i, n) in ns_cfg.iter().enumerate() {
        if n.name.is_empty() || ns_cfg[..i].iter().any(|m| m.name == n.name) {
            return Err(invalid(format!(
                "namespace name {:?} is empty or repeated",
                n.name
            )));
        }
    }
    Ok(ns_cfg)
}

/// A configuration the pool refuses, and why.
pub(super) fn invalid(m: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, m)
}
