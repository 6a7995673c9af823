//! Membership through etcd, with real processes on loopback: an `etcd` of our own (free ports,
//! its own data dir) and `kvpoold`s registered in it with fast timings (down after 1 s: etcd
//! grants its 2 s minimum lease). Three nodes serve by weight, one is killed with SIGKILL, a
//! fourth joins, etcd itself is killed and restarted while the nodes keep serving, and a fifth
//! joins afterwards. A second etcd has its authentication on (tokens expiring after 1 s): the
//! nodes log in as a user that may only touch their prefix, a wrong password is refused and
//! said, and an expired token is traded again. A third etcd serves TLS with client
//! certificates required: nodes given its CA and a client certificate register over
//! `https://`; a node that trusts another CA, or presents no certificate, never enters the
//! view. Without an `etcd` binary (Debian: `apt-get
//! install etcd-server`) they fail in CI and say SKIPPED elsewhere. Every wait is bounded.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::cluster::{cfg, check, fill, serving, wait_view};
use common::etcd::{find_etcd, Etcd};
use common::{temp_dir, Node};
use kvpool::placement::{ClusterView, NodeState};
use kvpool::NodeId;
use kvpool_client::{Client, SameHost};

const TIMING: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "1000"];

/// One call to the single member's JSON gateway; its status and body.
fn post(etcd: &Etcd, path: &str, body: &str) -> (u16, String) {
    etcd.post(0, path, body, None, Duration::from_secs(5))
        .unwrap_or_else(|| panic!("etcd did not answer {path}"))
}

/// Turns etcd's authentication on: a root user, and `user` (password `password`) with a
/// role that may read and write `prefix` and nothing else.
fn enable_auth(etcd: &Etcd, user: &str, password: &str, prefix: &str) {
    use base64::Engine as _;
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let calls = [
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"root-pw"}"#.to_string(),
        ),
        (
            "/v3/auth/user/grant",
            r#"{"user":"root","role":"root"}"#.to_string(),
        ),
        ("/v3/auth/role/add", r#"{"name":"kvpool-rw"}"#.to_string()),
        (
            "/v3/auth/role/grant",
            format!(
                r#"{{"name":"kvpool-rw","perm":{{"permType":"READWRITE","key":"{}","range_end":"{}"}}}}"#,
                b64(prefix.as_bytes()),
                b64(&end)
            ),
        ),
        (
            "/v3/auth/user/add",
            format!(r#"{{"name":"{user}","password":"{password}"}}"#),
        ),
        (
            "/v3/auth/user/grant",
            format!(r#"{{"user":"{user}","role":"kvpool-rw"}}"#),
        ),
        ("/v3/auth/enable", "{}".to_string()),
    ];
    for (path, body) in calls {
        let (status, reply) = post(etcd, path, &body);
        assert_eq!(status, 200, "{path} {body}: {reply}");
    }
    let (status, reply) = post(etcd, "/v3/kv/put", r#"{"key":"eA==","value":"eA=="}"#);
    assert_eq!(
        status, 400,
        "with authentication on, no token is refused: {reply}"
    );
}

/// A CA and the certificates it signed, as PEM files in a directory of their own: etcd's
/// (for 127.0.0.1; also a client certificate, because etcd's gateway presents it to etcd's own
/// gRPC server), a node's client certificate, and another CA that signed nothing.
struct TestPki {
    dir: PathBuf,
    ca: PathBuf,
    etcd_cert: PathBuf,
    etcd_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    other_ca: PathBuf,
}

impl TestPki {
    /// etcd's flags for a TLS listener with this certificate and key, requiring a client
    /// certificate signed by this CA.
    fn etcd_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        for (flag, file) in [
            ("--cert-file", &self.etcd_cert),
            ("--key-file", &self.etcd_key),
            ("--trusted-ca-file", &self.ca),
        ] {
            flags.extend([flag.to_string(), file.to_str().unwrap().to_string()]);
        }
        flags.push("--client-cert-auth".into());
        flags
    }

    fn new() -> TestPki {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let dir = temp_dir("etcd-pki");
        let ca = |name: &str| {
            let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            p.distinguished_name.push(rcgen::DnType::CommonName, name);
            rcgen::CertifiedIssuer::self_signed(p, rcgen::KeyPair::generate().unwrap()).unwrap()
        };
        let (issuer, other) = (ca("kvpool test CA"), ca("another CA"));
        let write = |name: &str, pem: String| {
            let p = dir.join(name);
            std::fs::write(&p, pem).unwrap();
            p
        };
        let leaf = |names: &[&str], usages, file: &str| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            let mut p = rcgen::CertificateParams::new(names).unwrap();
            p.extended_key_usages = usages;
            p.distinguished_name
                .push(rcgen::DnType::CommonName, file.to_string());
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, &issuer).unwrap();
            (
                write(&format!("{file}.pem"), cert.pem()),
                write(&format!("{file}-key.pem"), key.serialize_pem()),
            )
        };
        let (etcd_cert, etcd_key) = leaf(&["127.0.0.1"], vec![ServerAuth, ClientAuth], "etcd");
        let (client_cert, client_key) = leaf(&["kvpool-node"], vec![ClientAuth], "node");
        TestPki {
            ca: write("ca.pem", issuer.pem()),
            other_ca: write("other-ca.pem", other.pem()),
            etcd_cert,
            etcd_key,
            client_cert,
            client_key,
            dir,
        }
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts node `id` with `memory`, registered in `etcd`, with the cluster secret kept next to
/// etcd's data.
fn start(id: u32, memory: &str, etcd: &Etcd) -> Node {
    let args = node_args(id, etcd);
    Node::start(memory, &args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The flags of node `id` registered in `etcd`.
fn node_args(id: u32, etcd: &Etcd) -> Vec<String> {
    let secret = etcd.dir.join("cluster.secret");
    if !secret.exists() {
        common::write_secret(&secret, 42);
    }
    let mut args: Vec<String> = vec![
        "--node-id".into(),
        id.to_string(),
        "--etcd".into(),
        etcd.url(0),
        "--cluster-secret-file".into(),
        secret.to_str().unwrap().into(),
    ];
    args.extend(TIMING.iter().map(|s| s.to_string()));
    args
}

async fn connect(n: &Node) -> Client {
    Client::connect(&n.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap()
}

/// Polls every client's node until all hold the same view (same stamp) and `want` holds of it
/// (at most 20 s); returns that view.
async fn agree(
    clients: &[&Client],
    what: &str,
    want: impl Fn(&ClusterView) -> bool,
) -> ClusterView {
    let t = Instant::now();
    loop {
        let mut views = Vec::new();
        for c in clients {
            views.push(c.view().await.ok());
        }
        if let Some(Some(first)) = views.first() {
            if want(first)
                && views
                    .iter()
                    .all(|v| v.as_ref().is_some_and(|v| v.stamp() == first.stamp()))
            {
                return first.clone();
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the nodes never agreed on a view where {what}: {views:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn state(v: &ClusterView, id: u32) -> Option<NodeState> {
    v.node(NodeId(id)).map(|n| n.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_membership_survives_a_crash_a_join_and_an_etcd_restart() {
    let bin = find_etcd();
    let test = "etcd_membership_survives_a_crash_a_join_and_an_etcd_restart";
    if !common::deps::require(bin.is_some(), test, "etcd", "apt-get install etcd-server") {
        return;
    }
    let bin = bin.expect("checked above");
    let mut etcd = Etcd::start(bin, 1, &[]);
    let n0 = start(0, "64MiB", &etcd);
    let n1 = start(1, "128MiB", &etcd);
    let mut n2 = start(2, "64MiB", &etcd);
    let (c0, c1, c2) = (connect(&n0).await, connect(&n1).await, connect(&n2).await);
    agree(&[&c0, &c1, &c2], "3 serving", |v| serving(v) == 3).await;

    // Keys spread by weight (1:2:1) and are readable from every node.
    assert_eq!(fill(&c0, 0..10_000).await, 10_000);
    let mut held = [0u64; 3];
    for (id, h) in held.iter_mut().enumerate() {
        *h = c0.node_stats(id as u32).await.unwrap().objects;
    }
    for (id, want) in [0.25, 0.5, 0.25].into_iter().enumerate() {
        let share = held[id] as f64 / 10_000.0;
        assert!((share - want).abs() < 0.05, "node {id}: {share}");
    }
    assert_eq!(check(&c1, 0..10_000).await, 10_000);
    assert_eq!(check(&c2, 0..10_000).await, 10_000);

    // SIGKILL node 2: its lease expires and every node marks it down.
    let mut child = n2.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    wait_view(&c0, "node 2 down", |v| state(v, 2) == Some(NodeState::Down)).await;
    println!(
        "node 2 marked down {:?} after SIGKILL (down after 1000 ms, so a 2 s lease)",
        killed.elapsed()
    );
    agree(&[&c0, &c1], "node 2 down, 2 serving", |v| {
        state(v, 2) == Some(NodeState::Down) && serving(v) == 2
    })
    .await;
    // Its keys are misses; every other key is still there, byte for byte.
    assert_eq!(check(&c0, 0..10_000).await as u64, 10_000 - held[2]);
    drop(c2);

    // A fourth node joins and takes about a quarter of new writes (64 of 256 MiB).
    let n3 = start(3, "64MiB", &etcd);
    let c3 = connect(&n3).await;
    agree(&[&c0, &c1, &c3], "node 3 serving", |v| {
        serving(v) == 3 && state(v, 3) == Some(NodeState::Serving)
    })
    .await;
    // Nodes 0 and 1 hand node 3 the old keys it now owns: counted once that has settled.
    let mut before = u64::MAX;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = c0.node_stats(3).await.unwrap().objects;
        if now == before {
            break;
        }
        before = now;
    }
    println!("node 3 was handed {before} old keys");
    assert_eq!(fill(&c0, 20_000..24_000).await, 4_000);
    let share = (c0.node_stats(3).await.unwrap().objects - before) as f64 / 4_000.0;
    println!("node 3 took {:.1} % of new writes", share * 100.0);
    assert!((0.15..0.35).contains(&share), "about a quarter: {share}");

    // etcd goes away: the nodes keep serving reads and writes on their last view, for longer
    // than a lease lasts.
    let mut before = Vec::new();
    for c in [&c0, &c1, &c3] {
        before.push(c.view().await.unwrap().version);
    }
    etcd.kill(0);
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(3) {
        let i = outage.elapsed().as_millis() as u64;
        let base = 30_000 + i * 100;
        assert_eq!(
            fill(&c1, base..base + 100).await,
            100,
            "writes during the outage"
        );
        assert_eq!(
            check(&c3, base..base + 100).await,
            100,
            "reads during the outage"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let during = agree(&[&c0, &c1, &c3], "3 serving during the outage", |v| {
        serving(v) == 3
    })
    .await;
    assert_eq!(state(&during, 2), Some(NodeState::Down));

    // etcd is back (same data dir): every node registers again and follows it afresh.
    etcd.launch(0);
    etcd.wait_healthy();
    let back = Instant::now();
    for (c, v0) in [&c0, &c1, &c3].into_iter().zip(before) {
        wait_view(c, "registered again (a newer revision)", |v| v.version > v0).await;
    }
    println!(
        "nodes registered again {:?} after etcd came back",
        back.elapsed()
    );
    let after = agree(&[&c0, &c1, &c3], "3 serving after the restart", |v| {
        serving(v) == 3
    })
    .await;
    assert_eq!(
        after.stamp(),
        during.stamp(),
        "nobody changed: the same view"
    );

    // A fresh node still joins, and every node agrees again.
    let mut n4 = start(4, "64MiB", &etcd);
    let c4 = connect(&n4).await;
    agree(&[&c0, &c1, &c3, &c4], "node 4 serving", |v| {
        serving(v) == 4 && state(v, 4) == Some(NodeState::Serving)
    })
    .await;
    // Keys that now hash to node 4 were handed to it, or are found on their previous owners
    // (the client's fallback).
    let found = check(&c0, 20_000..24_000).await;
    assert!(found >= 3_600, "old keys after the join: {found} of 4000");

    // SIGTERM with other nodes serving: it drains, publishes `down`, and exits.
    drop(c4);
    let status = n4.stop();
    assert!(status.success(), "{status:?}");
    agree(&[&c0, &c1, &c3], "node 4 left", |v| {
        state(v, 4) == Some(NodeState::Down) && serving(v) == 3
    })
    .await;
    drop((n0, n1));
}

/// etcd's own authentication on, with tokens that expire after 1 s unused: nodes given a user
/// that may read and write only the cluster's prefix register and serve; a node with a wrong
/// password says why and never enters the view; and once the tokens have expired, a node's
/// next change (a drain) is put with a new token, without the session failing first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_authentication_admits_the_cluster_user_and_refuses_a_wrong_password() {
    let bin = find_etcd();
    let test = "etcd_authentication_admits_the_cluster_user_and_refuses_a_wrong_password";
    if !common::deps::require(bin.is_some(), test, "etcd", "apt-get install etcd-server") {
        return;
    }
    let bin = bin.unwrap();
    let etcd = Etcd::start(bin, 1, &["--auth-token-ttl", "1"]);
    enable_auth(&etcd, "kvpool", "kvpool-pw", "/kvpool/");
    let good = etcd.dir.join("etcd.password");
    std::fs::write(&good, "kvpool-pw\n").unwrap();
    let bad = etcd.dir.join("wrong.password");
    std::fs::write(&bad, "not-it\n").unwrap();
    let start_as = |id: u32, password: &PathBuf| {
        let mut args = node_args(id, &etcd);
        args.extend([
            "--etcd-user".to_string(),
            "kvpool".into(),
            "--etcd-password-file".into(),
            password.to_str().unwrap().into(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Node::start_logged(&[], "64MiB", &args)
    };
    let (n0, log0) = start_as(0, &good);
    let (mut n1, log1) = start_as(1, &good);
    let (c0, c1) = (connect(&n0).await, connect(&n1).await);
    agree(&[&c0, &c1], "both nodes serve", |v| serving(v) == 2).await;

    let (n9, log9) = start_as(9, &bad);
    let t = Instant::now();
    while log9.count("authentication failed") == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a wrong password was never reported: {:?}",
            log9.lines()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let line = log9
        .lines()
        .into_iter()
        .find(|l| l.contains("authentication failed"));
    assert!(
        line.as_deref().unwrap_or("").contains("kvpool"),
        "names the user: {line:?}"
    );
    let v = c0.view().await.unwrap();
    assert!(
        v.node(NodeId(9)).is_none(),
        "a node with a wrong password is not in the view"
    );

    // Every token has expired by now (1 s unused; keepalives need none). Node 1 is stopped
    // (SIGTERM with a peer serving: it drains, puts `draining` then `down`, and exits): its
    // puts go with a new token, and the other node sees it leave.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(n1.stop().success());
    agree(&[&c0], "node 1 has left", |v| {
        serving(v) == 1 && state(v, 1) == Some(NodeState::Down)
    })
    .await;
    for (name, log) in [("node 0", &log0), ("node 1", &log1)] {
        assert_eq!(
            log.count("etcd: lost"),
            0,
            "{name} lost etcd (a refused token must be traded again within the call): {:?}",
            log.lines()
        );
    }
    drop((n0, n9));
}

/// etcd serving TLS with client certificates required (`--client-cert-auth`): nodes given
/// `--etcd https://…`, the CA and a client certificate register and serve; a node that trusts
/// only another CA refuses etcd's certificate and says so, and a node that presents no
/// certificate is refused by etcd; neither enters the view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_verifies_etcd_and_presents_the_node_certificate() {
    let bin = find_etcd();
    let test = "etcd_over_tls_verifies_etcd_and_presents_the_node_certificate";
    if !common::deps::require(bin.is_some(), test, "etcd", "apt-get install etcd-server") {
        return;
    }
    let pki = TestPki::new();
    let flags = pki.etcd_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let etcd = Etcd::start_tls(bin.unwrap(), &flags);
    let path = |p: &PathBuf| p.to_str().unwrap().to_string();
    let start_tls = |id: u32, ca: &PathBuf, client: bool| {
        let mut args = node_args(id, &etcd);
        let at = args.iter().position(|a| a == "--etcd").unwrap() + 1;
        args[at] = etcd.https_url(0);
        args.extend(["--etcd-ca-file".to_string(), path(ca)]);
        if client {
            args.extend([
                "--etcd-cert-file".to_string(),
                path(&pki.client_cert),
                "--etcd-key-file".into(),
                path(&pki.client_key),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Node::start_logged(&[], "64MiB", &args)
    };
    let (n0, _log0) = start_tls(0, &pki.ca, true);
    let (n1, _log1) = start_tls(1, &pki.ca, true);
    let (c0, c1) = (connect(&n0).await, connect(&n1).await);
    agree(&[&c0, &c1], "both nodes serve over TLS", |v| {
        serving(v) == 2
    })
    .await;
    assert_eq!(fill(&c0, 0..1_000).await, 1_000);
    assert_eq!(check(&c1, 0..1_000).await, 1_000);

    let (n8, log8) = start_tls(8, &pki.other_ca, true);
    let (n9, log9) = start_tls(9, &pki.ca, false);
    for (what, log, says) in [
        ("another CA", &log8, "certificate"),
        ("no client certificate", &log9, "etcd: lost"),
    ] {
        let t = Instant::now();
        while !log
            .lines()
            .iter()
            .any(|l| l.contains("etcd: lost") && l.contains(says))
        {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{what}: the failure was never logged: {:?}",
                log.lines()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let v = c0.view().await.unwrap();
    for id in [8, 9] {
        assert!(v.node(NodeId(id)).is_none(), "node {id} is not in the view");
    }
    assert_eq!(serving(&v), 2);
    drop((n0, n1, n8, n9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_holds_a_node_restarting_in_place_and_it_serves_its_objects_again() {
    let bin = find_etcd();
    let test = "etcd_holds_a_node_restarting_in_place_and_it_serves_its_objects_again";
    if !common::deps::require(bin.is_some(), test, "etcd", "apt-get install etcd-server") {
        return;
    }
    let etcd = Etcd::start(bin.expect("checked above"), 1, &[]);
    let restart = [
        "--restart-on-shutdown",
        "true",
        "--restart-window-ms",
        "30000",
    ];
    let args = |id: u32| {
        let mut a = node_args(id, &etcd);
        a.extend(restart.iter().map(|s| s.to_string()));
        a
    };
    let start_r = |id: u32| {
        let a = args(id);
        Node::start("64MiB", &a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let n0 = start_r(0);
    let mut n1 = start_r(1);
    let n2 = start_r(2);
    let (c0, c2) = (connect(&n0).await, connect(&n2).await);
    let before = agree(&[&c0, &c2], "3 serving", |v| serving(v) == 3).await;
    assert_eq!(fill(&c0, 0..3000).await, 3000);
    let held: Vec<u64> = (0..3000)
        .filter(|&i| before.owner(&common::cluster::key(i)) == Some(NodeId(1)))
        .collect();
    assert!(!held.is_empty());

    assert!(n1.stop().success());
    let away = agree(&[&c0, &c2], "node 1 restarting", |v| {
        state(v, 1) == Some(NodeState::Restarting)
    })
    .await;
    assert_eq!(away.owner(&common::cluster::key(held[0])), Some(NodeId(1)));
    // Past the lease TTL of a live node (1 s asked, etcd's minimum 2 s granted): the restart
    // window's lease holds it.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        state(&c0.view().await.unwrap(), 1),
        Some(NodeState::Restarting),
        "held for the restart window"
    );
    for &i in &held {
        assert_eq!(c0.get(&common::cluster::key(i)).await.unwrap(), None);
    }

    let a = args(1);
    let addrs = [n1.tcp.as_str(), n1.quic.as_str(), n1.metrics.as_str()];
    let n1 = Node::start_in(
        n1.dir.clone(),
        "64MiB",
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        &addrs,
    );
    let c1 = connect(&n1).await;
    let after = agree(&[&c0, &c1, &c2], "3 serving", |v| serving(v) == 3).await;
    assert_eq!(
        after.node(NodeId(1)).unwrap().epoch,
        before.node(NodeId(1)).unwrap().epoch + 2,
        "restarting, then serving again: no join in between"
    );
    for c in [&c0, &c1] {
        for &i in &held {
            let v = c.get(&common::cluster::key(i)).await.unwrap();
            assert_eq!(v, Some(common::value(i, 256)), "key {i}");
        }
    }
}
