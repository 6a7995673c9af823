//! The `O_DIRECT` engine against a real file: every kind of request checked against a plain
//! byte vector, and the whole store working over it.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use memmap2::MmapMut;

use super::*;
use crate::disk::tests::TempDir;
use crate::disk::{DiskConfig, DiskStore, Get, Insert, ALIGN};

/// A fresh directory on a file system that takes `O_DIRECT`: the system's temp dir, or, where
/// that refuses it (tmpfs before Linux 6.6), one under this crate's `target/`.
fn direct_dir(name: &str) -> TempDir {
    let dir = TempDir::new(name);
    std::fs::create_dir_all(&dir.0).unwrap();
    let probe = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.0.join("probe"));
    if probe.is_ok() {
        return dir;
    }
    let file_name = dir.0.file_name().unwrap().to_owned();
    let on_disk = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(file_name);
    TempDir(on_disk)
}

/// Deterministic bytes for the model test (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    (0..len).map(|_| rng.next() as u8).collect()
}

#[test]
fn unaligned_writes_and_reads_round_trip_and_leave_the_lengths_pwrite_would() {
    let dir = direct_dir("direct-unaligned");
    let io = DirectRegions::open(&dir.0, 2).unwrap();
    io.write_at(0, 0, b"0123456789").unwrap();
    assert_eq!(io.len(0).unwrap(), 10);
    let mut got = [0u8; 4];
    io.read_at(0, 3, &mut got).unwrap();
    assert_eq!(&got, b"3456");
    // Past the end, with a gap: the gap reads as zeros, the file ends where the write does.
    io.write_at(0, 10_000, b"tail").unwrap();
    assert_eq!(io.len(0).unwrap(), 10_004);
    let mut gap = vec![1u8; 10_000 - 10];
    io.read_at(0, 10, &mut gap).unwrap();
    assert!(gap.iter().all(|&b| b == 0));
    let mut tail = [0u8; 4];
    io.read_at(0, 10_000, &mut tail).unwrap();
    assert_eq!(&tail, b"tail");
    // A write inside the file keeps its length and its other bytes.
    io.write_at(0, 2, b"ab").unwrap();
    assert_eq!(io.len(0).unwrap(), 10_004);
    let mut head = [0u8; 10];
    io.read_at(0, 0, &mut head).unwrap();
    assert_eq!(&head, b"01ab456789");
    // A read past the end fails, as a plain short read does.
    let mut over = [0u8; 8];
    let err = io.read_at(0, 10_000, &mut over).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    // Regions are separate files.
    assert_eq!(io.len(1).unwrap(), 0);
    assert_eq!(
        io.read_at(2, 0, &mut over).unwrap_err().kind(),
        io::ErrorKind::NotFound
    );
}

#[test]
fn aligned_requests_go_straight_and_round_trip() {
    let dir = direct_dir("direct-aligned");
    let io = DirectRegions::open(&dir.0, 2).unwrap();
    let len = 3 * ALIGN as usize;
    let mut src = MmapMut::map_anon(len).unwrap();
    src.copy_from_slice(&bytes(7, len));
    io.write_at(1, ALIGN, &src).unwrap();
    assert_eq!(io.len(1).unwrap(), 4 * ALIGN);
    let mut dst = MmapMut::map_anon(len).unwrap();
    io.read_at(1, ALIGN, &mut dst).unwrap();
    assert!(dst[..] == src[..]);
    // The same bytes through an unaligned buffer (the bounce path) read the same.
    let mut unaligned = vec![0u8; len + 1];
    io.read_at(1, ALIGN, &mut unaligned[1..]).unwrap();
    assert!(unaligned[1..] == src[..]);
    // Aligned, but past the end: a short read is an error.
    let mut past = MmapMut::map_anon(2 * ALIGN as usize).unwrap();
    let err = io.read_at(1, 3 * ALIGN, &mut past).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    io.truncate(1, 5).unwrap();
    assert_eq!(io.len(1).unwrap(), 5);
    io.sync(1).unwrap();
}

#[test]
fn random_requests_read_what_a_byte_vector_holds() {
    let dir = direct_dir("direct-model");
    let bounce = 3 * ALIGN as usize;
    let io = DirectRegions::open_with_bounce(&dir.0, 1, bounce).unwrap();
    let mut model: Vec<u8> = Vec::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Requests span up to three bounce buffers, at any offset and any buffer address.
    let max_len = 3 * bounce as u64 + 5000;
    for step in 0..300u64 {
        let offset = match rng.below(3) {
            0 => rng.below(4) * ALIGN,
            _ => rng.below(4 * ALIGN + max_len),
        };
        let len = match rng.below(4) {
            0 => rng.below(3) * ALIGN,
            1 => rng.below(64),
            _ => rng.below(max_len),
        } as usize;
        let shift = rng.below(2) as usize * (1 + rng.below(ALIGN - 1) as usize);
        match rng.below(5) {
            0 | 1 => {
                let mut buf = vec![0u8; shift + len];
                buf[shift..].copy_from_slice(&bytes(step + 1, len));
                io.write_at(0, offset, &buf[shift..]).unwrap();
                // As with pwrite, writing nothing does not lengthen the file.
                if len > 0 {
                    let end = offset as usize + len;
                    model.resize(model.len().max(end), 0);
                    model[offset as usize..end].copy_from_slice(&buf[shift..]);
                }
            }
            2 => {
                let cut = rng.below(model.len() as u64 + 1);
                io.truncate(0, cut).unwrap();
                model.truncate(cut as usize);
            }
            _ => {
                let mut buf = vec![0u8; shift + len];
                let got = io.read_at(0, offset, &mut buf[shift..]);
                let end = offset as usize + len;
                if len == 0 {
                    got.unwrap();
                } else if end <= model.len() {
                    got.unwrap();
                    assert!(
                        buf[shift..] == model[offset as usize..end],
                        "step {step}: read {len} at {offset}"
                    );
                } else {
                    assert_eq!(got.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
                }
            }
        }
        assert_eq!(io.len(0).unwrap(), model.len() as u64, "step {step}");
    }
}

fn config(dir: &std::path::Path) -> DiskConfig {
    DiskConfig::new(dir, 4 * (64 << 10)).region_size(64 << 10)
}

fn get(store: &DiskStore<impl RegionIo>, key: &[u8]) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 64 << 10];
    match store.get(0, key, &mut buf) {
        Get::Hit { len } => Some(buf[..len].to_vec()),
        _ => None,
    }
}

#[test]
fn the_store_works_over_direct_io_and_reopens_with_either_engine() {
    let dir = direct_dir("direct-store");
    let open = || DiskStore::open_with(&config(&dir.0), DirectRegions::open(&dir.0, 4).unwrap());
    let store = open().unwrap();
    for i in 0..20u64 {
        let key = format!("key-{i}");
        let value = bytes(i + 100, 1000 + i as usize * 500);
        assert_eq!(store.insert(0, key.as_bytes(), &value), Insert::Written);
    }
    assert!(get(&store, b"key-3") == Some(bytes(103, 2500)));
    assert!(store.remove(0, b"key-3"));
    assert_eq!(get(&store, b"key-3"), None);
    assert!(store.sync());
    let written = store.stats();
    drop(store);

    let store = open().unwrap();
    assert_eq!(store.stats().objects, written.objects);
    assert_eq!(get(&store, b"key-3"), None);
    for i in (0..20u64).filter(|&i| i != 3) {
        let key = format!("key-{i}");
        let want = bytes(i + 100, 1000 + i as usize * 500);
        assert!(get(&store, key.as_bytes()) == Some(want), "{key}");
    }
    assert!(get(&store, b"key-19") == Some(bytes(119, 10_500)));
    drop(store);

    // The files are the same whichever engine wrote them.
    let buffered = DiskStore::open(&config(&dir.0)).unwrap();
    assert_eq!(buffered.stats().objects, written.objects);
    assert!(get(&buffered, b"key-19") == Some(bytes(119, 10_500)));
    assert_eq!(buffered.stats().checksum_failures, 0);
}

#[test]
fn an_engine_is_named_in_configuration_and_opens_the_same_files() {
    for engine in [IoEngine::Buffered, IoEngine::Direct] {
        assert_eq!(engine.to_string().parse::<IoEngine>(), Ok(engine));
    }
    assert_eq!(IoEngine::default(), IoEngine::Buffered);
    assert!("uring".parse::<IoEngine>().is_err());
    let dir = direct_dir("engines");
    let regions = IoEngine::Direct.open(&dir.0, 2).unwrap();
    regions.write_at(1, 5, b"either").unwrap();
    regions.sync(1).unwrap();
    drop(regions);
    let regions = IoEngine::Buffered.open(&dir.0, 2).unwrap();
    let mut got = [0u8; 6];
    regions.read_at(1, 5, &mut got).unwrap();
    assert_eq!(&got, b"either");
    assert_eq!(regions.len(1).unwrap(), 11);
    regions.truncate(1, 0).unwrap();
    assert_eq!(regions.len(1).unwrap(), 0);
}
