//! The bytes of one record, as the module docs draw them: a fixed header, the key, the value,
//! zeros up to the next 4 KiB boundary.

use xxhash_rust::xxh3::Xxh3Default;

use crate::error::MAX_KEY_LEN;

/// Magic bytes at the start of every record.
pub const RECORD_MAGIC: [u8; 4] = *b"KVDK";
/// Version of the record format described in the module docs.
pub const FORMAT_VERSION: u16 = 2;
/// Every record starts and ends on a multiple of this, so that a record can later be read
/// with `O_DIRECT`.
pub const ALIGN: u64 = 4096;
/// Bytes of a record's header.
pub const HEADER_LEN: usize = 56;

/// The record removes its key instead of holding a value.
const FLAG_TOMBSTONE: u16 = 1;
/// Bytes the header checksum covers (with the key): every field before it.
const COVERED: usize = 48;

/// A record's header, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    /// Namespace id.
    pub(super) ns: u32,
    /// Key length.
    pub(super) key_len: u32,
    /// Value length (0 for a tombstone).
    pub(super) value_len: u64,
    /// The store's sequence number at the write: larger is newer.
    pub(super) seq: u64,
    /// xxh3-64 of the value, as the pool computes it.
    pub(super) checksum: u64,
    /// The pool's generation of the object when DRAM let it go: what a clustered node judges
    /// whether it may still serve the object by, as it judges one in DRAM.
    pub(super) generation: u64,
    /// The record removes its key.
    pub(super) tombstone: bool,
}

impl Header {
    /// The header of a tombstone of `(ns, key)` (its sequence number assigned when written).
    pub(super) fn tombstone(ns: u32, key: &[u8]) -> Header {
        Header {
            ns,
            key_len: key.len() as u32,
            value_len: 0,
            seq: 0,
            checksum: crate::checksum::checksum(&[]),
            generation: 0,
            tombstone: true,
        }
    }

    /// Bytes the record takes on disk: header, key and value, rounded up to [`ALIGN`].
    pub(super) fn record_len(&self) -> u64 {
        record_len(self.key_len as usize, self.value_len)
    }

    /// Where the value starts, from the record's start.
    pub(super) fn value_offset(&self) -> u64 {
        (HEADER_LEN + self.key_len as usize) as u64
    }

    /// The header's bytes; the last field is the xxh3-64 of the fields before it and `key`.
    pub(super) fn encode(&self, key: &[u8]) -> [u8; HEADER_LEN] {
        debug_assert_eq!(key.len(), self.key_len as usize);
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&RECORD_MAGIC);
        b[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        let flags = if self.tombstone { FLAG_TOMBSTONE } else { 0 };
        b[6..8].copy_from_slice(&flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.ns.to_le_bytes());
        b[12..16].copy_from_slice(&self.key_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.value_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..40].copy_from_slice(&self.checksum.to_le_bytes());
        b[40..48].copy_from_slice(&self.generation.to_le_bytes());
        let sum = head_checksum(&b[..COVERED], key);
        b[48..56].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Checks the fixed part of a header: magic, version, flags, a key no longer than keys may
    /// be and a record that ends within `room` bytes. The key is checked apart
    /// ([`Header::verify_key`]), once it is read.
    pub(super) fn decode(b: &[u8; HEADER_LEN], room: u64) -> Option<Header> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b[0..4] != RECORD_MAGIC || u16_at(4) != FORMAT_VERSION {
            return None;
        }
        let flags = u16_at(6);
        if flags & !FLAG_TOMBSTONE != 0 {
            return None;
        }
        let h = Header {
            ns: u32_at(8),
            key_len: u32_at(12),
            value_len: u64_at(16),
            seq: u64_at(24),
            checksum: u64_at(32),
            generation: u64_at(40),
            tombstone: flags & FLAG_TOMBSTONE != 0,
        };
        let fits = h.key_len as usize <= MAX_KEY_LEN
            && h.value_len <= room
            && (!h.tombstone || h.value_len == 0)
            && h.record_len() <= room;
        fits.then_some(h)
    }

    /// Whether `key` is the key this header was written with (its checksum covers it).
    pub(super) fn verify_key(b: &[u8; HEADER_LEN], key: &[u8]) -> bool {
        let stored = u64::from_le_bytes(b[COVERED..].try_into().expect("8 bytes"));
        stored == head_checksum(&b[..COVERED], key)
    }
}

/// Bytes a record of a `key_len`-byte key and a `value_len`-byte value takes on disk.
pub(super) fn record_len(key_len: usize, value_len: u64) -> u64 {
    let raw = (HEADER_LEN + key_len) as u64 + value_len;
    raw.div_ceil(ALIGN) * ALIGN
}

fn head_checksum(fields: &[u8], key: &[u8]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(fields);
    h.update(key);
    h.digest()
}
