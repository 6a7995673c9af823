//! What a pool reports: occupancy and fragmentation per segment, use per namespace, counters.

use std::sync::atomic::{AtomicU64, Ordering};

use rkyv::{Archive, Deserialize, Serialize};

use super::Pool;

/// Event counters, bumped on the hot path with relaxed atomics.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) evictions: AtomicU64,
    pub(crate) commits: AtomicU64,
    pub(crate) reaped: AtomicU64,
    /// Keys refused for their length (longer than `max_key_len`).
    pub(crate) long_keys: AtomicU64,
}

/// Occupancy of one segment.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize, serde::Serialize)]
pub struct SegmentStats {
    /// Segment number.
    pub id: u32,
    /// Bytes of the data area.
    pub capacity: u64,
    /// Bytes reserved by live blocks (including size-class rounding).
    pub used_bytes: u64,
    /// Bytes not reserved.
    pub free_bytes: u64,
    /// Live blocks (committed and pending objects).
    pub live_blocks: u64,
    /// Largest contiguous free run, in bytes.
    pub largest_free_run: u64,
    /// `1 - largest_free_run / free_bytes`: how scattered the free memory is.
    pub external_fragmentation: f64,
}

/// Use of one namespace on this node.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize, serde::Serialize)]
pub struct NamespaceStats {
    /// Name.
    pub name: String,
    /// Id used on the wire.
    pub id: u32,
    /// Quota in bytes (`u64::MAX`: none).
    pub quota_bytes: u64,
    /// Bytes reserved by its objects, pending ones included.
    pub used_bytes: u64,
    /// Bytes of its pinned objects.
    pub pinned_bytes: u64,
    /// Committed objects.
    pub objects: u64,
    /// Reads that found their object.
    pub hits: u64,
    /// Reads that did not.
    pub misses: u64,
    /// Blocks asked for by prefix lookups (`Exists`).
    pub prefix_blocks: u64,
    /// Of those, blocks in the matched leading runs.
    pub prefix_hits: u64,
}

/// A snapshot of a pool.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize, serde::Serialize)]
pub struct PoolStats {
    /// The node.
    pub node: u32,
    /// Per segment.
    pub segments: Vec<SegmentStats>,
    /// Per namespace.
    pub namespaces: Vec<NamespaceStats>,
    /// Committed objects.
    pub objects: u64,
    /// Allocations not yet committed.
    pub pending: u64,
    /// Lookups that found their object.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Objects evicted for space.
    pub evictions: u64,
    /// Objects committed.
    pub commits: u64,
    /// Abandoned allocations reclaimed.
    pub reaped: u64,
}

impl PoolStats {
    /// Bytes of all segments.
    pub fn capacity(&self) -> u64 {
        self.segments.iter().map(|s| s.capacity).sum()
    }

    /// Bytes reserved in all segments.
    pub fn used_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.used_bytes).sum()
    }
}

pub(crate) fn collect(pool: &Pool) -> PoolStats {
    let segments = pool
        .segments
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let a = super::lock(&s.alloc).stats();
            SegmentStats {
                id: i as u32,
                capacity: a.capacity,
                used_bytes: a.used_bytes,
                free_bytes: a.free_bytes,
                live_blocks: a.live_blocks,
                largest_free_run: a.largest_free_run,
                external_fragmentation: a.external_fragmentation(),
            }
        })
        .collect();
    let namespaces: Vec<NamespaceStats> = pool
        .namespaces
        .iter()
        .enumerate()
        .map(|(i, n)| NamespaceStats {
            name: n.name.clone(),
            id: i as u32,
            quota_bytes: n.quota,
            used_bytes: n.used.load(Ordering::Relaxed),
            pinned_bytes: n.pinned.load(Ordering::Relaxed),
            objects: n.objects.load(Ordering::Relaxed),
            hits: n.hits.load(Ordering::Relaxed),
            misses: n.misses.load(Ordering::Relaxed),
            prefix_blocks: n.prefix_blocks.load(Ordering::Relaxed),
            prefix_hits: n.prefix_hits.load(Ordering::Relaxed),
        })
        .collect();
    let pending = pool
        .pending
        .iter()
        .map(|p| super::lock(p).by_generation.len() as u64)
        .sum();
    let c = &pool.counters;
    let hits = namespaces.iter().map(|n| n.hits).sum();
    let misses = namespaces.iter().map(|n| n.misses).sum();
    PoolStats {
        node: pool.node.0,
        segments,
        objects: namespaces.iter().map(|n| n.objects).sum(),
        namespaces,
        pending,
        hits,
        misses,
        evictions: c.evictions.load(Ordering::Relaxed),
        commits: c.commits.load(Ordering::Relaxed),
        reaped: c.reaped.load(Ordering::Relaxed),
    }
}
