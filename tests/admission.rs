//! A hostile peer must not starve honest clients of a node: connections that never
//! authenticate give way to new ones when connection slots or descriptors run short, memory
//! taken by headers sent before authenticating goes back to the OS once their connections
//! close, and a flood of guessed tokens or cluster proofs is checked within a node-wide budget
//! while a client that has not failed is still admitted. Real `kvpoold` processes over real
//! sockets on loopback (127.0.0.0/8 is all local, so a test plays many peers); every wait is
//! bounded.
#![cfg(not(loom))]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{metric, value, Node};
use kvpool::protocol::auth::ClusterSecret;
use kvpool::protocol::{ErrorCode, FramePrefix, HelloInfo, Op, Reply, PROTOCOL_VERSION};
use kvpool_client::{Client, ClientConfig, SameHost};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};

/// Writes `toml` into a config file for a node and returns its path.
fn config_file(toml: &str) -> String {
    let p = common::temp_dir("config").join("kvpoold.toml");
    std::fs::write(&p, toml).unwrap();
    p.to_str().unwrap().to_string()
}

/// A connection to `to` from the loopback address `from` (without Nagle's delay, so that a
/// frame written in two pieces is not held back waiting for an acknowledgement).
async fn connect_from(from: &str, to: &str) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::new(from.parse().unwrap(), 0))?;
    sock.set_nodelay(true)?;
    sock.connect(to.parse().unwrap()).await
}

/// `count` connections to `to`, spread over the loopback addresses 127.0.0.2 to 127.0.0.6
/// (each within the default `max_connections_per_peer`), that send nothing.
async fn idle_connections(to: &str, count: usize) -> Vec<TcpStream> {
    let mut conns = Vec::with_capacity(count);
    for i in 0..count {
        let from = format!("127.0.0.{}", 2 + i % 5);
        if let Ok(s) = connect_from(&from, to).await {
            conns.push(s);
        }
    }
    conns
}

/// The time an honest client takes to connect (its `Hello` included) and store a value,
/// failing the test when it is not served within `within`.
async fn honest_put(n: &Node, within: Duration) -> Duration {
    let config = ClientConfig {
        same_host: SameHost::Off,
        timeout: within,
        ..ClientConfig::default()
    };
    let start = Instant::now();
    let served = async {
        let c = Client::connect(&n.tcp_url(), config).await?;
        c.put(b"honest", &value(7, 4096)).await?;
        Ok::<_, kvpool_client::ClientError>(())
    };
    match tokio::time::timeout(within, served).await {
        Ok(Ok(())) => start.elapsed(),
        Ok(Err(e)) => panic!("the honest client failed after {:?}: {e}", start.elapsed()),
        Err(_) => panic!("the honest client was not served within {within:?}"),
    }
}

/// The best of three honest puts: the latency of a node that is not busy otherwise.
async fn honest_best_of_three(n: &Node, within: Duration) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..3 {
        best = best.min(honest_put(n, within).await);
    }
    best
}

/// A raw connection that has said `Hello` (no token); the node's handshake reply.
async fn greeted(to: &str) -> (TcpStream, HelloInfo) {
    let mut s = TcpStream::connect(to).await.unwrap();
    let op = Op::Hello {
        version: PROTOCOL_VERSION,
        token: String::new(),
        client: "admission".into(),
    };
    common::raw::send(&mut s, 1, op, &[]).await;
    match common::raw::recv(&mut s).await.map(|r| r.reply) {
        Some(Reply::Hello(h)) => (s, h),
        other => panic!("handshake answered {other:?}"),
    }
}

/// `name` on the node's metrics page (0 when absent).
fn counter(n: &Node, name: &str) -> u64 {
    metric(&n.scrape(), name).unwrap_or(0)
}

/// 1 100 idle TCP connections from five addresses hold more than the node's 1 024 connection
/// slots. The oldest of those that never said `Hello` are closed to admit new connections, so
/// an honest client is served at once, long before the handshake timeout (60 s here) would
/// have reaped them; connections that did authenticate are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_give_way_to_an_honest_client() {
    let handshake = Duration::from_secs(60);
    let cfg = config_file("[limits]\nhandshake_timeout_ms = 60000\n");
    let n = Node::start("64MiB", &["-c", &cfg]);
    let idle_node = honest_best_of_three(&n, handshake / 2).await;

    let mut authenticated = Vec::new();
    for _ in 0..8 {
        authenticated.push(greeted(&n.tcp).await.0);
    }
    let idle = idle_connections(&n.tcp, 1100).await;
    assert_eq!(idle.len(), 1100, "the kernel queued every connection");
    // Served while every slot is taken, well before the handshake timeout frees any.
    let flooded = honest_best_of_three(&n, handshake / 2).await;
    println!(
        "connect + Hello + put: {idle_node:?} on an idle node, {flooded:?} with 1100 idle \
         connections open"
    );
    let reaped = counter(
        &n,
        "kvpool_connections_reaped_total{cause=\"max_connections\"}",
    );
    // Every connection past the 1 024 slots, and the first honest one after them (the others
    // may take the slot a finished one gave back).
    assert!(
        reaped > 1100 + 8 - 1024,
        "{reaped} unauthenticated connections reaped"
    );
    for (i, s) in authenticated.iter_mut().enumerate() {
        common::raw::send(s, 2, Op::View, &[]).await;
        let r = common::raw::recv(s).await;
        assert!(
            matches!(r.as_ref().map(|r| &r.reply), Some(Reply::View(_))),
            "authenticated connection {i} was closed: {r:?}"
        );
    }
    drop(idle);
}

/// The same when the node runs out of descriptors before it runs out of connection slots
/// (open-file limit 128, no descriptors kept in reserve): an accept that fails for lack of
/// descriptors closes the oldest unauthenticated connection and tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_give_way_when_descriptors_run_out() {
    let handshake = Duration::from_secs(60);
    let cfg = config_file("[limits]\nhandshake_timeout_ms = 60000\n[listen]\nreserve_fds = 0\n");
    let (n, _log) = Node::start_logged(&["prlimit", "--nofile=128:128"], "64MiB", &["-c", &cfg]);
    let idle_node = honest_best_of_three(&n, handshake / 2).await;
    let idle = idle_connections(&n.tcp, 160).await;
    let flooded = honest_best_of_three(&n, handshake / 2).await;
    println!(
        "connect + Hello + put: {idle_node:?} on an idle node, {flooded:?} with 160 idle \
         connections and no descriptors left"
    );
    let reaped = counter(&n, "kvpool_connections_reaped_total{cause=\"descriptors\"}");
    assert!(reaped > 0, "no connection reaped for a descriptor");
    drop(idle);
}

/// 1 000 connections that never authenticate, each announcing a 64 KiB header (the most
/// allowed before `Hello`) and sending 16 bytes of it, then closing: once they are gone the
/// node's resident memory comes back to what it was before them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_of_unauthenticated_headers_goes_back_after_they_close() {
    let n = Node::start("16MiB", &[]);
    // Warm the node up (a client, a put, a scrape), so that what it allocates once is counted.
    honest_put(&n, Duration::from_secs(10)).await;
    counter(&n, "kvpool_connections");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = n.rss();

    let mut conns = idle_connections(&n.tcp, 1000).await;
    assert_eq!(conns.len(), 1000);
    let prefix = FramePrefix {
        header_len: 64 << 10,
        payload_len: 0,
    };
    for s in &mut conns {
        s.write_all(&prefix.encode()).await.unwrap();
        s.write_all(&[0x5a; 16]).await.unwrap();
    }
    // Until the node has read them all: it answers nothing while a header is incomplete.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let held = n.rss();
    drop(conns);

    // Freed memory goes back within a few seconds (the release is rate-limited); wait for it,
    // bounded.
    //
    // The margin, 8 MiB, from measurement (2 cores, debug build): with 64 KiB header buffers
    // and nothing given back, RSS grew 98 MiB while the connections were open and stayed
    // 35 MiB above its baseline after they closed; with the small buffers before `Hello`
    // alone, 27 MiB and 18.6 MiB; with freed memory given back too, it settles 0.3 MiB above.
    // 8 MiB leaves room for the allocator's bookkeeping and the node's maps grown once, and is
    // well below what either fix alone leaves.
    let margin = 8u64 << 20;
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut after = n.rss();
    while after > before + margin && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = n.rss();
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "RSS: {:.1} MiB before, {:.1} MiB with 1000 unauthenticated 64 KiB headers, {:.1} MiB \
         after they closed",
        mib(before),
        mib(held),
        mib(after)
    );
    assert!(
        after <= before + margin,
        "RSS stayed {:.1} MiB above its baseline after the connections closed",
        mib(after.saturating_sub(before))
    );
    honest_put(&n, Duration::from_secs(10)).await;
}

/// What the node answered one `Hello` with `token` from `from`.
async fn hello_from(from: &str, to: &str, token: &str) -> Reply {
    let mut s = connect_from(from, to).await.unwrap();
    let op = Op::Hello {
        version: PROTOCOL_VERSION,
        token: token.into(),
        client: "guesser".into(),
    };
    common::raw::send(&mut s, 1, op, &[]).await;
    common::raw::recv(&mut s).await.expect("a reply").reply
}

/// Whether `r` is a refusal without a check (throttled), as opposed to a wrong token or
/// proof; panics on anything else.
fn throttled(r: &Reply) -> bool {
    match r {
        Reply::Error { code, message } => {
            assert_eq!(
                ErrorCode::from_u16(*code),
                ErrorCode::Unauthorized,
                "{message}"
            );
            message.contains("too many failed")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// The most failures a budget of `per_second` lets be checked over `elapsed`, plus one per
/// address that had failed nothing before (each such address's first attempt is checked
/// whatever the budget).
fn allowed(per_second: u64, elapsed: Duration, addresses: u64) -> u64 {
    per_second + (per_second as f64 * elapsed.as_secs_f64()).ceil() as u64 + addresses
}

/// 40 addresses guess 10 tokens each, as fast as they can (each within its own per-address
/// allowance of 10): the node checks no more of them than its budget of failed tokens per
/// second (20 here) lets through, plus each address's first, and the rest are refused
/// unchecked. A client with the right token from an address that has not failed is admitted
/// all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessed_tokens_are_checked_within_a_node_wide_budget() {
    let cfg = config_file(
        "[auth]\ntoken = \"the-right-token\"\n\
         [limits]\nauth_failures = 10\nauth_failure_refill_ms = 60000\n\
         auth_failures_per_second = 20\n",
    );
    let n = Node::start("16MiB", &["-c", &cfg]);
    let to = n.tcp.clone();
    let start = Instant::now();
    let mut guessers = Vec::new();
    for a in 0..40 {
        let to = to.clone();
        guessers.push(tokio::spawn(async move {
            let from = format!("127.0.1.{}", 1 + a);
            let mut refused = 0;
            for g in 0..10 {
                let r = hello_from(&from, &to, &format!("guess-{a}-{g}")).await;
                refused += throttled(&r) as u64;
            }
            refused
        }));
    }
    let mut refused = 0;
    for g in guessers {
        refused += g.await.unwrap();
    }
    let elapsed = start.elapsed();
    let checked = counter(&n, "kvpool_auth_failures_total");
    println!("400 guesses from 40 addresses in {elapsed:?}: {checked} checked, {refused} refused unchecked");
    assert_eq!(checked + refused, 400);
    assert!(
        checked <= allowed(20, elapsed, 40),
        "{checked} guesses checked in {elapsed:?}"
    );
    assert_eq!(counter(&n, "kvpool_auth_throttled_total"), refused);

    let r = hello_from("127.0.2.1", &to, "the-right-token").await;
    assert!(matches!(r, Reply::Hello(_)), "the honest client: {r:?}");
}

/// One peer sends 200 wrong proofs of the cluster secret, each on a new connection: the node
/// checks no more of them than its budget of failed proofs per second (20 here) lets through,
/// and refuses the rest unchecked; a node holding the secret, from another address, still
/// proves itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_cluster_proofs_are_checked_within_a_node_wide_budget() {
    let cfg = config_file("[limits]\ncluster_auth_failures_per_second = 20\n");
    let n = Node::start("16MiB", &["-c", &cfg]);
    let prove = |from: &'static str, secret: Option<ClusterSecret>| {
        let to = n.tcp.clone();
        async move {
            let mut s = connect_from(from, &to).await.unwrap();
            let op = Op::Hello {
                version: PROTOCOL_VERSION,
                token: String::new(),
                client: "peer".into(),
            };
            common::raw::send(&mut s, 1, op, &[]).await;
            let Some(Reply::Hello(h)) = common::raw::recv(&mut s).await.map(|r| r.reply) else {
                panic!("no handshake");
            };
            let nonce = [9u8; 32];
            let proof = match &secret {
                Some(secret) => secret.peer_proof(h.node, &h.challenge, &nonce),
                None => [0u8; 32],
            };
            common::raw::send(&mut s, 2, Op::ClusterAuth { nonce, proof }, &[]).await;
            common::raw::recv(&mut s).await.expect("a reply").reply
        }
    };
    let start = Instant::now();
    let mut refused = 0;
    for _ in 0..200 {
        refused += throttled(&prove("127.0.3.1", None).await) as u64;
    }
    let elapsed = start.elapsed();
    let checked = counter(&n, "kvpool_cluster_auth_failures_total");
    println!("200 wrong proofs from one peer in {elapsed:?}: {checked} checked, {refused} refused unchecked");
    assert_eq!(checked + refused, 200);
    assert!(
        checked <= allowed(20, elapsed, 1),
        "{checked} proofs checked in {elapsed:?}"
    );
    assert_eq!(counter(&n, "kvpool_cluster_auth_throttled_total"), refused);

    let secret = std::fs::read(n.secret_file()).unwrap();
    let secret = ClusterSecret::from_file_contents(&secret).unwrap();
    let r = prove("127.0.3.2", Some(secret)).await;
    assert!(matches!(r, Reply::ClusterAuth { .. }), "the peer: {r:?}");
}
