//! A daemon restarted on the same data directory.
//!
//! It comes back with every acknowledged object, byte for byte, after a clean stop or a kill -9,
//! even one in the middle of a stream of puts (only the puts not yet acknowledged may be lost,
//! and none is served torn); an object whose bytes were damaged while it was down is dropped,
//! never served.
//!
//! Seen by a long-lived same-host client: the client keeps its mapping of the dead daemon's
//! (unlinked) segment files, and the new daemon hands out addresses at the same segments and
//! offsets. Every read must return the value the new daemon holds or a miss, never the dead
//! daemon's bytes; addresses from before the restart are refused; and the client carries on
//! without being recreated.
//!
//! With a disk tier, the objects demoted to it before a clean stop are on disk after it.
#![cfg(not(loom))]

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{metric, value, Node};
use kvpool::protocol::ErrorCode;
use kvpool::AddrFault;
use kvpool_client::{Client, ClientConfig, Located};

const KEYS: u64 = 64;

fn key(i: u64) -> Vec<u8> {
    format!("restart-key-{i}").into_bytes()
}

/// Sizes on both sides of the client's same-host put threshold (16 KiB).
fn len(i: u64) -> usize {
    if i % 2 == 0 {
        4096
    } else {
        40_000
    }
}

/// Value of key `i` written by life `life` of the daemon.
fn val(life: u64, i: u64) -> Vec<u8> {
    value(life * 1000 + i, len(i))
}

/// Stops the node (SIGTERM, or SIGKILL for a crash) and starts it again on the same directory
/// and addresses.
fn restart(n: &mut Node, crash: bool) -> Node {
    if crash {
        n.kill();
    } else {
        assert!(n.stop().success());
    }
    start_again(n, "16MiB")
}

/// Starts a node again on `n`'s directory and addresses.
fn start_again(n: &Node, memory: &str) -> Node {
    let addrs = [n.tcp.clone(), n.quic.clone(), n.metrics.clone()];
    Node::start_in(
        n.dir.clone(),
        memory,
        &[],
        &[addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()],
    )
}

/// Kills the node under writers that end once `stop` is set, and waits for them.
async fn kill_under(n: &mut Node, stop: &AtomicBool, writers: Vec<tokio::task::JoinHandle<()>>) {
    n.kill();
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("writers give up once the daemon is gone")
            .unwrap();
    }
}

async fn same_host_client(n: &Node) -> Client {
    let c = Client::connect(&n.tcp_url(), ClientConfig::default())
        .await
        .unwrap();
    assert!(c.is_local(), "the test needs the same-host path");
    c
}

/// The long-lived client writes every key, the daemon restarts, another client writes new
/// values of every key; then the long-lived client reads them every way it can.
async fn long_lived_client_reads_only_the_new_values(crash: bool) {
    let mut n = Node::start("16MiB", &[]);
    let c = same_host_client(&n).await;
    let keys: Vec<Vec<u8>> = (0..KEYS).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    for i in 0..KEYS {
        c.put(&keys[i as usize], &val(1, i)).await.unwrap();
    }
    let old: Vec<Located> = c
        .lease(&refs, 0)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.expect("present"))
        .collect();

    let n2 = restart(&mut n, crash);

    // Before the client has talked to the new daemon: its mapping is of a dead daemon, and
    // the dead daemon's addresses are refused through it.
    let mut buf = vec![0u8; 40_000];
    for l in &old {
        let dst = &mut buf[..l.addr.len as usize];
        match c.read_local(&l.addr, 0, dst) {
            None => {}
            Some(r) => assert_eq!(r, Err(AddrFault::WrongIncarnation), "{l:?}"),
        }
    }

    let writer = same_host_client(&n2).await;
    for i in 0..KEYS {
        writer.put(&keys[i as usize], &val(2, i)).await.unwrap();
    }

    for round in 0..3 {
        // lease + read_local, and the verified read.
        let found = c.lease(&refs, 0).await.unwrap();
        for (i, l) in found.iter().enumerate() {
            let i = i as u64;
            let Some(l) = l else { continue };
            assert_ne!(l.addr.incarnation, old[i as usize].addr.incarnation);
            let want = val(2, i);
            let dst = &mut buf[..l.addr.len as usize];
            if let Some(Ok(())) = c.read_local(&l.addr, 0, dst) {
                assert!(
                    dst == want,
                    "round {round}: read_local of key {i} is not its value"
                );
            }
            if let Some(Ok(got)) = c.read_local_verified(l, &mut buf) {
                assert!(
                    buf[..got] == want,
                    "round {round}: verified read of key {i}"
                );
            }
        }
        // get.
        for i in 0..KEYS {
            if let Some(v) = c.get(&keys[i as usize]).await.unwrap() {
                assert!(v == val(2, i), "round {round}: get of key {i}");
            }
        }
        // batch_get_into.
        let mut bufs: Vec<Vec<u8>> = (0..KEYS).map(|_| vec![0u8; 40_000]).collect();
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
        for (i, g) in got.iter().enumerate() {
            if let Some(len) = g {
                assert!(
                    bufs[i][..*len] == val(2, i as u64),
                    "round {round}: batch_get_into of key {i}"
                );
            }
        }
    }

    // By now the client has noticed the restart: every key is served, from the new mapping.
    assert!(c.is_local(), "the client mapped the new daemon's segments");
    let found = c.lease(&refs, 0).await.unwrap();
    for (i, l) in found.iter().enumerate() {
        let l = l.expect("present");
        let got = c
            .read_local_verified(&l, &mut buf)
            .expect("mapped")
            .unwrap();
        assert!(buf[..got] == val(2, i as u64), "key {i} after the remap");
    }
    let mut bufs: Vec<Vec<u8>> = (0..KEYS).map(|_| vec![0u8; 40_000]).collect();
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
    for (i, g) in got.iter().enumerate() {
        let len = g.expect("present");
        assert!(bufs[i][..len] == val(2, i as u64), "batch key {i}");
    }

    // The dead daemon's addresses stay refused, through the mapping and through the socket.
    for l in &old {
        let dst = &mut buf[..l.addr.len as usize];
        if let Some(r) = c.read_local(&l.addr, 0, dst) {
            assert_eq!(r, Err(AddrFault::WrongIncarnation));
        }
        let e = c.read(&l.addr, 0, dst).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::WrongIncarnation), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_client_never_reads_the_dead_daemons_bytes_after_a_restart() {
    long_lived_client_reads_only_the_new_values(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_client_never_reads_the_dead_daemons_bytes_after_a_crash() {
    long_lived_client_reads_only_the_new_values(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_from_before_a_restart_are_refused() {
    let mut n = Node::start("16MiB", &[]);
    let c = same_host_client(&n).await;
    c.put(b"k", &value(1, 4096)).await.unwrap();
    let old = c.lease(&[b"k"], 0).await.unwrap()[0].unwrap();
    let n2 = restart(&mut n, false);
    // The new daemon holds an object of the same size at the same place.
    let other = same_host_client(&n2).await;
    other.put(b"k", &value(2, 4096)).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let e = c.read(&old.addr, 0, &mut buf).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::WrongIncarnation), "{e}");
    // Again, now that the client has remapped.
    let e = c.read(&old.addr, 0, &mut buf).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::WrongIncarnation), "{e}");
    let e = c.write(&old.addr, 0, b"x").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::WrongIncarnation), "{e}");
    // And over TCP, from a client that never mapped anything.
    let tcp = Client::connect(
        &n2.tcp_url(),
        ClientConfig {
            same_host: kvpool_client::SameHost::Off,
            ..ClientConfig::default()
        },
    )
    .await
    .unwrap();
    let e = tcp.read(&old.addr, 0, &mut buf).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::WrongIncarnation), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_reconnects_on_its_own_after_a_restart() {
    let mut n = Node::start("16MiB", &[]);
    let c = same_host_client(&n).await;
    // Several pooled connections, all of the first daemon.
    let puts: Vec<_> = (0..8u64)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { c.put(&key(i), &val(1, i)).await })
        })
        .collect();
    for p in puts {
        p.await.unwrap().unwrap();
    }
    let _n2 = restart(&mut n, true);
    // The very first calls after the restart succeed: no error, no recreated client.
    c.put(&key(0), &val(2, 0)).await.unwrap();
    assert_eq!(c.get(&key(0)).await.unwrap(), Some(val(2, 0)));
    c.put(&key(1), &val(2, 1)).await.unwrap();
    assert_eq!(c.get(&key(1)).await.unwrap(), Some(val(2, 1)));
    assert_eq!(
        c.get(&key(2)).await.unwrap(),
        Some(val(1, 2)),
        "the new daemon recovered the dead one's objects"
    );
    let items: Vec<(Vec<u8>, Vec<u8>)> = (2..8).map(|i| (key(i), val(2, i))).collect();
    let refs: Vec<(&[u8], &[u8])> = items
        .iter()
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();
    let codes = c.batch_put_from(&refs).await.unwrap();
    assert!(codes.iter().all(|c| *c == ErrorCode::Ok), "{codes:?}");
    let keys: Vec<Vec<u8>> = (0..8).map(key).collect();
    let krefs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 40_000]).collect();
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = c.batch_get_into(&krefs, &mut dsts).await.unwrap();
    for (i, g) in got.iter().enumerate() {
        let len = g.expect("present");
        assert!(bufs[i][..len] == val(2, i as u64), "key {i}");
    }
    assert!(c.is_local(), "the same-host path is back");
    // A two-phase put straight into the new mapping.
    let v = value(77, 50_000);
    let addr = c.alloc(b"two-phase", v.len() as u64).await.unwrap();
    c.write(&addr, 0, &v).await.unwrap();
    c.commit(&addr, kvpool::checksum(&v)).await.unwrap();
    assert_eq!(c.get(b"two-phase").await.unwrap(), Some(v));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_clients_reconnect_on_their_own_after_a_restart() {
    let mut n = Node::start("16MiB", &[]);
    let remote = |ca| ClientConfig {
        same_host: kvpool_client::SameHost::Off,
        ca,
        ..ClientConfig::default()
    };
    let tcp = Client::connect(&n.tcp_url(), remote(None)).await.unwrap();
    let quic = Client::connect(&n.quic_url(), remote(Some(n.cert())))
        .await
        .unwrap();
    tcp.put(b"t", b"1").await.unwrap();
    quic.put(b"q", b"1").await.unwrap();
    let _n2 = restart(&mut n, false);
    tcp.put(b"t", b"2").await.unwrap();
    assert_eq!(tcp.get(b"t").await.unwrap().as_deref(), Some(&b"2"[..]));
    quic.put(b"q", b"2").await.unwrap();
    assert_eq!(quic.get(b"q").await.unwrap().as_deref(), Some(&b"2"[..]));
}

/// A client of either kind: remote (TCP) or same-host (mapped segments, the client writes the
/// bytes itself).
async fn client(n: &Node, local: bool) -> Client {
    let cfg = ClientConfig {
        same_host: if local {
            kvpool_client::SameHost::Auto
        } else {
            kvpool_client::SameHost::Off
        },
        ..ClientConfig::default()
    };
    let c = Client::connect(&n.tcp_url(), cfg).await.unwrap();
    assert_eq!(c.is_local(), local);
    c
}

/// Sizes from one byte to well past the same-host put threshold and the allocator's pages.
fn mixed_len(i: u64) -> usize {
    [1, 100, 4096, 40_000, 70_000, 200_000][(i % 6) as usize]
}

async fn every_acknowledged_object_survives(crash: bool) {
    let mut n = Node::start("64MiB", &[]);
    let remote = client(&n, false).await;
    let local = client(&n, true).await;
    let count = 120u64;
    for i in 0..count {
        let c = if i % 2 == 0 { &remote } else { &local };
        c.put(&key(i), &value(i, mixed_len(i))).await.unwrap();
    }
    // Removed and replaced objects come back as they were last acknowledged.
    assert!(remote.remove(&key(0)).await.unwrap());
    remote.put(&key(1), &value(9999, 333)).await.unwrap();
    let n2 = restart(&mut n, crash);
    let c = client(&n2, false).await;
    assert_eq!(
        c.get(&key(0)).await.unwrap(),
        None,
        "a removed key stays removed"
    );
    assert_eq!(c.get(&key(1)).await.unwrap(), Some(value(9999, 333)));
    for i in 2..count {
        let got = c.get(&key(i)).await.unwrap();
        assert!(
            got.as_deref() == Some(&value(i, mixed_len(i))[..]),
            "key {i} after the restart: {:?} bytes",
            got.map(|v| v.len())
        );
    }
    // The same-host path reads them too, through fresh mappings.
    let l = client(&n2, true).await;
    let keys: Vec<Vec<u8>> = (2..count).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut buf = vec![0u8; 200_000];
    for (i, found) in l.lease(&refs, 0).await.unwrap().iter().enumerate() {
        let found = found.expect("present");
        let got = l
            .read_local_verified(&found, &mut buf)
            .expect("mapped")
            .unwrap();
        assert!(
            buf[..got] == value(i as u64 + 2, mixed_len(i as u64 + 2)),
            "key {}",
            i + 2
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_daemon_comes_back_with_every_acknowledged_object() {
    every_acknowledged_object_survives(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanly_stopped_daemon_comes_back_with_every_acknowledged_object() {
    every_acknowledged_object_survives(false).await;
}

/// The data offset of the segment file at `path` (from its header) and the file itself.
fn segment_file(dir: &Path, segment: u32) -> (std::path::PathBuf, u64) {
    let path = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("segment-") && name.ends_with(&format!("-{segment}.kvp"))
        })
        .expect("segment file");
    let head = std::fs::read(&path).unwrap();
    let data_offset = u64::from_le_bytes(head[40..48].try_into().unwrap());
    (path, data_offset)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_damaged_while_the_daemon_was_down_is_dropped_not_served() {
    use std::os::unix::fs::FileExt;
    let mut n = Node::start("16MiB", &[]);
    let c = client(&n, false).await;
    for i in 0..8 {
        c.put(&key(i), &val(1, i)).await.unwrap();
    }
    let keys: Vec<Vec<u8>> = (0..8).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let found = c.lease(&refs, 0).await.unwrap();
    n.kill();
    // Flip one byte in the middle of key 3's value, and the last byte of key 6's.
    for (i, at) in [(3usize, 1000u64), (6, val(1, 6).len() as u64 - 1)] {
        let addr = found[i].unwrap().addr;
        let (path, data_offset) = segment_file(&n.dir, addr.segment);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, data_offset + addr.offset + at)
            .unwrap();
        f.write_all_at(&[b[0] ^ 1], data_offset + addr.offset + at)
            .unwrap();
    }
    let n2 = start_again(&n, "16MiB");
    let c = client(&n2, false).await;
    for i in 0..8 {
        let got = c.get(&key(i)).await.unwrap();
        if i == 3 || i == 6 {
            assert_eq!(got, None, "damaged key {i} is a miss");
        } else {
            assert!(got == Some(val(1, i)), "intact key {i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_write_loses_at_most_the_puts_in_flight_and_serves_nothing_torn() {
    let mut n = Node::start("256MiB", &[]);
    // Two writers streaming puts, one remote and one same-host, each noting what was
    // acknowledged; the daemon is killed under them.
    let acked: Arc<Mutex<Vec<u64>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2u64 {
        let c = client(&n, w == 1).await;
        let acked = acked.clone();
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let mut i = w;
            while !stop.load(Ordering::Relaxed) && i < 4000 {
                // Up to 3000 puts of at most 70 kB: well within memory, nothing evicted.
                if c.put(&key(i), &value(i, mixed_len(i))).await.is_err() {
                    break;
                }
                acked.lock().unwrap().push(i);
                i += 2;
            }
        }));
    }
    // Let the stream run, then kill the daemon in the middle of it.
    while acked.lock().unwrap().len() < 300 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    kill_under(&mut n, &stop, writers).await;
    // Every put that returned Ok did so before the kill: nothing else was listening.
    let acked_at_kill: Vec<u64> = acked.lock().unwrap().clone();
    let n2 = start_again(&n, "256MiB");
    let c = client(&n2, false).await;
    let highest = acked_at_kill.iter().max().copied().unwrap_or(0);
    let mut present = 0;
    for i in 0..highest + 10 {
        let got = c.get(&key(i)).await.unwrap();
        if let Some(v) = &got {
            assert!(*v == value(i, mixed_len(i)), "key {i} is served torn");
            present += 1;
        }
        if acked_at_kill.contains(&i) {
            assert!(got.is_some(), "acknowledged key {i} was lost");
        }
    }
    assert!(present >= acked_at_kill.len());
}

/// The journal is compacted on a thread of its own while puts go on (every ~33,000
/// overwriting puts here). A daemon killed in the middle of a stream of overwrites that has
/// been through several compactions comes back with, for every key, its last acknowledged
/// value or a later one, never an older one and never torn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_amid_journal_compactions_keeps_the_last_acknowledged_values() {
    const PER: u64 = 64; // keys per writer, overwritten in one batch put per round
    let version_key = |w: u64, k: u64| format!("compact-{w}-{k}").into_bytes();
    let version_val = |w: u64, k: u64, v: u64| value((v << 16) | (w << 8) | k, 100);
    let mut n = Node::start("64MiB", &[]);
    // writer -> the last round acknowledged
    let acked: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(vec![0; 2]));
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2u64 {
        let c = client(&n, false).await;
        let (acked, stop) = (acked.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let keys: Vec<Vec<u8>> = (0..PER).map(|k| version_key(w, k)).collect();
            let mut v = 1;
            while !stop.load(Ordering::Relaxed) {
                let vals: Vec<Vec<u8>> = (0..PER).map(|k| version_val(w, k, v)).collect();
                let items: Vec<(&[u8], &[u8])> = keys
                    .iter()
                    .zip(&vals)
                    .map(|(k, v)| (k.as_slice(), v.as_slice()))
                    .collect();
                match c.batch_put_from(&items).await {
                    Ok(codes) if codes.iter().all(|c| *c == ErrorCode::Ok) => {}
                    _ => break,
                }
                acked.lock().unwrap()[w as usize] = v;
                v += 1;
            }
        }));
    }
    // At least 1,600 rounds of both writers (about 205,000 overwriting puts, 410,000 journal
    // records, several compactions' worth) and two compactions finished, as the metrics page
    // counts them; then the kill, with the writers still going. Waiting for the count rather
    // than reading it after a fixed number of rounds keeps a loaded machine, whose compactions
    // lag the writers, from failing the test.
    let journal = n.dir.join("journal-0.kvj");
    let compactions = || -> u64 {
        metric(&n.scrape(), "kvpool_journal_compactions_total{node=\"0\"}")
            .expect("kvpool_journal_compactions_total on the metrics page")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while acked.lock().unwrap().iter().min().copied().unwrap_or(0) < 1_600 || compactions() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "fewer than two compactions in a minute of overwrites: {}",
            compactions()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    kill_under(&mut n, &stop, writers).await;
    let at_kill = acked.lock().unwrap().clone();
    // Uncompacted, the records would take over 20 MB (a commit of a 14-byte key is 72
    // bytes, a gone 21); the allocation ahead of the last record is at most as large again.
    let len = std::fs::metadata(&journal).unwrap().len();
    let written = 2 * 1_600 * PER * (72 + 21);
    assert!(len < written / 2, "journal of {len} bytes: not compacted");
    let n2 = start_again(&n, "64MiB");
    let c = client(&n2, false).await;
    for w in 0..2u64 {
        for k in 0..PER {
            let got = c
                .get(&version_key(w, k))
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("key {w}/{k} lost"));
            // The last acknowledged round, or the one in flight at the kill.
            let ok = [at_kill[w as usize], at_kill[w as usize] + 1]
                .iter()
                .any(|&v| got == version_val(w, k, v));
            assert!(
                ok,
                "key {w}/{k}: neither round {} nor the next",
                at_kill[w as usize]
            );
        }
    }
}

/// With a disk tier (`--disk-path`), what DRAM evicts is written to disk in the background;
/// a clean stop lets the queue land, and the restarted daemon finds every demoted object on
/// disk again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_tier_keeps_demoted_objects_across_a_restart() {
    let dir = common::temp_dir("disk-tier");
    let disk = dir.join("disk");
    let disk_args = [
        "--disk-path",
        disk.to_str().unwrap(),
        "--disk-capacity",
        "64MiB",
        "--disk-region-size",
        "4MiB",
        "--disk-admit",
        "all",
    ];
    let mut n = Node::start("16MiB", &disk_args);
    let c = client(&n, false).await;
    for i in 0..40u64 {
        c.put(&key(i), &value(i, 1 << 20)).await.unwrap();
    }
    let series = |page: &str, name: &str| metric(page, &format!("{name}{{node=\"0\"}}"));
    let t = std::time::Instant::now();
    let demoted = loop {
        let page = n.scrape();
        let evictions = series(&page, "kvpool_evictions_total").unwrap();
        let demoted = series(&page, "kvpool_disk_demotions_total").unwrap();
        if evictions > 0 && demoted == evictions {
            assert_eq!(series(&page, "kvpool_disk_queue_drops_total"), Some(0));
            break demoted;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    drop(c);
    assert!(n.stop().success());

    let addrs = [n.tcp.clone(), n.quic.clone(), n.metrics.clone()];
    let n2 = Node::start_in(
        n.dir.clone(),
        "16MiB",
        &disk_args,
        &[addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()],
    );
    let page = n2.scrape();
    assert_eq!(
        series(&page, "kvpool_disk_objects"),
        Some(demoted),
        "{page}"
    );
    assert_eq!(
        series(&page, "kvpool_disk_checksum_failures_total"),
        Some(0)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
