//! The store under a real kill -9 while it writes, and read while its regions are dropped and
//! rewritten: what it serves is always a value that was written for that key.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tests::TempDir;
use super::*;

/// Tells the test binary, run again, to be the writer that gets killed.
const CHILD_DIR: &str = "KVPOOL_DISK_TEST_CHILD_DIR";
const REGION: u64 = 256 << 10;

/// A value that names its key and version, so that any bytes served can be judged alone.
fn value(key: u32, version: u32, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(8));
    v.extend_from_slice(&key.to_le_bytes());
    v.extend_from_slice(&version.to_le_bytes());
    let seed = key.wrapping_mul(2_654_435_761) ^ version;
    v.extend((8..len.max(8)).map(|i| (i as u32).wrapping_mul(seed | 1).to_le_bytes()[1]));
    v
}

/// Whether `bytes` are a value [`value`] makes for `key`.
fn is_a_value_of(key: u32, bytes: &[u8]) -> bool {
    bytes.len() >= 8 && bytes[..4] == key.to_le_bytes() && {
        let version = u32::from_le_bytes(bytes[4..8].try_into().unwrap());
        bytes == value(key, version, bytes.len())
    }
}

fn config(dir: &std::path::Path) -> DiskConfig {
    DiskConfig::new(dir, 8 * REGION).region_size(REGION)
}

/// The writer of [`a_kill_9_while_writing_loses_at_most_what_was_being_written`]: does nothing
/// unless that test ran this binary again to be killed.
#[test]
fn killed_writer() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let store = DiskStore::open(&config(&dir)).unwrap();
    std::fs::write(dir.join("writing"), b"").unwrap();
    for version in 0.. {
        for key in 0..64u32 {
            let len = 1000 + (key as usize * 997 + version as usize * 131) % 60_000;
            store.insert(0, &key.to_le_bytes(), &value(key, version, len));
        }
    }
}

#[test]
fn a_kill_9_while_writing_loses_at_most_what_was_being_written() {
    let dir = TempDir::new("kill9");
    let ready = dir.0.join("writing");
    for round in 0..3u64 {
        let _ = std::fs::remove_file(&ready);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "disk::tests_crash::killed_writer",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, &dir.0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Killed once it writes, at a different point each round.
        let started = Instant::now();
        while !ready.exists() && started.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(40 + 25 * round));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let store = DiskStore::open(&config(&dir.0)).unwrap();
        assert!(super::tests::bytes_on_disk(&dir.0) <= 8 * REGION);
        let mut buf = vec![0u8; REGION as usize];
        let mut found = 0;
        for key in 0..64u32 {
            if let Get::Hit { len } = store.get(0, &key.to_le_bytes(), &mut buf) {
                assert!(
                    is_a_value_of(key, &buf[..len]),
                    "key {key} after kill {round}"
                );
                found += 1;
            }
        }
        let s = store.stats();
        assert_eq!((s.checksum_failures, s.io_errors), (0, 0));
        assert!(found > 0 && s.torn <= 1, "found {found}, {s:?}");
    }
}

#[test]
fn reads_racing_with_dropped_regions_never_return_wrong_bytes() {
    let dir = TempDir::new("race");
    // Four small regions: the writer drops one every few records.
    let store = Arc::new(
        DiskStore::open(&DiskConfig::new(&dir.0, 4 * (64 << 10)).region_size(64 << 10)).unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3u32)
        .map(|t| {
            let (store, stop) = (store.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                let mut hits = 0u64;
                let mut key = t;
                while !stop.load(Ordering::Relaxed) {
                    key = (key * 7 + 3) % 16;
                    if let Get::Hit { len } = store.get(0, &key.to_le_bytes(), &mut buf) {
                        assert!(is_a_value_of(key, &buf[..len]), "key {key}");
                        hits += 1;
                    }
                }
                hits
            })
        })
        .collect();
    let started = Instant::now();
    let mut version = 0;
    while started.elapsed() < Duration::from_millis(500) {
        for key in 0..16u32 {
            let len = 100 + (key as usize * 4099 + version as usize * 31) % 20_000;
            assert_eq!(
                store.insert(0, &key.to_le_bytes(), &value(key, version, len)),
                Insert::Written
            );
        }
        version += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let hits: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    let s = store.stats();
    assert!(hits > 0 && s.regions_dropped > 0, "{hits} hits, {s:?}");
    // Copies whose region went while they were read are plain misses, not faults.
    assert_eq!((s.checksum_failures, s.io_errors), (0, 0));
}
