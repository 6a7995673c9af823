use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

use super::*;

const REGION: u64 = 64 << 10;

/// A fresh directory under the system's temp dir, removed when dropped.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new(name: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("kvpool-disk-{name}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn config(dir: &Path, regions: u64) -> DiskConfig {
    DiskConfig::new(dir, regions * REGION).region_size(REGION)
}

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read(store: &DiskStore<impl RegionIo>, ns: u32, key: &[u8]) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; REGION as usize];
    match store.get(ns, key, &mut buf) {
        Get::Hit { len } => Some(buf[..len].to_vec()),
        Get::Miss => None,
        Get::BufferTooSmall { len } => panic!("a region-sized buffer is too small for {len}"),
    }
}

/// Total bytes of the region files in `dir` (0 before it exists).
pub(super) fn bytes_on_disk(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries.map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

#[test]
fn objects_round_trip_and_survive_reopening() {
    let dir = TempDir::new("round-trip");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(store.insert(1, b"a", &value(1, 5000)), Insert::Written);
    assert_eq!(store.insert(1, b"empty", &[]), Insert::Written);
    assert_eq!(read(&store, 1, b"a"), Some(value(1, 5000)));
    assert_eq!(read(&store, 1, b"empty"), Some(Vec::new()));
    assert!(store.contains(1, b"a"));
    assert_eq!(store.value_len(1, b"a"), Some(5000));
    assert_eq!(read(&store, 1, b"b"), None);
    // 48 + 1 + 5000 bytes take two 4 KiB blocks; the empty value one.
    assert_eq!(store.namespace_bytes(1), 3 * ALIGN);
    let mut small = [0u8; 10];
    assert_eq!(
        store.get(1, b"a", &mut small),
        Get::BufferTooSmall { len: 5000 }
    );
    let s = store.stats();
    assert_eq!((s.inserts, s.hits, s.misses, s.objects), (2, 2, 1, 2));
    assert_eq!(s.bytes_written, 3 * ALIGN);
    drop(store);

    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 1, b"a"), Some(value(1, 5000)));
    assert_eq!(read(&store, 1, b"empty"), Some(Vec::new()));
    assert_eq!(store.namespace_bytes(1), 3 * ALIGN);
    // Appends go on after the recovered records.
    assert_eq!(store.insert(1, b"c", &value(3, 10)), Insert::Written);
    assert_eq!(read(&store, 1, b"a"), Some(value(1, 5000)));
    assert_eq!(read(&store, 1, b"c"), Some(value(3, 10)));
}

#[test]
fn the_newer_copy_wins_and_removals_survive_reopening() {
    let dir = TempDir::new("newer");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    for i in 0..40u8 {
        assert_eq!(store.insert(0, b"k", &value(i, 3000)), Insert::Written);
    }
    store.insert(0, b"gone", &value(9, 10));
    assert!(store.remove(0, b"gone"));
    assert!(!store.remove(0, b"gone"));
    assert_eq!(read(&store, 0, b"k"), Some(value(39, 3000)));
    assert_eq!(store.namespace_bytes(0), ALIGN);
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 0, b"k"), Some(value(39, 3000)));
    assert_eq!(read(&store, 0, b"gone"), None);
    assert_eq!(store.stats().objects, 1);
}

#[test]
fn a_full_store_drops_its_oldest_region_and_never_exceeds_its_capacity() {
    let dir = TempDir::new("fifo");
    let store = DiskStore::open(&config(&dir.0, 3)).unwrap();
    // Four records of 16 KiB fill a region.
    for i in 0..40u32 {
        let key = i.to_le_bytes();
        assert_eq!(
            store.insert(0, &key, &value(i as u8, 16_000)),
            Insert::Written
        );
        assert!(bytes_on_disk(&dir.0) <= 3 * REGION);
    }
    let s = store.stats();
    assert_eq!(s.regions_dropped, 7);
    assert_eq!(s.evicted, 28);
    assert_eq!(s.objects, 12);
    // The newest twelve are there, the rest are not.
    for i in 0..40u32 {
        let got = read(&store, 0, &i.to_le_bytes());
        assert_eq!(got.is_some(), i >= 28, "object {i}");
    }
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 3)).unwrap();
    assert_eq!(store.stats().objects, 12);
    assert_eq!(
        read(&store, 0, &39u32.to_le_bytes()),
        Some(value(39, 16_000))
    );
}

#[test]
fn a_key_in_one_namespace_is_never_served_to_another() {
    let dir = TempDir::new("tenants");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    store.insert(1, b"shared", &value(1, 100));
    assert_eq!(read(&store, 2, b"shared"), None);
    assert!(!store.contains(2, b"shared"));
    store.insert(2, b"shared", &value(2, 200));
    assert_eq!(read(&store, 1, b"shared"), Some(value(1, 100)));
    assert_eq!(read(&store, 2, b"shared"), Some(value(2, 200)));
    assert!(store.remove(2, b"shared"));
    assert_eq!(read(&store, 1, b"shared"), Some(value(1, 100)));
    assert_eq!(
        (store.namespace_bytes(1), store.namespace_bytes(2)),
        (ALIGN, 0)
    );
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 1, b"shared"), Some(value(1, 100)));
    assert_eq!(read(&store, 2, b"shared"), None);
}

#[test]
fn keys_and_records_too_large_are_refused() {
    let dir = TempDir::new("large");
    let store = DiskStore::open(&config(&dir.0, 2)).unwrap();
    assert_eq!(
        store.insert(0, &[7; MAX_KEY_LEN + 1], b"v"),
        Insert::TooLarge
    );
    assert_eq!(
        store.insert(0, b"k", &vec![0; REGION as usize]),
        Insert::TooLarge
    );
    let fits = REGION as usize - HEADER_LEN - 1;
    assert_eq!(store.insert(0, b"k", &value(1, fits)), Insert::Written);
    assert_eq!(read(&store, 0, b"k"), Some(value(1, fits)));
    assert_eq!(store.stats().refused, 2);
}

#[test]
fn invalid_configurations_are_refused() {
    let dir = TempDir::new("config");
    let bad = [
        DiskConfig::new(&dir.0, 1 << 20).region_size(0),
        DiskConfig::new(&dir.0, 1 << 20).region_size(5000),
        DiskConfig::new(&dir.0, REGION).region_size(REGION),
    ];
    for c in bad {
        assert!(DiskStore::open(&c).is_err(), "{c:?}");
    }
}

/// Overwrites bytes of region `region` at `offset`.
fn scribble(dir: &Path, region: u32, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .open(dir.join(region_file_name(region)))
        .unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

#[test]
fn a_torn_tail_is_cut_off_at_reopening() {
    let dir = TempDir::new("torn");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    store.insert(0, b"a", &value(1, 100));
    store.insert(0, b"b", &value(2, 9000));
    store.insert(0, b"c", &value(3, 100));
    drop(store);
    // A crash while writing "b": only its first 5000 bytes reached the disk.
    let path = dir.0.join(region_file_name(0));
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(ALIGN + 5000).unwrap();
    drop(f);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(store.stats().torn, 1);
    assert_eq!(read(&store, 0, b"a"), Some(value(1, 100)));
    assert_eq!(read(&store, 0, b"b"), None);
    assert_eq!(read(&store, 0, b"c"), None);
    // The tail is gone: the next record follows "a", and all of it reads back.
    assert_eq!(fs::metadata(&path).unwrap().len(), ALIGN);
    store.insert(0, b"d", &value(4, 50));
    assert_eq!(fs::metadata(&path).unwrap().len(), 2 * ALIGN);
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 0, b"a"), Some(value(1, 100)));
    assert_eq!(read(&store, 0, b"d"), Some(value(4, 50)));
    assert_eq!((store.stats().objects, store.stats().torn), (2, 0));
}

#[test]
fn corrupted_bytes_are_misses_while_open_and_after_reopening() {
    let dir = TempDir::new("corrupt");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    store.insert(0, b"a", &value(1, 100));
    store.insert(0, b"b", &value(2, 100));
    store.insert(0, b"c", &value(3, 100));
    // A flipped byte in "b"'s value, found by a get.
    scribble(&dir.0, 0, ALIGN + HEADER_LEN as u64 + 1 + 10, &[0xff]);
    assert_eq!(read(&store, 0, b"b"), None);
    assert!(!store.contains(0, b"b"));
    assert_eq!(store.stats().checksum_failures, 1);
    // A flipped byte in "c"'s key.
    scribble(&dir.0, 0, 2 * ALIGN + HEADER_LEN as u64, b"x");
    assert_eq!(read(&store, 0, b"c"), None);
    assert_eq!(store.stats().checksum_failures, 2);
    assert_eq!(read(&store, 0, b"a"), Some(value(1, 100)));
    drop(store);
    // At reopening, "b" (its value damaged) is a miss when read, and "c" (its key damaged)
    // ends the region: past a header or key that does not check out, nothing is trusted.
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 0, b"a"), Some(value(1, 100)));
    assert_eq!(read(&store, 0, b"b"), None);
    assert_eq!(read(&store, 0, b"c"), None);
    assert_eq!(store.stats().objects, 1);
}

/// File regions that fail on command: writes with `write_error` (an errno), reads with EIO.
pub(super) struct Faulty {
    inner: FileRegions,
    write_error: AtomicI32,
    fail_reads: AtomicBool,
    fail_syncs: AtomicBool,
    fail_truncates: AtomicBool,
}

impl Faulty {
    fn new(dir: &Path, regions: u32) -> Faulty {
        Faulty {
            inner: FileRegions::open(dir, regions).unwrap(),
            write_error: AtomicI32::new(0),
            fail_reads: AtomicBool::new(false),
            fail_syncs: AtomicBool::new(false),
            fail_truncates: AtomicBool::new(false),
        }
    }
}

impl RegionIo for Faulty {
    fn read_at(&self, region: u32, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if self.fail_reads.load(Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.read_at(region, offset, buf)
    }

    fn write_at(&self, region: u32, offset: u64, buf: &[u8]) -> io::Result<()> {
        match self.write_error.load(Ordering::Relaxed) {
            0 => self.inner.write_at(region, offset, buf),
            errno => {
                // Like a disk filling up mid-write: part of the record lands first.
                self.inner.write_at(region, offset, &buf[..buf.len() / 2])?;
                Err(io::Error::from_raw_os_error(errno))
            }
        }
    }

    fn sync(&self, region: u32) -> io::Result<()> {
        if self.fail_syncs.load(Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.sync(region)
    }

    fn truncate(&self, region: u32, len: u64) -> io::Result<()> {
        if self.fail_truncates.load(Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.truncate(region, len)
    }

    fn len(&self, region: u32) -> io::Result<u64> {
        self.inner.len(region)
    }
}

#[test]
fn a_full_disk_refuses_writes_and_the_store_goes_on() {
    let dir = TempDir::new("enospc");
    let store = DiskStore::open_with(&config(&dir.0, 4), Faulty::new(&dir.0, 4)).unwrap();
    assert_eq!(store.insert(0, b"a", &value(1, 100)), Insert::Written);
    store.io.write_error.store(libc::ENOSPC, Ordering::Relaxed);
    assert_eq!(store.insert(0, b"b", &value(2, 9000)), Insert::IoError);
    assert!(!store.contains(0, b"b"));
    assert!(!store.remove(0, b"b"));
    let s = store.stats();
    assert_eq!((s.refused, s.io_errors, s.inserts), (1, 1, 1));
    // The half-written record was cut off: the region holds "a" alone.
    assert_eq!(bytes_on_disk(&dir.0), ALIGN);
    assert_eq!(read(&store, 0, b"a"), Some(value(1, 100)));
    store.io.write_error.store(0, Ordering::Relaxed);
    assert_eq!(store.insert(0, b"c", &value(3, 100)), Insert::Written);
    assert_eq!(read(&store, 0, b"c"), Some(value(3, 100)));
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 0, b"a"), Some(value(1, 100)));
    assert_eq!(read(&store, 0, b"b"), None);
    assert_eq!(read(&store, 0, b"c"), Some(value(3, 100)));
}

#[test]
fn io_errors_are_misses_and_counted_and_the_store_goes_on() {
    let dir = TempDir::new("eio");
    let store = DiskStore::open_with(&config(&dir.0, 4), Faulty::new(&dir.0, 4)).unwrap();
    store.insert(0, b"a", &value(1, 100));
    store.insert(0, b"b", &value(2, 100));
    store.io.fail_reads.store(true, Ordering::Relaxed);
    assert_eq!(read(&store, 0, b"a"), None);
    // The copy that could not be read is dropped.
    assert!(!store.contains(0, b"a"));
    store.io.fail_reads.store(false, Ordering::Relaxed);
    assert_eq!(read(&store, 0, b"b"), Some(value(2, 100)));
    store.io.write_error.store(libc::EIO, Ordering::Relaxed);
    assert_eq!(store.insert(0, b"c", &value(3, 100)), Insert::IoError);
    store.io.fail_syncs.store(true, Ordering::Relaxed);
    assert!(!store.sync());
    let s = store.stats();
    assert_eq!((s.io_errors, s.misses, s.hits, s.refused), (3, 1, 1, 1));
    store.io.write_error.store(0, Ordering::Relaxed);
    store.io.fail_syncs.store(false, Ordering::Relaxed);
    assert_eq!(store.insert(0, b"c", &value(3, 100)), Insert::Written);
    assert!(store.sync());
    assert_eq!(read(&store, 0, b"c"), Some(value(3, 100)));
}

#[test]
fn regions_left_by_a_larger_configuration_are_deleted() {
    let dir = TempDir::new("shrink");
    let store = DiskStore::open(&config(&dir.0, 6)).unwrap();
    for i in 0..24u32 {
        store.insert(0, &i.to_le_bytes(), &value(i as u8, 16_000));
    }
    assert_eq!(bytes_on_disk(&dir.0), 6 * REGION);
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 3)).unwrap();
    assert!(bytes_on_disk(&dir.0) <= 3 * REGION);
    assert_eq!(store.stats().objects, 12);
    for i in 0..12u32 {
        assert_eq!(
            read(&store, 0, &i.to_le_bytes()),
            Some(value(i as u8, 16_000))
        );
    }
}

#[test]
fn a_value_shaped_like_a_record_never_becomes_one_after_a_crash() {
    // A tenant's value holding, on a 4 KiB boundary of the region, the bytes of a valid record
    // of another namespace.
    let secret = value(7, 100);
    let forged = format::Header {
        ns: 2,
        key_len: 6,
        value_len: secret.len() as u64,
        seq: u64::MAX,
        checksum: checksum(&secret),
        generation: 0,
        tombstone: false,
    };
    let mut v = vec![0u8; ALIGN as usize - HEADER_LEN - 1];
    v.extend_from_slice(&forged.encode(b"secret"));
    v.extend_from_slice(b"secret");
    v.extend_from_slice(&secret);
    v.resize(3 * ALIGN as usize, 0);
    let dir = TempDir::new("forged");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    store.insert(0, b"a", &value(1, 100));
    store.insert(1, b"v", &v);
    drop(store);
    // A crash cut the tenant's record short, after the forged bytes.
    let path = dir.0.join(region_file_name(0));
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4 * ALIGN)
        .unwrap();
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 1, b"v"), None);
    // A short record where the tenant's began: its bytes after it must not be read as records.
    store.insert(0, b"b", &value(2, 100));
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(read(&store, 2, b"secret"), None);
    assert_eq!(read(&store, 0, b"b"), Some(value(2, 100)));
    assert_eq!(store.stats().objects, 2);
}

#[test]
fn a_prehashed_insert_with_a_wrong_checksum_only_ever_misses() {
    let dir = TempDir::new("prehashed");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    let v = value(1, 3000);
    assert_eq!(
        store.insert_prehashed(0, b"ok", &v, checksum(&v)),
        Insert::Written
    );
    assert_eq!(
        store.insert_prehashed(0, b"bad", &v, checksum(&v) ^ 1),
        Insert::Written
    );
    assert_eq!(store.insert(0, b"after", &v), Insert::Written);
    assert_eq!(read(&store, 0, b"ok"), Some(v.clone()));
    assert_eq!(read(&store, 0, b"bad"), None);
    assert_eq!(store.stats().checksum_failures, 1);
    drop(store);
    // At reopening the bad record is indexed again (values are checked when read), is not
    // the end of its region, and is dropped at its first read.
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert_eq!(store.stats().checksum_failures, 0);
    assert_eq!(read(&store, 0, b"bad"), None);
    assert_eq!(store.stats().checksum_failures, 1);
    assert_eq!(read(&store, 0, b"after"), Some(v.clone()));
    assert_eq!(read(&store, 0, b"ok"), Some(v));
}

#[test]
fn a_region_that_cannot_be_emptied_is_not_brought_back_by_a_restart() {
    let dir = TempDir::new("no-truncate");
    let store = DiskStore::open_with(&config(&dir.0, 2), Faulty::new(&dir.0, 2)).unwrap();
    // Four records of 16 KiB fill a region.
    for i in 0..8u32 {
        store.insert(0, &i.to_le_bytes(), &value(i as u8, 16_000));
    }
    store.io.fail_truncates.store(true, Ordering::Relaxed);
    // The next insert needs region 0 again: its objects go, but it cannot be emptied.
    assert_eq!(store.insert(0, b"x", &value(9, 100)), Insert::IoError);
    assert_eq!(read(&store, 0, &0u32.to_le_bytes()), None);
    assert_eq!(store.stats().regions_dropped, 1);
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 2)).unwrap();
    for i in 0..4u32 {
        assert_eq!(read(&store, 0, &i.to_le_bytes()), None, "object {i}");
    }
    assert_eq!(read(&store, 0, &4u32.to_le_bytes()), Some(value(4, 16_000)));
    // Emptied now, it takes records again.
    assert_eq!(store.insert(0, b"x", &value(9, 100)), Insert::Written);
    assert_eq!(read(&store, 0, b"x"), Some(value(9, 100)));
}

#[test]
fn a_write_withdrawn_under_the_index_lock_is_never_indexed_nor_brought_back() {
    let dir = TempDir::new("withdrawn");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    let v = value(1, 3000);
    let object = |key: &'static [u8]| Object {
        ns: 0,
        key,
        value: &v,
        checksum: checksum(&v),
        generation: 42,
    };
    assert_eq!(store.write(&object(b"kept"), || true), Insert::Written);
    assert_eq!(store.write(&object(b"gone"), || false), Insert::Withdrawn);
    assert!(!store.contains(0, b"gone"));
    let found = store.lookup(0, b"kept").unwrap();
    assert_eq!((found.generation, found.value_len), (42, 3000));
    // Forgotten unless the value is the one kept; the tombstone keeps it gone.
    assert!(!store.forget(0, b"kept", Some(checksum(&v))));
    assert!(store.holds(0, b"kept", found.seq));
    let mut buf = vec![0u8; 3000];
    assert_eq!(
        store.read_found(0, b"kept", &found, &mut buf),
        Get::Hit { len: 3000 }
    );
    assert!(store.forget(0, b"kept", None));
    assert_eq!(store.read_found(0, b"kept", &found, &mut buf), Get::Miss);
    assert!(store.tombstone(0, b"kept"));
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert!(
        !store.contains(0, b"gone"),
        "a withdrawn record stays withdrawn"
    );
    assert!(!store.contains(0, b"kept"));
    assert_eq!(store.stats().objects, 0);
}

#[test]
fn a_checkpoint_is_loaded_once_and_only_while_it_matches_the_files() {
    let dir = TempDir::new("checkpoint");
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    for i in 0..20u8 {
        store.insert(u32::from(i % 3), &[i], &value(i, 5000));
    }
    assert!(store.remove(1, &[1]));
    assert!(store.checkpoint());
    let before = store.stats();
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert!(store.opened_from_checkpoint());
    assert!(
        !dir.0.join("index.ckpt").exists(),
        "deleted as it is loaded"
    );
    assert_eq!(store.stats().objects, before.objects);
    assert_eq!(store.stats().bytes, before.bytes);
    assert_eq!(read(&store, 1, &[1]), None);
    for i in (0..20u8).filter(|&i| i != 1) {
        assert_eq!(read(&store, u32::from(i % 3), &[i]), Some(value(i, 5000)));
    }
    // Written to since the checkpoint: a checkpoint of the files before is not used.
    assert!(store.checkpoint());
    store.insert(0, b"later", &value(99, 100));
    drop(store);
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert!(!store.opened_from_checkpoint());
    assert_eq!(read(&store, 0, b"later"), Some(value(99, 100)));
    assert_eq!(store.stats().objects, before.objects + 1);
    // A damaged checkpoint is not used either.
    assert!(store.checkpoint());
    drop(store);
    let ckpt = dir.0.join("index.ckpt");
    let mut bytes = fs::read(&ckpt).unwrap();
    bytes[40] ^= 1;
    fs::write(&ckpt, bytes).unwrap();
    let store = DiskStore::open(&config(&dir.0, 4)).unwrap();
    assert!(!store.opened_from_checkpoint());
    assert_eq!(store.stats().objects, before.objects + 1);
}
