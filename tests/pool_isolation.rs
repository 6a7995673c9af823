//! Real daemons: what one client does to pending allocations and to its namespace never takes
//! memory or bytes from another.
#![cfg(not(loom))]

mod common;

use std::time::Duration;

use common::raw::{hello, send_head};
use common::{value, Node};
use kvpool::protocol::{ErrorCode, Op, Reply};
use kvpool::GlobalAddr;
use kvpool_client::{Client, ClientConfig, ClientError, SameHost};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn remote(namespace: &str) -> ClientConfig {
    ClientConfig {
        same_host: SameHost::Off,
        namespace: namespace.into(),
        ..ClientConfig::default()
    }
}

fn code(e: ClientError) -> ErrorCode {
    e.code()
        .unwrap_or_else(|| panic!("expected a node error, got {e}"))
}

fn config(dir: &std::path::Path, toml: &str) -> String {
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, toml).unwrap();
    path.to_str().unwrap().to_string()
}

/// A raw connection, greeted, that can send a frame's header and only part of its payload.
async fn raw(n: &Node) -> TcpStream {
    let mut s = TcpStream::connect(&n.tcp).await.unwrap();
    hello(&mut s, "raw").await;
    s
}

/// One reply (its payload skipped); None when the node closed the connection.
async fn recv(s: &mut TcpStream) -> Option<Reply> {
    common::raw::recv(s).await.map(|r| r.reply)
}

/// True when the node closed `s` (within 10 s).
async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// A one-sided write that overlaps another connection's write still in flight into
/// the same pending allocation is refused with `Busy`; it is never given the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_one_sided_writes_are_refused_not_aliased() {
    let n = Node::start("16MiB", &[]);
    let c = Client::connect(&n.tcp_url(), remote("default"))
        .await
        .unwrap();
    const LEN: usize = 1 << 20;
    let v = value(11, LEN);
    let overlap = LEN / 4..LEN / 4 + 4096;
    // A's write may itself be refused when it opens while one of B's attempts is open (that
    // is the rule too): then the round starts again on a new allocation.
    let mut round = 0;
    let (a, mut s) = loop {
        round += 1;
        assert!(round <= 5, "connection A's write never opened");
        let key = format!("shared-target-{round}");
        let a: GlobalAddr = c.alloc(key.as_bytes(), LEN as u64).await.unwrap();
        // Connection A writes the first half, and stalls halfway through its payload.
        let mut s = raw(&n).await;
        let write = Op::Write { addr: a, offset: 0 };
        send_head(&mut s, 2, write, (LEN / 2) as u64).await;
        s.write_all(&v[..LEN / 4]).await.unwrap();
        s.flush().await.unwrap();
        // B overlaps A's range: refused once the node has opened A's write. (B writes what
        // A will, so an attempt that lands before A's write opens changes nothing.)
        let mut refused = false;
        for _ in 0..50 {
            match c.write(&a, overlap.start as u64, &v[overlap.clone()]).await {
                Ok(()) => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => {
                    assert_eq!(code(e), ErrorCode::Busy);
                    refused = true;
                    break;
                }
            }
        }
        if refused {
            break (a, s);
        }
        // Every attempt of B over 5 s got in: legitimate only if A's write was refused.
        s.write_all(&v[LEN / 4..LEN / 2]).await.unwrap();
        match recv(&mut s).await.unwrap() {
            Reply::Error { code, .. } if code == ErrorCode::Busy as u16 => continue,
            other => panic!("an overlapping write was let in beside an open one: A got {other:?}"),
        }
    };
    // B writes the other half: disjoint, so it proceeds.
    c.write(&a, (LEN / 2) as u64, &v[LEN / 2..]).await.unwrap();
    // Commit waits for A.
    s.write_all(&v[LEN / 4..LEN / 2]).await.unwrap();
    assert!(matches!(recv(&mut s).await.unwrap(), Reply::Done));
    c.commit(&a, kvpool::checksum(&v)).await.unwrap();
    let key = format!("shared-target-{round}");
    assert_eq!(c.get(key.as_bytes()).await.unwrap().unwrap(), v);
}

/// A Put or a one-sided Write whose payload stalls holds its allocation only until the
/// allocation's deadline (`pending_timeout_ms`), however long the connection stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_payloads_release_their_allocations_at_the_deadline() {
    let dir = common::temp_dir("stall");
    let cfg = config(&dir, "[memory]\npending_timeout_ms = 500\n");
    let n = Node::start("16MiB", &["--config", &cfg]);
    let c = Client::connect(&n.tcp_url(), remote("default"))
        .await
        .unwrap();
    // A Put announcing 8 MiB that sends 1 MiB and stops, and a Write into an allocation that
    // does the same; both sockets stay open on this side.
    let mut put = raw(&n).await;
    let op = Op::Put {
        ns: 0,
        key: b"stalled-put".to_vec(),
        checksum: 0,
        pin: false,
    };
    send_head(&mut put, 2, op, 8 << 20).await;
    put.write_all(&value(1, 1 << 20)).await.unwrap();
    let a = c.alloc(b"stalled-write", 4 << 20).await.unwrap();
    let mut write = raw(&n).await;
    send_head(&mut write, 2, Op::Write { addr: a, offset: 0 }, 4 << 20).await;
    write.write_all(&value(2, 1 << 20)).await.unwrap();
    let mut both = false;
    for _ in 0..50 {
        if c.stats().await.unwrap().pending == 2 {
            both = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(both, "{:?}", c.stats().await.unwrap());
    // Within a few reaper rounds past the deadline both are gone and their memory is free.
    let mut freed = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let s = c.stats().await.unwrap();
        if s.pending == 0 && s.used_bytes() == 0 {
            freed = true;
            break;
        }
    }
    assert!(freed, "{:?}", c.stats().await.unwrap());
    // The node gave up on both connections.
    assert!(closed(&mut put).await);
    assert!(closed(&mut write).await);
    // And the memory serves others: 12 MiB fit again.
    c.put(b"after", &value(3, 12 << 20)).await.unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

/// Filling and pinning `default`, and leaving another tenant's
/// allocations pending, neither evicts tenant B (within its quota) nor makes its puts fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_is_a_reservation_nobody_else_can_take() {
    let dir = common::temp_dir("reserve");
    let cfg = config(
        &dir,
        "[[namespace]]\nname = \"tenant-a\"\nquota = \"32MiB\"\n\n\
         [[namespace]]\nname = \"tenant-b\"\nquota = \"64MiB\"\n",
    );
    // default may use the 96 MiB nobody reserved.
    let n = Node::start("192MiB", &["--config", &cfg]);
    let d = Client::connect(&n.tcp_url(), remote("default"))
        .await
        .unwrap();
    let a = d.namespace("tenant-a").unwrap();
    let b = d.namespace("tenant-b").unwrap();
    const MIB: usize = 1 << 20;
    for i in 0..48u64 {
        b.put(format!("b-{i}").as_bytes(), &value(i, MIB))
            .await
            .unwrap();
    }
    // 200 MiB into default: it evicts its own objects only.
    for i in 0..200u64 {
        d.put(format!("d-{i}").as_bytes(), &value(1000 + i, MIB))
            .await
            .unwrap();
    }
    for i in 0..48u64 {
        assert_eq!(
            b.get(format!("b-{i}").as_bytes()).await.unwrap().as_deref(),
            Some(&value(i, MIB)[..]),
            "b's object {i} survived default's writes"
        );
    }
    // Try to pin 128 MiB in default: it may pin the 96 MiB nobody reserved.
    let mut pinned = 0;
    for i in 0..128u64 {
        match d
            .put_pinned(format!("p-{i}").as_bytes(), &value(i, MIB))
            .await
        {
            Ok(()) => pinned += 1,
            Err(e) => {
                assert_eq!(code(e), ErrorCode::PoolFull);
                break;
            }
        }
    }
    assert!((90..=96).contains(&pinned), "{pinned}");
    // A leaves its whole quota pending.
    let mut pending = 0;
    loop {
        match a.alloc(format!("a-{pending}").as_bytes(), MIB as u64).await {
            Ok(_) => pending += 1,
            Err(e) => {
                assert_eq!(code(e), ErrorCode::QuotaExceeded);
                break;
            }
        }
        assert!(pending <= 32);
    }
    // B still has its 64 MiB: new puts succeed (evicting only B's own objects) and the old
    // ones that fit stay.
    for i in 48..112u64 {
        b.put(format!("b-{i}").as_bytes(), &value(i, MIB))
            .await
            .unwrap_or_else(|e| panic!("b's put {i}: {e}"));
    }
    let s = b.stats().await.unwrap();
    let nb = s.namespaces.iter().find(|x| x.name == "tenant-b").unwrap();
    assert!(nb.used_bytes <= 64 << 20, "{nb:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `Clear` (the client's `remove_all`) removes every object of its own namespace, pinned ones
/// too, and nothing of another namespace; it counts what it removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clearing_a_namespace_removes_its_objects_only_pinned_too() {
    let dir = common::temp_dir("clear");
    let cfg = config(
        &dir,
        "[[namespace]]\nname = \"tenant-a\"\n\n[[namespace]]\nname = \"tenant-b\"\n",
    );
    let n = Node::start("64MiB", &["--config", &cfg]);
    let d = Client::connect(&n.tcp_url(), remote("default"))
        .await
        .unwrap();
    let (a, b) = (
        d.namespace("tenant-a").unwrap(),
        d.namespace("tenant-b").unwrap(),
    );
    for i in 0..30u64 {
        a.put(format!("k-{i}").as_bytes(), &value(i, 4096))
            .await
            .unwrap();
    }
    for i in 0..5u64 {
        a.put_pinned(format!("p-{i}").as_bytes(), &value(i, 4096))
            .await
            .unwrap();
        b.put(format!("k-{i}").as_bytes(), &value(i, 4096))
            .await
            .unwrap();
    }
    assert_eq!(a.remove_all().await.unwrap(), 35);
    assert!(!a.exists(b"k-0").await.unwrap());
    assert!(!a.exists(b"p-0").await.unwrap(), "pinned objects go too");
    let keys: Vec<Vec<u8>> = (0..5).map(|i| format!("k-{i}").into_bytes()).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    assert_eq!(
        b.batch_exists(&refs).await.unwrap(),
        5,
        "another namespace is untouched"
    );
    assert_eq!(a.remove_all().await.unwrap(), 0);
    assert_eq!(b.remove_all().await.unwrap(), 5);
}
