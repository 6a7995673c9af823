//! Tenant isolation, door by door (issue 18): with namespaces `a` and `b` guarded by their own
//! tokens, tenant B (holding only `token-b`) can neither read, probe (exists, prefix match),
//! list, remove nor take the quota of tenant A's namespace through any socket door of a real
//! `kvpoold`: TCP, TLS over TCP, QUIC, the Unix socket, a same-host client (its calls), and the
//! RESP front door. The Python door wraps the same client (python/tests/client). Not covered,
//! because it does not hold: a same-host process reading the mapped segments directly, bypassing
//! the calls (SECURITY.md, "Same host").
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
