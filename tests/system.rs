//! Whole-system tests: real `kvpoold` processes on loopback, driven through the client library
//! and through raw bytes.
#![cfg(not(loom))]

mod common;

use std::time::Duration;

use common::raw::{recv, send};
use common::{value, Node};
use kvpool::protocol::{
    ErrorCode, Exchange, FramePrefix, Op, PutItem, Reply, Response, MIN_PROTOCOL_VERSION,
    MISS_VERSION, PROTOCOL_VERSION,
};
use kvpool::GlobalAddr;
use kvpool_client::{Client, ClientConfig, ClientError, SameHost};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn remote() -> ClientConfig {
    ClientConfig {
        same_host: SameHost::Off,
        ..ClientConfig::default()
    }
}

async fn tcp_client(n: &Node) -> Client {
    Client::connect(&n.tcp_url(), remote()).await.unwrap()
}

fn code(e: ClientError) -> ErrorCode {
    e.code()
        .unwrap_or_else(|| panic!("expected a node error, got {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_over_every_transport() {
    let n = Node::start("64MiB", &[]);
    let quic_cfg = ClientConfig {
        ca: Some(n.cert()),
        ..remote()
    };
    let clients = [
        (
            "tcp",
            Client::connect(&n.tcp_url(), remote()).await.unwrap(),
        ),
        (
            "quic",
            Client::connect(&n.quic_url(), quic_cfg).await.unwrap(),
        ),
        (
            "unix",
            Client::connect(&n.unix_url(), remote()).await.unwrap(),
        ),
        (
            "local",
            Client::connect(&n.tcp_url(), ClientConfig::default())
                .await
                .unwrap(),
        ),
    ];
    assert!(
        clients[3].1.is_local(),
        "a client on the same host maps the segments"
    );
    assert!(!clients[0].1.is_local());
    for (i, (name, c)) in clients.iter().enumerate() {
        for (j, len) in [0usize, 1, 4096, 64 << 10, 3 << 20].into_iter().enumerate() {
            let key = format!("{name}-{j}");
            let v = value((i * 10 + j) as u64, len);
            c.put(key.as_bytes(), &v).await.unwrap();
            // Every transport reads what every other wrote.
            for (_, other) in &clients {
                assert_eq!(
                    other.get(key.as_bytes()).await.unwrap().as_deref(),
                    Some(&v[..]),
                    "{name} {len}"
                );
            }
        }
        assert_eq!(c.get(b"absent").await.unwrap(), None);
    }
    // QUIC without a trusted CA is refused; with insecure_skip_verify it connects.
    assert!(Client::connect(&n.quic_url(), remote()).await.is_err());
    let insecure = ClientConfig {
        insecure_skip_verify: true,
        ..remote()
    };
    assert!(Client::connect(&n.quic_url(), insecure).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_one_round_trip_and_fill_caller_buffers() {
    let n = Node::start("64MiB", &[]);
    for cfg in [remote(), ClientConfig::default()] {
        let c = Client::connect(&n.tcp_url(), cfg).await.unwrap();
        let keys: Vec<Vec<u8>> = (0..32u32)
            .map(|i| format!("b{i}-{}", c.is_local()).into_bytes())
            .collect();
        let vals: Vec<Vec<u8>> = (0..32).map(|i| value(i, 100_000 + i as usize)).collect();
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&vals)
            .take(20)
            .map(|(k, v)| (&k[..], &v[..]))
            .collect();
        let codes = c.batch_put_from(&items).await.unwrap();
        assert!(codes.iter().all(|c| *c == ErrorCode::Ok), "{codes:?}");
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        assert_eq!(c.batch_exists(&refs).await.unwrap(), 20);
        let mut bufs: Vec<Vec<u8>> = (0..32).map(|_| vec![0u8; 200_000]).collect();
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
        for i in 0..32 {
            if i < 20 {
                assert_eq!(got[i], Some(vals[i].len()));
                assert_eq!(&bufs[i][..vals[i].len()], &vals[i][..]);
            } else {
                assert_eq!(got[i], None);
            }
        }
        // A buffer too small is an error, and the connection stays usable.
        let mut small = vec![0u8; 10];
        let e = c.get_into(&keys[0], &mut small).await.unwrap_err();
        assert!(matches!(e, ClientError::BufferTooSmall { .. }), "{e}");
        assert!(c.exists(&keys[0]).await.unwrap());

        // Scattered: each value over pieces of uneven sizes, filled in order (twice: the
        // second time on the same host from the client's own index, checked as current).
        for _ in 0..2 {
            let mut bufs: Vec<Vec<u8>> = (0..22).map(|_| vec![0u8; 200_000]).collect();
            let mut dsts: Vec<Vec<&mut [u8]>> = bufs
                .iter_mut()
                .map(|b| {
                    let (a, rest) = b.split_at_mut(7);
                    let (b2, rest) = rest.split_at_mut(4096);
                    let (c3, d4) = rest.split_at_mut(60_000);
                    vec![a, b2, c3, d4]
                })
                .collect();
            let got = c.batch_get_scatter(&refs[..22], &mut dsts).await.unwrap();
            for i in 0..22 {
                if i < 20 {
                    assert_eq!(got[i], Some(vals[i].len()), "{i}");
                    assert_eq!(&bufs[i][..vals[i].len()], &vals[i][..], "{i}");
                    assert!(bufs[i][vals[i].len()..].iter().all(|&b| b == 0));
                } else {
                    assert_eq!(got[i], None);
                }
            }
        }
        // Pieces smaller than the value together: an error, the connection usable after.
        let mut a = vec![0u8; 50_000];
        let mut b = vec![0u8; 40_000];
        let mut short = vec![vec![&mut a[..], &mut b[..]]];
        let e = c
            .batch_get_scatter(&refs[..1], &mut short)
            .await
            .unwrap_err();
        assert!(matches!(e, ClientError::BufferTooSmall { .. }), "{e}");
        assert!(c.exists(&keys[0]).await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_put_and_one_sided_reads_check_keys_bounds_and_generations() {
    let n = Node::start("64MiB", &[]);
    for cfg in [remote(), ClientConfig::default()] {
        let c = Client::connect(&n.tcp_url(), cfg).await.unwrap();
        let key = format!("tp-{}", c.is_local());
        let v = value(5, 1 << 20);
        let a = c.alloc(key.as_bytes(), v.len() as u64).await.unwrap();
        c.write(&a, 0, &v[..1000]).await.unwrap();
        c.write(&a, 1000, &v[1000..]).await.unwrap();
        assert_eq!(
            c.get(key.as_bytes()).await.unwrap(),
            None,
            "invisible before commit"
        );
        let e = c.commit(&a, kvpool::checksum(b"wrong")).await.unwrap_err();
        assert_eq!(code(e), ErrorCode::ChecksumMismatch);
        let a = c.alloc(key.as_bytes(), v.len() as u64).await.unwrap();
        c.write(&a, 0, &v).await.unwrap();
        c.commit(&a, kvpool::checksum(&v)).await.unwrap();
        assert_eq!(c.get(key.as_bytes()).await.unwrap().unwrap(), v);

        let loc = c.lease(&[key.as_bytes()], 1000).await.unwrap()[0].unwrap();
        let mut buf = vec![0u8; 4096];
        assert!(c.read(&loc.addr, 8192, &mut buf).await.unwrap());
        assert_eq!(&buf[..], &v[8192..8192 + 4096]);
        let remote_c = tcp_client(&n).await;
        let mut b = vec![0u8; 16];
        for (bad, want) in [
            (
                GlobalAddr {
                    key: loc.addr.key ^ 1,
                    ..loc.addr
                },
                ErrorCode::WrongKey,
            ),
            (
                GlobalAddr {
                    len: loc.addr.len * 2,
                    ..loc.addr
                },
                ErrorCode::WrongKey,
            ),
            (
                GlobalAddr {
                    offset: loc.addr.offset + 512,
                    ..loc.addr
                },
                ErrorCode::WrongKey,
            ),
            (
                GlobalAddr {
                    segment: 7,
                    ..loc.addr
                },
                ErrorCode::NoSegment,
            ),
            (
                GlobalAddr {
                    node: kvpool::NodeId(3),
                    ..loc.addr
                },
                ErrorCode::WrongNode,
            ),
        ] {
            assert_eq!(
                code(remote_c.read(&bad, 0, &mut b).await.unwrap_err()),
                want,
                "{bad:?}"
            );
        }
        let mut big = vec![0u8; 100];
        assert_eq!(
            code(
                remote_c
                    .read(&loc.addr, (1 << 20) - 50, &mut big)
                    .await
                    .unwrap_err()
            ),
            ErrorCode::OutOfBounds
        );
        c.release(&[key.as_bytes()]).await.unwrap();
        assert!(c.remove(key.as_bytes()).await.unwrap());
        assert!(
            !c.read(&loc.addr, 0, &mut buf).await.unwrap(),
            "a removed object reads as a miss"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_pressure_keeps_pins() {
    let n = Node::start("16MiB", &[]);
    let c = tcp_client(&n).await;
    let pinned = value(99, 1 << 20);
    c.put_pinned(b"weights-0", &pinned).await.unwrap();
    c.put(b"weights-1", &pinned).await.unwrap();
    assert_eq!(c.pin(&[b"weights-1"]).await.unwrap(), 1);
    for i in 0..64u64 {
        c.put(format!("kv{i}").as_bytes(), &value(i, 1 << 20))
            .await
            .unwrap();
    }
    let s = c.stats().await.unwrap();
    assert!(s.evictions >= 40, "{s:?}");
    assert!(s.used_bytes() <= s.capacity());
    assert_eq!(c.get(b"weights-0").await.unwrap().unwrap(), pinned);
    assert_eq!(c.get(b"weights-1").await.unwrap().unwrap(), pinned);
    assert_eq!(c.get(b"kv63").await.unwrap().unwrap(), value(63, 1 << 20));
    assert_eq!(
        c.get(b"kv0").await.unwrap(),
        None,
        "the oldest were evicted"
    );
    assert_eq!(s.namespaces[0].pinned_bytes, 2 << 20);
    // A pool full of pins refuses with a clear error and keeps serving.
    for i in 0..64u64 {
        let _ = c
            .put_pinned(format!("w{i}").as_bytes(), &value(i, 1 << 20))
            .await;
    }
    let e = c.put(b"one-more", &value(1, 1 << 20)).await.unwrap_err();
    assert_eq!(code(e), ErrorCode::PoolFull);
    assert_eq!(c.get(b"weights-0").await.unwrap().unwrap(), pinned);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_are_isolated_and_quotas_hold() {
    let dir = common::temp_dir("ns");
    let cfg = dir.join("kvpoold.toml");
    std::fs::write(&cfg, "[[namespace]]\nname = \"tenant-a\"\n\n[[namespace]]\nname = \"tenant-b\"\nquota = \"2MiB\"\n").unwrap();
    let n = Node::start("32MiB", &["--config", cfg.to_str().unwrap()]);
    let a = Client::connect(
        &n.tcp_url(),
        ClientConfig {
            namespace: "tenant-a".into(),
            ..remote()
        },
    )
    .await
    .unwrap();
    let b = a.namespace("tenant-b").unwrap();
    a.put(b"same-key", b"from a").await.unwrap();
    b.put(b"same-key", b"from b").await.unwrap();
    assert_eq!(a.get(b"same-key").await.unwrap().unwrap(), b"from a");
    assert_eq!(b.get(b"same-key").await.unwrap().unwrap(), b"from b");
    assert!(b.remove(b"same-key").await.unwrap());
    assert_eq!(a.get(b"same-key").await.unwrap().unwrap(), b"from a");
    for i in 0..8u64 {
        b.put(format!("q{i}").as_bytes(), &value(i, 512 << 10))
            .await
            .unwrap();
    }
    let s = b.stats().await.unwrap();
    let nb = s.namespaces.iter().find(|x| x.name == "tenant-b").unwrap();
    assert!(nb.used_bytes <= 2 << 20, "{nb:?}");
    assert!(
        a.exists(b"same-key").await.unwrap(),
        "b's quota evicted only b's objects"
    );
    let e = Client::connect(
        &n.tcp_url(),
        ClientConfig {
            namespace: "tenant-c".into(),
            ..remote()
        },
    )
    .await
    .err()
    .unwrap();
    assert!(matches!(e, ClientError::UnknownNamespace(_)), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_serves_again_and_old_addresses_are_refused() {
    let mut n = Node::start("16MiB", &[]);
    let c = tcp_client(&n).await;
    c.put(b"k", &value(1, 100_000)).await.unwrap();
    let old = c.lease(&[b"k"], 0).await.unwrap()[0].unwrap();
    let addrs = [n.tcp.clone(), n.quic.clone(), n.metrics.clone()];
    let status = n.stop();
    assert!(status.success(), "SIGTERM exits cleanly: {status:?}");
    assert!(
        !std::path::Path::new(&n.unix).exists(),
        "socket removed on exit"
    );
    let segs = std::fs::read_dir(&n.dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "kvp")
        })
        .count();
    assert_eq!(segs, 1, "segment files kept on exit, for the next life");
    let n2 = Node::start_in(
        n.dir.clone(),
        "16MiB",
        &[],
        &[addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()],
    );
    let c2 = tcp_client(&n2).await;
    assert_eq!(
        c2.get(b"k").await.unwrap(),
        Some(value(1, 100_000)),
        "a restarted node comes back with its objects"
    );
    let mut buf = vec![0u8; 16];
    let e = c2.read(&old.addr, 0, &mut buf).await.unwrap_err();
    assert_eq!(
        code(e),
        ErrorCode::WrongIncarnation,
        "addresses from before the restart are refused"
    );
    c2.put(b"k", b"again").await.unwrap();
    assert_eq!(c2.get(b"k").await.unwrap().unwrap(), b"again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_read_exactly_what_they_wrote() {
    let n = Node::start("32MiB", &[]);
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let cfg = if t % 2 == 0 {
            remote()
        } else {
            ClientConfig::default()
        };
        let c = Client::connect(&n.tcp_url(), cfg).await.unwrap();
        tasks.push(tokio::spawn(async move {
            let mut hits = 0;
            for i in 0..150u64 {
                let key = format!("c{}", (t * 7 + i) % 40);
                let v = value(t * 1000 + i, 32 << 10);
                c.put(key.as_bytes(), &v).await.unwrap();
                // Another task may have overwritten it: the value must be one that some task
                // wrote in full, which the checksum check inside get guarantees.
                if let Some(got) = c.get(key.as_bytes()).await.unwrap() {
                    assert_eq!(got.len(), 32 << 10);
                    hits += 1;
                }
            }
            hits
        }));
    }
    let mut hits = 0;
    for t in tasks {
        hits += t.await.unwrap();
    }
    assert!(hits > 1000, "{hits}");
}

// ----- bad input, as raw bytes -----

async fn raw_conn(n: &Node) -> TcpStream {
    TcpStream::connect(&n.tcp).await.unwrap()
}

fn error_code(r: &Response) -> ErrorCode {
    match &r.reply {
        Reply::Error { code, .. } => ErrorCode::from_u16(*code),
        other => panic!("expected an error, got {other:?}"),
    }
}

async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

async fn hello(s: &mut TcpStream, token: &str) -> Response {
    send(
        s,
        1,
        Op::Hello {
            version: PROTOCOL_VERSION,
            token: token.into(),
            client: "raw".into(),
        },
        &[],
    )
    .await;
    recv(s).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_the_node_keeps_serving() {
    let n = Node::start("16MiB", &[]);
    let good = tcp_client(&n).await;
    good.put(b"k", b"v").await.unwrap();

    // Garbage: not our magic. Answered, then closed.
    let mut s = raw_conn(&n).await;
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::Malformed
    );
    assert!(closed(&mut s).await);

    // A header over the limit: refused before a byte of it is buffered.
    let mut s = raw_conn(&n).await;
    s.write_all(
        &FramePrefix {
            header_len: u32::MAX,
            payload_len: 0,
        }
        .encode(),
    )
    .await
    .unwrap();
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::FrameTooLarge
    );
    assert!(closed(&mut s).await);

    // A payload over the limit.
    let mut s = raw_conn(&n).await;
    s.write_all(
        &FramePrefix {
            header_len: 64,
            payload_len: u64::MAX,
        }
        .encode(),
    )
    .await
    .unwrap();
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::FrameTooLarge
    );

    // A request before the handshake.
    let mut s = raw_conn(&n).await;
    send(&mut s, 9, Op::Stats, &[]).await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::HandshakeRequired
    );
    assert!(closed(&mut s).await);

    // Protocol versions: newer than this build's, or older than the oldest it accepts, are
    // refused and the connection closed; the oldest accepted one is answered in that version.
    for version in [999, PROTOCOL_VERSION + 1, MIN_PROTOCOL_VERSION - 1] {
        let mut s = raw_conn(&n).await;
        let other = Op::Hello {
            version,
            token: String::new(),
            client: "other version".into(),
        };
        send(&mut s, 1, other, &[]).await;
        assert_eq!(
            error_code(&recv(&mut s).await.unwrap()),
            ErrorCode::UnsupportedVersion,
            "version {version}"
        );
        assert!(closed(&mut s).await, "version {version}");
    }
    let mut s = raw_conn(&n).await;
    let older = Op::Hello {
        version: MIN_PROTOCOL_VERSION,
        token: String::new(),
        client: "older client".into(),
    };
    send(&mut s, 1, older, &[]).await;
    match recv(&mut s).await.unwrap().reply {
        Reply::Hello(h) => assert_eq!(h.version, MIN_PROTOCOL_VERSION),
        r => panic!("an older client's Hello answered {r:?}"),
    }
    send(&mut s, 2, Op::Stats, &[]).await;
    assert!(matches!(recv(&mut s).await.unwrap().reply, Reply::Stats(_)));
    // An absent key is an error to a client of a version before `Miss`, a reply from it on.
    let absent = || Op::Get {
        ns: 0,
        key: b"absent".to_vec(),
    };
    send(&mut s, 3, absent(), &[]).await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::NotFound
    );
    let mut s = raw_conn(&n).await;
    let knows_miss = Op::Hello {
        version: MISS_VERSION,
        token: String::new(),
        client: "current client".into(),
    };
    send(&mut s, 1, knows_miss, &[]).await;
    assert!(matches!(recv(&mut s).await.unwrap().reply, Reply::Hello(_)));
    send(&mut s, 2, absent(), &[]).await;
    let r = recv(&mut s).await.unwrap();
    assert_eq!((r.id, r.reply), (2, Reply::Miss));

    // A header that fails validation, with a payload: answered, payload skipped, stream in sync.
    let mut s = raw_conn(&n).await;
    assert!(matches!(hello(&mut s, "").await.reply, Reply::Hello(_)));
    let junk = [0xA5u8; 64];
    s.write_all(
        &FramePrefix {
            header_len: 64,
            payload_len: 5,
        }
        .encode(),
    )
    .await
    .unwrap();
    s.write_all(&junk).await.unwrap();
    s.write_all(b"12345").await.unwrap();
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::Malformed
    );
    // Unknown namespace, bad keys, oversized batches, wrong payload sizes: each answered in turn
    // on the same connection.
    send(
        &mut s,
        2,
        Op::Put {
            ns: 99,
            key: b"k".to_vec(),
            checksum: 0,
            pin: false,
        },
        b"abc",
    )
    .await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::UnknownNamespace
    );
    send(
        &mut s,
        3,
        Op::Put {
            ns: 0,
            key: vec![1; 300],
            checksum: 0,
            pin: false,
        },
        b"abc",
    )
    .await;
    assert_eq!(error_code(&recv(&mut s).await.unwrap()), ErrorCode::BadKey);
    send(
        &mut s,
        4,
        Op::Put {
            ns: 0,
            key: b"x".to_vec(),
            checksum: 12345,
            pin: false,
        },
        b"abc",
    )
    .await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::ChecksumMismatch
    );
    send(
        &mut s,
        5,
        Op::Exists {
            ns: 0,
            keys: vec![b"k".to_vec(); 20_000],
        },
        &[],
    )
    .await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::BatchTooLarge
    );
    // Commit and Abort obey the batch limit like every other batch (they did not).
    let addr = kvpool::GlobalAddr {
        node: kvpool::NodeId(0),
        incarnation: 1,
        segment: 0,
        offset: 0,
        len: 1,
        generation: 1,
        key: 0,
    };
    let commits = vec![kvpool::protocol::CommitItem { addr, checksum: 0 }; 20_000];
    send(&mut s, 50, Op::Commit { items: commits }, &[]).await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::BatchTooLarge
    );
    send(
        &mut s,
        51,
        Op::Abort {
            addrs: vec![addr; 20_000],
        },
        &[],
    )
    .await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::BatchTooLarge
    );
    let items = vec![PutItem {
        key: b"a".to_vec(),
        len: 10,
        checksum: 0,
    }];
    send(
        &mut s,
        6,
        Op::BatchPut {
            ns: 0,
            items,
            pin: false,
            depths: Vec::new(),
        },
        b"only7by",
    )
    .await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::PayloadMismatch
    );
    send(
        &mut s,
        7,
        Op::Get {
            ns: 0,
            key: b"k".to_vec(),
        },
        b"unexpected",
    )
    .await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::PayloadMismatch
    );
    send(&mut s, 8, Op::MapInfo, &[]).await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::NotLocal,
        "segments only over the Unix socket"
    );
    send(
        &mut s,
        9,
        Op::Put {
            ns: 0,
            key: b"huge".to_vec(),
            checksum: 0,
            pin: false,
        },
        &vec![0u8; 17 << 20],
    )
    .await;
    assert_eq!(
        error_code(&recv(&mut s).await.unwrap()),
        ErrorCode::TooLarge
    );
    send(
        &mut s,
        10,
        Op::Get {
            ns: 0,
            key: b"k".to_vec(),
        },
        &[],
    )
    .await;
    let r = recv(&mut s).await.unwrap();
    assert_eq!(r.id, 10);
    assert!(matches!(r.reply, Reply::Value { len: 1, .. }), "{r:?}");

    // A connection that vanishes mid-payload leaves nothing behind.
    let mut s = raw_conn(&n).await;
    hello(&mut s, "").await;
    let torn = Op::Put {
        ns: 0,
        key: b"torn".to_vec(),
        checksum: 0,
        pin: false,
    };
    let out = Exchange::new().request_as(2, torn);
    s.write_all(&out.prefix(1 << 20)).await.unwrap();
    s.write_all(&out.header).await.unwrap();
    s.write_all(&[1u8; 1000]).await.unwrap();
    drop(s);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = good.stats().await.unwrap();
    assert_eq!(st.pending, 0, "the torn put was aborted");
    assert_eq!(good.get(b"torn").await.unwrap(), None);

    // Through all of it, everyone else was served.
    assert_eq!(good.get(b"k").await.unwrap().unwrap(), b"v");
    let m = n.scrape();
    let errors: u64 = m
        .lines()
        .find(|l| l.starts_with("kvpool_protocol_errors_total"))
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(errors >= 3, "{errors}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_tokens_are_enforced() {
    let n = Node::start("16MiB", &["--token", "s3cret"]);
    let mut s = raw_conn(&n).await;
    assert_eq!(
        error_code(&hello(&mut s, "wrong").await),
        ErrorCode::Unauthorized
    );
    assert!(closed(&mut s).await);
    let e = Client::connect(&n.tcp_url(), remote()).await.err().unwrap();
    assert_eq!(code(e), ErrorCode::Unauthorized);
    let c = Client::connect(
        &n.tcp_url(),
        ClientConfig {
            token: "s3cret".into(),
            ..remote()
        },
    )
    .await
    .unwrap();
    c.put(b"k", b"v").await.unwrap();
}

/// Wrong tokens are counted per peer address: past `[limits] auth_failures` in a row, the
/// address's attempts are refused unchecked (the right token too, or the refusal would still
/// answer guesses) until it has waited, at every door; other addresses are not affected, and
/// both are counted in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_are_throttled_per_address() {
    let dir = common::temp_dir("auth-throttle");
    let cfg = dir.join("kvpoold.toml");
    std::fs::write(
        &cfg,
        "[limits]\nauth_failures = 3\nauth_failure_refill_ms = 60000\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let n = Node::start(
        "16MiB",
        &[
            "--token",
            "s3cret",
            "--config",
            cfg,
            "--resp",
            "127.0.0.1:0",
        ],
    );
    let message = |r: &kvpool::protocol::Response| match &r.reply {
        Reply::Error { message, .. } => message.clone(),
        other => panic!("expected an error, got {other:?}"),
    };
    for _ in 0..3 {
        let mut s = raw_conn(&n).await;
        let r = hello(&mut s, "guess").await;
        assert_eq!(error_code(&r), ErrorCode::Unauthorized);
        assert!(message(&r).contains("wrong or missing"), "{}", message(&r));
    }
    let mut s = raw_conn(&n).await;
    let r = hello(&mut s, "s3cret").await;
    assert_eq!(error_code(&r), ErrorCode::Unauthorized);
    assert!(
        message(&r).contains("too many failed authentications"),
        "{}",
        message(&r)
    );
    // The RESP door shares the count.
    let mut resp = TcpStream::connect(&n.resp).await.unwrap();
    resp.write_all(b"*2\r\n$4\r\nAUTH\r\n$6\r\ns3cret\r\n")
        .await
        .unwrap();
    let mut line = vec![0u8; 256];
    let got = tokio::time::timeout(Duration::from_secs(10), resp.read(&mut line))
        .await
        .unwrap()
        .unwrap();
    let line = String::from_utf8_lossy(&line[..got]).into_owned();
    assert!(
        line.starts_with("-ERR kvpool: too many failed authentications"),
        "{line}"
    );
    // Another address is not affected.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = sock.connect(n.tcp.parse().unwrap()).await.unwrap();
    let r = hello(&mut other, "s3cret").await;
    assert!(matches!(r.reply, Reply::Hello(_)), "{:?}", r.reply);
    let page = n.scrape();
    assert!(
        page.lines().any(|l| l == "kvpool_auth_failures_total 3"),
        "{page}"
    );
    assert!(
        page.lines().any(|l| l == "kvpool_auth_throttled_total 2"),
        "{page}"
    );
}

/// `listen.tls`: the native protocol over TCP with TLS 1.3, with QUIC's certificate. A client
/// that trusts it reads and writes as over plain TCP; one with no CA, or speaking plaintext to
/// the TLS port, gets an error, not a hang, and the node goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_over_tcp_serves_trusting_clients_only() {
    let n = Node::start("64MiB", &["--tls", "127.0.0.1:0"]);
    assert_ne!(n.tls, "off", "the ready line names the TLS address");
    let url = format!("tls://{}", n.tls);
    let trusting = ClientConfig {
        ca: Some(n.cert()),
        ..remote()
    };
    let c = Client::connect(&url, trusting.clone()).await.unwrap();
    assert!(!c.is_local());
    let plain = tcp_client(&n).await;
    for (j, len) in [0usize, 1, 4096, 64 << 10, 3 << 20].into_iter().enumerate() {
        let key = format!("tls-{j}");
        let v = value(j as u64, len);
        c.put(key.as_bytes(), &v).await.unwrap();
        assert_eq!(
            c.get(key.as_bytes()).await.unwrap().as_deref(),
            Some(&v[..])
        );
        assert_eq!(
            plain.get(key.as_bytes()).await.unwrap().as_deref(),
            Some(&v[..])
        );
    }
    let keys: Vec<Vec<u8>> = (0..5).map(|j| format!("tls-{j}").into_bytes()).collect();
    let keys: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    assert_eq!(c.batch_exists(&keys).await.unwrap(), 5);

    let untrusting = Client::connect(&url, remote()).await;
    assert!(
        matches!(untrusting, Err(ClientError::Tls(_))),
        "no CA: {:?}",
        untrusting.err()
    );
    let plaintext = tokio::time::timeout(
        Duration::from_secs(20),
        Client::connect(&format!("tcp://{}", n.tls), remote()),
    )
    .await
    .expect("plaintext to the TLS port fails, not hangs");
    assert!(plaintext.is_err());
    // The node still serves both doors.
    let again = Client::connect(&url, trusting).await.unwrap();
    assert_eq!(
        again.get(b"tls-2").await.unwrap().map(|v| v.len()),
        Some(4096)
    );
    assert!(n
        .scrape()
        .lines()
        .any(|l| l.starts_with("kvpool_connections_accepted_total{transport=\"tls\"}")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_allocations_are_reclaimed() {
    let dir = common::temp_dir("reap");
    let cfg = dir.join("kvpoold.toml");
    std::fs::write(&cfg, "[memory]\npending_timeout_ms = 200\n").unwrap();
    let n = Node::start("16MiB", &["--config", cfg.to_str().unwrap()]);
    let c = tcp_client(&n).await;
    let a = c.alloc(b"abandoned", 1 << 20).await.unwrap();
    assert_eq!(c.stats().await.unwrap().pending, 1);
    let mut reaped = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let s = c.stats().await.unwrap();
        if s.pending == 0 && s.reaped == 1 && s.used_bytes() == 0 {
            reaped = true;
            break;
        }
    }
    assert!(reaped, "{:?}", c.stats().await.unwrap());
    assert_eq!(
        code(c.commit(&a, 0).await.unwrap_err()),
        ErrorCode::NotWritable
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_operations_hits_and_misses() {
    let n = Node::start("16MiB", &[]);
    let c = tcp_client(&n).await;
    for i in 0..5u64 {
        c.put(format!("m{i}").as_bytes(), &value(i, 1000))
            .await
            .unwrap();
    }
    c.get(b"m1").await.unwrap();
    c.get(b"nope").await.unwrap();
    let m = n.scrape();
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    for line in [
        "kvpool_operations_total{op=\"put\",outcome=\"ok\"} 5",
        "kvpool_hits_total{node=\"0\"} 1",
        "kvpool_misses_total{node=\"0\"} 1",
        "kvpool_objects{node=\"0\"} 5",
        "kvpool_operation_seconds_count{op=\"put\"} 5",
    ] {
        assert!(m.contains(line), "missing {line:?} in\n{m}");
    }
    assert!(m.contains("kvpool_segment_bytes{node=\"0\",segment=\"0\",state=\"used\"}"));
    assert!(m.contains("kvpool_connections{transport=\"tcp\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_are_saved_matched_and_loaded_without_gaps() {
    use kvpool_client::{Prefix, PrefixSeed};
    let n = Node::start("64MiB", &[]);
    let seed = PrefixSeed {
        model: "m".into(),
        block_tokens: 16,
        layer_end: 32,
        ..PrefixSeed::default()
    };
    for cfg in [remote(), ClientConfig::default()] {
        let c = Client::connect(&n.tcp_url(), cfg).await.unwrap();
        // 10 full blocks and a partial one, which has no key.
        let tokens: Vec<u32> = (0..165).map(|i| i * 3 + c.is_local() as u32).collect();
        let p = Prefix::Tokens {
            seed: &seed,
            tokens: &tokens,
        };
        assert_eq!(p.keys().len(), 10);
        let blocks: Vec<Vec<u8>> = (0..10).map(|i| value(i, 64 << 10)).collect();
        let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
        assert_eq!(c.match_prefix(p).await.unwrap(), 0);
        assert_eq!(c.save_prefix(p, &refs[..6]).await.unwrap(), 6);
        assert_eq!(
            c.save_prefix(p, &refs).await.unwrap(),
            10,
            "only the missing blocks are sent"
        );
        assert_eq!(c.match_prefix(p).await.unwrap(), 10);
        // Another request sharing the first 5 blocks.
        let mut other = tokens.clone();
        other[16 * 5 + 3] += 1;
        assert_eq!(
            c.match_prefix(Prefix::Tokens {
                seed: &seed,
                tokens: &other
            })
            .await
            .unwrap(),
            5
        );
        let mut bufs: Vec<Vec<u8>> = (0..10).map(|_| vec![0u8; 64 << 10]).collect();
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        assert_eq!(c.load_prefix(p, &mut dsts).await.unwrap(), 10);
        assert!(bufs.iter().zip(&blocks).all(|(a, b)| a == b));
        // A gap: block 4 is gone, so blocks 5.. are useless and never loaded.
        let keys = p.keys();
        assert!(c.remove(&keys[4]).await.unwrap());
        let mut bufs: Vec<Vec<u8>> = (0..10).map(|_| vec![0u8; 64 << 10]).collect();
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        assert_eq!(c.load_prefix(p, &mut dsts).await.unwrap(), 4);
        assert!(
            bufs[4..].iter().all(|b| b.iter().all(|&x| x == 0)),
            "nothing after the gap"
        );
        assert_eq!(c.match_prefix(p).await.unwrap(), 4);
        // Engines that have their own block hashes pass them in.
        let own: Vec<Vec<u8>> = (0..3u8)
            .map(|i| vec![0xEE, i, c.is_local() as u8])
            .collect();
        let own_refs: Vec<&[u8]> = own.iter().map(|k| &k[..]).collect();
        assert_eq!(
            c.save_prefix(Prefix::Keys(&own_refs), &refs[..3])
                .await
                .unwrap(),
            3
        );
        assert_eq!(c.match_prefix(Prefix::Keys(&own_refs)).await.unwrap(), 3);
        assert!(
            c.save_prefix(Prefix::Keys(&own_refs), &refs).await.is_err(),
            "more blocks than keys"
        );
        c.remove(&keys[0]).await.unwrap();
    }
    let s = tcp_client(&n).await.stats().await.unwrap();
    assert!(s.namespaces[0].prefix_blocks > 0 && s.namespaces[0].prefix_hits > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_tokens_isolate_tenants() {
    let dir = common::temp_dir("nsauth");
    let cfg = dir.join("kvpoold.toml");
    std::fs::write(
        &cfg,
        "[[namespace]]\nname = \"a\"\ntokens = [\"token-a\"]\n\n[[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\n\n[[namespace]]\nname = \"shared\"\n",
    )
    .unwrap();
    let n = Node::start("32MiB", &["--config", cfg.to_str().unwrap()]);
    let with = |token: &str, ns: &str| ClientConfig {
        token: token.into(),
        namespace: ns.into(),
        ..remote()
    };
    let a = Client::connect(&n.tcp_url(), with("token-a", "a"))
        .await
        .unwrap();
    a.put(b"secret", b"of tenant a").await.unwrap();
    let names: Vec<&str> = a
        .hello()
        .namespaces
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        names,
        ["default", "a", "shared", "weights"],
        "a client sees only what it may use"
    );
    // b can't even name a's namespace...
    let e = Client::connect(&n.tcp_url(), with("token-b", "a"))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, ClientError::UnknownNamespace(_)), "{e}");
    // ...and raw requests with a's namespace id are refused: no read, no test, no removal.
    let a_id = a
        .hello()
        .namespaces
        .iter()
        .find(|(n, _)| n == "a")
        .unwrap()
        .1;
    let mut s = raw_conn(&n).await;
    assert!(matches!(
        hello(&mut s, "token-b").await.reply,
        Reply::Hello(_)
    ));
    for (i, op) in [
        Op::Get {
            ns: a_id,
            key: b"secret".to_vec(),
        },
        Op::Exists {
            ns: a_id,
            keys: vec![b"secret".to_vec()],
        },
        Op::Remove {
            ns: a_id,
            keys: vec![b"secret".to_vec()],
        },
        Op::Lookup {
            ns: a_id,
            keys: vec![b"secret".to_vec()],
            lease_ms: 0,
        },
        Op::Put {
            ns: a_id,
            key: b"secret".to_vec(),
            checksum: kvpool::checksum(b"x"),
            pin: false,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let payload: &[u8] = if matches!(op, Op::Put { .. }) {
            b"x"
        } else {
            b""
        };
        send(&mut s, 10 + i as u64, op, payload).await;
        assert_eq!(
            error_code(&recv(&mut s).await.unwrap()),
            ErrorCode::Unauthorized
        );
    }
    send(&mut s, 20, Op::Stats, &[]).await;
    match recv(&mut s).await.unwrap().reply {
        Reply::Stats(st) => assert!(st.namespaces.iter().all(|n| n.name != "a"), "stats hide a"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.get(b"secret").await.unwrap().unwrap(), b"of tenant a");
    // Open namespaces are open to every admitted client, and a wrong token is refused.
    let b_shared = Client::connect(&n.tcp_url(), with("token-b", "shared"))
        .await
        .unwrap();
    b_shared.put(b"k", b"v").await.unwrap();
    assert_eq!(
        a.namespace("shared")
            .unwrap()
            .get(b"k")
            .await
            .unwrap()
            .unwrap(),
        b"v"
    );
    let e = Client::connect(&n.tcp_url(), with("nope", "shared"))
        .await
        .err();
    assert!(
        e.is_none(),
        "no node token is set: unknown tokens get the open namespaces"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A batch is stored from its last item to its first, so in an LRU namespace the chain's root
/// is its newest block and pressure takes the chain from its tail, where a prefix lookup loses
/// least (docs/EVICTION.md, "tail first"): over TCP and through the same-host path alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_stored_tail_first_so_pressure_takes_a_chains_tail_first() {
    let dir = common::temp_dir("tail-first");
    let cfg = dir.join("kvpoold.toml");
    std::fs::write(&cfg, lru_namespaces(["chain-tcp", "chain-local"])).unwrap();
    let n = Node::start("32MiB", &["--config", cfg.to_str().unwrap()]);
    for (name, url, same_host) in [
        ("chain-tcp", n.tcp_url(), SameHost::Off),
        ("chain-local", n.unix_url(), SameHost::Auto),
    ] {
        let c = Client::connect(
            &url,
            ClientConfig {
                namespace: name.into(),
                same_host,
                ..ClientConfig::default()
            },
        )
        .await
        .unwrap();
        let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("chain/{i}").into_bytes()).collect();
        let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, 32 << 10)).collect();
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| (&k[..], &v[..]))
            .collect();
        let codes = c.batch_put_from(&items).await.unwrap();
        assert!(
            codes.iter().all(|&s| s == ErrorCode::Ok),
            "{name}: {codes:?}"
        );
        // The namespace is full: one more block evicts the least recently stored one.
        c.put(b"other", &value(9, 32 << 10)).await.unwrap();
        assert!(
            c.exists(b"chain/0").await.unwrap(),
            "{name}: the chain's root was evicted"
        );
        assert!(
            !c.exists(b"chain/7").await.unwrap(),
            "{name}: the chain's tail was kept"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A config of LRU namespaces named `names`, each holding 256 KiB (8 blocks of 32 KiB).
fn lru_namespaces<S: std::fmt::Display>(names: impl IntoIterator<Item = S>) -> String {
    names
        .into_iter()
        .map(|n| {
            format!("[[namespace]]\nname = \"{n}\"\nquota = \"256KiB\"\neviction = \"lru\"\n\n")
        })
        .collect()
}

/// How a batched read reaches the node in [`a_batched_read_touches_a_chain_tail_first`].
#[derive(Clone, Copy, Debug)]
enum ChainRead {
    /// `BatchGet` over TCP.
    Batch,
    /// `BatchGet` in its prefix mode over TCP (`load_prefix`).
    Prefix,
    /// A same-host client that has not seen the keys: a `Lookup`, then copies from the mapping.
    Lookup,
    /// A same-host client whose index knows the keys: copies only, reported to the node later.
    Reported,
}

/// A batched read is taken from its last key to its first, so in an LRU namespace a chain's
/// root ends up its most recently used block and pressure takes the chain's tail, whichever
/// way the read reaches the node (docs/EVICTION.md, "tail first"). The chain is stored one
/// block at a time, root first, then read in two batches, blocks 0–3 and then 4–7: read in
/// order and each tail first, block 3 is the least recently used (read root first, block 0
/// would be; reported in the wrong order across batches, block 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_read_touches_a_chain_tail_first() {
    let dir = common::temp_dir("tail-first-reads");
    let cfg = dir.join("kvpoold.toml");
    let reads = [
        ChainRead::Batch,
        ChainRead::Prefix,
        ChainRead::Lookup,
        ChainRead::Reported,
    ];
    std::fs::write(&cfg, lru_namespaces(reads.map(|r| format!("{r:?}")))).unwrap();
    let n = Node::start("32MiB", &["--config", cfg.to_str().unwrap()]);
    for read in reads {
        let name = format!("{read:?}");
        let (url, same_host) = match read {
            ChainRead::Batch | ChainRead::Prefix => (n.tcp_url(), SameHost::Off),
            ChainRead::Lookup | ChainRead::Reported => (n.unix_url(), SameHost::Auto),
        };
        let connect = || {
            Client::connect(
                &url,
                ClientConfig {
                    namespace: name.clone(),
                    same_host,
                    ..ClientConfig::default()
                },
            )
        };
        let writer = connect().await.unwrap();
        let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("chain/{i}").into_bytes()).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        for (i, k) in keys.iter().enumerate() {
            writer.put(k, &value(i as u64, 32 << 10)).await.unwrap();
        }
        let reader = connect().await.unwrap();
        let hits = |s: kvpool::pool::PoolStats| {
            s.namespaces
                .iter()
                .find(|x| x.name == name)
                .map_or(0, |x| x.hits)
        };
        let read_batch = async |keys: &[&[u8]], first: u64| {
            let mut bufs = vec![vec![0u8; 32 << 10]; keys.len()];
            let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let got = match read {
                ChainRead::Prefix => reader
                    .load_prefix(kvpool_client::Prefix::Keys(keys), &mut dsts)
                    .await
                    .unwrap(),
                _ => {
                    let got = reader.batch_get_into(keys, &mut dsts).await.unwrap();
                    got.iter().flatten().count()
                }
            };
            assert_eq!(got, keys.len(), "{name}");
            for (i, b) in (first..).zip(&bufs) {
                assert_eq!(b[..], value(i, 32 << 10)[..], "{name}: block {i}");
            }
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut before = hits(reader.stats().await.unwrap());
        if let ChainRead::Reported = read {
            // Reads until one is served from the reader's index: the node has not counted it
            // yet, and will with the reads below.
            loop {
                read_batch(&refs, 0).await;
                let now = hits(reader.stats().await.unwrap());
                if now == before {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "{name}: no index");
                before = now;
            }
        }
        read_batch(&refs[..4], 0).await;
        read_batch(&refs[4..], 4).await;
        let mut reads = 8 + matches!(read, ChainRead::Reported) as u64 * 8;
        while hits(reader.stats().await.unwrap()) < before + reads {
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: the node never counted the reads"
            );
            if let ChainRead::Reported = read {
                // Reads served from the index are reported at the next read once the oldest
                // is 100 ms old (in the background, one report at a time).
                tokio::time::sleep(Duration::from_millis(150)).await;
                assert!(reader.get(b"chain/4").await.unwrap().is_some());
                reads += 1;
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // The namespace is full: one more block evicts the least recently used one.
        writer.put(b"other", &value(9, 32 << 10)).await.unwrap();
        for (i, kept) in [(0, true), (3, false), (4, true), (7, true)] {
            assert_eq!(
                writer.exists(refs[i]).await.unwrap(),
                kept,
                "{name}: block {i} should have been {}",
                if kept { "kept" } else { "evicted" }
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
