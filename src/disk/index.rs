//! Where each object on disk is: `(namespace, key) → (region, offset, lengths, checksum,
//! seq)`, the bytes each namespace holds, and which keys each region was written with (so a
//! dropped region's objects leave in one pass).

use std::collections::HashMap;

/// One object's record on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) region: u32,
    /// The record's start in its region.
    pub(super) offset: u64,
    pub(super) key_len: u32,
    pub(super) value_len: u64,
    /// Bytes the record takes on disk (what the namespace is charged).
    pub(super) record_len: u64,
    /// xxh3-64 of the value.
    pub(super) checksum: u64,
    /// The pool's generation of the object when it was written here.
    pub(super) generation: u64,
    pub(super) seq: u64,
}

/// The index of every object on disk.
#[derive(Debug, Default)]
pub(super) struct Index {
    namespaces: HashMap<u32, Namespace>,
    /// Per region, the keys whose records it received, some since superseded.
    regions: Vec<Vec<(u32, Box<[u8]>)>>,
    objects: u64,
    bytes: u64,
}

#[derive(Debug, Default)]
struct Namespace {
    entries: HashMap<Box<[u8]>, Entry>,
    bytes: u64,
}

impl Index {
    pub(super) fn new(regions: u32) -> Index {
        Index {
            regions: vec![Vec::new(); regions as usize],
            ..Index::default()
        }
    }

    pub(super) fn get(&self, ns: u32, key: &[u8]) -> Option<Entry> {
        self.namespaces.get(&ns)?.entries.get(key).copied()
    }

    /// Indexes `entry` for `(ns, key)`, replacing (and returning) what was there.
    pub(super) fn insert(&mut self, ns: u32, key: &[u8], entry: Entry) -> Option<Entry> {
        let space = self.namespaces.entry(ns).or_default();
        let old = space.entries.insert(key.into(), entry);
        space.bytes += entry.record_len;
        self.bytes += entry.record_len;
        self.objects += 1;
        if let Some(old) = old {
            space.bytes -= old.record_len;
            self.bytes -= old.record_len;
            self.objects -= 1;
        }
        self.regions[entry.region as usize].push((ns, key.into()));
        old
    }

    /// Forgets `(ns, key)`; its entry, if it had one.
    pub(super) fn remove(&mut self, ns: u32, key: &[u8]) -> Option<Entry> {
        let space = self.namespaces.get_mut(&ns)?;
        let old = space.entries.remove(key)?;
        space.bytes -= old.record_len;
        self.bytes -= old.record_len;
        self.objects -= 1;
        if space.entries.is_empty() {
            self.namespaces.remove(&ns);
        }
        Some(old)
    }

    /// Forgets `(ns, key)` if its entry is still the record with sequence number `seq`.
    pub(super) fn remove_if_seq(&mut self, ns: u32, key: &[u8], seq: u64) -> bool {
        if self.get(ns, key).is_some_and(|e| e.seq == seq) {
            self.remove(ns, key);
            return true;
        }
        false
    }

    /// Forgets every object whose record is in `region`, showing each to `gone`; how many
    /// there were.
    pub(super) fn drop_region(&mut self, region: u32, gone: &dyn Fn(u32, &[u8])) -> u64 {
        let keys = std::mem::take(&mut self.regions[region as usize]);
        let mut dropped = 0;
        for (ns, key) in keys {
            if self.get(ns, &key).is_some_and(|e| e.region == region) {
                self.remove(ns, &key);
                gone(ns, &key);
                dropped += 1;
            }
        }
        dropped
    }

    /// Every object indexed: namespace, key and entry.
    pub(super) fn entries(&self) -> impl Iterator<Item = (u32, &[u8], &Entry)> {
        self.namespaces
            .iter()
            .flat_map(|(&ns, s)| s.entries.iter().map(move |(k, e)| (ns, &k[..], e)))
    }

    /// The keys of namespace `ns`'s objects.
    pub(super) fn keys(&self, ns: u32) -> Vec<Box<[u8]>> {
        self.namespaces
            .get(&ns)
            .map_or_else(Vec::new, |s| s.entries.keys().cloned().collect())
    }

    /// Bytes on disk of namespace `ns`'s objects (whole records, padding included).
    pub(super) fn namespace_bytes(&self, ns: u32) -> u64 {
        self.namespaces.get(&ns).map_or(0, |s| s.bytes)
    }

    /// Objects indexed.
    pub(super) fn objects(&self) -> u64 {
        self.objects
    }

    /// Bytes on disk of every object indexed.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }
}
