//! A same-host client remembers where it found objects and reads them again straight from the
//! mapping, without a lookup round trip (`ClientConfig::local_index`). Real daemon, real
//! clients: whatever other clients do to a key in between (overwrite it, overwrite it while a
//! third process holds the old value in place, remove it, or push it out and reuse its memory),
//! a get returns the key's current value or a miss, never the old bytes or another key's.
#![cfg(not(loom))]

mod common;

use common::{value, Node};
use kvpool_client::{Client, ClientConfig};

/// Values above the client's same-host put threshold (16 KiB), so puts are remembered too.
const LEN: usize = 40_000;

async fn client(n: &Node) -> Client {
    let c = Client::connect(&n.tcp_url(), ClientConfig::default())
        .await
        .unwrap();
    assert!(c.is_local(), "the node runs on this host");
    c
}

async fn get_all(c: &Client, keys: &[&[u8]]) -> Vec<Option<Vec<u8>>> {
    let mut bufs = vec![vec![0u8; LEN]; keys.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = c.batch_get_into(keys, &mut dsts).await.unwrap();
    got.into_iter()
        .zip(bufs)
        .map(|(g, mut b)| {
            g.map(|n| {
                b.truncate(n);
                b
            })
        })
        .collect()
}

/// A client of `n` that has put `keys` (the value of `key[i]` is `value(seed + i)`) and read
/// them all back three times, so its index knows every one.
async fn remembering(n: &Node, keys: &[&[u8]], seed: u64) -> Client {
    let a = client(n).await;
    for (i, k) in keys.iter().enumerate() {
        a.put(k, &value(seed + i as u64, LEN)).await.unwrap();
    }
    for _ in 0..3 {
        assert!(get_all(&a, keys).await.iter().all(Option::is_some));
    }
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_key_reads_its_current_value_whatever_other_clients_did() {
    let n = Node::start("64MiB", &[]);
    let (a, b, holder) = (client(&n).await, client(&n).await, client(&n).await);
    let keys: [&[u8]; 4] = [b"k0", b"k1", b"k2", b"k3"];

    // A writes and reads (both remember); B overwrites: A reads B's values.
    for (i, k) in keys.iter().enumerate() {
        a.put(k, &value(i as u64, LEN)).await.unwrap();
    }
    let first = get_all(&a, &keys).await;
    for (i, g) in first.iter().enumerate() {
        assert_eq!(g.as_deref(), Some(&value(i as u64, LEN)[..]));
    }
    for (i, k) in keys.iter().enumerate() {
        b.put(k, &value(100 + i as u64, LEN)).await.unwrap();
    }
    for (i, g) in get_all(&a, &keys).await.iter().enumerate() {
        assert_eq!(
            g.as_deref(),
            Some(&value(100 + i as u64, LEN)[..]),
            "key {i} after another client's overwrite"
        );
    }
    assert_eq!(a.get(keys[0]).await.unwrap(), Some(value(100, LEN)));

    // A third client holds the values in place; B overwrites again. The old objects' memory
    // stays (the holder reads it), but they are no longer the keys' values: A must not read them.
    let (hold, held) = holder.hold_local(&keys, 0).await.unwrap();
    let held: Vec<_> = held.into_iter().map(|l| l.expect("held")).collect();
    for (i, k) in keys.iter().enumerate() {
        b.put(k, &value(200 + i as u64, LEN)).await.unwrap();
    }
    for (i, g) in get_all(&a, &keys).await.iter().enumerate() {
        assert_eq!(
            g.as_deref(),
            Some(&value(200 + i as u64, LEN)[..]),
            "key {i} overwritten while its old value was held"
        );
    }
    assert_eq!(a.get(keys[1]).await.unwrap(), Some(value(201, LEN)));
    // ... while the holder still reads the old bytes where they lie.
    let mut buf = vec![0u8; LEN];
    assert!(holder
        .read_local(&held[2].addr, 0, &mut buf)
        .expect("mapped")
        .is_ok());
    assert_eq!(buf, value(102, LEN));
    drop(hold);

    // B removes two keys: A misses them and still reads the others.
    assert!(b.remove(keys[0]).await.unwrap());
    assert!(b.remove(keys[3]).await.unwrap());
    let got = get_all(&a, &keys).await;
    assert_eq!(got[0], None);
    assert_eq!(got[1].as_deref(), Some(&value(201, LEN)[..]));
    assert_eq!(got[2].as_deref(), Some(&value(202, LEN)[..]));
    assert_eq!(got[3], None);
    assert_eq!(a.get(keys[0]).await.unwrap(), None);

    // A prefix load stops at the first key that is gone, remembered or not.
    let mut bufs = vec![vec![0u8; LEN]; 4];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let order: [&[u8]; 4] = [keys[1], keys[2], keys[3], keys[0]];
    let prefix = kvpool_client::Prefix::Keys(&order);
    assert_eq!(a.load_prefix(prefix, &mut dsts).await.unwrap(), 2);

    // Another client removes a key in the middle of a run A remembers whole: A loads the
    // blocks before it, and the buffers after it keep what they held.
    let run: Vec<Vec<u8>> = (0..6).map(|i| format!("run-{i}").into_bytes()).collect();
    let run: Vec<&[u8]> = run.iter().map(|k| &k[..]).collect();
    for (i, k) in run.iter().enumerate() {
        a.put(k, &value(300 + i as u64, LEN)).await.unwrap();
    }
    assert!(get_all(&a, &run).await.iter().all(Option::is_some));
    assert!(b.remove(run[2]).await.unwrap());
    let mut bufs = vec![vec![0xAAu8; LEN]; 6];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let loaded = a
        .load_prefix(kvpool_client::Prefix::Keys(&run), &mut dsts)
        .await
        .unwrap();
    assert_eq!(loaded, 2);
    assert_eq!(bufs[0], value(300, LEN));
    assert_eq!(bufs[1], value(301, LEN));
    for (i, b) in bufs.iter().enumerate().skip(2) {
        assert!(
            b.iter().all(|&x| x == 0xAA),
            "buffer {i} after the gap written"
        );
    }
}

/// Keys remembered by one client are pushed out and their memory reused by another client's
/// writes; every read of them afterwards is the key's own value or a miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_keys_whose_memory_was_reused_are_misses_never_other_bytes() {
    let n = Node::start("16MiB", &[]);
    let (a, b) = (client(&n).await, client(&n).await);
    let key = |i: u64| format!("reuse-{i}").into_bytes();
    let val = |i: u64| value(1_000 + i, LEN);
    for round in 0..3u64 {
        let keys: Vec<Vec<u8>> = (0..64).map(|i| key(round * 1_000 + i)).collect();
        for (i, k) in keys.iter().enumerate() {
            a.put(k, &val(round * 1_000 + i as u64)).await.unwrap();
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let before = get_all(&a, &refs).await;
        assert!(before.iter().any(Option::is_some));
        // Far more than the pool holds: A's keys are evicted and their blocks reused.
        for j in 0..1_200u64 {
            let k = format!("filler-{round}-{j}");
            b.put(k.as_bytes(), &value(50_000 + j, LEN)).await.unwrap();
        }
        for (i, g) in get_all(&a, &refs).await.iter().enumerate() {
            if let Some(g) = g {
                assert_eq!(
                    g,
                    &val(round * 1_000 + i as u64),
                    "key {i} of round {round}"
                );
            }
        }
        for (i, k) in refs.iter().enumerate() {
            if let Some(g) = a.get(k).await.unwrap() {
                assert_eq!(g, val(round * 1_000 + i as u64));
            }
        }
    }
}

/// A client's index must not outlive its daemon: once the daemon is killed (its memory still
/// mapped by the client, its last values still there), reads of remembered keys stop being
/// served from the mapping within moments, and never are again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_daemons_memory_is_not_served_from_the_index() {
    let mut n = Node::start("64MiB", &[]);
    let keys: [&[u8]; 2] = [b"d0", b"d1"];
    let a = remembering(&n, &keys, 400).await;
    n.kill();
    let served =
        |got: &Result<Vec<Option<usize>>, _>| matches!(got, Ok(v) if v.iter().any(Option::is_some));
    let mut bufs = vec![vec![0u8; LEN]; 2];
    let start = std::time::Instant::now();
    loop {
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        if !served(&a.batch_get_into(&keys, &mut dsts).await) {
            break;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "a dead daemon's values still served from the client's index"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    for _ in 0..50 {
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        assert!(
            !served(&a.batch_get_into(&keys, &mut dsts).await),
            "served again after the daemon's death"
        );
        assert!(a.get(keys[0]).await.map_or(true, |v| v.is_none()));
    }
}

/// Once a call of the client's own has found the daemon gone, the very next read is not served
/// from the index: the watch of the daemon's life may not have run yet on a busy machine, but
/// the failed call ends it before it returns. (The Python client's restart test reads right
/// after a failed write, and was served the dead daemon's value when the watch ran late.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_finds_the_daemon_gone_closes_the_index_before_it_returns() {
    let mut n = Node::start("64MiB", &[]);
    let keys: [&[u8]; 2] = [b"g0", b"g1"];
    let a = remembering(&n, &keys, 500).await;
    n.kill();
    a.put(b"g2", &value(502, LEN))
        .await
        .expect_err("a put to a killed daemon fails");
    let mut bufs = vec![vec![0u8; LEN]; 2];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = a.batch_get_into(&keys, &mut dsts).await;
    assert!(
        !matches!(&got, Ok(v) if v.iter().any(Option::is_some)),
        "served from the index after a call found the daemon gone: {got:?}"
    );
}

/// Reads served from the index are reported to the node in batches, in the background: its hit
/// counter (and eviction policy) sees them, and the reads never wait for the report. Reads go
/// on until two batches' worth have been counted (a report still on its way when the reads
/// stopped would otherwise wait for a next read), and the node never counts more reads than
/// were made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_served_from_the_index_reach_the_nodes_hit_counter() {
    let n = Node::start("64MiB", &[]);
    let c = client(&n).await;
    let keys: Vec<Vec<u8>> = (0..8u64).map(|i| format!("r{i}").into_bytes()).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    for (i, k) in refs.iter().enumerate() {
        c.put(k, &value(i as u64, LEN)).await.unwrap();
    }
    // The first read remembers every key (one lookup: the node counts it).
    get_all(&c, &refs).await;
    let before = c.stats().await.unwrap().hits;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut reads = 0u64;
    loop {
        for (i, g) in get_all(&c, &refs).await.iter().enumerate() {
            assert_eq!(g.as_deref(), Some(&value(i as u64, LEN)[..]));
        }
        reads += refs.len() as u64;
        let counted = c.stats().await.unwrap().hits - before;
        assert!(
            counted <= reads,
            "the node counted {counted} reads of {reads} made"
        );
        if counted >= 512 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "after {reads} reads served from the index the node had counted {counted}"
        );
    }
}
