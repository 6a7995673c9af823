//! Tenant isolation, door by door: with namespaces `a` and `b` guarded by their own
//! tokens, tenant B (holding only `token-b`) can neither read, probe (exists, prefix match),
//! list, remove nor take the quota of tenant A's namespace through any socket door of a real
//! `kvpoold`: TCP, TLS over TCP, QUIC, the Unix socket, a same-host client (its calls), and the
//! RESP front door. The Python door wraps the same client (python/tests/client). A same-host
//! process that bypasses the calls and reads what it maps is covered too: the node hands it
//! descriptors of its own namespace's segment (and of the common ones) only, read-only for a
//! read token and, since its namespace has tokens, for its writer too, whose values land only
//! through a staging area of its own; never A's (SECURITY.md, "Same host").
#![cfg(not(loom))]

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{value, Node};
use kvpool::prefix::PrefixSeed;
use kvpool_client::{Client, ClientConfig, ClientError, Prefix, SameHost};

const CONFIG: &str = "[[namespace]]\nname = \"a\"\ntokens = [\"token-a\"]\nquota = \"8MiB\"\n\n\
                      [[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\nquota = \"8MiB\"\n";

fn cfg(n: &Node, token: &str, ns: &str) -> ClientConfig {
    ClientConfig {
        token: token.into(),
        namespace: ns.into(),
        same_host: SameHost::Off,
        local_index: 0,
        ca: Some(n.cert()),
        timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_b_cannot_reach_tenant_a_by_any_door() {
    let dir = common::temp_dir("tenant-matrix");
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, CONFIG).unwrap();
    let n = Node::start(
        "64MiB",
        &[
            "--config",
            path.to_str().unwrap(),
            "--tls",
            "127.0.0.1:0",
            "--resp",
            "127.0.0.1:0",
        ],
    );

    // Tenant A's data: a value and a prefix of four blocks, put over TCP.
    let a = Client::connect(&n.tcp_url(), cfg(&n, "token-a", "a"))
        .await
        .unwrap();
    let secret = value(7, 64 << 10);
    a.put(b"secret", &secret).await.unwrap();
    // Four blocks of a prompt, under kvpool's chained prefix keys: the same tokens and model
    // give B the same keys, so a probe in B's namespace asks for exactly A's blocks.
    let seed = PrefixSeed {
        model: "m".into(),
        block_tokens: 16,
        layer_end: 32,
        ..PrefixSeed::default()
    };
    let tokens: Vec<u32> = (0..64).collect();
    let prefix = Prefix::Tokens {
        seed: &seed,
        tokens: &tokens,
    };
    let blocks: Vec<Vec<u8>> = (0..4).map(|i| value(100 + i, 4096)).collect();
    let block_refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
    assert_eq!(a.save_prefix(prefix, &block_refs).await.unwrap(), 4);

    let doors = [
        ("tcp", n.tcp_url(), SameHost::Off),
        ("tls", format!("tls://{}", n.tls), SameHost::Off),
        ("quic", n.quic_url(), SameHost::Off),
        ("unix", n.unix_url(), SameHost::Off),
        ("same-host", n.tcp_url(), SameHost::Auto),
    ];
    for (door, url, same_host) in &doors {
        let cfg = |n: &Node, token: &str, ns: &str| ClientConfig {
            same_host: *same_host,
            ..cfg(n, token, ns)
        };
        // B cannot open A's namespace with its own token, nor with a guess...
        for token in ["token-b", "", "token-a "] {
            let e = Client::connect(url, cfg(&n, token, "a")).await.err();
            assert!(
                matches!(
                    e,
                    Some(ClientError::UnknownNamespace(_)) | Some(ClientError::Server { .. })
                ),
                "{door}: B opened namespace a with {token:?}: {e:?}"
            );
        }
        // ...and from its own namespace it sees nothing of A's.
        let b = Client::connect(url, cfg(&n, "token-b", "b")).await.unwrap();
        assert_eq!(b.is_local(), *same_host == SameHost::Auto, "{door}");
        assert_eq!(b.get(b"secret").await.unwrap(), None, "{door}: read");
        assert!(!b.exists(b"secret").await.unwrap(), "{door}: exists");
        assert_eq!(
            b.match_prefix(prefix).await.unwrap(),
            0,
            "{door}: prefix probe"
        );
        let mut dsts: Vec<Vec<u8>> = vec![vec![0u8; 4096]; 4];
        let mut refs: Vec<&mut [u8]> = dsts.iter_mut().map(|d| &mut d[..]).collect();
        assert_eq!(
            b.load_prefix(prefix, &mut refs).await.unwrap(),
            0,
            "{door}: prefix load"
        );
        assert!(
            b.keys_with_prefix(b"").await.unwrap().is_empty(),
            "{door}: list"
        );
        assert!(!b.remove(b"secret").await.unwrap(), "{door}: remove");
        assert_eq!(b.remove_all().await.unwrap(), 0, "{door}: remove all");
        // B writes twice its quota: its puts evict its own older values (a cache), never
        // A's, and A can still put within its own quota.
        for i in 0..16 {
            b.put(format!("{door}-{i}").as_bytes(), &value(i, 1 << 20))
                .await
                .unwrap();
        }
        let mut kept = 0;
        for i in 0..16 {
            kept += b.exists(format!("{door}-{i}").as_bytes()).await.unwrap() as u64;
        }
        assert!((1..=8).contains(&kept), "{door}: B's quota held {kept} MiB");
        a.put(format!("a-after-{door}").as_bytes(), &value(3, 1 << 20))
            .await
            .expect("A's quota is untouched by B filling its own");
        assert_eq!(
            a.get(b"secret").await.unwrap().as_deref(),
            Some(&secret[..])
        );
        assert_eq!(b.remove_all().await.unwrap(), kept, "{door}");
    }

    // RESP: AUTH names the namespace; B's token does not open A's.
    let mut r = std::net::TcpStream::connect(&n.resp).unwrap();
    r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut ask = |cmd: &[&[u8]], want: &[u8]| {
        let mut v = Vec::new();
        kvpool::resp::encode::command(&mut v, cmd);
        r.write_all(&v).unwrap();
        let mut got = vec![0u8; want.len()];
        r.read_exact(&mut got).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(want),
            "RESP {:?}",
            String::from_utf8_lossy(cmd[0])
        );
    };
    let wrongpass = b"-WRONGPASS invalid username-password pair or user is disabled.\r\n";
    ask(&[b"AUTH", b"a", b"token-b"], wrongpass);
    // (The node has no node token: a connection starts in the open `default` namespace.)
    ask(&[b"GET", b"secret"], b"$-1\r\n");
    ask(&[b"AUTH", b"b", b"token-b"], b"+OK\r\n");
    ask(&[b"GET", b"secret"], b"$-1\r\n");
    ask(&[b"EXISTS", b"secret"], b":0\r\n");
    ask(&[b"DBSIZE"], b":0\r\n");
    ask(&[b"SCAN", b"0"], b"*2\r\n$1\r\n0\r\n*0\r\n");
    ask(&[b"DEL", b"secret"], b":0\r\n");
    ask(&[b"FLUSHDB"], b"+OK\r\n");

    // After all of it, A's bytes are whole.
    assert_eq!(
        a.get(b"secret").await.unwrap().as_deref(),
        Some(&secret[..])
    );
    assert_eq!(a.match_prefix(prefix).await.unwrap(), 4);
    for (door, _, _) in &doors {
        assert!(a
            .exists(format!("a-after-{door}").as_bytes())
            .await
            .unwrap());
    }
}

/// A same-host writer of a staged segment stores through its staging area only: what it
/// names in `CommitStaged` is copied into an allocation it was given, checked and committed;
/// another tenant can't name its area, a range past the area's end is refused, and bytes that
/// don't match their checksum are never committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_writer_stores_only_through_its_staging_area() {
    use kvpool::protocol::{AllocItem, ErrorCode, Op, Reply, StagedCommit, PROTOCOL_VERSION};
    use std::os::unix::fs::FileExt;
    let dir = common::temp_dir("tenant-staging");
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, CONFIG).unwrap();
    let n = Node::start("64MiB", &["--config", path.to_str().unwrap()]);
    let hello = |token: &str| Op::Hello {
        version: PROTOCOL_VERSION,
        token: token.into(),
        client: "stager".into(),
    };
    let mut b = tokio::net::UnixStream::connect(&n.unix).await.unwrap();
    let (r, _) = common::raw::unix_call(&mut b, 1, hello("token-b")).await;
    let Reply::Hello(h) = r else { panic!("{r:?}") };
    let ns_b = h.namespaces.iter().find(|(name, _)| name == "b").unwrap().1;
    let (r, mut fds) = common::raw::unix_call(&mut b, 2, Op::Staging).await;
    let Reply::Staging { id, len } = r else {
        panic!("{r:?}")
    };
    assert_eq!(len, 64 << 20, "memory.staging's default");
    let area = std::fs::File::from(fds.pop().expect("the area's descriptor"));
    let alloc = |id: u64, key: &str, n: usize| {
        let op = Op::Alloc {
            ns: ns_b,
            items: vec![AllocItem {
                key: key.as_bytes().to_vec(),
                len: n as u64,
            }],
            pin: false,
            depths: Vec::new(),
        };
        (id, op)
    };
    let allocated = |r: Reply| match r {
        Reply::Allocated(v) => v[0].addr.expect("allocated"),
        other => panic!("{other:?}"),
    };
    let value = value(21, 100_000);
    area.write_all_at(&value, 8192).unwrap();
    let (i, op) = alloc(3, "staged", value.len());
    let (r, _) = common::raw::unix_call(&mut b, i, op).await;
    let addr = allocated(r);
    let commit = |addr, offset, checksum| Op::CommitStaged {
        staging: id,
        items: vec![StagedCommit {
            addr,
            offset,
            checksum,
        }],
    };
    let sum = kvpool::checksum::checksum(&value);

    // Tenant A can't name B's area, whatever its id.
    let mut a = tokio::net::UnixStream::connect(&n.unix).await.unwrap();
    let _ = common::raw::unix_call(&mut a, 1, hello("token-a")).await;
    let (r, _) = common::raw::unix_call(&mut a, 2, commit(addr, 8192, sum)).await;
    match r {
        Reply::Error { code, .. } => assert_eq!(ErrorCode::from_u16(code), ErrorCode::NotFound),
        other => panic!("A used B's staging area: {other:?}"),
    }
    // A range past the area's end, and bytes that don't match their checksum, are refused.
    let (r, _) = common::raw::unix_call(&mut b, 4, commit(addr, len - 10, sum)).await;
    assert!(
        matches!(&r, Reply::Statuses(s) if s == &[ErrorCode::OutOfBounds as u16]),
        "{r:?}"
    );
    let (r, _) = common::raw::unix_call(&mut b, 5, commit(addr, 8192, sum ^ 1)).await;
    assert!(
        matches!(&r, Reply::Statuses(s) if s == &[ErrorCode::ChecksumMismatch as u16]),
        "{r:?}"
    );
    // (A failed commit released the allocation: a new one, committed right.)
    let (i, op) = alloc(6, "staged", value.len());
    let (r, _) = common::raw::unix_call(&mut b, i, op).await;
    let addr = allocated(r);
    let (r, _) = common::raw::unix_call(&mut b, 7, commit(addr, 8192, sum)).await;
    assert!(matches!(&r, Reply::Statuses(s) if s == &[0]), "{r:?}");
    let c = Client::connect(&n.tcp_url(), cfg(&n, "token-b", "b"))
        .await
        .unwrap();
    assert_eq!(c.get(b"staged").await.unwrap().as_deref(), Some(&value[..]));
    // Stores into the area after the commit change nothing committed.
    area.write_all_at(&[0u8; 4096], 8192).unwrap();
    assert_eq!(c.get(b"staged").await.unwrap().as_deref(), Some(&value[..]));
    assert!(n.scrape().contains("kvpool_staging_bytes 67108864"));
    // The area goes with its connection.
    drop(b);
    let mut gone = false;
    for _ in 0..100 {
        if n.scrape().contains("kvpool_staging_bytes 0") {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gone, "the area outlived its connection");

    // B's own client puts through a staging area of its own, and reads back what it put.
    let same_host = ClientConfig {
        same_host: SameHost::Auto,
        ..cfg(&n, "token-b", "b")
    };
    let b = Client::connect(&n.tcp_url(), same_host).await.unwrap();
    assert!(b.is_local());
    let values: Vec<Vec<u8>> = (0..20).map(|i| common::value(100 + i, 300_000)).collect();
    let keys: Vec<Vec<u8>> = (0..20).map(|i| format!("v{i}").into_bytes()).collect();
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (&k[..], &v[..]))
        .collect();
    for code in b.batch_put_from(&items).await.unwrap() {
        assert_eq!(code, ErrorCode::Ok);
    }
    let page = n.scrape();
    assert!(page.contains("kvpool_staging_bytes 67108864"));
    // Through the area: no one-sided write over the socket, no socket put.
    assert_no_socket_puts(&page);
    for (k, v) in keys.iter().zip(&values) {
        assert_eq!(b.get(k).await.unwrap().as_deref(), Some(&v[..]));
    }
}

/// Checks on a metrics page that no value reached the node over the socket: no one-sided
/// `Write`, no `Put`, no `BatchPut`.
fn assert_no_socket_puts(page: &str) {
    for op in ["write", "put", "batch_put"] {
        let line = format!("kvpool_operations_total{{op=\"{op}\",outcome=\"ok\"}} 0\n");
        assert!(page.contains(&line), "{op}s went over the socket:\n{page}");
    }
}

/// What a process holding `token` gets when it asks the node's Unix socket for its segments,
/// bypassing the client: (segment id, writable, the file behind the descriptor).
async fn segments_handed_to(n: &Node, token: &str) -> Vec<(u32, bool, std::fs::File)> {
    use kvpool::protocol::{Op, Reply, PROTOCOL_VERSION};
    let mut s = tokio::net::UnixStream::connect(&n.unix).await.unwrap();
    let hello = Op::Hello {
        version: PROTOCOL_VERSION,
        token: token.into(),
        client: "prober".into(),
    };
    let (r, fds) = common::raw::unix_call(&mut s, 1, hello).await;
    assert!(matches!(r, Reply::Hello(_)), "{r:?}");
    assert!(fds.is_empty());
    let (r, fds) = common::raw::unix_call(&mut s, 2, Op::MapInfo).await;
    let Reply::MapInfo { segments, .. } = r else {
        panic!("{r:?}")
    };
    assert_eq!(segments.len(), fds.len(), "one descriptor per segment");
    segments
        .into_iter()
        .zip(fds)
        .map(|(m, fd)| (m.id, m.writable, std::fs::File::from(fd)))
        .collect()
}

/// Does any of `files` hold `needle`?
fn holds(files: &[(u32, bool, std::fs::File)], needle: &[u8]) -> bool {
    files.iter().any(|(_, _, f)| {
        let mut bytes = Vec::new();
        (&*f).read_to_end(&mut bytes).unwrap();
        bytes.windows(needle.len()).any(|w| w == needle)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_process_is_handed_its_own_segments_only() {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    let dir = common::temp_dir("tenant-same-host");
    let path = dir.join("kvpoold.toml");
    let config = CONFIG.replace(
        "tokens = [\"token-a\"]",
        "tokens = [\"token-a\"]\nread_tokens = [\"reader-a\"]",
    );
    std::fs::write(&path, config).unwrap();
    let n = Node::start(
        "64MiB",
        &["--config", path.to_str().unwrap(), "--resp", "127.0.0.1:0"],
    );
    let same_host = |token: &str, ns: &str| ClientConfig {
        same_host: SameHost::Auto,
        ..cfg(&n, token, ns)
    };
    let a = Client::connect(&n.tcp_url(), same_host("token-a", "a"))
        .await
        .unwrap();
    assert!(a.is_local());
    let secret = value(11, 64 << 10);
    a.put(b"secret", &secret).await.unwrap();
    let b = Client::connect(&n.tcp_url(), same_host("token-b", "b"))
        .await
        .unwrap();
    assert!(b.is_local());
    let b_value = value(12, 64 << 10);
    b.put(b"mine", &b_value).await.unwrap();

    // B, bypassing its client, gets the common segments and its own, every one read-only
    // even to B's writer token (its puts went through a staging area), so not even its own
    // committed objects can be overwritten through the mapping...
    let to_b = segments_handed_to(&n, "token-b").await;
    assert_eq!(to_b.len(), 2, "the common segment and B's own");
    for (id, writable, file) in &to_b {
        assert!(!writable, "segment {id} handed out writable");
        let e = file.write_at(b"x", 8192).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(9), "EBADF: {e}");
    }
    assert!(holds(&to_b, &b_value[..256]));
    // ...and not one byte of A's.
    assert!(
        !holds(&to_b, &secret[..256]),
        "B's mapping holds A's secret"
    );
    // Any other token (the node has no node token, so it is admitted to the open namespaces)
    // gets the common segment only.
    let to_other = segments_handed_to(&n, "token-c").await;
    assert_eq!(to_other.len(), 1);
    assert!(!holds(&to_other, &secret[..256]) && !holds(&to_other, &b_value[..256]));

    // A's reader gets A's segment read-only: its descriptor cannot write, nor be mapped to.
    let to_reader = segments_handed_to(&n, "reader-a").await;
    assert_eq!(to_reader.len(), 2, "the common segment and A's own");
    assert!(holds(&to_reader, &secret[..256]));
    for (id, writable, file) in &to_reader {
        assert!(!writable, "segment {id} handed out writable");
        let e = file.write_at(b"x", 8192).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(9), "EBADF: {e}");
    }
    assert!(
        !holds(&to_reader, &b_value[..256]),
        "the reader sees B's bytes"
    );

    // Its client reads A's values through that mapping and may change nothing.
    let reader = Client::connect(&n.tcp_url(), same_host("reader-a", "a"))
        .await
        .unwrap();
    assert!(reader.is_local());
    assert_eq!(
        reader.get(b"secret").await.unwrap().as_deref(),
        Some(&secret[..])
    );
    let refused = reader.put(b"forged", b"bytes").await.unwrap_err();
    assert_eq!(
        refused.code(),
        Some(kvpool::protocol::ErrorCode::Unauthorized),
        "{refused}"
    );
    assert!(!reader.remove(b"secret").await.unwrap_or(false));
    assert_eq!(
        a.get(b"secret").await.unwrap().as_deref(),
        Some(&secret[..])
    );

    // The RESP door holds the read token to reading too.
    let mut r = std::net::TcpStream::connect(&n.resp).unwrap();
    r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut ask = |cmd: &[&[u8]]| {
        let mut v = Vec::new();
        kvpool::resp::encode::command(&mut v, cmd);
        r.write_all(&v).unwrap();
        // One line of reply.
        let mut got = Vec::new();
        while !got.ends_with(b"\r\n") {
            let mut b = [0u8; 1];
            r.read_exact(&mut b).unwrap();
            got.push(b[0]);
        }
        String::from_utf8(got).unwrap()
    };
    assert_eq!(ask(&[b"AUTH", b"a", b"reader-a"]), "+OK\r\n");
    assert!(ask(&[b"SET", b"forged", b"x"]).starts_with("-NOPERM"));
    assert!(ask(&[b"DEL", b"secret"]).starts_with("-NOPERM"));
    assert_eq!(ask(&[b"EXISTS", b"secret"]), ":1\r\n");

    // Nobody else can open the files by name: every segment file is the daemon user's alone,
    // and so is the socket by default.
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let segment_files: Vec<_> = std::fs::read_dir(&n.dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvp"))
        .collect();
    assert_eq!(segment_files.len(), 3, "{segment_files:?}");
    for f in &segment_files {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }
    assert_eq!(mode(std::path::Path::new(&n.unix)), 0o600);
}

/// The connection that holds a writer's staging area is idle between puts by design, so the
/// node's idle timeout spares it (as it spares holds and watches): a put after a long pause
/// still goes through the area, and the area stays handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staging_area_outlives_the_idle_timeout() {
    let dir = common::temp_dir("tenant-staging-idle");
    let path = dir.join("kvpoold.toml");
    std::fs::write(
        &path,
        format!("[limits]\nidle_timeout_ms = 300\n\n{CONFIG}"),
    )
    .unwrap();
    let n = Node::start("64MiB", &["--config", path.to_str().unwrap()]);
    let same_host = ClientConfig {
        same_host: SameHost::Auto,
        ..cfg(&n, "token-b", "b")
    };
    let b = Client::connect(&n.tcp_url(), same_host).await.unwrap();
    assert!(b.is_local());
    let first = value(31, 200_000);
    b.put(b"first", &first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let second = value(32, 200_000);
    b.put(b"second", &second).await.unwrap();
    let page = n.scrape();
    assert!(page.contains("kvpool_staging_bytes 67108864"), "{page}");
    assert_no_socket_puts(&page);
    assert_eq!(b.get(b"first").await.unwrap().as_deref(), Some(&first[..]));
    assert_eq!(
        b.get(b"second").await.unwrap().as_deref(),
        Some(&second[..])
    );
}
