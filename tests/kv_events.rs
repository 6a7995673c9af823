//! KV events for routers on a real daemon: every key stored in or removed from a tier is
//! published to the namespace's subscribers (commits, removals, evictions, clears, the disk
//! tier's demotions and promotions), a subscriber that never reads gets a lag marker while the
//! node's memory stays bounded and another tenant is served as before, subscriptions are
//! bounded by the ledger, and no subscriber ever sees another namespace's keys.
#![cfg(not(loom))]

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::raw::{hello_with, recv, send};
use common::{metric, value, Node};
use kvpool::protocol::{ErrorCode, Op, Reply, EVENT_ID, KV_EVENTS_VERSION};
use kvpool_client::{Client, ClientConfig, KvEventKind, KvEvents, KvTier, SameHost};
use tokio::net::TcpStream;

/// Two tenants, each behind its own token.
const TENANTS: &str = "[[namespace]]\nname = \"a\"\ntokens = [\"token-a\"]\nquota = \"16MiB\"\n\n\
                       [[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\nquota = \"16MiB\"\n";

fn start_with(memory: &str, config: &str, extra: &[&str]) -> Node {
    let dir = common::temp_dir("kv-events");
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, config).unwrap();
    let mut args = vec!["--config", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    Node::start(memory, &args)
}

fn cfg(token: &str, ns: &str) -> ClientConfig {
    ClientConfig {
        token: token.into(),
        namespace: ns.into(),
        same_host: SameHost::Off,
        timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    }
}

/// What a subscriber heard: (kind, tier, key).
type Heard = Vec<(KvEventKind, KvTier, Vec<u8>)>;

/// Reads events until `done` says they are enough, or panics after 30 s with what it heard.
async fn hear_until(sub: &mut KvEvents, heard: &mut Heard, done: impl Fn(&Heard) -> bool) {
    let t = Instant::now();
    while !done(heard) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "heard only {heard:?}"
        );
        if let Some(b) = sub.next_within(Duration::from_millis(200)).await {
            let b = b.unwrap();
            assert_eq!(
                b.dropped, 0,
                "nothing is dropped for a reader that keeps up"
            );
            heard.extend(b.events.into_iter().map(|e| (e.kind, e.tier, e.key)));
        }
    }
}

fn has(heard: &Heard, kind: KvEventKind, tier: KvTier, key: &[u8]) -> bool {
    heard
        .iter()
        .any(|(k, t, x)| *k == kind && *t == tier && x == key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_removals_evictions_and_clears_are_published() {
    let n = Node::start("16MiB", &[]);
    let c = Client::connect(&n.tcp_url(), cfg("", "default"))
        .await
        .unwrap();
    let mut sub = c.kv_events(b"ev/").await.unwrap();
    let mut heard = Heard::new();
    c.put(b"ev/one", b"1").await.unwrap();
    c.put(b"other/one", b"1").await.unwrap(); // outside the prefix
    assert!(c.remove(b"ev/one").await.unwrap());
    hear_until(&mut sub, &mut heard, |h| h.len() >= 2).await;
    assert_eq!(
        heard[..2],
        [
            (KvEventKind::Stored, KvTier::Dram, b"ev/one".to_vec()),
            (KvEventKind::Removed, KvTier::Dram, b"ev/one".to_vec()),
        ]
    );
    // 1 MiB values into 16 MiB of memory: the first ones are evicted.
    let big = value(7, 1 << 20);
    for i in 0..24 {
        c.put(format!("ev/big-{i}").as_bytes(), &big).await.unwrap();
    }
    // Events come in the order the node published them: every eviction before the last put.
    hear_until(&mut sub, &mut heard, |h| {
        has(h, KvEventKind::Stored, KvTier::Dram, b"ev/big-23")
    })
    .await;
    assert!(has(&heard, KvEventKind::Removed, KvTier::Dram, b"ev/big-0"));
    for i in 0..24 {
        let k = format!("ev/big-{i}").into_bytes();
        assert!(has(&heard, KvEventKind::Stored, KvTier::Dram, &k));
        let gone = !c.exists(&k).await.unwrap();
        assert_eq!(
            gone,
            has(&heard, KvEventKind::Removed, KvTier::Dram, &k),
            "{i}"
        );
    }
    assert!(heard.iter().all(|(_, _, k)| k.starts_with(b"ev/")));
    c.remove_all().await.unwrap();
    hear_until(&mut sub, &mut heard, |h| {
        h.iter().any(|(k, _, _)| *k == KvEventKind::Cleared)
    })
    .await;
    let page = n.scrape();
    assert!(metric(&page, "kvpool_kv_events_published_total").unwrap() >= 26);
    assert_eq!(metric(&page, "kvpool_kv_event_subscribers"), Some(1));
    let charged = "kvpool_resources{resource=\"kv_event_subscriptions\"}";
    assert_eq!(metric(&page, charged), Some(1), "charged in the ledger");
    drop(sub);
    let t = Instant::now();
    let released = |page: &str| {
        metric(page, "kvpool_kv_event_subscribers") == Some(0) && metric(page, charged) == Some(0)
    };
    while !released(&n.scrape()) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the subscription ends with its connection"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demotions_to_disk_and_promotions_back_are_events_of_their_tier() {
    let dir = common::temp_dir("kv-events-disk");
    let disk = dir.join("disk");
    let n = Node::start(
        "16MiB",
        &[
            "--disk-path",
            disk.to_str().unwrap(),
            "--disk-capacity",
            "128MiB",
            "--disk-region-size",
            "4MiB",
            "--disk-admit",
            "all",
        ],
    );
    let c = Client::connect(&n.tcp_url(), cfg("", "default"))
        .await
        .unwrap();
    let mut sub = c.kv_events(b"").await.unwrap();
    let mut heard = Heard::new();
    let v = value(3, 1 << 20);
    for i in 0..24 {
        c.put(format!("d/{i}").as_bytes(), &v).await.unwrap();
    }
    hear_until(&mut sub, &mut heard, |h| {
        has(h, KvEventKind::Stored, KvTier::Disk, b"d/0")
    })
    .await;
    assert!(has(&heard, KvEventKind::Removed, KvTier::Dram, b"d/0"));
    // A read brings the copy back up: stored in DRAM again.
    heard.clear();
    assert_eq!(c.get(b"d/0").await.unwrap().as_deref(), Some(&v[..]));
    hear_until(&mut sub, &mut heard, |h| {
        has(h, KvEventKind::Stored, KvTier::Dram, b"d/0")
    })
    .await;
    // Removed from both tiers.
    assert!(c.remove(b"d/0").await.unwrap());
    hear_until(&mut sub, &mut heard, |h| {
        has(h, KvEventKind::Removed, KvTier::Disk, b"d/0")
            && has(h, KvEventKind::Removed, KvTier::Dram, b"d/0")
    })
    .await;
}

/// A raw connection that said `Hello` with `token`, and the namespaces it was told of.
async fn raw(n: &Node, token: &str) -> (TcpStream, Vec<(String, u32)>) {
    let mut s = TcpStream::connect(n.tcp_url().trim_start_matches("tcp://"))
        .await
        .unwrap();
    let h = hello_with(&mut s, token).await;
    (s, h.namespaces)
}

/// Subscribes a raw connection of `token` to namespace `ns` (its id as tenant A is told it)
/// and answers what the node said.
async fn raw_subscribe(
    n: &Node,
    token: &str,
    ns: &str,
    prefixes: &[&[u8]],
) -> (TcpStream, Vec<Reply>) {
    let (_, names) = raw(n, "token-a").await;
    let id = names.iter().find(|(name, _)| name == ns).unwrap().1;
    let (mut s, _) = raw(n, token).await;
    let mut replies = Vec::new();
    for (i, p) in prefixes.iter().enumerate() {
        let op = Op::KvEvents {
            ns: id,
            prefix: p.to_vec(),
        };
        send(&mut s, 2 + i as u64, op, &[]).await;
        replies.push(recv(&mut s).await.unwrap().reply);
    }
    (s, replies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_subscriber_that_never_reads_lags_alone_and_the_node_stays_bounded() {
    // A write that stalls this long closes a connection; the idle subscriber is to read at
    // the end.
    let config = format!("[limits]\nwrite_timeout_ms = 600000\n\n{TENANTS}");
    let n = start_with("64MiB", &config, &[]);
    // Tenant A subscribes and never reads again.
    let (mut idle, replies) = raw_subscribe(&n, "token-a", "a", &[b""]).await;
    assert_eq!(replies, [Reply::Done]);
    let b = Client::connect(&n.tcp_url(), cfg("token-b", "b"))
        .await
        .unwrap();
    let mut b_sub = b.kv_events(b"").await.unwrap();
    let rss = n.rss();
    let a = Client::connect(&n.tcp_url(), cfg("token-a", "a"))
        .await
        .unwrap();
    // Long keys, small values: many events, few bytes stored.
    let keys: Vec<Vec<u8>> = (0..2000)
        .map(|i| format!("{i:0>200}").into_bytes())
        .collect();
    let mut rounds = 0;
    while metric(&n.scrape(), "kvpool_kv_events_dropped_total").unwrap_or(0) == 0 {
        assert!(rounds < 200, "the idle subscriber never lagged");
        let items: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (&k[..], &b"x"[..])).collect();
        a.batch_put_from(&items).await.unwrap();
        rounds += 1;
        // Tenant B is served, and hears its own events, all of them.
        let key = format!("b/{rounds}").into_bytes();
        b.put(&key, b"mine").await.unwrap();
        let mut heard = Heard::new();
        hear_until(&mut b_sub, &mut heard, |h| {
            has(h, KvEventKind::Stored, KvTier::Dram, &key)
        })
        .await;
        assert!(
            heard.iter().all(|(_, _, k)| k.starts_with(b"b/")),
            "{heard:?}"
        );
    }
    let grown = n.rss().saturating_sub(rss);
    assert!(grown < 64 << 20, "the node grew by {grown} bytes");
    // Reading at last, A finds the lag marker: a batch saying how many events it lost.
    let t = Instant::now();
    loop {
        assert!(t.elapsed() < Duration::from_secs(60), "no lag marker");
        let r = recv(&mut idle).await.expect("the connection stays open");
        assert_eq!(r.id, EVENT_ID);
        let Reply::KvEvents(batch) = r.reply else {
            panic!("{:?}", r.reply)
        };
        if batch.dropped > 0 {
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_past_the_limit_are_refused_and_counted() {
    let config = format!("[limits]\nmax_event_subscriptions_per_connection = 2\n\n{TENANTS}");
    let n = start_with("64MiB", &config, &[]);
    let (_s, replies) = raw_subscribe(&n, "token-a", "a", &[b"x", b"x", b"y", b"z"]).await;
    assert_eq!(
        replies[..3],
        [Reply::Done, Reply::Done, Reply::Done],
        "the same one twice is one"
    );
    let Reply::Error { code, message } = &replies[3] else {
        panic!("{:?}", replies[3])
    };
    assert_eq!(ErrorCode::from_u16(*code), ErrorCode::LimitExceeded);
    assert!(
        message.contains("max_event_subscriptions_per_connection"),
        "{message}"
    );
    let series = "kvpool_limit_refusals_total{limit=\"event_subscriptions_per_connection\"}";
    assert_eq!(metric(&n.scrape(), series), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_namespace_is_never_seen() {
    let n = start_with("64MiB", TENANTS, &[]);
    // B's token opens only B.
    let (_s, replies) = raw_subscribe(&n, "token-b", "a", &[b""]).await;
    let Reply::Error { code, .. } = &replies[0] else {
        panic!("{:?}", replies[0])
    };
    assert_eq!(ErrorCode::from_u16(*code), ErrorCode::Unauthorized);
    let a = Client::connect(&n.tcp_url(), cfg("token-a", "a"))
        .await
        .unwrap();
    let b = Client::connect(&n.tcp_url(), cfg("token-b", "b"))
        .await
        .unwrap();
    let mut a_sub = a.kv_events(b"").await.unwrap();
    let mut b_sub = b.kv_events(b"").await.unwrap();
    for i in 0..50 {
        a.put(format!("same/{i}").as_bytes(), b"a").await.unwrap();
    }
    b.put(b"same/last", b"b").await.unwrap();
    let mut heard = Heard::new();
    hear_until(&mut b_sub, &mut heard, |h| !h.is_empty()).await;
    let mut a_heard = Heard::new();
    hear_until(&mut a_sub, &mut a_heard, |h| h.len() >= 50).await;
    assert_eq!(
        heard,
        [(KvEventKind::Stored, KvTier::Dram, b"same/last".to_vec())]
    );
    let a_keys: HashSet<Vec<u8>> = a_heard.into_iter().map(|(_, _, k)| k).collect();
    assert!(!a_keys.contains(&b"same/last"[..]));
    assert!(b_sub
        .next_within(Duration::from_millis(300))
        .await
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_of_an_older_version_is_refused_and_kept() {
    let n = Node::start("16MiB", &[]);
    let mut s = TcpStream::connect(n.tcp_url().trim_start_matches("tcp://"))
        .await
        .unwrap();
    let hello = Op::Hello {
        version: KV_EVENTS_VERSION - 1,
        token: String::new(),
        client: "older".into(),
    };
    send(&mut s, 1, hello, &[]).await;
    assert!(matches!(recv(&mut s).await.unwrap().reply, Reply::Hello(_)));
    let op = Op::KvEvents {
        ns: 0,
        prefix: Vec::new(),
    };
    send(&mut s, 2, op, &[]).await;
    let Reply::Error { code, .. } = recv(&mut s).await.unwrap().reply else {
        panic!("not refused")
    };
    assert_eq!(ErrorCode::from_u16(code), ErrorCode::UnsupportedVersion);
    send(&mut s, 3, Op::Stats, &[]).await;
    assert!(matches!(recv(&mut s).await.unwrap().reply, Reply::Stats(_)));
}
