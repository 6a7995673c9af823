//! Rebuilding the index at open: every region read from its start, every record's header,
//! lengths and key checked before it is indexed; small records' headers come a 1 MiB window at
//! a time, a large record's in a read of their own. A region's first record whose
//! header or key does not check out ends it, which is how a write cut short by a crash is cut
//! off (a record whose bytes run past the file's end is such a record). Values are not read:
//! every get verifies its value's checksum before serving it, and drops a copy that fails, so
//! a damaged value costs a miss, and opening a store reads one block per object, not its data.

use super::format::{Header, ALIGN, HEADER_LEN};
use super::index::{Entry, Index};
use super::io::RegionIo;
use super::read::AlignedBuf;

/// Bytes a scan reads at once while the records it meets are small.
const WINDOW: u64 = 1 << 20;

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
}

/// Reads every region of `io` and rebuilds the index (see the module docs): regions are
/// replayed oldest first (by their first record's sequence number), and a record replaces an
/// older one of its key only when its sequence number is larger.
pub(super) fn recover<I: RegionIo>(io: &I, regions: u32, region_size: u64) -> Recovered {
    let mut io_errors = 0;
    let mut torn = 0;
    let mut scans = Vec::new();
    let mut free = Vec::new();
    for r in 0..regions {
        match scan(io, r, region_size) {
            Ok(s) => {
                torn += u64::from(s.torn);
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
    }
}

/// Reads region `region`'s records up to the first whose header or key is not valid.
fn scan<I: RegionIo>(io: &I, region: u32, region_size: u64) -> std::io::Result<Scan> {
    let len = io.len(region)?.min(region_size);
    let mut records: Vec<Found> = Vec::new();
    let mut at = 0;
    // Records are read a window at a time (page-aligned, so `O_DIRECT` reads it straight): one
    // read brings the headers of many small records; after a large record, the next read is
    // one block, so a region of large values is not read whole.
    let mut window = AlignedBuf::default();
    let (mut start, mut filled) = (0u64, 0usize);
    let mut next_read = WINDOW;
    let mut last_seq = None;
    while at + HEADER_LEN as u64 <= len {
        // A header and the longest key fit in the first block of a record.
        let want = (len - at).min(ALIGN) as usize;
        if at < start || at + want as u64 > start + filled as u64 {
            filled = (len - at).min(next_read.max(ALIGN)) as usize;
            let buf = window.get(filled).ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::OutOfMemory, "a read window")
            })?;
            io.read_at(region, at, buf)?;
            start = at;
        }
        let bytes = window.get(filled).expect("filled above");
        let from = (at - start) as usize;
        let first = &bytes[from..from + want];
        let head: &[u8; HEADER_LEN] = first[..HEADER_LEN].try_into().expect("a header");
        let Some(h) = Header::decode(head, len - at) else {
            break;
        };
        // Sequence numbers grow along a region; a smaller one is not this log's record.
        if last_seq.is_some_and(|seq| seq >= h.seq) {
            break;
        }
        last_seq = Some(h.seq);
        let key = &first[HEADER_LEN..HEADER_LEN + h.key_len as usize];
        if !Header::verify_key(head, key) {
            break;
        }
        let entry = Entry {
            region,
            offset: at,
            key_len: h.key_len,
            value_len: h.value_len,
            record_len: h.record_len(),
            checksum: h.checksum,
            generation: h.generation,
            seq: h.seq,
        };
        records.push(Found {
            ns: h.ns,
            key: key.into(),
            entry,
            tombstone: h.tombstone,
        });
        next_read = if h.record_len() <= WINDOW / 16 {
            WINDOW
        } else {
            ALIGN
        };
        at += h.record_len();
    }
    Ok(Scan {
        records,
        end: at,
        torn: at < len,
    })
}
