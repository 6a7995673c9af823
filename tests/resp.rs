//! The Redis-protocol front door of a real `kvpoold` (`--resp`), over raw sockets: the exact
//! bytes LMCache's native `resp://` client expects, keys shared with the native client both
//! ways, garbage closing only its own connection, and keys of another node refused in a
//! cluster. redis-py, redis-cli and redis-benchmark drive it in python/tests/resp.
#![cfg(not(loom))]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::cluster::{cfg, serving, start_node, wait_view};
use common::{value, Node};
use kvpool_client::{Client, ClientConfig, SameHost};

fn resp_node(memory: &str, extra: &[&str]) -> Node {
    let mut args = vec!["--resp", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let n = Node::start(memory, &args);
    assert_ne!(n.resp, "off", "the ready line names the RESP address");
    n
}

fn connect(n: &Node) -> TcpStream {
    let s = TcpStream::connect(&n.resp).expect("connect to the RESP door");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// A command as clients send it.
fn cmd(args: &[&[u8]]) -> Vec<u8> {
    let mut v = Vec::new();
    kvpool::resp::encode::command(&mut v, args);
    v
}

/// Sends `args` and reads exactly `want.len()` bytes back, which must be `want`.
fn expect(s: &mut TcpStream, args: &[&[u8]], want: &[u8]) {
    s.write_all(&cmd(args)).unwrap();
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(want),
        "reply to {:?}",
        String::from_utf8_lossy(args[0])
    );
}

/// Reads one line (through CRLF).
fn line(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while !out.ends_with(b"\r\n") {
        s.read_exact(&mut b).unwrap();
        out.push(b[0]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn remote() -> ClientConfig {
    ClientConfig {
        same_host: SameHost::Off,
        ..ClientConfig::default()
    }
}

/// LMCache's `resp://` connector (csrc/storage_backends/redis): no HELLO, one request in flight,
/// and replies compared byte for byte: `+OK`, `:1`/`:0`, `$<len>` + exactly the stored bytes +
/// CRLF, `$-1` for a miss.
#[test]
fn lmcache_resp_client_bytes_exact() {
    let n = resp_node("64MiB", &[]);
    let mut s = connect(&n);
    let key = b"vllm@1@0@a1b2c3d4e5f60718@bfloat16kv_bytes";
    let chunk = value(7, 1 << 20);
    expect(&mut s, &[b"SET", key, &chunk], b"+OK\r\n");
    expect(&mut s, &[b"EXISTS", key], b":1\r\n");
    expect(&mut s, &[b"EXISTS", b"absent"], b":0\r\n");
    let mut want = format!("${}\r\n", chunk.len()).into_bytes();
    want.extend_from_slice(&chunk);
    want.extend_from_slice(b"\r\n");
    expect(&mut s, &[b"GET", key], &want);
    expect(&mut s, &[b"GET", b"absent"], b"$-1\r\n");
    expect(&mut s, &[b"DEL", key], b":1\r\n");
    expect(&mut s, &[b"DEL", key], b":0\r\n");
    expect(&mut s, &[b"GET", key], b"$-1\r\n");
}

/// A value SET over RESP is an ordinary object for the native client, and the other way round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_and_native_clients_share_keys() {
    let n = resp_node("64MiB", &[]);
    let c = Client::connect(&n.tcp_url(), remote()).await.unwrap();
    let mut s = connect(&n);
    let v = value(1, 100_000);
    expect(&mut s, &[b"SET", b"from-resp\r\n", &v], b"+OK\r\n");
    assert_eq!(c.get(b"from-resp\r\n").await.unwrap(), Some(v.clone()));
    let w = value(2, 5000);
    c.put(b"from-native", &w).await.unwrap();
    let mut want = format!("${}\r\n", w.len()).into_bytes();
    want.extend_from_slice(&w);
    want.extend_from_slice(b"\r\n");
    expect(&mut s, &[b"GET", b"from-native"], &want);
    expect(&mut s, &[b"DEL", b"from-native"], b":1\r\n");
    assert_eq!(c.get(b"from-native").await.unwrap(), None);
}

/// Bytes that are not RESP get an error and close that connection; another connection and
/// the daemon carry on. An unknown command is only an error: its connection goes on.
#[test]
fn garbage_closes_only_its_connection() {
    let n = resp_node("64MiB", &[]);
    let mut good = connect(&n);
    expect(&mut good, &[b"SET", b"k", b"v"], b"+OK\r\n");
    expect(
        &mut good,
        &[b"LPUSH"],
        b"-ERR unknown command 'LPUSH', with args beginning with: \r\n",
    );
    for garbage in [
        &b"*2\r\n$3\r\nGET\r\n+nope\r\n"[..],
        b"*1\r\n$999999999999\r\n",
        b"*99999999\r\n",
        b"*1\r\n$3\r\nGETX\r\n",
    ] {
        let mut bad = connect(&n);
        bad.write_all(garbage).unwrap();
        let l = line(&mut bad);
        assert!(l.starts_with("-ERR Protocol error"), "{l:?}");
        let mut rest = Vec::new();
        // Closed by the daemon: EOF (or a reset), never a hang.
        let _ = bad.read_to_end(&mut rest);
        assert!(rest.is_empty(), "{rest:?}");
    }
    // A large value still arriving goes straight into the pool: a missing CRLF after it is
    // caught there too, and nothing is stored.
    let mut bad = connect(&n);
    bad.write_all(b"*3\r\n$3\r\nSET\r\n$4\r\nlate\r\n$100000\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    bad.write_all(&value(9, 100_000)).unwrap();
    bad.write_all(b"XX").unwrap();
    let l = line(&mut bad);
    assert!(l.starts_with("-ERR Protocol error"), "{l:?}");
    expect(&mut good, &[b"EXISTS", b"late"], b":0\r\n");
    // And a well-formed one, split the same way, is stored.
    let mut slow = connect(&n);
    slow.write_all(b"PING\r\n*3\r\n$3\r\nSET\r\n$4\r\nlate\r\n$100000\r\n01")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let v = value(9, 100_000);
    slow.write_all(&v[2..]).unwrap();
    slow.write_all(b"\r").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    slow.write_all(b"\n").unwrap();
    let mut got = [0u8; 12];
    slow.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"+PONG\r\n+OK\r\n");
    let mut want = b"01".to_vec();
    want.extend_from_slice(&v[2..]);
    let mut reply = format!("${}\r\n", want.len()).into_bytes();
    reply.extend_from_slice(&want);
    reply.extend_from_slice(b"\r\n");
    expect(&mut slow, &[b"GET", b"late"], &reply);
    expect(&mut good, &[b"GET", b"k"], b"$1\r\nv\r\n");
    expect(&mut good, &[b"PING"], b"+PONG\r\n");
}

/// Pipelined commands, inline ones among them, are answered in order; EX removes the key at
/// its deadline, for the native client too, and a later SET clears the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelining_inline_commands_and_expiry() {
    let n = resp_node("64MiB", &[]);
    let mut s = connect(&n);
    let mut batch = Vec::new();
    for i in 0..100 {
        batch.extend(cmd(&[b"SET", format!("p{i}").as_bytes(), b"x"]));
    }
    batch.extend_from_slice(b"PING\r\nDBSIZE\r\n");
    s.write_all(&batch).unwrap();
    let mut want = b"+OK\r\n".repeat(100);
    want.extend_from_slice(b"+PONG\r\n:100\r\n");
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).unwrap();
    assert_eq!(got, want);

    let c = Client::connect(&n.tcp_url(), remote()).await.unwrap();
    expect(&mut s, &[b"SET", b"ttl", b"v", b"PX", b"300"], b"+OK\r\n");
    expect(&mut s, &[b"SET", b"kept", b"v", b"PX", b"300"], b"+OK\r\n");
    expect(&mut s, &[b"SET", b"kept", b"w"], b"+OK\r\n");
    expect(&mut s, &[b"SET", b"ttl", b"v", b"NX"], b"$-1\r\n");
    assert!(c.get(b"ttl").await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        c.get(b"ttl").await.unwrap(),
        None,
        "expired for the native client"
    );
    expect(&mut s, &[b"GET", b"ttl"], b"$-1\r\n");
    expect(&mut s, &[b"GET", b"kept"], b"$1\r\nw\r\n");
    expect(
        &mut s,
        &[b"SET", b"k", b"v", b"EX", b"0"],
        b"-ERR invalid expire time in 'set' command\r\n",
    );
}

/// In a cluster of two, the RESP door of one node serves the keys it owns from its pool and
/// forwards the others to their owner, so a copy is only ever stored where the native client
/// looks for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_forwards_keys_owned_elsewhere() {
    let hb = ["--heartbeat-ms", "100", "--down-after-ms", "600"];
    let a = resp_node("64MiB", &[&["--node-id", "0"][..], &hb].concat());
    let _b = start_node(1, "64MiB", Some(&a), &hb);
    let c = Client::connect(&a.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "two serving", |v| serving(v) == 2).await;
    // The door refreshes its view when the membership's stamp moves; give it the same view.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let view = c.view().await.unwrap();
    let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("ck{i}").into_bytes()).collect();
    let mine = keys
        .iter()
        .find(|k| view.owner(k) == Some(kvpool::NodeId(0)))
        .expect("a key of node 0");
    let theirs = keys
        .iter()
        .find(|k| view.owner(k) == Some(kvpool::NodeId(1)))
        .expect("a key of node 1");
    let mut s = connect(&a);
    expect(&mut s, &[b"SET", mine, b"here"], b"+OK\r\n");
    assert_eq!(c.get(mine).await.unwrap(), Some(b"here".to_vec()));
    // A key of node 1, sent to node 0's door, is stored on node 1, where the native client
    // looks for it, and read back through node 0's door.
    expect(&mut s, &[b"SET", theirs, b"elsewhere"], b"+OK\r\n");
    assert_eq!(c.get(theirs).await.unwrap(), Some(b"elsewhere".to_vec()));
    assert_eq!(
        c.node_stats(0).await.unwrap().objects,
        1,
        "only `mine` on node 0"
    );
    expect(&mut s, &[b"GET", theirs], b"$9\r\nelsewhere\r\n");
    expect(&mut s, &[b"STRLEN", theirs], b":9\r\n");
    expect(&mut s, &[b"EXISTS", mine, theirs, b"ck-absent"], b":2\r\n");
    expect(
        &mut s,
        &[b"MGET", theirs, mine, b"ck-absent"],
        b"*3\r\n$9\r\nelsewhere\r\n$4\r\nhere\r\n$-1\r\n",
    );
    // A large value, which the door streams as it arrives, is forwarded whole.
    let big = value(7, 300_000);
    expect(&mut s, &[b"SET", theirs, &big], b"+OK\r\n");
    assert_eq!(c.get(theirs).await.unwrap(), Some(big.clone()));
    let mut want = format!("${}\r\n", big.len()).into_bytes();
    want.extend_from_slice(&big);
    want.extend_from_slice(b"\r\n");
    expect(&mut s, &[b"GET", theirs], &want);
    // MSET across owners: every pair where the native client finds it.
    expect(&mut s, &[b"MSET", mine, b"m0", theirs, b"m1"], b"+OK\r\n");
    assert_eq!(c.get(mine).await.unwrap(), Some(b"m0".to_vec()));
    assert_eq!(c.get(theirs).await.unwrap(), Some(b"m1".to_vec()));
    // A conditional or expiring SET can't be forwarded: refused, and nothing changes.
    s.write_all(&cmd(&[b"SET", theirs, b"nx", b"NX"])).unwrap();
    let l = line(&mut s);
    assert!(l.starts_with("-ERR kvpool: SET with NX"), "{l:?}");
    assert_eq!(c.get(theirs).await.unwrap(), Some(b"m1".to_vec()));
    expect(&mut s, &[b"DEL", theirs, mine], b":2\r\n");
    assert_eq!(c.get(theirs).await.unwrap(), None);
    expect(&mut s, &[b"GET", theirs], b"$-1\r\n");
    // FLUSHDB in a cluster empties the namespace on every node.
    c.put(theirs, b"again").await.unwrap();
    c.put(mine, b"again").await.unwrap();
    expect(&mut s, &[b"FLUSHDB"], b"+OK\r\n");
    assert_eq!(c.get(theirs).await.unwrap(), None);
    assert_eq!(c.get(mine).await.unwrap(), None);
    expect(&mut s, &[b"PING"], b"+PONG\r\n");
}

/// With a node token, a connection must authenticate first, and until it does it may only send
/// small commands (as in Redis): a large bulk is refused before anything is buffered for it.
#[test]
fn unauthenticated_connections_are_held_small() {
    let dir = common::temp_dir("resp-auth");
    let cfg = dir.join("kvpool.toml");
    std::fs::write(
        &cfg,
        "[auth]\ntoken = \"node-token\"\n[[namespace]]\nname = \"team\"\ntokens = [\"team-token\"]\n",
    )
    .unwrap();
    let n = resp_node("64MiB", &["--config", cfg.to_str().unwrap()]);
    let mut s = connect(&n);
    expect(
        &mut s,
        &[b"GET", b"k"],
        b"-NOAUTH Authentication required.\r\n",
    );
    expect(
        &mut s,
        &[b"AUTH", b"team", b"wrong"],
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    );
    expect(&mut s, &[b"AUTH", b"team", b"team-token"], b"+OK\r\n");
    expect(&mut s, &[b"SET", b"k", &value(3, 100_000)], b"+OK\r\n");

    let mut early = connect(&n);
    early
        .write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$100000\r\n")
        .unwrap();
    let l = line(&mut early);
    assert_eq!(l, "-ERR Protocol error: invalid bulk length\r\n");
    let mut rest = Vec::new();
    let _ = early.read_to_end(&mut rest);
    assert!(rest.is_empty());
    // The authenticated connection is unaffected, and sees only its namespace.
    expect(&mut s, &[b"DBSIZE"], b":1\r\n");
    let mut other = connect(&n);
    expect(&mut other, &[b"AUTH", b"node-token"], b"+OK\r\n");
    expect(&mut other, &[b"GET", b"k"], b"$-1\r\n");
}

/// The value of one `INFO memory` field on a fresh connection.
fn info_memory(n: &Node, field: &str) -> u64 {
    let mut s = connect(n);
    s.write_all(&cmd(&[b"INFO", b"memory"])).unwrap();
    let head = line(&mut s);
    let len: usize = head.trim_start_matches('$').trim_end().parse().unwrap();
    let mut body = vec![0u8; len + 2];
    s.read_exact(&mut body).unwrap();
    let body = String::from_utf8(body).unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("INFO memory has {field}: {body}"))
        .trim()
        .parse()
        .unwrap()
}

/// Polls `INFO memory` until `field` satisfies `ok` (10 s at most).
fn wait_info(n: &Node, field: &str, ok: impl Fn(u64) -> bool) -> u64 {
    for _ in 0..1000 {
        let v = info_memory(n, field);
        if ok(v) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("INFO memory {field} never got there");
}

/// Every command but a large plain `SET` is buffered whole before it runs, so the door's memory
/// was bounded only by `max_connections` × `max_command` (1 TiB at the defaults). Now all RESP
/// connections together hold at most `[resp] input_memory` beyond their first 64 KiB: the
/// connection that would go past it gets an error and is closed, the others go on, and the room
/// comes back when a command is done.
#[test]
fn input_buffers_are_bounded_across_the_node() {
    let dir = common::temp_dir("resp-input");
    let cfg = dir.join("kvpool.toml");
    std::fs::write(&cfg, "[resp]\ninput_memory = \"4MiB\"\n").unwrap();
    let n = resp_node("64MiB", &["--config", cfg.to_str().unwrap()]);
    let big = value(11, 3 << 20);
    let mset = |key: &[u8]| cmd(&[b"MSET", key, &big]);

    // A sends the first MiB of a 3 MiB MSET and stalls: its buffer is charged for the command.
    let mut a = connect(&n);
    let a_cmd = mset(b"ka");
    a.write_all(&a_cmd[..1 << 20]).unwrap();
    let held = wait_info(&n, "kvpool_resp_input_bytes", |v| v >= 2 << 20);
    assert!(held <= 4 << 20, "held {held}");

    // B's MSET of the same size does not fit beside it: an error, then the connection closes.
    let mut b = connect(&n);
    let _ = b.write_all(&mset(b"kb")); // the node may close before reading it all
    let l = line(&mut b);
    assert!(
        l.starts_with(
            "-ERR kvpool: the node's RESP input buffers are full ([resp] input_memory = 4194304)"
        ),
        "{l}"
    );
    let mut rest = Vec::new();
    let _ = b.read_to_end(&mut rest);
    assert!(rest.is_empty(), "B closed after its error");

    // Small commands on other connections need no charged room and go on meanwhile.
    let mut c = connect(&n);
    expect(&mut c, &[b"SET", b"small", b"v"], b"+OK\r\n");

    // A finishes; its room comes back once its command has run. Its last bytes come after a
    // pause, so the node reads the rest of the value short of them first: a buffer that has the
    // room for what the command still needs is not grown (nor refused) to read ahead.
    let tail = a_cmd.len() - 10;
    a.write_all(&a_cmd[1 << 20..tail]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    a.write_all(&a_cmd[tail..]).unwrap();
    assert_eq!(line(&mut a), "+OK\r\n");
    wait_info(&n, "kvpool_resp_input_bytes", |v| v == 0);

    // Now B's command fits, and both values are whole.
    let mut b = connect(&n);
    expect(&mut b, &[b"MSET", b"kb", &big], b"+OK\r\n");
    let mut want = format!("${}\r\n", big.len()).into_bytes();
    want.extend_from_slice(&big);
    want.extend_from_slice(b"\r\n");
    expect(&mut c, &[b"GET", b"ka"], &want);
    expect(&mut c, &[b"GET", b"kb"], &want);
    assert!(n
        .scrape()
        .lines()
        .any(|l| l == "kvpool_resp_input_refusals_total 1"));
}
