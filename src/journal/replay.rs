//! Reading a journal back: the objects its records leave in the index, one per key.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64;

use super::format::{decode, record_at, u32_at, u64_at, Committed, Decoded};
use super::{JOURNAL_MAGIC, JOURNAL_VERSION};

/// Why a journal could not be read at all.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Not a journal (bad magic) or a damaged header.
    #[error("not a kvpool journal, or its header is damaged")]
    Corrupt,
    /// A journal format this build does not read.
    #[error("journal format version {0} (this kvpoold reads version {JOURNAL_VERSION})")]
    UnknownVersion(u32),
    /// Segments of a layout this build does not read.
    #[error("segment layout version {found} (this kvpoold reads version {reads})")]
    UnknownLayout {
        /// The journal's layout.
        found: u32,
        /// The one this build reads.
        reads: u32,
    },
}

/// What [`replay`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// The journal writer's node.
    pub node: u32,
    /// Its namespace names, by id.
    pub namespaces: Vec<String>,
    /// Objects in the index when the journal ends, oldest commit first, one per key.
    pub objects: Vec<Committed>,
    /// Bytes after the last whole record (a record cut short by a crash, or damage), not
    /// counting the zeros allocated ahead of it.
    pub torn_tail: u64,
    /// Where the last whole record ends (the header's length when there is none).
    pub end: u64,
}

/// Parses a journal. `layout` is the segment layout version this build reads.
pub fn replay(bytes: &[u8], layout: u32) -> Result<Replayed, JournalError> {
    let (node, namespaces, start) = read_header(bytes, layout)?;
    let (live, pos) = read_records(bytes, start, namespaces.len());
    let objects = newest_per_key(live);
    // Zeros after the records are space the writer allocated ahead, not a torn record.
    let written = bytes
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |i| i + 1)
        .max(pos);
    Ok(Replayed {
        node,
        namespaces,
        objects,
        torn_tail: (written - pos) as u64,
        end: pos as u64,
    })
}

/// Checks a journal's header and reads it: the writer's node, its namespace names by id, and
/// where the records start.
fn read_header(bytes: &[u8], layout: u32) -> Result<(u32, Vec<String>, usize), JournalError> {
    if bytes.len() < 24 || bytes[..8] != JOURNAL_MAGIC {
        return Err(JournalError::Corrupt);
    }
    let version = u32_at(bytes, 8);
    if version != JOURNAL_VERSION {
        return Err(JournalError::UnknownVersion(version));
    }
    let body_len = u32_at(bytes, 12) as usize;
    let body = bytes.get(24..24 + body_len).ok_or(JournalError::Corrupt)?;
    if xxh3_64(body) != u64_at(bytes, 16) || body.len() < 12 {
        return Err(JournalError::Corrupt);
    }
    let found = u32_at(body, 0);
    if found != layout {
        return Err(JournalError::UnknownLayout {
            found,
            reads: layout,
        });
    }
    let node = u32_at(body, 4);
    let count = u32_at(body, 8) as usize;
    let mut namespaces = Vec::new();
    let mut at = 12;
    for _ in 0..count {
        let len = body
            .get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
            .ok_or(JournalError::Corrupt)?;
        let name = body
            .get(at + 2..at + 2 + len)
            .ok_or(JournalError::Corrupt)?;
        namespaces.push(String::from_utf8(name.to_vec()).map_err(|_| JournalError::Corrupt)?);
        at += 2 + len;
    }
    if at != body.len() {
        return Err(JournalError::Corrupt);
    }
    Ok((node, namespaces, 24 + body_len))
}

/// Applies the whole records from `pos` on, up to the first that is not whole or makes no
/// sense: the objects then live, by generation, each with the sequence number of its commit;
/// and where the last record applied ends.
fn read_records(
    bytes: &[u8],
    mut pos: usize,
    namespaces: usize,
) -> (HashMap<u64, (u64, Committed)>, usize) {
    // generation -> (sequence of its commit, object)
    let mut live: HashMap<u64, (u64, Committed)> = HashMap::new();
    let mut seq = 0u64;
    while pos < bytes.len() {
        let Some(rec) = record_at(bytes, pos) else {
            break;
        };
        pos += 12 + rec.len();
        seq += 1;
        match decode(rec, namespaces) {
            Some(Decoded::Commit(c)) => {
                live.insert(c.generation, (seq, c));
            }
            Some(Decoded::Gone(g)) => {
                live.remove(&g);
            }
            Some(Decoded::Pin(g, pinned)) => {
                if let Some((_, c)) = live.get_mut(&g) {
                    c.pinned = pinned;
                }
            }
            // A whole record (its checksum holds) that makes no sense: damage we can't
            // explain, so nothing after it is trusted either.
            None => {
                pos -= 12 + rec.len();
                break;
            }
        }
    }
    (live, pos)
}

/// The live objects, oldest commit first, one per key.
fn newest_per_key(live: HashMap<u64, (u64, Committed)>) -> Vec<Committed> {
    let mut objects: Vec<(u64, Committed)> = live.into_values().collect();
    objects.sort_unstable_by_key(|(s, _)| *s);
    // A key committed again before its older object's "gone" was written (a crash between
    // the two): the later commit wins.
    let mut newest: HashMap<(u32, &[u8]), u64> = HashMap::new();
    for (s, c) in &objects {
        newest.insert((c.ns, c.key.as_slice()), *s);
    }
    let keep: Vec<bool> = objects
        .iter()
        .map(|(s, c)| newest.get(&(c.ns, c.key.as_slice())) == Some(s))
        .collect();
    objects
        .into_iter()
        .zip(keep)
        .filter_map(|((_, c), k)| k.then_some(c))
        .collect()
}
