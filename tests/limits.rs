//! What a peer can make a node spend before and after it authenticates: memory for headers it
//! never sends, descriptors for connections it never uses, objects held by replies it never
//! reads, and what the metrics page tells anyone who asks. Real `kvpoold` processes over real
//! sockets; every wait is bounded.
#![cfg(not(loom))]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{value, Node};
use kvpool::protocol::{ErrorCode, FramePrefix, Op};
use kvpool_client::{Client, ClientConfig, SameHost};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

fn remote() -> ClientConfig {
    ClientConfig {
        same_host: SameHost::Off,
        ..ClientConfig::default()
    }
}

/// Writes `toml` into a config file for a node and returns its path.
fn config_file(toml: &str) -> String {
    let p = common::temp_dir("config").join("kvpoold.toml");
    std::fs::write(&p, toml).unwrap();
    p.to_str().unwrap().to_string()
}

async fn send(s: &mut TcpStream, id: u64, op: Op) {
    common::raw::send(s, id, op, &[]).await;
}

async fn hello(s: &mut TcpStream) {
    common::raw::hello(s, "limits").await;
}

/// A connection to `to` from the loopback address `from` (127.0.0.0/8 is all local), so tests
/// can play several peers.
async fn connect_from(from: &str, to: &str) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::new(from.parse().unwrap(), 0))?;
    sock.connect(to.parse().unwrap()).await
}

/// True when the node has closed `s` (end of stream or reset) within `wait`.
async fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    let mut b = [0u8; 64];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue, // an error reply before the close
            Err(_) => return false,
        }
    }
}

/// An honest client can still store and read back a value.
async fn still_serves(n: &Node) {
    let c = Client::connect(&n.tcp_url(), remote()).await.unwrap();
    let v = value(7, 4096);
    c.put(b"honest", &v).await.unwrap();
    assert_eq!(c.get(b"honest").await.unwrap().as_deref(), Some(&v[..]));
}

/// Connections that announce a large header and send a few bytes cost the node a
/// little each, not the announced size, whether or not they authenticated first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_headers_cost_only_what_arrives() {
    let n = Node::start("64MiB", &[]);
    still_serves(&n).await;
    let before = n.rss();
    // 4 MiB: the header limit before this fix, so the same connections also reached the old
    // node's allocation.
    let announced = 4u32 << 20;
    let mut conns = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(&n.tcp).await.unwrap();
        if i % 2 == 1 {
            hello(&mut s).await;
        }
        let p = FramePrefix {
            header_len: announced,
            payload_len: 0,
        };
        s.write_all(&p.encode()).await.unwrap();
        s.write_all(&[0x5a; 16]).await.unwrap();
        conns.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = n.rss().saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "200 connections with {announced}-byte headers announced and 16 bytes sent grew the \
         node by {} MiB",
        grown >> 20
    );
    still_serves(&n).await;
    drop(conns);
}

/// A peer address over its cap is turned away at once; idle connections that exhaust
/// the node's descriptors are closed after the handshake timeout, so an honest client gets in;
/// failed accepts (data and metrics listeners alike) are logged at a bounded rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_lock_out_clients() {
    let cfg = config_file(
        "[limits]\nhandshake_timeout_ms = 3000\n\
         [listen]\nmax_connections_per_peer = 40\nreserve_fds = 0\n",
    );
    let (n, log) = Node::start_logged(&["prlimit", "--nofile=128:128"], "64MiB", &["-c", &cfg]);
    still_serves(&n).await;

    // One address, 50 connections: the 10 over the cap are closed as soon as accepted.
    let mut one_peer = Vec::new();
    for _ in 0..50 {
        one_peer.push(connect_from("127.0.0.2", &n.tcp).await.unwrap());
    }
    let mut checks = Vec::new();
    for mut s in one_peer {
        checks.push(tokio::spawn(async move {
            closed_within(&mut s, Duration::from_millis(1500)).await
        }));
    }
    let mut refused = 0;
    for c in checks {
        refused += c.await.unwrap() as usize;
    }
    assert_eq!(
        refused, 10,
        "connections closed before the handshake timeout"
    );

    // Enough idle connections from several addresses to run the node out of descriptors.
    let started = Instant::now();
    let mut idle = Vec::new();
    for i in 0..160 {
        let from = format!("127.0.0.{}", 10 + i / 32);
        if let Ok(s) = connect_from(&from, &n.tcp).await {
            idle.push(s);
        }
    }
    // Scrapes queue behind them; the metrics listener must wait, not spin.
    let mut scrapes = Vec::new();
    for _ in 0..4 {
        if let Ok(s) = TcpStream::connect(&n.metrics).await {
            scrapes.push(s);
        }
    }
    let honest = async {
        loop {
            match Client::connect(&n.tcp_url(), remote()).await {
                Ok(c) => return c,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    };
    let c = tokio::time::timeout(Duration::from_secs(30), honest)
        .await
        .expect("an honest client got in once idle connections timed out");
    c.put(b"after", b"the flood").await.unwrap();
    let waited = started.elapsed();
    let failures = log.count("accept failed");
    assert!(
        failures <= 2 * (2 + waited.as_secs() as usize / 5),
        "{failures} accept failures logged in {waited:?}:\n{}",
        log.lines().join("\n")
    );
    drop((idle, scrapes));
}

/// A client that asks for large values and never reads the reply loses its
/// connection after the write timeout, and the objects the reply held are released: once
/// removed, their space is reusable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_reply_releases_its_objects() {
    let cfg = config_file("[limits]\nwrite_timeout_ms = 1000\n");
    let n = Node::start("64MiB", &["-c", &cfg]);
    let c = Client::connect(&n.tcp_url(), remote()).await.unwrap();
    let big = 8 << 20;
    let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("big-{i}").into_bytes()).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(k, &value(i as u64, big)).await.unwrap();
    }
    // A small fixed receive buffer, so the kernel cannot absorb the reply for the reader.
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(64 << 10).unwrap();
    let mut reader = sock.connect(n.tcp.parse().unwrap()).await.unwrap();
    hello(&mut reader).await;
    send(
        &mut reader,
        2,
        Op::BatchGet {
            ns: 0,
            keys: keys.clone(),
            prefix: false,
        },
    )
    .await;
    // Read the reply's header only: the node now holds every value for a reply nobody reads.
    let mut prefix = [0u8; 16];
    reader.read_exact(&mut prefix).await.unwrap();
    let p = FramePrefix::parse(&prefix, &kvpool::protocol::Limits::default()).unwrap();
    assert_eq!(p.payload_len, (keys.len() * big) as u64);
    for k in &keys {
        assert!(c.remove(k).await.unwrap());
    }
    // 48 MiB of a 64 MiB pool was held by the unread reply: until it is dropped, new values
    // of the same total size only fit by evicting one another.
    let fresh: Vec<(Vec<u8>, Vec<u8>)> = (0..keys.len())
        .map(|i| (format!("new-{i}").into_bytes(), value(100 + i as u64, big)))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut present = 0;
        for (k, v) in &fresh {
            if c.get(k).await.unwrap().as_deref() == Some(&v[..]) {
                present += 1;
            } else {
                let _ = c.put(k, v).await;
            }
        }
        if present == fresh.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {present} of {} new values fit: the unread reply still holds the removed ones",
            fresh.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(reader);
}

/// Namespace names and usage are not on the metrics page unless the operator says so,
/// and with `token` only for a scrape bearing the node token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_namespaces_only_when_allowed() {
    let ns = "[[namespace]]\nname = \"tenant-secret\"\n";
    let scrape = |n: &Node, auth: Option<&str>| {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&n.metrics).unwrap();
        let auth = auth.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        out
    };
    let by_default = Node::start("16MiB", &["-c", &config_file(ns)]);
    let page = scrape(&by_default, None);
    assert!(page.contains("kvpool_objects"));
    assert!(!page.contains("tenant-secret") && !page.contains("kvpool_namespace_bytes"));

    let cfg = format!("[listen]\nmetrics_namespaces = \"token\"\n[auth]\ntoken = \"tok\"\n{ns}");
    let gated = Node::start("16MiB", &["-c", &config_file(&cfg)]);
    assert!(!scrape(&gated, None).contains("tenant-secret"));
    assert!(!scrape(&gated, Some("wrong")).contains("tenant-secret"));
    let page = scrape(&gated, Some("tok"));
    assert!(page.contains("kvpool_namespace_bytes{") && page.contains("tenant-secret"));

    let cfg = format!("[listen]\nmetrics_namespaces = \"open\"\n{ns}");
    let open = Node::start("16MiB", &["-c", &config_file(&cfg)]);
    assert!(scrape(&open, None).contains("tenant-secret"));
}

/// A request that stops arriving half-way (a frame's header, a put's payload, a RESP command)
/// loses its connection once `read_timeout_ms` passes without a byte, and the put's space comes
/// back; a connection idle between requests keeps it (no idle timeout is configured).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_stops_half_way_is_dropped_and_idling_is_not() {
    let cfg = config_file("[limits]\nread_timeout_ms = 1000\n");
    let n = Node::start("16MiB", &["-c", &cfg, "--resp", "127.0.0.1:0"]);

    // Greeted, then a prefix and 10 bytes of the 64-byte header it announces.
    let mut half_header = TcpStream::connect(&n.tcp).await.unwrap();
    hello(&mut half_header).await;
    let p = FramePrefix {
        header_len: 64,
        payload_len: 0,
    };
    half_header.write_all(&p.encode()).await.unwrap();
    half_header.write_all(&[0u8; 10]).await.unwrap();

    // Greeted, then a 12 MiB put (most of the pool) whose payload stops after 1 MiB.
    let mut half_put = TcpStream::connect(&n.tcp).await.unwrap();
    hello(&mut half_put).await;
    let put = Op::Put {
        ns: 0,
        key: b"half-put".to_vec(),
        checksum: 0,
        pin: false,
    };
    common::raw::send_head(&mut half_put, 2, put, 12 << 20).await;
    half_put.write_all(&vec![7u8; 1 << 20]).await.unwrap();

    // A RESP command cut in the middle of its second bulk string.
    let mut half_resp = TcpStream::connect(&n.resp).await.unwrap();
    half_resp
        .write_all(b"*3\r\n$3\r\nSET\r\n$5\r\nhal")
        .await
        .unwrap();

    // Idle between requests, natively and over RESP.
    let mut idle = TcpStream::connect(&n.tcp).await.unwrap();
    hello(&mut idle).await;
    let mut idle_resp = TcpStream::connect(&n.resp).await.unwrap();
    idle_resp.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    let mut pong = [0u8; 7];
    idle_resp.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"+PONG\r\n");

    for (what, s) in [
        ("half a header", &mut half_header),
        ("half a payload", &mut half_put),
        ("half a RESP command", &mut half_resp),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(20)).await,
            "{what} held its connection"
        );
    }
    assert!(!closed_within(&mut idle, Duration::from_secs(3)).await);
    assert!(!closed_within(&mut idle_resp, Duration::from_millis(100)).await);

    // The stalled put's 12 MiB are free again: another one fits.
    let c = Client::connect(&n.tcp_url(), remote()).await.unwrap();
    let v = value(3, 12 << 20);
    let mut stored = false;
    for _ in 0..50 {
        if c.put(b"whole-put", &v).await.is_ok() {
            stored = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(stored, "the stalled put's space never came back");
    assert_eq!(c.get(b"whole-put").await.unwrap().as_deref(), Some(&v[..]));
}

/// A raw connection that has said `Hello` with `token`, or the node's refusal of it.
async fn hello_with(to: &str, token: &str) -> (TcpStream, kvpool::protocol::Reply) {
    let mut s = TcpStream::connect(to).await.unwrap();
    let op = Op::Hello {
        version: kvpool::protocol::PROTOCOL_VERSION,
        token: token.into(),
        client: "limits".into(),
    };
    send(&mut s, 1, op).await;
    let r = common::raw::recv(&mut s).await.expect("a reply to Hello");
    (s, r.reply)
}

/// The first reply (up to 256 bytes) to one RESP command sent on a new connection to `to`.
async fn resp_reply(to: &str, args: &[&[u8]]) -> String {
    let mut s = TcpStream::connect(to).await.unwrap();
    let mut cmd = Vec::new();
    kvpool::resp::encode::command(&mut cmd, args);
    s.write_all(&cmd).await.unwrap();
    let mut reply = [0u8; 256];
    let got = tokio::time::timeout(Duration::from_secs(5), s.read(&mut reply))
        .await
        .expect("a reply in time")
        .unwrap();
    String::from_utf8_lossy(&reply[..got]).into_owned()
}

/// `Alloc` of `n` one-byte values named `{tag}-{i}`, in the default namespace (id 0).
async fn alloc(s: &mut TcpStream, id: u64, tag: &str, n: usize) -> kvpool::protocol::Reply {
    let items = (0..n)
        .map(|i| kvpool::protocol::AllocItem {
            key: format!("{tag}-{i}").into_bytes(),
            len: 1,
        })
        .collect();
    let op = Op::Alloc {
        ns: 0,
        items,
        pin: false,
        depths: Vec::new(),
    };
    send(s, id, op).await;
    common::raw::recv(s).await.expect("a reply to Alloc").reply
}

/// Checks that `r` is a `LimitExceeded` refusal whose message names `setting`.
fn limit_exceeded(r: kvpool::protocol::Reply, setting: &str) {
    use kvpool::protocol::{ErrorCode, Reply};
    match r {
        Reply::Error { code, message } => {
            assert_eq!(
                ErrorCode::from_u16(code),
                ErrorCode::LimitExceeded,
                "{message}"
            );
            assert!(message.contains(setting), "{message}");
        }
        other => panic!("expected LimitExceeded, got {other:?}"),
    }
}

/// The value of `kvpool_limit_refusals{limit="<limit>"}` on the node's metrics page.
fn refusals(n: &Node, limit: &str) -> u64 {
    let needle = format!("kvpool_limit_refusals_total{{limit=\"{limit}\"}} ");
    let page = n.scrape();
    let line = page
        .lines()
        .find(|l| l.starts_with(&needle))
        .unwrap_or_else(|| panic!("no {needle} in\n{page}"));
    line[needle.len()..].trim().parse().unwrap()
}

/// Pending allocations per connection: an `Alloc` that would take a connection past
/// `max_pending_per_connection` is refused whole with `LimitExceeded`, naming the setting, and
/// counted; what the connection commits or aborts, or what another connection commits for it,
/// makes room again; another connection has its own allowance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_allocations_are_capped_per_connection() {
    use kvpool::protocol::{CommitItem, Reply};
    let cfg = config_file("[limits]\nmax_pending_per_connection = 4\n");
    let n = Node::start("64MiB", &["-c", &cfg]);
    let mut s = TcpStream::connect(&n.tcp).await.unwrap();
    hello(&mut s).await;
    let addrs = |r: Reply| match r {
        Reply::Allocated(v) => v
            .into_iter()
            .map(|a| a.addr.expect("allocated"))
            .collect::<Vec<_>>(),
        other => panic!("expected Allocated, got {other:?}"),
    };
    let refused = |r: Reply| limit_exceeded(r, "max_pending_per_connection");
    let first = addrs(alloc(&mut s, 2, "a", 3).await);
    refused(alloc(&mut s, 3, "b", 2).await); // 3 + 2 > 4: nothing allocated
    assert_eq!(refusals(&n, "pending_per_connection"), 1);
    let one = addrs(alloc(&mut s, 4, "c", 1).await); // 4 pending now
    refused(alloc(&mut s, 5, "d", 1).await);

    // Another connection has its own allowance, and commits one of the first connection's
    // allocations for it: that one no longer counts against the first.
    let mut other = TcpStream::connect(&n.tcp).await.unwrap();
    hello(&mut other).await;
    addrs(alloc(&mut other, 2, "e", 4).await);
    let commit = |addr| Op::Commit {
        items: vec![CommitItem {
            addr,
            checksum: kvpool::checksum::checksum(&[0u8]),
        }],
    };
    send(&mut other, 3, commit(first[0])).await;
    let r = common::raw::recv(&mut other).await.unwrap().reply;
    assert!(matches!(&r, Reply::Statuses(s) if s == &[0]), "{r:?}");
    addrs(alloc(&mut s, 6, "f", 1).await);
    refused(alloc(&mut s, 7, "g", 1).await);

    // Aborting and committing over the connection itself make room too.
    send(
        &mut s,
        8,
        Op::Abort {
            addrs: vec![first[1]],
        },
    )
    .await;
    let r = common::raw::recv(&mut s).await.unwrap().reply;
    assert!(matches!(&r, Reply::Statuses(st) if st == &[0]), "{r:?}");
    send(&mut s, 9, commit(one[0])).await;
    let r = common::raw::recv(&mut s).await.unwrap().reply;
    assert!(matches!(&r, Reply::Statuses(st) if st == &[0]), "{r:?}");
    addrs(alloc(&mut s, 10, "h", 2).await);
    refused(alloc(&mut s, 11, "i", 1).await);
    assert_eq!(refusals(&n, "pending_per_connection"), 4);
    still_serves(&n).await;
}

/// Connections per token: past `max_connections_per_token` a `Hello` with that token is
/// refused with `LimitExceeded` and the connection closed, whatever door it comes through
/// (native TCP and RESP `AUTH` count together); other tokens and connections without one are
/// not affected; a closed connection gives its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_capped_per_token_across_doors() {
    use kvpool::protocol::Reply;
    let cfg = config_file(
        "[limits]\nmax_connections_per_token = 2\n\n\
         [[namespace]]\nname = \"a\"\ntokens = [\"token-a\"]\n\n\
         [[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\n",
    );
    let n = Node::start("64MiB", &["-c", &cfg, "--resp", "127.0.0.1:0"]);
    let (first, r) = hello_with(&n.tcp, "token-a").await;
    assert!(matches!(r, Reply::Hello(_)), "{r:?}");
    // The second place goes to a RESP connection.
    let mut resp = TcpStream::connect(&n.resp).await.unwrap();
    let mut auth = Vec::new();
    kvpool::resp::encode::command(&mut auth, &[&b"AUTH"[..], b"a", b"token-a"]);
    resp.write_all(&auth).await.unwrap();
    let mut line = vec![0u8; 5];
    resp.read_exact(&mut line).await.unwrap();
    assert_eq!(&line, b"+OK\r\n");

    let (mut third, r) = hello_with(&n.tcp, "token-a").await;
    limit_exceeded(r, "max_connections_per_token");
    assert!(closed_within(&mut third, Duration::from_secs(5)).await);
    // RESP is refused too, with an error reply, and keeps its connection unauthenticated.
    let text = resp_reply(&n.resp, &[&b"AUTH"[..], b"a", b"token-a"]).await;
    assert!(
        text.starts_with("-ERR") && text.contains("max_connections_per_token"),
        "{text}"
    );
    assert_eq!(refusals(&n, "connections_per_token"), 2);

    // Another token, and no token (the default namespace is open), are not counted here.
    for token in ["token-b", "token-b", ""] {
        let (_s, r) = hello_with(&n.tcp, token).await;
        assert!(matches!(r, Reply::Hello(_)), "{token}: {r:?}");
    }
    // A closed connection gives its place back (the node notices the close at once; a few
    // tries cover the time it takes).
    drop(first);
    let mut admitted = false;
    for _ in 0..50 {
        if let (_s, Reply::Hello(_)) = hello_with(&n.tcp, "token-a").await {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        admitted,
        "a place freed by a closed connection is taken again"
    );
    drop(resp);
}

/// QUIC streams count against `max_connections_per_peer` as TCP connections do: a stream over
/// the cap is reset, so a client's handshake on it fails, and a closed client's streams give
/// their places back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_streams_count_against_the_per_peer_cap() {
    let cfg = config_file("[listen]\nmax_connections_per_peer = 2\n");
    let n = Node::start("64MiB", &["-c", &cfg]);
    let quic = || ClientConfig {
        ca: Some(n.cert()),
        ..remote()
    };
    let a = Client::connect(&n.quic_url(), quic()).await.unwrap();
    let b = Client::connect(&n.quic_url(), quic()).await.unwrap();
    a.put(b"a", b"1").await.unwrap();
    b.put(b"b", b"2").await.unwrap();
    let err = Client::connect(&n.quic_url(), quic()).await.err();
    assert!(err.is_some(), "a third stream from one address is refused");
    assert!(refusals(&n, "connections_per_peer") >= 1);
    drop(a);
    let mut again = None;
    for _ in 0..50 {
        if let Ok(c) = Client::connect(&n.quic_url(), quic()).await {
            again = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let c = again.expect("a place freed by a closed client is taken again");
    assert_eq!(c.get(b"b").await.unwrap().as_deref(), Some(&b"2"[..]));
}

/// `max_key_len` below the format's 256 bytes: longer keys are refused with `BadKey` through
/// the native door and RESP alike, and counted; keys within it work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_longer_than_the_configured_limit_are_refused() {
    let cfg = config_file("[limits]\nmax_key_len = 16\n");
    let n = Node::start("64MiB", &["-c", &cfg, "--resp", "127.0.0.1:0"]);
    let c = Client::connect(&n.tcp_url(), remote()).await.unwrap();
    c.put(&[b'k'; 16], b"fits").await.unwrap();
    let err = c.put(&[b'k'; 17], b"too long").await.unwrap_err();
    assert!(err.to_string().contains("max_key_len"), "{err}");
    assert_eq!(
        c.get(&[b'k'; 16]).await.unwrap().as_deref(),
        Some(&b"fits"[..])
    );
    let text = resp_reply(&n.resp, &[&b"SET"[..], &[b'r'; 17], b"v"]).await;
    assert!(
        text.starts_with("-ERR") && text.contains("max_key_len"),
        "{text}"
    );
    assert_eq!(refusals(&n, "key_length"), 2);
    // Out of range settings are refused at start.
    let bad = config_file("[limits]\nmax_key_len = 257\n");
    let out = std::process::Command::new(common::bin("kvpoold"))
        .args(["-c", &bad, "--memory", "16MiB", "--tcp", "127.0.0.1:0"])
        .args([
            "--quic",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(common::temp_dir("bad-key-len"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("max_key_len"));
}

/// A client cuts every request to the limits its nodes announce (`max_batch` keys or items,
/// `max_payload` bytes): a batch of any length works, where a node would refuse it with
/// `BatchTooLarge` or close the connection for its payload. Over TCP and on the same host; the
/// prefix calls still stop at the first gap, across the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_over_the_nodes_limits_are_cut_to_fit() {
    use kvpool_client::Prefix;
    let cfg = config_file("[limits]\nmax_batch = 8\nmax_payload = \"64KiB\"\n");
    let n = Node::start("64MiB", &["-c", &cfg]);
    for same_host in [SameHost::Off, SameHost::Auto] {
        let c = Client::connect(
            &n.tcp_url(),
            ClientConfig {
                same_host,
                ..ClientConfig::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(c.hello().max_batch, 8);
        // 100 values of 4 KiB: 13 batches by count, and 400 KiB of payload against 64 KiB.
        let keys: Vec<Vec<u8>> = (0..100)
            .map(|i| format!("{same_host:?}-{i}").into_bytes())
            .collect();
        let vals: Vec<Vec<u8>> = (0..100).map(|i| value(i, 4096)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let items: Vec<(&[u8], &[u8])> =
            refs.iter().zip(&vals).map(|(k, v)| (*k, &v[..])).collect();
        let codes = c.batch_put_from(&items).await.unwrap();
        assert!(codes.iter().all(|&c| c == ErrorCode::Ok), "{codes:?}");
        assert_eq!(c.batch_exists(&refs).await.unwrap(), 100);
        assert_eq!(c.present(&refs).await.unwrap(), vec![true; 100]);

        let mut bufs = vec![vec![0u8; 4096]; 100];
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = c.batch_get_into(&refs, &mut dsts).await.unwrap();
        assert_eq!(got, vec![Some(4096); 100]);
        assert!(bufs == vals, "every value whole, in its own buffer");
        let leases = c.lease(&refs, 1_000).await.unwrap();
        assert!(leases.iter().all(Option::is_some));
        assert_eq!(c.release(&refs).await.unwrap(), 100);

        // A gap at block 50: the prefix calls stop there, though later cuts hold every key.
        assert!(c.remove(refs[50]).await.unwrap());
        assert_eq!(c.batch_exists(&refs).await.unwrap(), 50);
        assert_eq!(c.match_prefix(Prefix::Keys(&refs)).await.unwrap(), 50);
        let mut bufs = vec![vec![0u8; 4096]; 100];
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        assert_eq!(
            c.load_prefix(Prefix::Keys(&refs), &mut dsts).await.unwrap(),
            50
        );
        assert!(bufs[..50] == vals[..50]);
        let blocks: Vec<&[u8]> = vals.iter().map(|v| &v[..]).collect();
        assert_eq!(
            c.save_prefix(Prefix::Keys(&refs), &blocks).await.unwrap(),
            100
        );
        assert_eq!(c.batch_remove(&refs).await.unwrap(), 100);
        assert_eq!(c.batch_exists(&refs).await.unwrap(), 0);
    }
    // Nothing was refused on the way.
    assert_eq!(refusals(&n, "batch"), 0);
    still_serves(&n).await;
}
