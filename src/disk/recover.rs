//! Rebuilding the index at open: every region read from its start, every record checked
//! (header, lengths, key, value checksum) before it is indexed. A region's first record whose
//! header or key does not check out ends it, which is how a write cut short by a crash is cut
//! off; a record whose value alone fails (its extent is known from a header that checks out)
//! is skipped, and what follows it is read on.

use crate::checksum::checksum;

use super::format::{Header, HEADER_LEN};
use super::index::{Entry, Index};
use super::io::RegionIo;

/// The log as the regions on disk describe it.
#[derive(Debug)]
pub(super) struct Recovered {
    pub(super) index: Index,
    /// Regions holding records, oldest first.
    pub(super) fifo: Vec<u32>,
    /// Regions holding none, the one to take next last.
    pub(super) free: Vec<u32>,
    /// Where the records of the newest region end.
    pub(super) head_len: u64,
    pub(super) next_seq: u64,
    /// Regions whose reading failed (their records are not served).
    pub(super) io_errors: u64,
    /// Regions whose records ended with bytes that are not a valid record.
    pub(super) torn: u64,
    /// Records whose value failed its checksum (not indexed).
    pub(super) damaged: u64,
}

/// One record found by the scan.
struct Found {
    ns: u32,
    key: Box<[u8]>,
    entry: Entry,
    tombstone: bool,
}

/// What one region holds.
struct Scan {
    records: Vec<Found>,
    /// Where its valid records end.
    end: u64,
    torn: bool,
    /// Records whose value failed its checksum (skipped).
    damaged: u64,
}

/// Reads every region of `io` and rebuilds the index (see the module docs): regions are
/// replayed oldest first (by their first record's sequence number), and a record replaces an
/// older one of its key only when its sequence number is larger.
pub(super) fn recover<I: RegionIo>(io: &I, regions: u32, region_size: u64) -> Recovered {
    let mut io_errors = 0;
    let mut torn = 0;
    let mut damaged = 0;
    let mut scans = Vec::new();
    let mut free = Vec::new();
    for r in 0..regions {
        match scan(io, r, region_size) {
            Ok(s) => {
                torn += u64::from(s.torn);
                damaged += s.damaged;
                if s.records.is_empty() {
                    free.push(r);
                } else {
                    scans.push((r, s));
                }
            }
            Err(_) => {
                io_errors += 1;
                free.push(r);
            }
        }
    }
    // Free regions are taken from the end: the lowest numbered first.
    free.reverse();
    scans.sort_by_key(|(_, s)| s.records[0].entry.seq);
    let mut index = Index::new(regions);
    let mut next_seq = 1;
    let head_len = scans.last().map_or(0, |(_, s)| s.end);
    let fifo = scans.iter().map(|(r, _)| *r).collect();
    for (_, s) in scans {
        for f in s.records {
            next_seq = next_seq.max(f.entry.seq.saturating_add(1));
            let newer = index.get(f.ns, &f.key).is_none_or(|e| e.seq < f.entry.seq);
            if !newer {
                continue;
            }
            if f.tombstone {
                index.remove(f.ns, &f.key);
            } else {
                index.insert(f.ns, &f.key, f.entry);
            }
        }
    }
    Recovered {
        index,
        fifo,
        free,
        head_len,
        next_seq,
        io_errors,
        torn,
        damaged,
    }
}

/// Reads region `region`'s records up to the first whose header or key is not valid; a record
/// whose value alone fails its checksum is skipped.
fn scan<I: RegionIo>(io: &I, region: u32, region_size: u64) -> std::io::Result<Scan> {
    let len = io.len(region)?.min(region_size);
    let mut records: Vec<Found> = Vec::new();
    let mut at = 0;
    let mut value = Vec::new();
    let mut key = Vec::new();
    let mut last_seq = None;
    let mut damaged = 0;
    while at + HEADER_LEN as u64 <= len {
        let mut head = [0u8; HEADER_LEN];
        io.read_at(region, at, &mut head)?;
        let Some(h) = Header::decode(&head, len - at) else {
            break;
        };
        // Sequence numbers grow along a region; a smaller one is not this log's record.
        if last_seq.is_some_and(|seq| seq >= h.seq) {
            break;
        }
        last_seq = Some(h.seq);
        key.resize(h.key_len as usize, 0);
        io.read_at(region, at + HEADER_LEN as u64, &mut key)?;
        if !Header::verify_key(&head, &key) {
            break;
        }
        if !h.tombstone {
            value.resize(h.value_len as usize, 0);
            io.read_at(region, at + h.value_offset(), &mut value)?;
            if checksum(&value) != h.checksum {
                // The header and key check out, so the record's extent is known: only this
                // value is lost, and the records after it are read on.
                damaged += 1;
                at += h.record_len();
                continue;
            }
        }
        let entry = Entry {
            region,
            offset: at,
            key_len: h.key_len,
            value_len: h.value_len,
            record_len: h.record_len(),
            checksum: h.checksum,
            seq: h.seq,
        };
        records.push(Found {
            ns: h.ns,
            key: key.as_slice().into(),
            entry,
            tombstone: h.tombstone,
        });
        at += h.record_len();
    }
    Ok(Scan {
        records,
        end: at,
        torn: at < len,
        damaged,
    })
}
