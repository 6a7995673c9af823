//! Recovery: a pool started on the segment directory of a previous life copies that life's
//! objects into its own segments, every one checked by its checksum first.
//!
//! The previous life's journal (see [`crate::journal`]) says which objects were in its index
//! and where; its segment files, still in the directory, hold the bytes. They are mapped
//! read-only before the new segments replace them (the old files are then retired and
//! unlinked, their pages live on in our mapping until recovery ends). Each object is copied
//! into a fresh allocation of the new pool and hashed there, where nothing else can write it;
//! only an object whose bytes hash to the checksum its journal record holds is committed.
//! Everything else is dropped: objects whose bytes changed or were damaged, records that point
//! outside their segment, namespaces the new configuration lacks, objects that no longer fit.
//! Pending (uncommitted) allocations were never journaled, so they are gone. The new
//! allocator, index and journal are built by the ordinary alloc and commit path, so they are
//! exactly as if the objects had just been put: coldest first by the ranks the previous life's
//! eviction policies gave them when it stopped cleanly ([`crate::pool::recency`]), else in
//! commit order.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::path::Path;

use crate::addr::NodeId;
use crate::checksum::checksum;
use crate::journal::{self, journal_file_name, Committed};
use crate::pool::{Commit, Pool};
use crate::segment::{RetiredSegment, LAYOUT_VERSION};

/// What a pool found of its previous life at start-up (see [`Pool::recovery`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Why nothing was recovered although a journal was there (an unknown format or damage);
    /// None when there was no journal or it was read.
    pub unreadable: Option<String>,
    /// Objects the journal listed.
    pub listed: u64,
    /// Objects recovered: checked by their checksum and now served.
    pub recovered: u64,
    /// Bytes of recovered values.
    pub recovered_bytes: u64,
    /// Dropped: bytes not matching their checksum.
    pub dropped_checksum: u64,
    /// Dropped: segment file missing or unreadable, or a record outside its segment.
    pub dropped_bounds: u64,
    /// Dropped: namespace not in this configuration.
    pub dropped_namespace: u64,
    /// Dropped: no room (smaller memory or quotas than the previous life).
    pub dropped_no_room: u64,
    /// Bytes after the journal's last whole record (a record cut by a crash).
    pub torn_tail: u64,
}

/// The previous life's journal and segments, opened before the new segments replace them.
pub(crate) struct Previous {
    objects: Vec<Committed>,
    namespaces: Vec<String>,
    segments: HashMap<u16, RetiredSegment>,
    report: Recovery,
}

impl Previous {
    /// Reads what `dir` holds of node `node`'s previous life: nothing when there is no journal.
    pub(crate) fn open(dir: &Path, node: NodeId) -> Previous {
        let mut prev = Previous {
            objects: Vec::new(),
            namespaces: Vec::new(),
            segments: HashMap::new(),
            report: Recovery::default(),
        };
        let bytes = match std::fs::read(dir.join(journal_file_name(node))) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return prev,
            Err(e) => {
                prev.report.unreadable = Some(format!("journal: {e}"));
                return prev;
            }
        };
        let replayed = match journal::replay(&bytes, LAYOUT_VERSION) {
            Ok(r) if r.node == node.0 => r,
            Ok(r) => {
                prev.report.unreadable = Some(format!("journal of node {}", r.node));
                return prev;
            }
            Err(e) => {
                prev.report.unreadable = Some(e.to_string());
                return prev;
            }
        };
        for c in &replayed.objects {
            if let Entry::Vacant(v) = prev.segments.entry(c.segment) {
                if let Ok(s) = RetiredSegment::open(dir, node, u32::from(c.segment)) {
                    v.insert(s);
                }
            }
        }
        prev.report.listed = replayed.objects.len() as u64;
        prev.report.torn_tail = replayed.torn_tail;
        prev.objects = replayed.objects;
        prev.namespaces = replayed.namespaces;
        if let Some(ranks) = super::recency::take_ranks(dir, node) {
            // Coldest first; objects the ranks do not list (written after them, or pinned)
            // keep their commit order, ahead of the ranked ones.
            let names = &prev.namespaces;
            prev.objects.sort_by_cached_key(|c| {
                let name = names.get(c.ns as usize).cloned().unwrap_or_default();
                ranks.get(&(name, c.key.clone())).copied().unwrap_or(0)
            });
        }
        prev
    }
}

impl Pool {
    /// Copies the previous life's valid objects into this pool (see the module docs).
    pub(crate) fn recover(&self, prev: Previous) -> Recovery {
        let mut r = prev.report;
        // journal namespace id -> this pool's
        let ns_map: Vec<Option<u32>> = prev
            .namespaces
            .iter()
            .map(|n| self.namespace_id(n))
            .collect();
        for c in &prev.objects {
            let Some(ns) = ns_map.get(c.ns as usize).copied().flatten() else {
                r.dropped_namespace += 1;
                continue;
            };
            let Some(old) = prev.segments.get(&c.segment) else {
                r.dropped_bounds += 1;
                continue;
            };
            let l = old.layout();
            let inside = c
                .offset
                .checked_add(c.len)
                .is_some_and(|end| end <= l.data_len);
            if !inside || c.offset % l.granule != 0 {
                r.dropped_bounds += 1;
                continue;
            }
            let Ok(addr) = self.alloc_in_chain(ns, &c.key, c.len, c.pinned, c.depth, 0) else {
                r.dropped_no_room += 1;
                continue;
            };
            let hashed = match self.begin_write(&addr) {
                Ok(mut w) => {
                    let dst = w.bytes_mut();
                    old.copy_out(c.offset, dst).then(|| checksum(dst))
                }
                Err(_) => None,
            };
            if hashed != Some(c.checksum) {
                let _ = self.abort(&addr);
                r.dropped_checksum += 1;
                continue;
            }
            // Hashed in our own allocation, whose address was never handed out, written whole
            // under one write claim: the bytes hashed are the bytes committed.
            match self.commit(Commit::prehashed(&addr, c.checksum, c.checksum)) {
                Ok(_) => {
                    r.recovered += 1;
                    r.recovered_bytes += c.len;
                }
                Err(_) => r.dropped_no_room += 1,
            }
        }
        r
    }
}
