//! Elastic membership without losing the cache: a drained node hands its unpinned
//! blocks to their new owners before it leaves, previous owners hand a joining node its share,
//! and a handed-over copy never replaces a newer value. Real `kvpoold` processes on loopback;
//! clients read with no fallback to previous owners, so every hit is a block that reached its
//! owner. Every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{admin, cfg, check, drain, fill, serving, wait_view};
use common::{bin, metric, value, Node};
use kvpool_bench::replay::cache::Unbounded;
use kvpool_bench::replay::cli::BUNDLED_TRACE;
use kvpool_bench::replay::elastic::{replay_around, Outcome, Plan};
use kvpool_bench::replay::pool_engine::Remote;
use kvpool_bench::replay::trace::{Trace, TraceFormat};
use kvpool_client::{Client, ClientConfig, ErrorCode, SameHost};

const HEARTBEAT: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "600"];
const N: u64 = 3_000;

fn start(id: u32, seed: Option<&Node>, handover: bool) -> Node {
    let flag = if handover { "true" } else { "false" };
    let extra = [HEARTBEAT, &["--handover", flag]].concat();
    common::cluster::start_node(id, "64MiB", seed, &extra)
}

/// A client through `n` that never looks a miss up on the key's previous owner.
async fn owners_only(n: &Node) -> Client {
    let c = ClientConfig {
        fallback_window: Duration::ZERO,
        ..cfg(SameHost::Off)
    };
    Client::connect(&n.tcp_url(), c).await.unwrap()
}

/// Objects held by the nodes of `ids`, summed.
async fn held(c: &Client, ids: &[u32]) -> u64 {
    let mut n = 0;
    for &id in ids {
        n += c.node_stats(id).await.map_or(0, |s| s.objects);
    }
    n
}

/// Three serving nodes holding keys `0..N`, and a client through node 0 that reads owners only.
async fn three_filled(handover: bool) -> ([Node; 3], Client) {
    let n0 = start(0, None, handover);
    let n1 = start(1, Some(&n0), handover);
    let n2 = start(2, Some(&n0), handover);
    let c = owners_only(&n0).await;
    wait_view(&c, "3 serving", |v| serving(v) == 3).await;
    assert_eq!(fill(&c, 0..N).await, N as usize);
    ([n0, n1, n2], c)
}

/// Three nodes holding keys `0..N`; then node 1 drains. Returns the keys found afterwards.
async fn drain_one(handover: bool) -> usize {
    let (mut nodes, c) = three_filled(handover).await;
    let on_1 = c.node_stats(1).await.unwrap().objects;
    assert!(on_1 > N / 5, "node 1 holds its share: {on_1}");
    drain(&mut nodes, 1).await;
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    check(&c, 0..N).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_hands_its_unpinned_blocks_to_their_new_owners() {
    let kept = drain_one(true).await;
    // The control: without the handover the drained node's share is lost.
    let lost_without = N as usize - drain_one(false).await;
    println!("after a drain: {kept} of {N} found; without handover {lost_without} lost");
    assert!(lost_without as u64 > N / 5, "the control lost its share");
    assert_eq!(kept, N as usize, "every block reached its new owner");
}

/// Three nodes holding keys `0..N`; then node 3 joins. Returns the keys found on their owners
/// afterwards, and how many node 3 was handed.
async fn join_one(handover: bool) -> (usize, u64) {
    let (nodes, c) = three_filled(handover).await;
    let _n3 = start(3, Some(&nodes[0]), handover);
    wait_view(&c, "4 serving", |v| serving(v) == 4).await;
    if !handover {
        // Give a handover (there should be none) time to happen.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let on_3 = c.node_stats(3).await.map_or(0, |s| s.objects);
        return (check(&c, 0..N).await, on_3);
    }
    // Handed over: node 3 holds its share, and each key is held once (the previous owners
    // dropped what they handed).
    // The previous owners count what they handed on their metrics page; node 3 started empty,
    // so that is exactly what it holds, and nothing is left pending.
    let t = Instant::now();
    loop {
        let on_3 = c.node_stats(3).await.map_or(0, |s| s.objects);
        let handed: u64 = nodes
            .iter()
            .map(|n| metric(&n.scrape(), "kvpool_handover_objects_total").unwrap_or(0))
            .sum();
        let pending: u64 = nodes
            .iter()
            .map(|n| metric(&n.scrape(), "kvpool_handover_pending").unwrap_or(0))
            .sum();
        if on_3 > N / 8 && held(&c, &[0, 1, 2, 3]).await == N && handed == on_3 && pending == 0 {
            // The copies went out as the nodes' own calls to their peers, counted as data; the
            // heartbeats as membership.
            let peer_bytes = |n: &Node, kind: &str| {
                let series =
                    format!("kvpool_peer_bytes_total{{kind=\"{kind}\",direction=\"sent\"}}");
                metric(&n.scrape(), &series).unwrap_or(0)
            };
            let data: u64 = nodes.iter().map(|n| peer_bytes(n, "data")).sum();
            assert!(
                data >= handed * 256,
                "{data} bytes sent for {handed} copies of 256 B"
            );
            assert!(nodes.iter().all(|n| peer_bytes(n, "membership") > 0));
            return (check(&c, 0..N).await, on_3);
        }
        assert!(t.elapsed() < Duration::from_secs(30), "never handed over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_owners_hand_a_joining_node_its_share() {
    let (found, handed) = join_one(true).await;
    let (without, none) = join_one(false).await;
    println!(
        "after a join: {found} of {N} found, node 3 handed {handed}; without handover {without} found"
    );
    assert_eq!(none, 0, "the control handed nothing over");
    assert!(
        (without as u64) < N - N / 8,
        "the control missed node 3's share"
    );
    assert_eq!(found, N as usize, "every key on its owner");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_copy_never_replaces_a_newer_value() {
    // A cluster peer's unpinned put is a handover copy: taken only where the key is absent
    // and no write or remove of it was acknowledged here.
    let n0 = start(0, None, true);
    let c = owners_only(&n0).await;
    let peer = admin(&n0).await;
    let (old, new) = (value(1, 4096), value(2, 4096));
    // Never seen here: the copy is taken.
    peer.put(b"fresh", &old).await.unwrap();
    assert_eq!(c.get(b"fresh").await.unwrap(), Some(old.clone()));
    // Present (a newer write): refused, and the value stays.
    c.put(b"written", &new).await.unwrap();
    assert!(peer.put(b"written", &old).await.is_err());
    assert_eq!(c.get(b"written").await.unwrap(), Some(new.clone()));
    // Removed after a write: the older copy does not come back.
    c.put(b"removed", &new).await.unwrap();
    assert!(c.remove(b"removed").await.unwrap());
    assert!(peer.put(b"removed", &old).await.is_err());
    assert_eq!(c.get(b"removed").await.unwrap(), None);
    // A copy over a copy: the key is present, so refused too.
    assert!(peer.put(b"fresh", &new).await.is_err());
    assert_eq!(c.get(b"fresh").await.unwrap(), Some(old));
}

/// The public two-phase put (`alloc`, `write`, `commit`) is judged by the view its `alloc` was
/// routed by, as every other put is: a commit after the key's owners changed is refused with
/// `WrongView` and nothing is stored, and doing it again routes by the new view. Over TCP and
/// on the same host (stores into the mapping, the commit over the Unix socket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_phase_put_whose_view_changed_after_its_alloc_is_refused() {
    for same_host in [SameHost::Off, SameHost::Auto] {
        let n0 = start(0, None, true);
        let n1 = start(1, Some(&n0), true);
        let c = Client::connect(&n0.tcp_url(), cfg(same_host))
            .await
            .unwrap();
        let watch = [owners_only(&n0).await, owners_only(&n1).await];
        for w in &watch {
            wait_view(w, "2 serving", |v| serving(v) == 2).await;
        }
        c.view().await.unwrap();
        let two_phase = |key: &'static [u8], v: Vec<u8>| {
            let c = &c;
            async move {
                let addr = c.alloc(key, v.len() as u64).await.unwrap();
                c.write(&addr, 0, &v).await.unwrap();
                (addr, kvpool::checksum(&v))
            }
        };
        // The control: no view change between the alloc and the commit.
        let (addr, sum) = two_phase(b"steady", value(1, 4096)).await;
        c.commit(&addr, sum).await.unwrap();
        assert_eq!(c.get(b"steady").await.unwrap(), Some(value(1, 4096)));

        let (addr, sum) = two_phase(b"moved", value(2, 4096)).await;
        let _n2 = start(2, Some(&n0), true);
        for w in &watch {
            wait_view(w, "3 serving", |v| serving(v) == 3).await;
        }
        let err = c.commit(&addr, sum).await.unwrap_err();
        assert_eq!(
            err.code(),
            Some(ErrorCode::WrongView),
            "{same_host:?}: {err}"
        );
        assert_eq!(c.get(b"moved").await.unwrap(), None, "{same_host:?}");
        // Again, by the new view.
        let (addr, sum) = two_phase(b"moved", value(3, 4096)).await;
        c.commit(&addr, sum).await.unwrap();
        assert_eq!(c.get(b"moved").await.unwrap(), Some(value(3, 4096)));
    }
}

/// Three nodes with room for every block replay the first 300 requests of the bundled trace
/// through `kvpool-bench elastic`'s harness; half-way, node 2 drains (`kvpool cluster drain
/// --wait`, the replay held until it has left).
fn replay_through_a_drain(handover: bool, trace: &Trace, plan: &Plan) -> Outcome {
    let n0 = start(0, None, handover);
    let nodes = [start(1, Some(&n0), handover), start(2, Some(&n0), handover)];
    let mut remote = Remote::connect(&n0.tcp_url(), "default", 4096, 0).unwrap();
    let t = Instant::now();
    while remote.cluster_nodes().unwrap() < 3 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "3 nodes never served"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let drain = format!(
        "{} -e {} cluster drain 2 --wait --cluster-secret-file {}",
        bin("kvpool").display(),
        n0.tcp_url(),
        n0.secret_file().display()
    );
    let o = replay_around(trace, &mut remote, plan, Some(&drain)).unwrap();
    drop(nodes);
    o
}

/// `kvpool-bench elastic` against real daemons: with room for every block, the windows after a
/// drain that handed its blocks over hit exactly what an unbounded cache does, request for
/// request; without the handover the drained node's share is missed. Every loaded block is
/// checked byte for byte by the harness.
#[test]
fn the_elastic_harness_sees_a_drain_keep_the_cache() {
    let trace = Trace::load(
        std::path::Path::new(BUNDLED_TRACE),
        TraceFormat::Auto,
        None,
        None,
        Some(300),
    )
    .unwrap();
    let at = trace.requests[150].arrival_ms as f64 / 1e3;
    let end = trace.requests[299].arrival_ms as f64 / 1e3;
    let plan = Plan {
        wait_event: true,
        ..Plan::new(at, 20.0, end - at, 10.0, 50.0).unwrap()
    };
    let ceiling = replay_around(&trace, &mut Unbounded::default(), &plan, None).unwrap();
    let after = |o: &Outcome| -> (u64, u64) {
        let w = o.windows.iter().filter(|w| w.index >= 0);
        w.fold((0, 0), |(h, e), w| (h + w.hits, e + w.errors))
    };
    let (ceiling_hits, _) = after(&ceiling);
    assert!(
        ceiling_hits > 300,
        "the slice reuses blocks: {ceiling_hits}"
    );

    let kept = replay_through_a_drain(true, &trace, &plan);
    let lost = replay_through_a_drain(false, &trace, &plan);
    println!(
        "after the drain: {} hits with handover, {} without, {} unbounded (drain took {:?} s)",
        after(&kept).0,
        after(&lost).0,
        ceiling_hits,
        kept.event_seconds
    );
    assert!(kept.event_seconds.is_some() && lost.event_seconds.is_some());
    assert_eq!(after(&kept), (ceiling_hits, 0), "every block kept");
    let hits = |o: &Outcome| {
        o.windows
            .iter()
            .map(|w| (w.index, w.hits))
            .collect::<Vec<_>>()
    };
    assert_eq!(hits(&kept), hits(&ceiling), "window for window");
    assert!(
        after(&lost).0 < ceiling_hits * 9 / 10,
        "the control lost the drained node's share: {} of {ceiling_hits}",
        after(&lost).0
    );
}
