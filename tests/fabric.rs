//! `fabric://`: a real daemon with its segments registered with libfabric (`--fabric tcp`, and
//! `shm`), and clients that read values one-sidedly over it: every size, batched gets into
//! caller buffers and scattered, prefixes, misses, values replaced and removed between reads;
//! the node's payload counter shows the bytes did not come through the socket. Tenants: a
//! key reaches only its own namespace's segment, a forged access is refused without harm to
//! anyone else, and a provider that checks no keys is offered only to a token that admits to
//! every namespace.
#![cfg(not(loom))]

mod common;

use std::time::Duration;

use common::{metric, value, Node};
use kvpool_client::{Client, ClientConfig, SameHost};
use kvpool_system_tests::deps::require_libfabric;

fn available(test: &str) -> bool {
    require_libfabric(kvpool_fabric::AVAILABLE, test)
}

/// The tests of this file, one at a time: one of them sets `KVPOOL_FABRIC_BOUNCE` for the
/// process while it runs.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn cfg(token: &str, ns: &str) -> ClientConfig {
    ClientConfig {
        token: token.into(),
        namespace: ns.into(),
        same_host: SameHost::Off,
        timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    }
}

fn start(provider: &str, config: &str) -> Node {
    let dir = common::temp_dir("fabric");
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, config).unwrap();
    Node::start(
        "64MiB",
        &["--fabric", provider, "--config", path.to_str().unwrap()],
    )
}

fn payload_out(n: &Node) -> u64 {
    metric(&n.scrape(), "kvpool_payload_bytes_total{direction=\"out\"}").unwrap_or(0)
}

/// The client's operations over `fabric://` against a node serving `provider`.
async fn gets_over(provider: &str) {
    let n = start(provider, "");
    let url = format!("fabric://{}", n.tcp);
    let c = Client::connect(&url, cfg("", "default")).await.unwrap();
    let tcp = Client::connect(&n.tcp_url(), cfg("", "default"))
        .await
        .unwrap();
    assert!(!c.is_local());
    let sizes = [0usize, 1, 511, 4096, 64 << 10, 2 << 20, 3 << 20];
    let mut total = 0;
    for (j, len) in sizes.into_iter().enumerate() {
        let key = format!("k-{j}");
        let v = value(j as u64, len);
        tcp.put(key.as_bytes(), &v).await.unwrap();
        total += len as u64;
    }
    let before = payload_out(&n);
    for round in 0..3 {
        for (j, len) in sizes.into_iter().enumerate() {
            let key = format!("k-{j}");
            let got = c.get(key.as_bytes()).await.unwrap();
            assert_eq!(got, Some(value(j as u64, len)), "{provider} {len} {round}");
        }
    }
    assert_eq!(c.get(b"absent").await.unwrap(), None);
    // Batched, into the caller's buffers, with a miss in the middle.
    let keys: Vec<Vec<u8>> = ["k-3", "absent", "k-5", "k-6"]
        .iter()
        .map(|k| k.as_bytes().to_vec())
        .collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 3 << 20]; 4];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let lens = c.batch_get_into(&refs, &mut dsts).await.unwrap();
    assert_eq!(lens, vec![Some(4096), None, Some(2 << 20), Some(3 << 20)]);
    assert_eq!(&bufs[0][..4096], &value(3, 4096)[..]);
    assert_eq!(&bufs[2][..2 << 20], &value(5, 2 << 20)[..]);
    assert_eq!(&bufs[3][..], &value(6, 3 << 20)[..]);
    // By address: a range of a located object, straight over the fabric.
    let l = c.lease(&[b"k-5"], 0).await.unwrap()[0].unwrap();
    let mut part = vec![0u8; 100_000];
    assert!(c.read(&l.addr, 12_345, &mut part).await.unwrap());
    assert_eq!(&part[..], &value(5, 2 << 20)[12_345..112_345]);
    let served_by_socket = payload_out(&n) - before;
    assert!(
        served_by_socket < total,
        "{provider}: {served_by_socket} payload bytes went through the socket for {} read",
        3 * total
    );
    // Replaced: the old address reads nothing, over the fabric as over the socket.
    tcp.put(b"k-5", &value(55, 2 << 20)).await.unwrap();
    assert!(!c.read(&l.addr, 0, &mut part).await.unwrap());
    // A buffer too small is an error, not a short read.
    let mut small = vec![0u8; 100];
    assert!(c.get_into(b"k-4", &mut small).await.is_err());
    // Replaced and removed between two reads: the new value, then a miss; never the old bytes.
    for round in 0..20u64 {
        let v = value(100 + round, 64 << 10);
        tcp.put(b"k-4", &v).await.unwrap();
        assert_eq!(c.get(b"k-4").await.unwrap(), Some(v), "{provider} {round}");
    }
    assert!(tcp.remove(b"k-4").await.unwrap());
    assert_eq!(c.get(b"k-4").await.unwrap(), None);
    // Puts over fabric:// go through the socket and read back over the fabric.
    c.put(b"mine", &value(7, 1 << 20)).await.unwrap();
    assert_eq!(tcp.get(b"mine").await.unwrap(), Some(value(7, 1 << 20)));
    assert_eq!(c.get(b"mine").await.unwrap(), Some(value(7, 1 << 20)));
    let page = n.scrape();
    assert!(
        metric(&page, "kvpool_fabric_registered_bytes").is_some_and(|b| b >= 64 << 20),
        "{page}"
    );
    assert!(
        metric(&page, "kvpool_fabric_offers_total{result=\"served\"}").is_some_and(|b| b >= 1),
        "{page}"
    );
    // Opening libfabric left the node's signal handlers as they were: SIGTERM is a clean stop
    // (a provider library's own handlers would exit with a failure, skipping the shutdown).
    let mut n = n;
    let status = n.stop();
    assert!(
        status.success(),
        "{provider}: SIGTERM exits cleanly: {status:?}"
    );
    // A client dropped closes its endpoints (shm: their files in /dev/shm go with them).
    drop((c, tcp));
    let ours = format!("{}:", std::process::id());
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|f| f.starts_with(&ours))
        .collect();
    assert!(left.is_empty(), "{provider}: left in /dev/shm: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fabric_gets_over_the_tcp_provider() {
    if available("fabric_gets_over_the_tcp_provider") {
        let _one = SERIAL.lock().await;
        gets_over("tcp").await;
    }
}

/// The path of providers that require registered buffers (verbs, EFA), taken over tcp: reads
/// land in the lane's registered buffer and are copied out, hashed in the same pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fabric_gets_through_registered_buffers() {
    if available("fabric_gets_through_registered_buffers") {
        let _one = SERIAL.lock().await;
        // Read by a client when it opens a fabric; the other tests of this process wait.
        std::env::set_var("KVPOOL_FABRIC_BOUNCE", "1");
        gets_over("tcp").await;
        std::env::remove_var("KVPOOL_FABRIC_BOUNCE");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fabric_gets_over_the_shm_provider() {
    if available("fabric_gets_over_the_shm_provider") {
        let _one = SERIAL.lock().await;
        gets_over("shm").await;
    }
}

/// Two tenants, each in a segment of its own behind its own token.
const TENANTS: &str = "[[namespace]]\nname = \"a\"\ntokens = [\"token-a\"]\nquota = \"16MiB\"\n\n\
                       [[namespace]]\nname = \"b\"\ntokens = [\"token-b\"]\nquota = \"16MiB\"\n";

/// The raw `FabricInfo` a token is given.
async fn fabric_info(n: &Node, token: &str) -> kvpool::protocol::Reply {
    use common::raw::{hello_with, recv, send};
    let mut s = tokio::net::TcpStream::connect(&n.tcp).await.unwrap();
    hello_with(&mut s, token).await;
    send(&mut s, 2, kvpool::protocol::Op::FabricInfo, &[]).await;
    recv(&mut s).await.expect("a reply").reply
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_reaches_only_its_own_segment_over_the_fabric() {
    if !available("a_tenant_reaches_only_its_own_segment_over_the_fabric") {
        return;
    }
    let _one = SERIAL.lock().await;
    use kvpool::protocol::Reply;
    let n = start("tcp", TENANTS);
    let url = format!("fabric://{}", n.tcp);
    let a = Client::connect(&url, cfg("token-a", "a")).await.unwrap();
    let b = Client::connect(&url, cfg("token-b", "b")).await.unwrap();
    let secret = value(42, 1 << 20);
    a.put(b"secret", &secret).await.unwrap();
    b.put(b"own", &value(43, 4096)).await.unwrap();
    let (
        Reply::FabricInfo {
            segments: of_a,
            address,
            ..
        },
        Reply::FabricInfo { segments: of_b, .. },
    ) = (
        fabric_info(&n, "token-a").await,
        fabric_info(&n, "token-b").await,
    )
    else {
        panic!("both tenants are offered the fabric");
    };
    // Both reach the common segment (the default namespace admits every token); each its own
    // segment, and never the other's.
    let only = |mine: &[kvpool::protocol::FabricSegment],
                theirs: &[kvpool::protocol::FabricSegment]| {
        let own: Vec<_> = mine
            .iter()
            .filter(|s| !theirs.iter().any(|t| t.id == s.id))
            .cloned()
            .collect();
        assert_eq!(
            own.len(),
            1,
            "one segment of its own: {mine:?} against {theirs:?}"
        );
        own
    };
    let (of_a, of_b) = (only(&of_a, &of_b), only(&of_b, &of_a));
    assert_ne!(of_a[0].key, of_b[0].key);
    // Tenant B, on the fabric itself: its own key over a's segment's range, and keys it
    // guesses. Each is refused by the provider; then a and b are served as before.
    tokio::task::block_in_place(|| {
        use kvpool_fabric::{Fabric, Remote};
        let mut tries = vec![Remote {
            len: of_a[0].total_len.max(of_b[0].total_len) * 4,
            ..Remote {
                addr: of_b[0].addr,
                key: of_b[0].key,
                len: 0,
            }
        }];
        for k in [
            1,
            2,
            3,
            of_b[0].key.wrapping_add(1),
            of_b[0].key.wrapping_sub(1),
        ] {
            tries.push(Remote {
                addr: of_a[0].addr,
                key: k,
                len: of_a[0].total_len,
            });
        }
        for (i, forged) in tries.iter().enumerate() {
            let f = Fabric::open("tcp").unwrap();
            let mut ep = f.endpoint().unwrap();
            let node = ep.insert(&address).unwrap();
            let mut buf = ep.register(1 << 20, false, false).unwrap();
            let at = if i == 0 {
                // Past b's own segment: where a's would be if one key reached both.
                of_b[0].total_len
            } else {
                0
            };
            let r = ep.read_many(&mut buf, &[(0..1 << 20, node, *forged, at)], 1);
            assert!(r.is_err(), "forged access {i} read the node's memory");
            assert!(
                !buf.bytes().windows(64).any(|w| w == &secret[..64]),
                "a's bytes reached b"
            );
        }
    });
    assert_eq!(a.get(b"secret").await.unwrap(), Some(secret));
    assert_eq!(b.get(b"own").await.unwrap(), Some(value(43, 4096)));
    // B's namespace over its own fabric path never shows a's keys.
    assert_eq!(b.get(b"secret").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_checks_no_keys_serves_only_a_token_for_every_namespace() {
    if !available("a_provider_that_checks_no_keys_serves_only_a_token_for_every_namespace") {
        return;
    }
    let _one = SERIAL.lock().await;
    use kvpool::protocol::{ErrorCode, Reply};
    let config = format!("[auth]\ntoken = \"node-token\"\n\n{TENANTS}");
    let n = start("shm", &config);
    match fabric_info(&n, "token-b").await {
        Reply::Error { code, .. } => assert_eq!(code, ErrorCode::Unauthorized as u16),
        other => panic!("a tenant was offered shm: {other:?}"),
    }
    let url = format!("fabric://{}", n.tcp);
    assert!(Client::connect(&url, cfg("token-b", "b")).await.is_err());
    let all = Client::connect(&url, cfg("node-token", "b")).await.unwrap();
    all.put(b"k", &value(1, 8192)).await.unwrap();
    assert_eq!(all.get(b"k").await.unwrap(), Some(value(1, 8192)));
    assert!(metric(
        &n.scrape(),
        "kvpool_fabric_offers_total{result=\"refused\"}"
    )
    .is_some_and(|v| v >= 2));
    // Stopped, not killed: the provider's files in /dev/shm go with a clean stop.
    drop(all);
    let mut n = n;
    assert!(n.stop().success());
}

/// A node restarted on the same directory and address: the client's fabric, registered by the
/// dead daemon, is opened again from the new one's `FabricInfo` (new keys, new address), and
/// the recovered values are read over it; meanwhile nothing of the old life is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_is_read_over_its_new_fabric() {
    if !available("a_restarted_node_is_read_over_its_new_fabric") {
        return;
    }
    let _one = SERIAL.lock().await;
    let mut n = Node::start("64MiB", &["--fabric", "tcp"]);
    let url = format!("fabric://{}", n.tcp);
    let c = Client::connect(&url, cfg("", "default")).await.unwrap();
    let v = value(9, 1 << 20);
    c.put(b"kept", &v).await.unwrap();
    assert_eq!(c.get(b"kept").await.unwrap().as_deref(), Some(&v[..]));
    let addrs = [n.tcp.clone(), n.quic.clone(), n.metrics.clone()];
    assert!(n.stop().success());
    let mut n2 = Node::start_in(
        n.dir.clone(),
        "64MiB",
        &["--fabric", "tcp"],
        &[addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()],
    );
    let before = payload_out(&n2);
    // The first call finds the pooled connections dead and reconnects; the ones after it
    // read over the new fabric.
    for _ in 0..5 {
        assert_eq!(c.get(b"kept").await.unwrap().as_deref(), Some(&v[..]));
    }
    let over_socket = payload_out(&n2) - before;
    assert!(
        over_socket < 5 * v.len() as u64,
        "{over_socket} bytes of five 1 MiB reads went through the socket"
    );
    let v2 = value(10, 3 << 20);
    c.put(b"kept", &v2).await.unwrap();
    assert_eq!(c.get(b"kept").await.unwrap().as_deref(), Some(&v2[..]));
    drop(c);
    assert!(n2.stop().success());
}
