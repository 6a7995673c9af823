//! How a pool's memory is laid out: the common segments and the namespaces' own, created with
//! their allocators, and the reservations checked against them.

use std::io;
use std::sync::Mutex;

use crate::alloc::Allocator;
use crate::segment::{Segment, SegmentSpec};
use crate::sync::lock;

use super::config::invalid;
use super::namespace::NamespaceConfig;
use super::{PoolConfig, SegmentSlot};

/// The pool's segments: their data sizes and owners, and each namespace's segments.
pub(super) struct SegmentPlan {
    /// Per segment id: (data bytes asked for, the namespace whose own it is).
    pub(super) segments: Vec<(u64, Option<u32>)>,
    /// Per namespace id.
    pub(super) ns_segments: Vec<std::ops::Range<usize>>,
}

/// Lays out the pool's memory (`segments` × `segment_size`): a segment of its own for each
/// namespace that asks for one, of its reservation rounded up to whole pages, first, and what
/// is left split evenly among the common segments (ids `0..segments`, then the namespaces' own
/// in namespace order). Without such namespaces, exactly the configured segments.
pub(super) fn plan_segments(
    cfg: &PoolConfig,
    ns: &[NamespaceConfig],
) -> Result<SegmentPlan, String> {
    let page = cfg.alloc.page_size.max(1);
    let total = cfg
        .segment_size
        .checked_mul(u64::from(cfg.segments))
        .ok_or("the pool's memory overflows")?;
    // (data bytes, namespace) of each own segment, in namespace order.
    let mut own = Vec::new();
    for (id, n) in ns.iter().enumerate().filter(|(_, n)| n.own_segment) {
        let quota = n.quota_bytes.ok_or_else(|| {
            format!(
                "namespace {:?} asks for a segment of its own but has no quota to size it",
                n.name
            )
        })?;
        own.push((
            quota.div_ceil(page).saturating_mul(page).max(page),
            id as u32,
        ));
    }
    let taken = own
        .iter()
        .try_fold(0u64, |a, &(b, _)| a.checked_add(b))
        .unwrap_or(u64::MAX);
    let common = total.saturating_sub(taken) / u64::from(cfg.segments);
    if common < page {
        return Err(format!(
            "the namespaces' own segments ({taken} bytes) leave nothing of the pool's \
             {total} bytes for the common segments: lower their quotas or add memory"
        ));
    }
    let commons = cfg.segments as usize;
    let segments: Vec<(u64, Option<u32>)> = (0..commons)
        .map(|_| (common, None))
        .chain(own.iter().map(|&(size, n)| (size, Some(n))))
        .collect();
    let ns_segments = (0..ns.len())
        .map(|i| match own.iter().position(|&(_, n)| n as usize == i) {
            Some(k) => commons + k..commons + k + 1,
            None => 0..commons,
        })
        .collect();
    if segments.len() > u16::MAX as usize {
        return Err(format!("{} segments are more than 65535", segments.len()));
    }
    Ok(SegmentPlan {
        segments,
        ns_segments,
    })
}

/// Creates the segments `layout` plans, each with its allocator, stamped with `incarnation`.
pub(super) fn create_segments(
    cfg: &PoolConfig,
    layout: &SegmentPlan,
    incarnation: u64,
) -> io::Result<Vec<SegmentSlot>> {
    let mut segments = Vec::new();
    for (id, &(size, _)) in layout.segments.iter().enumerate() {
        let alloc = Allocator::new(size, cfg.alloc)
            .map_err(|e| invalid(format!("segment size {size}: {e}")))?;
        let spec = SegmentSpec {
            node: cfg.node,
            id: id as u32,
            data_len: alloc.capacity(),
            granule: alloc.granule(),
            backing: cfg.backing.clone(),
            huge_pages: cfg.huge_pages,
            prefault: cfg.prefault,
            incarnation,
        };
        let mut segment = Segment::create(&spec)?;
        segment.keep_file_on_drop();
        segments.push(SegmentSlot {
            segment,
            alloc: Mutex::new(alloc),
        });
    }
    Ok(segments)
}

/// The memory no namespace reserved, which the namespaces without a reservation share.
/// Reservations are promises of memory: together they must fit in the pool. A segment of a
/// namespace's own is its reservation; the others' come out of the common segments.
pub(super) fn unreserved_memory(
    segments: &[SegmentSlot],
    layout: &SegmentPlan,
    ns_cfg: &[NamespaceConfig],
) -> io::Result<u64> {
    let capacity: u64 = segments.iter().map(|s| lock(&s.alloc).capacity()).sum();
    let shared_capacity: u64 = segments
        .iter()
        .zip(&layout.segments)
        .filter(|(_, (_, owner))| owner.is_none())
        .map(|(s, _)| lock(&s.alloc).capacity())
        .sum();
    let reserved = ns_cfg
        .iter()
        .filter(|n| !n.own_segment)
        .filter_map(|n| n.quota_bytes)
        .try_fold(0u64, u64::checked_add)
        .filter(|&r| r <= shared_capacity)
        .ok_or_else(|| {
            invalid(format!(
                "namespace quotas reserve more than the pool's {capacity} bytes \
                 ({}): lower them or add memory",
                ns_cfg
                    .iter()
                    .filter_map(|n| Some(format!("{} {}", n.name, n.quota_bytes?)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
    Ok(shared_capacity - reserved)
}
