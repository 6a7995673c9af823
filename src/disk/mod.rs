//! The disk store: the second tier a node can keep objects in once DRAM lets them go.
//!
//! The store is a log cut into fixed-size **regions** (one file each, `region-NNNNN.kvd` in the
//! store's directory). Records are appended to the newest region; when it cannot take the next
//! record the store moves to an empty region, and when none is left it drops the oldest region
//! whole (first in, first out) and its objects leave the index. An SSD sees only sequential
//! writes and whole-file truncations, and the store never holds more than
//! `capacity / region_size` regions: it never grows past its capacity.
//!
//! A record:
//!
//! ```text
//! 0   magic "KVDK"      4   version u16 (2)    6   flags u16 (1: tombstone)
//! 8   namespace u32     12  key length u32     16  value length u64
//! 24  sequence u64      32  xxh3-64 of the value (the pool's checksum)
//! 40  the pool's generation of the object when it was written
//! 48  xxh3-64 of bytes 0..48 and the key
//! 56  key, value, zeros up to the next multiple of 4096
//! ```
//!
//! Integers are little-endian. Every record starts on a 4 KiB boundary so that it can be read
//! with `O_DIRECT`. Sequence numbers grow with every record the store writes: the larger one
//! wins for a key, and a removal writes a tombstone so that the object stays removed after a
//! restart.
//!
//! In memory, an index (`index.rs`) maps `(namespace, key)` to the record's place, lengths,
//! checksum and sequence number, and counts each namespace's bytes. [`DiskStore::open`] rebuilds it by
//! reading every record's header and key back (`recover.rs`); a record that does not check out
//! ends its region, so a write cut short by a crash is cut off. A read checks the header, the
//! key and the value's checksum: a mismatch or a failed read drops the object and is a miss, never wrong
//! bytes. Every read and write goes through [`RegionIo`], so failures (`ENOSPC`, `EIO`) become
//! refusals, misses and counters, and the store goes on working.

mod checkpoint;
mod format;
mod index;
mod io;
mod read;
mod recover;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_crash;
#[cfg(test)]
mod tests_model;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::checksum::checksum;
use crate::error::MAX_KEY_LEN;
use crate::sync::{lock, AtomicU64, Ordering};

pub use format::{ALIGN, FORMAT_VERSION, HEADER_LEN, RECORD_MAGIC};
pub use io::{region_file_name, DirectRegions, FileRegions, IoEngine, RegionIo};

use format::Header;
use index::{Entry, Index};

/// Where a disk store lives and how large it may grow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    /// The directory of the region files (created if missing).
    pub dir: PathBuf,
    /// The most bytes the store's files hold together.
    pub capacity: u64,
    /// Bytes of one region: the unit the store drops when it is full. Default 64 MiB.
    pub region_size: u64,
}

/// The default [`DiskConfig::region_size`].
pub const DEFAULT_REGION_SIZE: u64 = 64 << 20;

impl DiskConfig {
    /// A store in `dir` of at most `capacity` bytes, with regions of [`DEFAULT_REGION_SIZE`].
    pub fn new(dir: impl Into<PathBuf>, capacity: u64) -> DiskConfig {
        DiskConfig {
            dir: dir.into(),
            capacity,
            region_size: DEFAULT_REGION_SIZE,
        }
    }

    /// Regions of `region_size` bytes (a multiple of [`ALIGN`]).
    pub fn region_size(mut self, region_size: u64) -> DiskConfig {
        self.region_size = region_size;
        self
    }

    /// Regions the capacity holds.
    pub fn regions(&self) -> u64 {
        self.capacity.checked_div(self.region_size).unwrap_or(0)
    }

    /// The number of regions, if the configuration is one a store can be opened with.
    pub fn checked_regions(&self) -> Result<u32, DiskError> {
        check(self)
    }
}

/// Why a store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The region size is not a positive multiple of 4 KiB.
    #[error("the disk region size must be a positive multiple of 4 KiB, not {0}")]
    RegionSize(u64),
    /// The capacity holds fewer than two regions (one to write, one to drop).
    #[error("the disk capacity must hold at least two regions of {region_size} bytes, not {capacity} bytes")]
    Capacity {
        /// The capacity configured.
        capacity: u64,
        /// The region size configured.
        region_size: u64,
    },
    /// The directory or a region file could not be opened.
    #[error("disk store: {0}")]
    Io(#[from] std::io::Error),
}

/// What [`DiskStore::insert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// The object is on disk and indexed (replacing an older copy of its key).
    Written,
    /// The key is longer than keys may be, or the record is larger than a region.
    TooLarge,
    /// The write failed (`ENOSPC`, `EIO`): nothing was indexed; counted in `io_errors`.
    IoError,
    /// The caller's condition no longer held once the record was written: it was not
    /// indexed, and a tombstone after it keeps it from coming back at a restart.
    Withdrawn,
}

/// An object the index holds: what a read of it needs and what a caller judges it by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    /// Value length.
    pub value_len: u64,
    /// xxh3-64 of the value.
    pub checksum: u64,
    /// The pool's generation of the object when it was written here.
    pub generation: u64,
    /// The record's sequence number: which copy of the key this is.
    pub seq: u64,
}

/// An object to write, as [`DiskStore::write`] takes it.
#[derive(Clone, Copy, Debug)]
pub struct Object<'a> {
    /// Namespace id.
    pub ns: u32,
    /// Key.
    pub key: &'a [u8],
    /// Value.
    pub value: &'a [u8],
    /// xxh3-64 of `value`, as the pool computed it (a wrong one costs the object: every read
    /// of it fails its check and is a miss).
    pub checksum: u64,
    /// The pool's generation of the object.
    pub generation: u64,
}

/// What [`DiskStore::get`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Get {
    /// The value, verified, is the first `len` bytes of the buffer.
    Hit {
        /// Value length.
        len: usize,
    },
    /// Not on disk, or its copy failed a read or a check (and was dropped). The buffer's
    /// bytes mean nothing.
    Miss,
    /// The value is `len` bytes, more than the buffer holds; nothing was read.
    BufferTooSmall {
        /// Value length.
        len: usize,
    },
}

/// What a store reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// The most bytes the region files may hold.
    pub capacity: u64,
    /// Objects indexed.
    pub objects: u64,
    /// Bytes on disk of the objects indexed (whole records).
    pub bytes: u64,
    /// Objects written.
    pub inserts: u64,
    /// Bytes written (records, tombstones included).
    pub bytes_written: u64,
    /// Gets that returned a value.
    pub hits: u64,
    /// Value bytes those returned.
    pub bytes_read: u64,
    /// Gets that did not.
    pub misses: u64,
    /// Copies dropped because what was read did not check out (at a get, or at open).
    pub checksum_failures: u64,
    /// Reads, writes, syncs and truncations that failed.
    pub io_errors: u64,
    /// Inserts refused (too large, or the write failed).
    pub refused: u64,
    /// Regions dropped to make room.
    pub regions_dropped: u64,
    /// Objects that left with a dropped region.
    pub evicted: u64,
    /// Regions whose records ended, at open, in bytes that are not a valid record (a write a
    /// crash cut short, or damage): cut off there.
    pub torn: u64,
}

#[derive(Debug, Default)]
struct Counters {
    inserts: AtomicU64,
    bytes_written: AtomicU64,
    hits: AtomicU64,
    bytes_read: AtomicU64,
    misses: AtomicU64,
    checksum_failures: AtomicU64,
    io_errors: AtomicU64,
    refused: AtomicU64,
    regions_dropped: AtomicU64,
    evicted: AtomicU64,
    torn: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The writing end of the log. Lock order: the log, then the index.
#[derive(Debug)]
struct Log {
    /// Regions holding records, oldest first; the last is the one written (the head).
    fifo: VecDeque<u32>,
    /// Regions holding no records.
    free: Vec<u32>,
    /// Bytes written into the head.
    head_len: u64,
    next_seq: u64,
    /// The record being written, reused.
    scratch: read::AlignedBuf,
}

/// An on-disk store of objects by `(namespace, key)`, with a capacity it never exceeds (see
/// the module docs). Reads run in parallel; writes are serialized, as a log's are.
#[derive(Debug)]
pub struct DiskStore<I: RegionIo = FileRegions> {
    io: I,
    /// Where the checkpoint is kept.
    dir: PathBuf,
    /// The index was loaded from a checkpoint rather than read back from the records.
    from_checkpoint: bool,
    region_size: u64,
    regions: u32,
    log: Mutex<Log>,
    index: Mutex<Index>,
    counters: Counters,
    /// Told of each object that leaves with a dropped region ([`DiskStore::on_dropped`]).
    dropped: DroppedHook,
}

/// What a store tells of each object that leaves with a region dropped to make room: its
/// namespace and key. Called with the store's index locked: it must be quick and must not
/// call into the store.
pub type OnDropped = Box<dyn Fn(u32, &[u8]) + Send + Sync>;

#[derive(Default)]
struct DroppedHook(std::sync::OnceLock<OnDropped>);

impl std::fmt::Debug for DroppedHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "set"
        } else {
            "unset"
        })
    }
}

/// An engine chosen at run time (or one that fails on purpose, in tests) behind a box.
impl RegionIo for Box<dyn RegionIo> {
    fn read_at(&self, region: u32, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        (**self).read_at(region, offset, buf)
    }

    fn write_at(&self, region: u32, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        (**self).write_at(region, offset, buf)
    }

    fn sync(&self, region: u32) -> std::io::Result<()> {
        (**self).sync(region)
    }

    fn truncate(&self, region: u32, len: u64) -> std::io::Result<()> {
        (**self).truncate(region, len)
    }

    fn len(&self, region: u32) -> std::io::Result<u64> {
        (**self).len(region)
    }
}

impl DiskStore<FileRegions> {
    /// Opens the store `config` describes, rebuilding its index from the region files.
    pub fn open(config: &DiskConfig) -> Result<DiskStore<FileRegions>, DiskError> {
        let regions = check(config)?;
        let io = FileRegions::open(&config.dir, regions)?;
        DiskStore::open_with(config, io)
    }
}

impl<I: RegionIo> DiskStore<I> {
    /// Opens the store `config` describes over the regions of `io` (of which it uses the
    /// first `config.regions()`), rebuilding its index from them.
    pub fn open_with(config: &DiskConfig, io: I) -> Result<DiskStore<I>, DiskError> {
        let regions = check(config)?;
        let counters = Counters::default();
        // Regions written with a larger region size are cut to this one (records past it
        // would not be read anyway): the files never hold more than the capacity.
        for r in 0..regions {
            let long = io.len(r).map(|len| len > config.region_size);
            if long.is_err()
                || (long.unwrap_or(false) && io.truncate(r, config.region_size).is_err())
            {
                bump(&counters.io_errors, 1);
            }
        }
        let layout = (regions, config.region_size);
        let loaded = checkpoint::load(&config.dir, &io, layout);
        let from_checkpoint = loaded.is_some();
        let found = loaded.unwrap_or_else(|| recover::recover(&io, regions, config.region_size));
        bump(&counters.io_errors, found.io_errors);
        bump(&counters.torn, found.torn);
        let mut log = Log {
            fifo: found.fifo.into(),
            free: found.free,
            head_len: found.head_len,
            next_seq: found.next_seq,
            scratch: read::AlignedBuf::default(),
        };
        // Appends go on after the head's last valid record: what lies beyond (a record cut
        // short) goes first, so that no stale bytes ever follow a new record.
        if let Some(&head) = log.fifo.back() {
            let cut = io.len(head).and_then(|len| {
                if len > log.head_len {
                    io.truncate(head, log.head_len)
                } else {
                    Ok(())
                }
            });
            if cut.is_err() {
                bump(&counters.io_errors, 1);
                log.head_len = config.region_size;
            }
        }
        Ok(DiskStore {
            io,
            dir: config.dir.clone(),
            from_checkpoint,
            region_size: config.region_size,
            regions,
            log: Mutex::new(log),
            index: Mutex::new(found.index),
            counters,
            dropped: DroppedHook::default(),
        })
    }

    /// Sets what is told of each object that leaves with a dropped region (once; a second
    /// call is ignored).
    pub fn on_dropped(&self, hook: OnDropped) {
        let _ = self.dropped.0.set(hook);
    }

    /// Writes `value` as `(ns, key)`'s object, replacing an older copy. May drop the oldest
    /// region to make room.
    pub fn insert(&self, ns: u32, key: &[u8], value: &[u8]) -> Insert {
        self.insert_prehashed(ns, key, value, checksum(value))
    }

    /// [`DiskStore::insert`] of a value whose xxh3-64 the caller has (the pool keeps each
    /// object's): `checksum` is recorded as the value's without hashing it again. A wrong one
    /// costs nothing but the object: every read of it fails its check and is a miss.
    pub fn insert_prehashed(&self, ns: u32, key: &[u8], value: &[u8], checksum: u64) -> Insert {
        let object = Object {
            ns,
            key,
            value,
            checksum,
            generation: 0,
        };
        self.write(&object, || true)
    }

    /// Writes `object`, replacing an older copy of its key, and indexes it only if `still`
    /// (asked once the record is written, with the index locked, so nothing the caller guards
    /// with it can slip in between) says the object is still wanted; if not, a tombstone
    /// follows the record and the answer is [`Insert::Withdrawn`]. `still` must not call into
    /// the store.
    pub fn write(&self, object: &Object<'_>, still: impl FnOnce() -> bool) -> Insert {
        let Object { ns, key, value, .. } = *object;
        if key.len() > MAX_KEY_LEN
            || format::record_len(key.len(), value.len() as u64) > self.region_size
        {
            bump(&self.counters.refused, 1);
            return Insert::TooLarge;
        }
        let header = Header {
            ns,
            key_len: key.len() as u32,
            value_len: value.len() as u64,
            seq: 0,
            checksum: object.checksum,
            generation: object.generation,
            tombstone: false,
        };
        let mut log = lock(&self.log);
        let Some(entry) = self.append(&mut log, header, key, value) else {
            bump(&self.counters.refused, 1);
            return Insert::IoError;
        };
        let mut index = lock(&self.index);
        if !still() {
            drop(index);
            self.append(&mut log, Header::tombstone(ns, key), key, &[]);
            return Insert::Withdrawn;
        }
        index.insert(ns, key, entry);
        bump(&self.counters.inserts, 1);
        Insert::Written
    }

    /// The object `(ns, key)` has on disk, if any (not read: a read may still miss).
    pub fn lookup(&self, ns: u32, key: &[u8]) -> Option<Found> {
        lock(&self.index).get(ns, key).map(|e| Found {
            value_len: e.value_len,
            checksum: e.checksum,
            generation: e.generation,
            seq: e.seq,
        })
    }

    /// Whether `(ns, key)`'s object on disk is still the copy `seq`.
    pub fn holds(&self, ns: u32, key: &[u8], seq: u64) -> bool {
        lock(&self.index).get(ns, key).is_some_and(|e| e.seq == seq)
    }

    /// Reads the copy `found` (a [`DiskStore::lookup`] of `(ns, key)`) into `buf`, exactly its
    /// length, and verifies it. A copy replaced or dropped since is a miss; one that fails its
    /// read or check is dropped (counted) and is a miss.
    pub fn read_found(&self, ns: u32, key: &[u8], found: &Found, buf: &mut [u8]) -> Get {
        let entry = lock(&self.index)
            .get(ns, key)
            .filter(|e| e.seq == found.seq);
        let Some(entry) = entry else {
            bump(&self.counters.misses, 1);
            return Get::Miss;
        };
        self.read_entry(ns, key, &entry, buf)
    }

    /// Forgets `(ns, key)`'s object unless its value is the one whose xxh3-64 is `keep`:
    /// gone from the index at once (whether it had one is the answer). The record stays on
    /// disk until its region is dropped: the caller has [`DiskStore::tombstone`] written to
    /// keep it gone after a restart.
    pub fn forget(&self, ns: u32, key: &[u8], keep: Option<u64>) -> bool {
        let mut index = lock(&self.index);
        if index.get(ns, key).is_none_or(|e| Some(e.checksum) == keep) {
            return false;
        }
        index.remove(ns, key).is_some()
    }

    /// Writes a tombstone of `(ns, key)`, so that no copy of it written before comes back at
    /// a restart (the index is not touched: see [`DiskStore::forget`]). False (counted in
    /// `io_errors`) if the write failed.
    pub fn tombstone(&self, ns: u32, key: &[u8]) -> bool {
        let mut log = lock(&self.log);
        self.append(&mut log, Header::tombstone(ns, key), key, &[])
            .is_some()
    }

    /// The keys of namespace `ns`'s objects on disk.
    pub fn keys(&self, ns: u32) -> Vec<Box<[u8]>> {
        lock(&self.index).keys(ns)
    }

    /// Reads `(ns, key)`'s value into `buf` and verifies it (see [`Get`]).
    pub fn get(&self, ns: u32, key: &[u8], buf: &mut [u8]) -> Get {
        let Some(entry) = lock(&self.index).get(ns, key) else {
            bump(&self.counters.misses, 1);
            return Get::Miss;
        };
        self.read_entry(ns, key, &entry, buf)
    }

    /// Reads `entry`, `(ns, key)`'s copy, into `buf`, dropping it (counted) if it fails.
    fn read_entry(&self, ns: u32, key: &[u8], entry: &Entry, buf: &mut [u8]) -> Get {
        let len = entry.value_len as usize;
        if buf.len() < len {
            return Get::BufferTooSmall { len };
        }
        match self.read(ns, key, entry, &mut buf[..len]) {
            Ok(()) => {
                bump(&self.counters.hits, 1);
                bump(&self.counters.bytes_read, len as u64);
                Get::Hit { len }
            }
            Err(fault) => {
                // A copy whose region was dropped meanwhile is a plain miss, not a fault.
                if lock(&self.index).remove_if_seq(ns, key, entry.seq) {
                    match fault {
                        Fault::Io => bump(&self.counters.io_errors, 1),
                        Fault::Mismatch => bump(&self.counters.checksum_failures, 1),
                    }
                }
                bump(&self.counters.misses, 1);
                Get::Miss
            }
        }
    }

    /// Whether `(ns, key)` has an object on disk (not read: a get may still miss).
    pub fn contains(&self, ns: u32, key: &[u8]) -> bool {
        lock(&self.index).get(ns, key).is_some()
    }

    /// The value length of `(ns, key)`'s object, if it has one.
    pub fn value_len(&self, ns: u32, key: &[u8]) -> Option<u64> {
        lock(&self.index).get(ns, key).map(|e| e.value_len)
    }

    /// Removes `(ns, key)`'s object; whether there was one. A tombstone record keeps it
    /// removed after a restart; if that write fails (counted in `io_errors`) the object is
    /// gone from this life's index only.
    pub fn remove(&self, ns: u32, key: &[u8]) -> bool {
        let mut log = lock(&self.log);
        if lock(&self.index).remove(ns, key).is_none() {
            return false;
        }
        self.append(&mut log, Header::tombstone(ns, key), key, &[]);
        true
    }

    /// Makes every record written so far durable, then saves the index beside the region
    /// files, so that the next open loads it instead of reading every record back (for a clean
    /// close: see `checkpoint.rs`). False (counted in `io_errors`) if either failed.
    pub fn checkpoint(&self) -> bool {
        if !self.sync() {
            return false;
        }
        let log = lock(&self.log);
        let index = lock(&self.index);
        let fifo: Vec<u32> = log.fifo.iter().copied().collect();
        let state = checkpoint::LogState {
            fifo: &fifo,
            free: &log.free,
            head_len: log.head_len,
            next_seq: log.next_seq,
        };
        let layout = (self.regions, self.region_size);
        let saved = checkpoint::save(&self.dir, &self.io, layout, &state, &index).is_ok();
        if !saved {
            bump(&self.counters.io_errors, 1);
        }
        saved
    }

    /// Whether this store's index was loaded from a checkpoint at open.
    pub fn opened_from_checkpoint(&self) -> bool {
        self.from_checkpoint
    }

    /// Makes every record written so far durable; false (counted) if the sync failed.
    pub fn sync(&self) -> bool {
        let log = lock(&self.log);
        match log.fifo.back() {
            Some(&head) => self.sync_region(head),
            None => true,
        }
    }

    /// Bytes on disk of namespace `ns`'s objects (whole records, padding included).
    pub fn namespace_bytes(&self, ns: u32) -> u64 {
        lock(&self.index).namespace_bytes(ns)
    }

    /// The store's counters and occupancy.
    pub fn stats(&self) -> DiskStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (objects, bytes) = {
            let index = lock(&self.index);
            (index.objects(), index.bytes())
        };
        DiskStats {
            capacity: u64::from(self.regions) * self.region_size,
            objects,
            bytes,
            inserts: get(&c.inserts),
            bytes_written: get(&c.bytes_written),
            hits: get(&c.hits),
            bytes_read: get(&c.bytes_read),
            misses: get(&c.misses),
            checksum_failures: get(&c.checksum_failures),
            io_errors: get(&c.io_errors),
            refused: get(&c.refused),
            regions_dropped: get(&c.regions_dropped),
            evicted: get(&c.evicted),
            torn: get(&c.torn),
        }
    }

    /// Appends one record (its sequence number assigned here) to the head, moving to a new
    /// head first if it does not fit. Its entry, or `None` (counted) if a write failed.
    fn append(&self, log: &mut Log, mut header: Header, key: &[u8], value: &[u8]) -> Option<Entry> {
        let record_len = header.record_len();
        if log.fifo.is_empty() || log.head_len + record_len > self.region_size {
            self.advance(log)?;
        }
        let head = *log.fifo.back().expect("a head region");
        header.seq = log.next_seq;
        log.next_seq = log.next_seq.saturating_add(1);
        // Page-aligned, so an `O_DIRECT` engine writes it straight.
        let Some(scratch) = log.scratch.get(record_len as usize) else {
            bump(&self.counters.io_errors, 1);
            return None;
        };
        let (head_bytes, rest) = scratch.split_at_mut(HEADER_LEN);
        head_bytes.copy_from_slice(&header.encode(key));
        let (key_bytes, rest) = rest.split_at_mut(key.len());
        key_bytes.copy_from_slice(key);
        let (value_bytes, padding) = rest.split_at_mut(value.len());
        value_bytes.copy_from_slice(value);
        padding.fill(0);
        let scratch = &*scratch;
        let offset = log.head_len;
        if self.io.write_at(head, offset, scratch).is_err() {
            bump(&self.counters.io_errors, 1);
            // Part of the record may be there: cut it off, or, if even that fails, write no
            // more into this region (its scan ends at the bad record).
            if self.io.truncate(head, offset).is_err() {
                bump(&self.counters.io_errors, 1);
                log.head_len = self.region_size;
            }
            return None;
        }
        log.head_len += record_len;
        bump(&self.counters.bytes_written, record_len);
        Some(Entry {
            region: head,
            offset,
            key_len: header.key_len,
            value_len: header.value_len,
            record_len,
            checksum: header.checksum,
            generation: header.generation,
            seq: header.seq,
        })
    }

    /// Seals the head (synced) and makes an empty region the head: a free one, or else the
    /// oldest, dropped whole. `None` (counted) if the region could not be emptied.
    fn advance(&self, log: &mut Log) -> Option<()> {
        if let Some(&head) = log.fifo.back() {
            self.sync_region(head);
        }
        let region = match log.free.pop() {
            Some(r) => r,
            None => {
                let oldest = log.fifo.pop_front().expect("a full store has regions");
                let gone = |ns: u32, key: &[u8]| {
                    if let Some(hook) = self.dropped.0.get() {
                        hook(ns, key);
                    }
                };
                let evicted = lock(&self.index).drop_region(oldest, &gone);
                bump(&self.counters.regions_dropped, 1);
                bump(&self.counters.evicted, evicted);
                oldest
            }
        };
        if self.io.truncate(region, 0).is_err() {
            bump(&self.counters.io_errors, 1);
            // Still holding old records: not a head, and tried again when next needed. Its
            // first header is overwritten if the disk lets us, so that a restart does not
            // bring back objects this life let go (removed ones among them).
            if self.io.write_at(region, 0, &[0u8; HEADER_LEN]).is_err() {
                bump(&self.counters.io_errors, 1);
            }
            log.free.insert(0, region);
            return None;
        }
        log.fifo.push_back(region);
        log.head_len = 0;
        Some(())
    }

    fn sync_region(&self, region: u32) -> bool {
        let ok = self.io.sync(region).is_ok();
        if !ok {
            bump(&self.counters.io_errors, 1);
        }
        ok
    }
}

/// Why a read of a copy failed.
#[derive(Clone, Copy, Debug)]
pub(super) enum Fault {
    Io,
    Mismatch,
}

/// The number of regions `config` describes, if it is valid.
fn check(config: &DiskConfig) -> Result<u32, DiskError> {
    if config.region_size == 0 || config.region_size % ALIGN != 0 {
        return Err(DiskError::RegionSize(config.region_size));
    }
    let regions = config.regions();
    if regions < 2 {
        return Err(DiskError::Capacity {
            capacity: config.capacity,
            region_size: config.region_size,
        });
    }
    Ok(u32::try_from(regions).unwrap_or(u32::MAX))
}
