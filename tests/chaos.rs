//! Chaos: a three-node cluster of real daemons on loopback under a mixed load (put, get,
//! batch_get_into, save_prefix/load_prefix, remove) from same-host and TCP clients, while a
//! node is killed with SIGKILL and restarted on its data directory, a node is frozen with
//! SIGSTOP and resumed, a node's traffic goes through a proxy that first delays it and then
//! blackholes it, slowloris connections hold half a frame, and one address holds as many
//! connections as the per-peer cap admits.
//!
//! Every value is self-describing: its first 8 bytes are its version, the next 8 a hash of
//! (key, version), the rest derived from that hash; its length is derived from (key, version)
//! too. Every read is checked whole: the bytes are exactly a value written for that key (a
//! version some writer issued), or a miss, or an error; never anything else. A prefix load
//! counts a leading run of blocks, each of which must be a valid block. After the chaos the
//! cluster must serve again: every node up, every daemon still running, a round of puts and
//! gets through every node succeeding byte for byte.
//!
//! Every loop is bounded (by the load's end, by per-call timeouts, by a count); nothing asserts
//! on how long anything took.
#![cfg(not(loom))]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{cfg, serving};
use common::{value, Node};
use kvpool::protocol::{Exchange, FramePrefix, Op, PROTOCOL_VERSION};
use kvpool_client::{Client, ClientConfig, ClientError, Prefix, SameHost};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// Heartbeats every 100 ms, a peer down after 1 s of silence: the kill, the stop and the
/// partition are each noticed within the load.
const HEARTBEAT: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "1000"];
const MEMORY: &str = "64MiB";
/// The load runs until the chaos is over and this long after, at most `LOAD_MAX` in all.
const LOAD_AFTER: Duration = Duration::from_secs(2);
const LOAD_MAX: Duration = Duration::from_secs(90);
/// Keys of the load; their values' lengths are drawn from `SIZES`.
const KEYS: usize = 256;
/// Small values, values around the same-host put threshold (16 KiB), bulk ones (>= 256 KiB).
const SIZES: [usize; 8] = [200, 1024, 4096, 4096, 17_000, 40_000, 100_000, 300_000];
const MAX_LEN: usize = 300_000;
/// Prefix chains: `CHAINS` of `BLOCKS` blocks of `BLOCK` bytes each.
const CHAINS: usize = 16;
const BLOCKS: usize = 8;
const BLOCK: usize = 4096;
/// A call that has not returned this long after the client's own timeout (5 s) is a hang.
const STUCK: Duration = Duration::from_secs(60);
/// `[listen] max_connections_per_peer`'s default.
const PER_PEER_CAP: usize = 256;

fn key(i: usize) -> Vec<u8> {
    format!("chaos-k-{i:04}").into_bytes()
}

fn block_key(chain: usize, b: usize) -> Vec<u8> {
    format!("chaos-p-{chain:02}-{b}").into_bytes()
}

fn fnv(key: &[u8], version: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in key.iter().chain(&version.to_le_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Value `version` of `key`, `len` bytes (`None`: the length its (key, version) picks).
fn val(key: &[u8], version: u64, len: Option<usize>) -> Vec<u8> {
    let h = fnv(key, version);
    let len = len.unwrap_or(SIZES[(h >> 7) as usize % SIZES.len()]);
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&h.to_le_bytes());
    v.extend_from_slice(&value(h, len - 16));
    v
}

/// The invariant: `got` is exactly a value some writer issued for `key` (versions 1..=issued).
fn check(key: &[u8], got: &[u8], issued: u64, len: Option<usize>) -> Result<(), String> {
    let k = String::from_utf8_lossy(key);
    if got.len() < 16 {
        return Err(format!("{k}: {} bytes, shorter than any value", got.len()));
    }
    let version = u64::from_le_bytes(got[..8].try_into().unwrap());
    if version == 0 || version > issued {
        return Err(format!(
            "{k}: version {version} never written (issued up to {issued}), {} bytes",
            got.len()
        ));
    }
    let want = val(key, version, len);
    if want.len() != got.len() {
        return Err(format!(
            "{k}: version {version} is {} bytes, read {}",
            want.len(),
            got.len()
        ));
    }
    if want != got {
        let at = want.iter().zip(got).position(|(a, b)| a != b).unwrap();
        return Err(format!(
            "{k}: version {version}, {} bytes, differs from byte {at}",
            got.len()
        ));
    }
    Ok(())
}

/// What the load saw.
#[derive(Default)]
struct Counts {
    reads: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    wrong: AtomicU64,
    prefix_loads: AtomicU64,
    prefix_blocks: AtomicU64,
    writes: AtomicU64,
    write_errors: AtomicU64,
    removes: AtomicU64,
    stuck: AtomicU64,
    /// Errors by kind (reads and writes).
    kinds: Mutex<BTreeMap<String, u64>>,
    /// The first wrong reads, described.
    wrong_seen: Mutex<Vec<String>>,
}

impl Counts {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    fn error(&self, e: &ClientError) {
        let kind = match e {
            ClientError::Server { code, .. } => format!("{code:?}"),
            ClientError::Io(_) => "io".into(),
            ClientError::Timeout => "timeout".into(),
            ClientError::Tls(_) => "tls".into(),
            ClientError::Protocol(_) => "protocol".into(),
            ClientError::Checksum => "checksum".into(),
            ClientError::BufferTooSmall { .. } => "buffer-too-small".into(),
            other => format!("{other}"),
        };
        *self.kinds.lock().unwrap().entry(kind).or_default() += 1;
    }

    fn wrong(&self, what: String) {
        Counts::add(&self.wrong, 1);
        let mut seen = self.wrong_seen.lock().unwrap();
        if seen.len() < 20 {
            seen.push(what);
        }
    }
}

/// Versions issued so far, per key and per prefix block.
struct Versions {
    keys: Vec<AtomicU64>,
    blocks: Vec<AtomicU64>,
}

impl Versions {
    fn new() -> Versions {
        Versions {
            keys: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
            blocks: (0..CHAINS * BLOCKS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

/// A small deterministic generator per worker.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// One client's share of the load, until `stop` is set or `end` passes.
async fn worker(
    id: u64,
    c: Client,
    (stop, end): (Arc<AtomicBool>, Instant),
    v: Arc<Versions>,
    n: Arc<Counts>,
) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (id + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
    let mut bufs = vec![vec![0u8; MAX_LEN]; 8];
    let mut blocks = vec![vec![0u8; BLOCK]; BLOCKS];
    while !stop.load(Ordering::Relaxed) && Instant::now() < end {
        let op = rng.below(100);
        let step = async {
            match op {
                0..=29 => {
                    let i = rng.below(KEYS);
                    let version = v.keys[i].fetch_add(1, Ordering::Relaxed) + 1;
                    match c.put(&key(i), &val(&key(i), version, None)).await {
                        Ok(()) => Counts::add(&n.writes, 1),
                        Err(e) => {
                            Counts::add(&n.write_errors, 1);
                            n.error(&e);
                        }
                    }
                }
                30..=54 => {
                    let i = rng.below(KEYS);
                    Counts::add(&n.reads, 1);
                    match c.get(&key(i)).await {
                        Ok(Some(got)) => {
                            let issued = v.keys[i].load(Ordering::Relaxed);
                            match check(&key(i), &got, issued, None) {
                                Ok(()) => Counts::add(&n.hits, 1),
                                Err(w) => n.wrong(format!("get {w}")),
                            }
                        }
                        Ok(None) => Counts::add(&n.misses, 1),
                        Err(e) => {
                            Counts::add(&n.errors, 1);
                            n.error(&e);
                        }
                    }
                }
                55..=69 => {
                    let ids: Vec<usize> = (0..8).map(|_| rng.below(KEYS)).collect();
                    let keys: Vec<Vec<u8>> = ids.iter().map(|&i| key(i)).collect();
                    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    Counts::add(&n.reads, 8);
                    match c.batch_get_into(&refs, &mut dsts).await {
                        Ok(got) => {
                            for (j, g) in got.iter().enumerate() {
                                let Some(len) = *g else {
                                    Counts::add(&n.misses, 1);
                                    continue;
                                };
                                let issued = v.keys[ids[j]].load(Ordering::Relaxed);
                                match check(&keys[j], &bufs[j][..len], issued, None) {
                                    Ok(()) => Counts::add(&n.hits, 1),
                                    Err(w) => n.wrong(format!("batch_get_into {w}")),
                                }
                            }
                        }
                        Err(e) => {
                            Counts::add(&n.errors, 8);
                            n.error(&e);
                        }
                    }
                }
                70..=79 => {
                    let chain = rng.below(CHAINS);
                    let len = 1 + rng.below(BLOCKS);
                    let keys: Vec<Vec<u8>> = (0..len).map(|b| block_key(chain, b)).collect();
                    let vals: Vec<Vec<u8>> = (0..len)
                        .map(|b| {
                            let version =
                                v.blocks[chain * BLOCKS + b].fetch_add(1, Ordering::Relaxed) + 1;
                            val(&keys[b], version, Some(BLOCK))
                        })
                        .collect();
                    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                    let vrefs: Vec<&[u8]> = vals.iter().map(|b| &b[..]).collect();
                    match c.save_prefix(Prefix::Keys(&refs), &vrefs).await {
                        Ok(_) => Counts::add(&n.writes, 1),
                        Err(e) => {
                            Counts::add(&n.write_errors, 1);
                            n.error(&e);
                        }
                    }
                }
                80..=89 => {
                    let chain = rng.below(CHAINS);
                    let keys: Vec<Vec<u8>> = (0..BLOCKS).map(|b| block_key(chain, b)).collect();
                    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                    let mut dsts: Vec<&mut [u8]> = blocks.iter_mut().map(|b| &mut b[..]).collect();
                    Counts::add(&n.prefix_loads, 1);
                    match c.load_prefix(Prefix::Keys(&refs), &mut dsts).await {
                        Ok(loaded) => {
                            for b in 0..loaded.min(BLOCKS) {
                                let issued = v.blocks[chain * BLOCKS + b].load(Ordering::Relaxed);
                                match check(&keys[b], &blocks[b], issued, Some(BLOCK)) {
                                    Ok(()) => Counts::add(&n.prefix_blocks, 1),
                                    Err(w) => n.wrong(format!("load_prefix block {b}: {w}")),
                                }
                            }
                            if loaded > BLOCKS {
                                n.wrong(format!("load_prefix loaded {loaded} of {BLOCKS}"));
                            }
                        }
                        Err(e) => {
                            Counts::add(&n.errors, 1);
                            n.error(&e);
                        }
                    }
                }
                _ => match c.remove(&key(rng.below(KEYS))).await {
                    Ok(_) => Counts::add(&n.removes, 1),
                    Err(e) => {
                        Counts::add(&n.write_errors, 1);
                        n.error(&e);
                    }
                },
            }
        };
        if tokio::time::timeout(STUCK, step).await.is_err() {
            Counts::add(&n.stuck, 1);
        }
    }
}

/// How the proxy in front of a node treats its traffic.
const PASS: u8 = 0;
const SLOW: u8 = 1;
const BLACKHOLE: u8 = 2;

/// A TCP proxy: accepts on its own port and forwards to `target` (set once the node behind it
/// has started), passing bytes through, delaying each chunk, or holding them (a partition:
/// connections stay open, nothing arrives; held bytes go on once it heals, as TCP would
/// retransmit them). Its connections end when the returned task is aborted.
struct Proxy {
    addr: SocketAddr,
    target: Arc<Mutex<Option<String>>>,
    mode: Arc<AtomicU8>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start() -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target: Arc<Mutex<Option<String>>> = Arc::default();
        let mode = Arc::new(AtomicU8::new(PASS));
        let (t, m) = (target.clone(), mode.clone());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                while conns.try_join_next().is_some() {}
                let (t, m) = (t.clone(), m.clone());
                conns.spawn(async move {
                    while m.load(Ordering::Relaxed) == BLACKHOLE {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let Some(to) = t.lock().unwrap().clone() else {
                        return;
                    };
                    let Ok(outbound) = TcpStream::connect(to).await else {
                        return;
                    };
                    let _ = (inbound.set_nodelay(true), outbound.set_nodelay(true));
                    let (ir, iw) = inbound.into_split();
                    let (or, ow) = outbound.into_split();
                    tokio::join!(pump(ir, ow, m.clone()), pump(or, iw, m));
                });
            }
        });
        Proxy {
            addr,
            target,
            mode,
            task,
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::Relaxed);
    }
}

/// Copies `r` to `w` chunk by chunk as the proxy's mode says, until either side closes.
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mode: Arc<AtomicU8>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        loop {
            match mode.load(Ordering::Relaxed) {
                PASS => break,
                SLOW => {
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        if w.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = w.shutdown().await;
}

/// A `Hello` frame, as a client that presents no token sends it.
fn hello_frame() -> Vec<u8> {
    let hello = Op::Hello {
        version: PROTOCOL_VERSION,
        token: String::new(),
        client: "chaos".into(),
    };
    Exchange::new().request(hello).frame(&[])
}

/// Connects to `to` from loopback address `from` (the node counts connections per address).
async fn connect_from(from: &str, to: &str) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(format!("{from}:0").parse().unwrap())?;
    s.connect(to.parse().unwrap()).await
}

/// Whether the node has closed `s` (end of stream or reset); reads and discards what it sent.
fn closed(s: &TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.try_read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Slowloris, from 127.0.0.3: to each address, connections that send 8 bytes of a frame's
/// 16-byte prefix and nothing more, and connections that greet properly and then send a prefix
/// and half the header it announces. Returns them, to be held: (not greeted, greeted).
async fn slowloris(addrs: &[String]) -> (Vec<TcpStream>, Vec<TcpStream>) {
    let mut held = (Vec::new(), Vec::new());
    for a in addrs {
        for i in 0..16 {
            let Ok(mut s) = connect_from("127.0.0.3", a).await else {
                continue;
            };
            let half = if i % 2 == 0 {
                FramePrefix {
                    header_len: 64,
                    payload_len: 0,
                }
                .encode()[..8]
                    .to_vec()
            } else {
                let mut f = hello_frame();
                f.extend_from_slice(
                    &FramePrefix {
                        header_len: 64,
                        payload_len: 1 << 20,
                    }
                    .encode(),
                );
                f.extend_from_slice(&[0u8; 32]);
                f
            };
            if s.write_all(&half).await.is_ok() {
                if i % 2 == 0 {
                    held.0.push(s);
                } else {
                    held.1.push(s);
                }
            }
        }
    }
    held
}

/// From 127.0.0.2: greets `to` on `PER_PEER_CAP + 16` connections and keeps them. Returns them
/// once each has been answered or closed (at most 30 s), with how many the node kept.
async fn hold_connections(to: &str) -> (Vec<TcpStream>, usize) {
    let hello = hello_frame();
    let mut conns = Vec::new();
    for _ in 0..PER_PEER_CAP + 16 {
        let Ok(mut s) = connect_from("127.0.0.2", to).await else {
            continue;
        };
        if s.write_all(&hello).await.is_ok() {
            conns.push(s);
        }
    }
    // Answered (the reply to Hello arrived) or closed (over the cap).
    let mut answered: Vec<Option<bool>> = vec![None; conns.len()];
    let t = Instant::now();
    while answered.iter().any(Option::is_none) && t.elapsed() < Duration::from_secs(30) {
        for (s, a) in conns.iter().zip(answered.iter_mut()) {
            if a.is_some() {
                continue;
            }
            let mut b = [0u8; 1];
            match s.try_read(&mut b) {
                Ok(0) => *a = Some(false),
                Ok(_) => *a = Some(true),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => *a = Some(false),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let kept = answered.iter().filter(|a| **a == Some(true)).count();
    (conns, kept)
}

/// Sends `sig` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid}");
}

/// Resumes a stopped process when dropped, also when the test fails while it is stopped.
struct Cont(u32);

impl Drop for Cont {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT".to_string(), self.0.to_string()])
            .status();
    }
}

/// Node `id`'s command line after `--data-dir` and `--memory`.
fn node_args(id: u32, seed: Option<&Node>, advertise: Option<&SocketAddr>) -> Vec<String> {
    let mut args: Vec<String> = vec!["--node-id".into(), id.to_string()];
    if let Some(s) = seed {
        args.extend([
            "--peer".into(),
            s.tcp.clone(),
            "--cluster-secret-file".into(),
            s.secret_file().to_str().unwrap().into(),
        ]);
    }
    if let Some(a) = advertise {
        args.extend(["--advertise".into(), a.to_string()]);
    }
    args.extend(HEARTBEAT.iter().map(|s| s.to_string()));
    args
}

fn start_node(id: u32, seed: Option<&Node>, advertise: Option<&SocketAddr>) -> Node {
    let args = node_args(id, seed, advertise);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Node::start(MEMORY, &refs)
}

/// Polls `c`'s view until `want` holds or 60 s have passed; returns whether it held.
async fn view_reaches(c: &Client, want: impl Fn(&kvpool::placement::ClusterView) -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        if let Ok(v) = c.view().await {
            if want(&v) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn client(url: &str, same_host: SameHost) -> Client {
    Client::connect(url, cfg(same_host)).await.unwrap()
}

/// The chaos, in turn: kill -9 node 2 and restart it on its directory; freeze node 0 for 3 s;
/// slow node 1's proxy for 2 s, then blackhole it for 3 s. Returns what it saw, for the report.
async fn chaos(nodes: &mut [Node], proxy: &Proxy, seed_tcp: &str) -> String {
    let mut seen = Vec::new();
    let observer = client(&format!("tcp://{seed_tcp}"), SameHost::Off).await;

    tokio::time::sleep(Duration::from_secs(2)).await;
    let old = &mut nodes[2];
    let addrs = [old.tcp.clone(), old.quic.clone(), old.metrics.clone()];
    let dir = old.dir.clone();
    tokio::task::block_in_place(|| old.kill());
    let down = view_reaches(&observer, |v| serving(v) == 2).await;
    seen.push(format!("node 2 killed (seen down: {down})"));
    let args = node_args(2, Some(&nodes[0]), None);
    let restarted = tokio::task::block_in_place(|| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Node::start_in(
            dir,
            MEMORY,
            &refs,
            &[addrs[0].as_str(), addrs[1].as_str(), addrs[2].as_str()],
        )
    });
    nodes[2] = restarted;
    let back = view_reaches(&observer, |v| serving(v) == 3).await;
    assert!(back, "node 2 never came back after its restart");
    seen.push("restarted on its data dir".into());

    tokio::time::sleep(Duration::from_secs(1)).await;
    let pid = nodes[0].pid();
    signal(pid, "STOP");
    let resume = Cont(pid);
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(resume);
    seen.push("node 0 stopped 3 s".into());
    let back = view_reaches(&observer, |v| serving(v) == 3).await;
    assert!(
        back,
        "the cluster never saw 3 nodes serving after node 0 resumed"
    );

    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.set(SLOW);
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.set(BLACKHOLE);
    let cut = view_reaches(&observer, |v| serving(v) < 3).await;
    // Bounded by `view_reaches`; the partition lasts at least 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set(PASS);
    seen.push(format!("node 1 slowed 2 s, blackholed (seen down: {cut})"));
    seen.join(", ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_kills_restarts_stops_partitions_and_stalled_clients_every_read_is_a_written_value_or_a_miss(
) {
    let proxy = Proxy::start().await;
    let n0 = start_node(0, None, None);
    let n1 = start_node(1, Some(&n0), Some(&proxy.addr));
    *proxy.target.lock().unwrap() = Some(n1.tcp.clone());
    let n2 = start_node(2, Some(&n0), None);
    let seed_tcp = n0.tcp.clone();
    let n1_direct = n1.tcp.clone();
    let mut nodes = vec![n0, n1, n2];
    let observer = client(&nodes[0].tcp_url(), SameHost::Off).await;
    assert!(
        view_reaches(&observer, |v| serving(v) == 3).await,
        "3 nodes serving"
    );

    // Same-host clients through nodes 0 and 2; TCP clients through node 0 and the proxy.
    let proxied = format!("tcp://{}", proxy.addr);
    let clients = [
        client(&nodes[0].tcp_url(), SameHost::Auto).await,
        client(&nodes[2].tcp_url(), SameHost::Auto).await,
        client(&nodes[0].tcp_url(), SameHost::Off).await,
        client(&proxied, SameHost::Off).await,
    ];
    assert!(clients[0].is_local() && clients[1].is_local());
    assert!(!clients[2].is_local() && !clients[3].is_local());

    let versions = Arc::new(Versions::new());
    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let end = Instant::now() + LOAD_MAX;
    let workers: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            tokio::spawn(worker(
                i as u64,
                c.clone(),
                (stop.clone(), end),
                versions.clone(),
                counts.clone(),
            ))
        })
        .collect();

    // Stalled clients on every node's own port, and one address at the per-peer cap.
    let direct = [
        nodes[0].tcp.clone(),
        n1_direct.clone(),
        nodes[2].tcp.clone(),
    ];
    let stalled = slowloris(&direct).await;
    let (held, kept) = hold_connections(&n1_direct).await;

    let story = chaos(&mut nodes, &proxy, &seed_tcp).await;
    tokio::time::sleep(LOAD_AFTER).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let stalled_len = stalled.0.len() + stalled.1.len();
    let ungreeted_closed = stalled.0.iter().filter(|s| closed(s)).count();
    let greeted_closed = stalled.1.iter().filter(|s| closed(s)).count();
    let held_closed = held.iter().filter(|s| closed(s)).count();

    // Every daemon is still running (none panicked or exited).
    for (i, n) in nodes.iter_mut().enumerate() {
        let status = n.child.as_mut().unwrap().try_wait().unwrap();
        assert!(status.is_none(), "node {i} exited: {status:?}");
    }

    // The cluster serves again: every node seen serving, then through every node (its own
    // port and, for node 1, the proxy), with a same-host and a TCP client, puts and gets of
    // fresh keys succeed byte for byte (bounded retries while links to a healed node reopen).
    drop((held, stalled));
    assert!(
        view_reaches(&observer, |v| serving(v) == 3).await,
        "3 nodes serving after the chaos: {:?}",
        observer.view().await
    );
    let mut urls: Vec<String> = nodes.iter().map(Node::tcp_url).collect();
    urls.push(proxied);
    let mut final_ok = 0;
    for (u, url) in urls.iter().enumerate() {
        for same_host in [SameHost::Auto, SameHost::Off] {
            let c = Client::connect(
                url,
                ClientConfig {
                    timeout: Duration::from_secs(10),
                    ..cfg(same_host)
                },
            )
            .await
            .unwrap();
            for i in 0..20u64 {
                let k = format!("final-{u}-{same_host:?}-{i}").into_bytes();
                let want = val(&k, 1, None);
                let mut tries = 0;
                let got = loop {
                    tries += 1;
                    let r = match c.put(&k, &want).await {
                        Ok(()) => c.get(&k).await,
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(got) => break got,
                        Err(e) if tries < 20 => {
                            println!("final round via {url}: {e}; again");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        Err(e) => panic!("final round via {url}: {e}"),
                    }
                };
                assert!(got.as_deref() == Some(&want[..]), "final key {k:?}");
                final_ok += 1;
            }
        }
    }

    let n = &counts;
    let g = Counts::get;
    println!(
        "chaos: reads {} hits {} misses {} errors {} wrong {} | prefix loads {} valid blocks {} | \
         writes {} write errors {} removes {} | stuck {} | errors by kind {:?} | {} | \
         slowloris {} held (closed by the nodes: {} not greeted, {} greeted) | per-peer holder: {} answered of {} opened, \
         {} closed by the end | final round {final_ok} puts+gets ok",
        g(&n.reads),
        g(&n.hits),
        g(&n.misses),
        g(&n.errors),
        g(&n.wrong),
        g(&n.prefix_loads),
        g(&n.prefix_blocks),
        g(&n.writes),
        g(&n.write_errors),
        g(&n.removes),
        g(&n.stuck),
        n.kinds.lock().unwrap(),
        story,
        stalled_len,
        ungreeted_closed,
        greeted_closed,
        kept,
        PER_PEER_CAP + 16,
        held_closed,
    );
    assert_eq!(
        g(&n.wrong),
        0,
        "reads returned bytes never written for their key: {:?}",
        n.wrong_seen.lock().unwrap()
    );
    assert_eq!(g(&n.stuck), 0, "calls that never returned");
    assert_eq!(
        g(&n.hits) + g(&n.misses) + g(&n.errors),
        g(&n.reads),
        "every read accounted for"
    );
    assert!(
        g(&n.hits) > 0,
        "the load read values back: the test checks something"
    );
    assert!(g(&n.prefix_blocks) > 0, "prefix loads found blocks");
    assert!(kept <= PER_PEER_CAP, "one address held {kept} connections");
    proxy.task.abort();
}
