//! The index saved at a clean close (`index.ckpt` in the store's directory), so that the next
//! open loads it instead of reading every record's header back.
//!
//! A checkpoint describes the region files as they were when it was written: it holds every
//! region's length then, and is used only if each file still has exactly that length. It is
//! deleted as it is loaded, before the store writes anything, so a checkpoint never outlives
//! the files it describes: a store that is then killed is opened by reading its records back
//! (`recover.rs`). A checkpoint that is missing, damaged (its xxh3-64 covers it all), of
//! another layout, or that cannot be deleted is ignored the same way.
//!
//! ```text
//! magic "KVDKIDX1", regions u32, region size u64, next seq u64, head len u64,
//! regions × length u64, fifo count u32 + region u32 each, free count u32 + region u32 each,
//! objects u64, then per object: ns u32, key length u16, key, region u32, offset u64,
//! value length u64, record length u64, checksum u64, generation u64, seq u64;
//! last, the xxh3-64 of everything before it. Little-endian.
//! ```

use crate::le::Reader;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::index::{Entry, Index};
use super::io::RegionIo;
use super::recover::Recovered;
use crate::checksum::checksum;

const MAGIC: &[u8; 8] = b"KVDKIDX1";

/// The checkpoint's file in `dir`.
pub(super) fn path(dir: &Path) -> PathBuf {
    dir.join("index.ckpt")
}

/// What a checkpoint holds of the log besides the index.
pub(super) struct LogState<'a> {
    pub(super) fifo: &'a [u32],
    pub(super) free: &'a [u32],
    pub(super) head_len: u64,
    pub(super) next_seq: u64,
}

/// Writes the checkpoint of `index` and `log` over regions of `io` (`regions` of
/// `region_size` bytes): to a temporary file, synced, then renamed over the checkpoint.
pub(super) fn save<I: RegionIo>(
    dir: &Path,
    io: &I,
    (regions, region_size): (u32, u64),
    log: &LogState<'_>,
    index: &Index,
) -> io::Result<()> {
    let mut b = Vec::with_capacity(64 + index.objects() as usize * 80);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&regions.to_le_bytes());
    for v in [region_size, log.next_seq, log.head_len] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    for r in 0..regions {
        b.extend_from_slice(&io.len(r)?.to_le_bytes());
    }
    for list in [log.fifo, log.free] {
        b.extend_from_slice(&(list.len() as u32).to_le_bytes());
        for r in list {
            b.extend_from_slice(&r.to_le_bytes());
        }
    }
    b.extend_from_slice(&index.objects().to_le_bytes());
    for (ns, key, e) in index.entries() {
        b.extend_from_slice(&ns.to_le_bytes());
        b.extend_from_slice(&(key.len() as u16).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&e.region.to_le_bytes());
        for v in [
            e.offset,
            e.value_len,
            e.record_len,
            e.checksum,
            e.generation,
            e.seq,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
    let sum = checksum(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    let tmp = dir.join("index.ckpt.tmp");
    let mut f = fs::File::create(&tmp)?;
    f.write_all(&b)?;
    f.sync_all()?;
    fs::rename(&tmp, path(dir))
}

/// The log the checkpoint in `dir` describes, if there is one that matches the region files
/// of `io` now; the checkpoint is deleted either way (see the module docs).
pub(super) fn load<I: RegionIo>(
    dir: &Path,
    io: &I,
    (regions, region_size): (u32, u64),
) -> Option<Recovered> {
    let file = path(dir);
    let bytes = fs::read(&file).ok()?;
    // Gone before anything is written, or not used at all.
    fs::remove_file(&file).ok()?;
    let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
    if checksum(body) != u64::from_le_bytes(sum.try_into().ok()?) {
        return None;
    }
    let mut r = Reader(body);
    if r.take(8)? != MAGIC || r.u32()? != regions || r.u64()? != region_size {
        return None;
    }
    let (next_seq, head_len) = (r.u64()?, r.u64()?);
    for region in 0..regions {
        if io.len(region).ok()? != r.u64()? {
            return None;
        }
    }
    let mut lists = [Vec::new(), Vec::new()];
    for list in &mut lists {
        for _ in 0..r.u32()? {
            let region = r.u32()?;
            if region >= regions {
                return None;
            }
            list.push(region);
        }
    }
    let [fifo, free] = lists;
    let mut index = Index::new(regions);
    for _ in 0..r.u64()? {
        let ns = r.u32()?;
        let key_len = usize::from(r.u16()?);
        let key = r.take(key_len)?;
        let entry = Entry {
            region: r.u32()?,
            offset: r.u64()?,
            key_len: key_len as u32,
            value_len: r.u64()?,
            record_len: r.u64()?,
            checksum: r.u64()?,
            generation: r.u64()?,
            seq: r.u64()?,
        };
        let fits = entry.region < regions
            && entry
                .offset
                .checked_add(entry.record_len)
                .is_some_and(|end| end <= region_size);
        if !fits {
            return None;
        }
        index.insert(ns, key, entry);
    }
    if !r.0.is_empty() {
        return None;
    }
    Some(Recovered {
        index,
        fifo,
        free,
        head_len,
        next_seq,
        io_errors: 0,
        torn: 0,
    })
}
