//! A tenant can only hurt itself: each test drives a real `kvpoold` as a hostile tenant would,
//! through a door that lets a peer make the node hold something (a staging area, a segment
//! descriptor, handoff leases, tombstones, watches, holds), and checks that the node survives,
//! that the hostile tenant meets its own bound (`LimitExceeded`, naming the setting, counted
//! in `kvpool_limit_refusals_total`) and that a second tenant is served throughout: a
//! [`Bystander`] puts and reads back values of its own for the whole of each test and must
//! never fail.
#![cfg(not(loom))]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::raw::{hello_with, recv, send, unix_call};
use common::{metric, value, Node};
use kvpool::protocol::{AllocItem, ErrorCode, Op, Reply, StagedCommit};
use kvpool_client::{Client, ClientConfig, SameHost};
use tokio::net::{TcpStream, UnixStream};

/// Two tenants, each in a segment of its own behind its own token.
const TENANTS: &str = "[[namespace]]\nname = \"a\"\ntokens = [\"token-a\"]\nquota = \"32MiB\"\n\n\
                       [[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\nquota = \"32MiB\"\n";

fn start(memory: &str, config: &str) -> Node {
    let dir = common::temp_dir("hostile");
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, config).unwrap();
    Node::start(memory, &["--config", path.to_str().unwrap()])
}

fn cfg(token: &str, ns: &str) -> ClientConfig {
    ClientConfig {
        token: token.into(),
        namespace: ns.into(),
        same_host: SameHost::Off,
        local_index: 0,
        timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    }
}

/// Tenant B at work while the test runs: puts a value, reads it back and compares, over and
/// over, recording every failure.
struct Bystander {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(u64, Vec<String>)>,
}

impl Bystander {
    async fn start(n: &Node, token: &str, ns: &str) -> Bystander {
        let c = Client::connect(&n.tcp_url(), cfg(token, ns)).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let (mut rounds, mut failures) = (0u64, Vec::new());
            while !flag.load(Ordering::Acquire) || rounds == 0 {
                let key = format!("bystander/{}", rounds % 64).into_bytes();
                let v = value(rounds, 4096 + (rounds as usize % 7) * 1000);
                match c.put(&key, &v).await {
                    Ok(()) => match c.get(&key).await {
                        Ok(Some(got)) if got == v => {}
                        other => failures.push(format!("get {rounds}: {other:?}")),
                    },
                    Err(e) => failures.push(format!("put {rounds}: {e}")),
                }
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (rounds, failures)
        });
        Bystander { stop, task }
    }

    /// Stops it and checks it was served every time.
    async fn served_throughout(self) {
        self.stop.store(true, Ordering::Release);
        let (rounds, failures) = self.task.await.unwrap();
        assert!(
            failures.is_empty(),
            "the second tenant was not served ({} of {rounds} rounds failed): {:?}",
            failures.len(),
            &failures[..failures.len().min(5)]
        );
    }
}

/// The error of a reply, as (code, message).
fn error_of(r: &Reply) -> Option<(ErrorCode, &str)> {
    match r {
        Reply::Error { code, message } => Some((ErrorCode::from_u16(*code), message.as_str())),
        _ => None,
    }
}

/// Checks that `r` is a `LimitExceeded` that names `setting`.
fn limit_exceeded(r: &Reply, setting: &str) {
    let (code, message) = error_of(r).unwrap_or_else(|| panic!("not refused: {r:?}"));
    assert_eq!(code, ErrorCode::LimitExceeded, "{message}");
    assert!(
        message.contains(setting),
        "{message} does not name {setting}"
    );
}

fn refusals(n: &Node, limit: &str) -> u64 {
    let series = format!("kvpool_limit_refusals_total{{limit=\"{limit}\"}}");
    metric(&n.scrape(), &series).unwrap_or(0)
}

/// A raw connection of `token`, with `ns`'s id.
async fn tcp_tenant(n: &Node, token: &str, ns: &str) -> (TcpStream, u32) {
    let mut s = TcpStream::connect(&n.tcp).await.unwrap();
    let h = hello_with(&mut s, token).await;
    let id = h.namespaces.iter().find(|(name, _)| name == ns).unwrap().1;
    (s, id)
}

async fn call(s: &mut TcpStream, id: u64, op: Op) -> Reply {
    send(s, id, op, &[]).await;
    recv(s).await.expect("a reply").reply
}

fn keys(tag: &str, range: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    range
        .map(|i| format!("{tag}/{i:08}").into_bytes())
        .collect()
}

/// A same-host writer shrinks the staging area the node handed it, then names a range of it
/// in `CommitStaged`: the area is sealed, so the shrink is refused and the node, which never
/// touches memory a client could have taken away, keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staging_area_cannot_be_shrunk_under_the_node() {
    let n = start("128MiB", TENANTS);
    let bystander = Bystander::start(&n, "token-b", "b").await;
    let mut s = UnixStream::connect(&n.unix).await.unwrap();
    let h = hello_with(&mut s, "token-a").await;
    let ns = h.namespaces.iter().find(|(name, _)| name == "a").unwrap().1;
    let (r, mut fds) = unix_call(&mut s, 2, Op::Staging).await;
    let Reply::Staging { id, len } = r else {
        panic!("{r:?}")
    };
    let area = std::fs::File::from(fds.pop().expect("the area's descriptor"));
    let v = value(1, 300_000);
    std::os::unix::fs::FileExt::write_all_at(&area, &v, 1 << 20).unwrap();
    // Each shrink is tried, then the commit names the range: whatever the area's size, the
    // node must survive it. Only then are the shrinks checked.
    let shrinks: Vec<_> = [len * 2, len / 2, 0]
        .into_iter()
        .map(|to| area.set_len(to).err().map(|e| e.kind()))
        .collect();
    let op = Op::Alloc {
        ns,
        items: vec![AllocItem {
            key: b"staged".to_vec(),
            len: v.len() as u64,
        }],
        pin: false,
        depths: Vec::new(),
    };
    let (r, _) = unix_call(&mut s, 3, op).await;
    let Reply::Allocated(a) = r else {
        panic!("{r:?}")
    };
    let commit = Op::CommitStaged {
        staging: id,
        items: vec![StagedCommit {
            addr: a[0].addr.expect("allocated"),
            offset: 1 << 20,
            checksum: kvpool::checksum::checksum(&v),
        }],
    };
    let (r, _) = unix_call(&mut s, 4, commit).await;
    assert!(matches!(&r, Reply::Statuses(st) if st == &[0]), "{r:?}");
    let c = Client::connect(&n.tcp_url(), cfg("token-a", "a"))
        .await
        .unwrap();
    assert!(
        c.get(b"staged").await.unwrap().as_deref() == Some(&v[..]),
        "wrong bytes"
    );
    bystander.served_throughout().await;
    let refused = Some(std::io::ErrorKind::PermissionDenied);
    assert_eq!(
        shrinks, [refused; 3],
        "the area is sealed against shrinking and growing"
    );
    assert_eq!(area.metadata().unwrap().len(), len);
}

/// A writer of an open namespace shrinks every segment descriptor the node hands it: the node
/// hands out none it could shrink (segments are read-only to every same-host client; values
/// go through staging areas), so every value stays readable and the node keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_writer_cannot_shrink_a_segment() {
    let config = "[[namespace]]\nname = \"a\"\n\n[[namespace]]\nname = \"b\"\n\
                  tokens = [\"token-b\"]\nquota = \"32MiB\"\n";
    let n = start("128MiB", config);
    let bystander = Bystander::start(&n, "token-b", "b").await;
    let c = Client::connect(&n.tcp_url(), cfg("", "a")).await.unwrap();
    let values: Vec<Vec<u8>> = (0..40).map(|i| value(100 + i, 20_000)).collect();
    for (i, v) in values.iter().enumerate() {
        c.put(format!("v{i}").as_bytes(), v).await.unwrap();
    }
    let mut s = UnixStream::connect(&n.unix).await.unwrap();
    hello_with(&mut s, "").await;
    let (r, fds) = unix_call(&mut s, 2, Op::MapInfo).await;
    let Reply::MapInfo { segments, .. } = r else {
        panic!("{r:?}")
    };
    assert!(
        !fds.is_empty(),
        "the open namespace's segments are handed out"
    );
    // Every descriptor is shrunk as far as it lets itself be; the node must serve on.
    let files: Vec<std::fs::File> = fds.into_iter().map(std::fs::File::from).collect();
    let shrunk: Vec<u32> = segments
        .iter()
        .zip(&files)
        .filter(|(_, f)| f.set_len(4096).is_ok())
        .map(|(m, _)| m.id)
        .collect();
    for (i, v) in values.iter().enumerate() {
        let got = c.get(format!("v{i}").as_bytes()).await.unwrap();
        assert!(got.as_deref() == Some(&v[..]), "v{i}");
    }
    let fresh = value(7, 50_000);
    c.put(b"fresh", &fresh).await.unwrap();
    assert!(
        c.get(b"fresh").await.unwrap().as_deref() == Some(&fresh[..]),
        "wrong bytes"
    );
    // A same-host writer of the open namespace still puts and reads back, through its area.
    let local = ClientConfig {
        same_host: SameHost::Auto,
        ..cfg("", "a")
    };
    let w = Client::connect(&n.tcp_url(), local).await.unwrap();
    assert!(w.is_local());
    let big = value(8, 3 << 20);
    w.put(b"same-host", &big).await.unwrap();
    assert!(
        c.get(b"same-host").await.unwrap().as_deref() == Some(&big[..]),
        "wrong bytes"
    );
    bystander.served_throughout().await;
    assert_eq!(shrunk, Vec::<u32>::new(), "segments shrunk by a client");
    assert!(segments.iter().all(|m| !m.writable), "{segments:?}");
}

/// Tenant A leases a million never-written keys of its own namespace: it meets its
/// namespace's bound, and tenant B's lease on its own key is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_leases_are_bounded_per_namespace() {
    let n = start("128MiB", TENANTS);
    let bystander = Bystander::start(&n, "token-b", "b").await;
    let (mut a, ns_a) = tcp_tenant(&n, "token-a", "a").await;
    let mut refused = None;
    for batch in 0..64 {
        let op = Op::Expire {
            ns: ns_a,
            keys: keys("lease", batch * 16_384..(batch + 1) * 16_384),
            ttl_ms: 600_000,
        };
        let r = call(&mut a, batch as u64 + 2, op).await;
        if error_of(&r).is_some() {
            refused = Some(r);
            break;
        }
    }
    let r = refused.expect("a million leases taken by one namespace");
    limit_exceeded(&r, "limits.max_leases_per_namespace");
    assert!(refusals(&n, "leases_per_namespace") >= 1);
    let b = Client::connect(&n.tcp_url(), cfg("token-b", "b"))
        .await
        .unwrap();
    b.put(b"leased", b"v").await.unwrap();
    assert_eq!(
        b.expire(&[b"leased"], Duration::from_millis(300))
            .await
            .unwrap(),
        1
    );
    // B's lease is kept: its object goes when it lapses.
    let mut gone = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if b.get(b"leased").await.unwrap().is_none() {
            gone = true;
            break;
        }
    }
    assert!(gone, "B's lease did not lapse");
    bystander.served_throughout().await;
}

/// Tenant A posts 70 000 tombstones in its own namespace: B's tombstone stays, and B's
/// consumer, waiting on the failed key, is told `Failed` with B's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_are_bounded_per_namespace() {
    let n = start("128MiB", TENANTS);
    let bystander = Bystander::start(&n, "token-b", "b").await;
    let b = Client::connect(&n.tcp_url(), cfg("token-b", "b"))
        .await
        .unwrap();
    assert_eq!(b.fail(&[b"b-block"], "prefill died").await.unwrap(), 1);
    let (mut a, ns_a) = tcp_tenant(&n, "token-a", "a").await;
    let mut refused = None;
    for batch in 0..5 {
        let op = Op::Fail {
            ns: ns_a,
            keys: keys("tomb", batch * 14_000..(batch + 1) * 14_000),
            reason: "flood".into(),
        };
        let r = call(&mut a, batch as u64 + 2, op).await;
        if error_of(&r).is_some() {
            refused = Some(r);
            break;
        }
    }
    let r = refused.expect("70 000 tombstones taken by one namespace");
    limit_exceeded(&r, "limits.max_tombstones_per_namespace");
    assert!(refusals(&n, "tombstones_per_namespace") >= 1);
    let out = b
        .wait(&[b"b-block"], Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(
        out.failed,
        vec![(b"b-block".to_vec(), "prefill died".to_string())],
        "{out:?}"
    );
    bystander.served_throughout().await;
}

/// 16 connections each watch 65 536 keys, then close: the node's watch gauge and its memory
/// return to where they were, round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_are_released_with_their_connections() {
    let config = format!("{TENANTS}\n[limits]\nmax_watches_per_namespace = 1048576\n");
    let n = start("128MiB", &config);
    let bystander = Bystander::start(&n, "token-b", "b").await;
    let watched = |n: &Node| metric(&n.scrape(), "kvpool_resources{resource=\"watches\"}");
    // A small round first, so that what every connection costs once (buffers, the runtime's
    // own tables) is in the baseline.
    watch_round(&n, 2, 4096).await;
    settle(&n, &watched).await;
    let baseline = n.rss();
    for round in 0..3 {
        watch_round(&n, 16, 65_536).await;
        settle(&n, &watched).await;
        // The node gives freed memory back within a second or two (its trim task looks once
        // a second); a round holds about 200 MiB at its peak, what stays is the allocator's
        // slack.
        let mut rss = n.rss();
        for _ in 0..100 {
            if rss < baseline + (32 << 20) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            rss = n.rss();
        }
        println!(
            "round {round}: RSS {} MiB, baseline {} MiB",
            rss >> 20,
            baseline >> 20
        );
        assert!(
            rss < baseline + (32 << 20),
            "round {round}: the node kept {} MiB after its watchers left",
            (rss.saturating_sub(baseline)) >> 20
        );
    }
    bystander.served_throughout().await;
}

/// `conns` connections of tenant A, each watching `per_conn` keys, all open at once; then all
/// closed.
async fn watch_round(n: &Node, conns: usize, per_conn: usize) {
    let mut open = Vec::new();
    for c in 0..conns {
        let (mut s, ns) = tcp_tenant(n, "token-a", "a").await;
        for (i, start) in (0..per_conn).step_by(16_384).enumerate() {
            let end = (start + 16_384).min(per_conn);
            let op = Op::Watch {
                ns,
                keys: keys(&format!("watch-{c}"), start..end),
            };
            let r = call(&mut s, i as u64 + 2, op).await;
            assert!(matches!(r, Reply::Statuses(_)), "{r:?}");
        }
        open.push(s);
    }
    let page = n.scrape();
    assert_eq!(
        metric(&page, "kvpool_resources{resource=\"watches\"}"),
        Some((conns * per_conn) as u64)
    );
    println!(
        "{conns} × {per_conn} watches open: RSS {} MiB",
        n.rss() >> 20
    );
    drop(open);
}

/// Waits until the node has let go of every watch.
async fn settle(n: &Node, watched: &impl Fn(&Node) -> Option<u64>) {
    for _ in 0..200 {
        if watched(n) == Some(0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("watches outlived their connections: {:?}", watched(n));
}

/// A same-host reader holds every version of a key while an honest writer overwrites it: the
/// reader meets its namespace's bound on held bytes, and the writer's overwrites and new keys
/// all find memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_cannot_park_the_pool() {
    let config = "[[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\nquota = \"16MiB\"\n";
    let n = start("128MiB", config);
    let bystander = Bystander::start(&n, "token-b", "b").await;
    let writer = Client::connect(&n.tcp_url(), cfg("", "default"))
        .await
        .unwrap();
    let mut reader = UnixStream::connect(&n.unix).await.unwrap();
    let h = hello_with(&mut reader, "").await;
    let ns = h
        .namespaces
        .iter()
        .find(|(name, _)| name == "default")
        .unwrap()
        .1;
    let (mut held, mut refused) = (0, None);
    for i in 0..150u64 {
        let v = value(i, 1 << 20);
        writer.put(b"hot", &v).await.expect("an honest overwrite");
        let op = Op::Hold {
            ns,
            keys: vec![b"hot".to_vec()],
        };
        let (r, _) = unix_call(&mut reader, i + 2, op).await;
        match r {
            Reply::Located(_) => held += 1,
            r => refused = Some(r),
        }
    }
    println!("the reader held {held} versions");
    let r = refused.expect("the reader parked 150 MiB in a 112 MiB namespace");
    limit_exceeded(&r, "limits.max_held_share");
    assert!(refusals(&n, "held_share") >= 1);
    for i in 0..20u64 {
        let v = value(1000 + i, 1 << 20);
        let key = format!("new/{i}");
        writer.put(key.as_bytes(), &v).await.expect("a new key");
        assert!(
            writer.get(key.as_bytes()).await.unwrap().as_deref() == Some(&v[..]),
            "wrong bytes"
        );
    }
    drop(reader);
    bystander.served_throughout().await;
}
