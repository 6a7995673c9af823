//! Handoffs end to end (docs/HANDOFF.md): a consumer waits for keys a producer
//! writes, against real `kvpoold` processes over real sockets: woken by the writes, woken at
//! once by a producer's tombstone with its reason, timing out with the missing keys when the
//! producer dies silently, ten thousand waits at once, a prefix subscription, a wait across a
//! three-node cluster while a node drains, one `cancel` freeing a request on both sides, and the
//! `kvpool wait` / `kvpool fail` / `kvpool cancel` commands.
//! Every wait is bounded; nothing asserts on elapsed time.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{cfg, drain, serving, start_node, wait_view};
use common::Node;
use kvpool::placement::NodeState;
use kvpool_client::{Client, KeyEvent, SameHost};

async fn connect(n: &Node) -> Client {
    Client::connect(&n.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap()
}

fn keys(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}/block-{i:05}").into_bytes())
        .collect()
}

fn refs(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(|k| &k[..]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_wakes_when_its_producer_writes_and_a_tombstone_wakes_it_at_once() {
    let node = Node::start("64MiB", &[]);
    let producer = connect(&node).await;
    let consumer = connect(&node).await;

    // Written before the wait: it returns at once.
    let early = keys("req-early", 3);
    for k in &early {
        producer.put(k, b"kv").await.unwrap();
    }
    let got = consumer
        .wait(&refs(&early), Duration::from_secs(30))
        .await
        .unwrap();
    assert!(got.complete(), "{got:?}");

    // Written while the consumer waits.
    let ks = keys("req-1", 8);
    let waiting = {
        let (c, ks) = (consumer.clone(), ks.clone());
        tokio::spawn(async move { c.wait(&refs(&ks), Duration::from_secs(60)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (i, k) in ks.iter().enumerate() {
        producer
            .put(k, &common::value(i as u64, 4096))
            .await
            .unwrap();
    }
    let got = waiting.await.unwrap().unwrap();
    assert!(got.complete(), "{got:?}");
    for (i, k) in ks.iter().enumerate() {
        assert_eq!(
            consumer.get(k).await.unwrap().unwrap(),
            common::value(i as u64, 4096)
        );
    }

    // The producer writes half and fails the rest: the wait ends with the reason, long before
    // its 60 s timeout (had it timed out, the failed keys would be reported missing).
    let ks = keys("req-2", 6);
    let waiting = {
        let (c, ks) = (consumer.clone(), ks.clone());
        tokio::spawn(async move { c.wait(&refs(&ks), Duration::from_secs(60)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    for k in &ks[..3] {
        producer.put(k, b"kv").await.unwrap();
    }
    assert_eq!(
        producer
            .fail(&refs(&ks[3..]), "prefill worker 3 lost its GPU")
            .await
            .unwrap(),
        3
    );
    let got = waiting.await.unwrap().unwrap();
    assert!(got.missing.is_empty(), "{got:?}");
    let mut failed: Vec<_> = got.failed.iter().map(|(k, _)| k.clone()).collect();
    failed.sort();
    assert_eq!(failed, ks[3..].to_vec());
    assert!(got
        .failed
        .iter()
        .all(|(_, r)| r == "prefill worker 3 lost its GPU"));

    // A wait that starts after the tombstone finds it (the reason comes with it).
    let got = consumer
        .wait(&refs(&ks[3..]), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(got.failed.len(), 3, "{got:?}");
    assert!(got.failed.iter().all(|(_, r)| r.contains("GPU")));
    // A retry that writes the key ends its tombstone.
    producer.put(&ks[3], b"retried").await.unwrap();
    let got = consumer
        .wait(&refs(&ks[3..4]), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(got.complete(), "{got:?}");

    // A producer that dies without a word: the wait times out with exactly what is missing.
    let ks = keys("req-3", 4);
    producer.put(&ks[0], b"kv").await.unwrap();
    let got = consumer
        .wait(&refs(&ks), Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(got.missing, ks[1..].to_vec());
    assert!(got.failed.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_waits_at_once_all_end_when_their_keys_come() {
    let node = Node::start("256MiB", &[]);
    let producer = connect(&node).await;
    let consumer = connect(&node).await;
    let ks = keys("many", 10_000);
    let mut tasks = Vec::new();
    for k in &ks {
        let (c, k) = (consumer.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            c.wait(&[&k], Duration::from_secs(120)).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for part in ks.chunks(500) {
        let items: Vec<(&[u8], &[u8])> = part.iter().map(|k| (&k[..], &b"v"[..])).collect();
        let codes = producer.batch_put_from(&items).await.unwrap();
        assert!(codes.iter().all(|c| *c == kvpool_client::ErrorCode::Ok));
    }
    let mut complete = 0;
    for t in tasks {
        complete += t.await.unwrap().unwrap().complete() as usize;
    }
    assert_eq!(complete, ks.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_hears_every_key_under_its_prefix() {
    let node = Node::start("64MiB", &[]);
    let producer = connect(&node).await;
    let consumer = connect(&node).await;
    let mut sub = consumer.subscribe(b"req-9/").await.unwrap();
    producer.put(b"req-9/a", b"1").await.unwrap();
    producer.put(b"other/x", b"1").await.unwrap();
    producer.fail(&[b"req-9/b"], "aborted").await.unwrap();
    producer.put(b"req-9/c", b"1").await.unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        let ev = tokio::time::timeout(Duration::from_secs(20), sub.recv())
            .await
            .expect("an event within 20 s")
            .unwrap();
        got.push(ev);
    }
    assert_eq!(
        got,
        vec![
            KeyEvent::Written(b"req-9/a".to_vec()),
            KeyEvent::Failed(b"req-9/b".to_vec(), "aborted".into()),
            KeyEvent::Written(b"req-9/c".to_vec()),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_across_a_cluster_survives_a_node_draining() {
    let hb: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "2000"];
    let first = start_node(0, "64MiB", None, hb);
    let mut nodes = vec![first];
    for id in 1..3 {
        let n = start_node(id, "64MiB", Some(&nodes[0]), hb);
        nodes.push(n);
    }
    let consumer = connect(&nodes[0]).await;
    wait_view(&consumer, "three serving", |v| serving(v) == 3).await;
    let producer = connect(&nodes[2]).await;
    wait_view(&producer, "three serving", |v| serving(v) == 3).await;
    let ks = keys("spread", 200);
    let waiting = {
        let (c, ks) = (consumer.clone(), ks.clone());
        tokio::spawn(async move { c.wait(&refs(&ks), Duration::from_secs(90)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Half before node 1 drains, half after (those go to the keys' new owners).
    for k in &ks[..100] {
        producer.put(k, b"kv").await.unwrap();
    }
    drain(&mut nodes, 1).await;
    wait_view(&producer, "node 1 down", |v| {
        v.node(kvpool::NodeId(1))
            .is_some_and(|n| n.state == NodeState::Down)
    })
    .await;
    for k in &ks[100..] {
        producer.put(k, b"kv").await.unwrap();
    }
    let got = waiting.await.unwrap().unwrap();
    assert!(
        got.complete(),
        "missing {} failed {}",
        got.missing.len(),
        got.failed.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_waits_and_fails() {
    let node = Node::start("64MiB", &[]);
    let c = connect(&node).await;
    c.put(b"cli/a", b"1").await.unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(common::bin("kvpool"))
            .args(["-e", &node.tcp_url()])
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["wait", "cli/a", "--wait-ms", "10000"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = run(&["wait", "cli/a", "cli/b", "--wait-ms", "200"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("cli/b missing"),
        "{out:?}"
    );
    let out = run(&["fail", "cli/b", "--reason", "no decode slot"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = run(&["wait", "cli/a", "cli/b", "--wait-ms", "10000"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("cli/b failed: no decode slot"),
        "{out:?}"
    );
    // `cancel` removes what was written and fails it too.
    let out = run(&["cancel", "cli/a", "--reason", "request aborted"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1", "{out:?}");
    assert!(!c.exists(b"cli/a").await.unwrap());
    let out = run(&["wait", "cli/a", "--wait-ms", "10000"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("cli/a failed: request aborted"),
        "{out:?}"
    );
}

/// Polls (at most 20 s) until `key` is absent.
async fn until_gone(c: &Client, key: &[u8]) {
    let t = Instant::now();
    while c.exists(key).await.unwrap() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{key:?} never lapsed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_frees_its_blocks_and_a_renewed_or_ended_one_keeps_them() {
    let node = Node::start("64MiB", &[]);
    let c = connect(&node).await;
    for k in ["lease/a", "lease/b", "lease/c", "lease/d"] {
        c.put(k.as_bytes(), &common::value(1, 64 << 10))
            .await
            .unwrap();
    }
    let short = Duration::from_millis(300);
    let n = c
        .expire(
            &[
                b"lease/a",
                b"lease/b",
                b"lease/c",
                b"lease/d",
                b"lease/absent",
            ],
            short,
        )
        .await
        .unwrap();
    assert_eq!(n, 4, "the absent key is not counted");
    assert_eq!(
        c.expire(&[b"lease/b"], Duration::from_secs(600))
            .await
            .unwrap(),
        1
    );
    assert_eq!(c.expire(&[b"lease/c"], Duration::ZERO).await.unwrap(), 1);
    // A key leased before it is written goes too.
    assert_eq!(c.expire(&[b"lease/e"], short).await.unwrap(), 0);
    c.put(b"lease/e", b"written under the lease").await.unwrap();
    until_gone(&c, b"lease/a").await;
    until_gone(&c, b"lease/d").await;
    until_gone(&c, b"lease/e").await;
    // Past their lapse: b renewed, c's lease ended.
    assert!(c.exists(b"lease/b").await.unwrap());
    assert!(c.exists(b"lease/c").await.unwrap());
    let out = std::process::Command::new(common::bin("kvpool"))
        .args([
            "-e",
            &node.tcp_url(),
            "expire",
            "lease/b",
            "--ttl-ms",
            "100",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "1\n", "{out:?}");
    until_gone(&c, b"lease/b").await;
}

/// What happens to handoff `i` (deterministic, varied): 1 its producer gives up and fails the
/// rest, 2 its producer dies midway, 3 its consumer dies while waiting, 4 its consumer dies
/// after reading without releasing; otherwise all goes well.
fn fate(i: u64) -> u64 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % 10
}

/// Bytes the `default` namespace takes on `c`'s node.
async fn used(c: &Client) -> u64 {
    let s = c.stats().await.unwrap();
    s.namespaces
        .iter()
        .find(|n| n.name == "default")
        .map_or(0, |n| n.used_bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_handoffs_with_producers_and_consumers_dying_leave_nothing_held() {
    // Each handoff: a producer writes 4 blocks under a LEASE_S lease (some producers die midway,
    // some fail their blocks), a consumer waits for them (some consumers die while waiting or
    // after reading, without releasing) and releases what it read. Deaths are tasks aborted
    // mid-call: their connections drop, as a killed process's do. At the end every wait has
    // answered, and once the leases have lapsed the pool holds nothing.
    let node = Node::start("256MiB", &[]);
    let c = connect(&node).await;
    const HANDOFFS: u64 = 10_000;
    const AT_ONCE: usize = 200;
    // Long enough that a consumer reads what its wait found before the lease lapses, however
    // busy the machine (at 1 s, a loaded 2-core machine let leases lapse between a complete
    // wait and the reads); short enough that the end of the test waits for it.
    const LEASE_S: u64 = 5;
    let block = common::value(7, 4096);
    let mut answered = 0u64;
    let mut outcomes = [0u64; 3]; // complete, failed, missing
    let mut next = 0u64;
    let mut running = tokio::task::JoinSet::new();
    while next < HANDOFFS || !running.is_empty() {
        while next < HANDOFFS && running.len() < AT_ONCE {
            let (c, block, i) = (c.clone(), block.clone(), next);
            next += 1;
            running.spawn(async move {
                let keys: Vec<Vec<u8>> =
                    (0..4).map(|b| format!("h{i}/b{b}").into_bytes()).collect();
                let rk = refs(&keys);
                let fate = fate(i);
                let producer = {
                    let (c, keys, block) = (c.clone(), keys.clone(), block.clone());
                    tokio::spawn(async move {
                        // Leased before anything is written: a death at any point below
                        // leaves nothing behind.
                        let rk: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                        c.expire(&rk, Duration::from_secs(LEASE_S)).await.unwrap();
                        for (n, k) in keys.iter().enumerate() {
                            if fate == 1 && n == 2 {
                                // Gives up: fails what it will not write.
                                let rest: Vec<&[u8]> = keys[2..].iter().map(|k| &k[..]).collect();
                                let _ = c.fail(&rest, "producer gave up").await;
                                return;
                            }
                            c.put(k, &block).await.unwrap();
                        }
                    })
                };
                if fate == 2 {
                    // The producer dies midway (its last calls may or may not have landed).
                    tokio::task::yield_now().await;
                    producer.abort();
                }
                let wait = c.wait(&rk, Duration::from_millis(1500));
                let got = if fate == 3 {
                    // The consumer dies while waiting.
                    let _ = tokio::time::timeout(Duration::from_millis(5), wait).await;
                    None
                } else {
                    // Every wait answers by its deadline (plus a generous margin for a busy
                    // machine): a hang fails the test instead of stalling it.
                    let got = tokio::time::timeout(Duration::from_secs(30), wait)
                        .await
                        .expect("a wait answered")
                        .unwrap();
                    Some(got)
                };
                let _ = producer.await;
                let got = got?;
                if got.complete() && fate != 4 {
                    // Read and released; a fate-4 consumer dies before releasing.
                    for k in &keys {
                        assert_eq!(c.get(k).await.unwrap().as_deref(), Some(&block[..]));
                    }
                    c.batch_remove(&rk).await.unwrap();
                }
                Some(if got.complete() {
                    0
                } else if !got.failed.is_empty() {
                    1
                } else {
                    2
                })
            });
        }
        if let Some(done) = running.join_next().await {
            if let Some(o) = done.unwrap() {
                answered += 1;
                outcomes[o] += 1;
            }
        }
    }
    let surviving = (0..HANDOFFS).filter(|&i| fate(i) != 3).count() as u64;
    assert_eq!(
        answered, surviving,
        "every surviving consumer got an answer"
    );
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
    // Leases lapse LEASE_S after the last block was written: nothing may stay held.
    let t = Instant::now();
    while used(&c).await > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} bytes still held",
            used(&c).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_sided_form_consumer_reserves_producer_writes_and_commits() {
    // NIXL's and Mooncake's transfer-engine shape: the consumer reserves a region for the
    // handoff's key and hands its address (bytes) to the producer, which writes into it
    // directly and commits: that commit is the completion the consumer's wait returns on.
    let node = Node::start("64MiB", &[]);
    let consumer = connect(&node).await;
    let producer = Client::connect(&node.tcp_url(), cfg(SameHost::Auto))
        .await
        .unwrap();
    let block = common::value(3, 1 << 20);
    let token = consumer
        .alloc(b"req-8/kv", block.len() as u64)
        .await
        .unwrap()
        .to_bytes();
    let waiting = {
        let c = consumer.clone();
        tokio::spawn(async move { c.wait(&[b"req-8/kv"], Duration::from_secs(60)).await })
    };
    let addr = kvpool::GlobalAddr::from_bytes(&token).unwrap();
    producer.write(&addr, 0, &block[..4096]).await.unwrap();
    producer.write(&addr, 4096, &block[4096..]).await.unwrap();
    producer
        .commit(&addr, kvpool::checksum(&block))
        .await
        .unwrap();
    assert!(waiting.await.unwrap().unwrap().complete());
    assert_eq!(consumer.get(b"req-8/kv").await.unwrap().unwrap(), block);
    // A forged address (another memory key) is refused by the node. (A same-host producer
    // writes straight into the mapping, which the node's segment files give to every process
    // of its user: SECURITY.md, "Same host"; the memory key is checked where the node sees
    // the write.)
    let fresh = consumer.alloc(b"req-8/next", 4096).await.unwrap();
    let forged = kvpool::GlobalAddr {
        key: fresh.key ^ 1,
        ..fresh
    };
    let remote = connect(&node).await;
    assert!(remote.write(&forged, 0, b"x").await.is_err());
    assert!(remote
        .commit(&forged, kvpool::checksum(b"x"))
        .await
        .is_err());
}

/// An aborted request frees its blocks on both sides, in one call: a consumer's
/// reservation, a producer's written block and its allocation still being written all go with
/// one `cancel`, every waiter hears the reason at once, the pool holds what it held before,
/// and a late commit of either allocation fails with `Failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_cancel_frees_a_request_on_both_sides_and_wakes_its_waiters() {
    use kvpool::protocol::ErrorCode;
    let node = Node::start("64MiB", &[]);
    let producer = connect(&node).await;
    let consumer = connect(&node).await;
    let (k1, k2, k3): (&[u8], &[u8], &[u8]) = (b"req-c/k1", b"req-c/k2", b"req-c/k3");
    let mut sub = consumer.subscribe(b"req-c/").await.unwrap();
    let before = used(&producer).await;

    // The consumer reserves K1's region; the producer leases and writes K2 and is midway
    // through writing K3 into its own allocation.
    let reserved = consumer.alloc(k1, 64 << 10).await.unwrap();
    let block = common::value(2, 64 << 10);
    producer
        .expire(&[k2], Duration::from_millis(300))
        .await
        .unwrap();
    producer.put(k2, &block).await.unwrap();
    let in_flight = producer.alloc(k3, 64 << 10).await.unwrap();
    producer.write(&in_flight, 0, &block[..4096]).await.unwrap();
    assert!(used(&producer).await >= before + 3 * (64 << 10));
    let waiting = {
        let c = consumer.clone();
        tokio::spawn(async move { c.wait(&[k1, k3], Duration::from_secs(60)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;

    let freed = producer.cancel(&[k1, k2, k3], "decode gone").await.unwrap();
    assert_eq!(freed, 3, "one reservation, one object, one allocation");
    let mut got = waiting.await.unwrap().unwrap();
    let reason = |k: &[u8]| (k.to_vec(), "decode gone".to_string());
    assert!(got.missing.is_empty(), "woken by the cancel: {got:?}");
    got.failed.sort();
    assert_eq!(got.failed, vec![reason(k1), reason(k3)]);
    // A wait that comes later finds all three failed, K2 included.
    let mut got = consumer
        .wait(&[k1, k2, k3], Duration::from_secs(10))
        .await
        .unwrap();
    got.failed.sort();
    assert_eq!(got.failed, vec![reason(k1), reason(k2), reason(k3)]);
    // The subscription hears K2 written, then each key failed (a key's tombstone found by a
    // later wait on the same connection may be heard twice).
    let failed = |k: &[u8]| KeyEvent::Failed(k.to_vec(), "decode gone".into());
    let mut heard = Vec::new();
    while ![k1, k2, k3].iter().all(|k| heard.contains(&failed(k))) {
        let ev = tokio::time::timeout(Duration::from_secs(20), sub.recv())
            .await
            .unwrap_or_else(|_| panic!("no event within 20 s after {heard:?}"))
            .unwrap();
        heard.push(ev);
    }
    assert_eq!(heard[0], KeyEvent::Written(k2.to_vec()), "{heard:?}");

    assert_eq!(used(&producer).await, before, "every byte is back");
    assert_eq!(consumer.get(k2).await.unwrap(), None);
    for addr in [&reserved, &in_flight] {
        let e = producer
            .commit(addr, kvpool::checksum(&block))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::Failed), "{e}");
        let e = producer.write(addr, 0, b"late").await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::Failed), "{e}");
    }
    assert_eq!(producer.cancel(&[k1, k2, k3], "again").await.unwrap(), 0);

    // A retry of the request is a new one: written, and kept (K2's lease went with the cancel).
    producer.put(k2, &block).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(consumer.get(k2).await.unwrap(), Some(block.clone()));
    let got = consumer.wait(&[k2], Duration::from_secs(10)).await.unwrap();
    assert!(got.complete(), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_handoff_and_hold_requests_get_clear_errors_and_the_node_keeps_serving() {
    use kvpool::protocol::{ErrorCode, Op, Reply};
    let node = Node::start("64MiB", &[]);
    let mut s = tokio::net::TcpStream::connect(&node.tcp).await.unwrap();
    common::raw::hello(&mut s, "handoff-bad-input").await;
    let code = |r: Option<kvpool::protocol::Response>| match r.map(|r| r.reply) {
        Some(Reply::Error { code, .. }) => ErrorCode::from_u16(code),
        other => panic!("expected an error, got {other:?}"),
    };
    let cases: Vec<(Op, ErrorCode)> = vec![
        (
            Op::Watch {
                ns: 999,
                keys: vec![b"k".to_vec()],
            },
            ErrorCode::UnknownNamespace,
        ),
        (
            Op::Subscribe {
                ns: 0,
                prefix: vec![b'p'; 257],
            },
            ErrorCode::BadKey,
        ),
        (
            Op::Fail {
                ns: 0,
                keys: vec![Vec::new()],
                reason: "empty key".into(),
            },
            ErrorCode::BadKey,
        ),
        (
            Op::Watch {
                ns: 0,
                keys: vec![b"k".to_vec(); 20_000],
            },
            ErrorCode::BatchTooLarge,
        ),
        (
            Op::Expire {
                ns: 999,
                keys: vec![b"k".to_vec()],
                ttl_ms: 10,
            },
            ErrorCode::UnknownNamespace,
        ),
        (
            Op::Cancel {
                ns: 999,
                keys: vec![b"k".to_vec()],
                reason: "gone".into(),
            },
            ErrorCode::UnknownNamespace,
        ),
        (
            Op::Cancel {
                ns: 0,
                keys: vec![b"k".to_vec(); 20_000],
                reason: "gone".into(),
            },
            ErrorCode::BatchTooLarge,
        ),
        (
            Op::Cancel {
                ns: 0,
                keys: vec![b"k".to_vec()],
                reason: "x".repeat(1025),
            },
            ErrorCode::TooLarge,
        ),
        (
            Op::Cancel {
                ns: 0,
                keys: vec![b"k".to_vec(), Vec::new()],
                reason: "empty key".into(),
            },
            ErrorCode::BadKey,
        ),
        // Holds are only for a same-host reader, over the Unix socket.
        (
            Op::Hold {
                ns: 0,
                keys: vec![b"k".to_vec()],
            },
            ErrorCode::NotLocal,
        ),
    ];
    for (i, (op, want)) in cases.into_iter().enumerate() {
        let what = format!("{op:?}").chars().take(60).collect::<String>();
        common::raw::send(&mut s, i as u64 + 10, op, &[]).await;
        assert_eq!(code(common::raw::recv(&mut s).await), want, "{what}");
    }
    // The same connection, and the node, still serve.
    let c = connect(&node).await;
    c.put(b"after", b"ok").await.unwrap();
    let got = c.wait(&[b"after"], Duration::from_secs(10)).await.unwrap();
    assert!(got.complete());
    common::raw::send(
        &mut s,
        99,
        Op::Watch {
            ns: 0,
            keys: vec![b"after".to_vec()],
        },
        &[],
    )
    .await;
    match common::raw::recv(&mut s).await.map(|r| r.reply) {
        Some(Reply::Statuses(codes)) => assert_eq!(codes, vec![ErrorCode::Ok as u16]),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_reads_each_block_as_it_is_written() {
    let node = Node::start("128MiB", &[]);
    let producer = connect(&node).await;
    let consumer = connect(&node).await;
    let ks = keys("req-stream", 12);
    let block = |i: usize| common::value(i as u64, 256 << 10);
    // Two blocks are there before the wait; the producer writes eight more one by one while
    // the consumer reads, gives up on one, and never writes the last.
    for (i, k) in ks.iter().enumerate().take(2) {
        producer.put(k, &block(i)).await.unwrap();
    }
    let writer = {
        let (p, ks) = (producer.clone(), ks.clone());
        tokio::spawn(async move {
            for (i, k) in ks.iter().enumerate().take(10).skip(2) {
                tokio::time::sleep(Duration::from_millis(20)).await;
                p.put(k, &block(i)).await.unwrap();
            }
            p.fail(&[&ks[10][..]], "prefill gave up").await.unwrap();
        })
    };
    let mut bufs: Vec<Vec<u8>> = (0..12).map(|_| vec![0u8; 256 << 10]).collect();
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let (outcome, got) = consumer
        .wait_get_into(&refs(&ks), &mut dsts, Duration::from_secs(3))
        .await
        .unwrap();
    writer.await.unwrap();
    assert_eq!(outcome.missing, vec![ks[11].clone()]);
    assert_eq!(
        outcome.failed,
        vec![(ks[10].clone(), "prefill gave up".to_string())]
    );
    for (i, buf) in bufs.iter().enumerate() {
        if i < 10 {
            assert_eq!(got[i], Some(256 << 10), "block {i}");
            assert!(buf[..] == block(i)[..], "block {i}'s bytes");
        } else {
            assert_eq!(got[i], None, "block {i}");
        }
    }
    // The keys are unwatched afterwards: a second consumer still works.
    let all: Vec<Vec<u8>> = ks[..10].to_vec();
    let again = consumer
        .wait(&refs(&all), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(again.complete());
}
