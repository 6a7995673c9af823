//! The journal's bytes: the header, the records (commit, gone, pin) and their framing, as
//! the module docs draw them.

use xxhash_rust::xxh3::xxh3_64;

use crate::addr::NodeId;
use crate::error::MAX_KEY_LEN;

/// Magic bytes at the start of a journal.
pub const JOURNAL_MAGIC: [u8; 8] = *b"KVPOOLJN";
/// Version of the journal format described in the module docs.
pub const JOURNAL_VERSION: u32 = 1;

const TAG_COMMIT: u8 = 1;
pub(super) const TAG_GONE: u8 = 2;
pub(super) const TAG_PIN: u8 = 3;
const COMMIT_FIXED: usize = 1 + 4 + 2 + 8 * 4 + 1 + 4 + 2;
pub(super) const MAX_RECORD: usize = COMMIT_FIXED + MAX_KEY_LEN;

/// An object as the journal last described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// Namespace id, in the journal's namespace table.
    pub ns: u32,
    /// Segment number.
    pub segment: u16,
    /// Offset in the segment's data area.
    pub offset: u64,
    /// Value length.
    pub len: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// Generation in the life that wrote it.
    pub generation: u64,
    /// Pinned (never evicted).
    pub pinned: bool,
    /// Prefix-chain depth given at its allocation.
    pub depth: u32,
    /// The key.
    pub key: Vec<u8>,
}

/// A commit to record, borrowing its key.
#[derive(Clone, Copy, Debug)]
pub struct Record<'a> {
    /// Namespace id.
    pub ns: u32,
    /// Segment number.
    pub segment: u16,
    /// Offset in the segment's data area.
    pub offset: u64,
    /// Value length.
    pub len: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// Generation.
    pub generation: u64,
    /// Pinned.
    pub pinned: bool,
    /// Prefix-chain depth.
    pub depth: u32,
    /// The key.
    pub key: &'a [u8],
}

impl Committed {
    /// This object as a record to write.
    pub fn record(&self) -> Record<'_> {
        Record {
            ns: self.ns,
            segment: self.segment,
            offset: self.offset,
            len: self.len,
            checksum: self.checksum,
            generation: self.generation,
            pinned: self.pinned,
            depth: self.depth,
            key: &self.key,
        }
    }
}

/// A journal's header: its format, the segment layout `layout`, node `node` and the names of
/// its namespaces, by id.
pub(super) fn header(node: NodeId, layout: u32, namespaces: &[String]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&layout.to_le_bytes());
    body.extend_from_slice(&node.0.to_le_bytes());
    body.extend_from_slice(&(namespaces.len() as u32).to_le_bytes());
    for n in namespaces {
        let name = &n.as_bytes()[..n.len().min(u16::MAX as usize)];
        body.extend_from_slice(&(name.len() as u16).to_le_bytes());
        body.extend_from_slice(name);
    }
    let mut header = Vec::with_capacity(24 + body.len());
    header.extend_from_slice(&JOURNAL_MAGIC);
    header.extend_from_slice(&JOURNAL_VERSION.to_le_bytes());
    header.extend_from_slice(&(body.len() as u32).to_le_bytes());
    header.extend_from_slice(&xxh3_64(&body).to_le_bytes());
    header.extend_from_slice(&body);
    header
}

pub(super) fn frame(body: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&frame_head(body));
    out.extend_from_slice(body);
}

/// What goes before a record's body: its length and its xxh3.
pub(super) fn frame_head(body: &[u8]) -> [u8; 12] {
    let mut head = [0u8; 12];
    head[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
    head[4..].copy_from_slice(&xxh3_64(body).to_le_bytes());
    head
}

/// Encodes a commit record's body into `b`; returns its length.
pub(super) fn encode_commit(c: &Record<'_>, b: &mut [u8; MAX_RECORD]) -> usize {
    let key = &c.key[..c.key.len().min(MAX_KEY_LEN)];
    b[0] = TAG_COMMIT;
    b[1..5].copy_from_slice(&c.ns.to_le_bytes());
    b[5..7].copy_from_slice(&c.segment.to_le_bytes());
    b[7..15].copy_from_slice(&c.offset.to_le_bytes());
    b[15..23].copy_from_slice(&c.len.to_le_bytes());
    b[23..31].copy_from_slice(&c.checksum.to_le_bytes());
    b[31..39].copy_from_slice(&c.generation.to_le_bytes());
    b[39] = c.pinned as u8;
    b[40..44].copy_from_slice(&c.depth.to_le_bytes());
    b[44..46].copy_from_slice(&(key.len() as u16).to_le_bytes());
    b[46..46 + key.len()].copy_from_slice(key);
    COMMIT_FIXED + key.len()
}

/// The body of the whole, intact record at `pos`, if there is one.
pub(super) fn record_at(bytes: &[u8], pos: usize) -> Option<&[u8]> {
    let head = bytes.get(pos..pos + 12)?;
    let len = u32_at(head, 0) as usize;
    if len == 0 || len > MAX_RECORD {
        return None;
    }
    let body = bytes.get(pos + 12..pos + 12 + len)?;
    (xxh3_64(body) == u64_at(head, 4)).then_some(body)
}

pub(super) enum Decoded {
    Commit(Committed),
    Gone(u64),
    Pin(u64, bool),
}

pub(super) fn decode(b: &[u8], namespaces: usize) -> Option<Decoded> {
    match *b.first()? {
        TAG_COMMIT if b.len() >= COMMIT_FIXED => {
            let key_len = u16::from_le_bytes([b[44], b[45]]) as usize;
            let ns = u32_at(b, 1);
            if b.len() != COMMIT_FIXED + key_len
                || key_len == 0
                || key_len > MAX_KEY_LEN
                || ns as usize >= namespaces
                || b[39] > 1
            {
                return None;
            }
            Some(Decoded::Commit(Committed {
                ns,
                segment: u16::from_le_bytes([b[5], b[6]]),
                offset: u64_at(b, 7),
                len: u64_at(b, 15),
                checksum: u64_at(b, 23),
                generation: u64_at(b, 31),
                pinned: b[39] == 1,
                depth: u32_at(b, 40),
                key: b[46..].to_vec(),
            }))
        }
        TAG_GONE if b.len() == 9 => Some(Decoded::Gone(u64_at(b, 1))),
        TAG_PIN if b.len() == 10 && b[9] <= 1 => Some(Decoded::Pin(u64_at(b, 1), b[9] == 1)),
        _ => None,
    }
}

pub(super) fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}

pub(super) fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}
