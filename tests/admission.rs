//! A hostile peer must not starve honest clients of a node: a flood of guessed tokens or
//! cluster proofs is checked within a node-wide budget while a client that has not failed is
//! still admitted. Real `kvpoold` processes over real sockets on loopback (127.0.0.0/8 is all
//! local, so a test plays many peers); every wait is bounded.
#![cfg(not(loom))]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{metric, Node};
use kvpool::protocol::auth::ClusterSecret;
use kvpool::protocol::{ErrorCode, Op, Reply, PROTOCOL_VERSION};
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

/// `name` on the node's metrics page (0 when absent).
fn counter(n: &Node, name: &str) -> u64 {
    metric(&n.scrape(), name).unwrap_or(0)
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
