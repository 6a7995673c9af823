//! Reading one copy back: its whole record in one aligned read, then every check before a
//! byte of it reaches the caller; and the page-aligned buffers records are read into and
//! written from (at least 2.5 MiB, so that a block of the usual size and its header fit the
//! first time).

use std::cell::RefCell;

use memmap2::MmapMut;

use super::format::{Header, HEADER_LEN};
use super::index::Entry;
use super::io::RegionIo;
use super::{DiskStore, Fault};
use crate::checksum::checksum;

/// Records up to this many bytes are read into a buffer each thread keeps; larger ones into
/// one of their own.
const KEPT: usize = 8 << 20;

thread_local! {
    /// This thread's page-aligned record buffer, grown as needed up to [`KEPT`].
    static RECORD: RefCell<AlignedBuf> = const { RefCell::new(AlignedBuf(None)) };
}

/// A page-aligned buffer that grows as needed (the log's record being written).
#[derive(Debug, Default)]
pub(super) struct AlignedBuf(Option<MmapMut>);

impl AlignedBuf {
    /// Its first `len` bytes, grown to hold them first; None if the memory could not be had.
    pub(super) fn get(&mut self, len: usize) -> Option<&mut [u8]> {
        if self.0.as_ref().is_none_or(|b| b.len() < len) {
            let size = len.max(5 << 19).next_multiple_of(4096);
            self.0 = Some(MmapMut::map_anon(size).ok()?);
        }
        self.0.as_mut().map(|b| &mut b[..len])
    }
}

impl<I: RegionIo> DiskStore<I> {
    /// Reads `(ns, key)`'s record at `entry` whole, in one read at its 4 KiB-aligned start
    /// into a page-aligned buffer (so an `O_DIRECT` engine reads it straight), checks its
    /// header against `entry`, its key, and its value's checksum, and only then copies the
    /// value into `value` (exactly its length).
    pub(super) fn read(
        &self,
        ns: u32,
        key: &[u8],
        entry: &Entry,
        value: &mut [u8],
    ) -> Result<(), Fault> {
        let len = entry.record_len as usize;
        let mut check = |record: &mut [u8]| -> Result<(), Fault> {
            self.io
                .read_at(entry.region, entry.offset, record)
                .map_err(|_| Fault::Io)?;
            let head: &[u8; HEADER_LEN] = record[..HEADER_LEN].try_into().expect("a header");
            let h = Header::decode(head, entry.record_len).ok_or(Fault::Mismatch)?;
            let same = h.ns == ns
                && h.key_len == entry.key_len
                && h.value_len == entry.value_len
                && h.seq == entry.seq
                && h.checksum == entry.checksum
                && !h.tombstone;
            if !same {
                return Err(Fault::Mismatch);
            }
            let stored = &record[HEADER_LEN..HEADER_LEN + key.len()];
            if stored != key || !Header::verify_key(head, stored) {
                return Err(Fault::Mismatch);
            }
            let start = h.value_offset() as usize;
            let bytes = &record[start..start + value.len()];
            if checksum(bytes) != entry.checksum {
                return Err(Fault::Mismatch);
            }
            value.copy_from_slice(bytes);
            Ok(())
        };
        if len > KEPT {
            let mut own = MmapMut::map_anon(len).map_err(|_| Fault::Io)?;
            return check(&mut own[..]);
        }
        RECORD.with(|cell| {
            let mut kept = cell.borrow_mut();
            check(kept.get(len).ok_or(Fault::Io)?)
        })
    }
}
