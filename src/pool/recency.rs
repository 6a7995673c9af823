//! The order a pool's eviction policies ranked its objects in, kept across a clean stop, so that
//! the next life re-inserts the objects it recovers coldest first and its policies rank them as
//! before: a hot object written long ago stays hot. Without it, recovery re-inserts in commit
//! order (the journal's), which makes the oldest writes the first evicted whatever their use.
//!
//! `recency-<node>.kvr` is written by [`Pool::save_recency`] once the last request has finished
//! (a clean stop), and read and removed by the next open of the directory. It is only a hint:
//! missing, damaged or out of date, recovery falls back to commit order, and objects it does not
//! list come first (coldest). Layout, little endian: `b"KVPR"`, version (u32), then per
//! namespace its name (u32 length, bytes) and its objects (u64 count, then each key as u16
//! length and bytes, and its rank as u64), and last the xxh3-64 of everything before.

use crate::le::Reader;
use std::collections::HashMap;
use std::io;
use std::path::Path;

use crate::addr::NodeId;
use crate::pool::Pool;

const MAGIC: &[u8; 4] = b"KVPR";
const VERSION: u32 = 1;
/// Longest key a pool holds (the protocol's limit), for bounding what is read.
const MAX_KEY: usize = 256;

/// The hint's file name for node `node`.
pub fn recency_file_name(node: NodeId) -> String {
    format!("recency-{}.kvr", node.0)
}

/// Ranks read back: per (namespace name, key), higher is hotter.
pub(crate) type Ranks = HashMap<(String, Vec<u8>), u64>;

impl Pool {
    /// Writes the ranks of every unpinned object (pinned ones are never evicted) to `dir`, for
    /// the next life on the directory to recover them in that order (see the module docs).
    /// Returns how many objects it lists. Call it once nothing writes the pool any more.
    pub fn save_recency(&self, dir: &Path) -> io::Result<u64> {
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&VERSION.to_le_bytes());
        let mut listed = 0u64;
        for (name, id) in self.namespaces() {
            let objects = self
                .unpinned_objects(id, |_| true)
                .map_err(io::Error::other)?;
            body.extend_from_slice(&(name.len() as u32).to_le_bytes());
            body.extend_from_slice(name.as_bytes());
            body.extend_from_slice(&(objects.len() as u64).to_le_bytes());
            for o in &objects {
                body.extend_from_slice(&(o.key.len() as u16).to_le_bytes());
                body.extend_from_slice(&o.key);
                body.extend_from_slice(&o.worth.to_le_bytes());
            }
            listed += objects.len() as u64;
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&body);
        body.extend_from_slice(&sum.to_le_bytes());
        let path = dir.join(recency_file_name(self.node()));
        let tmp = path.with_extension("kvr.tmp");
        std::fs::write(&tmp, &body)?;
        std::fs::rename(&tmp, &path)?;
        Ok(listed)
    }
}

/// Reads and removes node `node`'s hint from `dir`; None when there is none or it does not
/// check out (any damage discards it whole).
pub(crate) fn take_ranks(dir: &Path, node: NodeId) -> Option<Ranks> {
    let path = dir.join(recency_file_name(node));
    let bytes = std::fs::read(&path).ok();
    let _ = std::fs::remove_file(&path);
    parse(&bytes?)
}

fn parse(bytes: &[u8]) -> Option<Ranks> {
    let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
    if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum.try_into().ok()?) {
        return None;
    }
    let mut r = Reader(body);
    if r.take(4)? != MAGIC || r.u32()? != VERSION {
        return None;
    }
    let mut ranks = Ranks::new();
    while !r.0.is_empty() {
        let name_len = r.u32()? as usize;
        let name = std::str::from_utf8(r.take(name_len)?).ok()?.to_string();
        let count = r.u64()?;
        for _ in 0..count {
            let len = r.u16()? as usize;
            if len > MAX_KEY {
                return None;
            }
            let key = r.take(len)?.to_vec();
            let rank = r.u64()?;
            ranks.insert((name.clone(), key), rank);
        }
    }
    Some(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One namespace's objects: its name, and each key with its rank.
    type Listed<'a> = (&'a str, &'a [(&'a [u8], u64)]);

    fn file(entries: &[Listed<'_>]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&VERSION.to_le_bytes());
        for (name, objects) in entries {
            b.extend_from_slice(&(name.len() as u32).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            b.extend_from_slice(&(objects.len() as u64).to_le_bytes());
            for (k, rank) in *objects {
                b.extend_from_slice(&(k.len() as u16).to_le_bytes());
                b.extend_from_slice(k);
                b.extend_from_slice(&rank.to_le_bytes());
            }
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    #[test]
    fn ranks_read_back_and_any_damage_discards_them() {
        let b = file(&[("a", &[(b"k1", 7), (b"k2", 3)]), ("b", &[(b"k1", 9)])]);
        let r = parse(&b).unwrap();
        assert_eq!(r[&("a".to_string(), b"k1".to_vec())], 7);
        assert_eq!(r[&("b".to_string(), b"k1".to_vec())], 9);
        assert_eq!(r.len(), 3);
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x40;
            assert!(parse(&bad).is_none(), "byte {i} flipped");
        }
        for cut in 0..b.len() {
            assert!(parse(&b[..cut]).is_none(), "cut at {cut}");
        }
    }
}
