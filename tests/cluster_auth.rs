//! Cluster control is for cluster peers only, with real `kvpoold` processes on loopback: a
//! plain client (no node token configured, the default) can neither drain a node nor inject a
//! node into the view by `Gossip`; frames of random bytes never drain a node; a node with
//! another cluster secret never joins; a node told to join with no secret refuses to start.
//! Every wait is bounded.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::{cfg, serving, wait_view};
use common::{temp_dir, value, write_secret, Node};
use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::protocol::io::{discard, read_header, read_prefix};
use kvpool::protocol::{
    decode_response_owned, AlignedVec, ErrorCode, Exchange, HelloInfo, Limits, Op, Reply, MAGIC,
    PROTOCOL_VERSION,
};
use kvpool::NodeId;
use kvpool_client::{Client, SameHost};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const HEARTBEAT: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "600"];

/// One raw protocol connection, as any program that reaches the port could open.
struct Raw {
    s: TcpStream,
    exchange: Exchange,
}

impl Raw {
    /// Connects and says `Hello` with no token.
    async fn hello(addr: &str) -> (Raw, HelloInfo) {
        let s = TcpStream::connect(addr).await.unwrap();
        let mut r = Raw {
            s,
            exchange: Exchange::new(),
        };
        let hello = Op::Hello {
            version: PROTOCOL_VERSION,
            token: String::new(),
            client: "intruder".into(),
        };
        match r.call(hello).await {
            Some(Reply::Hello(h)) => (r, h),
            other => panic!("handshake answered {other:?}"),
        }
    }

    /// Sends one request; the reply, or None when the node closed the connection.
    async fn call(&mut self, op: Op) -> Option<Reply> {
        let frame = self.exchange.request(op).frame(&[]);
        self.send_raw(&frame).await
    }

    /// Sends bytes as they are and reads one reply (bounded: 2 s); None when the node closed
    /// the connection or did not answer.
    async fn send_raw(&mut self, bytes: &[u8]) -> Option<Reply> {
        self.s.write_all(bytes).await.ok()?;
        self.s.flush().await.ok()?;
        let read = async {
            let p = read_prefix(&mut self.s, &Limits::default()).await.ok()??;
            let mut h = AlignedVec::new();
            read_header(&mut self.s, &p, &mut h).await.ok()?;
            discard(&mut self.s, p.payload_len).await.ok()?;
            decode_response_owned(&h).ok().map(|r| r.reply)
        };
        tokio::time::timeout(Duration::from_secs(2), read)
            .await
            .ok()
            .flatten()
    }
}

/// A frame with no payload around an encoded header.
fn frame(hdr: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(16 + hdr.len());
    f.extend_from_slice(&MAGIC);
    f.extend_from_slice(&(hdr.len() as u32).to_le_bytes());
    f.extend_from_slice(&0u64.to_le_bytes());
    f.extend_from_slice(hdr);
    f
}

fn code(r: &Option<Reply>) -> Option<u16> {
    match r {
        Some(Reply::Error { code, .. }) => Some(*code),
        _ => None,
    }
}

/// A view holding `real` plus a fake node 99 of 1 PiB, serving, at a high epoch.
fn forged(real: &ClusterView) -> ClusterView {
    let mut nodes = real.nodes.clone();
    nodes.push(NodeInfo {
        id: 99,
        tcp: "127.0.0.1:9".into(),
        quic: String::new(),
        metrics: String::new(),
        capacity: 1 << 50,
        state: NodeState::Serving,
        epoch: 1_000,
    });
    ClusterView::from_nodes(nodes)
}

fn has_fake(v: &ClusterView) -> bool {
    v.node(NodeId(99)).is_some()
}

fn alive(n: &mut Node) -> bool {
    n.child.as_mut().unwrap().try_wait().unwrap().is_none()
}

/// Two nodes sharing the first one's cluster secret, both serving, and a client of the first.
async fn two_nodes() -> (Node, Node, Client) {
    let n0 = Node::start("64MiB", &[&["--node-id", "0"][..], HEARTBEAT].concat());
    let secret = n0.secret_file().to_str().unwrap().to_string();
    let n1 = Node::start(
        "64MiB",
        &[
            &["--node-id", "1", "--peer", &n0.tcp][..],
            &["--cluster-secret-file", &secret],
            HEARTBEAT,
        ]
        .concat(),
    );
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "2 serving", |v| serving(v) == 2).await;
    (n0, n1, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_clients_drain_is_refused_and_the_node_keeps_serving() {
    let (mut n0, mut n1, c) = two_nodes().await;

    // Drain from a plain client (the node has no token): refused, the connection keeps working.
    let (mut raw, _) = Raw::hello(&n0.tcp).await;
    assert_eq!(
        code(&raw.call(Op::Drain).await),
        Some(ErrorCode::Unauthorized as u16)
    );
    assert!(matches!(raw.call(Op::View).await, Some(Reply::View(_))));
    // A made-up proof of the cluster secret: refused, connection closed.
    let (mut guess, _) = Raw::hello(&n0.tcp).await;
    let r = guess
        .call(Op::ClusterAuth {
            nonce: [7; 32],
            proof: [0; 32],
        })
        .await;
    assert_eq!(code(&r), Some(ErrorCode::Unauthorized as u16));
    assert!(
        guess.call(Op::Drain).await.is_none(),
        "closed after a failed proof"
    );
    // The CLI with a wrong secret can't drain either.
    let wrong = temp_dir("wrong-secret").join("cluster.secret");
    write_secret(&wrong, 7);
    let out = Command::new(common::bin("kvpool"))
        .args(["cluster", "drain", "0", "-e", &n0.tcp_url()])
        .arg("--cluster-secret-file")
        .arg(&wrong)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");

    // Ten heartbeats later both nodes still serve, and the data path works.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(alive(&mut n0) && alive(&mut n1), "a node exited");
    let v = c.view().await.unwrap();
    assert_eq!(serving(&v), 2, "{v:?}");
    c.put(b"tenant-key", &value(1, 4096)).await.unwrap();
    assert_eq!(c.get(b"tenant-key").await.unwrap(), Some(value(1, 4096)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_clients_gossip_of_a_fake_node_is_refused_and_never_in_the_view() {
    let (mut n0, mut n1, _c) = two_nodes().await;

    // Gossip advertising a 1 PiB node, to both nodes.
    let (mut raw0, hello) = Raw::hello(&n0.tcp).await;
    let (mut raw1, _) = Raw::hello(&n1.tcp).await;
    let fake = forged(&hello.view);
    let r0 = raw0.call(Op::Gossip { view: fake.clone() }).await;
    let r1 = raw1.call(Op::Gossip { view: fake }).await;

    // For ten heartbeats neither view ever holds the fake node.
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(1) {
        for n in [&n0, &n1] {
            let v = Client::connect(&n.tcp_url(), cfg(SameHost::Off))
                .await
                .unwrap()
                .view()
                .await
                .unwrap();
            assert!(!has_fake(&v), "node at {} took the forged node", n.tcp);
            assert_eq!(serving(&v), 2);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(code(&r0), Some(ErrorCode::Unauthorized as u16));
    assert_eq!(code(&r1), Some(ErrorCode::Unauthorized as u16));
    assert!(matches!(raw0.call(Op::View).await, Some(Reply::View(_))));
    assert!(alive(&mut n0) && alive(&mut n1));
    // A tenant's put and get go to the real owners.
    let fresh = Client::connect(&n1.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    for i in 0..50u64 {
        let k = format!("tenant-{i}");
        fresh.put(k.as_bytes(), &value(i, 1024)).await.unwrap();
        assert_eq!(fresh.get(k.as_bytes()).await.unwrap(), Some(value(i, 1024)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_of_random_bytes_never_drain_a_node() {
    let mut n = Node::start("64MiB", HEARTBEAT);
    let (_, hello) = Raw::hello(&n.tcp).await;
    // Seeds: every control request a plain client could try, encoded correctly, then mutated.
    let seeds: Vec<Vec<u8>> = [
        Op::Drain,
        Op::Gossip {
            view: forged(&hello.view),
        },
        Op::ClusterAuth {
            nonce: [1; 32],
            proof: [2; 32],
        },
        Op::View,
        Op::Stats,
    ]
    .into_iter()
    .map(|op| Exchange::new().request_as(9, op).header.to_vec())
    .collect();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut conn, _) = Raw::hello(&n.tcp).await;
    let mut sent = 0;
    for round in 0..1_500u32 {
        let hdr: Vec<u8> = match round % 3 {
            // 80 random bytes after a valid prefix.
            0 => (0..64).map(|_| rand() as u8).collect(),
            // A seed with a few bytes changed.
            1 => {
                let mut h = seeds[rand() as usize % seeds.len()].clone();
                for _ in 0..1 + rand() % 4 {
                    let i = rand() as usize % h.len();
                    h[i] = rand() as u8;
                }
                h
            }
            // A seed as it is.
            _ => seeds[rand() as usize % seeds.len()].clone(),
        };
        let reply = conn.send_raw(&frame(&hdr)).await;
        sent += 1;
        if reply.is_none() {
            // The node closed the connection (a frame that broke the protocol): a new one.
            conn = match TcpStream::connect(&n.tcp).await {
                Ok(_) => Raw::hello(&n.tcp).await.0,
                Err(e) => panic!("round {round}: the node stopped listening: {e}"),
            };
        }
    }
    // Still serving, still in its own view as serving, and the process is alive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(alive(&mut n), "the node exited after {sent} random frames");
    let c = Client::connect(&n.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    let v = c.view().await.unwrap();
    assert_eq!(v.node(NodeId(0)).map(|r| r.state), Some(NodeState::Serving));
    assert!(!has_fake(&v));
    c.put(b"after", b"fuzz").await.unwrap();
    assert_eq!(c.get(b"after").await.unwrap(), Some(b"fuzz".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_cluster_secret_never_joins() {
    let mut n0 = Node::start("64MiB", &[&["--node-id", "0"][..], HEARTBEAT].concat());
    let other = temp_dir("other-secret").join("cluster.secret");
    write_secret(&other, 99);
    let mut n1 = Node::start(
        "64MiB",
        &[
            &["--node-id", "1", "--peer", &n0.tcp][..],
            &["--cluster-secret-file", other.to_str().unwrap()],
            HEARTBEAT,
        ]
        .concat(),
    );
    let c0 = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    let c1 = Client::connect(&n1.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    // Fifteen heartbeats: neither ever sees the other.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1_500) {
        let (v0, v1) = (c0.view().await.unwrap(), c1.view().await.unwrap());
        assert_eq!(v0.nodes.len(), 1, "node 0 admitted a stranger: {v0:?}");
        assert_eq!(
            v1.nodes.len(),
            1,
            "node 1 joined with a wrong secret: {v1:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(alive(&mut n0) && alive(&mut n1));
    c0.put(b"k", b"v").await.unwrap();
    assert_eq!(c0.get(b"k").await.unwrap(), Some(b"v".to_vec()));
}

#[test]
fn a_node_told_to_join_with_no_secret_refuses_to_start() {
    let dir = temp_dir("no-secret");
    let out = Command::new(common::bin("kvpoold"))
        .args(["--data-dir", dir.to_str().unwrap(), "--memory", "16MiB"])
        .args(["--tcp", "127.0.0.1:0", "--quic", "", "--metrics", ""])
        .args(["--peer", "127.0.0.1:9"])
        .env("KVPOOL_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--cluster-secret-file"), "{err}");
    assert!(
        !dir.join("cluster.secret").exists(),
        "no secret is made up for a node that joins others"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
