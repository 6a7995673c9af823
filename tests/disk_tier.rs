//! The disk tier under a real daemon on a real file system: what DRAM evicts comes back through
//! every read path, a rewritten or removed key never comes back from disk, tenants never see
//! each other's disk copies, and a kill -9 while demoting loses at most what was being written.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{metric, Node};
use kvpool_client::{Client, ClientConfig, Prefix, SameHost};

/// 1 MiB values: sixteen fill the DRAM of a 16 MiB node.
const LEN: usize = 1 << 20;

fn key(i: u64) -> Vec<u8> {
    format!("disk-block-{i}").into_bytes()
}

/// Value `i`, version `v`.
fn value(i: u64, v: u64) -> Vec<u8> {
    (0..LEN)
        .map(|j| (j as u64 ^ i.wrapping_mul(131) ^ v.wrapping_mul(7919)) as u8)
        .collect()
}

/// The flags of a 128 MiB disk tier in `dir` that takes every eviction.
fn disk_args(dir: &Path) -> Vec<String> {
    [
        "--disk-path",
        dir.to_str().unwrap(),
        "--disk-capacity",
        "128MiB",
        "--disk-region-size",
        "4MiB",
        "--disk-admit",
        "all",
    ]
    .map(String::from)
    .to_vec()
}

fn start(dir: &Path, extra: &[&str]) -> Node {
    let mut args = disk_args(&dir.join("disk"));
    args.extend(extra.iter().map(|s| s.to_string()));
    Node::start(
        "16MiB",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    )
}

async fn client(n: &Node, same_host: SameHost) -> Client {
    let cfg = ClientConfig {
        same_host,
        timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    };
    Client::connect(&n.tcp_url(), cfg).await.unwrap()
}

/// Waits until every eviction so far has reached the disk.
fn demoted(n: &Node) -> u64 {
    let series = |page: &str, name: &str| metric(page, &format!("{name}{{node=\"0\"}}"));
    let t = Instant::now();
    loop {
        let page = n.scrape();
        let evictions = series(&page, "kvpool_evictions_total").unwrap();
        let demoted = series(&page, "kvpool_disk_demotions_total").unwrap();
        let kept = series(&page, "kvpool_disk_already_on_disk_total").unwrap();
        if evictions > 0 && demoted + kept == evictions {
            assert_eq!(series(&page, "kvpool_disk_queue_drops_total"), Some(0));
            return demoted;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{page}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn temp(name: &str) -> PathBuf {
    common::temp_dir(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_blocks_come_back_from_disk_through_every_read_path() {
    let dir = temp("disk-reads");
    let n = start(&dir, &[]);
    let remote = client(&n, SameHost::Off).await;
    const N: u64 = 48;
    for i in 0..N {
        remote.put(&key(i), &value(i, 0)).await.unwrap();
    }
    assert!(demoted(&n) >= N - 16);
    let before = remote.disk_stats().await.unwrap().expect("a disk tier");
    assert!(before.objects >= N - 16, "{before:?}");

    // Existence and prefix lookups count the disk: every block, in order.
    let keys: Vec<Vec<u8>> = (0..N).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    assert_eq!(remote.batch_exists(&refs).await.unwrap(), N as usize);
    assert_eq!(
        remote.match_prefix(Prefix::Keys(&refs)).await.unwrap(),
        N as usize
    );
    assert!(remote.exists(&key(0)).await.unwrap());

    // A get of each reads it back (promoting it, and pushing others down again).
    for i in 0..N {
        let got = remote.get(&key(i)).await.unwrap();
        assert_eq!(got.as_deref(), Some(&value(i, 0)[..]), "key {i}");
    }
    // Batched reads into the caller's buffers, over the socket and on the same host.
    let local = client(&n, SameHost::Auto).await;
    assert!(local.is_local());
    for c in [&remote, &local] {
        for chunk in refs.chunks(8) {
            let mut bufs: Vec<Vec<u8>> = chunk.iter().map(|_| vec![0u8; LEN]).collect();
            let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let got = c.batch_get_into(chunk, &mut dsts).await.unwrap();
            for (k, (len, buf)) in chunk.iter().zip(got.iter().zip(&bufs)) {
                let i: u64 = std::str::from_utf8(&k[11..]).unwrap().parse().unwrap();
                assert_eq!(*len, Some(LEN), "key {i}");
                assert_eq!(buf, &value(i, 0), "key {i}");
            }
        }
    }
    let after = remote.disk_stats().await.unwrap().unwrap();
    assert!(after.promoted >= N - 16, "{after:?}");
    assert!(after.hits >= after.promoted, "{after:?}");
    assert_eq!(after.checksum_failures, 0);
    // Values DRAM took back unchanged are not written again when evicted again.
    demoted(&n);
    assert!(remote.disk_stats().await.unwrap().unwrap().already_on_disk > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_or_rewritten_key_never_comes_back_from_disk() {
    let dir = temp("disk-forget");
    let mut n = start(&dir, &[]);
    let c = client(&n, SameHost::Off).await;
    for i in 0..40 {
        c.put(&key(i), &value(i, 0)).await.unwrap();
    }
    demoted(&n);
    // Keys 0 and 1 left DRAM first: on disk only.
    assert!(c.remove(&key(0)).await.unwrap(), "a key on disk is removed");
    assert!(!c.exists(&key(0)).await.unwrap());
    assert_eq!(c.get(&key(0)).await.unwrap(), None);
    c.put(&key(1), &value(1, 1)).await.unwrap();
    assert_eq!(c.get(&key(1)).await.unwrap(), Some(value(1, 1)));
    // Push the new value out too, so only the disk can answer for it.
    for i in 100..140 {
        c.put(&key(i), &value(i, 0)).await.unwrap();
    }
    demoted(&n);
    assert_eq!(c.get(&key(1)).await.unwrap(), Some(value(1, 1)));
    drop(c);
    assert!(n.stop().success());

    let addrs = [n.tcp.clone(), n.quic.clone(), n.metrics.clone()];
    let args = disk_args(&dir.join("disk"));
    let n2 = Node::start_in(
        n.dir.clone(),
        "16MiB",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()],
    );
    let c = client(&n2, SameHost::Off).await;
    assert_eq!(c.get(&key(0)).await.unwrap(), None, "removed stays removed");
    assert_eq!(c.get(&key(1)).await.unwrap(), Some(value(1, 1)));
    for i in 2..40 {
        let got = c.get(&key(i)).await.unwrap();
        assert_eq!(got.as_deref(), Some(&value(i, 0)[..]), "key {i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_disk_copies_are_never_served_to_another() {
    let dir = temp("disk-tenants");
    let config = "[[namespace]]\nname = \"a\"\ntokens = [\"token-a\"]\nquota = \"4MiB\"\n\n\
                  [[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\nquota = \"4MiB\"\n";
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, config).unwrap();
    let n = start(&dir, &["--config", path.to_str().unwrap()]);
    let tenant = |token: &str, ns: &str| ClientConfig {
        token: token.into(),
        namespace: ns.into(),
        same_host: SameHost::Off,
        timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    };
    let a = Client::connect(&n.tcp_url(), tenant("token-a", "a"))
        .await
        .unwrap();
    let b = Client::connect(&n.tcp_url(), tenant("token-b", "b"))
        .await
        .unwrap();
    // Tenant A fills its quota several times over: most of its blocks go to disk.
    for i in 0..30 {
        a.put(&key(i), &value(i, 0)).await.unwrap();
    }
    b.put(&key(29), &value(29, 9)).await.unwrap();
    demoted(&n);
    let keys: Vec<Vec<u8>> = (0..30).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    assert_eq!(b.batch_exists(&refs[..1]).await.unwrap(), 0);
    for i in 0..29 {
        assert_eq!(b.get(&key(i)).await.unwrap(), None, "key {i} is A's");
        assert!(!b.exists(&key(i)).await.unwrap());
        assert!(!b.remove(&key(i)).await.unwrap());
    }
    assert_eq!(b.get(&key(29)).await.unwrap(), Some(value(29, 9)));
    // B's removals touched nothing of A's.
    for i in 0..30 {
        let got = a.get(&key(i)).await.unwrap();
        assert_eq!(got.as_deref(), Some(&value(i, 0)[..]), "key {i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_while_demoting_loses_at_most_what_was_being_written() {
    let dir = temp("disk-kill");
    let mut n = start(&dir, &[]);
    let c = client(&n, SameHost::Off).await;
    for i in 0..60 {
        c.put(&key(i), &value(i, 0)).await.unwrap();
    }
    // Killed with demotions in flight (or just landed).
    n.kill();
    drop(c);
    let addrs = [n.tcp.clone(), n.quic.clone(), n.metrics.clone()];
    let args = disk_args(&dir.join("disk"));
    let n2 = Node::start_in(
        n.dir.clone(),
        "16MiB",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()],
    );
    let c = client(&n2, SameHost::Off).await;
    let mut found = 0;
    for i in 0..60 {
        // A miss is allowed; wrong bytes never.
        if let Some(got) = c.get(&key(i)).await.unwrap() {
            assert_eq!(got, value(i, 0), "key {i}");
            found += 1;
        }
    }
    assert!(found >= 16, "found {found}");
    let s = c.disk_stats().await.unwrap().unwrap();
    assert_eq!(s.checksum_failures, 0, "{s:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
