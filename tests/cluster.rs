//! Multi-node tests with real `kvpoold` processes on loopback: placement by weight, routing
//! from any node, a node killed with SIGKILL under load, a node joining, a node draining.
//! Static membership with fast heartbeats (100 ms, down after 600 ms). Every wait is bounded.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::{cfg, check, drain, fill, key, serving, wait_view};
use common::{temp_dir, value, Node};
use kvpool::placement::NodeState;
use kvpool_client::{Client, ErrorCode, SameHost};
use tokio::io::AsyncWriteExt;

const HEARTBEAT: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "600"];
/// For the tests of what a read may take from a key's previous owner: nodes that keep their
/// copies when the view changes instead of handing them over (tests/elastic.rs).
const NO_HANDOVER: &[&str] = &["--handover", "false"];

/// Starts node `id` with `memory`, joining through `seed` (none for the first node, which
/// generates the cluster secret the others are given).
fn start(id: u32, memory: &str, seed: Option<&Node>, extra: &[&str]) -> Node {
    common::cluster::start_node(id, memory, seed, &[HEARTBEAT, extra].concat())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_spread_keys_by_weight_and_serve_them_from_any_node() {
    let n0 = start(0, "64MiB", None, &[]);
    let n1 = start(1, "128MiB", Some(&n0), &[]);
    let n2 = start(2, "64MiB", Some(&n0), &[]);
    let c0 = Client::connect(&n0.tcp_url(), cfg(SameHost::Auto))
        .await
        .unwrap();
    wait_view(&c0, "3 serving", |v| serving(v) == 3).await;
    let c1 = Client::connect(&n1.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    let c2 = Client::connect(&n2.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    for c in [&c1, &c2] {
        wait_view(c, "3 serving", |v| serving(v) == 3).await;
    }
    let v = c0.view().await.unwrap();
    assert_eq!(v.stamp(), c1.view().await.unwrap().stamp(), "views agree");
    assert_eq!(v.version, c2.view().await.unwrap().version);

    assert_eq!(fill(&c0, 0..10_000).await, 10_000);
    // Shares follow capacity (1:2:1) within 15 % of each node's weight.
    let total: u64 = v.nodes.iter().map(|n| n.capacity).sum();
    for n in &v.nodes {
        let objects = c0.node_stats(n.id).await.unwrap().objects;
        let want = 10_000.0 * n.capacity as f64 / total as f64;
        let dev = (objects as f64 - want).abs() / want;
        println!("node {}: {objects} keys, weight share {want:.0}", n.id);
        assert!(
            dev < 0.15,
            "node {} holds {objects}, expected about {want:.0}",
            n.id
        );
    }
    // Every key is readable from a client of any node, over the mapping or TCP.
    for c in [&c0, &c1, &c2] {
        assert_eq!(check(c, 0..10_000).await, 10_000);
        assert_eq!(
            c.batch_exists(&[&key(1)[..], &key(2)[..], b"absent", &key(3)[..]])
                .await
                .unwrap(),
            2,
            "the leading run over the whole batch, across owners"
        );
    }
    // The CLI prints the same view, with every node's use.
    let out = std::process::Command::new(common::bin("kvpool"))
        .args(["cluster", "status", "--json", "-e", &n2.tcp_url()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let json = String::from_utf8(out.stdout).unwrap();
    assert!(
        json.contains(&format!(r#""version":{}"#, v.version)),
        "{json}"
    );
    assert_eq!(json.matches(r#""state":"serving""#).count(), 3, "{json}");
    let objects: u64 = json
        .split(r#""objects":"#)
        .skip(1)
        .map(|t| {
            t.split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert_eq!(objects, 10_000, "{json}");
    let table = std::process::Command::new(common::bin("kvpool"))
        .args(["cluster", "status", "-e", &n0.tcp_url()])
        .output()
        .unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(
        table.contains("serving") && table.lines().count() == 5,
        "{table}"
    );
    // A request routed by another view is refused, never served by the wrong owner.
    let stale = raw_get_with_view(&n1.tcp, v.stamp() ^ 1, &key(7)).await;
    assert_eq!(stale, ErrorCode::WrongView as u16);
    let right = raw_get_with_view(&n1.tcp, v.stamp(), &key(7)).await;
    assert!(
        right == 0 || right == ErrorCode::NotFound as u16,
        "a correctly routed request is served: {right}"
    );
}

/// Sends one `Get` routed by view stamp `view` over a fresh connection; returns 0 for a value
/// or the error code.
async fn raw_get_with_view(addr: &str, view: u64, key: &[u8]) -> u16 {
    let get = kvpool::protocol::Op::Get {
        ns: 0,
        key: key.to_vec(),
    };
    raw_with_view(addr, view, get).await
}

/// Sends `op` routed by view stamp `view` over a fresh connection; returns 0 for an answer
/// that is not an error, or the error code.
async fn raw_with_view(addr: &str, view: u64, op: kvpool::protocol::Op) -> u16 {
    use kvpool::protocol::io::{read_header, read_prefix, write_frame};
    use kvpool::protocol::{
        decode_response_owned, AlignedVec, ErrorCode, Exchange, Limits, Op, Reply, PROTOCOL_VERSION,
    };
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let ops = [
        Op::Hello {
            version: PROTOCOL_VERSION,
            token: String::new(),
            client: "test".into(),
        },
        op,
    ];
    let mut last = 0;
    for (id, op) in ops.into_iter().enumerate() {
        let mut exchange = Exchange::new();
        exchange.view = if id == 0 { 0 } else { view };
        let out = exchange.request_as(id as u64, op);
        write_frame(&mut s, &out.header, &[]).await.unwrap();
        s.flush().await.unwrap();
        let p = read_prefix(&mut s, &Limits::default())
            .await
            .unwrap()
            .unwrap();
        let mut h = AlignedVec::new();
        read_header(&mut s, &p, &mut h).await.unwrap();
        kvpool::protocol::io::discard(&mut s, p.payload_len)
            .await
            .unwrap();
        last = match decode_response_owned(&h).unwrap().reply {
            Reply::Error { code, .. } => code,
            Reply::Miss => ErrorCode::NotFound as u16,
            _ => 0,
        };
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_under_load_turns_its_keys_into_misses_never_errors() {
    let n0 = start(0, "64MiB", None, &[]);
    let n1 = start(1, "64MiB", Some(&n0), &[]);
    let mut n2 = start(2, "64MiB", Some(&n0), &[]);
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    assert_eq!(fill(&c, 0..3_000).await, 3_000);
    // Pinned objects live on two nodes (pinned_replicas defaults to 2).
    for i in 0..200u64 {
        c.put_pinned(
            format!("weights-{i}").as_bytes(),
            &value(1_000_000 + i, 4096),
        )
        .await
        .unwrap();
    }
    let on_n2 = c.node_stats(2).await.unwrap().objects;
    assert!(on_n2 > 500, "node 2 holds a share: {on_n2}");

    // Mixed load: reads of the preloaded keys (every byte checked), writes of new keys.
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let load = {
        let (c, stop, ops) = (c.clone(), stop.clone(), ops.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let k = i * 7 % 3_000;
                if let Some(v) = c.get(&key(k)).await.expect("reads never fail") {
                    assert_eq!(v, value(k, 256), "key {k}: wrong bytes");
                }
                let w = 100_000 + i;
                let r = c.put(&key(w), &value(w, 256)).await;
                if let Err(e) = r {
                    // A put may be refused while the node is unreachable; never anything else.
                    assert!(
                        matches!(
                            e.code(),
                            Some(ErrorCode::Unavailable) | Some(ErrorCode::WrongView)
                        ),
                        "put failed: {e}"
                    );
                }
                ops.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            i
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before_kill = ops.load(Ordering::Relaxed);
    let mut child = n2.child.take().unwrap();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let killed = Instant::now();
    let took = wait_view(&c, "node 2 down", |v| {
        v.node(kvpool::NodeId(2))
            .is_some_and(|n| n.state == NodeState::Down)
    })
    .await;
    println!(
        "node 2 marked down {:?} after SIGKILL (heartbeat 100 ms, down after 600 ms)",
        killed.elapsed().max(took)
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let total = load.await.unwrap();
    assert!(
        total > before_kill + 10,
        "the load kept running: {before_kill} ops before the kill, {total} in all"
    );
    // Keys node 2 held are misses now; every other key is still there, byte for byte.
    let present = check(&c, 0..3_000).await;
    assert!(
        present >= 3_000 - on_n2 as usize - 50 && present < 3_000,
        "present after the kill: {present} (node 2 held {on_n2})"
    );
    // Replicated objects survived.
    for i in 0..200u64 {
        let got = c.get(format!("weights-{i}").as_bytes()).await.unwrap();
        assert_eq!(got, Some(value(1_000_000 + i, 4096)), "pinned object {i}");
    }
    drop(n1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_takes_a_share_of_new_writes_and_old_keys_stay_reachable() {
    let n0 = start(0, "64MiB", None, NO_HANDOVER);
    let _n1 = start(1, "64MiB", Some(&n0), NO_HANDOVER);
    let _n2 = start(2, "64MiB", Some(&n0), NO_HANDOVER);
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Auto))
        .await
        .unwrap();
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    assert_eq!(fill(&c, 0..3_000).await, 3_000);
    let before = check(&c, 0..3_000).await as f64 / 3_000.0;

    let _n3 = start(3, "64MiB", Some(&n0), NO_HANDOVER);
    wait_view(&c, "4 serving", |v| serving(v) == 4).await;
    assert_eq!(fill(&c, 10_000..14_000).await, 4_000);
    let share = c.node_stats(3).await.unwrap().objects as f64 / 4_000.0;
    println!("node 3 took {:.1} % of new writes", share * 100.0);
    assert!((0.15..0.35).contains(&share), "about a quarter: {share}");
    // About a quarter of the old keys now belong to node 3, which never saw them: the lookup
    // falls back to their previous owner.
    let after = check(&c, 0..3_000).await as f64 / 3_000.0;
    println!("hit rate on old keys: {before:.3} before the join, {after:.3} after");
    assert!(after >= 0.9 * before, "{after} against {before}");
    // And prefix matches across the change see the whole run.
    let keys: Vec<Vec<u8>> = (0..64).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    assert_eq!(c.batch_exists(&refs).await.unwrap(), 64);
    // So do per-key presence checks (Mooncake's batch_is_exist in the Python client).
    let present = c.present(&refs).await.unwrap();
    assert_eq!(present.iter().filter(|p| **p).count(), 64);
}

/// A config file giving namespace `weights` one copy of each pinned object, so only the
/// mover can carry them to a new owner.
fn one_copy_weights(tag: &str) -> String {
    let conf = temp_dir(tag).join("kvpool.toml");
    std::fs::write(
        &conf,
        "[[namespace]]\nname = \"weights\"\npinned_replicas = 1\n",
    )
    .unwrap();
    conf.to_str().unwrap().to_string()
}

/// A client of namespace `weights` through `n`, every byte over TCP.
async fn weights_client(n: &Node) -> Client {
    Client::connect(&n.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap()
        .namespace("weights")
        .unwrap()
}

/// Waits (bounded) until nodes 0 and 1 hold the `n` objects once between them, node 1 some:
/// the join's moves are done.
async fn join_moved(c: &Client, n: u64) {
    let t = Instant::now();
    loop {
        let (a, b) = (c.node_stats(0).await, c.node_stats(1).await);
        if let (Ok(a), Ok(b)) = (a, b) {
            if a.objects + b.objects == n && b.objects > 0 {
                return;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the join's moves never finished"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_hands_its_pinned_objects_over_before_it_exits() {
    // One copy of each pinned object, so only the mover can save them.
    let conf = one_copy_weights("drain-conf");
    let n0 = start(0, "64MiB", None, &["--config", &conf]);
    let mut n1 = start(1, "64MiB", Some(&n0), &["--config", &conf]);
    let _n2 = start(2, "64MiB", Some(&n0), &["--config", &conf]);
    let c = weights_client(&n0).await;
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    for i in 0..300u64 {
        c.put_pinned(format!("layer-{i}").as_bytes(), &value(i, 8192))
            .await
            .unwrap();
    }
    let on_n1 = c.node_stats(1).await.unwrap().objects;
    assert!(on_n1 > 50, "node 1 holds a share: {on_n1}");
    let out = std::process::Command::new(common::bin("kvpool"))
        .args(["cluster", "drain", "1", "-e", &n0.tcp_url()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // It exits by itself once its objects have moved.
    let mut child = n1.child.take().unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "drained node did not exit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
    wait_view(&c, "node 1 gone", |v| {
        v.node(kvpool::NodeId(1))
            .is_some_and(|n| n.state == NodeState::Down)
    })
    .await;
    for i in 0..300u64 {
        let got = c.get(format!("layer-{i}").as_bytes()).await.unwrap();
        assert_eq!(
            got,
            Some(value(i, 8192)),
            "pinned object {i} after the drain"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_took_a_share_drains_it_back_without_a_miss() {
    // The keys were first written to node 0 alone; node 1 joins and takes its share (node 0
    // hands each over once node 1 holds exactly its latest write), then drains it back. Until
    // node 0's mover has a key again, a read finds it on node 1 as its previous owner, and
    // node 0 vouches for that copy: it handed over its own last write, so nothing it
    // acknowledged is newer. Not one read may miss, and every byte must be right.
    let conf = one_copy_weights("drain-back-conf");
    let n0 = start(0, "256MiB", None, &["--config", &conf]);
    let c = weights_client(&n0).await;
    const N: u64 = 3000;
    let val = |i: u64| value(i, 16 << 10);
    for chunk in (0..N).collect::<Vec<_>>().chunks(500) {
        let keys: Vec<Vec<u8>> = chunk
            .iter()
            .map(|i| format!("layer-{i}").into_bytes())
            .collect();
        let vals: Vec<Vec<u8>> = chunk.iter().map(|&i| val(i)).collect();
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&vals)
            .map(|(k, v)| (&k[..], &v[..]))
            .collect();
        let codes = c.batch_put_pinned(&items).await.unwrap();
        assert!(codes.iter().all(|c| *c == ErrorCode::Ok), "{codes:?}");
    }
    let n1 = start(1, "256MiB", Some(&n0), &["--config", &conf]);
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    // The join's moves are done when the two nodes hold every key once between them.
    join_moved(&c, N).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, misses) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let reader = {
        let (c, stop, reads, misses) = (c.clone(), stop.clone(), reads.clone(), misses.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // 64 keys spread over all of them, again and again (as an engine rereads its
                // hot blocks): any of them not moved back yet is read in every round.
                let k = (i % 64) * (N / 64);
                match c.get(format!("layer-{k}").as_bytes()).await {
                    Ok(Some(v)) => assert!(v == val(k), "layer-{k}: wrong bytes"),
                    Ok(None) => {
                        misses.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("layer-{k}: {e}"),
                }
                reads.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    let mut nodes = [n0, n1];
    drain(&mut nodes, 1).await;
    stop.store(true, Ordering::Relaxed);
    reader.await.unwrap();
    let (reads, misses) = (
        reads.load(Ordering::Relaxed),
        misses.load(Ordering::Relaxed),
    );
    assert!(reads > 0);
    assert_eq!(
        misses, 0,
        "{misses} of {reads} reads missed while node 1 drained"
    );
    assert_eq!(c.node_stats(0).await.unwrap().objects, N);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_streaming_across_a_view_change_is_never_acknowledged_and_then_lost() {
    // Puts routed by the one-node view stream half their values into node 0; node 1 joins and
    // the mover hands it its share (the old values); then the puts finish. A put acknowledged
    // then would leave its key's new owner serving the older value, so node 0 refuses to
    // commit once its view has changed (WrongView: the client routes again), and every put it
    // did acknowledge must be what the key reads.
    let conf = one_copy_weights("stream-view-conf");
    let n0 = start(0, "64MiB", None, &["--config", &conf]);
    let c = weights_client(&n0).await;
    let ns = c
        .hello()
        .namespaces
        .iter()
        .find(|(n, _)| n == "weights")
        .map(|(_, id)| *id)
        .unwrap();
    const K: u64 = 16;
    let name = |i: u64| format!("layer-{i}").into_bytes();
    let (old, new) = (
        |i: u64| value(i, 64 << 10),
        |i: u64| value(1000 + i, 64 << 10),
    );
    for i in 0..K {
        c.put_pinned(&name(i), &old(i)).await.unwrap();
    }
    let stamp = c.view().await.unwrap().stamp();
    let mut conns = Vec::new();
    for i in 0..K {
        let mut s = tokio::net::TcpStream::connect(&n0.tcp).await.unwrap();
        common::raw::hello(&mut s, "streaming-put").await;
        let v = new(i);
        let op = kvpool::protocol::Op::Put {
            ns,
            key: name(i),
            checksum: kvpool::checksum(&v),
            pin: true,
        };
        common::raw::send_head_in_view(&mut s, (2, stamp), op, v.len() as u64).await;
        s.write_all(&v[..v.len() / 2]).await.unwrap();
        conns.push(s);
    }
    let _n1 = start(1, "64MiB", Some(&n0), &["--config", &conf]);
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    join_moved(&c, K).await;
    let mut acknowledged = 0;
    for (i, s) in conns.iter_mut().enumerate() {
        let v = new(i as u64);
        s.write_all(&v[v.len() / 2..]).await.unwrap();
        match common::raw::recv(s).await.expect("an answer").reply {
            kvpool::protocol::Reply::Done => {
                acknowledged += 1;
                let got = c.get(&name(i as u64)).await.unwrap();
                assert!(
                    got.as_deref() == Some(&v[..]),
                    "layer-{i}: acknowledged, then lost"
                );
            }
            kvpool::protocol::Reply::Error { code, .. } => {
                assert_eq!(ErrorCode::from_u16(code), ErrorCode::WrongView, "layer-{i}");
                let got = c.get(&name(i as u64)).await.unwrap();
                assert!(
                    got.as_deref() == Some(&old(i as u64)[..]),
                    "layer-{i}: not the old value"
                );
            }
            r => panic!("layer-{i}: {r:?}"),
        }
    }
    assert_eq!(
        acknowledged, 0,
        "puts routed by a view that changed meanwhile were acknowledged"
    );
    // A client put in the same situation goes again by the new view and lands.
    c.put_pinned(&name(0), &new(0)).await.unwrap();
    assert_eq!(c.get(&name(0)).await.unwrap(), Some(new(0)));
}

/// Puts `value` under `key`, retrying (bounded) while the client's link to a restarted node
/// is still the dead one.
async fn put_retrying(c: &Client, key: &[u8], value: &[u8]) {
    let t = Instant::now();
    loop {
        match c.put(key, value).await {
            Ok(()) => return,
            Err(e) => assert!(
                t.elapsed() < Duration::from_secs(10),
                "put never succeeded: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_owner_never_shadows_a_write_acknowledged_after_the_owner_came_back() {
    let n0 = start(0, "64MiB", None, NO_HANDOVER);
    let mut n1 = start(1, "8MiB", Some(&n0), NO_HANDOVER);
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    // Keys node 1 owns: 8 to overwrite, 8 to remove.
    let view = c.routing_view();
    let owned: Vec<Vec<u8>> = (0..10_000u64)
        .map(|i| format!("shadow-{i}").into_bytes())
        .filter(|k| view.owner(k) == Some(kvpool::NodeId(1)))
        .take(16)
        .collect();
    let (rewritten, removed) = owned.split_at(8);

    // The owner goes down: version 1 lands on node 0.
    let mut child = n1.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    wait_view(&c, "node 1 down", |v| serving(v) == 1).await;
    for (i, k) in owned.iter().enumerate() {
        c.put(k, &value(i as u64, 1024)).await.unwrap();
    }
    assert_eq!(c.node_stats(0).await.unwrap().objects, 16);

    // It comes back (a fresh process): version 2 is written to it and acknowledged, by this
    // client (whose previous view has node 0 as the owner), and the other keys are removed
    // on node 1 (only there, as a client routing with another view might).
    let n1b = start(1, "8MiB", Some(&n0), NO_HANDOVER);
    wait_view(&c, "node 1 back", |v| serving(v) == 2).await;
    for (i, k) in rewritten.iter().enumerate() {
        put_retrying(&c, k, &value(100 + i as u64, 1024)).await;
    }
    for k in removed {
        let remove = kvpool::protocol::Op::Remove {
            ns: 0,
            keys: vec![k.clone()],
        };
        assert_eq!(raw_with_view(&n1b.tcp, 0, remove).await, 0);
    }
    let w = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    // Version 2 is evicted on node 1: fill it with other keys it owns.
    let wv = w.routing_view();
    let filler: Vec<Vec<u8>> = (0..100_000u64)
        .map(|i| format!("filler-{i}").into_bytes())
        .filter(|k| wv.owner(k) == Some(kvpool::NodeId(1)))
        .take(200)
        .collect();
    let big = value(7, 256 << 10);
    for k in &filler {
        w.put(k, &big).await.unwrap();
    }
    // Node 0 still holds every version 1: only the read path stands between them and a reader.
    assert_eq!(c.node_stats(0).await.unwrap().objects, 16);

    // Newest value or a miss, never version 1: by `get`, batched, and by presence.
    let mut evicted = 0;
    for (i, k) in rewritten.iter().enumerate() {
        match c.get(k).await.unwrap() {
            Some(v) => assert!(
                v == value(100 + i as u64, 1024),
                "key {i}: version 1 served"
            ),
            None => evicted += 1,
        }
    }
    assert!(
        evicted > 0,
        "no version 2 was evicted: the test proves nothing"
    );
    let refs: Vec<&[u8]> = rewritten.iter().map(|k| &k[..]).collect();
    let mut bufs = vec![vec![0u8; 1024]; refs.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
    for (i, (g, b)) in got.iter().zip(&bufs).enumerate() {
        if g.is_some() {
            assert!(
                *b == value(100 + i as u64, 1024),
                "key {i}: version 1 served"
            );
        }
    }
    for (i, k) in removed.iter().enumerate() {
        assert!(
            c.get(k).await.unwrap().is_none(),
            "removed key {i} came back"
        );
        assert!(!c.exists(k).await.unwrap(), "removed key {i} came back");
    }
    let refs: Vec<&[u8]> = removed.iter().map(|k| &k[..]).collect();
    let mut bufs = vec![vec![0u8; 1024]; refs.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
    assert!(
        got.iter().all(|g| g.is_none()),
        "removed keys came back: {got:?}"
    );
}

/// Writes `value(seed(i), 512)` under each of `keys`; every write must be acknowledged.
async fn put_all(c: &Client, keys: &[Vec<u8>], seed: impl Fn(usize) -> u64) {
    let vals: Vec<Vec<u8>> = (0..keys.len()).map(|i| value(seed(i), 512)).collect();
    for (ks, vs) in keys.chunks(500).zip(vals.chunks(500)) {
        let items: Vec<(&[u8], &[u8])> = ks.iter().zip(vs).map(|(k, v)| (&k[..], &v[..])).collect();
        let codes = c.batch_put_from(&items).await.unwrap();
        assert!(codes.iter().all(|c| *c == ErrorCode::Ok), "{codes:?}");
    }
}

/// Reads `keys` by `get`, batched and by presence; each must be `value(newest(i), 512)` or a
/// miss, never `value(old(i), 512)`. Returns how many were present.
async fn newest_or_miss(
    c: &Client,
    keys: &[Vec<u8>],
    old: impl Fn(usize) -> u64,
    newest: impl Fn(usize) -> u64,
) -> usize {
    let mut present = 0;
    for (i, k) in keys.iter().enumerate() {
        if let Some(v) = c.get(k).await.unwrap() {
            assert!(v != value(old(i), 512), "key {i}: the old copy was served");
            assert_eq!(v, value(newest(i), 512), "key {i}: unknown bytes");
            present += 1;
        }
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let mut bufs = vec![vec![0u8; 512]; refs.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
    for (i, (g, b)) in got.iter().zip(&bufs).enumerate() {
        if g.is_some() {
            assert!(*b != value(old(i), 512), "key {i}: the old copy was served");
        }
    }
    for (i, k) in keys.iter().enumerate() {
        if c.exists(k).await.unwrap() {
            let v = c.get(k).await.unwrap();
            assert_eq!(
                v,
                Some(value(newest(i), 512)),
                "key {i}: present, not newest"
            );
        }
    }
    present
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_never_serves_its_copy_from_before_a_joined_node_took_the_key_and_left() {
    let n0 = start(0, "64MiB", None, NO_HANDOVER);
    let _n1 = start(1, "64MiB", Some(&n0), NO_HANDOVER);
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    let keys: Vec<Vec<u8>> = (0..2_000u64)
        .map(|i| format!("fence-{i}").into_bytes())
        .collect();
    // Version 0 on nodes 0 and 1.
    put_all(&c, &keys, |i| i as u64).await;

    // Node 2 joins and takes a share; version 1 of those keys is written to it only.
    let mut n2 = start(2, "64MiB", Some(&n0), NO_HANDOVER);
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    let view = c.routing_view();
    let (moved, stayed): (Vec<_>, Vec<_>) =
        (0..keys.len()).partition(|&i| view.owner(&keys[i]) == Some(kvpool::NodeId(2)));
    assert!(moved.len() > 100, "node 2 took a share: {}", moved.len());
    let moved_keys: Vec<Vec<u8>> = moved.iter().map(|&i| keys[i].clone()).collect();
    put_all(&c, &moved_keys, |j| 10_000 + moved[j] as u64).await;

    // It dies: ownership goes back to nodes 0 and 1, which still hold version 0.
    let mut child = n2.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    wait_view(&c, "node 2 down", |v| serving(v) == 2).await;

    // Version 1 or a miss (it was on node 2 only), never version 0.
    let present = newest_or_miss(
        &c,
        &moved_keys,
        |j| moved[j] as u64,
        |j| 10_000 + moved[j] as u64,
    )
    .await;
    assert_eq!(present, 0, "version 1 died with node 2");
    // The keys that never moved are served as before.
    let stayed_keys: Vec<Vec<u8>> = stayed.iter().map(|&i| keys[i].clone()).collect();
    let kept = newest_or_miss(&c, &stayed_keys, |_| u64::MAX, |j| stayed[j] as u64).await;
    assert_eq!(kept, stayed.len(), "keys that stayed on their owner");
}

/// Starts node `id` like [`start`], but marked down only after `down_after_ms`.
fn start_slow_down(id: u32, seed: Option<&Node>, down_after_ms: &str) -> Node {
    let id = id.to_string();
    let mut args: Vec<&str> = vec![
        "--node-id",
        &id,
        "--heartbeat-ms",
        "100",
        "--down-after-ms",
        down_after_ms,
        "--handover",
        "false",
    ];
    let (peer, secret);
    if let Some(s) = seed {
        peer = s.tcp.clone();
        secret = s.secret_file().to_str().unwrap().to_string();
        args.extend_from_slice(&["--peer", &peer, "--cluster-secret-file", &secret]);
    }
    Node::start("64MiB", &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_from_the_next_replica_never_serves_an_unpinned_copy_from_an_earlier_ownership() {
    // Slow failure detection: the reads below find the owner unreachable while it is still
    // serving in every view, so the client moves on to the key's second-ranked node.
    let n0 = start_slow_down(0, None, "10000");
    let _n2 = start_slow_down(2, Some(&n0), "10000");
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    let keys: Vec<Vec<u8>> = (0..3_000u64)
        .map(|i| format!("replica-{i}").into_bytes())
        .collect();
    put_all(&c, &keys, |i| i as u64).await;

    // Node 1 joins: the keys it ranks first and node 2 second are unpinned, so node 2's copy
    // (version 0, from when it owned them) is not a replica of anything.
    let mut n1 = start_slow_down(1, Some(&n0), "10000");
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    let view = c.routing_view();
    let targets: Vec<usize> = (0..keys.len())
        .filter(|&i| view.owners(&keys[i], 2) == [kvpool::NodeId(1), kvpool::NodeId(2)])
        .collect();
    assert!(targets.len() > 100, "keys ranked 1, 2: {}", targets.len());
    let target_keys: Vec<Vec<u8>> = targets.iter().map(|&i| keys[i].clone()).collect();
    put_all(&c, &target_keys, |j| 10_000 + targets[j] as u64).await;

    // The owner dies; every node still holds it serving.
    let mut child = n1.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let present = newest_or_miss(
        &c,
        &target_keys,
        |j| targets[j] as u64,
        |j| 10_000 + targets[j] as u64,
    )
    .await;
    assert_eq!(present, 0, "version 1 died with node 1");
    let still = c
        .routing_view()
        .node(kvpool::NodeId(1))
        .is_some_and(|n| n.state == NodeState::Serving);
    println!("node 1 still serving in the client's view after the reads: {still}");
}

/// Sends `signal` (a name such as `STOP`) to `node`'s process.
fn signal(node: &Node, signal: &str) {
    let pid = node.child.as_ref().expect("running").id();
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_and_marked_down_never_serves_its_old_copy_when_it_comes_back() {
    let n0 = start(0, "64MiB", None, NO_HANDOVER);
    let n1 = start(1, "64MiB", Some(&n0), NO_HANDOVER);
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    let view = c.routing_view();
    let keys: Vec<Vec<u8>> = (0..2_000u64)
        .map(|i| format!("cut-{i}").into_bytes())
        .filter(|k| view.owner(k) == Some(kvpool::NodeId(1)))
        .take(200)
        .collect();
    put_all(&c, &keys, |i| i as u64).await;
    let epoch = |v: &kvpool::placement::ClusterView| v.node(kvpool::NodeId(1)).map(|n| n.epoch);
    let before = epoch(&view);

    // Node 1 is cut off (stopped, never restarted): node 0 marks it down and takes its keys.
    signal(&n1, "STOP");
    let resumed = scopeguard_cont(&n1);
    wait_view(&c, "node 1 down", |v| serving(v) == 1).await;
    put_all(&c, &keys, |i| 10_000 + i as u64).await;

    // It comes back, refutes being down and owns its keys again, still holding version 0.
    drop(resumed);
    wait_view(&c, "node 1 back", |v| serving(v) == 2 && epoch(v) > before).await;
    newest_or_miss(&c, &keys, |i| i as u64, |i| 10_000 + i as u64).await;
}

/// Resumes a stopped node when dropped (also when the test fails before it resumes it).
fn scopeguard_cont(node: &Node) -> impl Drop + '_ {
    struct Cont<'a>(&'a Node);
    impl Drop for Cont<'_> {
        fn drop(&mut self) {
            // No assertion here: this may run while a failed test unwinds.
            if let Some(c) = self.0.child.as_ref() {
                let _ = std::process::Command::new("kill")
                    .args(["-CONT".to_string(), c.id().to_string()])
                    .status();
            }
        }
    }
    Cont(node)
}

/// `keys_with_prefix` (`Op::Scan` on every serving node) lists exactly the keys with the
/// prefix, each once though pinned ones live on two nodes, and nothing of another namespace;
/// a namespace the connection may not use is refused; a node that can't be reached is skipped
/// while the replicas of its pinned keys still list them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_a_prefix_are_listed_once_across_the_cluster() {
    let dir = temp_dir("scan-config");
    let conf = dir.join("kvpoold.toml");
    std::fs::write(
        &conf,
        "[[namespace]]\nname = \"weights\"\n\n[[namespace]]\nname = \"secret\"\ntokens = [\"s-token\"]\n",
    )
    .unwrap();
    let conf = conf.to_str().unwrap();
    let extra = ["--config", conf];
    let n0 = start(0, "64MiB", None, &extra);
    let n1 = start(1, "64MiB", Some(&n0), &extra);
    let mut n2 = start(2, "64MiB", Some(&n0), &extra);
    let weights = kvpool_client::ClientConfig {
        namespace: "weights".into(),
        ..cfg(SameHost::Off)
    };
    let c = Client::connect(&n0.tcp_url(), weights).await.unwrap();
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    let mut pinned: Vec<Vec<u8>> = (0..40)
        .map(|i| format!("manifest/p{i:02}").into_bytes())
        .collect();
    let unpinned: Vec<Vec<u8>> = (0..40)
        .map(|i| format!("manifest/u{i:02}").into_bytes())
        .collect();
    for (i, k) in pinned.iter().enumerate() {
        c.put_pinned(k, &value(i as u64, 512)).await.unwrap();
    }
    for (i, k) in unpinned.iter().enumerate() {
        c.put(k, &value(i as u64, 512)).await.unwrap();
    }
    for i in 0..60u64 {
        c.put(format!("chunk/{i}").as_bytes(), &value(i, 512))
            .await
            .unwrap();
    }
    let other = c.namespace("default").unwrap();
    other.put(b"manifest/elsewhere", b"v").await.unwrap();
    // Pinned objects are on two nodes each: the listing still has each key once.
    let mut objects = 0;
    for n in 0..3 {
        objects += c.node_stats(n).await.unwrap().objects;
    }
    assert_eq!(
        objects,
        40 * 2 + 40 + 60 + 1,
        "pinned objects have 2 replicas"
    );
    let mut want: Vec<Vec<u8>> = pinned.iter().chain(&unpinned).cloned().collect();
    want.sort();
    assert_eq!(c.keys_with_prefix(b"manifest/").await.unwrap(), want);
    assert_eq!(c.keys_with_prefix(b"manifest/p").await.unwrap(), pinned);
    assert_eq!(c.keys_with_prefix(b"").await.unwrap().len(), 140);
    assert!(c.keys_with_prefix(b"nothing/").await.unwrap().is_empty());
    assert_eq!(
        other.keys_with_prefix(b"manifest/").await.unwrap(),
        vec![b"manifest/elsewhere".to_vec()]
    );
    let long = c.keys_with_prefix(&[b'm'; 257]).await.unwrap_err();
    assert_eq!(long.code(), Some(ErrorCode::BadKey));
    // The blocking client gives the same list.
    let url = n1.tcp_url();
    let blocking = tokio::task::spawn_blocking(move || {
        let b = kvpool_client::blocking::Client::connect(
            &url,
            kvpool_client::ClientConfig {
                namespace: "weights".into(),
                ..cfg(SameHost::Off)
            },
        )
        .unwrap();
        b.keys_with_prefix(b"manifest/p").unwrap()
    })
    .await
    .unwrap();
    assert_eq!(blocking, pinned);

    // A namespace with a token this client lacks is not even visible to it, and a Scan naming
    // its id is refused on the wire.
    assert!(c.namespace("secret").is_err());
    let secret = kvpool_client::ClientConfig {
        namespace: "secret".into(),
        token: "s-token".into(),
        ..cfg(SameHost::Off)
    };
    let s = Client::connect(&n1.tcp_url(), secret).await.unwrap();
    s.put(b"manifest/hidden", b"v").await.unwrap();
    assert_eq!(
        s.keys_with_prefix(b"manifest/").await.unwrap(),
        vec![b"manifest/hidden".to_vec()]
    );
    let secret_id = s
        .hello()
        .namespaces
        .iter()
        .find(|(n, _)| n == "secret")
        .unwrap()
        .1;
    let scan = |ns| kvpool::protocol::Op::Scan {
        ns,
        cursor: 0,
        count: 100,
        prefix: b"manifest/".to_vec(),
    };
    for n in [&n0, &n1, &n2] {
        assert_eq!(
            raw_with_view(&n.tcp, 0, scan(secret_id)).await,
            ErrorCode::Unauthorized as u16
        );
    }
    // A Scan routed by another view is refused like every keyed request.
    let stamp = c.view().await.unwrap().stamp();
    assert_eq!(
        raw_with_view(&n0.tcp, stamp ^ 1, scan(0)).await,
        ErrorCode::WrongView as u16
    );
    assert_eq!(raw_with_view(&n0.tcp, stamp, scan(0)).await, 0);

    // Node 2 gone: it is skipped as unreachable; every pinned key is still listed by its
    // other replica, and nothing is listed that was never written.
    n2.child.take().unwrap().kill().unwrap();
    let before = c.unreachable_events();
    let got = c.keys_with_prefix(b"manifest/").await.unwrap();
    pinned.retain(|k| got.contains(k));
    assert_eq!(pinned.len(), 40, "every pinned key survives on a replica");
    assert!(got.iter().all(|k| want.contains(k)), "{got:?}");
    assert!(got.windows(2).all(|w| w[0] < w[1]), "sorted, once each");
    assert!(
        c.unreachable_events() > before,
        "node 2 counted unreachable"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A static peer that starts long after the node that names it: its own heartbeat brings it
/// into that node's view before the node's heartbeat reaches it, and it must not be marked
/// down for the silence of its address before it existed (seen in a mixed-version cluster: the
/// joiner was marked down 21 ms after it appeared, and refuted). Checked by the joiner's epoch:
/// 1 joining, 2 serving, and never a refutation above that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_peer_that_starts_late_is_not_marked_down_for_its_silence_before() {
    let dir = temp_dir("late-peer");
    let secret = dir.join("cluster.secret");
    common::write_secret(&secret, 17);
    let secret = secret.to_str().unwrap();
    // An address for node 1 that nothing listens on until it starts.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let late = format!("127.0.0.1:{port}");
    let timing = ["--heartbeat-ms", "100", "--down-after-ms", "500"];
    let flags = |id: &str, peer: &str| {
        let mut f = vec![
            "--node-id",
            id,
            "--peer",
            peer,
            "--cluster-secret-file",
            secret,
        ];
        f.extend(timing);
        f.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let a_flags = flags("0", &late);
    let a = Node::start(
        "32MiB",
        &a_flags.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // Node 0 watches the silent address for three times `down_after`.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b_flags = flags("1", &a.tcp);
    let _b = Node::start_in(
        temp_dir("late-peer-1"),
        "32MiB",
        &b_flags.iter().map(String::as_str).collect::<Vec<_>>(),
        &[&late, "127.0.0.1:0", "127.0.0.1:0"],
    );
    let c = Client::connect(&a.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    let mut downs = 0;
    let t = Instant::now();
    let mut last = None;
    while t.elapsed() < Duration::from_secs(3) {
        if let Some(n) = c.view().await.unwrap().node(kvpool::NodeId(1)).cloned() {
            downs += (n.state == NodeState::Down) as usize;
            last = Some(n);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let n = last.expect("node 1 joined node 0's view");
    assert_eq!(downs, 0, "node 1 was seen down in node 0's view");
    assert_eq!(n.state, NodeState::Serving);
    assert_eq!(
        n.epoch, 2,
        "joining, then serving, and no refutation: {n:?}"
    );
}

/// `GET /ready` on `node`'s metrics listener: the status code and the body, or None once
/// nothing listens there (the node has exited).
fn ready(node: &Node) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(&node.metrics).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// `/ready` answers 200 only while the node is `serving`: a node alone at once, a node that
/// cannot reach its etcd stays `joining` (503), and a node drained by SIGTERM turns 503
/// (`draining`, then `down`) while it still runs, never 200 again. Node 0 is stopped
/// (SIGSTOP) during the drain, so that node 1's announcements to it wait out their timeout
/// and each state lasts that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_answers_200_only_while_the_node_is_serving() {
    let n0 = start(0, "64MiB", None, &[]);
    assert_eq!(ready(&n0), Some((200, "serving\n".into())), "a node alone");
    let mut n1 = start(1, "64MiB", Some(&n0), &[]);
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    assert_eq!(ready(&n1), Some((200, "serving\n".into())), "joined");

    // etcd on a port where nothing listens: the node registers nowhere and owns nothing.
    let unreachable = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let etcd = format!("http://{}", unreachable.local_addr().unwrap());
    drop(unreachable);
    let secret = n0.secret_file();
    let n2 = Node::start(
        "16MiB",
        &[
            "--node-id",
            "2",
            "--etcd",
            &etcd,
            "--cluster-secret-file",
            secret.to_str().unwrap(),
        ],
    );
    assert_eq!(ready(&n2), Some((503, "joining\n".into())));

    signal(&n0, "STOP");
    let resumed = scopeguard_cont(&n0);
    signal(&n1, "TERM");
    let mut child = n1.child.take().unwrap();
    let mut seen = Vec::new();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if let Some(answer) = ready(&n1) {
            if seen.last() != Some(&answer) {
                seen.push(answer);
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "drained node did not exit: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    drop(resumed);
    assert!(status.success(), "{status:?}");
    let draining = seen
        .iter()
        .position(|a| *a == (503, "draining\n".to_string()));
    let first_503 = seen.iter().position(|(code, _)| *code == 503);
    assert!(draining.is_some(), "never draining: {seen:?}");
    assert!(
        seen[first_503.unwrap()..]
            .iter()
            .all(|(code, _)| *code == 503),
        "ready again after the drain began: {seen:?}"
    );
}
